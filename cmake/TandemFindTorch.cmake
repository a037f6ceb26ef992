# Before find_package(Torch): point every part TorchConfig.cmake looks up at the one LibTorch
# installation whose TorchConfig.cmake find_package(Torch) is about to load.
# Included by tandem's own build and by tandemConfig.cmake (find_package(tandem) users);
# TandemTorchLibraries.cmake, after find_package(Torch), checks the result.
#
# Note [Two LibTorch installations]: TorchConfig.cmake finds its Caffe2 package with
# find_package(Caffe2 PATHS <its folder>/../Caffe2) and its libraries with
# find_library(<name> PATHS <its prefix>/lib). PATHS are searched last, after the system's
# folders: with Debian's libtorch-dev installed, a LibTorch chosen by Torch_DIR, or by a
# CMAKE_PREFIX_PATH that names its share/cmake/Torch folder (a pip wheel, the libtorch zip),
# gets Debian's Caffe2 targets (libtorch_cpu.so.1.13, libc10.so.1.13) and libraries under its
# own headers; the programs then load two LibTorch versions and fail to link or crash.
# (A CMAKE_PREFIX_PATH of its share/cmake folder finds the right Caffe2, but still the
# system's libc10.so and libtorch.so.) So first find that TorchConfig.cmake by the search
# find_package(Torch) makes, and set Caffe2_DIR and those libraries to the ones beside it.

# The folder of the TorchConfig.cmake that find_package(Torch) will use, or "".
function(_tandem_torch_config_dir out)
  set(${out} "" PARENT_SCOPE)
  foreach(name TorchConfig.cmake torch-config.cmake)
    if(Torch_DIR AND EXISTS "${Torch_DIR}/${name}")
      get_filename_component(dir "${Torch_DIR}" REALPATH)
      set(${out} "${dir}" PARENT_SCOPE)
      return()
    endif()
  endforeach()
  # find_package's own search (Torch_ROOT, CMAKE_PREFIX_PATH, PATH, the system's folders), for
  # a package named Torch, stopping at its version file: TorchConfigVersion.cmake only sets
  # PACKAGE_VERSION* variables, in this function's scope.
  unset(_tandem_torch_probe_DIR CACHE)
  if(DEFINED Torch_ROOT)
    set(_tandem_torch_probe_ROOT "${Torch_ROOT}")
  elseif(DEFINED ENV{Torch_ROOT})
    set(_tandem_torch_probe_ROOT "$ENV{Torch_ROOT}")
  endif()
  find_package(_tandem_torch_probe NAMES Torch
               CONFIGS TorchConfigVersion.cmake torch-config-version.cmake QUIET)
  if(_tandem_torch_probe_DIR)
    get_filename_component(dir "${_tandem_torch_probe_DIR}" REALPATH)
    set(${out} "${dir}" PARENT_SCOPE)
  endif()
  unset(_tandem_torch_probe_DIR CACHE)
endfunction()

# The folder holding the installation's libraries: <prefix>/lib for <prefix>/share/cmake/Torch
# (pip wheel, libtorch zip), <libdir> for <libdir>/cmake/Torch (Debian, `make install`).
function(_tandem_torch_library_dir torch_dir out)
  get_filename_component(up2 "${torch_dir}/../.." ABSOLUTE)
  get_filename_component(up2_name "${up2}" NAME)
  if(up2_name STREQUAL "share")
    get_filename_component(libdir "${up2}/../lib" ABSOLUTE)
  else()
    set(libdir "${up2}")
  endif()
  if(DEFINED ENV{TORCH_INSTALL_PREFIX})  # TorchConfig.cmake honours it too
    set(libdir "$ENV{TORCH_INSTALL_PREFIX}/lib")
  endif()
  set(${out} "${libdir}" PARENT_SCOPE)
endfunction()

_tandem_torch_config_dir(_tandem_torch_dir)
if(_tandem_torch_dir)
  set(TANDEM_TORCH_CONFIG_DIR "${_tandem_torch_dir}")
  # Caffe2: the package beside TorchConfig.cmake, which is the one it asks for by PATHS.
  get_filename_component(_tandem_own_caffe2 "${_tandem_torch_dir}/../Caffe2" ABSOLUTE)
  if(EXISTS "${_tandem_own_caffe2}/Caffe2Config.cmake")
    set(_tandem_caffe2_was "")
    if(Caffe2_DIR)
      get_filename_component(_tandem_caffe2_was "${Caffe2_DIR}" REALPATH)
    endif()
    if(NOT _tandem_caffe2_was STREQUAL _tandem_own_caffe2)
      if(Caffe2_DIR)
        message(STATUS "tandem: Caffe2_DIR was ${Caffe2_DIR}, not the Caffe2 of the LibTorch in "
                       "${_tandem_torch_dir}: using ${_tandem_own_caffe2}")
      endif()
      set(Caffe2_DIR "${_tandem_own_caffe2}" CACHE PATH
          "The Caffe2 package of the LibTorch installation in Torch_DIR" FORCE)
      set(Caffe2_DIR "${_tandem_own_caffe2}")
    endif()
  endif()
  # Libraries TorchConfig.cmake finds by find_library: a cached result is not searched again.
  _tandem_torch_library_dir("${_tandem_torch_dir}" _tandem_torch_libdir)
  foreach(_tandem_pair TORCH_LIBRARY:torch c10_LIBRARY:c10 C10_CUDA_LIBRARY:c10_cuda
                       kineto_LIBRARY:kineto c10_xpu_LIBRARY:c10_xpu torch_xpu_LIBRARY:torch_xpu)
    string(REPLACE ":" ";" _tandem_pair "${_tandem_pair}")
    list(GET _tandem_pair 0 _tandem_var)
    list(GET _tandem_pair 1 _tandem_lib)
    set(_tandem_own
        "${_tandem_torch_libdir}/${CMAKE_SHARED_LIBRARY_PREFIX}${_tandem_lib}${CMAKE_SHARED_LIBRARY_SUFFIX}")
    if(EXISTS "${_tandem_own}" AND NOT "${${_tandem_var}}" STREQUAL "${_tandem_own}")
      if(${_tandem_var})
        message(STATUS "tandem: ${_tandem_var} was ${${_tandem_var}}, outside the LibTorch in "
                       "${_tandem_torch_dir}: using ${_tandem_own}")
      endif()
      set(${_tandem_var} "${_tandem_own}" CACHE FILEPATH "" FORCE)
    endif()
  endforeach()
  unset(_tandem_pair)
  unset(_tandem_var)
  unset(_tandem_lib)
  unset(_tandem_own)
  unset(_tandem_own_caffe2)
  unset(_tandem_caffe2_was)
  unset(_tandem_torch_libdir)
endif()
unset(_tandem_torch_dir)
