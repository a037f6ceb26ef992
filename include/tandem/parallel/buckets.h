// Gradient bucket assignment: which parameters are reduced together, as pure logic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tandem::parallel {

/// One parameter as the bucketing sees it.
struct BucketParam {
  int64_t bytes = 0;  ///< numel * element size
  int group = 0;      ///< parameters of different groups (dtype, device) never share a bucket
};

/// Groups parameters (given in registration order) into buckets, as PyTorch's DDP does:
/// in reverse registration order (gradients of the last layers are ready first during
/// backward), closing a bucket as soon as its size reaches the cap; the first bucket has its
/// own, smaller cap so that communication starts early. Each bucket lists parameter indices in the order
/// they were added (reverse registration order).
std::vector<std::vector<size_t>> assign_buckets(const std::vector<BucketParam>& params,
                                                int64_t bucket_cap_bytes,
                                                int64_t first_bucket_cap_bytes);

}  // namespace tandem::parallel
