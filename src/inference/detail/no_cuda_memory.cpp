// Free memory of a CUDA device in a build without CUDA: there is none.
#include "inference/detail/cuda_memory.h"

namespace tandem::inference::detail {

uint64_t cuda_free_bytes(int) { return 0; }

}  // namespace tandem::inference::detail
