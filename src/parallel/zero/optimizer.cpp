// The ZeRO strategy's optimizer: shards, their step, clipping (strategy.h).
#include "strategy.h"
#include "tandem/error.h"

namespace tandem::parallel::detail::zero {


bool ZeroStrategy::prepare_optimizer(torch::optim::Optimizer& optimizer) {
  auto& pg = *ctx_.pg;
  auto fail = [&](const std::string& what) { throw ::tandem::Refused(pg.prefix() + " prepare: " + what); };
  if (!optimizer.state().empty())
    fail("ZeRO shards the optimizer's state, so it needs an optimizer that has not stepped yet; "
         "prepare it before its first step");
  if (find(optimizer)) fail("this optimizer was already prepared");
  const auto name_of = qualified_parameter_names(models_);
  std::map<const void*, int> group_of;
  auto& param_groups = optimizer.param_groups();
  for (size_t g = 0; g < param_groups.size(); ++g)
    for (const auto& p : param_groups[g].params()) {
      auto it = name_of.find(p.unsafeGetTensorImpl());
      if (it == name_of.end()) {
        std::ostringstream shape;
        shape << p.sizes();
        fail("the optimizer has a parameter of shape " + shape.str() + " that belongs to no "
             "prepared model; prepare the model before its optimizer (acc.prepare(model, "
             "optimizer) does both in order)");
      }
      // A tied weight listed twice (LibTorch's parameters() names it once per module) is one
      // parameter, stepped once (as PyTorch's parameters() lists it).
      auto [known, inserted] = group_of.emplace(p.unsafeGetTensorImpl(), static_cast<int>(g));
      if (!inserted && known->second != static_cast<int>(g))
        fail("parameter " + it->second + " is in parameter groups " +
             std::to_string(known->second) + " and " + std::to_string(g) + "; put it in one");
    }
  // The optimizer's parameters in the models' registration order, as data parallel buckets
  // them: with one parameter group the units are exactly data parallel's buckets. Each tensor
  // once; parameters that need no gradient are not sharded.
  std::vector<std::pair<std::string, at::Tensor>> named, experts;
  std::vector<int> groups, expert_groups;
  std::map<const void*, int> registrations;  // names per tensor: tied ones have several
  {
    std::set<const void*> seen;
    for (size_t m = 0; m < models_.size(); ++m)
      for (const auto& kv : models_[m]->named_parameters()) {
        const void* key = kv.value().unsafeGetTensorImpl();
        ++registrations[key];
        auto it = group_of.find(key);
        if (it == group_of.end() || !kv.value().requires_grad() || !seen.insert(key).second)
          continue;
        if (experts_.contains(kv.value())) {  // Note [Expert parallel]: whole, not sharded
          experts.emplace_back(name_of.at(it->first), kv.value());
          expert_groups.push_back(it->second);
          continue;
        }
        named.emplace_back(name_of.at(it->first), kv.value());
        groups.push_back(it->second);
      }
  }
  // Stage 3: one unit per unit module (Sharded or hooked), parameter group and dtype, the innermost module owning
  // a parameter; tied parameters (used by several modules) and those of no Sharded module form
  // the root's units, which stay resident. Launched in reverse order of registration (the last
  // module's gradients are ready first), the root's last.
  std::vector<std::vector<size_t>> explicit_buckets;
  std::vector<int> owner_of_bucket;
  if (options_.stage() == 3) {
    std::map<const void*, int> owner;
    std::vector<int64_t> size_of(units_.size(), 0);
    for (size_t k = 0; k < units_.size(); ++k)
      for (const auto& p : units_[k]->parameters()) size_of[k] += p.numel();
    for (size_t k = 0; k < units_.size(); ++k)
      for (const auto& p : units_[k]->parameters()) {
        const void* key = p.unsafeGetTensorImpl();
        if (registrations[key] > 1) continue;
        auto it = owner.find(key);
        if (it == owner.end() || size_of[static_cast<size_t>(it->second)] > size_of[k])
          owner[key] = static_cast<int>(k);
      }
    std::map<std::tuple<int, int, int>, size_t> unit_of_key;
    std::vector<std::vector<size_t>> members;
    std::vector<int> unit_owner;
    for (size_t i = 0; i < named.size(); ++i) {
      const void* key = named[i].second.unsafeGetTensorImpl();
      const int o = owner.count(key) ? owner.at(key) : -1;
      auto k = std::make_tuple(o, groups[i], static_cast<int>(named[i].second.scalar_type()));
      auto it = unit_of_key.emplace(k, members.size()).first;
      if (it->second == members.size()) {
        members.emplace_back();
        unit_owner.push_back(o);
      }
      members[it->second].push_back(i);
    }
    for (int pass = 0; pass < 2; ++pass)
      for (size_t k = members.size(); k-- > 0;)
        if ((unit_owner[k] >= 0) == (pass == 0)) {
          explicit_buckets.push_back(members[k]);
          owner_of_bucket.push_back(unit_owner[k]);
        }
  }
  auto s = std::make_unique<ShardedOptimizer>();
  s->optimizer = &optimizer;
  s->pg = ctx_.pg;
  if (ctx_.replicate_pg && ctx_.replicate_pg->size() > 1) s->replicas = ctx_.replicate_pg;
  const int stage = options_.stage();
  ReducerOptions ro = ctx_.reducer;
  if (s->replicas) ro.average_over(ctx_.dp_pg);
  ro.groups(groups)
      .bucket_multiple(pg.size())
      .write_back(false)
      .gradient_as_bucket_view(stage == 1)
      .release_gradients(stage >= 2)
      .buckets(explicit_buckets)
      .comm_hook(std::make_shared<ZeroHook>(s.get(), stage, options_.reduce_scatter()));
  s->reducer = std::make_unique<GradientReducer>(named, ctx_.pg, ro);
  const auto& params = s->reducer->parameters();
  const auto& names = s->reducer->parameter_names();
  at::NoGradGuard no_grad;
  s->units.reserve(s->reducer->buckets().size());  // UnitHooks point into it
  for (size_t b = 0; b < s->reducer->buckets().size(); ++b) {
    const auto& members = s->reducer->buckets()[b];
    const at::Tensor& first = params[members.front()];
    Unit u;
    u.bucket = b;
    u.group = group_of.at(first.unsafeGetTensorImpl());
    u.padded = s->reducer->bucket_numel(b);
    u.resident = owner_of_bucket.empty() || owner_of_bucket[b] < 0;
    // Note [Sharded construction]: a unit built already sharded, exactly as this one, is taken
    // over with its chunk; the members of other built units are gathered to be copied.
    BuiltUnit* adopted = built_of(first);
    if (adopted && (u.resident || adopted->params.size() != members.size() ||
                    adopted->padded != u.padded))
      adopted = nullptr;
    for (size_t j = 0; adopted && j < members.size(); ++j)
      if (!params[members[j]].is_same(adopted->params[j]) ||
          s->reducer->offset_in_bucket(members[j]) != adopted->offsets[j])
        adopted = nullptr;
    if (!adopted)
      for (size_t i : members)
        if (auto* built = built_of(params[i])) gather_built(*built, pg);
    u.flat = adopted ? adopted->flat : at::zeros({u.padded}, first.options().requires_grad(false));
    u.gathered = !adopted;
    for (size_t i : members) {
      const auto& p = params[i];
      const int64_t off = s->reducer->offset_in_bucket(i);
      if (!adopted) {
        u.flat.narrow(0, off, p.numel()).copy_(p.detach().reshape({-1}));
        // The parameter's storage becomes its slot of the unit (same dtype: set_data keeps its
        // identity for the optimizer, hooks and the model).
        const_cast<at::Tensor&>(p).set_data(flat_alias(u.flat, off, p.sizes()));
        if (auto* built = built_of(p); built && ++built->moved == built->params.size())
          forget_built(built);
      }
      u.numel += p.numel();
      u.names.push_back(names[i]);
      u.params.push_back(p);
      u.offsets.push_back(off);
    }
    u.shard = shard_of(u.numel, pg.size(), pg.rank());
    TORCH_INTERNAL_ASSERT(u.shard.numel * pg.size() == u.padded, "unit padding mismatch");
    const bool fp32_copy = ctx_.master_weights && precision::is_half(first.scalar_type());
    const bool host_copy = (options_.offload_optimizer() || options_.offload_params() ||
                            !options_.nvme_path().empty()) &&
                           !first.device().is_cpu();
    u.alias = !fp32_copy && !host_copy && u.resident;
    if (u.alias) {
      u.shard_param = flat_alias(u.flat, u.shard.offset, {u.shard.numel});
    } else {
      auto opts = u.flat.options();
      if (fp32_copy) opts = opts.dtype(at::kFloat);
      if (host_copy) opts = opts.device(at::kCPU);
      const at::Tensor mine =
          adopted ? adopted->chunk : u.flat.narrow(0, u.shard.offset, u.shard.numel);
      u.shard_param = mine.to(opts, false, /*copy=*/!adopted);
    }
    if (adopted) forget_built(adopted);
    u.shard_param.set_requires_grad(true);
    s->unit_of_bucket.push_back(s->units.size());
    s->units.push_back(std::move(u));
    Unit& placed = s->units.back();
    if (!placed.resident) {
      placed.hooks = hooks_[static_cast<size_t>(owner_of_bucket[b])].get();
      placed.hooks->units.push_back(&placed);
      release_unit(placed);
    }
  }
  // Built units this optimizer does not step (parameters it leaves out) are made whole again:
  // nothing else would gather them.
  while (!built_.empty()) {
    BuiltUnit* b = built_.front().get();
    gather_built(*b, pg);
    forget_built(b);
  }
  // The optimizer steps this rank's chunks, one tensor per unit, in its own groups, and after
  // them the experts this rank holds whole (Note [Expert parallel]).
  for (size_t g = 0; g < param_groups.size(); ++g) {
    std::vector<at::Tensor> shards;
    for (const auto& u : s->units)
      if (u.group == static_cast<int>(g)) shards.push_back(u.shard_param);
    // s->experts in the order each group steps them (expert_index_in_group).
    for (size_t i = 0; i < experts.size(); ++i)
      if (expert_groups[i] == static_cast<int>(g)) {
        shards.push_back(experts[i].second);
        s->experts.push_back({experts[i].first, experts[i].second, expert_groups[i]});
      }
    param_groups[g].params() = shards;
  }
  if (!experts.empty()) {
    if (ctx_.master_weights)
      for (const auto& kv : experts)
        if (precision::is_half(kv.second.scalar_type()))
          fail("expert " + kv.first + " is " + std::string(c10::toString(kv.second.scalar_type())) +
               " and ZeRO keeps float32 master weights of the sharded parameters only; load the "
               "model in float32 (mixed precision computes in half) or run without ZeRO");
    expert_reducers_.push_back(make_expert_reducer(experts, experts_, ctx_.reducer));
  }
  check_same_layout(*s);
  if (!options_.nvme_path().empty()) {
    // Note [Optimizer state on disk]: refused now for an optimizer whose state tandem cannot
    // name field by field.
    if (!s->units.empty()) checkpoint::optimizer_state_tensors(optimizer, s->units.front().shard_param);
    const int rank = ctx_.dp_pg ? ctx_.dp_pg->rank() : pg.rank();
    s->disk = std::make_unique<StateOnDisk>(
        options_.nvme_path(),
        "rank" + std::to_string(rank) + "-optimizer" + std::to_string(sharded_.size()), pg.prefix());
  }
  if (stage >= 2) {  // Note [Clearing sharded gradients through the model]
    s->markers->owner = s.get();
    std::weak_ptr<MarkerCheck> weak = s->markers;
    for (const auto& u : s->units)
      for (const auto& p : u.params)
        p.register_hook([weak](const at::Tensor&) {
          if (auto m = weak.lock()) m->check();
        });
  }
  sharded_.push_back(std::move(s));
  // A second model or optimizer: a backward may reach one and not the other (a GAN's losses).
  for (auto& o : sharded_)
    o->reducer->allow_untouched_backward(sharded_.size() > 1 || models_.size() > 1);
  return true;
}

// Note [Optimizer state on disk]: one unit at a time, the others' gradients set aside.
void ZeroStrategy::step(torch::optim::Optimizer& optimizer) {
  auto* s = find(optimizer);
  if (!s || !s->disk) {
    optimizer.step();  // returns the closure's loss, which the accelerated step does not use
    return;
  }
  at::NoGradGuard no_grad;
  auto& disk = *s->disk;
  std::vector<at::Tensor> grads(s->units.size());
  std::vector<size_t> order;
  for (size_t k = 0; k < s->units.size(); ++k) {
    auto& p = s->units[k].shard_param;
    grads[k] = p.grad();
    if (grads[k].defined()) order.push_back(k);
    p.mutable_grad() = at::Tensor();
  }
  auto fields = [&](size_t k) {
    return checkpoint::optimizer_state_tensors(optimizer, s->units[k].shard_param);
  };
  auto restore = [&] {
    for (size_t k = 0; k < s->units.size(); ++k) s->units[k].shard_param.mutable_grad() = grads[k];
  };
  try {
    if (!order.empty()) disk.prefetch(order.front());
    for (size_t i = 0; i < order.size(); ++i) {
      const size_t k = order[i];
      auto& p = s->units[k].shard_param;
      disk.load(k, fields(k));
      if (i + 1 < order.size()) disk.prefetch(order[i + 1]);
      p.mutable_grad() = grads[k];
      optimizer.step();
      p.mutable_grad() = at::Tensor();
      disk.store(k, fields(k));  // the first step has just created the state
    }
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

// Note [Same collectives everywhere]: every rank must issue the same reductions in the same
// order; a model built differently on one rank would otherwise hang in a collective until the
// timeout, or silently mix unrelated gradients. The units are compared once, at prepare.
void ZeroStrategy::check_same_layout(const ShardedOptimizer& s) {
  std::ostringstream os;
  for (size_t k = 0; k < s.units.size(); ++k) {
    const auto& u = s.units[k];
    os << "unit " << k << " (group " << u.group << ", " << u.numel << " elements, "
       << u.flat.scalar_type() << "): ";
    for (size_t i = 0; i < u.names.size(); ++i) os << (i ? ", " : "") << u.names[i];
    os << "\n";
  }
  const std::string mine = os.str();
  auto all = comm::gather_object(*ctx_.pg, mine);
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    // Name the first line that differs, on both sides.
    auto first_diff = [](const std::string& a, const std::string& b) {
      std::istringstream x(a), y(b);
      std::string la, lb;
      while (true) {
        bool ga = static_cast<bool>(std::getline(x, la)), gb = static_cast<bool>(std::getline(y, lb));
        if (!ga && !gb) return std::make_pair(std::string("(none)"), std::string("(none)"));
        if (!ga) la = "(no such unit)";
        if (!gb) lb = "(no such unit)";
        if (la != lb) return std::make_pair(la, lb);
      }
    };
    auto [a, b] = first_diff(all[0], all[r]);
    throw std::runtime_error(
        ctx_.pg->prefix() + " ZeRO: the ranks built different models or optimizers, so they "
        "would reduce different gradients in a different order. Rank 0 has " + a + "; rank " +
        std::to_string(r) + " has " + b + ". Build the same model (same modules, in the same "
        "order) and the same optimizer parameter groups on every rank.");
  }
}

std::optional<std::array<double, 2>> ZeroStrategy::grad_norm_parts(
    const std::function<bool(const at::Tensor&)>& split, double norm_type) {
  at::NoGradGuard no_grad;
  const bool inf = std::isinf(norm_type);
  // Per tensor norms, combined in double: this rank's part of the total, then every rank's.
  std::array<double, 2> local{0, 0};
  auto add = [&](int part, const at::Tensor& g) {
    const double n = g.norm(norm_type).item<double>();
    local[part] = inf ? std::max(local[part], n) : local[part] + std::pow(n, norm_type);
  };
  for (auto& s : sharded_)
    for (auto& u : s->units) {
      if (!u.shard_param.grad().defined()) continue;
      const auto& g = u.shard_param.grad();
      if (!split) {
        add(1, g);
        continue;
      }
      // The shard covers [shard.offset, shard.offset + shard.numel) of the unit's parameters
      // laid end to end (offsets[k]): each parameter's slice of it counts in its part.
      for (size_t k = 0; k < u.params.size(); ++k) {
        const int64_t begin = std::max(u.offsets[k], u.shard.offset);
        const int64_t end =
            std::min(u.offsets[k] + u.params[k].numel(), u.shard.offset + u.shard.numel);
        if (begin < end)
          add(split(u.params[k]) ? 0 : 1, g.narrow(0, begin - u.shard.offset, end - begin));
      }
    }
  auto t = at::tensor({local[0], local[1]}, at::TensorOptions().dtype(at::kDouble));
  ctx_.pg->allreduce(t, inf ? ReduceOp::kMax : ReduceOp::kSum);
  return std::array<double, 2>{t[0].item<double>(), t[1].item<double>()};
}

void ZeroStrategy::after_step(torch::optim::Optimizer& optimizer) {
  auto* s = find(optimizer);
  if (!s) return;
  at::NoGradGuard no_grad;
  for (auto& u : s->units) {
    if (!u.resident) {  // gathered from its (updated) shard at its next use
      release_unit(u);
      continue;
    }
    auto mine = u.flat.narrow(0, u.shard.offset, u.shard.numel);
    if (!u.alias) mine.copy_(u.shard_param);
    if (ctx_.pg->size() > 1) ctx_.pg->all_gather_into(mine, u.flat);
  }
}


}  // namespace tandem::parallel::detail::zero
