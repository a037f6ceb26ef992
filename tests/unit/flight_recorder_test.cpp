// Note [Flight recorder]: the ring of a rank's collectives, its dump, and tandem doctor's reading
// of several ranks' dumps (written here as a job's ranks write them).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "tandem/comm/flight_recorder.h"
#include "tandem/track/flight_doctor.h"

using tandem::comm::FlightRecorder;
namespace fs = std::filesystem;

namespace {

std::string temp_dir(const std::string& name) {
  const auto dir = fs::temp_directory_path() / ("tandem-flight-" + name + "-" +
                                                std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir.string();
}

// A job of `world` ranks: rank r issues `counts[r]` allreduces of 8 floats in "world" (the last
// one pending), and rank `odd` (if any) makes its collective `odd_at` one of 9.
void write_job(const std::string& dir, const std::vector<int>& counts, int odd = -1,
               int odd_at = 0) {
  auto& rec = FlightRecorder::instance();
  const int world = static_cast<int>(counts.size());
  std::vector<int> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(r);
  for (int r = 0; r < world; ++r) {
    rec.clear();
    rec.add_group("world", ranks);
    rec.set_dump_path(dir, r, world);
    for (int k = 1; k <= counts[static_cast<size_t>(r)]; ++k) {
      const auto h = rec.begin("world", "allreduce", r == odd && k == odd_at ? 9 : 8, "Float");
      if (k < counts[static_cast<size_t>(r)]) rec.end(h, true);
    }
    EXPECT_EQ(rec.dump("test"), dir + "/rank" + std::to_string(r) + ".json");
  }
  rec.clear();
  rec.set_dump_path("", 0, 1);
}

}  // namespace

TEST(FlightRecorder, KeepsTheLastCollectivesWithSequenceNumbersPerGroup) {
  auto& rec = FlightRecorder::instance();
  rec.clear();
  const auto a = rec.begin("world", "allreduce", 8, "Float");
  const auto b = rec.begin("sub0", "broadcast", 3, "Int");
  rec.end(a, true);
  rec.end(b, false);
  const auto c = rec.begin("world", "all-gather", 5, "Float");
  auto r = rec.records();
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].seq, 1);
  EXPECT_EQ(r[0].state, "done");
  EXPECT_EQ(r[1].group, "sub0");
  EXPECT_EQ(r[1].seq, 1);
  EXPECT_EQ(r[1].state, "failed");
  EXPECT_EQ(r[2].seq, 2);
  EXPECT_EQ(r[2].state, "pending");
  EXPECT_LT(r[2].end_s, 0);
  rec.end(c, true);
  // The ring keeps the newest kCapacity; an overwritten handle ends nothing.
  for (size_t k = 0; k < FlightRecorder::kCapacity + 10; ++k)
    rec.end(rec.begin("world", "allreduce", 1, "Float"), true);
  r = rec.records();
  EXPECT_EQ(r.size(), FlightRecorder::kCapacity);
  EXPECT_EQ(r.back().seq, static_cast<int64_t>(FlightRecorder::kCapacity + 12));
  rec.end(a, false);  // long overwritten
  for (const auto& x : rec.records()) EXPECT_EQ(x.state, "done");
  EXPECT_EQ(rec.dump("no path"), "");  // no dump path set: nothing written
  rec.clear();
}

TEST(FlightRecorder, DumpIsJson) {
  const auto dir = temp_dir("dump");
  auto& rec = FlightRecorder::instance();
  rec.clear();
  rec.add_group("world", {0, 1});
  rec.set_dump_path(dir, 1, 2);
  rec.begin("world", "allreduce", 4, "Float");
  const auto path = rec.dump("allreduce failed: timeout");
  ASSERT_EQ(path, dir + "/rank1.json");
  std::ifstream in(path);
  const auto doc = nlohmann::json::parse(in);
  EXPECT_EQ(doc["rank"], 1);
  EXPECT_EQ(doc["world"], 2);
  EXPECT_EQ(doc["reason"], "allreduce failed: timeout");
  EXPECT_EQ(doc["groups"]["world"], nlohmann::json::array({0, 1}));
  ASSERT_EQ(doc["collectives"].size(), 1u);
  EXPECT_EQ(doc["collectives"][0]["op"], "allreduce");
  EXPECT_EQ(doc["collectives"][0]["state"], "pending");
  rec.clear();
  rec.set_dump_path("", 0, 1);
  fs::remove_all(dir);
}

TEST(FlightDoctor, NamesTheRankBehindAndAMismatch) {
  const auto behind = temp_dir("behind");
  write_job(behind, {5, 5, 3});
  auto out = tandem::track::diagnose_flight_dumps(behind);
  EXPECT_NE(out.find("3 of 3 ranks' flight records"), std::string::npos) << out;
  EXPECT_NE(out.find("group world: rank 2 is behind: its last collective is #3 allreduce (8 x "
                     "Float, pending), while ranks 0 and 1 reached #5 allreduce (8 x Float, "
                     "pending)"),
            std::string::npos)
      << out;

  const auto odd = temp_dir("odd");
  write_job(odd, {4, 4}, 1, 3);
  out = tandem::track::diagnose_flight_dumps(odd);
  EXPECT_NE(out.find("group world, collective #3: the ranks called different collectives: rank 0 "
                     "allreduce (8 x Float); rank 1 allreduce (9 x Float);"),
            std::string::npos)
      << out;

  const auto even = temp_dir("even");
  write_job(even, {4, 4});
  out = tandem::track::diagnose_flight_dumps(even);
  EXPECT_NE(out.find("no rank is behind"), std::string::npos) << out;

  const auto missing = temp_dir("missing");
  write_job(missing, {4, 4});
  fs::remove(missing + "/rank1.json");
  std::ofstream(missing + "/rank1.json") << "[[[";
  try {
    tandem::track::diagnose_flight_dumps(missing);
    ADD_FAILURE() << "a damaged dump was read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("rank1.json"), std::string::npos) << e.what();
  }
  fs::create_directories(missing + "-empty");
  EXPECT_THROW(tandem::track::diagnose_flight_dumps(missing + "-empty"), std::runtime_error);
  for (const auto& d : {behind, odd, even, missing, missing + "-empty"}) fs::remove_all(d);
}

// Note [Heartbeat]: what a beat says (the newest record, the oldest pending one, the ages), its
// file read back as the launcher reads it, and a file that is not a whole beat refused.
TEST(Heartbeat, SaysTheNewestAndTheOldestPendingCollective) {
  auto& rec = FlightRecorder::instance();
  rec.clear();
  rec.set_dump_path("/tmp/run/flight", 0, 2);
  EXPECT_TRUE(rec.heartbeat().last.empty());
  EXPECT_LT(rec.heartbeat().activity_age_s, 0);
  const auto a = rec.begin("world", "allreduce", 8, "Float");
  rec.end(a, true);
  const auto b = rec.begin("world", "broadcast", 3, "Int");
  rec.begin("sub0", "all-gather", 5, "Float");
  auto beat = rec.heartbeat();
  EXPECT_EQ(beat.last, "#1 all-gather (5 x Float) in group sub0, pending");
  EXPECT_EQ(beat.pending, "#2 broadcast (3 x Int) in group world");
  EXPECT_GE(beat.pending_age_s, 0);
  EXPECT_GE(beat.activity_age_s, 0);
  EXPECT_EQ(beat.flight_dir, "/tmp/run/flight");
  EXPECT_EQ(beat.pid, static_cast<int>(::getpid()));
  rec.end(b, true);
  EXPECT_EQ(rec.heartbeat().pending, "#1 all-gather (5 x Float) in group sub0");

  const auto text = tandem::comm::format_heartbeat(beat);
  auto back = tandem::comm::parse_heartbeat(text);
  ASSERT_TRUE(back.has_value()) << text;
  EXPECT_EQ(back->last, beat.last);
  EXPECT_EQ(back->pending, beat.pending);
  EXPECT_EQ(back->pid, beat.pid);
  EXPECT_NEAR(back->wall_s, beat.wall_s, 1e-3);
  EXPECT_FALSE(tandem::comm::parse_heartbeat(text.substr(0, text.size() / 2)).has_value());
  EXPECT_FALSE(tandem::comm::parse_heartbeat("").has_value());
  rec.clear();
}

// The thread rewrites its file until the last user stops it; then the file is gone.
TEST(Heartbeat, BeatsUntilStoppedAndRemovesItsFile) {
  auto& rec = FlightRecorder::instance();
  rec.clear();
  const auto dir = temp_dir("beat");
  fs::create_directories(dir);
  const auto path = dir + "/rank0.beat";
  rec.beat_to(path, 0.02);
  rec.beat_to(path, 0.02);  // a second Accelerator of the process
  auto beat_time = [&] {  // -1: no whole beat there
    std::ifstream f(path);
    std::stringstream text;
    text << f.rdbuf();
    auto b = tandem::comm::parse_heartbeat(text.str());
    return b ? b->wall_s : -1.0;
  };
  double first = -1;
  for (int i = 0; i < 200 && first < 0; ++i, ::usleep(10 * 1000)) first = beat_time();
  ASSERT_GT(first, 0);
  double later = first;
  for (int i = 0; i < 200 && later <= first; ++i, ::usleep(10 * 1000)) later = beat_time();
  EXPECT_GT(later, first);
  EXPECT_THROW(rec.beat_to(dir + "/other.beat", 0.02), std::runtime_error);
  rec.stop_beating();
  EXPECT_TRUE(fs::exists(path));  // one user left
  rec.stop_beating();
  EXPECT_FALSE(fs::exists(path));
  fs::remove_all(dir);
}
