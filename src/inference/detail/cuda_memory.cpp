// Free memory of a CUDA device: cudaMemGetInfo on it (CUDA builds only).
#include "inference/detail/cuda_memory.h"

#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

namespace tandem::inference::detail {

uint64_t cuda_free_bytes(int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) return 0;
  return free;
}

}  // namespace tandem::inference::detail
