// ZeRO-3's units: the flat buffers a sharded run's parameters live in, gathered and released
// around their use, prefetched in the order the first step ran them (Note [ZeRO units], Note
// [Freeing a unit], Note [Prefetching units], Note [Sharded construction]).
#pragma once

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

#include "../../compat/optimizer.h"
#include "../detail/flat_alias.h"
#include "../detail/reshard.h"
#include "../detail/state_on_disk.h"
#include "../detail/strategies.h"
#include "tandem/checkpoint/optimizer_state.h"
#include "tandem/checkpoint/model_io.h"
#include "tandem/comm/collectives.h"
#include "tandem/nn/module.h"
#include "tandem/parallel/sharded.h"
#include "tandem/parallel/zero.h"
#include "tandem/precision/policy.h"

namespace tandem::parallel::detail::zero {


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
void set_storage_numel(const at::Tensor& flat, int64_t numel);

// Gives a released unit its storage back (contents undefined).
void materialize_unit(Unit& u);

// Note [Prefetching units]: start_gather gives the unit its storage and issues its all-gather;
// finish_gather waits for it. Whatever reads or frees a unit's storage finishes its gather
// first, so a prefetched unit is never freed (nor read) while the all-gather writes into it.
void start_gather(Unit& u, ProcessGroup& pg);

void finish_gather(Unit& u, CommLog* log = nullptr);

void gather_unit(Unit& u, ProcessGroup& pg, CommLog* log = nullptr);

void release_unit(Unit& u);

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
at::Tensor released_alias(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes);

void gather_built(BuiltUnit& b, ProcessGroup& pg);

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

}  // namespace tandem::parallel::detail::zero
