// User-facing collectives built on ProcessGroup's primitives.
#include "tandem/comm/collectives.h"
#include "tandem/error.h"

#include <ATen/ATen.h>

#include <cstring>
#include <stdexcept>

namespace tandem::comm {
namespace {

// Sizes of one dim on every rank.
std::vector<int64_t> all_sizes(ProcessGroup& pg, int64_t size) {
  auto t = at::full({1}, size, at::kLong);
  auto parts = pg.allgather(t);
  std::vector<int64_t> sizes;
  for (auto& p : parts) sizes.push_back(p.item<int64_t>());
  return sizes;
}

// Pads along dim to `target` (end or start) with `value`.
at::Tensor pad_to(const at::Tensor& t, int64_t dim, int64_t target, double value, bool first) {
  if (t.size(dim) == target) return t;
  auto shape = t.sizes().vec();
  shape[dim] = target;
  auto out = at::full(shape, value, t.options());
  out.narrow(dim, first ? target - t.size(dim) : 0, t.size(dim)).copy_(t);
  return out;
}

}  // namespace

at::Tensor gather(ProcessGroup& pg, const at::Tensor& tensor) {
  auto t = tensor.dim() == 0 ? tensor.reshape({1}) : tensor;
  if (pg.size() == 1) return t.clone();
  auto sizes = all_sizes(pg, t.size(0));
  int64_t max = *std::max_element(sizes.begin(), sizes.end());
  auto parts = pg.allgather(pad_to(t.contiguous(), 0, max, 0.0, false));
  std::vector<at::Tensor> trimmed;
  for (size_t r = 0; r < parts.size(); ++r) trimmed.push_back(parts[r].narrow(0, 0, sizes[r]));
  return at::cat(trimmed, 0);
}

std::vector<std::string> gather_object(ProcessGroup& pg, const std::string& bytes) {
  if (pg.size() == 1) return {bytes};
  auto t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  auto sizes = all_sizes(pg, t.size(0));
  int64_t max = *std::max_element(sizes.begin(), sizes.end());
  auto parts = pg.allgather(pad_to(t, 0, max, 0.0, false));
  std::vector<std::string> out;
  for (size_t r = 0; r < parts.size(); ++r)
    out.emplace_back(static_cast<const char*>(parts[r].data_ptr()), sizes[r]);
  return out;
}

std::string broadcast_object(ProcessGroup& pg, const std::string& bytes, int root) {
  if (pg.size() == 1) return bytes;
  auto n = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
  pg.broadcast(n, root);
  auto len = n.item<int64_t>();
  auto t = at::empty({len}, at::kByte);
  if (pg.rank() == root && len > 0) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  if (len > 0) pg.broadcast(t, root);
  return std::string(static_cast<const char*>(t.data_ptr()), len);
}

at::Tensor reduce(ProcessGroup& pg, const at::Tensor& tensor, ReduceOp op) {
  auto out = tensor.clone().contiguous();
  if (pg.size() == 1) return out;
  if (op == ReduceOp::kMean && !at::isFloatingType(out.scalar_type()))
    throw ::tandem::Refused(pg.prefix() + " reduce(mean) of an integer tensor: use kSum, or "
                                "convert the tensor to a floating type first");
  pg.allreduce(out, op);
  return out;
}

void broadcast(ProcessGroup& pg, at::Tensor& tensor, int root) {
  if (pg.size() == 1) return;
  if (tensor.is_contiguous()) {
    pg.broadcast(tensor, root);
  } else {
    auto tmp = tensor.contiguous();
    pg.broadcast(tmp, root);
    tensor.copy_(tmp);
  }
}

at::Tensor pad_across_processes(ProcessGroup& pg, const at::Tensor& tensor, int64_t dim,
                                double pad_value, bool pad_first) {
  if (tensor.dim() == 0) return tensor;
  if (dim < 0) dim += tensor.dim();
  if (dim < 0 || dim >= tensor.dim())
    throw ::tandem::Refused(pg.prefix() + " pad_across_processes: dim " + std::to_string(dim) +
                                " is out of range for a tensor of " +
                                std::to_string(tensor.dim()) + " dims");
  if (pg.size() == 1) return tensor;
  auto sizes = all_sizes(pg, tensor.size(dim));
  int64_t max = *std::max_element(sizes.begin(), sizes.end());
  return pad_to(tensor, dim, max, pad_value, pad_first);
}

void wait_for_everyone(ProcessGroup& pg) { pg.barrier(); }

}  // namespace tandem::comm
