// Timeline: span recording and the Chrome trace JSON.
#include "tandem/track/timeline.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>

#include "track/detail/files.h"

namespace tandem::track {

Timeline::Scope::Scope(Timeline* timeline, std::string_view name, std::string_view cat)
    : timeline_(timeline), name_(name), cat_(cat), start_(Clock::now()) {}

Timeline::Scope::Scope(Scope&& other) noexcept
    : timeline_(other.timeline_),
      name_(std::move(other.name_)),
      cat_(std::move(other.cat_)),
      start_(other.start_) {
  other.timeline_ = nullptr;
}

Timeline::Scope& Timeline::Scope::operator=(Scope&& other) noexcept {
  if (this != &other) {
    end();
    timeline_ = other.timeline_;
    name_ = std::move(other.name_);
    cat_ = std::move(other.cat_);
    start_ = other.start_;
    other.timeline_ = nullptr;
  }
  return *this;
}

Timeline::Scope::~Scope() { end(); }

void Timeline::Scope::end() {
  if (!timeline_) return;
  Timeline* t = timeline_;
  timeline_ = nullptr;
  try {
    t->record(name_, cat_, start_, Clock::now());
  } catch (...) {
    // Out of memory while recording a span must not turn into std::terminate in a destructor.
  }
}

Timeline::Timeline(TimelineOptions options) : options_(std::move(options)) {
  steady_origin_ = Clock::now();
  wall_origin_us_ = detail::unix_time_now() * 1e6;
}

double Timeline::to_wall_us(Clock::time_point t) const {
  return wall_origin_us_ +
         std::chrono::duration<double, std::micro>(t - steady_origin_).count();
}

Timeline::Scope Timeline::scope(std::string_view name, std::string_view cat) {
  if (!options_.enabled()) return Scope();
  return Scope(this, name, cat);
}

int64_t Timeline::current_tid() {
  std::lock_guard<std::mutex> lock(mutex_);
  auto [it, inserted] = tids_.emplace(std::this_thread::get_id(), static_cast<int64_t>(tids_.size()));
  return it->second;
}

void Timeline::record(std::string_view name, std::string_view cat, Clock::time_point start,
                      Clock::time_point end, int64_t tid) {
  if (!options_.enabled()) return;
  double ts = to_wall_us(start);
  double dur = std::max(0.0, std::chrono::duration<double, std::micro>(end - start).count());
  std::lock_guard<std::mutex> lock(mutex_);
  if (tid < 0) {
    tid = tids_.emplace(std::this_thread::get_id(), static_cast<int64_t>(tids_.size())).first->second;
  }
  events_.push_back(Event{std::string(name), std::string(cat), ts, dur, tid});
}

void Timeline::set_thread_name(int64_t tid, std::string_view name) {
  if (!options_.enabled()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  thread_names_[tid] = std::string(name);
}

size_t Timeline::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

void Timeline::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  events_.clear();
}

std::string Timeline::to_json() const {
  using nlohmann::json;
  const int pid = options_.rank();
  json events = json::array();
  std::string pname = options_.process_name().empty() ? "rank " + std::to_string(pid)
                                                      : options_.process_name();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"tid", 0},
                    {"args", {{"name", pname}}}});
  // Sort rows by rank in a viewer showing several files together.
  events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", 0},
                    {"args", {{"sort_index", pid}}}});
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [tid, name] : thread_names_) {
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid},
                      {"args", {{"name", name}}}});
  }
  for (const auto& e : events_) {
    events.push_back({{"name", e.name}, {"cat", e.cat}, {"ph", "X"}, {"ts", e.ts_us},
                      {"dur", e.dur_us}, {"pid", pid}, {"tid", e.tid}});
  }
  json doc = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  return doc.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string Timeline::write(const std::string& dir) const {
  if (!options_.enabled()) return "";
  std::string folder = dir.empty() ? options_.dir() : dir;
  if (folder.empty()) folder = ".";
  detail::ensure_directory(folder, "Timeline::write");
  auto path = (std::filesystem::path(folder) /
               ("timeline_rank" + std::to_string(options_.rank()) + ".json"))
                  .string();
  detail::write_file_atomically(path, to_json() + "\n", "Timeline::write");
  return path;
}

}  // namespace tandem::track
