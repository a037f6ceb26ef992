// Accelerator::save_state / load_state: the full training state, saved atomically by every rank
// and resumed exactly.
//
// Layout of a checkpoint directory:
//   model.safetensors, model_1.safetensors ...        prepared models (main process)
//   optimizer.safetensors + optimizer.json, _1 ...    optimizer state and hyper-parameters (main)
//   master_weights.safetensors, _1 ...                fp32 masters of the -true modes, keyed as
//                                                     the optimizer state ("g<group>.p<index>")
//   optimizer.rank<r>.safetensors + .json, _1 ...     a sharded optimizer (ZeRO): every rank's
//                                                     shards, with the layout in the JSON, so
//                                                     that any number of ranks can resume
//   state.json                                        counters, loaders, schedulers, scaler (main)
//   custom_<name>.bin                                 registered objects (main)
//   random_states_<rank>.safetensors                  every rank's RNG states (each rank)
//   manifest.json                                     size and xxh64 of every file (main, last)
//
// Note [Atomic checkpoints]: every rank writes into <parent>/.<name>.tmp and fsyncs its files;
// the ranks' file lists and any failure are gathered on rank 0, which writes manifest.json,
// fsyncs, and renames the directory into place (then fsyncs the parent). A crash at any moment
// leaves either the previous checkpoints alone (the temporary directory is never taken for a
// checkpoint: its name starts with a dot and it has no manifest yet) or the complete new one.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <torch/torch.h>
#include <xxhash.h>

#include <ATen/Context.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <memory>
#include <fstream>
#include <regex>
#include <sstream>

#include "tandem/accelerator.h"
#include "tandem/checkpoint/model_io.h"
#include "tandem/checkpoint/optimizer_state.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/version.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

void fsync_path(const fs::path& p, bool directory) {
  int fd = ::open(p.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) throw std::runtime_error("cannot open " + p.string() + " to sync it");
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw std::runtime_error("fsync failed for " + p.string());
}

void write_file(const fs::path& p, const std::string& bytes) {
  {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) throw std::runtime_error("cannot write " + p.string() + " (disk full or no permission?)");
  }
  fsync_path(p, false);
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + p.string());
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string xxh64_of(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + p.string());
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  std::vector<char> buf(1 << 22);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    XXH64_update(st, buf.data(), static_cast<size_t>(in.gcount()));
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(XXH64_digest(st)));
  XXH64_freeState(st);
  return hex;
}

// Fault injection for the crash-consistency tests: TANDEM_CHECKPOINT_CRASH=<point> kills this
// process with SIGKILL at that point of a save on the rank given by TANDEM_CHECKPOINT_CRASH_RANK
// (default 0).
void crash_point(const char* point, int rank) {
  const char* want = std::getenv("TANDEM_CHECKPOINT_CRASH");
  if (!want || std::string(want) != point) return;
  const char* r = std::getenv("TANDEM_CHECKPOINT_CRASH_RANK");
  if ((r ? std::atoi(r) : 0) == rank) ::kill(::getpid(), SIGKILL);
}

std::string indexed(const std::string& stem, size_t i, const std::string& ext) {
  return stem + (i == 0 ? "" : "_" + std::to_string(i)) + ext;
}

// Every generator's state: the CPU one, and each CUDA device's.
std::vector<std::pair<std::string, at::Tensor>> rng_states() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  auto cpu = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    out.emplace_back("cpu", cpu.get_state());
  }
  if (torch::cuda::is_available()) {
    for (int64_t d = 0; d < static_cast<int64_t>(torch::cuda::device_count()); ++d) {
      auto g = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(d)));
      std::lock_guard<std::mutex> lock(g.mutex());
      out.emplace_back("cuda_" + std::to_string(d), g.get_state());
    }
  }
  return out;
}

void set_rng_states(const checkpoint::SafetensorsFile& f) {
  auto cpu = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_state(f.tensor("cpu"));
  }
  if (torch::cuda::is_available()) {
    for (int64_t d = 0; d < static_cast<int64_t>(torch::cuda::device_count()); ++d) {
      const std::string name = "cuda_" + std::to_string(d);
      if (!f.contains(name)) continue;
      auto g = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(d)));
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(f.tensor(name));
    }
  }
}

const std::regex kCheckpointName("checkpoint_([0-9]+)");

// Complete checkpoints (with a manifest) under `dir`, by number.
std::vector<std::pair<int64_t, fs::path>> complete_checkpoints(const fs::path& dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (auto& e : fs::directory_iterator(dir)) {
    std::smatch m;
    std::string name = e.path().filename().string();
    if (e.is_directory() && std::regex_match(name, m, kCheckpointName) &&
        fs::exists(e.path() / "manifest.json"))
      out.emplace_back(std::stoll(m[1]), e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

std::string Accelerator::latest_checkpoint() const {
  auto all = complete_checkpoints(fs::path(options_.project_dir()) / "checkpoints");
  return all.empty() ? "" : all.back().second.string();
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

void Accelerator::save_model(const torch::nn::Module& model, const std::string& dir,
                             const std::string& max_shard_size) {
  std::string error;
  // Every rank takes part: a sharded strategy gathers the model unit by unit to rank 0.
  auto tensors = strategy_->model_state(const_cast<torch::nn::Module&>(model));
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

std::string Accelerator::save_state(const std::string& dir_arg) {
  fs::path target;
  if (!dir_arg.empty()) {
    target = dir_arg;
  } else {
    TORCH_CHECK(options_.automatic_checkpoint_naming(), state_.prefix(),
                " save_state() needs a directory, or AcceleratorOptions().automatic_checkpoint_naming(true)");
    auto base = fs::path(options_.project_dir()) / "checkpoints";
    auto existing = complete_checkpoints(base);
    int64_t n = std::max<int64_t>(checkpoints_saved_, existing.empty() ? 0 : existing.back().first + 1);
    target = base / ("checkpoint_" + std::to_string(n));
  }
  target = fs::absolute(target).lexically_normal();
  const fs::path tmp = target.parent_path() / ("." + target.filename().string() + ".tmp");
  const int rank = state_.rank;

  // 1. Rank 0 prepares an empty temporary directory; the others wait for it.
  std::string error;
  if (rank == 0) {
    try {
      fs::create_directories(target.parent_path());
      fs::remove_all(tmp);
      fs::create_directories(tmp);
    } catch (const std::exception& e) {
      error = std::string("cannot create ") + tmp.string() + ": " + e.what();
    }
  }
  error = comm::broadcast_object(*pg_, error, 0);
  if (!error.empty()) throw std::runtime_error(state_.prefix() + " save_state: " + error);

  // 2. Every rank writes its parts. The models' tensors first, on every rank together (a
  // sharded strategy gathers them unit by unit to the main process).
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> model_states;
  for (auto& m : models_) model_states.push_back(strategy_->model_state(*m));
  json files = json::object();
  auto add = [&](const std::string& name) {
    files[name] = {{"size", fs::file_size(tmp / name)}, {"xxh64", xxh64_of(tmp / name)}};
  };
  try {
    if (rank == 0) {
      for (size_t i = 0; i < models_.size(); ++i) {
        const auto name = indexed("model", i, ".safetensors");
        checkpoint::save_safetensors((tmp / name).string(), model_states[i]);
        add(name);
      }
      for (size_t i = 0; i < optimizers_.size(); ++i) {
        if (strategy_->shards_optimizer(*optimizers_[i])) continue;  // every rank, below
        auto st = checkpoint::optimizer_state(*optimizers_[i]);
        checkpoint::save_safetensors((tmp / indexed("optimizer", i, ".safetensors")).string(), st.tensors);
        write_file(tmp / indexed("optimizer", i, ".json"), st.json);
        add(indexed("optimizer", i, ".safetensors"));
        add(indexed("optimizer", i, ".json"));
        auto masters = master_weights_of(*optimizers_[i]);
        if (!masters.empty()) {
          checkpoint::save_safetensors((tmp / indexed("master_weights", i, ".safetensors")).string(),
                                       masters);
          add(indexed("master_weights", i, ".safetensors"));
        }
      }
      for (const auto& r : registered_) {
        write_file(tmp / ("custom_" + r.name + ".bin"), r.save());
        add("custom_" + r.name + ".bin");
      }
      json st;
      st["tandem_version"] = kVersion;
      st["world_size"] = state_.world_size;
      st["optimizer_steps"] = optimizer_steps_;
      st["micro_step"] = micro_step_;
      st["sync_gradients"] = sync_gradients_;
      st["checkpoint_number"] = target.filename().string();
      st["gradient_accumulation_steps"] = accumulation_steps_;
      json loaders = json::array();
      for (auto& w : loaders_) {
        auto l = w.lock();
        loaders.push_back(l ? json{{"epoch", l->epoch()}, {"position", l->position()}} : json(nullptr));
      }
      st["loaders"] = loaders;
      json schedulers = json::array();
      for (auto& s : schedulers_) schedulers.push_back(checkpoint::scheduler_step_count(*s));
      st["schedulers"] = schedulers;
      json custom = json::array();
      for (const auto& r : registered_) custom.push_back(r.name);
      st["custom"] = custom;
      if (scaler_) st["scaler"] = scaler_->state_dict();
      write_file(tmp / "state.json", st.dump(2));
      add("state.json");
    }
    for (size_t i = 0; i < optimizers_.size(); ++i) {
      if (!strategy_->shards_optimizer(*optimizers_[i])) continue;
      auto st = strategy_->optimizer_shard_state(*optimizers_[i]);
      const auto stem = indexed("optimizer", i, "") + ".rank" + std::to_string(rank);
      checkpoint::save_safetensors((tmp / (stem + ".safetensors")).string(), st.tensors);
      write_file(tmp / (stem + ".json"), st.json);
      add(stem + ".safetensors");
      add(stem + ".json");
    }
    const auto rng = "random_states_" + std::to_string(rank) + ".safetensors";
    checkpoint::save_safetensors((tmp / rng).string(), rng_states());
    add(rng);
    crash_point("after_files", rank);
  } catch (const std::exception& e) {
    error = e.what();
  }

  // 3. Rank 0 gathers every rank's files (or failure), writes the manifest and renames.
  auto reports = comm::gather_object(*pg_, json{{"error", error}, {"files", files}}.dump());
  std::string outcome;
  if (rank == 0) {
    try {
      json manifest;
      manifest["world_size"] = state_.world_size;
      manifest["files"] = json::object();
      for (size_t r = 0; r < reports.size(); ++r) {
        auto rep = json::parse(reports[r]);
        if (!rep["error"].get<std::string>().empty())
          throw std::runtime_error("rank " + std::to_string(r) + " could not write its part: " +
                                   rep["error"].get<std::string>());
        for (auto& [k, v] : rep["files"].items()) manifest["files"][k] = v;
      }
      write_file(tmp / "manifest.json", manifest.dump(2));
      fsync_path(tmp, true);
      crash_point("before_rename", rank);
      fs::path old;
      if (fs::exists(target)) {
        old = target.parent_path() / ("." + target.filename().string() + ".old");
        fs::remove_all(old);
        fs::rename(target, old);
      }
      fs::rename(tmp, target);
      fsync_path(target.parent_path(), true);
      if (!old.empty()) fs::remove_all(old);
      crash_point("after_rename", rank);
      // Rotation of automatically named checkpoints.
      if (dir_arg.empty() && options_.total_limit() > 0) {
        auto all = complete_checkpoints(target.parent_path());
        for (size_t k = 0; k + static_cast<size_t>(options_.total_limit()) < all.size(); ++k)
          fs::remove_all(all[k].second);
      }
    } catch (const std::exception& e) {
      outcome = e.what();
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
  }
  outcome = comm::broadcast_object(*pg_, outcome, 0);
  if (!outcome.empty())
    throw std::runtime_error(state_.prefix() + " save_state to " + target.string() +
                             " failed; nothing was written and earlier checkpoints are intact: " + outcome);
  if (dir_arg.empty()) {
    std::smatch m;
    std::string name = target.filename().string();
    if (std::regex_match(name, m, kCheckpointName)) checkpoints_saved_ = std::stoll(m[1]) + 1;
  }
  return target.string();
}

void Accelerator::load_state(const std::string& dir_arg) {
  fs::path dir = dir_arg;
  if (dir.empty()) {
    dir = latest_checkpoint();
    if (dir.empty())
      throw std::runtime_error(state_.prefix() + " load_state: no complete checkpoint under " +
                               (fs::path(options_.project_dir()) / "checkpoints").string() +
                               "; save one with save_state() first, or pass a directory");
  }
  const fs::path manifest_path = dir / "manifest.json";
  if (!fs::exists(manifest_path))
    throw std::runtime_error(state_.prefix() + " load_state: " + dir.string() +
                             " is not a complete checkpoint (no manifest.json): its save was "
                             "interrupted or it is not a tandem checkpoint");
  json manifest;
  try {
    manifest = json::parse(read_file(manifest_path));
  } catch (const json::exception& e) {
    throw std::runtime_error(state_.prefix() + " load_state: " + manifest_path.string() +
                             " is corrupt: " + e.what());
  }
  // Verifies a file against the manifest before it is read.
  auto verified = [&](const std::string& name) {
    const fs::path p = dir / name;
    auto it = manifest["files"].find(name);
    if (it == manifest["files"].end())
      throw std::runtime_error(state_.prefix() + " load_state: " + p.string() +
                               " is not listed in manifest.json");
    if (!fs::exists(p))
      throw std::runtime_error(state_.prefix() + " load_state: " + p.string() + " is missing");
    auto size = fs::file_size(p);
    if (size != (*it)["size"].get<uint64_t>())
      throw std::runtime_error(state_.prefix() + " load_state: " + p.string() + " has " +
                               std::to_string(size) + " bytes, the manifest says " +
                               (*it)["size"].dump() + ": the file was truncated or altered");
    if (xxh64_of(p) != (*it)["xxh64"].get<std::string>())
      throw std::runtime_error(state_.prefix() + " load_state: " + p.string() +
                               " does not match its checksum in manifest.json: the file was altered "
                               "or damaged");
    return p.string();
  };

  auto st = json::parse(read_file(verified("state.json")));
  const bool same_world = st["world_size"].get<int>() == state_.world_size;
  if (!same_world && is_main_process())
    std::cerr << state_.prefix() << " load_state: the checkpoint was saved by "
              << st["world_size"] << " processes and is loaded by " << state_.world_size
              << ": models and optimizers are restored, but loader positions and random states "
                 "are not (they are per rank)" << std::endl;
  TORCH_CHECK(st["loaders"].size() <= loaders_.size() || loaders_.empty(), state_.prefix(),
              " load_state: the checkpoint has ", st["loaders"].size(),
              " loaders but only ", loaders_.size(), " were prepared; prepare them before load_state");

  for (size_t i = 0; i < models_.size(); ++i)
    strategy_->load_model_state(*models_[i], verified(indexed("model", i, ".safetensors")));
  const int saved_world = st["world_size"].get<int>();
  for (size_t i = 0; i < optimizers_.size(); ++i) {
    const auto stem = indexed("optimizer", i, "");
    const bool saved_sharded = manifest["files"].contains(stem + ".rank0.json");
    const bool sharded = strategy_->shards_optimizer(*optimizers_[i]);
    if (saved_sharded != sharded)
      throw std::runtime_error(
          state_.prefix() + " load_state: " + dir.string() + " holds " +
          (saved_sharded ? "sharded" : "whole") + " optimizer state, but this run " +
          (sharded ? "shards it (" + strategy_->name() + ")" : "does not shard it") +
          "; resume with the strategy the checkpoint was saved with (a ZeRO stage reloads on "
          "any number of ranks and from stage 1 to 2 and back)");
    if (sharded) {
      // Rank r's files, verified once and opened on first use.
      std::map<int, std::unique_ptr<checkpoint::SafetensorsFile>> open;
      auto file = [&](int r) -> checkpoint::SafetensorsFile& {
        auto& f = open[r];
        if (!f)
          f = std::make_unique<checkpoint::SafetensorsFile>(
              verified(stem + ".rank" + std::to_string(r) + ".safetensors"));
        return *f;
      };
      strategy_->load_optimizer_shards(
          *optimizers_[i], saved_world,
          [&](int r) { return read_file(verified(stem + ".rank" + std::to_string(r) + ".json")); },
          [&](int r, const std::string& name) { return file(r).tensor(name); });
      continue;
    }
    checkpoint::OptimizerState os;
    checkpoint::SafetensorsFile f(verified(indexed("optimizer", i, ".safetensors")));
    for (const auto& n : f.names()) os.tensors.emplace_back(n, f.tensor(n));
    os.json = read_file(verified(indexed("optimizer", i, ".json")));
    checkpoint::load_optimizer_state(*optimizers_[i], os);
    const auto masters_name = indexed("master_weights", i, ".safetensors");
    if (manifest["files"].contains(masters_name)) {
      checkpoint::SafetensorsFile f(verified(masters_name));
      load_master_weights(*optimizers_[i], &f, dir.string());
    } else {
      load_master_weights(*optimizers_[i], nullptr, dir.string());
    }
  }
  for (size_t i = 0; i < schedulers_.size() && i < st["schedulers"].size(); ++i)
    checkpoint::set_scheduler_step_count(*schedulers_[i], st["schedulers"][i].get<unsigned>());
  for (const auto& r : registered_) r.load(read_file(verified("custom_" + r.name + ".bin")));
  if (scaler_ && st.contains("scaler"))
    scaler_->load_state_dict(st["scaler"].get<std::map<std::string, double>>());
  optimizer_steps_ = st["optimizer_steps"].get<int64_t>();
  micro_step_ = st["micro_step"].get<int64_t>();
  sync_gradients_ = st["sync_gradients"].get<bool>();
  std::smatch m;
  std::string name = dir.filename().string();
  if (std::regex_match(name, m, kCheckpointName)) checkpoints_saved_ = std::stoll(m[1]) + 1;
  if (same_world) {
    for (size_t i = 0; i < loaders_.size() && i < st["loaders"].size(); ++i) {
      auto l = loaders_[i].lock();
      if (!l || st["loaders"][i].is_null()) continue;
      l->set_epoch(st["loaders"][i]["epoch"].get<int64_t>());
      l->skip_first_batches(st["loaders"][i]["position"].get<int64_t>());
    }
    checkpoint::SafetensorsFile rng(verified("random_states_" + std::to_string(state_.rank) + ".safetensors"));
    set_rng_states(rng);
  }
  wait_for_everyone();
}

}  // namespace tandem
