// RunRecorder (run_recorder.h): init_trackers / log / finish, and the spans of the per-rank
// Chrome trace (data wait, forward, backward, every bucket's reduction, optimizer).
#include "tandem/track/run_recorder.h"

#include <nlohmann/json.hpp>

#include "tandem/data/loader.h"
#include "tandem/parallel/ddp.h"

namespace tandem::track {

RunRecorder::RunRecorder(RunRecorderOptions options, data::LoaderState* loaders)
    : options_(std::move(options)), loaders_(loaders) {
  // The Accelerator hands in RunConfig::timeline_dir (TANDEM_TIMELINE resolved there).
  auto opts = TimelineOptions().rank(options_.rank());
  if (!options_.timeline_dir().empty()) opts.enabled(true).dir(options_.timeline_dir());
  timeline_ = std::make_shared<Timeline>(opts);
  if (!timeline_->enabled() || !loaders_) return;
  *last_ready_ = Timeline::Clock::now();
  // Note [Accelerator lifetime]: the callback owns what it touches; a loader that outlives the
  // recorder records into a timeline nobody writes out, which is harmless.
  loaders_->on_wait = [timeline = timeline_, last_ready = last_ready_](
                          Timeline::Clock::time_point a, Timeline::Clock::time_point b) {
    timeline->record("data wait", "data", a, b);
    *last_ready = b;
  };
}

RunRecorder::~RunRecorder() {
  if (loaders_) loaders_->on_wait = nullptr;
}

void RunRecorder::record_backward(Timeline::Clock::time_point begin,
                                  Timeline::Clock::time_point end,
                                  const std::vector<const parallel::GradientReducer*>& reducers) {
  if (!timeline_->enabled()) return;
  // LibTorch has no forward hooks: "forward" is the time from the last batch (or step) to the
  // start of backward, which is where the user's forward runs.
  if (*last_ready_ < begin) timeline_->record("forward", "compute", *last_ready_, begin);
  timeline_->record("backward", "compute", begin, end);
  for (const auto* r : reducers) {
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

void RunRecorder::init_trackers(const std::string& project_name, const Hparams& config) {
  trackers_ = make_trackers(options_.log_with(), options_.logging_dir(), project_name,
                            options_.main_process());
  trackers_.store_init_configuration(config);
  project_ = project_name;
}

void RunRecorder::log(const std::map<std::string, double>& values, int64_t step) {
  trackers_.log(values, step);
  last_step_ = step;
}

void RunRecorder::finish() {
  trackers_.finish();
  if (timeline_ && timeline_->enabled()) timeline_->write();
}

std::string RunRecorder::state_dict() const {
  return nlohmann::json{{"project", project_}, {"last_logged_step", last_step_}}.dump();
}

void RunRecorder::load_state_dict(const std::string& state) {
  if (state.empty()) return;
  auto j = nlohmann::json::parse(state);
  if (j.contains("last_logged_step")) last_step_ = j["last_logged_step"].get<int64_t>();
  if (j.contains("project") && project_.empty()) project_ = j["project"].get<std::string>();
}

}  // namespace tandem::track
