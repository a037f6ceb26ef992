// ProgressBar: plain lines with an injected clock, terminal redraws, silence off the main process.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tandem/track/progress.h"

using tandem::track::ProgressBar;
using tandem::track::ProgressOptions;

namespace {

// A temporary file standing in for stderr.
struct Capture {
  FILE* f = std::tmpfile();
  ~Capture() { std::fclose(f); }
  int fd() const { return fileno(f); }
  std::string text() const {
    std::string out;
    char buf[4096];
    ::lseek(fd(), 0, SEEK_SET);
    for (ssize_t n; (n = ::read(fd(), buf, sizeof(buf))) > 0;) out.append(buf, n);
    return out;
  }
};

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string line; std::getline(ss, line);) out.push_back(line);
  return out;
}

}  // namespace

TEST(ProgressBar, PlainLinesEveryIntervalAndAFinalLine) {
  Capture out;
  double now = 100.0;  // the fake clock: 50 steps per second
  {
    ProgressBar bar(ProgressOptions()
                        .total(1000)
                        .description("train")
                        .fd(out.fd())
                        .terminal(false)
                        .plain_interval_s(10)
                        .clock([&] { return now; }));
    EXPECT_TRUE(bar.active());
    EXPECT_FALSE(bar.terminal());
    for (int64_t step = 1; step <= 1000; ++step) {
      now = 100.0 + static_cast<double>(step) / 50.0;
      bar.update(step, 1.234);
    }
    bar.close();
    bar.close();  // idempotent: one final line
  }
  auto got = lines(out.text());
  ASSERT_EQ(got.size(), 3u) << out.text();
  EXPECT_EQ(got[0], "train: step 500/1000 (50%) 50.0 it/s eta 10s loss 1.234");
  EXPECT_EQ(got[1], "train: step 1000/1000 (100%) 50.0 it/s eta 0s loss 1.234");
  EXPECT_EQ(got[2], "train: step 1000/1000 (100%) 50.0 it/s done in 20s loss 1.234");
  EXPECT_EQ(out.text().find('\r'), std::string::npos);
}

TEST(ProgressBar, PlainWithoutTotalOrLossAndSlowSteps) {
  Capture out;
  double now = 0;
  ProgressBar bar(ProgressOptions().fd(out.fd()).terminal(false).plain_interval_s(5).clock(
      [&] { return now; }));
  now = 8;
  bar.update(2);  // 4 s per step
  now = 300;
  bar.update(75);
  bar.close();
  auto got = lines(out.text());
  ASSERT_EQ(got.size(), 3u) << out.text();
  EXPECT_EQ(got[0], "step 2 4.00 s/it");
  EXPECT_EQ(got[1], "step 75 4.00 s/it");
  EXPECT_EQ(got[2], "step 75 4.00 s/it done in 5m00s");
}

TEST(ProgressBar, ResumedRunCountsOnlyNewSteps) {
  Capture out;
  double now = 0;
  ProgressBar bar(ProgressOptions().total(200).initial(100).fd(out.fd()).terminal(false)
                      .plain_interval_s(1).clock([&] { return now; }));
  now = 10;
  bar.update(150, 0.5);  // 50 new steps in 10 s
  auto got = lines(out.text());
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0], "step 150/200 (75%) 5.0 it/s eta 10s loss 0.5");
}

TEST(ProgressBar, TerminalRedrawsInPlaceAtMostEveryMinInterval) {
  Capture out;
  double now = 0;
  {
    ProgressBar bar(ProgressOptions().total(10).fd(out.fd()).terminal(true).min_interval_s(1)
                        .bar_width(10).clock([&] { return now; }));
    EXPECT_TRUE(bar.terminal());
    for (int64_t step = 1; step <= 10; ++step) {
      now = static_cast<double>(step) * 0.25;  // 4 it/s: a redraw every 4 steps
      bar.update(step, 2.0);
    }
  }  // the destructor closes
  std::string text = out.text();
  // Draws: step 1 (first), 5 (1 s later), 9, 10 (the last step), then the final line.
  std::vector<std::string> draws;
  std::stringstream ss(text);
  for (std::string part; std::getline(ss, part, '\r');) {
    if (!part.empty()) draws.push_back(part);
  }
  ASSERT_EQ(draws.size(), 5u) << text;
  EXPECT_EQ(draws[0], "1/10  10% [#.........] 4.0 it/s eta 2s loss 2");
  EXPECT_NE(draws[1].find("5/10  50% [#####.....] 4.0 it/s eta 1s loss 2"), std::string::npos)
      << draws[1];
  EXPECT_NE(draws[3].find("10/10 100% [##########] 4.0 it/s eta 0s loss 2"), std::string::npos);
  EXPECT_NE(draws[4].find("10/10 100% [##########] 4.0 it/s done in 3s loss 2"), std::string::npos);
  EXPECT_EQ(text.back(), '\n');
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1);
}

TEST(ProgressBar, SilentOffTheMainProcessAndWhenDisabled) {
  Capture out;
  {
    ProgressBar bar(ProgressOptions().total(10).fd(out.fd()).terminal(false).plain_interval_s(0)
                        .is_main_process(false));
    EXPECT_FALSE(bar.active());
    for (int64_t s = 1; s <= 10; ++s) bar.update(s, 1.0);
    bar.close();
  }
  {
    ProgressBar bar(ProgressOptions().total(10).fd(out.fd()).terminal(true).enabled(false));
    bar.update(5);
  }
  EXPECT_EQ(out.text(), "");
}

// A rank whose loop ends by an exception never reports that it is done: the bar, destroyed
// while the exception unwinds, says "failed after".
TEST(ProgressBar, AnExceptionEndsWithFailedNotDone) {
  Capture out;
  double now = 0;
  try {
    ProgressBar bar(ProgressOptions()
                        .total(20)
                        .description("train")
                        .fd(out.fd())
                        .terminal(false)
                        .plain_interval_s(100)
                        .clock([&] { return now; }));
    for (int64_t step = 1; step <= 20; ++step) {
      now = static_cast<double>(step);
      bar.update(step, 0.5);
      if (step == 7) throw std::runtime_error("a collective failed");
    }
  } catch (const std::runtime_error&) {
  }
  auto got = lines(out.text());
  ASSERT_FALSE(got.empty()) << out.text();
  EXPECT_EQ(got.back(), "train: step 7/20 (35%) 1.0 it/s failed after 7s loss 0.5");
  EXPECT_EQ(out.text().find("done"), std::string::npos) << out.text();
}
