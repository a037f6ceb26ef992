# After find_package(Torch): make the LibTorch found usable when another one is installed too.
# Included by tandem's own build and by tandemConfig.cmake (find_package(tandem) users).
# Note [Two LibTorch installations]: TorchConfig.cmake looks for libtorch.so and libc10.so in the
# system's library folders before its own, so with Debian's libtorch-dev installed, a LibTorch
# chosen by CMAKE_PREFIX_PATH or Torch_DIR (a pip wheel, the libtorch zip) gets Debian's
# libraries under its own headers. Use the libraries of the installation whose headers we use.
if(TORCH_INSTALL_PREFIX)
  foreach(var TORCH_LIBRARY c10_LIBRARY)
    set(found "${${var}}")
    get_filename_component(name "${found}" NAME)
    set(own "${TORCH_INSTALL_PREFIX}/lib/${name}")
    if(found AND NOT found STREQUAL own AND EXISTS "${own}")
      message(STATUS "tandem: ${var} is ${found}, outside ${TORCH_INSTALL_PREFIX}: using ${own}")
      set(libs)
      foreach(lib ${TORCH_LIBRARIES})
        if(lib STREQUAL found)
          list(APPEND libs "${own}")
        else()
          list(APPEND libs "${lib}")
        endif()
      endforeach()
      set(TORCH_LIBRARIES ${libs})
      if(var STREQUAL "TORCH_LIBRARY" AND TARGET torch)
        set_property(TARGET torch PROPERTY IMPORTED_LOCATION "${own}")
      endif()
      set(${var} "${own}" CACHE FILEPATH "" FORCE)
    endif()
  endforeach()
endif()
# Note [A pip LibTorch's CUDA libraries]: the torch wheel finds NCCL, cuDNN, cuBLAS... in the
# nvidia-* wheels beside it (its RUNPATH, $ORIGIN/../../nvidia/*/lib). The linker, checking
# libtorch_cuda's own dependencies, would take the system's (the CUDA toolkit's older NCCL)
# first, so point it at the wheel's: what the programs load at run time.
get_filename_component(_tandem_torch_site "${TORCH_INSTALL_PREFIX}/.." ABSOLUTE)
file(GLOB _tandem_wheel_cuda_libs LIST_DIRECTORIES true "${_tandem_torch_site}/nvidia/*/lib")
if(_tandem_wheel_cuda_libs)
  string(JOIN ":" _tandem_wheel_cuda_path ${_tandem_wheel_cuda_libs})
  add_link_options("LINKER:-rpath-link,${_tandem_wheel_cuda_path}")
endif()
