// tandem::launch::launch: workers forked from this test process run a function over a real
// Gloo process group; a worker's exception comes back with its message; unsafe forks are refused.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "tandem/comm/process_group.h"
#include "tandem/launch/fork_launcher.h"

using tandem::launch::ForkLaunchOptions;
using tandem::launch::WorkerFailed;

namespace {

std::string temp_dir() {
  char tmpl[] = "/tmp/tandem-fork-XXXXXX";
  return mkdtemp(tmpl);
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::shared_ptr<tandem::ProcessGroup> join_job() {
  return tandem::ProcessGroup::create(
      tandem::ProcessState::from_environment(),
      tandem::ProcessGroupOptions().timeout(std::chrono::seconds(20)));
}

}  // namespace

TEST(ForkLauncher, TwoWorkersRunTheFunction) {
  const std::string dir = temp_dir();
  // Built before launching: the workers read it copy-on-write.
  auto shared = at::arange(5, at::kFloat);
  tandem::launch::launch(
      [&] {
        auto state = tandem::ProcessState::from_environment();
        auto pg = join_job();
        auto t = shared * static_cast<float>(pg->rank() + 1);
        pg->allreduce(t, tandem::ReduceOp::kSum);
        std::ofstream(dir + "/rank" + std::to_string(pg->rank()))
            << state.rank << " " << state.world_size << " " << state.local_rank << " "
            << std::getenv("TANDEM_MIXED_PRECISION") << " " << t.sum().item<float>();
      },
      2, ForkLaunchOptions().mixed_precision("bf16"));
  // (0+1+2+3+4) * (1 + 2) = 30 on both ranks.
  EXPECT_EQ(read_file(dir + "/rank0"), "0 2 0 bf16 30");
  EXPECT_EQ(read_file(dir + "/rank1"), "1 2 1 bf16 30");
  EXPECT_EQ(tandem::live_process_groups(), 0);
  std::system(("rm -rf " + dir).c_str());
}

TEST(ForkLauncher, AWorkersExceptionIsRethrownWithItsMessage) {
  auto started = std::chrono::steady_clock::now();
  try {
    tandem::launch::launch(
        [] {
          auto pg = join_job();
          if (pg->rank() == 1) throw std::runtime_error("loss is NaN at step 7");
          pg->barrier();  // rank 0 waits for rank 1, which is gone
        },
        2);
    FAIL() << "launch returned although rank 1 threw";
  } catch (const WorkerFailed& e) {
    EXPECT_EQ(e.rank(), 1);
    EXPECT_EQ(e.worker_message(), "loss is NaN at step 7");
    EXPECT_STREQ(e.what(), "tandem::launch: rank 1 of 2 failed: loss is NaN at step 7");
  }
  // Rank 0 was stopped rather than left to its 20 s timeout.
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(), 15);
}

TEST(ForkLauncher, AKilledWorkerIsNamed) {
  try {
    tandem::launch::launch(
        [] {
          if (std::atoi(std::getenv("RANK")) == 0) ::raise(SIGKILL);
        },
        2);
    FAIL() << "launch returned although rank 0 was killed";
  } catch (const WorkerFailed& e) {
    EXPECT_EQ(e.rank(), 0);
    EXPECT_NE(std::string(e.what()).find("rank 0 of 2 failed: killed by signal 9"),
              std::string::npos)
        << e.what();
  }
  try {
    tandem::launch::launch([] { ::_exit(3); }, 1);
    FAIL() << "launch returned although the worker exited with 3";
  } catch (const WorkerFailed& e) {
    EXPECT_NE(std::string(e.what()).find("exited with code 3"), std::string::npos) << e.what();
  }
}

TEST(ForkLauncher, RefusesWhileAnotherThreadRuns) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::thread t([&] {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return done; });
  });
  std::string error;
  try {
    tandem::launch::launch([] {}, 2);
  } catch (const std::runtime_error& e) {
    error = e.what();
  }
  {
    std::lock_guard<std::mutex> lock(m);
    done = true;
  }
  cv.notify_all();
  t.join();
  EXPECT_NE(error.find("runs 2 threads"), std::string::npos) << error;
}

TEST(ForkLauncher, RefusesWhileAProcessGroupIsAlive) {
  // Inside the workers a process group of two ranks is alive: a nested launch must refuse.
  const std::string dir = temp_dir();
  tandem::launch::launch(
      [&] {
        auto pg = join_job();
        std::string error;
        try {
          tandem::launch::launch([] {}, 2);
        } catch (const std::runtime_error& e) {
          error = e.what();
        }
        std::ofstream(dir + "/rank" + std::to_string(pg->rank())) << error;
        pg->barrier();
      },
      2);
  for (int r = 0; r < 2; ++r) {
    auto msg = read_file(dir + "/rank" + std::to_string(r));
    EXPECT_NE(msg.find("holds 1 live tandem ProcessGroup"), std::string::npos) << msg;
  }
  std::system(("rm -rf " + dir).c_str());
}

TEST(ForkLauncher, RejectsBadArguments) {
  EXPECT_THROW(tandem::launch::launch([] {}, 0), std::invalid_argument);
  EXPECT_THROW(tandem::launch::launch(nullptr, 2), std::invalid_argument);
}
