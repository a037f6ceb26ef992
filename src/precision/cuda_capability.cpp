// The current GPU's compute capability, for the precision policy (CUDA builds only).
#include <ATen/cuda/CUDAContext.h>
#include <torch/cuda.h>

namespace tandem::precision::detail {

int cuda_compute_capability() {
  if (!torch::cuda::is_available()) return 0;
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  return prop->major * 10 + prop->minor;
}

}  // namespace tandem::precision::detail
