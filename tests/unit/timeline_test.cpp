// Timeline: Chrome trace JSON that parses, with the recorded spans, from several threads.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <set>
#include <thread>

#include "tandem/config/run_config.h"
#include "tandem/track/timeline.h"
#include "../common/temp_dir.h"

using tandem::testing::TempDir;
using tandem::track::Timeline;
using tandem::track::TimelineOptions;

TEST(Timeline, DisabledRecordsNothing) {
  Timeline t;  // disabled by default
  EXPECT_FALSE(t.enabled());
  { auto s = t.scope("forward"); }
  t.record("allreduce", "comm", Timeline::Clock::now(), Timeline::Clock::now());
  EXPECT_EQ(t.size(), 0u);
  EXPECT_EQ(t.write("/nonexistent/never/written"), "");
}

TEST(Timeline, FolderFromEnvironment) {
  EXPECT_EQ(tandem::config::timeline_dir_from_env({{"TANDEM_TIMELINE", "/tmp/traces"}}), "/tmp/traces");
  EXPECT_EQ(tandem::config::timeline_dir_from_env({}), "");
  EXPECT_EQ(tandem::config::timeline_dir_from_env({{"TANDEM_TIMELINE", ""}}), "");
}

TEST(Timeline, SpansAndMetadataInValidJson) {
  TempDir dir;
  double before_us =
      std::chrono::duration<double, std::micro>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  Timeline t(TimelineOptions().enabled(true).rank(3).dir(dir.str()));
  {
    auto s = t.scope("forward", "compute");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  auto start = Timeline::Clock::now();
  auto end = start + std::chrono::microseconds(1500);
  t.record("allreduce bucket 0", "comm", start, end, /*tid=*/7);
  t.set_thread_name(7, "communication");
  auto moved = t.scope("step", "optim");
  auto target = std::move(moved);  // a moved-from scope records nothing
  target.end();
  EXPECT_EQ(t.size(), 3u);

  std::string path = t.write();
  EXPECT_EQ(path, (dir.path / "timeline_rank3.json").string());
  std::ifstream in(path);
  auto doc = nlohmann::json::parse(in);
  ASSERT_TRUE(doc["traceEvents"].is_array());
  std::map<std::string, nlohmann::json> spans;
  bool process_name = false, thread_name = false;
  for (const auto& e : doc["traceEvents"]) {
    EXPECT_EQ(e["pid"], 3);
    if (e["ph"] == "X") spans[e["name"]] = e;
    if (e["ph"] == "M" && e["name"] == "process_name") process_name = e["args"]["name"] == "rank 3";
    if (e["ph"] == "M" && e["name"] == "thread_name") thread_name = e["args"]["name"] == "communication" && e["tid"] == 7;
  }
  EXPECT_TRUE(process_name);
  EXPECT_TRUE(thread_name);
  ASSERT_EQ(spans.size(), 3u);
  EXPECT_EQ(spans["forward"]["cat"], "compute");
  EXPECT_GE(spans["forward"]["dur"].get<double>(), 2000.0);
  EXPECT_GE(spans["forward"]["ts"].get<double>(), before_us - 1e6);
  EXPECT_LE(spans["forward"]["ts"].get<double>(), before_us + 60e6);
  EXPECT_EQ(spans["allreduce bucket 0"]["tid"], 7);
  EXPECT_DOUBLE_EQ(spans["allreduce bucket 0"]["dur"].get<double>(), 1500.0);
  EXPECT_GE(spans["allreduce bucket 0"]["ts"].get<double>(), spans["forward"]["ts"].get<double>());
  EXPECT_EQ(spans["step"]["cat"], "optim");
  EXPECT_EQ(spans["forward"]["tid"], spans["step"]["tid"]);  // same thread, same row
}

TEST(Timeline, ThreadSafeRecording) {
  Timeline t(TimelineOptions().enabled(true).rank(0));
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&t] {
      for (int k = 0; k < 500; ++k) auto s = t.scope("work", "cpu");
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(t.size(), 2000u);
  auto doc = nlohmann::json::parse(t.to_json());
  std::set<int64_t> tids;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "X") tids.insert(e["tid"].get<int64_t>());
  }
  EXPECT_EQ(tids.size(), 4u);
}
