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

// Trains on 2 ranks; returns rank 0's final parameters.
std::vector<float> train(bool zero3, bool checkpointing, const std::string& wrap = "before") {
  const std::string what = std::string(zero3 ? "zero3" : "ddp") + (checkpointing ? "-ckpt-" + wrap : "");
  const auto out = tandem::testing::temp_path("checkpointing", what + ".bin");
  std::vector<std::string> flags;
  if (zero3) flags.insert(flags.end(), {"--use_deepspeed", "--zero_stage", "3"});
  if (checkpointing) flags.push_back("--activation_checkpointing");
  auto r = launch(2, kWorker, {"--out", out, "--wrap", wrap}, LaunchOptions().flags(flags));
  EXPECT_EQ(r.exit_code, 0) << what << "\n" << r.output;
  const std::string strategy = zero3 ? "zero-3" : "ddp";
  // 4 steps of 2 micro-steps: 4 synchronised backward passes, each finished once, on each rank.
  EXPECT_EQ(count_of(r.output, "strategy " + strategy + " checkpointed " +
                                   std::string(checkpointing ? "5" : "0") + " reductions 4"),
            2)
      << what << "\n" << r.output;
  auto v = read_floats(out);
  std::remove(out.c_str());
  return v;
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
  auto plain = train(false, false);
  auto ckpt = train(false, true);
  expect_bitwise(plain, ckpt);
}

// Sharded(Checkpointed(block)) (checkpointing applied before prepare, the auto-wrap outside) and
// Checkpointed(Sharded(block)) (applied after prepare): the units are gathered for the recompute
// and freed after, and each unit's gradients are reduced once.
TEST(ActivationCheckpointingDistributed, Zero3BitwiseEqualInBothNestings) {
  auto plain = train(true, false);
  expect_bitwise(plain, train(true, true, "before"));
  expect_bitwise(plain, train(true, true, "after"));
}
