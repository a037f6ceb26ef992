// Free memory of a CUDA device (0 in builds without CUDA).
#pragma once

#include <cstdint>

namespace tandem::inference::detail {

uint64_t cuda_free_bytes(int device);

}  // namespace tandem::inference::detail
