// The training state: resumed equals uninterrupted (bitwise), saves that survive kill -9 at any
// point, and damaged checkpoints that are refused with the file named.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "../common/launch.h"

namespace fs = std::filesystem;
using tandem::testing::count_of;
using tandem::testing::launch;
using tandem::testing::LaunchOptions;

namespace {

const std::string kWorker = RESUME_WORKER;

std::string fresh_dir(const std::string& name) {
  auto d = fs::temp_directory_path() / ("tandem-ckpt-" + std::to_string(::getpid()) + "-" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// One thread per rank, a second's grace for the others when one rank fails, 180 s per job.
const auto kLaunch = LaunchOptions().flags({"--grace_period", "1"}).timeout_s(180);

}  // namespace

// (ranks, precision mode, master weights).
class Resume : public ::testing::TestWithParam<std::tuple<int, std::string, bool>> {};

// Train 2K steps straight, or K steps, save, and K more in a new process: parameters, fp32
// masters, optimizer state, scheduler and a registered object are bitwise equal (the dump files
// are byte-identical). K = 7 optimizer steps with accumulation 2 and batch 8 stops mid-epoch
// (150 samples). Under bf16-true the float batches reach the bf16 model through the loader's
// input cast.
TEST_P(Resume, ResumedEqualsUninterrupted) {
  const auto [n, precision, masters] = GetParam();
  const std::string tag = std::to_string(n) + "-" + precision + (masters ? "-m" : "");
  auto dir = fresh_dir("resume" + tag);
  std::vector<std::string> mp{"--mixed-precision", precision};
  if (masters) mp.push_back("--master-weights");
  auto with = [&](std::vector<std::string> a) {
    a.insert(a.end(), mp.begin(), mp.end());
    return a;
  };
  auto straight = dir + "/straight.safetensors", resumed = dir + "/resumed.safetensors";
  // The straight run and the first half as jobs of one launch (tandem::testing::launch_jobs);
  // the second half in new processes.
  const auto first = tandem::testing::launch_jobs(
      n, kWorker,
      {{with({"run", "--steps", "14", "--project", dir + "/a", "--out", straight}), kLaunch},
       {with({"run", "--steps", "14", "--stop-at", "7", "--project", dir + "/b"}), kLaunch}});
  const auto &a = first[0], &b1 = first[1];
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b1.exit_code, 0) << b1.output;
  ASSERT_NE(b1.output.find("saved at step 7"), std::string::npos) << b1.output;
  ASSERT_TRUE(fs::exists(dir + "/b/checkpoints/checkpoint_0/manifest.json"));
  EXPECT_EQ(fs::exists(dir + "/b/checkpoints/checkpoint_0/master_weights.safetensors"), masters);
  auto b2 =
      launch(n, kWorker,
             with({"run", "--steps", "14", "--resume", "--project", dir + "/b", "--out", resumed}),
             kLaunch);
  ASSERT_EQ(b2.exit_code, 0) << b2.output;
  EXPECT_NE(b2.output.find("resumed at step 7"), std::string::npos) << b2.output;
  auto x = bytes_of(straight), y = bytes_of(resumed);
  ASSERT_GT(x.size(), 5000u);
  EXPECT_TRUE(x == y) << "resumed training differs from uninterrupted training";
  fs::remove_all(dir);
}

// A checkpoint saved without master weights, resumed with them: the masters are rebuilt from the
// loaded bf16 weights (and said so), not left as the copies prepare() made of the initial weights,
// which the optimizer would step and copy over the loaded weights.
TEST(ResumeMasters, RebuiltFromLoadedWeightsWhenTheCheckpointHasNone) {
  auto dir = fresh_dir("resume-rebuild");
  auto b1 = launch(1, kWorker,
                   {"run", "--steps", "14", "--stop-at", "7", "--project", dir, "--mixed-precision",
                    "bf16-true"},
                   kLaunch);
  ASSERT_EQ(b1.exit_code, 0) << b1.output;
  auto b2 = launch(1, kWorker,
                   {"run", "--steps", "8", "--resume", "--project", dir, "--mixed-precision",
                    "bf16-true", "--master-weights"},
                   kLaunch);
  ASSERT_EQ(b2.exit_code, 0) << b2.output;
  EXPECT_NE(b2.output.find("they are rebuilt from the loaded bf16-true weights"), std::string::npos)
      << b2.output;
  EXPECT_NE(b2.output.find("master gap 0\n"), std::string::npos) << b2.output;
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    RanksAndPrecision, Resume,
    // Every mode that runs on a CPU: no, bf16, bf16-true without and with fp32 masters.
    ::testing::Values(std::make_tuple(1, std::string("no"), false),
                      std::make_tuple(1, std::string("bf16"), false),
                      std::make_tuple(1, std::string("bf16-true"), false),
                      std::make_tuple(1, std::string("bf16-true"), true),
                      std::make_tuple(2, std::string("no"), false),
                      std::make_tuple(2, std::string("bf16"), false),
                      std::make_tuple(2, std::string("bf16-true"), false),
                      std::make_tuple(2, std::string("bf16-true"), true)),
    [](const auto& info) {
      std::string p = std::get<1>(info.param);
      for (auto& c : p)
        if (c == '-') c = '_';
      return std::to_string(std::get<0>(info.param)) + "ranks_" + p +
             (std::get<2>(info.param) ? "_masters" : "");
    });

class KillDuringSave : public ::testing::TestWithParam<std::string> {};

// A process SIGKILLed at a point of its second save (asynchronous: inside the background write,
// training going on meanwhile): the latest loadable checkpoint is the first one, equal to what was
// saved (or, killed after the rename, the complete second one); never a half-written one.
void expect_previous_checkpoint_loadable(const std::string& point, bool async) {
  auto dir = fresh_dir(std::string(async ? "async-" : "") + "kill-" + point);
  auto first = dir + "/first.safetensors", loaded = dir + "/loaded.safetensors";
  std::vector<std::string> args{"crash", "--project", dir, "--point", point, "--out", first};
  if (async) args.push_back("--async");
  auto r = launch(1, kWorker, args, kLaunch);
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.output;
  EXPECT_EQ(r.output.find("second save completed"), std::string::npos) << r.output;
  auto v = launch(1, kWorker, {"verify", "--project", dir, "--out", loaded}, kLaunch);
  ASSERT_EQ(v.exit_code, 0) << v.output;
  if (point == "after_rename") {
    EXPECT_NE(v.output.find("checkpoint_1 at step 5"), std::string::npos) << v.output;
  } else {
    EXPECT_NE(v.output.find("checkpoint_0 at step 3"), std::string::npos) << v.output;
    EXPECT_TRUE(bytes_of(first) == bytes_of(loaded));
    EXPECT_FALSE(fs::exists(dir + "/checkpoints/checkpoint_1"));
  }
  fs::remove_all(dir);
}

TEST_P(KillDuringSave, PreviousCheckpointStaysLoadable) {
  expect_previous_checkpoint_loadable(GetParam(), false);
}

INSTANTIATE_TEST_SUITE_P(Points, KillDuringSave,
                         ::testing::Values("mid_files", "after_files", "before_rename",
                                           "after_rename"));

// Rank 1 dies in the second save after writing its part (asynchronous: in its background write,
// after its first file): no checkpoint_1 appears, the first stays loadable on both ranks.
void expect_all_ranks_or_none(const std::string& point, bool async) {
  auto dir = fresh_dir(std::string(async ? "async-" : "") + "allornone");
  std::vector<std::string> args{"crash", "--project", dir, "--point", point, "--out", dir + "/f"};
  if (async) args.push_back("--async");
  auto r = launch(2, kWorker, args, LaunchOptions(kLaunch).env({{"TANDEM_CHECKPOINT_CRASH_RANK", "1"}}));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_FALSE(fs::exists(dir + "/checkpoints/checkpoint_1")) << r.output;
  auto v = launch(2, kWorker, {"verify", "--project", dir, "--out", dir + "/loaded"}, kLaunch);
  EXPECT_EQ(v.exit_code, 0) << v.output;
  EXPECT_EQ(count_of(v.output, "checkpoint_0 at step 3"), 2) << v.output;
  fs::remove_all(dir);
}

TEST(Checkpoint, SaveCompletesOnAllRanksOrNone) { expect_all_ranks_or_none("after_files", false); }

TEST(Checkpoint, KilledAtRandomMomentsAlwaysLeavesALoadableLatest) {
  auto dir = fresh_dir("random");
  std::mt19937 rng(12345);
  for (int round = 0; round < 4; ++round) {
    // The harness kills the launcher's whole group after a random delay; the launcher takes
    // the worker down with it.
    pid_t pid = fork();
    if (pid == 0) {
      setpgid(0, 0);
      int devnull = ::open("/dev/null", O_WRONLY);
      dup2(devnull, 1);
      dup2(devnull, 2);
      execl(kWorker.c_str(), kWorker.c_str(), "loop", "--project", dir.c_str(), "--total-limit",
            "2", static_cast<char*>(nullptr));
      _exit(127);
    }
    // The kill lands at a random moment once saving has begun: the first round waits for the
    // first complete checkpoint (a slow start, e.g. under sanitizers on a loaded machine, must
    // not turn "nothing saved yet" into a failure), then every round sleeps a random while.
    for (int waited = 0; round == 0 && waited < 1200; ++waited) {
      bool complete = false;
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(dir + "/checkpoints", ec))
        complete = complete || fs::exists(e.path() / "manifest.json");
      if (complete) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 1500));
    kill(-pid, SIGKILL);
    int st = 0;
    waitpid(pid, &st, 0);
    auto v = launch(1, kWorker, {"verify", "--project", dir, "--out", dir + "/v"}, kLaunch);
    ASSERT_EQ(v.exit_code, 0) << "round " << round << "\n" << v.output;
  }
  fs::remove_all(dir);
}

TEST(Checkpoint, DamagedFilesAreRefusedByName) {
  auto dir = fresh_dir("damaged");
  auto r = launch(1, kWorker, {"run", "--steps", "4", "--stop-at", "2", "--project", dir}, kLaunch);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string ck = dir + "/checkpoints/checkpoint_0";
  // Truncated model file.
  fs::copy(ck, dir + "/backup", fs::copy_options::recursive);
  fs::resize_file(ck + "/model.safetensors", fs::file_size(ck + "/model.safetensors") - 10);
  auto v = launch(1, kWorker, {"verify", "--project", dir, "--out", dir + "/v"}, kLaunch);
  EXPECT_NE(v.exit_code, 0);
  EXPECT_NE(v.output.find("model.safetensors has"), std::string::npos) << v.output;
  EXPECT_NE(v.output.find("truncated or altered"), std::string::npos) << v.output;
  // One altered byte in the optimizer state.
  fs::remove_all(ck);
  fs::copy(dir + "/backup", ck, fs::copy_options::recursive);
  {
    std::fstream f(ck + "/optimizer.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x7f');
  }
  v = launch(1, kWorker, {"verify", "--project", dir, "--out", dir + "/v"}, kLaunch);
  EXPECT_NE(v.exit_code, 0);
  EXPECT_NE(v.output.find("optimizer.safetensors does not match its checksum"), std::string::npos)
      << v.output;
  // No manifest: an interrupted save is never loaded.
  fs::remove(ck + "/manifest.json");
  v = launch(1, kWorker, {"verify", "--project", dir, "--out", dir + "/v"}, kLaunch);
  EXPECT_NE(v.exit_code, 0);
  EXPECT_NE(v.output.find("no complete checkpoint"), std::string::npos) << v.output;
  fs::remove_all(dir);
}

TEST(Checkpoint, RotationKeepsTotalLimit) {
  auto dir = fresh_dir("rotation");
  for (int k = 1; k <= 4; ++k) {
    std::vector<std::string> args{"run", "--steps", "20", "--stop-at", std::to_string(k),
                                  "--project", dir, "--total-limit", "2"};
    if (k > 1) args.push_back("--resume");
    auto r = launch(1, kWorker, args, kLaunch);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  std::vector<std::string> names;
  for (auto& e : fs::directory_iterator(dir + "/checkpoints")) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"checkpoint_2", "checkpoint_3"}));
  fs::remove_all(dir);
}

// Note [Checkpoints inside the optimizer step]: a periodic checkpoint (step 7 of 14, taken inside
// the optimizer step, before the loop steps its StepLR scheduler) resumes on the uninterrupted
// run's schedule: the final parameters, optimizer state (its learning rates included) are
// bitwise those of the straight run, on 1 and 2 ranks, saved synchronously or not. The loop's
// own counter, which it increments after the optimizer step, is saved before that increment:
// one behind (the documented limit of a checkpoint inside the step).
TEST(PeriodicCheckpoint, ResumesOnTheSchedulersStep) {
  for (int n : {1, 2}) {
    // The straight runs (sync and async) as jobs of one launch, then both resumed in another.
    std::vector<tandem::testing::Job> straight_jobs, resumed_jobs;
    std::vector<std::string> dirs, tags;
    for (bool async : {false, true}) {
      tags.push_back(std::to_string(n) + (async ? "-async" : ""));
      dirs.push_back(fresh_dir("periodic-" + tags.back()));
      const auto& dir = dirs.back();
      std::vector<std::string> a{"run", "--steps", "14", "--every", "7", "--project", dir + "/a",
                                 "--out", dir + "/straight.safetensors"};
      if (async) a.push_back("--async");
      straight_jobs.push_back({a, kLaunch});
      resumed_jobs.push_back({{"run", "--steps", "14", "--resume", "--project", dir + "/b", "--out",
                               dir + "/resumed.safetensors"},
                              kLaunch});
    }
    for (const auto& r : tandem::testing::launch_jobs(n, kWorker, straight_jobs))
      ASSERT_EQ(r.exit_code, 0) << r.output;
    for (const auto& dir : dirs) {
      fs::create_directories(dir + "/b/checkpoints");
      fs::copy(dir + "/a/checkpoints/checkpoint_0", dir + "/b/checkpoints/checkpoint_0",
               fs::copy_options::recursive);
    }
    const auto resumed = tandem::testing::launch_jobs(n, kWorker, resumed_jobs);
    for (size_t i = 0; i < dirs.size(); ++i) {
      const auto& b = resumed[i];
      ASSERT_EQ(b.exit_code, 0) << b.output;
      EXPECT_NE(b.output.find("resumed at step 7"), std::string::npos) << b.output;
      auto c = tandem::testing::run_command({kWorker, "compare", "--out",
                                             dirs[i] + "/straight.safetensors", "--project",
                                             dirs[i] + "/resumed.safetensors"},
                                            {}, 60);
      EXPECT_EQ(c.exit_code, 0) << c.output;
      EXPECT_NE(c.output.find("equal but counter 14 and 13"), std::string::npos) << tags[i] << "\n"
                                                                                 << c.output;
      fs::remove_all(dirs[i]);
    }
  }
}

// ---- asynchronous saves (Note [Asynchronous checkpoints]) -------------------------------------

namespace {

// Every file of two checkpoint directories, byte for byte (names and contents).
void expect_same_files(const std::string& a, const std::string& b) {
  std::vector<std::string> names_a, names_b;
  for (const auto& e : fs::directory_iterator(a)) names_a.push_back(e.path().filename().string());
  for (const auto& e : fs::directory_iterator(b)) names_b.push_back(e.path().filename().string());
  std::sort(names_a.begin(), names_a.end());
  std::sort(names_b.begin(), names_b.end());
  ASSERT_EQ(names_a, names_b) << a << " and " << b << " hold other files";
  ASSERT_GT(names_a.size(), 3u);
  for (const auto& n : names_a)
    EXPECT_TRUE(bytes_of(a + "/" + n) == bytes_of(b + "/" + n)) << n << " differs";
}

}  // namespace

// (ranks, launcher flags): periodic saves at steps 7 and 14 (the last step: the process ends
// right after it), synchronous against asynchronous: every file of both checkpoints is
// byte-identical, and training is unchanged by saves written while it goes on. ZeRO-2: every rank
// writes its own shards of the optimizer state.
class AsyncSave : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(AsyncSave, FilesEqualSynchronousSaves) {
  const auto [n, zero] = GetParam();
  auto dir = fresh_dir("async-files-" + std::to_string(n) + zero);
  auto options = zero.empty() ? kLaunch
                              : LaunchOptions(kLaunch).flags(
                                    {"--grace_period", "1", "--use_deepspeed", "--zero_stage", zero});
  std::string outs[2];
  std::vector<tandem::testing::Job> jobs;  // one launch (tandem::testing::launch_jobs)
  for (int async = 0; async < 2; ++async) {
    const std::string project = dir + (async ? "/async" : "/sync");
    outs[async] = project + ".safetensors";
    std::vector<std::string> args{"run", "--steps", "14", "--every", "7", "--project", project,
                                  "--out", outs[async]};
    if (async) args.push_back("--async");
    jobs.push_back({args, options});
  }
  for (const auto& r : tandem::testing::launch_jobs(n, kWorker, jobs))
    ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* ck : {"checkpoint_0", "checkpoint_1"})
    expect_same_files(dir + "/sync/checkpoints/" + ck, dir + "/async/checkpoints/" + ck);
  EXPECT_TRUE(bytes_of(outs[0]) == bytes_of(outs[1])) << "asynchronous saves changed training";
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Layouts, AsyncSave,
                         ::testing::Values(std::make_tuple(1, std::string()),
                                           std::make_tuple(2, std::string()),
                                           std::make_tuple(2, std::string("2"))),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "ranks" +
                                  (std::get<1>(info.param).empty()
                                       ? std::string("_ddp")
                                       : "_zero" + std::get<1>(info.param));
                         });

// An asynchronous save at step 7, the process ending at once (it waits for the write), resumed:
// equal to uninterrupted training.
TEST(AsyncSaveResume, ResumedEqualsUninterrupted) {
  auto dir = fresh_dir("async-resume");
  auto straight = dir + "/straight.safetensors", resumed = dir + "/resumed.safetensors";
  // The straight run and the first half as jobs of one launch; the second half in new processes.
  const auto first = tandem::testing::launch_jobs(
      2, kWorker,
      {{{"run", "--steps", "14", "--project", dir + "/a", "--out", straight}, kLaunch},
       {{"run", "--steps", "14", "--stop-at", "7", "--async", "--project", dir + "/b"}, kLaunch}});
  const auto &a = first[0], &b1 = first[1];
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b1.exit_code, 0) << b1.output;
  ASSERT_TRUE(fs::exists(dir + "/b/checkpoints/checkpoint_0/manifest.json")) << b1.output;
  auto b2 = launch(2, kWorker,
                   {"run", "--steps", "14", "--resume", "--project", dir + "/b", "--out", resumed},
                   kLaunch);
  ASSERT_EQ(b2.exit_code, 0) << b2.output;
  EXPECT_NE(b2.output.find("resumed at step 7"), std::string::npos) << b2.output;
  EXPECT_TRUE(bytes_of(straight) == bytes_of(resumed));
  fs::remove_all(dir);
}

class KillDuringAsyncSave : public ::testing::TestWithParam<std::string> {};

TEST_P(KillDuringAsyncSave, PreviousCheckpointStaysLoadable) {
  expect_previous_checkpoint_loadable(GetParam(), true);
}

INSTANTIATE_TEST_SUITE_P(Points, KillDuringAsyncSave,
                         ::testing::Values("mid_files", "after_files", "before_rename",
                                           "after_rename"));

TEST(AsyncSaveKill, CompletesOnAllRanksOrNone) { expect_all_ranks_or_none("mid_files", true); }

// A part that fails in an asynchronous save (a registered object that throws) fails it on every
// rank when it is waited for, names the part, renames nothing into place, and the next save
// works.
TEST(AsyncSaveFailure, ReportedOnEveryRankAtTheWait) {
  auto dir = fresh_dir("async-failing");
  auto r = launch(2, kWorker, {"failing", "--async", "--project", dir}, kLaunch);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "save failed: "), 2) << r.output;
  EXPECT_NE(r.output.find("part 'custom': cannot serialize the broken object"), std::string::npos)
      << r.output;
  EXPECT_EQ(count_of(r.output, "checkpoint exists: 0"), 2) << r.output;
  EXPECT_TRUE(fs::exists(dir + "/after/manifest.json")) << r.output;
  fs::remove_all(dir);
}
