// ZeRO's gradient reduction (reducer.h).
#include "reducer.h"

#include <torch/library.h>

#include "tandem/error.h"

namespace tandem::parallel::detail::zero {

// A unit's markers (MarkerCheck::mu held).
void plant_markers(ShardedOptimizer& s, Unit& u) {
  u.markers.resize(u.params.size());
  u.marker_versions.resize(u.params.size(), 0);
  for (size_t j = 0; j < u.params.size(); ++j) {
    auto& g = u.params[j].mutable_grad();
    if (g.defined()) {
      u.markers[j] = at::Tensor();
      continue;
    }
    u.markers[j] = at::empty(u.params[j].sizes(), u.params[j].options().device(at::kMeta));
    u.marker_versions[j] = u.markers[j]._version();
    g = u.markers[j];
    s.markers->planted = true;
  }
}

void MarkerCheck::plant() {
  std::lock_guard<std::mutex> lock(mu);
  if (!owner) return;
  for (auto& u : owner->units)
    if (u.reduced_since_plant) {
      u.reduced_since_plant = false;
      plant_markers(*owner, u);
    }
}

void MarkerCheck::drop() {
  std::lock_guard<std::mutex> lock(mu);
  if (!owner) return;
  for (auto& u : owner->units) {
    for (size_t j = 0; j < u.markers.size(); ++j) {
      auto& g = u.params[j].mutable_grad();
      if (u.markers[j].defined() && g.defined() && g.is_meta()) g.reset();
    }
    u.markers.clear();
  }
  planted = false;
  owner = nullptr;
}

void MarkerCheck::check() {
  std::lock_guard<std::mutex> lock(mu);
  if (!planted || !owner) return;
  planted = false;
  at::NoGradGuard no_grad;
  for (auto& u : owner->units) {
    if (u.markers.empty()) continue;
    auto& shard_grad = u.shard_param.mutable_grad();
    bool all_none = true;
    std::vector<size_t> cleared;
    for (size_t j = 0; j < u.params.size(); ++j) {
      auto& marker = u.markers[j];
      if (!marker.defined()) {
        all_none = false;
        continue;
      }
      auto& g = u.params[j].mutable_grad();
      const bool none = !g.defined();
      const bool replaced = !none && !g.is_same(marker);
      const bool zeroed = !none && !replaced && marker._version() != u.marker_versions[j];
      if (none || replaced || zeroed) cleared.push_back(j);
      if (!none) all_none = false;
      if (g.defined() && g.is_meta()) g.reset();  // autograd starts a fresh .grad
      marker = at::Tensor();
    }
    if (cleared.empty() || !shard_grad.defined()) continue;
    if (all_none && cleared.size() == u.params.size()) {
      shard_grad.reset();
      continue;
    }
    const int64_t begin = u.shard.offset, end = u.shard.offset + u.shard.numel;
    for (size_t j : cleared) {
      const int64_t a = std::max(begin, u.offsets[j]);
      const int64_t b = std::min(end, u.offsets[j] + u.params[j].numel());
      if (a < b) shard_grad.narrow(0, a - begin, b - a).zero_();
    }
  }
}

// Each unit's index among its parameter group's units: the index of its shard in the
// optimizer's group, which names its state in checkpoints (optimizer_param_key).
std::vector<size_t> index_in_group(const ShardedOptimizer& s) {
  std::map<int, size_t> next;
  std::vector<size_t> out;
  for (const auto& u : s.units) out.push_back(next[u.group]++);
  return out;
}

std::vector<size_t> expert_index_in_group(const ShardedOptimizer& s) {
  std::map<int, size_t> next;
  for (const auto& u : s.units) ++next[u.group];
  std::vector<size_t> out;
  for (const auto& e : s.experts) out.push_back(next[e.group]++);
  return out;
}

Work ZeroHook::start(ProcessGroup& pg, GradBucket& b) {
  Unit& u = owner_->units[owner_->unit_of_bucket[b.index]];
  // Stage 3: every gradient of the unit is in its bucket, so its backward is over: its
  // parameters go now, not once the reduction is done (a unit's worth less beside the next
  // unit's gathered weights and gradients).
  release_unit(u);
  const std::string what = "ZeRO gradient reduction (unit " + std::to_string(b.index) + ")";
  if (slices()) return pg.allreduce_async({b.buffer.narrow(0, 0, u.numel)}, ReduceOp::kSum, what);
  u.reduced = at::empty({u.shard.numel}, b.buffer.options());
  return pg.reduce_scatter_async(b.buffer, u.reduced, ReduceOp::kSum, algorithm_);
}

void ZeroHook::finish(GradBucket& b, Work& w) {
  w.wait();
  Unit& u = owner_->units[owner_->unit_of_bucket[b.index]];
  at::Tensor mine =
      slices() ? b.buffer.narrow(0, u.shard.offset, u.shard.numel) : std::move(u.reduced);
  u.reduced = at::Tensor();
  if (u.hooks) u.hooks->after_reduction();
  // Markers when this backward's reduction is over: the last bucket finishes at the end of the
  // backward (the engine's callback), after every gradient hook of it, also for a program that
  // calls loss.backward() itself.
  if (stage_ >= 2) {
    u.reduced_since_plant = true;
    if (b.is_last) owner_->markers->plant();
  }
  // No rank used this unit: its gradient stays as it was (undefined after zero_grad, so the
  // optimizer leaves the unit alone), as data parallel leaves unused parameters' .grad. (The
  // unused map spans the replicas too, so every rank returns here alike.)
  if (b.all_unused) return;
  // Note [Hybrid sharding]: the shard holds its machine's sum; the replicas' shards add up to
  // every rank's, each gradient divided by the whole data-parallel size on its way in.
  if (owner_->replicas)
    owner_->replicas->allreduce_async({mine}, ReduceOp::kSum,
                                      "ZeRO gradient allreduce across replicas (unit " +
                                          std::to_string(b.index) + ")")
        .wait();
  auto& g = u.shard_param.mutable_grad();
  // A half parameter's gradient is half, as its .grad is under data parallel, even where the
  // bucket travelled in fp32 (bf16 on Gloo before LibTorch 2.1) and the shard steps fp32 masters.
  if (mine.scalar_type() != u.flat.scalar_type() && precision::is_half(u.flat.scalar_type()))
    mine = mine.to(u.flat.scalar_type());
  const bool same = mine.scalar_type() == u.shard_param.scalar_type() &&
                    mine.device() == u.shard_param.device();
  if (stage_ == 1) {
    // The bucket holds the whole averaged gradient (the parameters' .grad are views of it, and
    // autograd accumulated into them): the chunk is the shard's gradient as it stands.
    const bool in_bucket = same && mine.is_alias_of(b.buffer);  // not rounded or moved
    if (in_bucket && g.defined() && g.data_ptr() == mine.data_ptr()) return;
    g = in_bucket ? flat_alias(b.buffer, u.shard.offset, {u.shard.numel})
                  : mine.to(u.shard_param.options(), /*non_blocking=*/false, /*copy=*/true);
    return;
  }
  // Stage 2: the bucket held this backward's local gradients only; what the shard already
  // holds (no zero_grad since the last step) accumulates, as .grad does in data parallel.
  if (g.defined())
    g.add_(same ? mine : mine.to(u.shard_param.options()));
  else
    g = same ? (slices() ? mine.clone() : mine) : mine.to(u.shard_param.options());
}

}  // namespace tandem::parallel::detail::zero

namespace {

// Note [Reading a sharded gradient]: between acc.backward and the optimizer step, a ZeRO-2/3
// parameter's .grad() is a meta tensor of its shape (Note [Clearing sharded gradients through the
// model]): the gradient lives in each rank's shard. LibTorch's clip_grad_norm_, or a program's
// `p.grad().norm().item()`, reads a value out of it, which LibTorch refuses with words about meta
// backends and custom builds. This Meta kernel of Tensor::item (LibTorch registers none: a meta
// tensor has no value to give) says what the tensor is and what to call instead.
at::Scalar meta_item(const at::Tensor& self) {
  throw ::tandem::Refused(
      "Tensor::item() on a meta tensor of shape " + c10::str(self.sizes()) +
      ", which holds no values. Under ZeRO stage 2 or 3 a parameter's .grad() is one between "
      "acc.backward and the optimizer step (each rank's gradient lives in its shard), so "
      "torch::nn::utils::clip_grad_norm_ / clip_grad_value_ and norms read from p.grad() cannot "
      "work there: call acc.clip_grad_norm_(model->parameters(), max_norm) or "
      "acc.clip_grad_value_, which clip by the whole model's gradients across the ranks");
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  m.impl("_local_scalar_dense", TORCH_FN(meta_item));
}
