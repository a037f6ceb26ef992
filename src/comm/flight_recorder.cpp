// The flight recorder and `tandem doctor` (Note [Flight recorder] in flight_recorder.h).
#include "tandem/comm/flight_recorder.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <exception>
#include <stdexcept>
#include <thread>

#include <nlohmann/json.hpp>

namespace tandem::comm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

const Clock::time_point g_start = Clock::now();

double now_s() { return std::chrono::duration<double>(Clock::now() - g_start).count(); }

int g_dump_pipe[2] = {-1, -1};
std::atomic<int> g_dump_signal{0};

std::terminate_handler g_previous_terminate = nullptr;

// A process ending on an uncaught exception (Gloo ends it so when a peer's message does not fit
// the collective: "op.preamble.length <= op.nbytes") writes its ring first.
[[noreturn]] void on_terminate() {
  std::string what = "an uncaught exception";
  if (auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      what = x.what();
    } catch (...) {
    }
  }
  const auto nl = what.find('\n');
  const auto path =
      FlightRecorder::instance().dump("terminate: " + what.substr(0, nl), /*blocking=*/false);
  if (!path.empty()) {
    const std::string line = "tandem: flight recorder written to " + path + "\n";
    ssize_t rc = ::write(2, line.data(), line.size());
    (void)rc;
  }
  if (g_previous_terminate) g_previous_terminate();
  std::abort();
}

extern "C" void on_dump_signal(int sig) {
  const unsigned char b = static_cast<unsigned char>(sig);
  if (g_dump_pipe[1] >= 0) {
    ssize_t rc = ::write(g_dump_pipe[1], &b, 1);
    (void)rc;
  }
}

json to_json(const FlightRecord& r) {
  return json{{"seq", r.seq},         {"group", r.group}, {"op", r.op},
              {"numel", r.numel},     {"dtype", r.dtype}, {"start_s", r.start_s},
              {"end_s", r.end_s},     {"state", r.state}};
}

}  // namespace

FlightRecorder::FlightRecorder() : ring_(kCapacity), ids_(kCapacity, 0) {}

FlightRecorder& FlightRecorder::instance() {
  static FlightRecorder* recorder = new FlightRecorder();  // never destroyed: dumps at exit work
  return *recorder;
}

void FlightRecorder::add_group(const std::string& group, const std::vector<int>& ranks) {
  std::lock_guard<std::mutex> lock(mu_);
  groups_[group] = ranks;
}

uint64_t FlightRecorder::begin(const std::string& group, const std::string& op, int64_t numel,
                               const std::string& dtype) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_++;
  const size_t slot = id % kCapacity;
  auto& r = ring_[slot];
  r.seq = ++seq_[group];
  r.group = group;
  r.op = op;
  r.numel = numel;
  r.dtype = dtype;
  r.start_s = now_s();
  r.end_s = -1;
  r.state = "pending";
  ids_[slot] = id;
  last_activity_s_ = r.start_s;
  return id;
}

void FlightRecorder::end(uint64_t handle, bool ok) { finish(handle, ok ? "done" : "failed"); }

void FlightRecorder::drop(uint64_t handle) { finish(handle, "dropped"); }

void FlightRecorder::finish(uint64_t handle, const char* state) {
  if (handle == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  const size_t slot = handle % kCapacity;
  if (ids_[slot] != handle) return;  // overwritten since
  ring_[slot].end_s = now_s();
  ring_[slot].state = state;
  last_activity_s_ = ring_[slot].end_s;
}

std::vector<FlightRecord> FlightRecorder::records() const {
  std::lock_guard<std::mutex> lock(mu_);
  return records_locked();
}

std::vector<FlightRecord> FlightRecorder::records_locked() const {
  std::vector<FlightRecord> out;
  const uint64_t first = next_ > kCapacity ? next_ - kCapacity : 1;
  for (uint64_t id = first; id < next_; ++id)
    if (ids_[id % kCapacity] == id) out.push_back(ring_[id % kCapacity]);
  return out;
}

void FlightRecorder::set_dump_path(const std::string& dir, int rank, int world) {
  std::lock_guard<std::mutex> lock(mu_);
  dir_ = dir;
  rank_ = rank;
  world_ = world;
}

std::string FlightRecorder::dump(const std::string& reason, bool blocking) {
  std::string dir;
  int rank = 0, world = 1;
  std::map<std::string, std::vector<int>> groups;
  std::vector<FlightRecord> records;
  {
    std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
    if (blocking) {
      lock.lock();
    } else {
      // From a crash: the thread that holds the lock may be the one that is gone.
      for (int i = 0; i < 50 && !lock.try_lock(); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      if (!lock.owns_lock()) return "";
    }
    dir = dir_;
    rank = rank_;
    world = world_;
    groups = groups_;
    records = records_locked();
  }
  if (dir.empty()) return "";
  json doc{{"rank", rank}, {"world", world}, {"reason", reason}, {"time_s", now_s()},
           {"capacity", kCapacity}, {"groups", groups}, {"collectives", json::array()}};
  for (const auto& r : records) doc["collectives"].push_back(to_json(r));
  std::error_code ec;
  fs::create_directories(dir, ec);
  const auto path = (fs::path(dir) / ("rank" + std::to_string(rank) + ".json")).string();
  const auto tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << doc.dump(1) << "\n";
    if (!out) return "";
  }
  fs::rename(tmp, path, ec);
  return ec ? "" : path;
}

void FlightRecorder::dump_on_signal(int signal) {
  int expected = 0;
  if (!g_dump_signal.compare_exchange_strong(expected, signal)) return;  // once per process
  g_previous_terminate = std::set_terminate(on_terminate);
  if (::pipe2(g_dump_pipe, O_CLOEXEC) != 0) return;
  struct sigaction sa {};
  sa.sa_handler = on_dump_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(signal, &sa, nullptr);
  // The dump runs here, not in the handler: a rank stuck in a collective still answers.
  std::thread([this] {
    unsigned char sig = 0;
    for (;;) {
      const ssize_t n = ::read(g_dump_pipe[0], &sig, 1);
      if (n < 0 && errno == EINTR) continue;
      if (n != 1) return;
      const auto path = dump("signal " + std::to_string(sig));
      if (!path.empty()) {
        const std::string line = "tandem: flight recorder written to " + path + "\n";
        ssize_t rc = ::write(2, line.data(), line.size());
        (void)rc;
      }
    }
  }).detach();
}

void FlightRecorder::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  ring_.assign(kCapacity, FlightRecord());
  ids_.assign(kCapacity, 0);
  next_ = 1;
  seq_.clear();
  groups_.clear();
  last_activity_s_ = -1;
}

// Note [Heartbeat]
HeartbeatReport FlightRecorder::heartbeat() const {
  auto describe = [](const FlightRecord& r) {
    return "#" + std::to_string(r.seq) + " " + r.op + " (" + std::to_string(r.numel) + " x " +
           r.dtype + ") in group " + r.group;
  };
  HeartbeatReport out;
  out.wall_s = std::chrono::duration<double>(
                   std::chrono::system_clock::now().time_since_epoch())
                   .count();
  out.pid = static_cast<int>(::getpid());
  std::lock_guard<std::mutex> lock(mu_);
  const double now = now_s();
  out.flight_dir = dir_;
  if (last_activity_s_ >= 0) out.activity_age_s = now - last_activity_s_;
  const uint64_t first = next_ > kCapacity ? next_ - kCapacity : 1;
  for (uint64_t id = first; id < next_; ++id) {
    const auto& r = ring_[id % kCapacity];
    if (ids_[id % kCapacity] != id) continue;
    out.last = describe(r) + ", " + r.state;
    if (r.state == "pending" && out.pending.empty()) {
      out.pending = describe(r);
      out.pending_age_s = now - r.start_s;
    }
  }
  return out;
}

void FlightRecorder::beat_to(const std::string& path, double interval_s) {
  std::lock_guard<std::mutex> lock(beat_mu_);
  if (beat_thread_.joinable()) {
    if (path == beat_path_) {
      ++beat_users_;
      return;
    }
    throw std::runtime_error("tandem: this process already writes its heartbeat to " +
                             beat_path_ + "; it cannot write another to " + path);
  }
  beat_path_ = path;
  beat_stop_ = false;
  beat_users_ = 1;
  const auto every = std::chrono::milliseconds(
      std::max<int64_t>(10, static_cast<int64_t>(interval_s * 1000.0)));
  beat_thread_ = std::thread([this, path, every] {
    const std::string tmp = path + ".tmp";
    std::unique_lock<std::mutex> lock(beat_mu_);
    while (!beat_stop_) {
      lock.unlock();
      {
        std::ofstream out(tmp, std::ios::trunc);
        out << format_heartbeat(heartbeat());
      }
      std::error_code ec;
      fs::rename(tmp, path, ec);  // a launcher that is gone took its folder: nothing to say
      lock.lock();
      beat_cv_.wait_for(lock, every, [this] { return beat_stop_; });
    }
  });
}

void FlightRecorder::stop_beating() {
  std::thread t;
  std::string path;
  {
    std::lock_guard<std::mutex> lock(beat_mu_);
    if (!beat_thread_.joinable() || --beat_users_ > 0) return;
    beat_stop_ = true;
    t = std::move(beat_thread_);
    path = beat_path_;
    beat_path_.clear();
  }
  beat_cv_.notify_all();
  t.join();
  std::error_code ec;
  fs::remove(path, ec);
  fs::remove(path + ".tmp", ec);
}

}  // namespace tandem::comm
