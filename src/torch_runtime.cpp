// What the base layer asks of LibTorch at run time: cpu_runtime()'s thread counts and oneDNN
// (the libraries a process maps: runtime.cpp), select_device's CUDA devices (state.h). Apart from
// runtime.cpp and state.cpp, which the launcher links without LibTorch (Note [A launcher without
// LibTorch]).
#include "tandem/runtime.h"
#include "tandem/error.h"
#include "tandem/state.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <string>

namespace tandem {

CpuRuntime cpu_runtime() {
  CpuRuntime r = cpu_libraries();
  r.intra_op_threads = at::get_num_threads();
  r.inter_op_threads = at::get_num_interop_threads();
  r.onednn = at::hasMKLDNN();
  return r;
}

c10::Device select_device(const ProcessState& state, bool force_cpu) {
  if (force_cpu || !torch::cuda::is_available()) return c10::Device(c10::kCPU);
  // CUDA renumbers the devices CUDA_VISIBLE_DEVICES leaves visible from 0, so local rank r uses
  // visible device r; more local ranks than visible devices is an error that says how many.
  int count = static_cast<int>(torch::cuda::device_count());
  if (state.local_rank >= count) {
    const char* vis = std::getenv("CUDA_VISIBLE_DEVICES");
    throw ::tandem::Refused(state.prefix() + " local rank " + std::to_string(state.local_rank) +
                                " has no GPU: " + std::to_string(count) + " visible" +
                                (vis ? std::string(" (CUDA_VISIBLE_DEVICES=") + vis + ")" : "") +
                                "; start at most " + std::to_string(count) +
                                " processes per machine or pass --cpu");
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(state.local_rank));
}


}  // namespace tandem
