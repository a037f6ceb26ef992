// ZeRO stages 1 and 2 (see zero.h, Note [ZeRO units]).
#include "tandem/parallel/zero.h"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <iostream>
#include <map>
#include <sstream>

#include "../compat/optimizer.h"
#include "detail/strategies.h"
#include "tandem/comm/collectives.h"

namespace tandem::parallel {

ShardInfo shard_of(int64_t numel, int world, int rank) {
  const int64_t chunk = std::max<int64_t>(1, (numel + world - 1) / world);
  return {chunk * rank, chunk};
}

std::vector<ReshardPiece> reshard_pieces(int64_t numel, int saved_world, int world, int rank) {
  std::vector<ReshardPiece> out;
  const ShardInfo mine = shard_of(numel, world, rank);
  const int64_t begin = mine.offset, end = std::min(numel, mine.offset + mine.numel);
  const int64_t old_chunk = shard_of(numel, saved_world, 0).numel;
  for (int64_t at = begin; at < end;) {
    const int src = static_cast<int>(at / old_chunk);
    const int64_t src_off = at - src * old_chunk;
    const int64_t len = std::min(end - at, old_chunk - src_off);
    out.push_back({src, src_off, at - begin, len});
    at += len;
  }
  return out;
}

namespace detail {
namespace {

using json = nlohmann::json;

bool is_half(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// A tensor sharing `flat`'s storage at `offset` with `sizes` (contiguous). Made with set_, not
// a view, so that optimizers may detach_() and zero it (Note [Gradients as bucket views]).
at::Tensor alias_of(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  at::Tensor t = at::empty({0}, flat.options());
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d)
    strides[d] = strides[d + 1] * sizes[d + 1];
  t.set_(flat.storage(), flat.storage_offset() + offset, sizes, strides);
  return t;
}

// One unit: a bucket of one parameter group (Note [ZeRO units]).
struct Unit {
  size_t bucket = 0;
  int group = 0;
  int64_t numel = 0;   // real elements
  int64_t padded = 0;  // multiple of the world size
  ShardInfo shard;
  at::Tensor flat;   // the parameters, padded, in their dtype and on their device
  at::Tensor shard_param;  // what the optimizer steps
  bool alias = true;       // shard_param is a view of flat (else an fp32 / host copy)
  at::Tensor reduced;      // stage 2: the reduce-scatter's output while in flight
  std::vector<std::string> names;
};

struct ShardedOptimizer;

// The reduction of one unit's gradient bucket. Stage 1, and stage 2 with kAllreduceSlice:
// the bucket's real elements are allreduced in place, exactly as data parallel's bucket (the
// same Gloo call on the same bytes, so the same sums), and this rank's chunk is taken. Stage 2
// with kAlltoall: the padded bucket is reduce-scattered. The reducer has already divided each
// gradient by the world size on its way in, so every path sums.
class ZeroHook : public CommHook {
 public:
  ZeroHook(ShardedOptimizer* owner, int stage, ProcessGroup::ReduceScatterAlgorithm algorithm)
      : owner_(owner), stage_(stage), algorithm_(algorithm) {}
  Work start(ProcessGroup& pg, GradBucket& b) override;
  void finish(GradBucket& b, Work& w) override;
  std::string name() const override { return "zero-" + std::to_string(stage_); }
  bool reducer_divides() const override { return true; }

 private:
  bool slices() const {
    return stage_ == 1 || algorithm_ == ProcessGroup::ReduceScatterAlgorithm::kAllreduceSlice;
  }
  ShardedOptimizer* owner_;
  int stage_;
  ProcessGroup::ReduceScatterAlgorithm algorithm_;
};

struct ShardedOptimizer {
  torch::optim::Optimizer* optimizer = nullptr;
  std::unique_ptr<GradientReducer> reducer;
  std::vector<Unit> units;
  std::vector<size_t> unit_of_bucket;
  std::shared_ptr<ProcessGroup> pg;
};

Work ZeroHook::start(ProcessGroup& pg, GradBucket& b) {
  Unit& u = owner_->units[owner_->unit_of_bucket[b.index]];
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
  // No rank used this unit: its gradient stays as it was (undefined after zero_grad, so the
  // optimizer leaves the unit alone), as data parallel leaves unused parameters' .grad.
  if (b.all_unused) return;
  auto& g = u.shard_param.mutable_grad();
  const bool same = mine.scalar_type() == u.shard_param.scalar_type() &&
                    mine.device() == u.shard_param.device();
  if (stage_ == 1) {
    // The bucket holds the whole averaged gradient (the parameters' .grad are views of it, and
    // autograd accumulated into them): the chunk is the shard's gradient as it stands.
    if (same && g.defined() && g.data_ptr() == mine.data_ptr()) return;
    g = same ? alias_of(b.buffer, u.shard.offset, {u.shard.numel}) : mine.to(u.shard_param.options());
    return;
  }
  // Stage 2: the bucket held this backward's local gradients only; what the shard already
  // holds (no zero_grad since the last step) accumulates, as .grad does in data parallel.
  if (g.defined())
    g.add_(same ? mine : mine.to(u.shard_param.options()));
  else
    g = same ? (slices() ? mine.clone() : mine) : mine.to(u.shard_param.options());
}

class ZeroStrategy : public Strategy {
 public:
  ZeroStrategy(ShardingOptions options, StrategyContext ctx)
      : options_(std::move(options)), ctx_(std::move(ctx)) {
    if (options_.offload_optimizer() && ctx_.device.is_cpu() && ctx_.pg->rank() == 0)
      std::cerr << ctx_.pg->prefix() << " " << options_.origin()
                << ": optimizer offload to the CPU: this run is on the CPU already, so the "
                   "shards and their step stay where they are" << std::endl;
  }
  std::string name() const override { return "zero-" + std::to_string(options_.stage()); }

  void prepare_model(const std::shared_ptr<torch::nn::Module>& model) override {
    models_.push_back(model);
  }

  bool prepare_optimizer(torch::optim::Optimizer& optimizer) override;

  void set_sync(bool sync) override {
    for (auto& s : sharded_) s->reducer->set_sync(sync);
  }
  void after_backward() override {
    for (auto& s : sharded_) s->reducer->after_backward();
  }
  std::optional<double> clip_grad_norm(double max_norm, double norm_type) override;
  bool clip_grad_value(double clip_value) override {
    at::NoGradGuard no_grad;
    for (auto& s : sharded_)
      for (auto& u : s->units)
        if (u.shard_param.grad().defined())
          u.shard_param.mutable_grad().clamp_(-clip_value, clip_value);
    return true;
  }
  void after_step(torch::optim::Optimizer& optimizer) override;
  void zero_grad(torch::optim::Optimizer& optimizer) override {
    auto* s = find(optimizer);
    if (!s) return;
    for (const auto& p : s->reducer->parameters()) {
      auto& g = const_cast<at::Tensor&>(p).mutable_grad();
      if (!g.defined()) continue;
      if (options_.stage() == 1) {
        g.detach_();
        g.zero_();  // stays the view into its bucket
      } else {
        g.reset();  // micro-steps of no_sync leave local gradients; the step consumed them
      }
    }
  }
  bool shards_optimizer(const torch::optim::Optimizer& optimizer) const override {
    return find(optimizer) != nullptr;
  }
  checkpoint::OptimizerState optimizer_shard_state(
      const torch::optim::Optimizer& optimizer) const override;
  void load_optimizer_shards(
      torch::optim::Optimizer& optimizer, int saved_world,
      const std::function<std::string(int)>& json_of,
      const std::function<at::Tensor(int, const std::string&)>& tensor_of) override;
  std::vector<const GradientReducer*> reducers() const override {
    std::vector<const GradientReducer*> out;
    for (const auto& s : sharded_) out.push_back(s->reducer.get());
    return out;
  }

 private:
  ShardedOptimizer* find(const torch::optim::Optimizer& o) const {
    for (const auto& s : sharded_)
      if (s->optimizer == &o) return s.get();
    return nullptr;
  }
  void check_same_layout(const ShardedOptimizer& s);

  ShardingOptions options_;
  StrategyContext ctx_;
  std::vector<std::shared_ptr<torch::nn::Module>> models_;
  std::vector<std::unique_ptr<ShardedOptimizer>> sharded_;
};

bool ZeroStrategy::prepare_optimizer(torch::optim::Optimizer& optimizer) {
  auto& pg = *ctx_.pg;
  auto fail = [&](const std::string& what) { throw std::invalid_argument(pg.prefix() + " prepare: " + what); };
  if (!optimizer.state().empty())
    fail("ZeRO shards the optimizer's state, so it needs an optimizer that has not stepped yet; "
         "prepare it before its first step");
  if (find(optimizer)) fail("this optimizer was already prepared");
  std::map<const void*, std::string> name_of;
  for (size_t m = 0; m < models_.size(); ++m)
    for (const auto& kv : models_[m]->named_parameters())
      name_of.emplace(kv.value().unsafeGetTensorImpl(),
                      (models_.size() > 1 ? "model" + std::to_string(m) + "." : "") + kv.key());
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
  // them: with one parameter group the units are exactly data parallel's buckets.
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::vector<int> groups;
  for (size_t m = 0; m < models_.size(); ++m)
    for (const auto& kv : models_[m]->named_parameters()) {
      auto it = group_of.find(kv.value().unsafeGetTensorImpl());
      if (it == group_of.end()) continue;
      named.emplace_back(name_of.at(it->first), kv.value());
      groups.push_back(it->second);
    }
  auto s = std::make_unique<ShardedOptimizer>();
  s->optimizer = &optimizer;
  s->pg = ctx_.pg;
  const int stage = options_.stage();
  ReducerOptions ro = ctx_.reducer;
  ro.groups(groups)
      .bucket_multiple(pg.size())
      .write_back(false)
      .gradient_as_bucket_view(stage == 1)
      .release_gradients(stage == 2)
      .comm_hook(std::make_shared<ZeroHook>(s.get(), stage, options_.reduce_scatter()));
  s->reducer = std::make_unique<GradientReducer>(named, ctx_.pg, ro);
  const auto& params = s->reducer->parameters();
  const auto& names = s->reducer->parameter_names();
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < s->reducer->buckets().size(); ++b) {
    const auto& members = s->reducer->buckets()[b];
    const at::Tensor& first = params[members.front()];
    Unit u;
    u.bucket = b;
    u.group = group_of.at(first.unsafeGetTensorImpl());
    u.padded = s->reducer->bucket_numel(b);
    u.flat = at::zeros({u.padded}, first.options().requires_grad(false));
    for (size_t i : members) {
      const auto& p = params[i];
      const int64_t off = s->reducer->offset_in_bucket(i);
      u.flat.narrow(0, off, p.numel()).copy_(p.detach().reshape({-1}));
      // The parameter's storage becomes its slot of the unit (same dtype: set_data keeps its
      // identity for the optimizer, hooks and the model).
      const_cast<at::Tensor&>(p).set_data(alias_of(u.flat, off, p.sizes()));
      u.numel += p.numel();
      u.names.push_back(names[i]);
    }
    u.shard = shard_of(u.numel, pg.size(), pg.rank());
    TORCH_INTERNAL_ASSERT(u.shard.numel * pg.size() == u.padded, "unit padding mismatch");
    const bool fp32_copy = ctx_.master_weights && is_half(first.scalar_type());
    const bool host_copy = options_.offload_optimizer() && !first.device().is_cpu();
    u.alias = !fp32_copy && !host_copy;
    if (u.alias) {
      u.shard_param = alias_of(u.flat, u.shard.offset, {u.shard.numel});
    } else {
      auto opts = u.flat.options();
      if (fp32_copy) opts = opts.dtype(at::kFloat);
      if (host_copy) opts = opts.device(at::kCPU);
      u.shard_param = u.flat.narrow(0, u.shard.offset, u.shard.numel).to(opts, false, true);
    }
    u.shard_param.set_requires_grad(true);
    s->unit_of_bucket.push_back(s->units.size());
    s->units.push_back(std::move(u));
  }
  // The optimizer steps this rank's chunks, one tensor per unit, in its own groups.
  for (size_t g = 0; g < param_groups.size(); ++g) {
    std::vector<at::Tensor> shards;
    for (const auto& u : s->units)
      if (u.group == static_cast<int>(g)) shards.push_back(u.shard_param);
    param_groups[g].params() = shards;
  }
  check_same_layout(*s);
  sharded_.push_back(std::move(s));
  return true;
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

std::optional<double> ZeroStrategy::clip_grad_norm(double max_norm, double norm_type) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (auto& s : sharded_)
    for (auto& u : s->units)
      if (u.shard_param.grad().defined()) grads.push_back(u.shard_param.grad());
  const bool inf = std::isinf(norm_type);
  // Per shard norms, combined in double: this rank's part of the total, then every rank's.
  double local = 0;
  for (const auto& g : grads) {
    const double n = g.norm(norm_type).item<double>();
    local = inf ? std::max(local, n) : local + std::pow(n, norm_type);
  }
  auto t = at::full({1}, local, at::TensorOptions().dtype(at::kDouble));
  ctx_.pg->allreduce(t, inf ? ReduceOp::kMax : ReduceOp::kSum);
  const double total = inf ? t.item<double>() : std::pow(t.item<double>(), 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1)
    for (auto& g : grads) g.mul_(coef);
  return total;
}

void ZeroStrategy::after_step(torch::optim::Optimizer& optimizer) {
  auto* s = find(optimizer);
  if (!s) return;
  at::NoGradGuard no_grad;
  for (auto& u : s->units) {
    auto mine = u.flat.narrow(0, u.shard.offset, u.shard.numel);
    if (!u.alias) mine.copy_(u.shard_param);
    if (ctx_.pg->size() > 1) ctx_.pg->all_gather_into(mine, u.flat);
  }
}

// The layout travels with the state, so that another number of ranks can cut it again.
checkpoint::OptimizerState ZeroStrategy::optimizer_shard_state(
    const torch::optim::Optimizer& optimizer) const {
  const auto* s = find(optimizer);
  TORCH_CHECK(s, "optimizer_shard_state: not a sharded optimizer");
  auto st = checkpoint::optimizer_state(optimizer);
  auto doc = json::parse(st.json);
  json units = json::array();
  std::map<int, size_t> index_in_group;
  for (const auto& u : s->units) {
    const size_t i = index_in_group[u.group]++;
    const auto key = checkpoint::optimizer_param_key(static_cast<size_t>(u.group), i);
    units.push_back({{"key", key}, {"numel", u.numel}, {"names", u.names}, {"param", !u.alias}});
    if (!u.alias) st.tensors.emplace_back(key + ".param", u.shard_param.detach().cpu());
  }
  doc["zero"] = {{"world", ctx_.pg->size()},
                 {"rank", ctx_.pg->rank()},
                 {"stage", options_.stage()},
                 {"units", units}};
  st.json = doc.dump(2);
  return st;
}

void ZeroStrategy::load_optimizer_shards(
    torch::optim::Optimizer& optimizer, int saved_world,
    const std::function<std::string(int)>& json_of,
    const std::function<at::Tensor(int, const std::string&)>& tensor_of) {
  auto* s = find(optimizer);
  TORCH_CHECK(s, "load_optimizer_shards: not a sharded optimizer");
  const auto& pg = *ctx_.pg;
  auto doc = json::parse(json_of(0));
  TORCH_CHECK(doc.contains("zero"), pg.prefix(), " load_state: the optimizer state was not "
              "saved sharded");
  const auto& units = doc["zero"]["units"];
  TORCH_CHECK(units.size() == s->units.size(), pg.prefix(), " load_state: the checkpoint's "
              "sharded optimizer has ", units.size(), " units, this run's ", s->units.size(),
              ": the model or its optimizer groups differ from the saved run's");
  checkpoint::OptimizerState state;
  std::map<std::string, size_t> unit_of_key;
  for (size_t k = 0; k < s->units.size(); ++k) {
    const auto& u = s->units[k];
    const auto saved_names = units[k]["names"].get<std::vector<std::string>>();
    TORCH_CHECK(units[k]["numel"].get<int64_t>() == u.numel && saved_names == u.names,
                pg.prefix(), " load_state: unit ", k, " of the checkpoint holds ",
                units[k]["numel"].get<int64_t>(), " elements (", saved_names.front(), ", ...), "
                "this run's ", u.numel, " (", u.names.front(), ", ...): the model differs from "
                "the saved run's");
    unit_of_key[units[k]["key"].get<std::string>()] = k;
  }
  // Each tensor of this rank's new chunk, assembled from the saved chunks that overlap it.
  auto assemble = [&](const Unit& u, const std::string& name) {
    at::Tensor out;
    for (const auto& piece : reshard_pieces(u.numel, saved_world, pg.size(), pg.rank())) {
      at::Tensor src = tensor_of(piece.source_rank, name);
      if (!out.defined()) out = at::zeros({u.shard.numel}, src.options());
      out.narrow(0, piece.target_offset, piece.length)
          .copy_(src.reshape({-1}).narrow(0, piece.source_offset, piece.length));
    }
    return out;
  };
  for (auto& [key, entry] : doc["state"].items()) {
    auto it = unit_of_key.find(key);
    TORCH_CHECK(it != unit_of_key.end(), pg.prefix(), " load_state: optimizer state for ", key,
                " belongs to no unit");
    const auto& u = s->units[it->second];
    for (const auto& field : entry["tensors"]) {
      const std::string name = key + "." + field.get<std::string>();
      state.tensors.emplace_back(name, assemble(u, name));
    }
  }
  // The shapes are this run's chunks.
  for (auto& group : doc["param_groups"]) {
    for (auto& shape : group["shapes"]) shape = json::array();
  }
  std::map<int, size_t> index_in_group;
  for (const auto& u : s->units) {
    const size_t i = index_in_group[u.group]++;
    doc["param_groups"][static_cast<size_t>(u.group)]["shapes"][i] = {u.shard.numel};
  }
  doc.erase("zero");
  state.json = doc.dump();
  checkpoint::load_optimizer_state(optimizer, state);
  // fp32 / host copies of the weights: restored exactly (the model file has them rounded).
  at::NoGradGuard no_grad;
  for (auto& [key, k] : unit_of_key) {
    auto& u = s->units[k];
    if (u.alias) continue;
    if (units[k].value("param", false))
      u.shard_param.copy_(assemble(u, key + ".param"));
    else  // saved without copies: the (loaded) weights are the best there is
      u.shard_param.copy_(u.flat.narrow(0, u.shard.offset, u.shard.numel));
  }
}

}  // namespace

std::unique_ptr<Strategy> make_zero_strategy(const ShardingOptions& options,
                                             StrategyContext context) {
  return std::make_unique<ZeroStrategy>(options, std::move(context));
}

}  // namespace detail
}  // namespace tandem::parallel
