// The full training state on disk (training_state.h): the parts' files written by every rank
// into a temporary directory, a manifest with every file's size and xxh64 written by rank 0
// last, and an atomic rename (Note [Atomic checkpoints]); loading verifies before reading.
//
// What the parts write into a checkpoint directory: Note [Checkpoint layout]
// (tandem/checkpoint/layout.h); besides them, state.json (counters, loaders, schedulers, scaler,
// tracking: main; one key per part) and manifest.json (size and xxh64 of every file: main, last).
#include "tandem/checkpoint/training_state.h"
#include "../detail/read_file.h"
#include "tandem/error.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <torch/torch.h>
#include <xxhash.h>

#include <ATen/Context.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <sstream>

#include "detail/json_depth.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/comm/collectives.h"
#include "tandem/comm/process_group.h"
#include "tandem/version.h"

namespace tandem::checkpoint {
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
  auto bytes = ::tandem::detail::read_file(p.string());
  if (!bytes) throw std::runtime_error("cannot read " + p.string());
  return std::move(*bytes);
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

constexpr const char* kDamagedFix =
    ": the checkpoint is damaged or was not written by tandem; use another checkpoint";

// A checkpoint's JSON file `path` (Note [JSON depth limit]: its depth is measured before
// nlohmann sees it). `where` begins the errors.
json parse_checkpoint_json(const std::string& text, const std::string& path,
                           const std::string& where) {
  if (auto deep = detail::json_depth_problem(text); !deep.empty())
    throw std::runtime_error(where + path + " " + deep + kDamagedFix);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw std::runtime_error(where + path + " is corrupt (expected JSON, found text that does " +
                             "not parse: " + e.what() + ")" + kDamagedFix);
  }
}

// Fault injection for the crash-consistency tests (CrashPoint): kills this process with SIGKILL
// at that point of a save on the rank it names.
void crash_point(const CrashPoint& crash, const char* point, int rank) {
  if (crash.at == point && crash.rank == rank) ::kill(::getpid(), SIGKILL);
}

}  // namespace

static const std::regex kCheckpointName("checkpoint_([0-9]+)");

std::vector<std::pair<int64_t, std::string>> complete_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (auto& e : fs::directory_iterator(dir)) {
    std::smatch m;
    std::string name = e.path().filename().string();
    if (e.is_directory() && std::regex_match(name, m, kCheckpointName) &&
        fs::exists(e.path() / "manifest.json"))
      out.emplace_back(std::stoll(m[1]), e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

int64_t checkpoint_number(const std::string& dir) {
  std::smatch m;
  const std::string name = fs::path(dir).filename().string();
  return std::regex_match(name, m, kCheckpointName) ? std::stoll(m[1]) : -1;
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

void set_rng_states(const SafetensorsFile& f) {
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


// ---- StateWriter ------------------------------------------------------------------------------

StateWriter::StateWriter(std::string dir, int rank, int world_size, bool staging,
                         std::shared_ptr<StagingBuffers> reuse)
    : dir_(std::move(dir)), rank_(rank), world_(world_size), staging_(staging), reuse_(std::move(reuse)) {}

namespace {

// A copy of `t` in host memory that training cannot change (pinned when `t` lives on a GPU,
// so that the copy is a DMA).
at::Tensor host_copy(const at::Tensor& t) {
  const at::Tensor d = t.detach();
  if (d.is_cuda()) {
    auto h = at::empty(d.sizes(), d.options().device(at::kCPU).pinned_memory(true));
    h.copy_(d);
    return h;
  }
  if (!d.device().is_cpu()) return d.to(at::kCPU);
  return d.clone(at::MemoryFormat::Contiguous);
}

}  // namespace

void StateWriter::wrote(const std::string& file) {
  const fs::path p = fs::path(dir_) / file;
  files_[file] = {fs::file_size(p), xxh64_of(p)};
  if (after_first_file_) {
    auto f = std::move(after_first_file_);
    after_first_file_ = nullptr;
    f();
  }
}

void StateWriter::write_tensors(const std::string& file,
                                const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                const std::map<std::string, std::string>& metadata) {
  if (staging_) {
    Staged st;
    st.file = file;
    st.is_tensors = true;
    st.metadata = metadata;
    st.tensors.reserve(tensors.size());
    for (const auto& [name, t] : tensors) {
      if (!reuse_) {
        st.tensors.emplace_back(name, host_copy(t));
        continue;
      }
      auto& buffer = reuse_->by_key[file + "\n" + name];
      const bool fits = buffer.defined() && buffer.sizes() == t.sizes() &&
                        buffer.scalar_type() == t.scalar_type() &&
                        buffer.is_pinned() == t.is_cuda();
      if (fits) {
        buffer.copy_(t.detach());
      } else {
        buffer = host_copy(t);
      }
      used_.insert(file + "\n" + name);
      st.tensors.emplace_back(name, buffer);
    }
    staged_.push_back(std::move(st));
    return;
  }
  save_safetensors((fs::path(dir_) / file).string(), tensors, metadata);
  wrote(file);
}

void StateWriter::write_bytes(const std::string& file, const std::string& bytes) {
  if (staging_) {
    Staged st;
    st.file = file;
    st.bytes = bytes;
    staged_.push_back(std::move(st));
    return;
  }
  write_file(fs::path(dir_) / file, bytes);
  wrote(file);
}

void StateWriter::write_staged() {
  for (auto& st : staged_) {
    const fs::path p = fs::path(dir_) / st.file;
    if (st.is_tensors)
      save_safetensors(p.string(), st.tensors, st.metadata);
    else
      write_file(p, st.bytes);
    st.tensors.clear();
    st.bytes.clear();
    st.bytes.shrink_to_fit();
    wrote(st.file);
  }
  staged_.clear();
}

void StateWriter::release_unused_buffers() {
  if (!reuse_) return;
  for (auto it = reuse_->by_key.begin(); it != reuse_->by_key.end();)
    it = used_.count(it->first) ? std::next(it) : reuse_->by_key.erase(it);
}

void StateWriter::set_state(const std::string& key, const std::string& json) {
  TANDEM_CHECK(is_main(), "StateWriter::set_state('", key,
              "') on rank ", rank_, ": state.json is written by the main process only");
  state_[key] = json;
}

// ---- StateReader ------------------------------------------------------------------------------

struct StateReader::Impl {
  json manifest, state;
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> open;
};

StateReader::~StateReader() = default;

StateReader::StateReader(std::string dir, std::string prefix, std::string operation)
    : dir_(std::move(dir)),
      prefix_(std::move(prefix)),
      where_((prefix_.empty() ? "" : prefix_ + " ") + operation + ": "),
      impl_(std::make_unique<Impl>()) {
  const fs::path manifest_path = fs::path(dir_) / "manifest.json";
  if (!fs::exists(manifest_path))
    throw std::runtime_error(where_ + dir_ +
                             " is not a complete checkpoint (no manifest.json): its save was "
                             "interrupted or it is not a tandem checkpoint");
  impl_->manifest = parse_checkpoint_json(read_file(manifest_path), manifest_path.string(), where_);
  // What verified() relies on: {"files": {name: {"size": n, "xxh64": "hex"}}}.
  const json& m = impl_->manifest;
  if (!m.is_object() || !m.contains("files") || !m["files"].is_object())
    throw std::runtime_error(where_ + manifest_path.string() +
                             " has no \"files\" object (expected {\"files\": {name: {\"size\", "
                             "\"xxh64\"}}, ...})" +
                             kDamagedFix);
  for (const auto& [name, entry] : m["files"].items()) {
    if (!entry.is_object() || !entry.contains("size") || !entry["size"].is_number_unsigned() ||
        !entry.contains("xxh64") || !entry["xxh64"].is_string())
      throw std::runtime_error(
          where_ + manifest_path.string() + ": the entry of '" + name + "' is " + entry.dump() +
          ", expected {\"size\": <bytes>, \"xxh64\": \"<hex>\"}" + kDamagedFix);
  }
  impl_->state = parse_checkpoint_json(read_bytes("state.json"), dir_ + "/state.json", where_);
  if (!impl_->state.is_object())
    throw std::runtime_error(where_ + dir_ + "/state.json holds " +
                             std::string(impl_->state.type_name()) + ", expected an object" +
                             kDamagedFix);
  const json& world = m.contains("world_size")              ? m["world_size"]
                      : impl_->state.contains("world_size") ? impl_->state["world_size"]
                                                            : json(0);
  if (!world.is_number_integer())
    throw std::runtime_error(where_ + manifest_path.string() + ": \"world_size\" is " +
                             world.dump() + ", expected a number of processes" + kDamagedFix);
  saved_world_ = world.get<int>();
}

bool StateReader::has(const std::string& file) const {
  return impl_->manifest["files"].contains(file);
}

std::string StateReader::verified(const std::string& name) const {
  const fs::path p = fs::path(dir_) / name;
  const auto& files = impl_->manifest["files"];
  auto it = files.find(name);
  if (it == files.end())
    throw std::runtime_error(where_ + p.string() + " is not listed in manifest.json");
  if (!fs::exists(p)) throw std::runtime_error(where_ + p.string() + " is missing");
  auto size = fs::file_size(p);
  if (size != (*it)["size"].get<uint64_t>())
    throw std::runtime_error(where_ + p.string() + " has " + std::to_string(size) +
                             " bytes, the manifest says " + (*it)["size"].dump() +
                             ": the file was truncated or altered; restore it from a copy or "
                             "use another checkpoint");
  if (xxh64_of(p) != (*it)["xxh64"].get<std::string>())
    throw std::runtime_error(where_ + p.string() +
                             " does not match its checksum in manifest.json: the file was altered "
                             "or damaged; restore it from a copy or use another checkpoint");
  return p.string();
}

std::string StateReader::read_bytes(const std::string& file) const {
  const std::string path = verified(file);
  std::string bytes = read_file(path);
  // Note [JSON depth limit]: the parts parse their JSON files (optimizer.json, the ZeRO shards'
  // layouts) themselves; none of them sees text nested too deep.
  if (file.size() > 5 && file.compare(file.size() - 5, 5, ".json") == 0) {
    if (auto deep = detail::json_depth_problem(bytes); !deep.empty())
      throw std::runtime_error(where_ + path + " " + deep + kDamagedFix);
  }
  return bytes;
}

const SafetensorsFile& StateReader::tensors(const std::string& file) const {
  auto& f = impl_->open[file];
  if (!f) f = std::make_unique<SafetensorsFile>(verified(file));
  return *f;
}

std::optional<std::string> StateReader::state(const std::string& key) const {
  if (!impl_->state.contains(key)) return std::nullopt;
  return impl_->state[key].dump();
}

// ---- save and load ----------------------------------------------------------------------------

namespace {

// Where a checkpoint is assembled before its rename.
fs::path temporary_of(const fs::path& target) {
  return target.parent_path() / ("." + target.filename().string() + ".tmp");
}

// Step 1: rank 0 prepares an empty temporary directory; the others wait for it.
void prepare_temporary(ProcessGroup& pg, const fs::path& target, const fs::path& tmp) {
  std::string error;
  if (pg.rank() == 0) {
    try {
      fs::create_directories(target.parent_path());
      fs::remove_all(tmp);
      fs::create_directories(tmp);
    } catch (const std::exception& e) {
      error = std::string("cannot create ") + tmp.string() + ": " + e.what();
    }
  }
  error = comm::broadcast_object(pg, error, 0);
  if (!error.empty()) throw std::runtime_error(pg.prefix() + " save_state: " + error);
}

// Step 2: every rank runs every part. After a failure the later parts still run, so that their
// collectives match on every rank; what they write goes with the temporary directory. Returns
// the first failure.
std::string run_parts(const std::vector<StatePart>& parts, StateWriter& writer) {
  std::string error;
  for (const auto& part : parts) {
    try {
      part.save(writer);
    } catch (const std::exception& e) {
      if (error.empty()) error = "part '" + part.name + "': " + e.what();
    }
  }
  return error;
}

// Step 3: rank 0 writes state.json, gathers every rank's files (or failure) over `pg`, writes
// the manifest and renames; every rank learns the outcome and throws on a failure.
void finish_save(ProcessGroup& pg, StateWriter& writer, std::string error, const fs::path& target,
                 int keep_last, const CrashPoint& crash) {
  const fs::path tmp = temporary_of(target);
  const int rank = pg.rank();
  if (error.empty() && rank == 0) {
    try {
      json st;
      st["tandem_version"] = kVersion;
      st["world_size"] = pg.size();
      for (const auto& [key, value] : writer.state()) st[key] = json::parse(value);
      writer.write_bytes("state.json", st.dump(2));
      writer.write_staged();
    } catch (const std::exception& e) {
      error = std::string("state.json: ") + e.what();
    }
  }
  json files = json::object();
  for (const auto& [name, info] : writer.files())
    files[name] = {{"size", info.first}, {"xxh64", info.second}};
  if (error.empty()) crash_point(crash, "after_files", rank);

  auto reports = comm::gather_object(pg, json{{"error", error}, {"files", files}}.dump());
  std::string outcome;
  if (rank == 0) {
    try {
      json manifest;
      manifest["world_size"] = pg.size();
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
      crash_point(crash, "before_rename", rank);
      fs::path old;
      if (fs::exists(target)) {
        old = target.parent_path() / ("." + target.filename().string() + ".old");
        fs::remove_all(old);
        fs::rename(target, old);
      }
      fs::rename(tmp, target);
      fsync_path(target.parent_path(), true);
      if (!old.empty()) fs::remove_all(old);
      crash_point(crash, "after_rename", rank);
      // Rotation of automatically named checkpoints.
      if (keep_last > 0) {
        auto all = complete_checkpoints(target.parent_path().string());
        for (size_t k = 0; k + static_cast<size_t>(keep_last) < all.size(); ++k)
          fs::remove_all(all[k].second);
      }
    } catch (const std::exception& e) {
      outcome = e.what();
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
  }
  outcome = comm::broadcast_object(pg, outcome, 0);
  if (!outcome.empty())
    throw std::runtime_error(pg.prefix() + " save_state to " + target.string() +
                             " failed; nothing was written and earlier checkpoints are intact: " +
                             outcome);
}

}  // namespace

void save_training_state(ProcessGroup& pg, const std::string& dir,
                         const std::vector<StatePart>& parts, int keep_last,
                         const CrashPoint& crash) {
  const fs::path target = fs::absolute(dir).lexically_normal();
  const fs::path tmp = temporary_of(target);
  const int rank = pg.rank();
  prepare_temporary(pg, target, tmp);
  StateWriter writer(tmp.string(), rank, pg.size());
  writer.set_name(target.filename().string());
  writer.set_after_first_file([&crash, rank] { crash_point(crash, "mid_files", rank); });
  std::string error = run_parts(parts, writer);
  finish_save(pg, writer, std::move(error), target, keep_last, crash);
}

// ---- asynchronous saves (Note [Asynchronous checkpoints]) -------------------------------------

struct PendingSave::Impl {
  std::string dir;
  std::thread thread;
  std::atomic<bool> done{false};
  std::string error;  // the write's failure, set before done
  bool reported = false;

  // Joins the thread once; says a failure nobody asked for on stderr.
  void finish() {
    if (thread.joinable()) thread.join();
    if (!error.empty() && !reported) {
      reported = true;
      std::cerr << error << std::endl;
    }
  }
};

namespace {

// A program that calls std::exit with a save in flight (no destructor runs) still ends after
// the write: every pending save is joined at exit.
std::mutex g_pending_mu;
std::vector<PendingSave::Impl*> g_pending;

void finish_pending_at_exit() {
  std::lock_guard<std::mutex> lock(g_pending_mu);
  for (auto* p : g_pending) p->finish();
}

void add_pending(PendingSave::Impl* p) {
  static const bool registered = [] { return std::atexit(finish_pending_at_exit) == 0; }();
  (void)registered;
  std::lock_guard<std::mutex> lock(g_pending_mu);
  g_pending.push_back(p);
}

void remove_pending(PendingSave::Impl* p) {
  std::lock_guard<std::mutex> lock(g_pending_mu);
  g_pending.erase(std::remove(g_pending.begin(), g_pending.end(), p), g_pending.end());
}

}  // namespace

PendingSave::PendingSave(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  add_pending(impl_.get());
}

PendingSave::~PendingSave() {
  remove_pending(impl_.get());
  impl_->finish();
}

const std::string& PendingSave::dir() const { return impl_->dir; }
bool PendingSave::done() const { return impl_->done.load(); }

void PendingSave::wait() {
  if (impl_->thread.joinable()) impl_->thread.join();
  if (!impl_->error.empty()) {
    impl_->reported = true;
    throw std::runtime_error(impl_->error);
  }
}

std::unique_ptr<PendingSave> save_training_state_async(ProcessGroup& pg,
                                                       std::shared_ptr<ProcessGroup> background,
                                                       const std::string& dir,
                                                       const std::vector<StatePart>& parts,
                                                       int keep_last, const CrashPoint& crash,
                                                       std::shared_ptr<StagingBuffers> buffers) {
  TANDEM_CHECK(background && background->size() == pg.size() && background->rank() == pg.rank(),
               pg.prefix(), " save_training_state_async: the background group must hold the "
               "same ranks as the run's group");
  const fs::path target = fs::absolute(dir).lexically_normal();
  const fs::path tmp = temporary_of(target);
  const int rank = pg.rank();
  prepare_temporary(pg, target, tmp);
  auto writer = std::make_shared<StateWriter>(tmp.string(), rank, pg.size(), /*staging=*/true,
                                             std::move(buffers));
  writer->set_name(target.filename().string());
  writer->set_after_first_file([crash, rank] { crash_point(crash, "mid_files", rank); });
  std::string error = run_parts(parts, *writer);
  writer->release_unused_buffers();
  auto impl = std::make_unique<PendingSave::Impl>();
  impl->dir = target.string();
  PendingSave::Impl* state = impl.get();
  impl->thread = std::thread([state, writer, background, error, target, keep_last, crash]() mutable {
    try {
      if (error.empty()) {
        try {
          writer->write_staged();
        } catch (const std::exception& e) {
          error = std::string("writing its files: ") + e.what();
        }
      }
      finish_save(*background, *writer, error, target, keep_last, crash);
    } catch (const std::exception& e) {
      state->error = e.what();
    }
    state->done.store(true);
  });
  return std::make_unique<PendingSave>(std::move(impl));
}

void load_training_state(ProcessGroup& pg, const std::string& dir,
                         const std::vector<StatePart>& parts) {
  StateReader reader(dir, pg.prefix());
  for (const auto& part : parts) part.load(reader);
  comm::wait_for_everyone(pg);
}

}  // namespace tandem::checkpoint
