// Activation checkpointing over real processes: with data parallel and with ZeRO-3, a model of
// checkpointed dropout blocks trains to bitwise the parameters of the same model without
// checkpointing, and every synchronised backward's buckets are reduced once (Note [Callbacks in a
// recompute]: the reducer's end-of-backward callback waits for the outer backward).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../common/launch.h"

using tandem::testing::count_of;
using tandem::testing::launch;
using tandem::testing::LaunchOptions;
using tandem::testing::read_floats;

namespace {

const std::string kWorker = ACTIVATION_CHECKPOINTING_WORKER;

// One training on 2 ranks: under ZeRO-3 or data parallel, checkpointed (wrapped before or after
// prepare) or not.
struct Training {
  bool zero3, checkpointing;
  std::string wrap = "before";
  std::string what() const {
    return std::string(zero3 ? "zero3" : "ddp") + (checkpointing ? "-ckpt-" + wrap : "");
  }
};

// The trainings as jobs of one launch on 2 ranks (tandem::testing::launch_jobs); rank 0's final
// parameters of each.
std::vector<std::vector<float>> train(const std::vector<Training>& trainings) {
  std::vector<tandem::testing::Job> jobs;
  for (const auto& t : trainings) {
    std::vector<std::string> flags;
    if (t.zero3) flags.insert(flags.end(), {"--use_deepspeed", "--zero_stage", "3"});
    if (t.checkpointing) flags.push_back("--activation_checkpointing");
    const auto out = tandem::testing::temp_path("checkpointing", t.what() + ".bin");
    jobs.push_back({{"--out", out, "--wrap", t.wrap}, LaunchOptions().flags(flags)});
  }
  const auto runs = tandem::testing::launch_jobs(2, kWorker, jobs);
  std::vector<std::vector<float>> params;
  for (size_t i = 0; i < trainings.size(); ++i) {
    const auto& t = trainings[i];
    const auto& r = runs[i];
    EXPECT_EQ(r.exit_code, 0) << t.what() << "\n" << r.output;
    const std::string strategy = t.zero3 ? "zero-3" : "ddp";
    // 4 steps of 2 micro-steps: 4 synchronised backward passes, each finished once, on each rank.
    EXPECT_EQ(count_of(r.output, "strategy " + strategy + " checkpointed " +
                                     std::string(t.checkpointing ? "5" : "0") + " reductions 4"),
              2)
        << t.what() << "\n" << r.output;
    const auto out = tandem::testing::temp_path("checkpointing", t.what() + ".bin");
    params.push_back(read_floats(out));
    std::remove(out.c_str());
  }
  return params;
}

void expect_bitwise(const std::vector<float>& a, const std::vector<float>& b) {
  ASSERT_FALSE(a.empty());
  ASSERT_EQ(a.size(), b.size());
  size_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  EXPECT_EQ(differ, 0u) << differ << " of " << a.size() << " parameters differ";
}

}  // namespace

TEST(ActivationCheckpointingDistributed, DataParallelBitwiseEqual) {
  const auto p = train({{false, false}, {false, true}});
  expect_bitwise(p[0], p[1]);
}

// Sharded(Checkpointed(block)) (checkpointing applied before prepare, the auto-wrap outside) and
// Checkpointed(Sharded(block)) (applied after prepare): the units are gathered for the recompute
// and freed after, and each unit's gradients are reduced once.
TEST(ActivationCheckpointingDistributed, Zero3BitwiseEqualInBothNestings) {
  const auto p = train({{true, false}, {true, true, "before"}, {true, true, "after"}});
  expect_bitwise(p[0], p[1]);
  expect_bitwise(p[0], p[2]);
}

// Note [Unused parameters in a recompute]: with find_unused_parameters each checkpointed
// module's recompute marks the parameters its graph does not reach. A region nested in another
// (the outer recompute's graph hides the inner's parameters) must mark nothing it may still get a
// gradient for: under data parallel it trains bitwise as without checkpointing (before, the outer
// recompute marked the inner blocks' parameters, which then got "their gradient twice").
TEST(ActivationCheckpointingDistributed, NestedRegionsFindUnusedParameters) {
  std::vector<tandem::testing::Job> jobs;
  std::vector<std::string> outs;
  for (bool ckpt : {false, true}) {
    const auto out = tandem::testing::temp_path(
        "checkpointing", std::string("nested") + (ckpt ? "-ckpt" : "") + ".bin");
    outs.push_back(out);
    jobs.push_back(
        {{"--out", out, "--shape", "nested", "--find_unused"},
         LaunchOptions().flags(ckpt ? std::vector<std::string>{"--activation_checkpointing"}
                                    : std::vector<std::string>{})});
  }
  const auto runs = tandem::testing::launch_jobs(2, kWorker, jobs);
  for (const auto& r : runs) {
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(count_of(r.output, "reductions 4"), 2) << r.output;
  }
  EXPECT_EQ(count_of(runs[1].output, "checkpointed 6"), 2) << runs[1].output;  // 2 inner + 4 outer
  std::vector<std::vector<float>> p;
  for (const auto& out : outs) {
    p.push_back(read_floats(out));
    std::remove(out.c_str());
  }
  expect_bitwise(p[0], p[1]);
}
