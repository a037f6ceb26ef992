# After find_package(Torch): check that every LibTorch part comes from one installation, and make
# the LibTorch found usable when another one is installed too.
# Included by tandem's own build and by tandemConfig.cmake (find_package(tandem) users).
# Note [Two LibTorch installations] (TandemFindTorch.cmake, included before find_package(Torch),
# points Caffe2_DIR and TorchConfig's libraries at the installation of its TorchConfig.cmake):
# a project that found Torch itself, or a search that went elsewhere, can still mix two
# installations. Refuse it here, naming both, instead of linking libraries of two versions.
function(_tandem_check_one_torch)
  get_filename_component(torch_dir "${Torch_DIR}" REALPATH)
  get_filename_component(torch_parent "${torch_dir}" DIRECTORY)
  set(caffe2_dir "")
  if(Caffe2_DIR)
    get_filename_component(caffe2_dir "${Caffe2_DIR}" REALPATH)
    get_filename_component(caffe2_parent "${caffe2_dir}" DIRECTORY)
    if(NOT caffe2_parent STREQUAL torch_parent)
      message(FATAL_ERROR
        "tandem: two LibTorch installations: Torch from ${torch_dir}, its Caffe2 targets (libtorch_cpu, "
        "libc10) from ${caffe2_dir}. Point both at one: -DCaffe2_DIR=${torch_parent}/Caffe2, or "
        "-DCMAKE_PREFIX_PATH=${torch_parent} (the share/cmake folder above Torch/); in a project of "
        "your own, include tandem's TandemFindTorch.cmake before find_package(Torch).")
    endif()
  endif()
  # The LibTorch libraries linked: TORCH_LIBRARIES' files and the imported targets' locations.
  set(files)
  foreach(lib ${TORCH_LIBRARIES})
    if(IS_ABSOLUTE "${lib}")
      list(APPEND files "${lib}")
    endif()
  endforeach()
  foreach(target torch torch_cpu torch_cuda c10 c10_cuda torch_xpu c10_xpu)
    if(TARGET ${target})
      get_target_property(type ${target} TYPE)
      if(NOT type STREQUAL "INTERFACE_LIBRARY")
        get_target_property(configs ${target} IMPORTED_CONFIGURATIONS)
        set(props IMPORTED_LOCATION)
        if(configs)
          foreach(config ${configs})
            string(TOUPPER "${config}" config)
            list(APPEND props IMPORTED_LOCATION_${config})
          endforeach()
        endif()
        foreach(prop ${props})
          get_target_property(location ${target} ${prop})
          if(location)
            list(APPEND files "${location}")
          endif()
        endforeach()
      endif()
    endif()
  endforeach()
  set(dirs)
  set(listing "")
  foreach(file ${files})
    get_filename_component(name "${file}" NAME)
    if(name MATCHES "^(lib)?(torch|c10|caffe2_nvrtc|kineto)[_.a-z0-9-]*$")
      get_filename_component(real "${file}" REALPATH)
      get_filename_component(dir "${real}" DIRECTORY)
      list(APPEND dirs "${dir}")
      string(APPEND listing "\n  ${file}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES dirs)
  list(LENGTH dirs count)
  if(count GREATER 1)
    string(REPLACE ";" " and " both "${dirs}")
    message(FATAL_ERROR
      "tandem: two LibTorch installations: the LibTorch of ${torch_dir} gets libraries from ${both}:"
      "${listing}\nUse one installation's: -DTorch_DIR=... with -DCMAKE_PREFIX_PATH=<its "
      "share/cmake folder>, or set the library variables above (TORCH_LIBRARY, c10_LIBRARY, ...) "
      "to its lib folder; in a project of your own, include tandem's TandemFindTorch.cmake "
      "before find_package(Torch).")
  endif()
  set(TANDEM_TORCH_LIBRARY_DIR "${dirs}" PARENT_SCOPE)
endfunction()
if(Torch_DIR)
  _tandem_check_one_torch()
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
