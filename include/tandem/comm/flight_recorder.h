// Note [Flight recorder]: every rank keeps its last collectives (kCapacity of them, across all its
// process groups) in a ring: a sequence number per group, the operation, its size and dtype, when
// it started and ended, and whether it is pending, done, failed or dropped (let go without a wait).
// Recording is a lock and a few copies per collective, next to a collective's tens of microseconds
// at the least. The ring is dumped as JSON to <dir>/rank<r>.json (the Accelerator sets
// project_dir/flight) when a collective fails (a timeout, a peer gone), when the process ends on an
// uncaught exception (Gloo ends it so when a peer's message does not fit), and on SIGUSR2 (from a
// helper thread, so a rank stuck in a collective still answers). `tandem doctor DIR` reads every
// rank's dump and says which rank is behind, in which group and at which collective, and which
// ranks called a different collective or size at the same sequence number (diagnose_flight_dumps).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tandem/comm/heartbeat.h"

namespace tandem::comm {

struct FlightRecord {
  int64_t seq = 0;     ///< per group, from 1, in the order this rank issued them
  std::string group;   ///< "world", or "sub<k>" (nested: "sub0/sub1") for a subgroup
  std::string op;      ///< "allreduce", "broadcast", "all-gather", "send to rank 1 (tag 3)", ...
  int64_t numel = 0;   ///< elements of the first tensor
  std::string dtype;   ///< its dtype ("float", "int", ...)
  double start_s = 0;  ///< seconds since the recorder began
  double end_s = -1;   ///< -1 while pending
  std::string state;   ///< "pending", "done", "failed" or "dropped" (let go without a wait)
};

class FlightRecorder {
 public:
  static constexpr size_t kCapacity = 512;
  /// The process's recorder.
  static FlightRecorder& instance();

  /// A group and its global ranks, named in every dump.
  void add_group(const std::string& group, const std::vector<int>& ranks);
  /// Starts a record; the handle ends it (0: none).
  uint64_t begin(const std::string& group, const std::string& op, int64_t numel,
                 const std::string& dtype);
  void end(uint64_t handle, bool ok);
  /// Ends it as "dropped": its work was let go without a wait.
  void drop(uint64_t handle);
  /// The records in the ring, oldest first.
  std::vector<FlightRecord> records() const;

  /// dump() writes <dir>/rank<rank>.json; an empty dir: dump() writes nothing.
  void set_dump_path(const std::string& dir, int rank, int world);
  /// Writes the ring with `reason`; returns the file written, or "" (no path, or it failed).
  /// `blocking` false: gives up after half a second when another thread holds the ring.
  std::string dump(const std::string& reason, bool blocking = true);
  /// Dumps (reason "signal <n>") whenever `signal` arrives, and (reason "terminate: ...") when
  /// the process ends on an uncaught exception; installed once per process.
  void dump_on_signal(int signal);
  /// Forgets every record and group (tests).
  void clear();

  /// What a heartbeat says now (Note [Heartbeat]): the newest record, the oldest pending one and
  /// the ages; wall_s, pid and flight_dir filled too.
  HeartbeatReport heartbeat() const;
  /// Rewrites `path` with heartbeat() every `interval_s` seconds from a thread of its own
  /// (atomically: a temporary file renamed); again with the same path (a second Accelerator):
  /// one more user of the same thread.
  void beat_to(const std::string& path, double interval_s);
  /// The last user gone: stops the thread and removes the file (the launcher then stops
  /// watching this rank).
  void stop_beating();

 private:
  FlightRecorder();
  std::vector<FlightRecord> records_locked() const;
  void finish(uint64_t handle, const char* state);
  mutable std::mutex mu_;
  std::vector<FlightRecord> ring_;
  std::vector<uint64_t> ids_;  // the handle of each slot
  uint64_t next_ = 1;
  std::map<std::string, int64_t> seq_;
  std::map<std::string, std::vector<int>> groups_;
  std::string dir_;
  int rank_ = 0, world_ = 1;
  double last_activity_s_ = -1;  // when a collective last began or ended
  // The heartbeat's thread (beat_to).
  std::mutex beat_mu_;
  std::condition_variable beat_cv_;
  std::thread beat_thread_;
  std::string beat_path_;
  bool beat_stop_ = false;
  int beat_users_ = 0;  // beat_to calls not yet matched by stop_beating
};

}  // namespace tandem::comm
