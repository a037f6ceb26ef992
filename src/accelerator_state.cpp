// The Accelerator's checkpoints: save_state / load_state assemble a checkpoint from the parts
// of the run's components (checkpoint/training_state.h), plus save_model and the registry of
// the user's objects.
#include <torch/torch.h>
#include "tandem/error.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <iostream>
#include <regex>
#include <set>
#include <sstream>

#include "tandem/accelerator.h"
#include "tandem/comm/collectives.h"
#include "tandem/parallel/expert_parallel.h"
#include "tandem/checkpoint/layout.h"
#include "tandem/checkpoint/model_io.h"
#include "tandem/checkpoint/optimizer_state.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/checkpoint/training_state.h"
#include "tandem/host_allocator.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

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
  TANDEM_CHECK(std::regex_match(name, std::regex("[A-Za-z0-9_.-]+")), state_.prefix(),
              " register_for_checkpointing: name '", name,
              "' must use letters, digits, '_', '-' and '.' only (it becomes a file name)");
  for (const auto& r : registered_)
    TANDEM_CHECK(r.name != name, state_.prefix(), " register_for_checkpointing: '", name,
                "' is already registered; give each object its own name");
  registered_.push_back({name, std::move(save), std::move(load)});
}

std::vector<std::pair<std::string, at::Tensor>> Accelerator::get_state_dict(
    torch::nn::Module& model) {
  auto tensors = strategy_->model_state(model);
  // Under model parallel the topology joins the tp shards and the pp stages, each under the
  // name the stage gives it (Note [Pipeline checkpoint names]).
  auto gathered = [&] {
    auto whole = topology_->gather_model_state(std::move(tensors), model);
    auto it = checkpoint_names_.find(&model);
    if (it != checkpoint_names_.end())
      for (auto& kv : whole) kv.first = it->second(kv.first);
    return whole;
  };
  // Note [Expert parallel]: the first ep group's rank 0 (the stage's first data-parallel rank)
  // holds its own experts; the others of the group send it theirs (their names, dtypes and
  // shapes first, then the tensors), before the stages go to the main process (Note [Expert
  // parallel beside a pipeline]).
  const auto held = parallel::held_experts(model);
  // Under tp every tp rank holds its experts whole: the ep group of tp rank 0 sends them (the
  // tp gather keeps tp rank 0's whole tensors).
  if (!held || topology_->replicas()->rank() >= held.ep->size() ||
      topology_->coordinate("tp") != 0)
    return gathered();
  std::vector<at::Tensor> mine;
  std::string listing;
  for (const auto& kv : model.named_parameters()) {
    if (!held.contains(kv.value())) continue;
    mine.push_back(kv.value().detach().contiguous());
    listing += kv.key() + "\t" + std::to_string(static_cast<int>(kv.value().scalar_type()));
    for (auto d : kv.value().sizes()) listing += "\t" + std::to_string(d);
    listing += "\n";
  }
  auto& group = *held.ep->group();
  const auto listings = comm::gather_object(group, listing);
  constexpr int kTag = 78;  // the experts of a saved model
  if (group.rank() != 0) {
    group.send(mine, 0, kTag, "experts to the main process");
    return gathered();
  }
  const auto device = mine.empty() ? c10::Device(c10::kCPU) : mine.front().device();
  for (int r = 1; r < group.size(); ++r) {
    std::vector<std::pair<std::string, at::Tensor>> got;
    std::vector<at::Tensor> buffers;
    std::istringstream lines(listings[static_cast<size_t>(r)]);
    for (std::string line; std::getline(lines, line);) {
      std::istringstream fields(line);
      std::string name, field;
      std::getline(fields, name, '\t');
      std::getline(fields, field, '\t');
      const auto dtype = static_cast<at::ScalarType>(std::stoi(field));
      std::vector<int64_t> shape;
      while (std::getline(fields, field, '\t')) shape.push_back(std::stoll(field));
      buffers.push_back(at::empty(shape, at::TensorOptions().dtype(dtype).device(device)));
      got.emplace_back(name, buffers.back());
    }
    group.recv(buffers, r, kTag, "experts of ep rank " + std::to_string(r));
    for (auto& kv : got) tensors.push_back(std::move(kv));
  }
  return gathered();
}

checkpoint::LoadReport Accelerator::load_model(torch::nn::Module& model, const std::string& path,
                                               const checkpoint::LoadOptions& options) {
  TANDEM_CHECK(topology_->tp() == 1 && topology_->pp() == 1, state_.prefix(),
              " load_model: this run is tensor or pipeline parallel (", topology_->summary(),
              "), whose modules hold parts of the dense tensors; load the dense weights into the "
              "dense model (checkpoint::load_model) before acc.parallelize / prepare_pipeline, "
              "or resume a training checkpoint with load_state");
  TANDEM_CHECK(!precision_->has_master_weights(), state_.prefix(),
              " load_model: an optimizer steps fp32 master copies of this model's half "
              "weights already, which loading would leave behind; load the weights before "
              "prepare(optimizer), or resume a training checkpoint with load_state");
  auto report = strategy_->load_model_state(model, path, options);
  trim_host_cache();
  return report;
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
  parts.push_back(topology_->checkpoint_part(strategy_->name()));  // the saving run's layout

  parts.push_back({"loaders",
                   [this](StateWriter& w) {
                     if (!w.is_main()) return;
                     json loaders = json::array();
                     for (auto& wl : loaders_) {
                       auto l = wl.lock();
                       // Samples per position: a resume on another data-parallel size
                       // continues at the same sample of the epoch.
                       loaders.push_back(l ? json{{"epoch", l->epoch()},
                                                  {"position", l->position()},
                                                  {"samples_per_position", l->samples_per_position()}}
                                           : json(nullptr));
                     }
                     w.set_state("loaders", loaders.dump());
                   },
                   [this](const StateReader& r) {
                     auto loaders = state_of(r, "loaders");
                     TANDEM_CHECK(loaders.size() <= loaders_.size() || loaders_.empty(),
                                 state_.prefix(), " load_state: the checkpoint has ",
                                 loaders.size(), " loaders but only ", loaders_.size(),
                                 " were prepared; prepare them before load_state");
                     const auto saved = checkpoint::layout::saved_run_layout(r);
                     loaded_.saved_layout = saved.describe();
                     loaded_.resharded =
                         loaded_.saved_layout !=
                         checkpoint::layout::SavedRunLayout{topology_->shape_string(),
                                                          strategy_->name(), state_.world_size, true,
                                                          topology_->pp_virtual_stages()}
                             .describe();
                     loaded_.random_states = r.saved_world_size() == state_.world_size;
                     if (!loaded_.random_states && is_main_process())
                       std::cerr << state_.prefix() << " load_state: the checkpoint was saved by "
                                 << r.saved_world_size() << " processes and is loaded by "
                                 << state_.world_size
                                 << ": the random states are not restored (they are per rank)"
                                 << std::endl;
                     for (size_t i = 0; i < loaders_.size() && i < loaders.size(); ++i) {
                       auto l = loaders_[i].lock();
                       if (!l || loaders[i].is_null()) continue;
                       const int64_t position = loaders[i]["position"].get<int64_t>();
                       l->set_epoch(loaders[i]["epoch"].get<int64_t>());
                       // The samples the epoch consumed, in this run's positions (an earlier
                       // checkpoint records none: its positions, on the same world).
                       const int64_t per = loaders[i].value("samples_per_position", int64_t{0});
                       const int64_t now = l->samples_per_position();
                       if (per == 0 && loaded_.random_states) {
                         l->skip_first_batches(position);
                         continue;
                       }
                       if (per > 0 && now > 0 && (position * per) % now == 0) {
                         l->skip_first_batches(position * per / now);
                         continue;
                       }
                       loaded_.loaders = false;
                       if (is_main_process())
                         std::cerr << state_.prefix() << " load_state: loader " << i
                                   << " consumed "
                                   << (per > 0 ? std::to_string(position * per) + " samples"
                                               : "an unrecorded number of samples")
                                   << " of epoch " << l->epoch() << ", which this run's "
                                   << now << " samples per batch over every rank do not meet: "
                                   << "it starts the epoch again (keep the global batch size "
                                      "to continue at the next batch)"
                                   << std::endl;
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
                     stepped_in_boundary_.clear();
                     unsynced_backwards_ = 0;
                     micro_step_ = state_of(r, "micro_step").get<int64_t>();
                     sync_gradients_ = state_of(r, "sync_gradients").get<bool>();
                     const auto n = checkpoint::checkpoint_number(r.dir());
                     if (n >= 0) checkpoints_saved_ = n + 1;
                   }});

  // The strategy's own files for the models and optimizers (Note [Model-parallel checkpoints]).
  std::vector<std::function<std::string(const std::string&)>> names;
  for (const auto& m : models_) {
    auto it = checkpoint_names_.find(m.get());
    names.push_back(it == checkpoint_names_.end() ? nullptr : it->second);
  }
  for (auto& part :
       strategy_->checkpoint_parts(*topology_, *precision_, models_, optimizers_, names))
    parts.push_back(std::move(part));

  // Note [Checkpoints inside the optimizer step]: a periodic or preemption checkpoint is taken
  // inside the optimizer step that ends a boundary, before the program's code after it, which in
  // a training loop steps the learning-rate schedulers (optimizer.step(); scheduler->step()).
  // Such a checkpoint says so, and loading it steps each prepared scheduler once, as that code
  // would have: the resumed run continues on the uninterrupted run's schedule (and learning
  // rates). A checkpoint the program saves itself is loaded as it was saved.
  parts.push_back({"schedulers",
                   [this](StateWriter& w) {
                     if (!w.is_main()) return;
                     json schedulers = json::array();
                     for (auto& s : schedulers_)
                       schedulers.push_back(checkpoint::scheduler_step_count(*s));
                     w.set_state("schedulers", schedulers.dump());
                     if (saving_inside_step_) w.set_state("schedulers_step_pending", "true");
                   },
                   [this](const StateReader& r) {
                     auto st = state_of(r, "schedulers");
                     for (size_t i = 0; i < schedulers_.size() && i < st.size(); ++i)
                       checkpoint::set_scheduler_step_count(*schedulers_[i], st[i].get<unsigned>());
                     const auto pending = r.state("schedulers_step_pending");
                     if (pending && json::parse(*pending).get<bool>())
                       for (auto& sched : schedulers_) sched->step();
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
                       w.write_bytes(checkpoint::layout::custom_file(reg.name), reg.save());
                       names.push_back(reg.name);
                     }
                     w.set_state("custom", names.dump());
                   },
                   [this](const StateReader& r) {
                     for (const auto& reg : registered_)
                       reg.load(r.read_bytes(checkpoint::layout::custom_file(reg.name)));
                   }});

  parts.push_back({"rng",
                   [](StateWriter& w) {
                     w.write_tensors(checkpoint::layout::random_states_file(w.rank()),
                                     checkpoint::rng_states());
                   },
                   [this](const StateReader& r) {
                     if (r.saved_world_size() != state_.world_size) return;
                     checkpoint::set_rng_states(r.tensors(
                         checkpoint::layout::random_states_file(state_.rank)));
                   }});
  return parts;
}

std::string Accelerator::save_state(const std::string& dir_arg) {
  return save_state(SaveOptions().dir(dir_arg));
}

std::string Accelerator::save_state(const SaveOptions& save) {
  // One save at a time: the numbering, the rotation and the host copies count on it.
  wait_for_checkpoint();
  const std::string& dir_arg = save.dir();
  fs::path target;
  if (!dir_arg.empty()) {
    target = dir_arg;
  } else {
    TANDEM_CHECK(options_.automatic_checkpoint_naming(), state_.prefix(),
                " save_state() needs a directory, or AcceleratorOptions().automatic_checkpoint_naming(true)");
    auto base = fs::path(options_.project_dir()) / "checkpoints";
    auto existing = checkpoint::complete_checkpoints(base.string());
    int64_t n = std::max<int64_t>(checkpoints_saved_, existing.empty() ? 0 : existing.back().first + 1);
    target = base / ("checkpoint_" + std::to_string(n));
  }
  target = fs::absolute(target).lexically_normal();
  // A process-level switch a test may set between two saves: read at each save.
  const auto faults = config::fault_injection();
  const checkpoint::CrashPoint crash{faults.checkpoint_crash, faults.checkpoint_crash_rank};
  const int keep_last = dir_arg.empty() ? options_.total_limit() : 0;
  if (save.async()) {
    // Note [Asynchronous checkpoints]: the manifest and the rename have a group of their own.
    if (!checkpoint_pg_) {
      std::vector<int> all(static_cast<size_t>(pg_->size()));
      for (int r = 0; r < pg_->size(); ++r) all[static_cast<size_t>(r)] = pg_->global_rank(r);
      checkpoint_pg_ = pg_->new_subgroup(all);
    }
    if (!staging_buffers_) staging_buffers_ = std::make_shared<checkpoint::StagingBuffers>();
    pending_save_ = checkpoint::save_training_state_async(*pg_, checkpoint_pg_, target.string(),
                                                          checkpoint_parts(), keep_last, crash,
                                                          staging_buffers_);
  } else {
    checkpoint::save_training_state(*pg_, target.string(), checkpoint_parts(), keep_last, crash);
  }
  if (dir_arg.empty()) {
    const auto n = checkpoint::checkpoint_number(target.string());
    if (n >= 0) checkpoints_saved_ = n + 1;
  }
  return target.string();
}

void Accelerator::wait_for_checkpoint() {
  if (!pending_save_) return;
  auto pending = std::move(pending_save_);
  pending->wait();
}

bool Accelerator::checkpoint_in_flight() const { return pending_save_ && !pending_save_->done(); }

LoadedState Accelerator::load_state(const std::string& dir_arg) {
  wait_for_checkpoint();  // the latest checkpoint may be the one being written
  std::string dir = dir_arg;
  if (dir.empty()) {
    dir = latest_checkpoint();
    if (dir.empty())
      throw std::runtime_error(state_.prefix() + " load_state: no complete checkpoint under " +
                               (fs::path(options_.project_dir()) / "checkpoints").string() +
                               "; save one with save_state() first, or pass a directory");
  }
  loaded_ = LoadedState();
  loaded_.dir = dir;
  checkpoint::load_training_state(*pg_, dir, checkpoint_parts());
  trim_host_cache();  // the files' buffers do not come again
  loaded_.step = optimizer_steps_;
  return loaded_;
}

}  // namespace tandem
