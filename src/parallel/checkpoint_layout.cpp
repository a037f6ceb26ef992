// The files a strategy writes into a checkpoint for the models and optimizers it runs, and how it
// reads them back: Strategy::checkpoint_parts (see strategy.h).
//
// Note [Model-parallel checkpoints]: with tp or pp above 1 the ranks of different (tp, pp)
// coordinates hold other parameters (their shards, their stage) and other optimizer state. The
// first data-parallel rank of each coordinate writes model.mp<r> (r its global rank); every rank
// writes its optimizer.mp<r> (or, under ZeRO, its shards optimizer.rank<r>, which its sharding
// group reads back). A resume needs the same mesh (the topology's "mesh" part checks it first).
// Without model parallel the main process writes model.safetensors and optimizer.*, and ZeRO's
// optimizer.rank<r> shards reload on any number of ranks.
#include <torch/torch.h>

#include <stdexcept>

#include "tandem/checkpoint/optimizer_state.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/checkpoint/training_state.h"
#include "tandem/comm/process_group.h"
#include "tandem/parallel/strategy.h"
#include "tandem/parallel/topology.h"
#include "tandem/precision/mixed_precision.h"

namespace tandem::parallel {
namespace {

using checkpoint::StateReader;
using checkpoint::StateWriter;

// "model", "model_1", ...: the i-th object of a kind.
std::string indexed(const std::string& stem, size_t i) {
  return stem + (i == 0 ? "" : "_" + std::to_string(i));
}

// Where this rank's files go under a topology.
struct Layout {
  const Topology& topology;

  bool per_rank() const { return topology.model_parallel(); }
  int rank() const { return topology.world()->rank(); }
  // A file this rank writes itself: "<stem>.mp<rank><ext>" under model parallel.
  std::string mine(const std::string& stem, size_t i, const std::string& ext) const {
    return indexed(stem, i) + (per_rank() ? ".mp" + std::to_string(rank()) : "") + ext;
  }
  // The model file of this rank's (tp, pp) coordinate: the data-parallel replicas hold the same
  // model, which their first rank writes (gathered, under ZeRO-3).
  std::string model_file(size_t i) const {
    if (!per_rank()) return mine("model", i, ".safetensors");
    return indexed("model", i) + ".mp" +
           std::to_string(topology.data_parallel()->global_rank(0)) + ".safetensors";
  }
  bool writes_model(const StateWriter& w) const {
    return per_rank() ? topology.data_parallel()->rank() == 0 : w.is_main();
  }
};

void load_optimizers(Strategy& strategy, const Layout& layout, precision::MixedPrecision& precision,
                     const std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers,
                     const StateReader& r) {
  const auto& topo = layout.topology;
  const std::string prefix = topo.world()->prefix();
  for (size_t i = 0; i < optimizers.size(); ++i) {
    auto& opt = *optimizers[i];
    const auto stem = indexed("optimizer", i);
    const bool saved_sharded = r.has(stem + ".rank0.json");
    const bool sharded = strategy.shards_optimizer(opt);
    if (saved_sharded != sharded)
      throw std::runtime_error(
          prefix + " load_state: " + r.dir() + " holds " + (saved_sharded ? "sharded" : "whole") +
          " optimizer state, but this run " +
          (sharded ? "shards it (" + strategy.name() + ")" : "does not shard it") +
          "; resume with the strategy the checkpoint was saved with (a ZeRO stage reloads on "
          "any number of ranks and from stage 1 to 2 and back)");
    if (sharded) {
      // Each rank wrote its shards under its global rank. Under model parallel the shards of
      // this rank's (tp, pp) coordinate are those of its sharding group (the same mesh: checked
      // first); otherwise the ranks of the saving run's first replica wrote a part each (Note
      // [Hybrid sharding]), on any world size: ranks 0 to its sharding group's size.
      const auto group = topo.sharding();
      const auto rank_stem = [&](int k) {
        return stem + ".rank" + std::to_string(layout.per_rank() ? group->global_rank(k) : k);
      };
      strategy.load_optimizer_shards(
          opt, [&](int k) { return r.read_bytes(rank_stem(k) + ".json"); },
          [&](int k, const std::string& name) {
            return r.tensors(rank_stem(k) + ".safetensors").tensor(name);
          });
      continue;
    }
    checkpoint::OptimizerState os;
    const auto& f = r.tensors(layout.mine("optimizer", i, ".safetensors"));
    for (const auto& n : f.names()) os.tensors.emplace_back(n, f.tensor(n));
    os.json = r.read_bytes(layout.mine("optimizer", i, ".json"));
    checkpoint::load_optimizer_state(opt, os);
    const auto masters_name = layout.mine("master_weights", i, ".safetensors");
    precision.load_master_weights(opt, r.has(masters_name) ? &r.tensors(masters_name) : nullptr,
                                  r.dir(), topo.world()->rank() == 0);
  }
}

}  // namespace

std::vector<checkpoint::StatePart> Strategy::checkpoint_parts(
    const Topology& topology, precision::MixedPrecision& precision,
    const std::vector<std::shared_ptr<torch::nn::Module>>& models,
    const std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers) {
  const Layout layout{topology};
  std::vector<checkpoint::StatePart> parts;
  parts.push_back({"models",
                   [this, layout, &models](StateWriter& w) {
                     // On every rank together: a sharded strategy gathers unit by unit.
                     for (size_t i = 0; i < models.size(); ++i) {
                       auto tensors = model_state(*models[i]);
                       if (layout.writes_model(w))
                         w.write_tensors(layout.model_file(i), tensors,
                                         layout.per_rank()
                                             ? layout.topology.model_file_metadata(*models[i])
                                             : std::map<std::string, std::string>());
                     }
                   },
                   [this, layout, &models](const StateReader& r) {
                     for (size_t i = 0; i < models.size(); ++i)
                       load_model_state(*models[i], r.verified(layout.model_file(i)));
                   }});
  parts.push_back({"optimizers",
                   [this, layout, &precision, &optimizers](StateWriter& w) {
                     for (size_t i = 0; i < optimizers.size(); ++i) {
                       auto& opt = *optimizers[i];
                       if (shards_optimizer(opt)) {  // every rank its shards
                         // Note [Hybrid sharding]: the other replicas hold the same ones.
                         if (!layout.per_rank() &&
                             layout.topology.coordinate("dp_replicate") != 0)
                           continue;
                         auto st = optimizer_shard_state(opt);
                         const auto stem =
                             indexed("optimizer", i) + ".rank" + std::to_string(w.rank());
                         w.write_tensors(stem + ".safetensors", st.tensors);
                         w.write_bytes(stem + ".json", st.json);
                         continue;
                       }
                       if (!w.is_main() && !layout.per_rank()) continue;
                       auto st = checkpoint::optimizer_state(opt);
                       w.write_tensors(layout.mine("optimizer", i, ".safetensors"), st.tensors);
                       w.write_bytes(layout.mine("optimizer", i, ".json"), st.json);
                       auto masters = precision.master_weights_of(opt);
                       if (!masters.empty())
                         w.write_tensors(layout.mine("master_weights", i, ".safetensors"),
                                         masters);
                     }
                   },
                   [this, layout, &precision, &optimizers](const StateReader& r) {
                     load_optimizers(*this, layout, precision, optimizers, r);
                   }});
  return parts;
}

}  // namespace tandem::parallel
