# All third-party dependencies, found the standard way.

# ccache, when present, for fast rebuilds. The sloppiness lets it cache the translation units that
# use the precompiled <ATen/ATen.h> (cmake/EoCompileTime.cmake), as ccache's manual asks. Paths inside
# the source folder are hashed relative to it, whatever base_dir the machine's ccache configuration
# names: a copy of the tree elsewhere (CI's fresh clone, another worktree, scripts/pip-check's) reuses
# these objects.
find_program(EO_CCACHE ccache)
if(EO_CCACHE)
  set(_eo_ccache_env CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
                     CCACHE_BASEDIR=${PROJECT_SOURCE_DIR} CCACHE_NOHASHDIR=1)
  set(CMAKE_CXX_COMPILER_LAUNCHER ${CMAKE_COMMAND} -E env ${_eo_ccache_env} ${EO_CCACHE})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${CMAKE_COMMAND} -E env ${_eo_ccache_env} ${EO_CCACHE})
endif()

# The CUDA architectures the user asked for (-DCMAKE_CUDA_ARCHITECTURES, else the environment's
# CUDAARCHS), read before anything enables CUDA: libtorch's CMake (found below) sets the variable to
# OFF and enable_language(CUDA) caches nvcc's own default (sm_75), either of which would hide the
# choice. Empty: every card eo-ddp serves (EO_CUDA_ARCHS below).
set(_eo_user_archs "${CMAKE_CUDA_ARCHITECTURES}")
if(NOT _eo_user_archs AND DEFINED ENV{CUDAARCHS})
  set(_eo_user_archs "$ENV{CUDAARCHS}")
endif()

# EO_DDP_PYTHON: the Python environment eo-ddp is built for: its torch is the libtorch linked, and
# the built binary runs tools/*.py with it. A pip install (scikit-build-core) builds for the
# interpreter running pip; scripts/quickstart passes the environment it was pointed at.
if(SKBUILD AND NOT EO_DDP_PYTHON)
  set(EO_DDP_PYTHON "${Python_EXECUTABLE}")
endif()
set(EO_DDP_PYTHON "${EO_DDP_PYTHON}" CACHE FILEPATH "Python whose torch eo-ddp links and whose tools it runs (empty: .venv, then python3)")

# libtorch: Torch_DIR / CMAKE_PREFIX_PATH win; else the prefix of the Python torch (EO_DDP_PYTHON's
# alone when it is set; else the project venv first, then python3 on PATH).
if(NOT Torch_DIR AND NOT DEFINED ENV{Torch_DIR})
  if(EO_DDP_PYTHON)
    set(_eo_pythons "${EO_DDP_PYTHON}")
  else()
    find_package(Torch QUIET CONFIG)
    set(_eo_pythons "${CMAKE_SOURCE_DIR}/.venv/bin/python" python3)
  endif()
  if(NOT Torch_FOUND)
    foreach(py ${_eo_pythons})
      execute_process(COMMAND ${py} -c "import torch;print(torch.utils.cmake_prefix_path)"
                      OUTPUT_VARIABLE _torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
                      RESULT_VARIABLE _rc ERROR_QUIET)
      if(_rc EQUAL 0 AND _torch_prefix)
        list(APPEND CMAKE_PREFIX_PATH "${_torch_prefix}")
        message(STATUS "eo-ddp: libtorch from ${py}: ${_torch_prefix}")
        break()
      elseif(EO_DDP_PYTHON)
        message(FATAL_ERROR "EO_DDP_PYTHON=${EO_DDP_PYTHON} cannot import torch: install torch into that "
                            "environment (pip install torch) or point EO_DDP_PYTHON at one that has it")
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
  # Machine code for every card the project serves: SASS for each of EO_CUDA_ARCHS that this nvcc
  # knows (T4 75, in fp16; A100 80, RTX 30xx / A-series 86, RTX 40xx 89, H100/H200 90, B200 100,
  # RTX 50xx 120) and PTX of the newest, so a card newer than all of them still JIT-compiles.
  # -DCMAKE_CUDA_ARCHITECTURES (e.g. 86, or native) or the environment's CUDAARCHS overrides it: a
  # build for one card is several times faster.
  set(EO_CUDA_ARCHS "75;80;86;89;90;100;120" CACHE STRING "CUDA architectures of the default build (SASS each, PTX of the last)")
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  if(NOT _eo_user_archs)
    execute_process(COMMAND ${CMAKE_CUDA_COMPILER} --list-gpu-arch OUTPUT_VARIABLE _eo_nvcc_archs ERROR_QUIET)
    set(_eo_archs "")
    foreach(_a ${EO_CUDA_ARCHS})
      if(_eo_nvcc_archs MATCHES "compute_${_a}[^0-9a-z]")
        list(APPEND _eo_archs ${_a}-real)
        set(_eo_newest ${_a})
      else()
        message(STATUS "eo-ddp: nvcc ${CMAKE_CUDA_COMPILER_VERSION} has no sm_${_a}: left out")
      endif()
    endforeach()
    list(APPEND _eo_archs ${_eo_newest}-virtual)
    set(CMAKE_CUDA_ARCHITECTURES "${_eo_archs}" CACHE STRING "CUDA architectures" FORCE)
    set(CMAKE_CUDA_ARCHITECTURES "${_eo_archs}")  # enable_language set a normal variable too (CMP0126)
  else()
    set(CMAKE_CUDA_ARCHITECTURES "${_eo_user_archs}" CACHE STRING "CUDA architectures" FORCE)
    set(CMAKE_CUDA_ARCHITECTURES "${_eo_user_archs}")
  endif()
  set(_eo_cuda_archs "${CMAKE_CUDA_ARCHITECTURES}")
  message(STATUS "eo-ddp: CUDA architectures: ${CMAKE_CUDA_ARCHITECTURES}")
endif()

find_package(Torch REQUIRED CONFIG)
if(EO_WITH_CUDA)
  # libtorch's CMake appends -gencode flags for TORCH_CUDA_ARCH_LIST, by default only the build
  # machine's GPU; CMAKE_CUDA_ARCHITECTURES alone decides what eo-ddp's kernels are built for.
  string(REGEX REPLACE "-gencode[ =]+arch=compute_[0-9a-z]+,code=[^ ]+" "" CMAKE_CUDA_FLAGS "${CMAKE_CUDA_FLAGS}")
  set(CMAKE_CUDA_ARCHITECTURES "${_eo_cuda_archs}")  # whatever libtorch's CMake set it to
  # CUTLASS (header-only) for the portable grouped GEMM of the experts: scripts/bootstrap unpacks
  # the nvidia-cutlass wheel's headers into third_party/cutlass/include.
  find_path(EO_CUTLASS_INCLUDE cutlass/gemm/device/gemm_grouped.h
            HINTS ${PROJECT_SOURCE_DIR}/third_party/cutlass/include $ENV{CUTLASS_HOME}/include)
  if(NOT EO_CUTLASS_INCLUDE)
    message(FATAL_ERROR "EO_WITH_CUDA is on but CUTLASS's headers were not found: run scripts/bootstrap "
                        "(it unpacks them into third_party/cutlass/include) or set CUTLASS_HOME")
  endif()
  message(STATUS "eo-ddp: CUTLASS headers: ${EO_CUTLASS_INCLUDE}")
endif()
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
