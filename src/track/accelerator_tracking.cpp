// The Accelerator's trackers and timeline: init_trackers / log / end_training, and the spans of
// the per-rank Chrome trace (data wait, forward, backward, every bucket's allreduce, optimizer).
#include <filesystem>

#include "tandem/accelerator.h"

namespace tandem {

void Accelerator::init_timeline() {
  auto opts = track::TimelineOptions::from_environment(state_.rank);
  if (!options_.timeline_dir().empty()) opts.enabled(true).dir(options_.timeline_dir());
  timeline_ = std::make_shared<track::Timeline>(opts);
  if (!timeline_->enabled()) return;
  *last_ready_ = track::Timeline::Clock::now();
  // Note [Accelerator lifetime]: the callback owns what it touches; a loader that outlives the
  // Accelerator records into a timeline nobody writes out, which is harmless.
  loader_state_->on_wait = [timeline = timeline_, last_ready = last_ready_](
                               track::Timeline::Clock::time_point a,
                               track::Timeline::Clock::time_point b) {
    timeline->record("data wait", "data", a, b);
    *last_ready = b;
  };
}

void Accelerator::record_backward(track::Timeline::Clock::time_point begin,
                                  track::Timeline::Clock::time_point end) {
  if (!timeline_->enabled()) return;
  // LibTorch has no forward hooks: "forward" is the time from the last batch (or step) to the
  // start of backward, which is where the user's forward runs.
  if (*last_ready_ < begin) timeline_->record("forward", "compute", *last_ready_, begin);
  timeline_->record("backward", "compute", begin, end);
  for (const auto* r : strategy_->reducers()) {
    if (!r->sync()) continue;
    auto t = r->last_timeline();
    for (size_t b = 0; b < t.bucket_started.size(); ++b)
      if (t.bucket_started[b] >= begin && t.bucket_finished[b] >= t.bucket_started[b])
        timeline_->record("allreduce bucket " + std::to_string(b) + " (" +
                              std::to_string(t.bucket_bytes[b] / 1024) + " KiB)",
                          "comm", t.bucket_started[b], t.bucket_finished[b], 1);
  }
  *last_ready_ = end;
}

void Accelerator::init_trackers(const std::string& project_name, const track::Hparams& config) {
  std::string dir = options_.logging_dir().empty()
                        ? (std::filesystem::path(options_.project_dir()) / "logs").string()
                        : options_.logging_dir();
  trackers_ = track::make_trackers(options_.log_with(), dir, project_name, is_main_process());
  trackers_.store_init_configuration(config);
}

void Accelerator::log(const std::map<std::string, double>& values, int64_t step) {
  trackers_.log(values, step);
}

void Accelerator::end_training() {
  trackers_.finish();
  if (timeline_ && timeline_->enabled()) timeline_->write();
}

}  // namespace tandem
