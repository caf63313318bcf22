# What a compile costs. Nearly every translation unit includes <ATen/ATen.h>; parsing it, and
# writing full debug information for everything it declares, was most of every compile (a test
# file: 14 s with -g, 7 s with -g1, 3 s with -g1 and the header precompiled). CI builds the
# project three times on two cores, so this decides whether CI fits its time.

# Line tables (-g1) are what backtraces and sanitizer reports need; -g's variable and type
# information doubles the compile. EO_DEBUG_INFO=full for a debugger session.
set(EO_DEBUG_INFO lines CACHE STRING "Debug information in RelWithDebInfo builds: lines (-g1) or full (-g)")
set_property(CACHE EO_DEBUG_INFO PROPERTY STRINGS lines full)
if(EO_DEBUG_INFO STREQUAL "lines")
  add_compile_options("$<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CONFIG:RelWithDebInfo>>:-g1>")  # after -g: wins
elseif(NOT EO_DEBUG_INFO STREQUAL "full")
  message(FATAL_ERROR "EO_DEBUG_INFO is '${EO_DEBUG_INFO}': use lines or full")
endif()

# <ATen/ATen.h> precompiled once per library (each library's definitions differ) and once for all
# test binaries (they share theirs): eo_precompile_aten(target) / eo_reuse_aten(target from).
option(EO_PCH "Precompile <ATen/ATen.h> (faster builds)" ON)
function(eo_precompile_aten target)
  if(EO_PCH)
    target_precompile_headers(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:<ATen/ATen.h$<ANGLE-R>>")
  endif()
endfunction()
function(eo_reuse_aten target from)
  if(EO_PCH)
    target_precompile_headers(${target} REUSE_FROM ${from})
  endif()
endfunction()
