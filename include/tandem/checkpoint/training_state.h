// The full training state on disk: a checkpoint directory assembled from the parts that the
// components of a run hand in (models, optimizers, precision, loaders, counters, RNG, the
// user's objects), written by every rank atomically and verified on load.
//
// Note [Atomic checkpoints]: every rank writes into <parent>/.<name>.tmp and fsyncs its files;
// the ranks' file lists and any failure are gathered on rank 0, which writes manifest.json,
// fsyncs, and renames the directory into place (then fsyncs the parent). A crash at any moment
// leaves either the previous checkpoints alone (the temporary directory is never taken for a
// checkpoint: its name starts with a dot and it has no manifest yet) or the complete new one.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tandem {
class ProcessGroup;
}

namespace tandem::checkpoint {

class SafetensorsFile;

/// What a part writes into a checkpoint being saved: files in the temporary directory (fsync'd,
/// listed with their size and checksum in the manifest) and keys of state.json (the main
/// process's small JSON state).
class StateWriter {
 public:
  StateWriter(std::string dir, int rank, int world_size);
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  bool is_main() const { return rank_ == 0; }
  /// The checkpoint's final name ("checkpoint_3").
  const std::string& name() const { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }

  /// Writes a safetensors file of this rank (with `metadata` in its "__metadata__").
  void write_tensors(const std::string& file,
                     const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     const std::map<std::string, std::string>& metadata = {});
  /// Writes a file of raw bytes of this rank.
  void write_bytes(const std::string& file, const std::string& bytes);
  /// Sets key `key` of state.json to the JSON document `json` (main process only).
  void set_state(const std::string& key, const std::string& json);

  // For save_training_state.
  const std::map<std::string, std::pair<uint64_t, std::string>>& files() const { return files_; }
  const std::map<std::string, std::string>& state() const { return state_; }

 private:
  std::string dir_, name_;
  int rank_, world_;
  std::map<std::string, std::pair<uint64_t, std::string>> files_;  // name -> size, xxh64
  std::map<std::string, std::string> state_;                       // state.json keys
};

/// What a part reads back from a complete checkpoint: every file is verified against the
/// manifest (listed, present, same size, same checksum) before it is read.
class StateReader {
 public:
  /// Opens `dir` (throws, naming the problem, when it has no readable manifest). Errors begin
  /// with `prefix` and `operation` ("[rank 0/2] load_state: ..."); merge_weights passes its own.
  StateReader(std::string dir, std::string prefix, std::string operation = "load_state");
  ~StateReader();
  const std::string& dir() const { return dir_; }
  /// The number of processes that saved it.
  int saved_world_size() const { return saved_world_; }
  /// Whether the manifest lists `file`.
  bool has(const std::string& file) const;
  /// The verified path of `file` (throws when it is missing, truncated or altered).
  std::string verified(const std::string& file) const;
  /// The verified bytes of `file`; a "*.json" file is also refused when it nests deeper than
  /// JSON readers accept (Note [JSON depth limit]).
  std::string read_bytes(const std::string& file) const;
  /// The verified safetensors file, opened once.
  const SafetensorsFile& tensors(const std::string& file) const;
  /// Key `key` of state.json as a JSON document, or nullopt.
  std::optional<std::string> state(const std::string& key) const;
  const std::string& prefix() const { return prefix_; }
  /// "<prefix> <operation>: ", the start of its errors.
  const std::string& where() const { return where_; }

 private:
  struct Impl;
  std::string dir_, prefix_;
  std::string where_;  // the start of every error: "<prefix> <operation>: "
  int saved_world_ = 0;
  std::unique_ptr<Impl> impl_;
};

/// One component's share of a checkpoint. Every rank calls every part's save, in the order of
/// the list, so a part may run collectives (a sharded model gathered to the main process); the
/// part decides which rank writes what. load is called on every rank in the same order.
struct StatePart {
  std::string name;
  std::function<void(StateWriter&)> save;
  std::function<void(const StateReader&)> load;
};

/// A point of save_training_state where one rank is killed (SIGKILL), for the crash-consistency
/// tests: "after_files", "before_rename" or "after_rename"; empty: none. The run configuration
/// resolves it (config::fault_injection, TANDEM_CHECKPOINT_CRASH) and the Accelerator hands it
/// down.
struct CrashPoint {
  std::string at;
  int rank = 0;
};

/// Saves `parts` into `dir` atomically (Note [Atomic checkpoints]); completes on every rank of
/// `pg` or on none, and throws on every rank with the failing rank's reason otherwise.
/// `keep_last` > 0: afterwards, keep only that many complete checkpoint_<n> siblings.
void save_training_state(ProcessGroup& pg, const std::string& dir,
                         const std::vector<StatePart>& parts, int keep_last = 0,
                         const CrashPoint& crash = {});
/// Loads `parts` from the complete checkpoint `dir`, then waits for every rank.
void load_training_state(ProcessGroup& pg, const std::string& dir,
                         const std::vector<StatePart>& parts);

/// Complete checkpoints (with a manifest) named checkpoint_<n> under `dir`, by number.
std::vector<std::pair<int64_t, std::string>> complete_checkpoints(const std::string& dir);
/// n of a directory named checkpoint_<n>, or -1.
int64_t checkpoint_number(const std::string& dir);

/// Every generator's state: the CPU one and each CUDA device's ("cpu", "cuda_<d>").
std::vector<std::pair<std::string, at::Tensor>> rng_states();
/// Restores rng_states().
void set_rng_states(const SafetensorsFile& file);

}  // namespace tandem::checkpoint
