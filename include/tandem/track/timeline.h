// Timeline: a per-rank recorder of timed spans (forward, backward, each bucket's allreduce, the
// optimizer step) written as Chrome trace JSON, viewable in chrome://tracing or Perfetto.
#pragma once

#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace tandem::track {

/// Whether and where a Timeline records.
///
/// Example:
///   tandem::track::Timeline timeline(
///       tandem::track::TimelineOptions().enabled(true).rank(state.rank).dir("traces"));
struct TimelineOptions {
  /// false: every call is a no-op that reads no clock and takes no lock.
  TORCH_ARG(bool, enabled) = false;
  /// This process's rank: the trace's pid, and the file name.
  TORCH_ARG(int, rank) = 0;
  /// Where write() puts timeline_rank<r>.json when given no folder.
  TORCH_ARG(std::string, dir) = "";
  /// Name shown for this process in the viewer; empty: "rank <r>".
  TORCH_ARG(std::string, process_name) = "";
};

/// A thread-safe recorder of complete events ({"ph": "X"}) for one rank. Timestamps are
/// microseconds on the wall clock (steady_clock offsets from a wall-clock origin taken at
/// construction), so the files of several ranks line up when opened together.
///
/// Example:
///   tandem::track::Timeline timeline(opts);
///   {
///     auto span = timeline.scope("forward", "compute");
///     loss = model->forward(x);
///   }
///   auto t0 = tandem::track::Timeline::Clock::now();   // measured elsewhere, e.g. a hook
///   ...
///   timeline.record("allreduce bucket 3", "comm", t0, tandem::track::Timeline::Clock::now());
///   timeline.write();  // <dir>/timeline_rank<r>.json
class Timeline {
 public:
  using Clock = std::chrono::steady_clock;

  /// A span that ends when destroyed. Move-only; a default or disabled one does nothing.
  class Scope {
   public:
    Scope() = default;
    Scope(Scope&& other) noexcept;
    Scope& operator=(Scope&& other) noexcept;
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    ~Scope();
    /// Ends the span now (instead of at destruction).
    void end();

   private:
    friend class Timeline;
    Scope(Timeline* timeline, std::string_view name, std::string_view cat);
    Timeline* timeline_ = nullptr;
    std::string name_, cat_;
    Clock::time_point start_;
  };

  explicit Timeline(TimelineOptions options = {});
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  bool enabled() const { return options_.enabled(); }
  int rank() const { return options_.rank(); }

  /// A span from now until the returned Scope is destroyed, on the calling thread.
  Scope scope(std::string_view name, std::string_view cat = "");
  /// A span measured elsewhere. tid < 0: the calling thread's id (small numbers from 0 in the
  /// order threads first record); give a fixed tid to put, say, communication on a row of its own.
  void record(std::string_view name, std::string_view cat, Clock::time_point start,
              Clock::time_point end, int64_t tid = -1);
  /// Names a row (tid) in the viewer.
  void set_thread_name(int64_t tid, std::string_view name);
  /// The tid record() uses for the calling thread.
  int64_t current_tid();

  /// Recorded spans so far.
  size_t size() const;
  /// Drops recorded spans (a long run writing one window at a time).
  void clear();
  /// The trace: {"traceEvents": [...], "displayTimeUnit": "ms"}.
  std::string to_json() const;
  /// Writes `<dir>/timeline_rank<r>.json` (dir empty: options.dir) atomically and returns its
  /// path; returns "" when disabled. Throws std::runtime_error when the folder cannot be written.
  std::string write(const std::string& dir = "") const;

 private:
  struct Event {
    std::string name, cat;
    double ts_us, dur_us;
    int64_t tid;
  };
  double to_wall_us(Clock::time_point t) const;

  TimelineOptions options_;
  Clock::time_point steady_origin_;
  double wall_origin_us_ = 0;
  mutable std::mutex mutex_;
  std::vector<Event> events_;
  std::map<std::thread::id, int64_t> tids_;
  std::map<int64_t, std::string> thread_names_;
};

}  // namespace tandem::track
