// The Accelerator's checkpoints: save_state / load_state assemble a checkpoint from the parts
// of the run's components (checkpoint/training_state.h), plus save_model and the registry of
// the user's objects.
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <iostream>
#include <regex>

#include "tandem/accelerator.h"
#include "tandem/checkpoint/model_io.h"
#include "tandem/checkpoint/optimizer_state.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/checkpoint/training_state.h"
#include "tandem/parallel/full_state.h"
#include "tandem/parallel/tensor_parallel.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string indexed(const std::string& stem, size_t i, const std::string& ext) {
  return stem + (i == 0 ? "" : "_" + std::to_string(i)) + ext;
}

json state_of(const checkpoint::StateReader& r, const std::string& key) {
  auto s = r.state(key);
  if (!s)
    throw std::runtime_error(r.prefix() + " load_state: " + r.dir() + "/state.json has no '" +
                             key + "': it was not written by tandem's save_state");
  return json::parse(*s);
}

}  // namespace

std::string Accelerator::latest_checkpoint() const {
  auto all = checkpoint::complete_checkpoints(
      (fs::path(options_.project_dir()) / "checkpoints").string());
  return all.empty() ? "" : all.back().second;
}

void Accelerator::register_for_checkpointing(const std::string& name,
                                             std::function<std::string()> save,
                                             std::function<void(const std::string&)> load) {
  TORCH_CHECK(std::regex_match(name, std::regex("[A-Za-z0-9_.-]+")), state_.prefix(),
              " register_for_checkpointing: name '", name,
              "' must use letters, digits, '_', '-' and '.' only (it becomes a file name)");
  for (const auto& r : registered_)
    TORCH_CHECK(r.name != name, state_.prefix(), " register_for_checkpointing: '", name,
                "' is already registered; give each object its own name");
  registered_.push_back({name, std::move(save), std::move(load)});
}

std::vector<std::pair<std::string, at::Tensor>> Accelerator::get_state_dict(
    torch::nn::Module& model) {
  auto tensors = strategy_->model_state(model);
  if (!mesh_) return tensors;
  // A mesh: the first data-parallel replica of every (tp, pp) coordinate joins its tp shards
  // and sends its stage to rank 0 (the others hold copies).
  return parallel::gather_model_parallel_state(
      tensors, parallel::tensor_parallel_splits(model),
      mesh_->size("tp") > 1 ? (*mesh_)["tp"].get() : nullptr,
      mesh_->size("pp") > 1 ? (*mesh_)["pp"].get() : nullptr, dp_->rank() == 0);
}

void Accelerator::save_model(const torch::nn::Module& model, const std::string& dir,
                             const std::string& max_shard_size) {
  std::string error;
  // Every rank takes part: a sharded strategy gathers the model unit by unit to rank 0, and a
  // mesh joins its shards and stages (get_state_dict).
  auto tensors = get_state_dict(const_cast<torch::nn::Module&>(model));
  if (is_main_process()) {
    try {
      checkpoint::save_model_tensors(tensors, dir, max_shard_size);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // Every rank learns whether the main process succeeded.
  auto status = comm::broadcast_object(*pg_, error, 0);
  if (!status.empty()) throw std::runtime_error(state_.prefix() + " save_model failed on rank 0: " + status);
}

// The parts, in the order every rank saves and loads them. Loading checks the loaders first, so
// that a mismatch is refused before anything is changed.
std::vector<checkpoint::StatePart> Accelerator::checkpoint_parts() {
  using checkpoint::StateReader;
  using checkpoint::StateWriter;
  std::vector<checkpoint::StatePart> parts;
  // Note [Model-parallel checkpoints]: with a mesh (tp or pp above 1) the ranks of different
  // (tp, pp) coordinates hold other parameters (their shards, their stage) and other optimizer
  // state. The first data-parallel rank of each coordinate writes model.mp<r> (r its global
  // rank); every rank writes its optimizer.mp<r> (or, under ZeRO, its shards
  // optimizer.rank<r>, which its data-parallel group reads back). A resume needs the same mesh.
  const bool per_rank = mesh_ != nullptr;
  auto mine = [this, per_rank](const std::string& stem, size_t i, const std::string& ext) {
    return indexed(stem, i, "") + (per_rank ? ".mp" + std::to_string(state_.rank) : "") + ext;
  };
  // The model's file of this rank's (tp, pp) coordinate: the data-parallel replicas hold the
  // same model, which their first rank writes (gathered, under ZeRO-3).
  auto model_file = [this, per_rank, mine](size_t i) {
    return per_rank ? indexed("model", i, "") + ".mp" + std::to_string(dp_->global_rank(0)) +
                          ".safetensors"
                    : mine("model", i, ".safetensors");
  };

  parts.push_back({"mesh",
                   [this](StateWriter& w) {
                     if (w.is_main() && mesh_)
                       w.set_state("mesh", json(mesh_shape_string()).dump());
                   },
                   [this](const StateReader& r) {
                     auto saved = r.state("mesh");
                     const std::string mine_shape = mesh_ ? mesh_shape_string() : "";
                     const std::string theirs = saved ? json::parse(*saved).get<std::string>() : "";
                     if (mine_shape != theirs)
                       throw std::runtime_error(
                           state_.prefix() + " load_state: " + r.dir() + " was saved by a run on " +
                           (theirs.empty() ? "no model-parallel mesh" : "the mesh " + theirs) +
                           " and this run has " +
                           (mine_shape.empty() ? "none" : "the mesh " + mine_shape) +
                           ": every rank's shards resume only on the same mesh; launch with the "
                           "sizes it was saved with");
                   }});

  parts.push_back({"loaders",
                   [this](StateWriter& w) {
                     if (!w.is_main()) return;
                     json loaders = json::array();
                     for (auto& wl : loaders_) {
                       auto l = wl.lock();
                       loaders.push_back(l ? json{{"epoch", l->epoch()}, {"position", l->position()}}
                                           : json(nullptr));
                     }
                     w.set_state("loaders", loaders.dump());
                   },
                   [this](const StateReader& r) {
                     auto loaders = state_of(r, "loaders");
                     TORCH_CHECK(loaders.size() <= loaders_.size() || loaders_.empty(),
                                 state_.prefix(), " load_state: the checkpoint has ",
                                 loaders.size(), " loaders but only ", loaders_.size(),
                                 " were prepared; prepare them before load_state");
                     if (r.saved_world_size() != state_.world_size) {
                       if (is_main_process())
                         std::cerr << state_.prefix() << " load_state: the checkpoint was saved by "
                                   << r.saved_world_size() << " processes and is loaded by "
                                   << state_.world_size
                                   << ": models and optimizers are restored, but loader positions "
                                      "and random states are not (they are per rank)"
                                   << std::endl;
                       return;
                     }
                     for (size_t i = 0; i < loaders_.size() && i < loaders.size(); ++i) {
                       auto l = loaders_[i].lock();
                       if (!l || loaders[i].is_null()) continue;
                       l->set_epoch(loaders[i]["epoch"].get<int64_t>());
                       l->skip_first_batches(loaders[i]["position"].get<int64_t>());
                     }
                   }});

  parts.push_back({"loop",
                   [this](StateWriter& w) {
                     if (!w.is_main()) return;
                     w.set_state("optimizer_steps", json(optimizer_steps_).dump());
                     w.set_state("micro_step", json(micro_step_).dump());
                     w.set_state("sync_gradients", json(sync_gradients_).dump());
                     w.set_state("gradient_accumulation_steps", json(accumulation_steps_).dump());
                     w.set_state("checkpoint_number", json(w.name()).dump());
                   },
                   [this](const StateReader& r) {
                     optimizer_steps_ = state_of(r, "optimizer_steps").get<int64_t>();
                     micro_step_ = state_of(r, "micro_step").get<int64_t>();
                     sync_gradients_ = state_of(r, "sync_gradients").get<bool>();
                     const auto n = checkpoint::checkpoint_number(r.dir());
                     if (n >= 0) checkpoints_saved_ = n + 1;
                   }});

  parts.push_back({"models",
                   [this, per_rank, model_file](StateWriter& w) {
                     // On every rank together: a sharded strategy gathers unit by unit.
                     for (size_t i = 0; i < models_.size(); ++i) {
                       auto tensors = strategy_->model_state(*models_[i]);
                       if (per_rank ? dp_->rank() == 0 : w.is_main())
                         w.write_tensors(model_file(i), tensors,
                                         per_rank ? model_parallel_metadata(*models_[i])
                                                  : std::map<std::string, std::string>());
                     }
                   },
                   [this, model_file](const StateReader& r) {
                     for (size_t i = 0; i < models_.size(); ++i)
                       strategy_->load_model_state(*models_[i], r.verified(model_file(i)));
                   }});

  parts.push_back({"optimizers",
                   [this, per_rank, mine](StateWriter& w) {
                     for (size_t i = 0; i < optimizers_.size(); ++i) {
                       auto& opt = *optimizers_[i];
                       if (strategy_->shards_optimizer(opt)) {  // every rank its shards
                         auto st = strategy_->optimizer_shard_state(opt);
                         const auto stem =
                             indexed("optimizer", i, "") + ".rank" + std::to_string(w.rank());
                         w.write_tensors(stem + ".safetensors", st.tensors);
                         w.write_bytes(stem + ".json", st.json);
                         continue;
                       }
                       if (!w.is_main() && !per_rank) continue;
                       auto st = checkpoint::optimizer_state(opt);
                       w.write_tensors(mine("optimizer", i, ".safetensors"), st.tensors);
                       w.write_bytes(mine("optimizer", i, ".json"), st.json);
                       auto masters = precision_->master_weights_of(opt);
                       if (!masters.empty())
                         w.write_tensors(mine("master_weights", i, ".safetensors"), masters);
                     }
                   },
                   [this](const StateReader& r) { load_optimizers(r); }});

  parts.push_back({"schedulers",
                   [this](StateWriter& w) {
                     if (!w.is_main()) return;
                     json schedulers = json::array();
                     for (auto& s : schedulers_)
                       schedulers.push_back(checkpoint::scheduler_step_count(*s));
                     w.set_state("schedulers", schedulers.dump());
                   },
                   [this](const StateReader& r) {
                     auto st = state_of(r, "schedulers");
                     for (size_t i = 0; i < schedulers_.size() && i < st.size(); ++i)
                       checkpoint::set_scheduler_step_count(*schedulers_[i], st[i].get<unsigned>());
                   }});

  parts.push_back({"precision",
                   [this](StateWriter& w) {
                     if (w.is_main() && precision_->scaler())
                       w.set_state("scaler", precision_->state_dict());
                   },
                   [this](const StateReader& r) {
                     if (auto s = r.state("scaler")) precision_->load_state_dict(*s);
                   }});

  parts.push_back({"tracking",
                   [this](StateWriter& w) {
                     if (w.is_main()) w.set_state("tracking", recorder_->state_dict());
                   },
                   [this](const StateReader& r) {
                     if (auto s = r.state("tracking")) recorder_->load_state_dict(*s);
                   }});

  parts.push_back({"custom",
                   [this](StateWriter& w) {
                     if (!w.is_main()) return;
                     json names = json::array();
                     for (const auto& reg : registered_) {
                       w.write_bytes("custom_" + reg.name + ".bin", reg.save());
                       names.push_back(reg.name);
                     }
                     w.set_state("custom", names.dump());
                   },
                   [this](const StateReader& r) {
                     for (const auto& reg : registered_)
                       reg.load(r.read_bytes("custom_" + reg.name + ".bin"));
                   }});

  parts.push_back({"rng",
                   [](StateWriter& w) {
                     w.write_tensors("random_states_" + std::to_string(w.rank()) + ".safetensors",
                                     checkpoint::rng_states());
                   },
                   [this](const StateReader& r) {
                     if (r.saved_world_size() != state_.world_size) return;
                     checkpoint::set_rng_states(r.tensors(
                         "random_states_" + std::to_string(state_.rank) + ".safetensors"));
                   }});
  return parts;
}

void Accelerator::load_optimizers(const checkpoint::StateReader& r) {
  for (size_t i = 0; i < optimizers_.size(); ++i) {
    auto& opt = *optimizers_[i];
    const auto stem = indexed("optimizer", i, "");
    const bool saved_sharded = r.has(stem + ".rank0.json");
    const bool sharded = strategy_->shards_optimizer(opt);
    if (saved_sharded != sharded)
      throw std::runtime_error(
          state_.prefix() + " load_state: " + r.dir() + " holds " +
          (saved_sharded ? "sharded" : "whole") + " optimizer state, but this run " +
          (sharded ? "shards it (" + strategy_->name() + ")" : "does not shard it") +
          "; resume with the strategy the checkpoint was saved with (a ZeRO stage reloads on "
          "any number of ranks and from stage 1 to 2 and back)");
    if (sharded) {
      // Each rank wrote its shards under its global rank; on a mesh the shards of this rank's
      // (tp, pp) coordinate are those of its data-parallel group (the same mesh: checked first).
      const auto rank_stem = [&](int k) {
        return stem + ".rank" + std::to_string(mesh_ ? dp_->global_rank(k) : k);
      };
      strategy_->load_optimizer_shards(
          opt, mesh_ ? dp_->size() : r.saved_world_size(),
          [&](int k) { return r.read_bytes(rank_stem(k) + ".json"); },
          [&](int k, const std::string& name) {
            return r.tensors(rank_stem(k) + ".safetensors").tensor(name);
          });
      continue;
    }
    const std::string mp = mesh_ ? ".mp" + std::to_string(state_.rank) : "";  // Note [Model-parallel checkpoints]
    checkpoint::OptimizerState os;
    const auto& f = r.tensors(stem + mp + ".safetensors");
    for (const auto& n : f.names()) os.tensors.emplace_back(n, f.tensor(n));
    os.json = r.read_bytes(stem + mp + ".json");
    checkpoint::load_optimizer_state(opt, os);
    const auto masters_name = indexed("master_weights", i, "") + mp + ".safetensors";
    precision_->load_master_weights(opt, r.has(masters_name) ? &r.tensors(masters_name) : nullptr,
                                    r.dir(), is_main_process());
  }
}

std::string Accelerator::save_state(const std::string& dir_arg) {
  fs::path target;
  if (!dir_arg.empty()) {
    target = dir_arg;
  } else {
    TORCH_CHECK(options_.automatic_checkpoint_naming(), state_.prefix(),
                " save_state() needs a directory, or AcceleratorOptions().automatic_checkpoint_naming(true)");
    auto base = fs::path(options_.project_dir()) / "checkpoints";
    auto existing = checkpoint::complete_checkpoints(base.string());
    int64_t n = std::max<int64_t>(checkpoints_saved_, existing.empty() ? 0 : existing.back().first + 1);
    target = base / ("checkpoint_" + std::to_string(n));
  }
  target = fs::absolute(target).lexically_normal();
  checkpoint::save_training_state(*pg_, target.string(), checkpoint_parts(),
                                  dir_arg.empty() ? options_.total_limit() : 0);
  if (dir_arg.empty()) {
    const auto n = checkpoint::checkpoint_number(target.string());
    if (n >= 0) checkpoints_saved_ = n + 1;
  }
  return target.string();
}

void Accelerator::load_state(const std::string& dir_arg) {
  std::string dir = dir_arg;
  if (dir.empty()) {
    dir = latest_checkpoint();
    if (dir.empty())
      throw std::runtime_error(state_.prefix() + " load_state: no complete checkpoint under " +
                               (fs::path(options_.project_dir()) / "checkpoints").string() +
                               "; save one with save_state() first, or pass a directory");
  }
  checkpoint::load_training_state(*pg_, dir, checkpoint_parts());
}

// Note [Tensor-parallel shards in checkpoints]: a model.mp<r> file of a tensor-parallel run says
// in its safetensors metadata which tp rank wrote it ("tandem_tp_rank", "tandem_tp_size") and how
// each split tensor was cut ("tandem_tp_split": {name: "rows/<parts>" | "cols"}, parallelize_
// module's split), so that merge_weights can join the shards into the dense tensors.
std::map<std::string, std::string> Accelerator::model_parallel_metadata(
    torch::nn::Module& model) const {
  std::map<std::string, std::string> meta{{"format", "pt"}, {"tandem_mesh", mesh_shape_string()}};
  if (mesh_->size("pp") > 1) meta["tandem_pp_stage"] = std::to_string(mesh_->coordinate("pp"));
  if (mesh_->size("tp") == 1) return meta;
  json split = json::object();
  for (const auto& [name, how] : parallel::tensor_parallel_splits(model)) split[name] = how;
  meta["tandem_tp_rank"] = std::to_string(mesh_->coordinate("tp"));
  meta["tandem_tp_size"] = std::to_string(mesh_->size("tp"));
  meta["tandem_tp_split"] = split.dump();
  return meta;
}

std::string Accelerator::mesh_shape_string() const {
  std::string out;
  for (const auto& name : mesh_->names())
    out += (out.empty() ? "" : " x ") + name + " " + std::to_string(mesh_->size(name));
  return out;
}

}  // namespace tandem
