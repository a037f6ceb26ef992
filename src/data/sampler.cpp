// DistributedSampler (see sampler.h): the algorithm of torch.utils.data.DistributedSampler.
#include "tandem/data/sampler.h"
#include "tandem/error.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <stdexcept>
#include <string>

namespace tandem::data {

DistributedSampler::DistributedSampler(int64_t size, SamplerOptions options)
    : size_(size), options_(options) {
  if (size < 0) throw ::tandem::Refused("DistributedSampler: negative data set size");
  if (options.num_replicas() < 1 || options.rank() < 0 || options.rank() >= options.num_replicas())
    throw ::tandem::Refused("DistributedSampler: rank " + std::to_string(options.rank()) +
                                " is not in [0, num_replicas=" +
                                std::to_string(options.num_replicas()) + ")");
}

int64_t DistributedSampler::num_samples() const {
  const int64_t n = options_.num_replicas();
  if (options_.drop_last()) return size_ / n;  // PyTorch: ceil((size - n) / n) == floor(size / n)
  if (!options_.pad()) return (size_ - options_.rank() + n - 1) / n;
  return (size_ + n - 1) / n;
}

std::vector<int64_t> DistributedSampler::global_order() const {
  std::vector<int64_t> order(static_cast<size_t>(size_));
  if (options_.shuffle()) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(options_.seed() + epoch_);
    auto perm = at::randperm(size_, gen, at::TensorOptions().dtype(at::kLong));
    auto* p = perm.data_ptr<int64_t>();
    std::copy(p, p + size_, order.begin());
  } else {
    for (int64_t i = 0; i < size_; ++i) order[static_cast<size_t>(i)] = i;
  }
  return order;
}

std::vector<int64_t> DistributedSampler::indices() const {
  auto order = global_order();
  const int64_t n = options_.num_replicas();
  int64_t total = options_.pad() || options_.drop_last() ? num_samples() * n : size_;
  std::vector<int64_t> padded;
  padded.reserve(static_cast<size_t>(total));
  // Pad by repeating from the start (repeatedly, when the padding exceeds the data set).
  for (int64_t i = 0; i < total && size_ > 0; ++i) padded.push_back(order[static_cast<size_t>(i % size_)]);
  std::vector<int64_t> mine;
  for (int64_t i = options_.rank(); i < static_cast<int64_t>(padded.size()); i += n)
    mine.push_back(padded[static_cast<size_t>(i)]);
  return mine;
}

std::vector<bool> DistributedSampler::padding_mask() const {
  const int64_t n = options_.num_replicas();
  std::vector<bool> mask;
  for (int64_t k = 0; k < num_samples(); ++k) mask.push_back(options_.rank() + k * n >= size_);
  return mask;
}

}  // namespace tandem::data
