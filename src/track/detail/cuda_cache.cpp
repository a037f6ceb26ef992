// Emptying the CUDA caching allocator; compiled only when LibTorch has CUDA.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

namespace tandem::track::detail {

void empty_cuda_cache() {
  // device_count() is 0 without a visible GPU; emptyCache() then has nothing to do.
  if (c10::cuda::device_count() > 0) c10::cuda::CUDACachingAllocator::emptyCache();
}

}  // namespace tandem::track::detail
