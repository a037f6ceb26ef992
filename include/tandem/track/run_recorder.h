// RunRecorder: the tracking component of a run. It owns the metric trackers (JSONL, CSV,
// TensorBoard) and the per-rank timeline, and records the spans of every step (data wait,
// forward, backward, each bucket's reduction, optimizer). The Accelerator owns one.
#pragma once

#include <torch/arg.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tandem/track/timeline.h"
#include "tandem/track/trackers.h"

namespace tandem {
namespace data {
struct LoaderState;
}
namespace parallel {
class GradientReducer;
}
}  // namespace tandem

namespace tandem::track {

/// Options of a RunRecorder.
///
/// Example:
///   track::RunRecorder rec(track::RunRecorderOptions().rank(0).main_process(true)
///                              .log_with({"jsonl"}).logging_dir("runs"));
struct RunRecorderOptions {
  TORCH_ARG(int, rank) = 0;
  /// Only the main process writes metric logs.
  TORCH_ARG(bool, main_process) = true;
  /// Trackers started by init_trackers: any of "jsonl", "csv", "tensorboard", or "all".
  TORCH_ARG(std::vector<std::string>, log_with) = std::vector<std::string>{"all"};
  /// Where init_trackers writes (<logging_dir>/<project_name>/).
  TORCH_ARG(std::string, logging_dir) = "logs";
  /// Per-rank timeline written here; empty: none (the Accelerator passes its RunConfig's
  /// timeline_dir: AcceleratorOptions::timeline_dir, else TANDEM_TIMELINE).
  TORCH_ARG(std::string, timeline_dir) = "";
};

/// The tracking component. Not copyable; one per Accelerator.
class RunRecorder {
 public:
  /// `loaders`: the prepared loaders' shared state, whose waits become "data wait" spans
  /// (may be null).
  explicit RunRecorder(RunRecorderOptions options, data::LoaderState* loaders = nullptr);
  ~RunRecorder();
  RunRecorder(const RunRecorder&) = delete;
  RunRecorder& operator=(const RunRecorder&) = delete;

  /// Starts the trackers on the main process and records the hyper-parameters.
  void init_trackers(const std::string& project_name, const Hparams& config = {});
  /// Logs scalar values at a step (main process only).
  void log(const std::map<std::string, double>& values, int64_t step);
  /// Finishes the trackers and writes the timeline. Idempotent.
  void finish();

  /// Records a backward pass (and the forward before it, which LibTorch cannot hook) and the
  /// bucket reductions of `reducers` that ran inside it.
  void record_backward(Timeline::Clock::time_point begin, Timeline::Clock::time_point end,
                       const std::vector<const parallel::GradientReducer*>& reducers);
  Timeline& timeline() { return *timeline_; }

  /// The project and the last logged step, as JSON text.
  std::string state_dict() const;
  /// Restores state_dict(): a resumed run knows where the logs stopped (last_logged_step()).
  void load_state_dict(const std::string& state);
  /// The step of the last log() call (-1: none), restored on resume.
  int64_t last_logged_step() const { return last_step_; }
  const std::string& project_name() const { return project_; }

 private:
  RunRecorderOptions options_;
  data::LoaderState* loaders_;
  TrackerSet trackers_;
  std::string project_;
  int64_t last_step_ = -1;
  // Shared with the loaders' wait callback, which must not hold the recorder itself.
  std::shared_ptr<Timeline> timeline_;
  std::shared_ptr<Timeline::Clock::time_point> last_ready_ =  // end of the last wait/step
      std::make_shared<Timeline::Clock::time_point>();
};

}  // namespace tandem::track
