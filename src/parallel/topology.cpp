// The Topology (see topology.h): the groups of a run's layout and the arithmetic across them.
#include "tandem/parallel/topology.h"
#include "tandem/error.h"

#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <iostream>
#include <set>
#include <stdexcept>

#include "tandem/checkpoint/layout.h"
#include "tandem/comm/process_group.h"
#include "tandem/parallel/expert_parallel.h"
#include "tandem/parallel/full_state.h"
#include "tandem/parallel/strategy.h"
#include "tandem/parallel/tensor_parallel.h"

namespace tandem::parallel {
namespace {

comm::DeviceMesh build_mesh(std::shared_ptr<ProcessGroup> world, const comm::MeshShape& shape,
                            int local_world_size) {
  if (!world) throw ::tandem::Refused("Topology needs a world ProcessGroup (got nullptr)");
  const std::string prefix = world->prefix();
  try {
    return comm::make_device_mesh(std::move(world), shape, local_world_size);
  } catch (const std::invalid_argument& e) {
    throw ::tandem::Refused(prefix + " parallelism: " + e.what());
  }
}

}  // namespace

Topology::Topology(std::shared_ptr<ProcessGroup> world, const comm::MeshShape& shape,
                   int local_world_size)
    // A resolved shape resolves to itself; an unresolved one gets the data-parallel default.
    : shape_(shape.resolve(world ? world->size() : 1, local_world_size)),
      mesh_(build_mesh(std::move(world), shape_, local_world_size)) {}

int Topology::world_size() const { return mesh_.world_size(); }

std::string Topology::shape_string() const {
  std::string out;
  for (const auto& name : mesh_.names())
    out += (out.empty() ? "" : " x ") + name + " " + std::to_string(mesh_.size(name));
  return out;
}

std::string Topology::summary() const {
  return "pp " + std::to_string(pp()) + " x dp " + std::to_string(dp()) +
         (cp() > 1 ? " x cp " + std::to_string(cp()) : std::string()) + " x tp " +
         std::to_string(tp());
}

std::shared_ptr<ProcessGroup> Topology::context_parallel() const {
  // Without cp, this rank alone: the tp group of a tp-1 run, a group of one.
  return mesh_.has("cp") ? group("cp") : ProcessGroup::single();
}

double Topology::total_norm(std::array<double, 2> parts, double norm_type) const {
  const bool inf = std::isinf(norm_type);
  const auto op = inf ? ReduceOp::kMax : ReduceOp::kSum;
  auto sum = at::full({1}, parts[0], at::TensorOptions().dtype(at::kDouble));
  group("tp")->allreduce(sum, op);  // the shards of split parameters (a group of one: nothing)
  const double here = sum.item<double>();
  sum.fill_(inf ? std::max(here, parts[1]) : here + parts[1]);
  group("pp")->allreduce(sum, op);  // every stage's parameters
  return inf ? sum.item<double>() : std::pow(sum.item<double>(), 1.0 / norm_type);
}

std::vector<std::pair<std::string, at::Tensor>> Topology::gather_model_state(
    std::vector<std::pair<std::string, at::Tensor>> local, torch::nn::Module& model) const {
  if (!model_parallel()) return local;  // every data-parallel rank holds the whole model
  // The first data-parallel replica of every (tp, pp) coordinate joins its tp shards and sends
  // its stage to rank 0 (the others hold copies).
  return gather_model_parallel_state(local, tensor_parallel_splits(model),
                                     tp() > 1 ? group("tp").get() : nullptr,
                                     pp() > 1 ? group("pp").get() : nullptr,
                                     replicas()->rank() == 0);
}

// Note [Tensor-parallel shards in checkpoints]: a model.mp<r> file of a tensor-parallel run says
// in its safetensors metadata which tp rank wrote it ("tandem_tp_rank", "tandem_tp_size") and how
// each split tensor was cut ("tandem_tp_split": {name: "rows/<parts>" | "cols"}, parallelize_
// module's split), so that merge_weights can join the shards into the dense tensors.
std::map<std::string, std::string> Topology::model_file_metadata(
    torch::nn::Module& model, const std::function<std::string(const std::string&)>& rename) const {
  checkpoint::layout::TpCut cut;
  if (tp() > 1) {
    cut.size = tp();
    cut.rank = coordinate("tp");
    for (const auto& [name, how] : tensor_parallel_splits(model))
      cut.split[rename ? rename(name) : name] = how;
  }
  return checkpoint::layout::model_part_metadata(
      shape_string(), pp() > 1 ? std::optional<int>(coordinate("pp")) : std::nullopt, cut);
}

checkpoint::StatePart Topology::checkpoint_part(const std::string& strategy) const {
  return {"mesh",
          [this](checkpoint::StateWriter& w) {
            if (w.is_main() && model_parallel())
              w.set_state(checkpoint::layout::kMeshKey,
                          checkpoint::layout::mesh_json(shape_string()));
          },
          [this, strategy](const checkpoint::StateReader& r) {
            const auto saved = checkpoint::layout::saved_run_layout(r);
            const std::string mine = shape_string();
            if (!saved.recorded) {  // an earlier tandem's checkpoint: its shards are per mesh
              const std::string theirs = saved.mesh;
              if ((model_parallel() ? mine : "") != theirs)
                throw std::runtime_error(
                    world()->prefix() + " load_state: " + r.dir() + " was saved by a run on " +
                    (theirs.empty() ? "no model-parallel mesh" : "the mesh " + theirs) +
                    " and this run has " +
                    (model_parallel() ? "the mesh " + checkpoint::layout::short_mesh(mine) : "none") +
                    ": a checkpoint of an earlier tandem records no layout, so its shards resume "
                    "only on the same mesh; launch with the sizes it was saved with");
              return;
            }
            // Note [Resharding a checkpoint]: any other layout loads too; said once.
            checkpoint::layout::SavedRunLayout here{mine, strategy, world_size(), true,
                                                    pp_virtual_stages(), ep()};
            if (world()->rank() == 0 && saved.describe() != here.describe())
              std::cerr << world()->prefix() << " load_state: " << r.dir() << " was saved on "
                        << saved.describe() << "; resuming on " << here.describe()
                        << (((saved.mesh != mine || saved.pp_virtual_stages != pp_virtual_stages()) &&
                             (model_parallel() || checkpoint::layout::model_parallel_mesh(saved.mesh))) ||
                                    saved.ep_size != ep()
                                ? ": every tensor is joined from its saved pieces and cut again"
                                : "")
                        << std::endl;
          }};
}

// Note [Clipping under model parallel]: the total norm is that of the dense, unsharded model's
// gradients (as FSDP's clip_grad_norm_, the whole model's).
//  - Sharded gradients (ZeRO): every rank's shards together; the strategy sums over its
//    (data-parallel) group.
//  - Tensor parallel: a split parameter (a TensorParallelModule's weight, and its bias unless it
//    is a row-parallel bias, which every tp rank holds whole) contributes the norms of every tp
//    rank's shard, summed over "tp"; a replicated one (LayerNorm, a row-parallel bias)
//    contributes once, from this rank's copy, which equals every other's.
//  - Pipeline parallel: each stage holds other parameters, so the stages' sums add up over "pp".
// For the infinity norm, maxima instead of sums. Plain data parallel (whole gradients, no
// model parallel) is LibTorch's clip_grad_norm_ itself, so it equals a plain loop bit for bit.
double clip_grad_norm(const Topology& topology, Strategy& strategy,
                      const std::vector<at::Tensor>& tensors,
                      const std::vector<std::shared_ptr<torch::nn::Module>>& models,
                      double max_norm, double norm_type) {
  std::set<const void*> split;
  if (topology.tp() > 1)
    for (const auto& m : models) {
      const auto cuts = tensor_parallel_splits(*m);
      for (const auto& p : m->named_parameters())
        if (cuts.count(p.key())) split.insert(p.value().unsafeGetTensorImpl());
    }
  std::function<bool(const at::Tensor&)> is_split;
  if (!split.empty())
    is_split = [&split](const at::Tensor& t) { return split.count(t.unsafeGetTensorImpl()) > 0; };
  torch::NoGradGuard no_grad;
  const bool inf = std::isinf(norm_type);
  // Note [Expert parallel]: the experts a rank holds (whole, under data parallel and ZeRO alike)
  // are its ep group's part of the model: their sum goes over the ep group, beside the rest.
  const auto held = held_experts(models);
  auto parts = strategy.grad_norm_parts(is_split, norm_type);  // ZeRO: never the experts
  const bool sharded = parts.has_value();
  if (!sharded && !topology.model_parallel() && !held)  // whole gradients on every dp rank
    return torch::nn::utils::clip_grad_norm_(tensors, max_norm, norm_type);
  std::array<double, 3> own{0, 0, 0};  // this rank's {split, the rest, experts}
  for (const auto& t : tensors) {
    if (!t.grad().defined()) continue;
    const bool expert = held && held.contains(t);
    if (sharded && !expert) continue;  // the strategy counted it
    const double n = t.grad().detach().to(at::kDouble).norm(norm_type).item<double>();
    auto& part = own[expert ? 2 : is_split && is_split(t) ? 0 : 1];
    part = inf ? std::max(part, n) : part + std::pow(n, norm_type);
  }
  if (!sharded) parts = std::array<double, 2>{own[0], own[1]};
  if (held) {  // whole on every tp rank of the ep group: beside the rest
    auto sum = at::full({1}, own[2], at::TensorOptions().dtype(at::kDouble));
    held.ep->group()->allreduce(sum, inf ? ReduceOp::kMax : ReduceOp::kSum);
    const double e = sum.item<double>();
    (*parts)[1] = inf ? std::max((*parts)[1], e) : (*parts)[1] + e;
  }
  const double total = topology.total_norm(*parts, norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) {
    if (sharded) strategy.scale_gradients(coef);
    for (const auto& t : tensors)
      if (t.grad().defined() && (!sharded || (held && held.contains(t))))
        t.grad().detach().mul_(coef);
  }
  return total;
}

}  // namespace tandem::parallel
