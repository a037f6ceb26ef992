// ZeRO stages 1, 2 and 3 (see zero.h, Note [ZeRO units]; stage 3 units are Sharded modules, sharded.h).
#include "tandem/parallel/zero.h"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "../compat/optimizer.h"
#include "detail/flat_alias.h"
#include "detail/reshard.h"
#include "detail/state_on_disk.h"
#include "detail/strategies.h"
#include "tandem/checkpoint/optimizer_state.h"
#include "tandem/checkpoint/model_io.h"
#include "tandem/comm/collectives.h"
#include "tandem/nn/module.h"
#include "tandem/parallel/sharded.h"
#include "tandem/precision/policy.h"

namespace tandem::parallel {

ShardInfo shard_of(int64_t numel, int world, int rank) {
  const int64_t chunk = padded_chunk_numel(numel, world);
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
  std::vector<at::Tensor> params;  // the model's parameters, views of flat
  std::vector<int64_t> offsets;    // where each parameter starts in flat
  // Stage 3: a unit of a Sharded module is resident only between gather() and release();
  // units of the root (parameters of no Sharded module, tied ones) stay resident.
  bool resident = true;
  bool gathered = true;
  // Note [Prefetching units]: an all-gather issued ahead of use, not yet waited on, and the
  // unit's module hooks (for BACKWARD_POST).
  Work gathering;
  bool in_flight = false;
  bool prefetched = false;  // issued ahead of its use
  std::chrono::steady_clock::time_point issued;
  struct UnitHooks* hooks = nullptr;
  // Note [Clearing sharded gradients through the model]: the marker each parameter's .grad
  // holds once its gradient went into the shard (undefined: none planted), and its version then.
  std::vector<at::Tensor> markers;
  std::vector<int64_t> marker_versions;
  bool reduced_since_plant = false;  // stages 2-3: its gradient went into the shard
};

// The timeline's view of stage 3's all-gathers (Strategy::take_comm_spans).
struct CommLog {
  bool record = false;
  std::vector<CommSpan> spans;
  void add(std::string name, std::chrono::steady_clock::time_point start,
           std::chrono::steady_clock::time_point end, bool wait) {
    // Bounded: a run that never calls backward (evaluation only) is not drained.
    if (record && spans.size() < (size_t{1} << 16)) spans.push_back({std::move(name), start, end, wait});
  }
};

// Note [Freeing a unit]: the parameters of a released unit keep their TensorImpls (the
// optimizer, autograd's saved tensors and the model all hold them) and their sizes; only the
// storage they share with `flat` gives its bytes back (nbytes 0). gather() allocates the storage
// again and all-gathers the chunks into it, so every tensor that aliases it, saved ones
// included, sees the parameters again. Nothing reads a released unit's parameters: a Sharded
// module gathers before its forward and before its backward.
// Gives `flat`'s storage `numel` elements again (contents undefined), or (0) takes its bytes.
void set_storage_numel(const at::Tensor& flat, int64_t numel) {
  auto* storage = flat.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(numel) * flat.element_size();
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

// Gives a released unit its storage back (contents undefined).
void materialize_unit(Unit& u) {
  set_storage_numel(u.flat, u.padded);
  u.gathered = true;
}

// Note [Prefetching units]: start_gather gives the unit its storage and issues its all-gather;
// finish_gather waits for it. Whatever reads or frees a unit's storage finishes its gather
// first, so a prefetched unit is never freed (nor read) while the all-gather writes into it.
void start_gather(Unit& u, ProcessGroup& pg) {
  if (u.gathered) return;
  materialize_unit(u);
  at::NoGradGuard no_grad;
  at::Tensor src = u.shard_param.detach();
  if (src.scalar_type() != u.flat.scalar_type() || src.device() != u.flat.device())
    src = src.to(u.flat.options());
  if (pg.size() > 1) {
    u.gathering = pg.all_gather_into_async(src, u.flat);
    u.in_flight = true;
    u.prefetched = false;
    u.issued = std::chrono::steady_clock::now();
  } else {
    u.flat.copy_(src);
  }
}

void finish_gather(Unit& u, CommLog* log = nullptr) {
  if (!u.in_flight) return;
  const auto begin = std::chrono::steady_clock::now();
  const bool done_before = u.gathering.completed();
  u.gathering.wait();
  u.gathering = Work();  // the collective's buffers (the list form's parts) go with it
  u.in_flight = false;
  const auto end = std::chrono::steady_clock::now();
  if (log) {
    log->add("all-gather unit " + std::to_string(u.bucket) +
                 (u.prefetched ? " (prefetched)" : ""),
             u.issued, done_before ? begin : end, false);
    if (!done_before) log->add("wait for all-gather", begin, end, true);
  }
}

void gather_unit(Unit& u, ProcessGroup& pg, CommLog* log = nullptr) {
  start_gather(u, pg);
  finish_gather(u, log);
}

void release_unit(Unit& u) {
  finish_gather(u);
  if (u.resident || !u.gathered) return;
  set_storage_numel(u.flat, 0);
  u.gathered = false;
}

// Note [Sharded construction] (tandem/nn/module.h): a module built under Accelerator::build
// that is a unit is flattened once complete, padded to a multiple of the group's size as a
// unit is, and only this rank's chunk is kept: its parameters become views of a flat buffer
// whose storage is released at once, so that every rank holds one dense block at most while
// the model is built. prepare_optimizer adopts the chunk as the unit's shard when the unit
// holds exactly these parameters in this order (one parameter group, one dtype), and otherwise
// gathers the built unit once to cut the optimizer's units from it.
struct BuiltUnit {
  std::vector<at::Tensor> params;
  std::vector<int64_t> offsets;
  int64_t numel = 0;
  int64_t padded = 0;
  ShardInfo shard;
  at::Tensor flat;   // storage released, except while gathered
  at::Tensor chunk;  // this rank's elements
  bool gathered = false;
  size_t moved = 0;  // parameters that prepare_optimizer placed in units of their own
};

// A tensor of `sizes` at `offset` of `flat`'s storage, made without giving the storage its bytes
// (set_ would: a released storage has none): what a released unit's parameter is.
at::Tensor released_alias(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage());  // zero elements of the (empty) storage
  auto* impl = t.unsafeGetTensorImpl();
  impl->set_storage_offset(flat.storage_offset() + offset);
  impl->set_sizes_contiguous(sizes);
  return t;
}

void gather_built(BuiltUnit& b, ProcessGroup& pg) {
  if (b.gathered) return;
  set_storage_numel(b.flat, b.padded);
  at::NoGradGuard no_grad;
  if (pg.size() > 1)
    pg.all_gather_into(b.chunk, b.flat);
  else
    b.flat.copy_(b.chunk);
  b.gathered = true;
}

// Note [Prefetching units]: the order in which the units' forwards ran in the first step
// (recorded until the first backward starts), and the prefetches it allows: in forward, the
// next unit's all-gather is issued when a unit's forward starts; in backward, the unit that
// runs next (the one before it in forward order) when a unit's backward starts (BACKWARD_PRE)
// or once its gradients are reduced (BACKWARD_POST). At most one unit is gathered ahead of the
// one computing, so at most two are gathered at a time (FSDP's limit_all_gathers). Every rank
// records the same order and issues the same all-gathers in it.
struct UnitHooks;
struct Prefetch {
  bool forward = false;
  std::string backward = "NO_PREFETCH";
  bool reshard_after_forward = true;
  std::vector<UnitHooks*> order;
  bool frozen = false;
  UnitHooks* after(UnitHooks* h, int step) const {
    auto it = std::find(order.begin(), order.end(), h);
    if (it == order.end()) return nullptr;
    const auto pos = (it - order.begin()) + step;
    return pos >= 0 && pos < static_cast<std::ptrdiff_t>(order.size()) ? order[pos] : nullptr;
  }
};

// Stage 3: what a Sharded module does around its forward and backward, for its units (one per
// parameter group and dtype, of every optimizer it belongs to).
struct UnitHooks : detail::ShardedHooks {
  std::vector<Unit*> units;
  ProcessGroup* pg = nullptr;
  Prefetch* prefetch = nullptr;
  CommLog* log = nullptr;
  void start() {
    for (auto* u : units)
      if (!u->gathered) {
        start_gather(*u, *pg);
        u->prefetched = true;
      }
  }
  void before_forward() override {
    for (auto* u : units) gather_unit(*u, *pg, log);
    if (!prefetch->frozen) {
      if (std::find(prefetch->order.begin(), prefetch->order.end(), this) == prefetch->order.end())
        prefetch->order.push_back(this);
    } else if (prefetch->forward) {
      if (auto* next = prefetch->after(this, 1)) next->start();
    }
  }
  void after_forward() override {
    // Kept until its backward (reshard_after_forward false), unless no backward comes.
    if (!prefetch->reshard_after_forward && at::GradMode::is_enabled()) return;
    for (auto* u : units) release_unit(*u);
  }
  void before_backward() override {
    prefetch->frozen = true;  // the forward order is known from here on
    for (auto* u : units) gather_unit(*u, *pg, log);
    if (prefetch->backward == "BACKWARD_PRE")
      if (auto* next = prefetch->after(this, -1)) next->start();
  }
  // A unit's gradients are reduced (and its parameters freed).
  void after_reduction() {
    if (prefetch->backward == "BACKWARD_POST")
      if (auto* next = prefetch->after(this, -1)) next->start();
  }
};

// Note [Hybrid sharding]: with dp_replicate above 1 (FSDP's HYBRID_SHARD and
// HYBRID_SHARD_ZERO2: one replica per machine), ZeRO's group is the ranks of one replica
// ("dp_shard"): its all-gathers and reduce-scatters stay inside a machine. Each gradient is
// divided by the whole data-parallel size on its way into its bucket, reduced over the replica,
// and this rank's reduced chunk is then allreduced over its replicas ("dp_replicate": the ranks
// of the other machines that hold the same chunk), so that every replica steps the same shards
// with the average of every rank's gradients, as data parallel does. What crosses machines per
// step is the shards' gradients (2 (R-1)/R of the shard per rank), never parameters. The
// unused-parameter map spans every data-parallel rank; the gradient norm sums over one replica
// (the others hold the same chunks); checkpoints hold the first replica's shards.
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

struct ShardedOptimizer;

// Note [Clearing sharded gradients through the model]: from stage 2 on, a parameter's gradient
// lives in its unit's shard (shard_param.grad()) once reduced, and the parameter's own .grad is
// released. LibTorch programs clear gradients through the model too (`model->zero_grad()`, a
// loop of `p.grad().zero_()`), which would never reach the shards: the next step would add the
// old gradient in. So each released .grad holds a marker instead, a meta tensor of the
// parameter's shape (no memory): `zero_grad()` through the module resets it (set_to_none) or
// replaces it with a zeroed detached copy, and `p.grad().zero_()` bumps its version. The next
// backward's first gradient hook (a tensor hook, which runs before autograd accumulates into
// .grad) reads every marker, zeroes the shard's slice of each parameter cleared through any of
// these routes (all of a unit's parameters cleared and none zeroed in place: the shard gradient
// is dropped, as set_to_none does), and removes the markers, so autograd accumulates into an
// empty .grad as before. A parameter whose marker is untouched keeps its shard gradient, which
// the backward adds to, as .grad accumulates under data parallel.
// Markers are planted when the backward's reduction is over (the last bucket's finish), never
// during it:
// a unit reduced early in a backward would otherwise have its markers taken by the check of a
// later parameter's hook in the same backward, and a later clearing would be missed.
struct MarkerCheck {
  ShardedOptimizer* owner = nullptr;
  std::mutex mu;
  bool planted = false;
  void check();
  void plant();  // every unit reduced since the last planting
  void drop();   // the strategy lets go: no marker stays in a parameter's .grad
};

struct ShardedOptimizer {
  torch::optim::Optimizer* optimizer = nullptr;
  std::shared_ptr<MarkerCheck> markers = std::make_shared<MarkerCheck>();
  std::unique_ptr<GradientReducer> reducer;
  std::vector<Unit> units;
  std::vector<size_t> unit_of_bucket;
  std::shared_ptr<ProcessGroup> pg;
  std::shared_ptr<ProcessGroup> replicas;  // Note [Hybrid sharding]; null without replicas
  std::unique_ptr<StateOnDisk> disk;       // Note [Optimizer state on disk]; null: in memory
  ~ShardedOptimizer() { markers->drop(); }
};

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
  // Stage 3: the unit's backward is over (all of its gradients are in): free its parameters.
  release_unit(u);
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

class ZeroStrategy : public Strategy {
 public:
  ZeroStrategy(ShardingOptions options, StrategyContext ctx)
      : options_(std::move(options)), ctx_(std::move(ctx)) {
    prefetch_.forward = options_.forward_prefetch();
    prefetch_.backward = options_.backward_prefetch();
    prefetch_.reshard_after_forward = options_.reshard_after_forward();
    if ((options_.offload_optimizer() || options_.offload_params()) && ctx_.device.is_cpu() &&
        ctx_.pg->rank() == 0)
      std::cerr << ctx_.pg->prefix() << " " << options_.origin()
                << ": optimizer offload to the CPU: this run is on the CPU already, so the "
                   "shards and their step stay where they are" << std::endl;
  }
  std::string name() const override { return "zero-" + std::to_string(options_.stage()); }

  void prepare_model(const std::shared_ptr<torch::nn::Module>& model) override {
    models_.push_back(model);
    if (options_.stage() != 3) return;
    const size_t before = units_.size();
    find_units(model);
    // FSDP's root wrap: a model declared with TANDEM_MODULE whose forward reaches no other unit
    // is one unit itself, gathered for its forward and backward, released in between.
    if (units_.size() == before && tandem::nn::hookable(*model) && !is_unit(*model))
      add_hooked(model, "");
    report_units(*model, before);
  }
  // Note [A model ZeRO-3 cannot reach]: a model whose modules are all held by typed torch::nn
  // members (`torch::nn::Linear fc1;` called as `fc1(x)`) has no module a wrapper or a hook
  // reaches, so no parameter could be released between uses: stage 3 would keep every weight
  // whole on every rank while saying "zero-3". LibTorch has no forward hooks on its own
  // modules, so instead of pretending, such a model is refused with the fixes; a model with
  // some units says how much of it is sharded.
  void report_units(const torch::nn::Module& model, size_t before) {
    // Parameters under several names (tied) stay in the root, resident, whatever module holds
    // them.
    std::map<const void*, int> names;
    std::set<const void*> all;
    int64_t elements = 0;
    for (const auto& p : model.named_parameters()) {
      ++names[p.value().unsafeGetTensorImpl()];
      if (p.value().requires_grad() && all.insert(p.value().unsafeGetTensorImpl()).second)
        elements += p.value().numel();
    }
    std::set<const void*> in_units;
    int64_t unit_elements = 0;
    for (size_t k = before; k < units_.size(); ++k)
      for (const auto& p : units_[k]->parameters()) {
        const void* key = p.unsafeGetTensorImpl();
        if (p.requires_grad() && names[key] == 1 && in_units.insert(key).second)
          unit_elements += p.numel();
      }
    const std::string label = model_label(model, static_cast<int>(models_.size()));
    if (all.empty()) return;
    if (in_units.empty())
      throw std::invalid_argument(
          ctx_.pg->prefix() + " " + options_.origin() + ": ZeRO-3 finds no module of " + label +
          " that it can gather and release (its " + std::to_string(all.size()) +
          " parameters would stay whole on every rank, which is ZeRO-2's memory under "
          "ZeRO-3's name): its layers are typed torch::nn members called directly, which no "
          "wrapper or hook reaches. Declare the model with TANDEM_MODULE(" +
          tandem::nn::module_type_name(model) +
          ") instead of TORCH_MODULE, which makes the whole model one unit (FSDP's root "
          "wrap), or its blocks with TANDEM_MODULE(Block) and its layers as tandem::nn::Linear "
          "(tandem/nn/module.h: one change per holder), or hold them in a torch::nn::Sequential "
          "or tandem::parallel::Sharded; or ask for ZeRO stage 2 (--zero_stage 2), which "
          "shards this model's gradients and optimizer state");
    if (ctx_.pg->rank() == 0) {
      std::ostringstream os;
      os << ctx_.pg->prefix() << " zero-3 on " << label << ": " << (units_.size() - before)
         << " unit" << (units_.size() - before == 1 ? "" : "s") << ", " << in_units.size()
         << " of " << all.size() << " parameters sharded (" << std::fixed
         << std::setprecision(1) << 100.0 * static_cast<double>(unit_elements) /
                static_cast<double>(std::max<int64_t>(1, elements))
         << "% of the elements)";
      if (in_units.size() < all.size())
        os << "; the rest (tied parameters and those outside every unit) stay whole on every "
              "rank";
      std::cerr << os.str() << std::endl;
    }
  }
  void find_units(const std::shared_ptr<torch::nn::Module>& model) {
    // Note [ZeRO-3 units on hooks]: the units are the modules the user wrapped in Sharded, the
    // Sequential entries the auto-wrap policy picks (wrapped in Sharded in place), and hookable
    // modules (TANDEM_MODULE types, tandem::nn layers) anywhere in the model, which get a
    // "zero-3 unit" forward hook instead of a wrapper: a model that calls its blocks through
    // typed members (`for (auto& b : blocks) x = b(x);`) has per-block units too.
    for (const auto& m : model->modules(/*include_self=*/true))
      if (auto w = std::dynamic_pointer_cast<ShardedImpl>(m)) add_wrapper(w);
    if (options_.auto_wrap_policy() == "NO_WRAP") return;
    const auto& classes = options_.transformer_layer_cls_to_wrap();
    if (!classes.empty() && options_.auto_wrap_policy() == "TRANSFORMER_BASED_WRAP") {
      wrap_classes(*model, classes);
      return;
    }
    for (auto& w : wrap_sequential_entries(*model, options_.min_num_params())) add_wrapper(w);
    // Hookable modules outside every unit: the outermost ones with at least min_num_params
    // parameters (under TRANSFORMER_BASED_WRAP, modules a user declared, not tandem::nn's
    // standard layers).
    const bool any_layer = options_.auto_wrap_policy() == "SIZE_BASED_WRAP";
    std::function<void(torch::nn::Module&)> visit = [&](torch::nn::Module& m) {
      for (const auto& child : m.children()) {
        if (is_unit(*child)) continue;
        auto* h = tandem::nn::hookable(*child);
        if (h && (any_layer || !h->standard_layer()) &&
            parameter_count(*child) >= std::max<int64_t>(1, options_.min_num_params())) {
          add_hooked(child, "");
          continue;
        }
        visit(*child);
      }
    };
    visit(*model);
  }

  bool prepare_optimizer(torch::optim::Optimizer& optimizer) override;

  void set_sync(bool sync) override {
    sync_ = sync;
    for (auto& s : sharded_) s->reducer->set_sync(sync);
  }
  void after_backward() override {
    for (auto& s : sharded_) s->reducer->after_backward();
    // Stage 3 without synchronisation (accumulation micro-steps): no reduction freed the units
    // that backward gathered; free them here.
    if (!sync_)
      for (auto& s : sharded_)
        for (auto& u : s->units) release_unit(u);
  }
  std::optional<std::array<double, 2>> grad_norm_parts(
      const std::function<bool(const at::Tensor&)>& split, double norm_type) override;
  void scale_gradients(double coef) override {
    at::NoGradGuard no_grad;
    for (auto& s : sharded_)
      for (auto& u : s->units)
        if (u.shard_param.grad().defined()) u.shard_param.mutable_grad().mul_(coef);
  }
  bool clip_grad_value(double clip_value) override {
    at::NoGradGuard no_grad;
    for (auto& s : sharded_)
      for (auto& u : s->units)
        if (u.shard_param.grad().defined())
          u.shard_param.mutable_grad().clamp_(-clip_value, clip_value);
    return true;
  }
  void after_step(torch::optim::Optimizer& optimizer) override;
  void step(torch::optim::Optimizer& optimizer) override;
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
      torch::optim::Optimizer& optimizer,
      const std::function<std::string(int)>& json_of,
      const std::function<at::Tensor(int, const std::string&)>& tensor_of) override;
  void load_optimizer_resharded(torch::optim::Optimizer& optimizer,
                                const ResavedOptimizer& saved) override;
  void load_model_tensors(torch::nn::Module& model,
                          const std::function<at::Tensor(const std::string&)>& local) override;
  std::map<const void*, std::vector<checkpoint::TensorSlice>> released_slices(
      torch::nn::Module& model, std::vector<Unit*>& resident_copies);
  void gather_units() override {
    for (auto& s : sharded_)
      for (auto& u : s->units) gather_unit(u, *ctx_.pg);
  }
  void release_units() override {
    for (auto& s : sharded_)
      for (auto& u : s->units) release_unit(u);
  }
  std::vector<const GradientReducer*> reducers() const override {
    std::vector<const GradientReducer*> out;
    for (const auto& s : sharded_) out.push_back(s->reducer.get());
    return out;
  }
  bool shards_construction() const override { return options_.stage() == 3; }
  std::vector<CommSpan> take_comm_spans() override {
    std::vector<CommSpan> out;
    out.swap(comm_log_.spans);
    return out;
  }
  void record_comm_spans(bool record) override { comm_log_.record = record; }
  // The auto-wrap policy of prepare_model, seen from one module at a time: Sharded wrappers,
  // the named classes, or (the BuildScope already chose the outermost hookable modules) those
  // with enough parameters, tandem::nn's standard layers only under SIZE_BASED_WRAP.
  bool unit_at_construction(torch::nn::Module& m, bool explicit_unit) override {
    if (options_.stage() != 3) return false;
    if (explicit_unit) return true;
    const auto& policy = options_.auto_wrap_policy();
    if (policy == "NO_WRAP") return false;
    auto* h = tandem::nn::hookable(m);
    if (!h) return false;
    const auto& classes = options_.transformer_layer_cls_to_wrap();
    if (!classes.empty() && policy == "TRANSFORMER_BASED_WRAP")
      return std::find(classes.begin(), classes.end(), h->type_name()) != classes.end();
    return (policy == "SIZE_BASED_WRAP" || !h->standard_layer()) &&
           parameter_count(m) >= std::max<int64_t>(1, options_.min_num_params());
  }
  void shard_built(torch::nn::Module& m) override;

 private:
  ShardedOptimizer* find(const torch::optim::Optimizer& o) const {
    for (const auto& s : sharded_)
      if (s->optimizer == &o) return s.get();
    return nullptr;
  }
  void check_same_layout(const ShardedOptimizer& s);

  static int64_t parameter_count(const torch::nn::Module& m) {
    int64_t n = 0;
    for (const auto& p : m.parameters()) n += p.numel();
    return n;
  }
  bool is_unit(const torch::nn::Module& m) const {
    for (const auto& u : units_)
      if (u.get() == &m) return true;
    for (const auto& u : units_)
      if (auto* w = dynamic_cast<const ShardedImpl*>(u.get()); w && w->inner().get() == &m)
        return true;
    return false;
  }
  std::shared_ptr<UnitHooks> make_hooks() {
    auto hooks = std::make_shared<UnitHooks>();
    hooks->pg = ctx_.pg.get();
    hooks->prefetch = &prefetch_;
    hooks->log = &comm_log_;
    return hooks;
  }
  void add_wrapper(const std::shared_ptr<ShardedImpl>& w) {
    for (const auto& known : units_)
      if (known.get() == w.get()) return;
    auto hooks = make_hooks();
    w->set_hooks(hooks);
    units_.push_back(w);
    hooks_.push_back(hooks);
  }
  // A hookable module becomes a unit through a forward hook (what Sharded does around its
  // forward, sharded.cpp).
  void add_hooked(const std::shared_ptr<torch::nn::Module>& m, const std::string& path) {
    for (const auto& known : units_)
      if (known.get() == m.get()) return;
    auto* h = tandem::nn::hookable(*m);
    auto hooks = make_hooks();
    h->hooks().add("zero-3 unit", tandem::nn::order::kShard,
                   [hooks](const std::vector<at::Tensor>& in, const tandem::nn::TensorFunction& next) {
                     return detail::run_unit(hooks, [&] { return next(in); });
                   });
    (void)path;
    units_.push_back(m);
    hooks_.push_back(hooks);
  }
  // fsdp_transformer_layer_cls_to_wrap: every module of those classes is a unit, hookable ones
  // by a hook, Sequential entries by a Sharded wrapper; a class that names no module, or a
  // module that can be neither, is refused.
  void wrap_classes(torch::nn::Module& model, const std::vector<std::string>& classes) {
    auto wanted = [&](const torch::nn::Module& m) {
      return std::find(classes.begin(), classes.end(), tandem::nn::module_type_name(m)) !=
             classes.end();
    };
    std::set<std::string> found, present;
    for (auto& w : wrap_sequential_entries(model, 1, [&](torch::nn::Module& m) { return wanted(m); })) {
      found.insert(tandem::nn::module_type_name(*w->inner()));
      add_wrapper(w);
    }
    std::function<void(torch::nn::Module&, const std::string&)> visit =
        [&](torch::nn::Module& m, const std::string& prefix) {
          for (const auto& item : m.named_children()) {
            const auto& child = item.value();
            const std::string path = prefix.empty() ? item.key() : prefix + "." + item.key();
            if (is_unit(*child)) continue;
            present.insert(tandem::nn::module_type_name(*child));
            if (wanted(*child)) {
              if (!tandem::nn::hookable(*child))
                throw std::invalid_argument(
                    ctx_.pg->prefix() + " " + options_.origin() + ": " + path + " is a " +
                    tandem::nn::module_type_name(*child) +
                    " (fsdp_transformer_layer_cls_to_wrap), but its parent calls it directly, "
                    "where no wrapper reaches it; declare it with TANDEM_MODULE(" +
                    tandem::nn::module_type_name(*child) +
                    ") instead of TORCH_MODULE (tandem/nn/module.h), or put it in a Sequential");
              found.insert(tandem::nn::module_type_name(*child));
              add_hooked(child, path);
              continue;
            }
            visit(*child, path);
          }
        };
    visit(model, "");
    std::string missing;
    for (const auto& c : classes)
      if (!found.count(c)) missing += (missing.empty() ? "" : ", ") + c;
    if (!missing.empty()) {
      std::string have;
      for (const auto& t : present) have += (have.empty() ? "" : ", ") + t;
      throw std::invalid_argument(ctx_.pg->prefix() + " " + options_.origin() +
                                  ": fsdp_transformer_layer_cls_to_wrap names " + missing +
                                  ", which is no module of the model (its module types: " + have +
                                  "); name the class of the model's blocks, as declared "
                                  "(TANDEM_MODULE(Block) is \"Block\")");
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> model_state(torch::nn::Module& model) override;
  checkpoint::LoadReport load_model_state(torch::nn::Module& model, const std::string& path,
                                          const checkpoint::LoadOptions& options) override;

  ShardingOptions options_;
  StrategyContext ctx_;
  std::vector<std::shared_ptr<torch::nn::Module>> models_;
  std::vector<std::shared_ptr<torch::nn::Module>> units_;  // stage 3: Sharded or hooked modules
  std::vector<std::shared_ptr<UnitHooks>> hooks_;          // of units_, in the same order
  std::vector<std::unique_ptr<ShardedOptimizer>> sharded_;
  bool sync_ = true;
  // Note [Sharded construction]: units built under Accelerator::build, until prepare_optimizer
  // places their parameters.
  std::vector<std::unique_ptr<BuiltUnit>> built_;
  std::map<const void*, BuiltUnit*> built_of_;
  Prefetch prefetch_;  // Note [Prefetching units]
  CommLog comm_log_;
  BuiltUnit* built_of(const at::Tensor& p) const {
    auto it = built_of_.find(p.unsafeGetTensorImpl());
    return it == built_of_.end() ? nullptr : it->second;
  }
  // A built unit whose parameters all moved (or that is kept whole) is forgotten; its
  // parameters keep whatever storage they now have.
  void forget_built(BuiltUnit* b) {
    for (const auto& p : b->params) built_of_.erase(p.unsafeGetTensorImpl());
    built_.erase(std::remove_if(built_.begin(), built_.end(),
                                [b](const std::unique_ptr<BuiltUnit>& x) { return x.get() == b; }),
                 built_.end());
  }
};

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

bool ZeroStrategy::prepare_optimizer(torch::optim::Optimizer& optimizer) {
  auto& pg = *ctx_.pg;
  auto fail = [&](const std::string& what) { throw std::invalid_argument(pg.prefix() + " prepare: " + what); };
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
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::vector<int> groups;
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
  // The optimizer steps this rank's chunks, one tensor per unit, in its own groups.
  for (size_t g = 0; g < param_groups.size(); ++g) {
    std::vector<at::Tensor> shards;
    for (const auto& u : s->units)
      if (u.group == static_cast<int>(g)) shards.push_back(u.shard_param);
    param_groups[g].params() = shards;
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

// The layout travels with the state, so that another number of ranks can cut it again.
checkpoint::OptimizerState ZeroStrategy::optimizer_shard_state(
    const torch::optim::Optimizer& optimizer) const {
  const auto* s = find(optimizer);
  TORCH_CHECK(s, "optimizer_shard_state: not a sharded optimizer");
  // Note [Optimizer state on disk]: read for the save, and let go again after it.
  std::vector<StateFields> read_back;
  if (s->disk)
    for (size_t k = 0; k < s->units.size(); ++k) {
      read_back.push_back(checkpoint::optimizer_state_tensors(
          const_cast<torch::optim::Optimizer&>(optimizer), s->units[k].shard_param));
      s->disk->load_copy(k, read_back.back());
    }
  auto st = checkpoint::optimizer_state(optimizer);
  for (size_t k = 0; k < read_back.size(); ++k)
    if (s->disk->on_disk(k))
      for (auto& [name, t] : read_back[k]) *t = at::Tensor();  // the copies live on in `st` alone
  auto doc = json::parse(st.json);
  json units = json::array();
  const auto index = index_in_group(*s);
  for (size_t k = 0; k < s->units.size(); ++k) {
    const auto& u = s->units[k];
    const auto key = checkpoint::optimizer_param_key(static_cast<size_t>(u.group), index[k]);
    json shapes = json::array();  // Note [Resharding a checkpoint]: each parameter's shape
    for (const auto& p : u.params) shapes.push_back(p.sizes().vec());
    units.push_back({{"key", key}, {"numel", u.numel}, {"names", u.names}, {"shapes", shapes},
                     {"param", !u.alias}});
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
    torch::optim::Optimizer& optimizer,
    const std::function<std::string(int)>& json_of,
    const std::function<at::Tensor(int, const std::string&)>& tensor_of) {
  auto* s = find(optimizer);
  TORCH_CHECK(s, "load_optimizer_shards: not a sharded optimizer");
  const auto& pg = *ctx_.pg;
  auto doc = json::parse(json_of(0));
  TORCH_CHECK(doc.contains("zero"), pg.prefix(), " load_state: the optimizer state was not "
              "saved sharded");
  const json units = doc["zero"]["units"];  // a copy: "zero" is erased below
  // The saving run's sharding group: its world, or under hybrid sharding one replica's ranks
  // (Note [Hybrid sharding]: the first replica wrote the parts).
  const int saved_world = doc["zero"].at("world").get<int>();
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
    // A chunk that is padding only (a 3-element unit on 4 ranks) has no pieces: zeros.
    at::Tensor out = at::zeros({u.shard.numel}, u.shard_param.options().requires_grad(false));
    for (const auto& piece : reshard_pieces(u.numel, saved_world, pg.size(), pg.rank())) {
      at::Tensor src = tensor_of(piece.source_rank, name);
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
  const auto index = index_in_group(*s);
  for (size_t k = 0; k < s->units.size(); ++k)
    doc["param_groups"][static_cast<size_t>(s->units[k].group)]["shapes"][index[k]] =
        {s->units[k].shard.numel};
  doc.erase("zero");
  state.json = doc.dump();
  checkpoint::load_optimizer_state(optimizer, state);
  if (s->disk)  // Note [Optimizer state on disk]: the loaded state goes to the file
    for (size_t k = 0; k < s->units.size(); ++k)
      s->disk->store(k, checkpoint::optimizer_state_tensors(optimizer, s->units[k].shard_param));
  // fp32 / host copies of the weights: restored exactly (the model file has them rounded).
  at::NoGradGuard no_grad;
  for (auto& [key, k] : unit_of_key) {
    auto& u = s->units[k];
    if (u.alias) continue;
    if (units[k].value("param", false))
      u.shard_param.copy_(assemble(u, key + ".param"));
    else if (u.resident)  // saved without copies: the (loaded) weights are the best there is
      u.shard_param.copy_(u.flat.narrow(0, u.shard.offset, u.shard.numel));
  }
}

// Note [Full state, one unit at a time]: every rank gathers each released unit in turn (the
// same collectives in the same order everywhere); the main process copies its parameters out
// and every rank frees it again, so no rank but the main one ever holds more than one unit
// beyond its shards.
std::vector<std::pair<std::string, at::Tensor>> ZeroStrategy::model_state(
    torch::nn::Module& model) {
  // The first replica's first rank (its replicas hold the same shards).
  const bool main = ctx_.pg->rank() == 0 && (!ctx_.replicate_pg || ctx_.replicate_pg->rank() == 0);
  std::map<const void*, at::Tensor> copies;
  std::set<const void*> in_model;
  for (const auto& p : model.parameters()) in_model.insert(p.unsafeGetTensorImpl());
  at::NoGradGuard no_grad;
  for (auto& s : sharded_)
    for (auto& u : s->units) {
      if (u.resident || !in_model.count(u.params.front().unsafeGetTensorImpl())) continue;
      gather_unit(u, *ctx_.pg);
      if (main)
        for (const auto& p : u.params)
          copies[p.unsafeGetTensorImpl()] = p.detach().to(at::kCPU, false, true);
      release_unit(u);
    }
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (!main) return out;  // only the main process writes models
  for (const auto& kv : model.named_parameters()) {
    if (!kv.value().defined()) continue;
    auto it = copies.find(kv.value().unsafeGetTensorImpl());
    out.emplace_back(kv.key(), it != copies.end() ? it->second : kv.value().detach());
  }
  for (const auto& kv : model.named_buffers())
    if (kv.value().defined()) out.emplace_back(kv.key(), kv.value().detach());
  return out;
}

// Note [Resharding a checkpoint]: the optimizer of a run saved on another layout, restored
// through load_optimizer_shards as if one rank had saved this run's units whole: each unit's
// tensors are its parameters' dense state (cut for this rank's tp coordinate) laid end to end,
// made when asked for, one unit and field at a time.
void ZeroStrategy::load_optimizer_resharded(torch::optim::Optimizer& optimizer,
                                            const ResavedOptimizer& saved) {
  auto* s = find(optimizer);
  TORCH_CHECK(s, "load_optimizer_resharded: not a sharded optimizer");
  json doc = json::parse(saved.json);
  const auto& pg = *ctx_.pg;
  const size_t groups = optimizer.param_groups().size();
  TORCH_CHECK(doc.contains("param_groups") && doc["param_groups"].size() == groups, pg.prefix(),
              " load_state: the checkpoint's optimizer has ",
              doc.contains("param_groups") ? doc["param_groups"].size() : 0,
              " parameter groups, this run's ", groups, ": build the optimizer as it was saved");
  json units = json::array(), state = json::object();
  const auto index = index_in_group(*s);
  std::vector<size_t> per_group(groups, 0);
  std::map<std::string, const Unit*> unit_of_key;
  for (size_t k = 0; k < s->units.size(); ++k) {
    const auto& u = s->units[k];
    ++per_group[static_cast<size_t>(u.group)];
    const auto key = checkpoint::optimizer_param_key(static_cast<size_t>(u.group), index[k]);
    unit_of_key[key] = &u;
    bool masters = !u.alias;
    for (const auto& n : u.names) masters = masters && saved.has_master(n);
    units.push_back({{"key", key}, {"numel", u.numel}, {"names", u.names}, {"param", masters}});
    const auto fields = saved.fields(u.names.front());
    if (fields.empty()) continue;
    json entry{{"tensors", fields}};
    if (auto step = saved.step(u.names.front())) entry["step"] = *step;
    state[key] = entry;
  }
  for (size_t g = 0; g < groups; ++g) {
    doc["param_groups"][g]["num_params"] = per_group[g];
    doc["param_groups"][g]["shapes"] = json::array();
  }
  doc["state"] = state;
  doc["zero"] = {{"world", 1}, {"rank", 0}, {"stage", options_.stage()}, {"units", units}};
  const std::string text = doc.dump();
  load_optimizer_shards(
      optimizer, [&](int) { return text; },
      [&](int, const std::string& name) {
        const auto dot = name.rfind('.');
        const auto key = name.substr(0, dot), field = name.substr(dot + 1);
        const Unit& u = *unit_of_key.at(key);
        std::vector<at::Tensor> parts;
        for (const auto& n : u.names) {
          auto t = field == "param" ? saved.master(n) : saved.field(n, field);
          TORCH_CHECK(t.defined(), pg.prefix(), " load_state: the checkpoint has no ", field,
                      " for ", n, ", but does for ", u.names.front(), " of the same unit");
          parts.push_back(t.reshape({-1}));
        }
        return at::cat(parts);
      });
}

// The parameters of `model` whose storage is released here (ZeRO-3 units between uses, units
// sharded as they were built): the slices of them this rank holds. The units' resident copies
// (fp32 or host shards of resident units), which follow the weights once they are loaded, go
// to `resident_copies`.
std::map<const void*, std::vector<checkpoint::TensorSlice>> ZeroStrategy::released_slices(
    torch::nn::Module& model, std::vector<Unit*>& resident_copies) {
  std::set<const void*> in_model;
  for (const auto& p : model.parameters()) in_model.insert(p.unsafeGetTensorImpl());
  for (auto& s : sharded_)
    for (auto& u : s->units) finish_gather(u);  // no all-gather writes while the file is read
  std::map<const void*, std::vector<checkpoint::TensorSlice>> slices;
  // The parameters laid end to end at `offsets`, of which this rank holds `chunk`, elements
  // [shard.offset, shard.offset + shard.numel).
  auto add_slices = [&](const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets,
                        const ShardInfo& shard, const at::Tensor& chunk) {
    for (size_t k = 0; k < params.size(); ++k) {
      auto& parts = slices[params[k].unsafeGetTensorImpl()];  // present even when empty
      const int64_t begin = std::max(offsets[k], shard.offset);
      const int64_t end = std::min(offsets[k] + params[k].numel(), shard.offset + shard.numel);
      if (begin < end)
        parts.push_back({begin - offsets[k], chunk.detach().narrow(0, begin - shard.offset, end - begin)});
    }
  };
  for (auto& s : sharded_)
    for (auto& u : s->units) {
      if (!in_model.count(u.params.front().unsafeGetTensorImpl())) continue;
      if (u.resident || u.gathered) {
        if (!u.alias) resident_copies.push_back(&u);
        continue;
      }
      add_slices(u.params, u.offsets, u.shard, u.shard_param);
    }
  // Units sharded while the model was built, before prepare(optimizer) made them its units.
  for (auto& b : built_)
    if (!b->gathered && in_model.count(b->params.front().unsafeGetTensorImpl()))
      add_slices(b->params, b->offsets, b->shard, b->chunk);
  return slices;
}

void ZeroStrategy::load_model_tensors(torch::nn::Module& model,
                                      const std::function<at::Tensor(const std::string&)>& local) {
  std::vector<Unit*> resident_copies;
  const auto slices = released_slices(model, resident_copies);
  at::NoGradGuard no_grad;
  auto load = [&](const std::string& name, at::Tensor& t) {
    auto source = local(name);
    auto it = slices.find(t.unsafeGetTensorImpl());
    if (it == slices.end()) {
      t.copy_(source);
      return;
    }
    TORCH_CHECK(source.sizes() == t.sizes(), ctx_.pg->prefix(), " load_state: ", name,
                " has shape ", source.sizes(), " in the checkpoint, ", t.sizes(), " here");
    auto flat = source.reshape({-1});
    for (const auto& slice : it->second)
      slice.dst.copy_(flat.narrow(0, slice.begin, slice.dst.numel()));
  };
  for (auto p : model.named_parameters()) load(p.key(), p.value());
  for (auto b : model.named_buffers())
    if (b.value().defined()) load(b.key(), b.value());
  for (auto* u : resident_copies)
    u->shard_param.copy_(u->flat.narrow(0, u->shard.offset, u->shard.numel));
}

// Note [Loading into shards]: a released unit's parameters are read only where this rank's
// chunk covers them (the safetensors headers give each tensor's offsets, so each rank reads its
// byte ranges and no rank holds the whole model); resident units are loaded whole. The checks
// of load_model (names, shapes, dtypes, strict) see every parameter as it is in the model.
checkpoint::LoadReport ZeroStrategy::load_model_state(torch::nn::Module& model,
                                                      const std::string& path,
                                                      const checkpoint::LoadOptions& options) {
  std::vector<Unit*> resident_copies;
  const auto slices = released_slices(model, resident_copies);
  auto report = checkpoint::load_model(model, path, options,
                         [&](const at::Tensor& t) -> std::optional<std::vector<checkpoint::TensorSlice>> {
                           auto it = slices.find(t.unsafeGetTensorImpl());
                           if (it == slices.end()) return std::nullopt;
                           return it->second;
                         });
  // fp32 or host copies of resident units follow the loaded weights.
  at::NoGradGuard no_grad;
  for (auto* u : resident_copies)
    u->shard_param.copy_(u->flat.narrow(0, u->shard.offset, u->shard.numel));
  return report;
}

}  // namespace

std::unique_ptr<Strategy> make_zero_strategy(const ShardingOptions& options,
                                             StrategyContext context) {
  return std::make_unique<ZeroStrategy>(options, std::move(context));
}

}  // namespace detail
}  // namespace tandem::parallel
