// Note [Resharding a checkpoint]: a run stopped after 2 of 5 steps (mid-epoch) under one layout
// and resumed under another ends equal to one uninterrupted dense run (the Sequential GPT with
// AdamW, a shuffled loader of 12 samples per step over all data-parallel ranks), within 1e-5 of
// each tensor's scale; the layout change is said in one line at load, and load_state's result
// says what it restored.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "../common/launch.h"
#include "../common/subprocess.h"

using tandem::testing::count_of;
using tandem::testing::launch;
using tandem::testing::LaunchOptions;

namespace {

const std::string kWorker = RESHARD_WORKER;

struct Layout {
  int processes;
  std::vector<std::string> flags;
};

// The largest value of every "check <name> <value>" line of the output.
std::map<std::string, double> worst_checks(const std::string& output) {
  std::map<std::string, double> worst;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("[rank ", 0) == 0) line = line.substr(line.find("] ") + 2);
    if (line.rfind("check ", 0) != 0) continue;
    const auto last = line.rfind(' ');
    const auto name = line.substr(6, last - 6);
    worst[name] = std::max(worst[name], std::stod(line.substr(last + 1)));
  }
  return worst;
}

// Saves after step 2 on `from`, resumes on `to` for steps 2-4; returns the resumed job's output.
std::string expect_resume_equals_dense(const Layout& from, const Layout& to,
                                       const std::string& saved_on,
                                       const std::string& resumed_on) {
  const auto dir = tandem::testing::temp_path("reshard", "ckpt");
  auto saved = launch(from.processes, kWorker, {"--steps", "5", "--stop", "2", "--save_dir", dir},
                      LaunchOptions().flags(from.flags).timeout_s(180));
  EXPECT_EQ(saved.exit_code, 0) << saved.output;
  EXPECT_EQ(count_of(saved.output, "saved at step 2"), from.processes) << saved.output;
  auto resumed = launch(to.processes, kWorker, {"--steps", "5", "--load_dir", dir},
                        LaunchOptions().flags(to.flags).timeout_s(180));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  // The loaders continue at sample 24 of the epoch on the new data-parallel size.
  EXPECT_EQ(count_of(resumed.output, "resumed at step 2 from " + saved_on + " resharded 1 loaders 1"),
            to.processes)
      << resumed.output;
  EXPECT_EQ(count_of(resumed.output, "was saved on " + saved_on + "; resuming on " + resumed_on),
            1)
      << resumed.output;
  auto worst = worst_checks(resumed.output);
  for (int s = 2; s < 5; ++s)
    EXPECT_LT(worst.at("resumed_loss_step" + std::to_string(s)), 1e-5) << resumed.output;
  EXPECT_LT(worst.at("resumed_params"), 1e-5) << resumed.output;
  std::cout << saved_on << " -> " << resumed_on << ": parameters within "
            << worst.at("resumed_params") << " of the dense run" << std::endl;
  EXPECT_EQ(count_of(resumed.output, "is not the dense model's"), 0) << resumed.output;
  std::system(("rm -rf " + dir).c_str());
  return resumed.output;
}

const Layout kDp2Tp2{4, {"--tp_size", "2"}};
const Layout kDp4{4, {}};
const Layout kTp2{2, {"--tp_size", "2"}};
const Layout kZero3On3{3, {"--use_deepspeed", "--zero_stage", "3"}};
const Layout kPp2{2, {"--pp_size", "2"}};
const Layout kDp2{2, {}};
const Layout kZero2On4{4, {"--use_deepspeed", "--zero_stage", "2"}};
const Layout kPp2Tp2{4, {"--pp_size", "2", "--tp_size", "2"}};
const Layout kZero3Tp2{4, {"--tp_size", "2", "--use_deepspeed", "--zero_stage", "3"}};
const Layout kZero1On2{2, {"--use_deepspeed", "--zero_stage", "1"}};

}  // namespace

TEST(Reshard, DataTimesTensorParallelResumesOnDataParallel) {
  expect_resume_equals_dense(kDp2Tp2, kDp4, "dp 2 x tp 2 (4 processes, ddp)",
                             "dp 4 (4 processes, ddp)");
}

TEST(Reshard, TensorParallelResumesOnZero3OverThreeRanks) {
  expect_resume_equals_dense(kTp2, kZero3On3, "tp 2 (2 processes, ddp)",
                             "dp 3 (3 processes, zero-3)");
}

// Interleaved stages: rank 0 holds the embedding and block 1, rank 1 block 0 and the head; the
// checkpoint records the stages per rank beside the mesh, so that a pipeline of one stage per
// rank (same mesh, other entries per rank) reshards it as it would another mesh; and on data
// parallel.
TEST(Reshard, InterleavedPipelineResumesOnZeroBubbleAndOnDataParallel) {
  const Layout interleaved{2, {"--pp_size", "2", "--pp_schedule", "interleaved_1f1b",
                               "--pp_virtual_stages", "2"}};
  const Layout zero_bubble{2, {"--pp_size", "2", "--pp_schedule", "zero_bubble"}};
  const std::string saved_on = "pp 2 (2 processes, ddp, 2 pipeline stages per rank)";
  expect_resume_equals_dense(interleaved, zero_bubble, saved_on, "pp 2 (2 processes, ddp)");
  expect_resume_equals_dense(interleaved, kDp2, saved_on, "dp 2 (2 processes, ddp)");
}

TEST(Reshard, PipelineResumesOnDataParallel) {
  expect_resume_equals_dense(kPp2, kDp2, "pp 2 (2 processes, ddp)", "dp 2 (2 processes, ddp)");
}

TEST(Reshard, Zero2ResumesOnTensorParallel) {
  expect_resume_equals_dense(kZero2On4, kTp2, "dp 4 (4 processes, zero-2)",
                             "tp 2 (2 processes, ddp)");
}

TEST(Reshard, PipelineTimesTensorParallelResumesOnDataTimesTensorParallel) {
  expect_resume_equals_dense(kPp2Tp2, kDp2Tp2, "pp 2 x tp 2 (4 processes, ddp)",
                             "dp 2 x tp 2 (4 processes, ddp)");
}

// Sharded on a mesh (each tp rank's shards cut again over its data-parallel pair) into another
// ZeRO stage without tensor parallel, and a ZeRO checkpoint onto a pipeline of tensor-parallel
// stages.
TEST(Reshard, Zero3TimesTensorParallelResumesOnZero1) {
  expect_resume_equals_dense(kZero3Tp2, kZero1On2, "dp 2 x tp 2 (4 processes, zero-3)",
                             "dp 2 (2 processes, zero-1)");
}

TEST(Reshard, Zero1ResumesOnPipelineTimesTensorParallel) {
  expect_resume_equals_dense(kZero1On2, kPp2Tp2, "dp 2 (2 processes, zero-1)",
                             "pp 2 x tp 2 (4 processes, ddp)");
}
