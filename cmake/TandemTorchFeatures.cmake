# Detects what the LibTorch we build against offers: its version, CUDA, NCCL, Gloo headers.
# Version-specific C++ lives in src/compat/ only; this file only sets definitions.
include(${CMAKE_CURRENT_LIST_DIR}/TandemTorchLibraries.cmake)
set(TANDEM_TORCH_VERSION "${Torch_VERSION}")
if(NOT TANDEM_TORCH_VERSION)
  set(TANDEM_TORCH_VERSION "unknown")
endif()
set(TANDEM_WITH_CUDA OFF)
if(TORCH_CUDA_LIBRARIES OR CUDA_FOUND)
  set(TANDEM_WITH_CUDA ON)
endif()
set(TANDEM_WITH_NCCL OFF)
if(TANDEM_WITH_CUDA)
  foreach(dir ${TORCH_INCLUDE_DIRS})
    if(EXISTS "${dir}/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp")
      set(TANDEM_WITH_NCCL ON)
    endif()
  endforeach()
endif()
# Gloo headers: c10d's ProcessGroupGloo.hpp includes them. Debian ships them in libgloo-dev.
# Note [Gloo headers for a wheel]: PyPI's torch wheel ships none, but its libtorch_cpu exports
# Gloo's code. tandem calls Gloo only through c10d functions compiled into LibTorch and builds no
# Gloo object itself (it holds Gloo devices and contexts by pointer only), so the headers serve
# as declarations: Debian's (2022) are enough for the wheel's ProcessGroupGloo.hpp, which leaves
# out its newer store methods when Gloo does not define GLOO_STORE_HAS_STORE_V2.
find_path(TANDEM_GLOO_INCLUDE gloo/algorithm.h HINTS ${TORCH_INCLUDE_DIRS})
if(NOT TANDEM_GLOO_INCLUDE)
  message(FATAL_ERROR "Gloo headers not found: install libgloo-dev (Debian) or use a LibTorch that ships gloo/ in its include folder")
endif()
message(STATUS "tandem: LibTorch ${TANDEM_TORCH_VERSION}, CUDA ${TANDEM_WITH_CUDA}, NCCL ${TANDEM_WITH_NCCL}")
