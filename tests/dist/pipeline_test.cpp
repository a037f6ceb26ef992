// Pipeline parallel over real processes: GPipe and 1F1B on 2 and 4 stages, and 2 stages x 2
// data-parallel replicas, train to the parameters and losses of one process training the whole
// model; too few micro-batches are refused on every rank; a stage that dies ends the job; and
// point-to-point transfers fail fast, naming the peer, when it leaves or stays silent.
#include <gtest/gtest.h>

#include <thread>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "../common/launch.h"

using tandem::testing::count_of;
using tandem::testing::launch;
using tandem::testing::LaunchOptions;
using tandem::testing::read_floats;
using tandem::testing::run_command;

namespace {

const std::string kWorker = PIPELINE_WORKER;

std::string out_dir() {
  static const std::string dir = [] {
    auto d = tandem::testing::temp_path("pipeline", "out");
    std::system(("mkdir -p " + d).c_str());
    return d;
  }();
  return dir;
}

// Parameters and losses of one process training the whole model on the global batch.
const std::pair<std::vector<float>, std::vector<float>>& reference() {
  static const auto ref = [] {
    auto r = launch(1, kWorker, {"reference", "--out", out_dir()});
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return std::make_pair(read_floats(out_dir() + "/reference.bin"),
                          read_floats(out_dir() + "/reference-loss.bin"));
  }();
  return ref;
}

// Lines of `out` that hold both `a` and `b`.
int lines_with(const std::string& out, const std::string& a, const std::string& b) {
  std::istringstream in(out);
  int n = 0;
  for (std::string line; std::getline(in, line);)
    n += line.find(a) != std::string::npos && line.find(b) != std::string::npos;
  return n;
}

// Largest |a - b| / |b| (b = the reference).
double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    m = std::max(m, std::fabs(double(a[i]) - b[i]) / std::max(1e-30, std::fabs(double(b[i]))));
  return m;
}

// Runs every configuration on stages x dp ranks and checks each against the reference: the
// parameters of every model stage (with virtual stages: 2 x stages of them, rank r holding r and
// r + stages) joined in order, per replica, and every rank's losses, within rtol 1e-5; the
// configurations a schedule cannot run refused on every rank with the advice: fewer
// micro-batches than stages, and for interleaved 1F1B micro-batches that are not a multiple of
// the stages.
void check_training(const tandem::testing::RunResult& r, int stages, int dp,
                    const std::string& dir) {
  const auto& [ref_params, ref_losses] = reference();
  ASSERT_EQ(ref_params.size(), 8u * (16 * 16 + 16));
  ASSERT_EQ(ref_losses.size(), 3u);
  const int n = stages * dp;
  ASSERT_EQ(r.exit_code, 0) << r.output;
  double worst_params = 0, worst_loss = 0;
  int trained = 0;
  for (const std::string kind : {"GPipe", "1F1B", "ZeroBubble", "Interleaved1F1B"}) {
    const int v = kind == "Interleaved1F1B" ? 2 : 1;
    for (int m : {1, 2, 4, 8}) {
      const std::string name = kind + "-m" + std::to_string(m);
      if (m < stages || (v > 1 && m % stages != 0)) {
        const std::string why =
            m < stages ? std::to_string(m) + " micro-batches for " + std::to_string(stages) +
                             " stages: use at least " + std::to_string(stages) + " micro-batches"
                       : "not a multiple of " + std::to_string(stages);
        EXPECT_EQ(count_of(r.output, "config " + name + " refused: "), n) << r.output;
        EXPECT_EQ(lines_with(r.output, "config " + name + " refused: ", why), n) << r.output;
        continue;
      }
      EXPECT_EQ(count_of(r.output, "config " + name + " trained"), n) << r.output;
      ++trained;
      for (int d = 0; d < dp; ++d) {
        std::vector<float> params;
        for (int g = 0; g < stages * v; ++g) {
          auto part = read_floats(dir + "/" + name + "-stage" + std::to_string(g) + "-d" +
                                  std::to_string(d) + ".bin");
          params.insert(params.end(), part.begin(), part.end());
        }
        const double diff = max_rel_diff(params, ref_params);
        EXPECT_LE(diff, 1e-5) << name << " replica " << d;
        worst_params = std::max(worst_params, diff);
      }
      for (int rank = 0; rank < n; ++rank) {
        const double diff = max_rel_diff(
            read_floats(dir + "/" + name + "-rank" + std::to_string(rank) + "-loss.bin"),
            ref_losses);
        EXPECT_LE(diff, 1e-5) << name << " rank " << rank;
        worst_loss = std::max(worst_loss, diff);
      }
    }
  }
  EXPECT_GE(trained, 3 * 2 + 1) << r.output;
  std::cout << stages << " stages x " << dp << " replicas, " << trained
            << " configurations: max relative difference to one process: "
            << "parameters " << worst_params << ", losses " << worst_loss << " (" << r.seconds
            << " s)" << std::endl;
}

// A directory of its own for one run's files, under out_dir().
std::string run_dir(const std::string& name) {
  const std::string dir = out_dir() + "/" + name;
  std::system(("mkdir -p " + dir).c_str());
  return dir;
}

// "train" on stages x dp ranks, launched alone, checked against the reference.
void check_against_reference(int stages, int dp) {
  const std::string dir = run_dir("train-" + std::to_string(stages) + "x" + std::to_string(dp));
  auto r = launch(
      stages * dp, kWorker,
      {"train", "--stages", std::to_string(stages), "--dp", std::to_string(dp), "--out", dir});
  check_training(r, stages, dp, dir);
}

}  // namespace

TEST(PipelineParallel, TwoStagesEqualOneProcess) {
  check_against_reference(2, 1);
}

namespace {

// Through the Accelerator: `tandem launch --pp_size 2 --activation_checkpointing` on 4 ranks
// gives a (pp 2, dp 2) mesh; prepare_pipeline splits the model, wraps the stage's entries in
// Checkpointed, and averages gradients over mesh["dp"]. Equal to one process within rtol 1e-5.
void check_accelerator_pipeline(const tandem::testing::RunResult& r, const std::string& dir) {
  const auto& [ref_params, ref_losses] = reference();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* line : {"acc rank 0 stage 0 of 2 replica 0 of 2 checkpointed 8",
                           "acc rank 1 stage 0 of 2 replica 1 of 2 checkpointed 8",
                           "acc rank 2 stage 1 of 2 replica 0 of 2 checkpointed 8",
                           "acc rank 3 stage 1 of 2 replica 1 of 2 checkpointed 8"})
    EXPECT_EQ(count_of(r.output, line), 1) << line << "\n" << r.output;
  for (int d = 0; d < 2; ++d) {
    std::vector<float> params;
    for (int s = 0; s < 2; ++s) {
      auto part =
          read_floats(dir + "/acc-d" + std::to_string(d) + "-s" + std::to_string(s) + ".bin");
      params.insert(params.end(), part.begin(), part.end());
      EXPECT_LE(max_rel_diff(read_floats(dir + "/acc-d" + std::to_string(d) + "-s" +
                                         std::to_string(s) + "-loss.bin"),
                             ref_losses),
                1e-5);
    }
    const double diff = max_rel_diff(params, ref_params);
    std::cout << "replica " << d << ": max relative difference to one process " << diff << std::endl;
    EXPECT_LE(diff, 1e-5) << "replica " << d;
  }
}

// The schedule from the launcher: `--pp_schedule interleaved_1f1b --pp_virtual_stages 2` on a
// (pp 2, dp 2) mesh with activation checkpointing splits the 16 entries into 4 stages, rank r
// holding stages r and r + 2 (4 entries, all checkpointed); a program that asks for 1F1B itself
// is refused naming both; the whole model, gathered by name (get_state_dict), equals one
// process's within rtol 1e-5, as does every rank's loss.
void check_interleaved_from_the_launcher(const tandem::testing::RunResult& r,
                                         const std::string& dir) {
  const auto& [ref_params, ref_losses] = reference();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* line :
       {"acc rank 0 stage 0 of 2 replica 0 of 2 checkpointed 8 schedule Interleaved1F1B virtual stages 2",
        "acc rank 1 stage 0 of 2 replica 1 of 2 checkpointed 8 schedule Interleaved1F1B virtual stages 2",
        "acc rank 2 stage 1 of 2 replica 0 of 2 checkpointed 8 schedule Interleaved1F1B virtual stages 2",
        "acc rank 3 stage 1 of 2 replica 1 of 2 checkpointed 8 schedule Interleaved1F1B virtual stages 2"})
    EXPECT_EQ(count_of(r.output, line), 1) << line << "\n" << r.output;
  EXPECT_EQ(lines_with(r.output, "schedule refused: ",
                       "asks for the 1F1B schedule (PipelineOptions().schedule) and the run for "
                       "Interleaved1F1B (--pp_schedule"),
            4)
      << r.output;
  const double diff = max_rel_diff(read_floats(dir + "/acc-full.bin"), ref_params);
  std::cout << "interleaved from the launcher: max relative difference to one process " << diff
            << std::endl;
  EXPECT_LE(diff, 1e-5);
  for (int d = 0; d < 2; ++d)
    for (int s = 0; s < 2; ++s)
      EXPECT_LE(max_rel_diff(read_floats(dir + "/acc-d" + std::to_string(d) + "-s" +
                                         std::to_string(s) + "-loss.bin"),
                             ref_losses),
                1e-5);
}

// DP x PP x TP on one 4-rank mesh (pp 2, tp 2): the example GPT as a Sequential, each stage's
// blocks, embedding and head split over its tp pair by the plan, 2 micro-batches and a
// vocab-parallel loss, with the whole model's gradient norm clipped (binding), trains as one dense
// process does: every step's loss and norm and the final parameters within 1e-5, and the loss
// falls. A plan entry that matches no stage's module is refused on every rank. save_state then
// merge_weights give back the dense model's weights. Under each schedule: 1F1B (the default);
// interleaved 1F1B with 2 stages per rank (rank 0: the embedding and block 1, rank 1: block 0
// and the head); zero bubble (input and weight gradients apart).
struct GptSchedule {
  std::string label;
  std::vector<std::string> flags;
  std::string printed;  // what the pipeline reports
};
const std::vector<GptSchedule> kGptSchedules = {
    {"1f1b", {}, " schedule 1F1B virtual stages 1"},
    {"interleaved",
     {"--pp_schedule", "interleaved_1f1b", "--pp_virtual_stages", "2"},
     " schedule Interleaved1F1B virtual stages 2"},
    {"zero_bubble", {"--pp_schedule", "zero_bubble"}, " schedule ZeroBubble virtual stages 1"}};

void check_gpt(const tandem::testing::RunResult& r, const GptSchedule& schedule) {
  SCOPED_TRACE("gpt under " + schedule.label);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // 1F1B: stage 0 holds the vocab-parallel token embedding and block 0's four layers, stage 1
  // block 1's four layers and the head; interleaved: 5 split layers on each rank too.
  for (const char* line : {"gpt rank 0 stage 0 tp 0 split layers 5", "gpt rank 1 stage 0 tp 1 split layers 5",
                           "gpt rank 2 stage 1 tp 0 split layers 5", "gpt rank 3 stage 1 tp 1 split layers 5"})
    EXPECT_EQ(count_of(r.output, std::string(line) + schedule.printed), 1) << line << "\n"
                                                                           << r.output;
  int checks = 0;
  std::istringstream in(r.output);
  for (std::string line; std::getline(in, line);) {
    const auto at = line.find("] check ");  // after the launcher's "[rank r] "
    if (at == std::string::npos) continue;
    const double diff = std::stod(line.substr(line.rfind(' ') + 1));  // "check <name> <diff>"
    EXPECT_LE(diff, 1e-5) << line;
    ++checks;
  }
  // 4 ranks x (4 losses, 4 norms, the parameters), and rank 0's comparison of the merged
  // checkpoint (merge_weights: 4 files, 2 stages x 2 tp shards; 29 tensors) with the dense model, tensor by tensor.
  EXPECT_EQ(checks, 4 * 9 + 29) << r.output;
  EXPECT_EQ(count_of(r.output, "merged 29 tensors from 4 files"), 1) << r.output;
  // get_state_dict: the main process gets the dense model (both stages, tp shards joined), the
  // other ranks nothing.
  EXPECT_EQ(count_of(r.output, "state_dict tensors 29 dense 29 names_and_shapes 1 relative"), 1)
      << r.output;
  EXPECT_EQ(count_of(r.output, ": 0 tensors"), 3) << r.output;
  for (double v : [&] {
         std::vector<double> out;
         for (auto at = r.output.find("names_and_shapes 1 relative "); at != std::string::npos;
              at = r.output.find("names_and_shapes 1 relative ", at + 1))
           out.push_back(std::stod(r.output.substr(at + 28)));
         return out;
       }())
    EXPECT_LE(v, 1e-5) << r.output;
  EXPECT_EQ(count_of(r.output, "same names 1"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "falling 1"), 4) << r.output;
  EXPECT_EQ(count_of(r.output, "plan refused: [rank "), 4) << r.output;
  EXPECT_EQ(count_of(r.output, "entry '*.mlp.down' match no module of any pipeline stage"), 4)
      << r.output;
}

}  // namespace

// Every layout on 4 ranks, each against one process: 4 stages; 2 stages x 2 replicas (ranks 0, 1
// and 2, 3 are pipelines; 0, 2 and 1, 3 average their stage's gradients); the Accelerator's
// pipeline x data parallel with checkpointing; the launcher's interleaved schedule; the GPT under
// pp x tp in each schedule. They are jobs of one launch, each with exactly the variables its own
// launch would give it (tandem::testing::launch_jobs).
TEST(PipelineParallel, EveryFourRankLayoutEqualsOneProcess) {
  reference();
  std::vector<tandem::testing::Job> jobs{
      {{"train", "--stages", "4", "--dp", "1", "--out", run_dir("train-4x1")}, LaunchOptions()},
      {{"train", "--stages", "2", "--dp", "2", "--out", run_dir("train-2x2")}, LaunchOptions()},
      {{"accelerate", "--out", run_dir("acc")},
       LaunchOptions().flags({"--pp_size", "2", "--activation_checkpointing"})},
      {{"accelerate", "--out", run_dir("acc-interleaved")},
       LaunchOptions()
           .flags({"--pp_size", "2", "--activation_checkpointing", "--pp_schedule",
                   "interleaved_1f1b", "--pp_virtual_stages", "2"})
           .env({{"PIPELINE_SCHEDULE_FROM_RUN", "1"}})}};
  for (const auto& schedule : kGptSchedules) {
    std::vector<std::string> flags = {"--pp_size", "2", "--tp_size", "2"};
    flags.insert(flags.end(), schedule.flags.begin(), schedule.flags.end());
    jobs.push_back(
        {{"gpt", "--out", run_dir("gpt-" + schedule.label)}, LaunchOptions().flags(flags)});
  }
  const auto runs = tandem::testing::launch_jobs(4, kWorker, jobs);
  {
    SCOPED_TRACE("4 stages");
    check_training(runs[0], 4, 1, run_dir("train-4x1"));
  }
  {
    SCOPED_TRACE("2 stages x 2 replicas");
    check_training(runs[1], 2, 2, run_dir("train-2x2"));
  }
  check_accelerator_pipeline(runs[2], run_dir("acc"));
  check_interleaved_from_the_launcher(runs[3], run_dir("acc-interleaved"));
  for (size_t k = 0; k < kGptSchedules.size(); ++k) check_gpt(runs[4 + k], kGptSchedules[k]);
}

// Zero bubble computes input and weight gradients with torch::autograd::grad, which a
// checkpointed region refuses: prepare_pipeline refuses the pair on every rank, naming the fix,
// before any step.
TEST(PipelineParallel, ZeroBubbleWithActivationCheckpointingIsRefused) {
  auto r = launch(
      2, kWorker, {"accelerate", "--out", out_dir()},
      LaunchOptions()
          .flags({"--pp_size", "2", "--activation_checkpointing", "--pp_schedule", "zero_bubble"})
          .env({{"PIPELINE_SCHEDULE_FROM_RUN", "1"}}));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_EQ(lines_with(r.output, "pipeline refused: ",
                       "use the 1f1b or interleaved_1f1b schedule with it, or turn activation "
                       "checkpointing off"),
            2)
      << r.output;
}

// A ZeRO stage with a pipeline is refused on every rank with the fix (the pipeline reduces
// each stage's gradients itself).
TEST(PipelineParallel, ZeroWithAPipelineIsRefused) {
  auto r =
      launch(2, kWorker, {"accelerate", "--out", out_dir()},
             LaunchOptions().flags({"--pp_size", "2", "--use_deepspeed", "--zero_stage", "1"}));
  EXPECT_NE(r.exit_code, 0) << r.output;
  // By the launcher, before any rank starts, naming both flags.
  EXPECT_EQ(count_of(r.output, "--pp_size 2 does not combine with --use_deepspeed --zero_stage 1"), 1)
      << r.output;
  EXPECT_EQ(count_of(r.output, "acc trained rank"), 0) << r.output;
  // By the Accelerator of ranks another launcher started (torchrun's variables), at
  // construction: before, only prepare_pipeline refused, so a program that never reached it ran.
  const int port = tandem::testing::free_port();
  std::vector<tandem::testing::RunResult> ranks(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank)
    threads.emplace_back([&, rank] {
      ranks[rank] = run_command(
          {kWorker, "accelerate", "--out", out_dir()},
          {{"RANK", std::to_string(rank)}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", std::to_string(rank)},
           {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)},
           {"TANDEM_USE_CPU", "1"}, {"TANDEM_PP_SIZE", "2"}, {"TANDEM_DISTRIBUTED_TYPE", "DEEPSPEED"},
           {"TANDEM_ZERO_STAGE", "1"}},
          120);
    });
  for (auto& t : threads) t.join();
  for (const auto& rr : ranks) {
    EXPECT_NE(rr.exit_code, 0) << rr.output;
    EXPECT_EQ(count_of(rr.output, "ZeRO stage 1 does not combine with pipeline parallel"), 1)
        << rr.output;
    EXPECT_EQ(count_of(rr.output, "acc trained rank"), 0) << rr.output;
  }
}

// Stage 1 of 4 exits in the middle of step 1: the job ends with its exit code and the launcher
// names it. The group's timeout (300 s) is longer than the harness's (120 s): the job ends
// because the failure is seen, not because something timed out.
TEST(PipelineParallel, AStageThatDiesEndsTheJob) {
  auto r = launch(4, kWorker, {"die"},
                  LaunchOptions().env({{"PIPELINE_DIE_RANK", "1"}, {"PIPELINE_TIMEOUT_S", "300"}}));
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("rank 1 exits in its forward"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 3"), std::string::npos) << r.output;
  EXPECT_EQ(count_of(r.output, "finished step 0"), 4) << r.output;
  EXPECT_EQ(count_of(r.output, "finished step 1"), 0) << r.output;
}

// The activation shapes travel once: a later batch of another size is refused by the stage that
// would send it, saying what it found and what it expected, and the job ends.
TEST(PipelineParallel, ABatchOfAnotherShapeIsRefused) {
  auto r = launch(2, kWorker, {"reshape"}, LaunchOptions().env({{"PIPELINE_TIMEOUT_S", "300"}}));
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "finished a step of 16 rows"), 2) << r.output;
  EXPECT_EQ(count_of(r.output, "finished a step of 8 rows"), 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0/2] Pipeline::step: stage 0's output of micro-batch 0 is Float "
                          "[2, 16], but the first step's was Float [4, 16]"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("rank 0 (pid"), std::string::npos) << r.output;
}

TEST(PointToPoint, SendAndRecvWithTagsListsAndStridedReceivers) {
  auto r = launch(2, kWorker, {"p2p"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "p2p ok"), 2) << r.output;
}

// A peer that fails to send: the receive fails, naming the operation and the peer, and never
// waits forever. "p2p_dead": the peer exits, and the receive fails without waiting for the
// timeout (300 s, longer than the harness's 120 s). "p2p_silent": the peer stays alive but
// silent, and the receive fails after the group's timeout (3 s).
struct SilentPeer {
  const char* mode;
  const char* timeout_s;
};

class PointToPointFailure : public ::testing::TestWithParam<SilentPeer> {};

TEST_P(PointToPointFailure, ARecvFromAPeerThatDoesNotSendFailsNamingIt) {
  auto r = launch(2, kWorker, {GetParam().mode},
                  LaunchOptions().env({{"PIPELINE_TIMEOUT_S", GetParam().timeout_s}}));
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("rank 0 error: [rank 0/2] recv of the test tensor from rank 1 (tag 3) "
                          "failed"),
            std::string::npos)
      << r.output;
}

INSTANTIATE_TEST_SUITE_P(PeerLeftOrSilent, PointToPointFailure,
                         ::testing::Values(SilentPeer{"p2p_dead", "300"},
                                           SilentPeer{"p2p_silent", "3"}),
                         [](const auto& info) { return std::string(info.param.mode); });
