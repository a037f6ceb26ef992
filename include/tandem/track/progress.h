// ProgressBar: one line of training progress on the main process: redrawn in place on a terminal,
// plain periodic lines in a log file or a pipe (where '\r' would pile up into one huge line).
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace tandem::track {

/// How a ProgressBar looks and where it writes.
///
/// Example:
///   auto bar = tandem::track::ProgressBar(tandem::track::ProgressOptions()
///                                             .total(1000)
///                                             .description("train")
///                                             .is_main_process(state.is_main_process()));
///   for (int64_t step = 1; step <= 1000; ++step) bar.update(step, loss.item<double>());
///   bar.close();
struct ProgressOptions {
  /// Steps in the run; 0 when unknown (then no percent, bar or ETA is shown).
  TORCH_ARG(int64_t, total) = 0;
  /// Printed before the step count ("train: ...").
  TORCH_ARG(std::string, description) = "";
  /// false: the bar is a no-op everywhere.
  TORCH_ARG(bool, enabled) = true;
  /// Only the main process ever prints; on the others every call is a no-op.
  TORCH_ARG(bool, is_main_process) = true;
  /// Where to write (default stderr, so that stdout stays clean for the program's own output).
  TORCH_ARG(int, fd) = 2;
  /// Terminal mode (redraw in place) or plain lines; unset: isatty(fd) decides.
  TORCH_ARG(std::optional<bool>, terminal) = std::nullopt;
  /// Terminal mode: at most one redraw per this many seconds (the last step always redraws).
  TORCH_ARG(double, min_interval_s) = 0.1;
  /// Plain mode: one line per this many seconds, plus a final line on close().
  TORCH_ARG(double, plain_interval_s) = 10.0;
  /// Steps already done before this bar started (a resumed run); the rate counts only new ones.
  TORCH_ARG(int64_t, initial) = 0;
  /// Characters between the brackets of the bar, terminal mode.
  TORCH_ARG(int, bar_width) = 30;
  /// Seconds from any fixed origin; unset: std::chrono::steady_clock. Tests inject a fake clock.
  TORCH_ARG(std::function<double()>, clock) = nullptr;
};

/// A progress bar for a training loop. Not thread-safe: call it from the training thread.
///
/// On a terminal: "train: 120/1000  12% [###.........] 35.2 it/s eta 25s loss 1.234", redrawn
/// in place. Elsewhere: "train: step 120/1000 (12%) 35.2 it/s eta 25s loss 1.234" every
/// plain_interval_s seconds and a final "... done in 28s" line on close(). The rate is the mean
/// over the steps since the bar started, the ETA is the remaining steps at that rate.
///
/// Example:
///   tandem::track::ProgressBar bar(tandem::track::ProgressOptions().total(steps));
///   bar.update(step, loss_value);   // or bar.update(step) without a loss
class ProgressBar {
 public:
  explicit ProgressBar(ProgressOptions options = {});
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  /// Records that `step` steps are done (counted from 0, or from options.initial), with the
  /// latest loss when given, and redraws or prints when it is time to.
  void update(int64_t step, std::optional<double> loss = std::nullopt);
  /// Draws the final state and ends the line. Idempotent; the destructor calls it. Destroyed
  /// while an exception unwinds the loop, the bar's last line says "failed after ..." instead of
  /// "done in ...": a rank that fails never reports that it finished.
  void close();

  /// Whether this bar prints at all (enabled and main process).
  bool active() const { return active_; }
  /// Whether it draws in place (terminal) or prints plain lines.
  bool terminal() const { return terminal_; }

 private:
  double now() const;
  std::string status(bool plain, bool final, bool failed = false) const;
  void emit(const std::string& text);

  ProgressOptions options_;
  bool active_ = false;
  bool terminal_ = false;
  bool closed_ = false;
  double start_ = 0;
  double last_draw_ = 0;
  bool drawn_ = false;
  int64_t step_ = 0;
  std::optional<double> loss_;
  size_t last_width_ = 0;
  int uncaught_at_start_ = 0;  // std::uncaught_exceptions() when the bar was made
};

}  // namespace tandem::track
