// The files a strategy writes into a checkpoint for the models and optimizers it runs, and how it
// reads them back: Strategy::checkpoint_parts (see strategy.h).
//
// Note [Model-parallel checkpoints]: with tp or pp above 1 the ranks of different (tp, pp)
// coordinates hold other parameters (their shards, their stage) and other optimizer state. The
// first data-parallel rank of each coordinate writes model.mp<r> (r its global rank); every rank
// writes its optimizer.mp<r> (or, under ZeRO, its shards optimizer.rank<r>, which its sharding
// group reads back). Without model parallel the main process writes model.safetensors and
// optimizer.*, and ZeRO's optimizer.rank<r> shards reload on any number of ranks. Every file
// says how its tensors were cut, so a checkpoint loads on any other layout too (Note
// [Resharding a checkpoint]): when the mesh differs from the saving run's under model
// parallel, or an optimizer saved sharded loads unsharded (or the other way), each tensor is
// joined from its saved pieces and cut again for this rank.
#include <torch/torch.h>

#include <stdexcept>

#include <nlohmann/json.hpp>

#include "detail/reshard.h"
#include "tandem/checkpoint/layout.h"
#include "tandem/checkpoint/model_io.h"
#include "tandem/checkpoint/optimizer_state.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/checkpoint/training_state.h"
#include "tandem/comm/process_group.h"
#include "tandem/parallel/expert_parallel.h"
#include "tandem/parallel/strategy.h"
#include "tandem/parallel/tensor_parallel.h"
#include "tandem/parallel/topology.h"
#include "tandem/precision/mixed_precision.h"

namespace tandem::parallel {
namespace {

using checkpoint::StateReader;
using checkpoint::StateWriter;
using json = nlohmann::json;
namespace layout = checkpoint::layout;

// Where this rank's files go under a topology (Note [Checkpoint layout]).
struct Layout {
  const Topology& topology;

  // Note [Expert-parallel checkpoints]: the ranks of the first ep group hold every expert
  // between them, each its own; each writes a model.mp<r> and an optimizer.mp<r> as a pipeline
  // stage does (the first the rest of the model too), and a load takes every tensor by its name.
  // Under ZeRO every rank writes its shards (optimizer.rank<r>) and, beside the units, the
  // experts it holds whole, each named in the file's "zero" record (ZeroStrategy::
  // optimizer_shard_state); SavedTensors indexes them by name like any other tensor.
  bool experts() const { return topology.ep() > 1; }
  bool per_rank() const { return topology.model_parallel() || experts(); }
  int rank() const { return topology.world()->rank(); }
  // The model file of this rank's (tp, pp) coordinate: the data-parallel replicas hold the same
  // model, which their first rank writes (gathered, under ZeRO-3).
  std::string model_file(size_t i) const {
    if (!per_rank()) return layout::model_file(i);
    if (experts()) return layout::model_part_file(i, rank());
    return layout::model_part_file(i, topology.replicas()->global_rank(0));
  }
  bool writes_model(const StateWriter& w) const {
    if (experts()) return topology.replicas()->rank() < topology.ep();
    return per_rank() ? topology.replicas()->rank() == 0 : w.is_main();
  }
  // Whether this rank writes its whole optimizers' files.
  bool writes_optimizers(const StateWriter& w) const {
    return experts() ? writes_model(w) : per_rank() || w.is_main();
  }
  // This rank's whole optimizer i (add kTensors or kJson) and its masters.
  std::string optimizer_stem(size_t i) const {
    return per_rank() ? layout::optimizer_part_stem(i, rank()) : layout::optimizer_stem(i);
  }
  std::string master_weights_file(size_t i) const {
    return per_rank() ? layout::master_weights_part_file(i, rank()) : layout::master_weights_file(i);
  }
};

// Note [Pipeline checkpoint names]: a pipeline's stage is a Sequential, whose tensors are named
// by their paths in it ("3.mlp.up_proj.weight"); the same model without the pipeline names them
// its own way ("model.layers.2.mlp.up_proj.weight"). A program that gives the stage's names
// (PipelineOptions::checkpoint_names) has every file of the checkpoint written under them (the
// model files, their tensor-parallel cuts, the optimizers' records), and every load looks each
// tensor up under them: a pipeline's checkpoint then resumes on the layouts without it, by name
// as any other resharded checkpoint, and theirs under it. On the same layout the files are read
// as written, bitwise.
struct Renames {
  // A copy: the parts outlive the call that made them.
  std::vector<std::function<std::string(const std::string&)>> of;
  bool has(size_t model) const { return model < of.size() && of[model]; }
  std::function<std::string(const std::string&)> at(size_t model) const {
    return has(model) ? of[model] : nullptr;
  }
  std::string operator()(size_t model, const std::string& name) const {
    return has(model) ? of[model](name) : name;
  }
};

// The models' parameters by their qualified names (ZeRO's: "model<m>." before them with several
// models; a tied weight under its first name; renamed as `renames` says) and the
// tensor-parallel split of each.
struct ParamNames {
  std::map<const void*, std::string> name;   // detail::qualified_parameter_names
  std::map<std::string, std::string> split;  // qualified name -> "cols", "rows/P"; absent: whole

  ParamNames(const std::vector<std::shared_ptr<torch::nn::Module>>& models, const Renames& renames)
      : name(detail::qualified_parameter_names(models)) {
    for (size_t m = 0; m < models.size(); ++m) {
      const std::string prefix = models.size() > 1 ? "model" + std::to_string(m) + "." : "";
      for (const auto& [local, how] : tensor_parallel_splits(*models[m]))
        split[prefix + renames(m, local)] = how;
      if (!renames.has(m)) continue;
      for (const auto& p : models[m]->named_parameters()) {
        auto it = name.find(p.value().unsafeGetTensorImpl());
        if (it != name.end() && it->second == prefix + p.key())
          it->second = prefix + renames(m, p.key());
      }
    }
  }
  std::string how(const std::string& qualified) const {
    auto it = split.find(qualified);
    return it == split.end() ? "" : it->second;
  }
};

// Note [Resharding a checkpoint]: what a whole optimizer file records of its parameters.
std::string parameter_record(const torch::optim::Optimizer& opt, const ParamNames& names,
                             const Topology& topology) {
  layout::OptimizerRecord rec;
  rec.tp_rank = topology.coordinate("tp");
  rec.tp_size = topology.tp();
  for (const auto& group : opt.param_groups()) {
    std::vector<std::string> n, h;
    for (const auto& p : group.params()) {
      auto it = names.name.find(p.unsafeGetTensorImpl());
      const std::string q = it == names.name.end() ? "" : it->second;
      n.push_back(q);
      h.push_back(names.how(q));
    }
    rec.names.push_back(n);
    rec.splits.push_back(h);
  }
  return layout::optimizer_record_json(rec);
}

// Whether this run must reshard what `r` holds: under model parallel (here or in the saving
// run) the mesh differs.
bool mesh_changed(const StateReader& r, const Topology& topology) {
  const auto saved = layout::saved_run_layout(r);
  if (!saved.recorded) return false;  // an earlier checkpoint: its own "mesh" check decides
  // Note [Expert-parallel checkpoints]: experts split on either side: by name.
  if (saved.ep_size > 1 || topology.ep() > 1) return true;
  // Without model parallel on either side, ZeRO reshards over dp by itself.
  if (!layout::model_parallel_mesh(saved.mesh) && !topology.model_parallel()) return false;
  // Interleaved stages put other entries on each pp rank (Note [Interleaved stages]).
  return saved.mesh != topology.shape_string() ||
         saved.pp_virtual_stages != topology.pp_virtual_stages();
}

// The state of a checkpoint saved on another layout, read once per load (Note [Resharding a
// checkpoint]).
struct Resharding {
  std::unique_ptr<detail::SavedTensors> saved;
  const detail::SavedTensors& of(const StateReader& r, size_t models, size_t optimizers) {
    if (!saved) saved = std::make_unique<detail::SavedTensors>(r, models, optimizers);
    return *saved;
  }
};

void load_resharded_optimizer(Strategy& strategy, const Topology& topology,
                              precision::MixedPrecision& precision, torch::optim::Optimizer& opt,
                              size_t index, const ParamNames& names,
                              const detail::SavedTensors& saved, const StateReader& r) {
  const int tp_rank = topology.coordinate("tp"), tp = topology.tp();
  const std::string prefix = topology.world()->prefix();
  auto cut = [&](const at::Tensor& dense, const std::string& name) {
    return dense.defined() ? detail::cut_for_rank(dense, names.how(name), tp_rank, tp) : dense;
  };
  ResavedOptimizer source;
  source.json = saved.optimizer_json(index);
  source.fields = [&](const std::string& name) { return saved.fields(index, name); };
  source.field = [&](const std::string& name, const std::string& field) {
    return cut(saved.field(index, name, field), name);
  };
  source.step = [&](const std::string& name) { return saved.step(index, name); };
  source.has_master = [&](const std::string& name) { return saved.has_master(index, name); };
  source.master = [&](const std::string& name) { return cut(saved.master(index, name), name); };
  if (strategy.shards_optimizer(opt)) {
    strategy.load_optimizer_resharded(opt, source);
    return;
  }
  // A whole optimizer: its state as checkpoint::optimizer_state writes it, made of the saved
  // parameters' state under this run's parameter order.
  json doc = json::parse(source.json);
  const auto& groups = opt.param_groups();
  if (!doc.contains("param_groups") || doc["param_groups"].size() != groups.size())
    throw std::runtime_error(prefix + " load_state: the checkpoint's optimizer " +
                             std::to_string(index) + " has " +
                             std::to_string(doc.value("param_groups", json::array()).size()) +
                             " parameter groups, this run's " + std::to_string(groups.size()) +
                             ": build the optimizer as it was saved");
  checkpoint::OptimizerState state;
  json entries = json::object();
  for (size_t g = 0; g < groups.size(); ++g) {
    json shapes = json::array();
    for (size_t i = 0; i < groups[g].params().size(); ++i) {
      const auto& p = groups[g].params()[i];
      shapes.push_back(p.sizes().vec());
      auto it = names.name.find(p.unsafeGetTensorImpl());
      if (it == names.name.end())
        throw std::runtime_error(prefix + " load_state: optimizer " + std::to_string(index) +
                                 " has a parameter that belongs to no prepared model");
      const auto fields = source.fields(it->second);
      if (fields.empty()) continue;
      const auto key = checkpoint::optimizer_param_key(g, i);
      json entry{{"tensors", fields}};
      if (auto step = source.step(it->second)) entry["step"] = *step;
      entries[key] = entry;
      for (const auto& f : fields) state.tensors.emplace_back(key + "." + f, source.field(it->second, f));
    }
    doc["param_groups"][g]["num_params"] = groups[g].params().size();
    doc["param_groups"][g]["shapes"] = shapes;
  }
  doc["state"] = entries;
  state.json = doc.dump();
  checkpoint::load_optimizer_state(opt, state);
  // Masters (Note [Masters on resume]) are made again from the loaded weights.
  precision.load_master_weights(opt, nullptr, r.dir(), topology.world()->rank() == 0);
}

// Optimizer i's state, saved on this layout (or, without model parallel, on any number of
// data-parallel ranks), sharded if and only if this run shards it.
void load_optimizer(Strategy& strategy, const Layout& layout, precision::MixedPrecision& precision,
                    torch::optim::Optimizer& opt, size_t i, const StateReader& r) {
  const auto& topo = layout.topology;
  if (strategy.shards_optimizer(opt)) {
    // Each rank wrote its shards under its global rank. Under model parallel the shards of this
    // rank's (tp, pp) coordinate are those of its sharding group (the same mesh); otherwise the
    // ranks of the saving run's first replica wrote a part each (Note [Hybrid sharding]), on
    // any world size: ranks 0 to its sharding group's size.
    const auto group = topo.sharding();
    const auto rank_stem = [&](int k) {
      return layout::optimizer_shard_stem(i, layout.per_rank() ? group->global_rank(k) : k);
    };
    strategy.load_optimizer_shards(
        opt, [&](int k) { return r.read_bytes(rank_stem(k) + layout::kJson); },
        [&](int k, const std::string& name) {
          return r.tensors(rank_stem(k) + layout::kTensors).tensor(name);
        });
    return;
  }
  checkpoint::OptimizerState os;
  const auto& f = r.tensors(layout.optimizer_stem(i) + layout::kTensors);
  for (const auto& n : f.names()) os.tensors.emplace_back(n, f.tensor(n));
  os.json = r.read_bytes(layout.optimizer_stem(i) + layout::kJson);
  checkpoint::load_optimizer_state(opt, os);
  const auto masters_name = layout.master_weights_file(i);
  precision.load_master_weights(opt, r.has(masters_name) ? &r.tensors(masters_name) : nullptr,
                                r.dir(), topo.world()->rank() == 0);
}

}  // namespace

std::vector<checkpoint::StatePart> Strategy::checkpoint_parts(
    const Topology& topology, precision::MixedPrecision& precision,
    const std::vector<std::shared_ptr<torch::nn::Module>>& models,
    const std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers,
    const std::vector<std::function<std::string(const std::string&)>>& names) {
  const Layout layout{topology};
  const Renames renames{names};
  auto resharding = std::make_shared<Resharding>();
  std::vector<checkpoint::StatePart> parts;
  parts.push_back({"models",
                   [this, layout, &models, renames](StateWriter& w) {
                     if (w.is_main())
                       w.set_state(layout::kLayoutKey,
                                   layout::run_layout_json(layout.topology.shape_string(), name(),
                                                           layout.topology.pp_virtual_stages(),
                                                           layout.topology.ep()));
                     // On every rank together: a sharded strategy gathers unit by unit.
                     for (size_t i = 0; i < models.size(); ++i) {
                       auto tensors = model_state(*models[i]);
                       // Note [Expert-parallel checkpoints]: the rest once, from ep rank 0.
                       if (layout.experts() && layout.topology.replicas()->rank() > 0) {
                         const auto held = held_experts(*models[i]);
                         std::set<std::string> names;
                         for (const auto& p : models[i]->named_parameters())
                           if (held.contains(p.value())) names.insert(p.key());
                         std::vector<std::pair<std::string, at::Tensor>> mine;
                         for (auto& kv : tensors)
                           if (names.count(kv.first)) mine.push_back(std::move(kv));
                         tensors = std::move(mine);
                       }
                       for (auto& kv : tensors) kv.first = renames(i, kv.first);
                       if (layout.writes_model(w))
                         w.write_tensors(layout.model_file(i), tensors,
                                         layout.per_rank()
                                             ? layout.topology.model_file_metadata(
                                                   *models[i], renames.at(i))
                                             : std::map<std::string, std::string>());
                     }
                   },
                   [this, layout, &models, &optimizers, resharding,
                    renames](const StateReader& r) {
                     const auto& topo = layout.topology;
                     auto missing = [&](size_t i, const std::string& name) {
                       return std::runtime_error(
                           topo.world()->prefix() + " load_state: " + r.dir() +
                           " holds no tensor " + name + " for model " + std::to_string(i) +
                           ": the model differs from the saved run's");
                     };
                     if (!mesh_changed(r, topo)) {
                       for (size_t i = 0; i < models.size(); ++i) {
                         if (!renames.has(i)) {
                           load_model_state(*models[i], r.verified(layout.model_file(i)));
                           continue;
                         }
                         const auto& file = r.tensors(layout.model_file(i));
                         load_model_tensors(*models[i], [&](const std::string& name) {
                           // A checkpoint written before the stage was given its names holds
                           // the stage's own.
                           const auto saved = renames(i, name);
                           if (file.contains(saved)) return file.tensor(saved);
                           if (file.contains(name)) return file.tensor(name);
                           throw missing(i, saved);
                         });
                       }
                       return;
                     }
                     const auto& saved = resharding->of(r, models.size(), optimizers.size());
                     for (size_t i = 0; i < models.size(); ++i) {
                       const auto cuts = tensor_parallel_splits(*models[i]);
                       load_model_tensors(*models[i], [&](const std::string& name) {
                         auto dense = saved.model_tensor(i, renames(i, name));
                         if (!dense.defined()) throw missing(i, renames(i, name));
                         auto it = cuts.find(name);
                         return detail::cut_for_rank(dense, it == cuts.end() ? "" : it->second,
                                                     topo.coordinate("tp"), topo.tp());
                       });
                     }
                   }});
  parts.push_back({"optimizers",
                   [this, layout, &precision, &models, &optimizers, renames](StateWriter& w) {
                     const ParamNames names(models, renames);
                     for (size_t i = 0; i < optimizers.size(); ++i) {
                       auto& opt = *optimizers[i];
                       if (shards_optimizer(opt)) {  // every rank its shards
                         // Note [Hybrid sharding]: the other replicas hold the same ones.
                         if (!layout.per_rank() &&
                             layout.topology.coordinate("dp_replicate") != 0)
                           continue;
                         auto st = optimizer_shard_state(opt);
                         {  // Note [Resharding a checkpoint]: this rank's tp cut of each unit
                           auto doc = json::parse(st.json);
                             std::vector<std::vector<std::string>> splits;
                           for (const auto& unit : doc["zero"]["units"]) {
                             std::vector<std::string> h;
                             for (const auto& n : unit["names"]) h.push_back(names.how(n.get<std::string>()));
                             splits.push_back(h);
                           }
                           layout::OptimizerRecord rec;
                           rec.tp_rank = layout.topology.coordinate("tp");
                           rec.tp_size = layout.topology.tp();
                           rec.splits = splits;
                           doc[layout::kOptimizerRecordKey] =
                               json::parse(layout::optimizer_record_json(rec));
                           st.json = doc.dump(2);
                         }
                         const auto stem = layout::optimizer_shard_stem(i, w.rank());
                         w.write_tensors(stem + layout::kTensors, st.tensors);
                         w.write_bytes(stem + layout::kJson, st.json);
                         continue;
                       }
                       if (!layout.writes_optimizers(w)) continue;
                       auto st = checkpoint::optimizer_state(opt);
                       {
                         auto doc = json::parse(st.json);
                         doc[layout::kOptimizerRecordKey] =
                             json::parse(parameter_record(opt, names, layout.topology));
                         st.json = doc.dump(2);
                       }
                       w.write_tensors(layout.optimizer_stem(i) + layout::kTensors, st.tensors);
                       w.write_bytes(layout.optimizer_stem(i) + layout::kJson, st.json);
                       auto masters = precision.master_weights_of(opt);
                       if (!masters.empty())
                         w.write_tensors(layout.master_weights_file(i), masters);
                     }
                   },
                   [this, layout, &precision, &models, &optimizers, resharding,
                    renames](const StateReader& r) {
                     const bool changed = mesh_changed(r, layout.topology);
                     std::unique_ptr<ParamNames> names;
                     for (size_t i = 0; i < optimizers.size(); ++i) {
                       auto& opt = *optimizers[i];
                       // Rank 0 writes its shards whenever a run shards (every layout).
                       const bool saved_sharded = r.has(layout::optimizer_shard_stem(i, 0) + layout::kJson);
                       if (!changed && saved_sharded == shards_optimizer(opt)) {
                         load_optimizer(*this, layout, precision, opt, i, r);
                         continue;
                       }
                       if (!names) names = std::make_unique<ParamNames>(models, renames);
                       load_resharded_optimizer(*this, layout.topology, precision, opt, i, *names,
                                                resharding->of(r, models.size(), optimizers.size()),
                                                r);
                     }
                     resharding->saved.reset();
                   }});
  return parts;
}

}  // namespace tandem::parallel
