# All third-party dependencies, found the standard way.

# ccache, when present, for fast rebuilds.
find_program(EO_CCACHE ccache)
if(EO_CCACHE)
  set(CMAKE_CXX_COMPILER_LAUNCHER ${EO_CCACHE})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${EO_CCACHE})
endif()

# libtorch: Torch_DIR / CMAKE_PREFIX_PATH win; else the prefix of the Python torch
# (the project venv first, then python3 on PATH).
if(NOT Torch_DIR AND NOT DEFINED ENV{Torch_DIR})
  find_package(Torch QUIET CONFIG)
  if(NOT Torch_FOUND)
    foreach(py "${CMAKE_SOURCE_DIR}/.venv/bin/python" python3)
      execute_process(COMMAND ${py} -c "import torch;print(torch.utils.cmake_prefix_path)"
                      OUTPUT_VARIABLE _torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
                      RESULT_VARIABLE _rc ERROR_QUIET)
      if(_rc EQUAL 0 AND _torch_prefix)
        list(APPEND CMAKE_PREFIX_PATH "${_torch_prefix}")
        message(STATUS "eo-ddp: libtorch from ${py}: ${_torch_prefix}")
        break()
      endif()
    endforeach()
  endif()
endif()

# CUDA + NCCL follow the libtorch build (a CUDA libtorch ships libc10_cuda) unless forced.
if(EO_WITH_CUDA STREQUAL "AUTO")
  set(EO_WITH_CUDA OFF)
  foreach(_p ${CMAKE_PREFIX_PATH} ${Torch_DIR} $ENV{Torch_DIR})
    foreach(_lib "${_p}/../../lib" "${_p}/../../../lib" "${_p}/../lib")
      if(EXISTS "${_lib}/libc10_cuda.so")
        set(EO_WITH_CUDA ON)
      endif()
    endforeach()
  endforeach()
  message(STATUS "eo-ddp: CUDA from libtorch: ${EO_WITH_CUDA} (force with -DEO_WITH_CUDA=ON|OFF)")
endif()
if(EO_WITH_CUDA)
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
endif()

find_package(Torch REQUIRED CONFIG)
# TORCH_LIBRARIES carries the flags for its ABI; keep its CXX flags too.
set(CMAKE_CXX_FLAGS "${CMAKE_CXX_FLAGS} ${TORCH_CXX_FLAGS}")

find_package(MPI REQUIRED COMPONENTS CXX)
find_package(PkgConfig REQUIRED)
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)
find_package(yaml-cpp REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(Threads REQUIRED)

if(EO_WITH_CUDA)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS $ENV{NCCL_HOME}/include)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS $ENV{NCCL_HOME}/lib)
  if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
    message(FATAL_ERROR "EO_WITH_CUDA is on but NCCL was not found (set NCCL_HOME)")
  endif()
  add_compile_definitions(EO_WITH_CUDA=1)
  add_library(eo_nccl INTERFACE)
  target_include_directories(eo_nccl INTERFACE ${NCCL_INCLUDE_DIR})
  target_link_libraries(eo_nccl INTERFACE ${NCCL_LIBRARY} CUDA::cudart)
endif()

if(EO_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()

# yaml-cpp's imported target changed name across versions (0.7: yaml-cpp, 0.8: yaml-cpp::yaml-cpp).
if(TARGET yaml-cpp::yaml-cpp)
  set(EO_YAML_TARGET yaml-cpp::yaml-cpp)
else()
  set(EO_YAML_TARGET yaml-cpp)
endif()
