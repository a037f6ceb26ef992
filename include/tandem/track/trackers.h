// Metric trackers: where a run's hyper-parameters and logged values go (JSON lines, CSV,
// TensorBoard event files), and TrackerSet, which fans one call out to all of them.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

namespace tandem::track {

/// One hyper-parameter value: a bool, an integer, a floating-point number or a string.
/// Converts implicitly, so that `{{"lr", 3e-4}, {"batch_size", 32}, {"model", "gpt"}}` is an
/// Hparams.
struct HparamValue {
  std::variant<bool, int64_t, double, std::string> value;

  HparamValue(bool v) : value(v) {}  // NOLINT: implicit on purpose
  template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
  HparamValue(T v) : value(static_cast<int64_t>(v)) {}  // NOLINT
  HparamValue(double v) : value(v) {}                    // NOLINT
  HparamValue(float v) : value(static_cast<double>(v)) {}  // NOLINT
  HparamValue(const char* v) : value(std::string(v)) {}  // NOLINT
  HparamValue(std::string v) : value(std::move(v)) {}    // NOLINT

  /// The value as text: "true", "32", "0.0003", "gpt".
  std::string to_string() const;
};

/// A run's configuration, as handed to Tracker::store_init_configuration.
using Hparams = std::map<std::string, HparamValue>;

/// Where metrics go. Implementations write files; a tracker of your own (a database, a
/// web service) derives from this and joins a TrackerSet with TrackerSet::add.
///
/// Example:
///   struct PrintTracker : tandem::track::Tracker {
///     std::string name() const override { return "print"; }
///     void store_init_configuration(const tandem::track::Hparams&) override {}
///     void log(const std::map<std::string, double>& v, int64_t step) override {
///       for (auto& [k, x] : v) std::cout << step << " " << k << " " << x << "\n";
///     }
///     void finish() override {}
///   };
class Tracker {
 public:
  virtual ~Tracker() = default;
  /// Short name ("jsonl", "csv", "tensorboard").
  virtual std::string name() const = 0;
  /// Records the run's hyper-parameters; call once, before the first log().
  virtual void store_init_configuration(const Hparams& hparams) = 0;
  /// Records values at a step. Every call is flushed, so a crashed run keeps what it logged.
  virtual void log(const std::map<std::string, double>& values, int64_t step) = 0;
  /// Flushes and closes. Idempotent; later log() calls are errors.
  virtual void finish() = 0;
};

/// JSON lines: `<run_dir>/metrics.jsonl`, one object per log() call,
/// `{"step": 120, "wall_time": 1712345678.25, "values": {"loss": 1.234}}` (wall_time in seconds
/// since the Unix epoch; NaN and infinities become null). Hyper-parameters go to a separate
/// `<run_dir>/hparams.json`, so that every line of metrics.jsonl has the same shape. An existing
/// metrics.jsonl is appended to (a resumed run continues its log).
class JsonlTracker : public Tracker {
 public:
  /// Creates run_dir when needed. Throws std::runtime_error when it cannot be written.
  explicit JsonlTracker(const std::string& run_dir);
  ~JsonlTracker() override;
  std::string name() const override { return "jsonl"; }
  void store_init_configuration(const Hparams& hparams) override;
  void log(const std::map<std::string, double>& values, int64_t step) override;
  void finish() override;
  /// Path of metrics.jsonl.
  const std::string& path() const { return path_; }

 private:
  std::string run_dir_, path_;
  struct File;
  std::unique_ptr<File> file_;
};

/// CSV: `<run_dir>/metrics.csv` with columns `step,wall_time,<keys...>`; the keys are those of
/// the first log() call (sorted), a key missing from a later call leaves its cell empty, and a
/// key seen for the first time later adds a column at the right: the file is rewritten once
/// with the wider header (earlier rows get empty cells). Hyper-parameters go to
/// `<run_dir>/hparams.csv` (`name,value`). An existing metrics.csv is continued with its own
/// columns (a resumed run).
class CsvTracker : public Tracker {
 public:
  explicit CsvTracker(const std::string& run_dir);
  ~CsvTracker() override;
  std::string name() const override { return "csv"; }
  void store_init_configuration(const Hparams& hparams) override;
  void log(const std::map<std::string, double>& values, int64_t step) override;
  void finish() override;
  const std::string& path() const { return path_; }
  /// The current columns, step and wall_time included.
  const std::vector<std::string>& columns() const { return columns_; }

 private:
  void widen(const std::vector<std::string>& new_keys);
  std::string run_dir_, path_;
  std::vector<std::string> columns_;
  struct File;
  std::unique_ptr<File> file_;
};

/// TensorBoard: `<run_dir>/events.out.tfevents.<unix time>.<host>` in TensorFlow's record format
/// (each record: uint64 length, masked CRC32C of the length, a serialized `Event`, masked
/// CRC32C of the data). The first event carries file_version "brain.Event:2"; each logged value
/// is an Event{wall_time, step, summary{value{tag, simple_value}}} (a float: TensorBoard's scalar
/// type). Hyper-parameters are written at step 0 as a text summary with tag "hparams", a
/// Markdown table shown in TensorBoard's Text tab. No TensorFlow or protobuf library is needed:
/// the few messages are encoded by hand.
class TensorBoardTracker : public Tracker {
 public:
  explicit TensorBoardTracker(const std::string& run_dir);
  ~TensorBoardTracker() override;
  std::string name() const override { return "tensorboard"; }
  void store_init_configuration(const Hparams& hparams) override;
  void log(const std::map<std::string, double>& values, int64_t step) override;
  void finish() override;
  /// Path of the event file.
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& data);
  std::string path_;
  struct File;
  std::unique_ptr<File> file_;
};

/// The names make_trackers understands, besides "all".
std::vector<std::string> available_trackers();

/// A group of trackers used as one. Move-only; finishes its trackers when destroyed.
///
/// Example:
///   auto trackers = tandem::track::make_trackers({"all"}, "runs", "gpt-small",
///                                                state.is_main_process());
///   trackers.store_init_configuration({{"lr", 3e-4}, {"batch_size", 32}});
///   trackers.log({{"loss", 1.23}, {"lr", 3e-4}}, step);
///   trackers.finish();
class TrackerSet {
 public:
  TrackerSet() = default;
  TrackerSet(TrackerSet&&) = default;
  TrackerSet& operator=(TrackerSet&&);
  ~TrackerSet();

  /// Adds a tracker (a built-in or one of your own).
  void add(std::unique_ptr<Tracker> tracker);
  void store_init_configuration(const Hparams& hparams);
  void log(const std::map<std::string, double>& values, int64_t step);
  /// Finishes every tracker. Idempotent.
  void finish();

  bool empty() const { return trackers_.empty(); }
  size_t size() const { return trackers_.size(); }
  /// The tracker with that name, or nullptr.
  Tracker* get(const std::string& name) const;
  const std::vector<std::unique_ptr<Tracker>>& trackers() const { return trackers_; }

 private:
  std::vector<std::unique_ptr<Tracker>> trackers_;
  bool finished_ = false;
};

/// Builds the named trackers ("jsonl", "csv", "tensorboard", or "all"), each writing into
/// `<logging_dir>/<project_name>/`. On a process that is not the main one the set is empty: only
/// the main process writes. Throws std::invalid_argument for an unknown name (listing the known
/// ones) or an empty logging_dir, std::runtime_error when the folder cannot be written.
TrackerSet make_trackers(const std::vector<std::string>& names, const std::string& logging_dir,
                         const std::string& project_name, bool is_main_process = true);

}  // namespace tandem::track
