// The ZeRO strategy: sharded construction and make_zero_strategy (strategy.h).
#include "strategy.h"

namespace tandem::parallel::detail::zero {


void ZeroStrategy::shard_built(torch::nn::Module& m) {
  at::NoGradGuard no_grad;
  auto& pg = *ctx_.pg;
  // The module's parameters not yet sharded (a Sharded wrapper around a built block has the
  // block's), one flat buffer per dtype, in registration order.
  std::vector<std::pair<c10::ScalarType, std::vector<at::Tensor>>> by_dtype;
  std::set<const void*> seen;
  for (const auto& p : m.parameters()) {
    if (!p.requires_grad() || p.numel() == 0 || built_of(p) ||
        !seen.insert(p.unsafeGetTensorImpl()).second)
      continue;
    auto it = std::find_if(by_dtype.begin(), by_dtype.end(),
                           [&](const auto& e) { return e.first == p.scalar_type(); });
    if (it == by_dtype.end()) {
      by_dtype.push_back({p.scalar_type(), {}});
      it = std::prev(by_dtype.end());
    }
    it->second.push_back(p);
  }
  for (auto& [dtype, params] : by_dtype) {
    auto b = std::make_unique<BuiltUnit>();
    for (const auto& p : params) {
      b->offsets.push_back(b->numel);
      b->numel += p.numel();
    }
    b->shard = shard_of(b->numel, pg.size(), pg.rank());
    b->padded = b->shard.numel * pg.size();
    const auto opts = params.front().options().requires_grad(false);
    // This rank's elements straight from the parameters (padding: zeros), and a flat buffer
    // that never has storage until it is gathered: nothing of the unit is copied whole.
    b->chunk = at::zeros({b->shard.numel}, opts);
    b->flat = released_alias(at::empty({0}, opts), 0, {b->padded});
    for (size_t k = 0; k < params.size(); ++k) {
      auto& p = const_cast<at::Tensor&>(params[k]);
      const int64_t begin = std::max(b->offsets[k], b->shard.offset);
      const int64_t end = std::min(b->offsets[k] + p.numel(), b->shard.offset + b->shard.numel);
      if (begin < end)
        b->chunk.narrow(0, begin - b->shard.offset, end - begin)
            .copy_(p.detach().reshape({-1}).narrow(0, begin - b->offsets[k], end - begin));
      p.set_data(released_alias(b->flat, b->offsets[k], p.sizes()));  // the dense storage goes
    }
    b->params = params;
    for (const auto& p : params) built_of_[p.unsafeGetTensorImpl()] = b.get();
    built_.push_back(std::move(b));
  }
}

}  // namespace tandem::parallel::detail::zero

namespace tandem::parallel::detail {

std::unique_ptr<Strategy> make_zero_strategy(const ShardingOptions& options,
                                             StrategyContext context) {
  return std::make_unique<zero::ZeroStrategy>(options, std::move(context));
}

}  // namespace tandem::parallel::detail
