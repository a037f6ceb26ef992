// Optimizer state in a file (Note [Optimizer state on disk]): each unit's state tensors are a
// record of one file per rank, read into one of three buffers before the unit steps and written
// back from it after, so that reading the next unit, stepping this one and writing the last one
// overlap.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <future>
#include <string>
#include <utility>
#include <vector>

namespace tandem::parallel::detail {

/// The fields of one unit's optimizer state, by name, as pointers into the optimizer's state
/// (checkpoint::optimizer_state_tensors).
using StateFields = std::vector<std::pair<std::string, at::Tensor*>>;

class StateOnDisk {
 public:
  /// Creates `dir` if needed and the file "tandem-optimizer-<pid>-<name>.state" in it (removed
  /// again by the destructor). Throws std::runtime_error naming the path and the fix when it
  /// cannot.
  StateOnDisk(const std::string& dir, const std::string& name, std::string prefix);
  ~StateOnDisk();
  StateOnDisk(const StateOnDisk&) = delete;
  StateOnDisk& operator=(const StateOnDisk&) = delete;

  /// Whether unit `k` has a record (its state was stored once).
  bool on_disk(size_t k) const { return k < records_.size() && records_[k].bytes > 0; }
  /// Starts reading unit `k`'s record into the next buffer (the one written longest ago).
  void prefetch(size_t k);
  /// Unit `k`'s fields become views of its record in a buffer (read now unless prefetched).
  void load(size_t k, const StateFields& fields);
  /// Unit `k`'s defined fields go to its record and become undefined: from the buffer it was
  /// loaded into, in the background; otherwise (its first store) at once.
  void store(size_t k, const StateFields& fields);
  /// Unit `k`'s fields as tensors of their own, read now (for a checkpoint).
  void load_copy(size_t k, const StateFields& fields);
  /// Waits for every read and write in flight (and rethrows the first failure).
  void finish();

 private:
  struct Field {
    std::string name;
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
    int64_t offset = 0, bytes = 0;  // within the record
  };
  struct Record {
    int64_t offset = 0, bytes = 0;  // within the file
    std::vector<Field> fields;
  };
  struct Slot {
    at::Tensor buffer;  // uint8
    std::future<void> pending;
    long unit = -1;     // whose record the buffer holds (or is reading)
  };
  void wait(Slot& s);
  Slot& slot_for_read();
  // `bytes` bytes at `offset` of the file.
  void read(int64_t offset, int64_t bytes, void* dst) const;
  void write(int64_t offset, int64_t bytes, const void* src) const;

  std::string prefix_, path_;
  int fd_ = -1;
  int64_t end_ = 0;  // the file's size: records are appended
  std::vector<Record> records_;
  std::array<Slot, 3> slots_;
  size_t next_slot_ = 0;
};

}  // namespace tandem::parallel::detail
