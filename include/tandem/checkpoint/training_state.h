// The full training state on disk: a checkpoint directory assembled from the parts that the
// components of a run hand in (models, optimizers, precision, loaders, counters, RNG, the
// user's objects), written by every rank atomically and verified on load.
//
// Note [Atomic checkpoints]: every rank writes into <parent>/.<name>.tmp and fsyncs its files;
// the ranks' file lists and any failure are gathered on rank 0, which writes manifest.json,
// fsyncs, and renames the directory into place (then fsyncs the parent). A crash at any moment
// leaves either the previous checkpoints alone (the temporary directory is never taken for a
// checkpoint: its name starts with a dot and it has no manifest yet) or the complete new one.
//
// Note [Asynchronous checkpoints]: an asynchronous save runs the parts on the calling thread, at
// the step boundary (their collectives, the registered objects' bytes, the counters), but its
// StateWriter stages what they hand in: every tensor copied to host memory (pinned when it lives
// on a GPU), every file's bytes kept. A background thread then writes and fsyncs the files,
// and the manifest and the rename follow as above, over a process group of their own (the
// training thread's collectives go on meanwhile on the run's groups, so the two never
// interleave). The files are byte for byte those of a synchronous save of the same state. The
// copy is the price: the state's bytes are held twice on the host. Without StagingBuffers each
// file's copies are dropped once that file is written; the Accelerator keeps them for its next
// asynchronous save (StagingBuffers), which then copies into memory already mapped.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace tandem {
class ProcessGroup;
}

namespace tandem::checkpoint {

class SafetensorsFile;

/// Host buffers an asynchronous save copies the state into, kept for the next one (Note
/// [Asynchronous checkpoints]): a tensor of the same file, name, shape and dtype is copied into
/// its buffer again instead of into new memory (a fresh buffer costs its page faults, about 5x
/// the copy). One save uses them at a time; buffers a save did not use are released at its end.
struct StagingBuffers {
  std::map<std::string, at::Tensor> by_key;  // "<file>\n<name>" -> host tensor
};

/// What a part writes into a checkpoint being saved: files in the temporary directory (fsync'd,
/// listed with their size and checksum in the manifest) and keys of state.json (the main
/// process's small JSON state).
class StateWriter {
 public:
  /// `staging`: write_tensors / write_bytes keep host copies for write_staged() (Note
  /// [Asynchronous checkpoints]) instead of writing at once.
  /// `reuse`: buffers of an earlier asynchronous save to copy into (and to keep this one's).
  StateWriter(std::string dir, int rank, int world_size, bool staging = false,
              std::shared_ptr<StagingBuffers> reuse = nullptr);
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
  /// Writes what was staged, in the order it was handed in, releasing each file's copies once
  /// it is written.
  void write_staged();
  /// Releases the reused buffers no tensor of this save was copied into.
  void release_unused_buffers();
  /// Runs `f` once, when this rank's first file is on disk (the "mid_files" CrashPoint).
  void set_after_first_file(std::function<void()> f) { after_first_file_ = std::move(f); }

 private:
  void wrote(const std::string& file);
  struct Staged {
    std::string file;
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    std::map<std::string, std::string> metadata;
    std::string bytes;
    bool is_tensors = false;
  };
  std::string dir_, name_;
  int rank_, world_;
  bool staging_ = false;
  std::shared_ptr<StagingBuffers> reuse_;
  std::set<std::string> used_;  // keys of reuse_ this save copied into
  std::vector<Staged> staged_;
  std::function<void()> after_first_file_;
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
/// tests: "mid_files" (after the rank's first file), "after_files", "before_rename" or
/// "after_rename"; empty: none. In an asynchronous save each falls in the background write. The run configuration
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
/// A save_training_state whose files are written in the background (Note [Asynchronous
/// checkpoints]), as returned by save_training_state_async.
class PendingSave {
 public:
  struct Impl;
  explicit PendingSave(std::unique_ptr<Impl> impl);
  /// Waits for the write (a failure is reported on stderr, never thrown from a destructor).
  ~PendingSave();
  PendingSave(const PendingSave&) = delete;
  PendingSave& operator=(const PendingSave&) = delete;
  /// The checkpoint's directory.
  const std::string& dir() const;
  /// Whether the write and the rename have ended (successfully or not).
  bool done() const;
  /// Waits until they have; throws (on every rank) what failed, as save_training_state would.
  /// A second call returns at once (or throws the same error again).
  void wait();

 private:
  std::unique_ptr<Impl> impl_;
};

/// save_training_state, asynchronously: the parts run now on the calling thread (their
/// collectives over `pg`) into host copies; a background thread writes the files, and the
/// manifest and the rename follow over `background` (a group over the same ranks as `pg`,
/// used by nothing else while the save runs). A part that fails, here or in the write, fails
/// the save on every rank: wait() throws it, and nothing is renamed into place.
/// `buffers`: host buffers kept from the last asynchronous save (null: fresh memory, freed
/// once written).
std::unique_ptr<PendingSave> save_training_state_async(ProcessGroup& pg,
                                                       std::shared_ptr<ProcessGroup> background,
                                                       const std::string& dir,
                                                       const std::vector<StatePart>& parts,
                                                       int keep_last = 0,
                                                       const CrashPoint& crash = {},
                                                       std::shared_ptr<StagingBuffers> buffers = nullptr);
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
