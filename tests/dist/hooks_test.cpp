// A model with typed members (holders declared with TANDEM_MODULE and tandem::nn layers) trains
// under tensor parallel, ZeRO-3 with one unit per block, and activation checkpointing from the
// config file, each equal to one dense process; with torch::nn holders the same requests are
// refused, naming the fix.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "../common/launch.h"

using tandem::testing::count_of;
using tandem::testing::run_command;

namespace {

const std::string kWorker = HOOKS_WORKER;

std::string config_file(const std::string& name, const std::string& body) {
  const auto path = tandem::testing::temp_path("hooks", name + ".yaml");
  std::ofstream(path) << "compute_environment: LOCAL_MACHINE\n"
                      << body << "mixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\n"
                      << "use_cpu: true\n";
  return path;
}

// `n` ranks of the worker in `mode`, with the launcher's `flags` (a config file names 2 ranks on
// the CPU, as launch's own flags do).
tandem::testing::RunResult run(int n, std::vector<std::string> flags, const std::string& mode) {
  return tandem::testing::launch(
      n, kWorker, {mode}, tandem::testing::LaunchOptions().flags(std::move(flags)).timeout_s(240));
}

// Runs of a test, as jobs of one launch per number of ranks (tandem::testing::launch_jobs_by_size):
// each gets exactly the variables its own launch would give it. add() names a run, run() runs
// them all, then [name] is its result.
class Runs {
 public:
  // `may_fail`: a refusal every rank makes alike.
  void add(const std::string& name, int n, std::vector<std::string> flags, const std::string& mode,
           bool may_fail = false) {
    jobs_.emplace_back(name, n,
                       tandem::testing::Job{
                           {mode},
                           tandem::testing::LaunchOptions().flags(std::move(flags)).timeout_s(240),
                           may_fail});
  }
  void run() { results_ = tandem::testing::launch_jobs_by_size(kWorker, jobs_); }
  const tandem::testing::RunResult& operator[](const std::string& name) { return results_[name]; }

 private:
  std::vector<std::tuple<std::string, int, tandem::testing::Job>> jobs_;
  std::map<std::string, tandem::testing::RunResult> results_;
};

double figure(const std::string& out, const std::string& key) {
  auto at = out.find(key);
  if (at == std::string::npos) return 1e9;
  return std::stod(out.substr(at + key.size()));
}

// Every step's loss and every gathered parameter within 1e-5 of the dense process.
void expect_dense(const tandem::testing::RunResult& r, const std::string& what, int ranks = 2) {
  ASSERT_EQ(r.exit_code, 0) << what << "\n" << r.output;
  EXPECT_EQ(count_of(r.output, "hooks trained rank"), ranks) << what << "\n" << r.output;
  EXPECT_LE(figure(r.output, "loss relative "), 1e-5) << what << "\n" << r.output;
  const auto at = r.output.find("params ");
  ASSERT_NE(at, std::string::npos) << r.output;
  int matched = 0, total = 0;
  double rel = 1;
  ASSERT_EQ(std::sscanf(r.output.c_str() + at, "params %d of %d relative %lf", &matched, &total, &rel),
            3)
      << r.output;
  EXPECT_EQ(matched, total) << what << "\n" << r.output;
  EXPECT_EQ(total, 2 + 3 * 6 + 2) << what;  // embed, 3 blocks (norm, up, down), head
  EXPECT_LE(rel, 1e-5) << what << "\n" << r.output;
}

TEST(ModuleHooksDist, TypedMembersUnderTensorParallelEqualOneProcess) {
  auto r = run(2, {"--tp_size", "2"}, "tp");
  expect_dense(r, "tp 2");
  // The typed members' calls went to the planned layers, which named_modules() shows.
  EXPECT_EQ(count_of(r.output, "module h1.up ColumnParallelLinear"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "module h2.down RowParallelLinear"), 1) << r.output;
}

TEST(ModuleHooksDist, TypedBlocksAreZero3UnitsByTheirClass) {
  const auto fsdp = config_file("fsdp", "distributed_type: FSDP\nfsdp_config:\n"
                                        "  fsdp_sharding_strategy: FULL_SHARD\n"
                                        "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
                                        "  fsdp_transformer_layer_cls_to_wrap: Block\n");
  Runs runs;
  runs.add("fsdp", 2, {"--config_file", fsdp}, "train");
  // Without a class list (DeepSpeed's stage 3): the outermost modules a user declared.
  runs.add("zero-3", 2, {"--use_deepspeed", "--zero_stage", "3"}, "train");
  runs.run();
  auto r = runs["fsdp"];
  expect_dense(r, "fsdp");
  for (const char* b : {"h0", "h1", "h2"})
    EXPECT_EQ(count_of(r.output, std::string("hooks ") + b + ": zero-3 unit\n"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "hooks h"), 3) << r.output;
  r = runs["zero-3"];
  expect_dense(r, "zero-3");
  EXPECT_EQ(count_of(r.output, ": zero-3 unit\n"), 3) << r.output;
  EXPECT_EQ(count_of(r.output, "hooks h1: zero-3 unit\n"), 1) << r.output;
}

TEST(ModuleHooksDist, ActivationCheckpointingFromTheConfigFileReachesTypedBlocks) {
  const auto ddp = config_file("ac",
                               "distributed_type: MULTI_CPU\nfsdp_config:\n"
                               "  fsdp_activation_checkpointing: true\n");
  // With ZeRO-3 units on the same blocks: the recompute gathers the unit again.
  const auto both = config_file("both", "distributed_type: FSDP\nfsdp_config:\n"
                                        "  fsdp_sharding_strategy: FULL_SHARD\n"
                                        "  fsdp_transformer_layer_cls_to_wrap: Block\n"
                                        "  fsdp_activation_checkpointing: true\n");
  Runs runs;
  runs.add("ddp", 2, {"--config_file", ddp}, "train");
  runs.add("both", 2, {"--config_file", both}, "train");
  runs.run();
  auto r = runs["ddp"];
  expect_dense(r, "ddp + activation checkpointing");
  EXPECT_EQ(count_of(r.output, ": activation checkpoint\n"), 3) << r.output;
  r = runs["both"];
  expect_dense(r, "fsdp + activation checkpointing");
  EXPECT_EQ(count_of(r.output, ": activation checkpoint, zero-3 unit\n"), 3) << r.output;
}

// torch::nn holders: what no hook reaches is refused, naming TANDEM_MODULE.
TEST(ModuleHooksDist, TorchNnHoldersAreRefusedNamingTheFix) {
  const auto fsdp = config_file("fsdp-plain", "distributed_type: FSDP\nfsdp_config:\n"
                                              "  fsdp_sharding_strategy: FULL_SHARD\n"
                                              "  fsdp_transformer_layer_cls_to_wrap: PlainBlock\n");
  const auto ac = config_file("ac-plain",
                              "distributed_type: MULTI_CPU\nfsdp_config:\n"
                              "  fsdp_activation_checkpointing: true\n");
  // A class that names no module is refused with the classes the model has.
  const auto wrong = config_file("fsdp-wrong",
                                 "distributed_type: FSDP\nfsdp_config:\n"
                                 "  fsdp_sharding_strategy: FULL_SHARD\n"
                                 "  fsdp_transformer_layer_cls_to_wrap: Layer\n");
  Runs runs;
  runs.add("fsdp", 2, {"--config_file", fsdp}, "plain", true);
  runs.add("ac", 2, {"--config_file", ac}, "plain", true);
  runs.add("tp", 2, {"--tp_size", "2"}, "plain-tp", true);
  runs.add("wrong", 2, {"--config_file", wrong}, "train", true);
  runs.run();
  auto r = runs["fsdp"];
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_GE(count_of(r.output, "declare it with TANDEM_MODULE(PlainBlock)"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "hooks trained rank"), 0) << r.output;
  r = runs["ac"];
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_GE(count_of(r.output, "has no block it can reach"), 1) << r.output;
  r = runs["tp"];
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_GE(count_of(r.output, "tandem::nn::Linear up;"), 1) << r.output;
  r = runs["wrong"];
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_GE(count_of(r.output, "names Layer, which is no module of the model"), 1) << r.output;
  EXPECT_GE(count_of(r.output, "Block"), 1) << r.output;
}

// Note [Collectives on a mesh]: the metrics code of a loop gives the same numbers on dp 2 and on
// dp 2 x tp 2 (before, reduce ran over every process: kSum counted each tp replica twice).
TEST(MeshCollectives, MetricsOnDp2EqualDp2TimesTp2) {
  auto dp = run(2, {}, "metrics");
  ASSERT_EQ(dp.exit_code, 0) << dp.output;
  auto both = run(4, {"--tp_size", "2"}, "metrics");
  ASSERT_EQ(both.exit_code, 0) << both.output;
  auto lines = [](const std::string& out) {
    std::vector<std::string> v;
    for (size_t at = out.find("metric "); at != std::string::npos; at = out.find("metric ", at + 1))
      v.push_back(out.substr(at, out.find('\n', at) - at));
    return v;
  };
  const auto expected = std::vector<std::string>{
      "metric gather 0.000000 0.000000 1.000000 1.000000", "metric sum 3.000000",
      "metric mean 1.500000",
      "metric padded 0.000000 -1.000000 10.000000 11.000000"};
  EXPECT_EQ(lines(dp.output), expected) << dp.output;
  EXPECT_EQ(lines(both.output), expected) << both.output;
}

// Note [A topology always built]: a plain run has one too (its dp group the world group
// itself), and the data-parallel sizes take effect through the strategy or are refused.
TEST(Topology, AlwaysBuiltAndItsSizesTakeEffect) {
  Runs runs;
  runs.add("plain", 2, {}, "topology");
  runs.add("fsdp", 2, {"--use_fsdp"}, "topology");
  runs.add("zero-2 tp", 4, {"--use_deepspeed", "--zero_stage", "2", "--tp_size", "2"}, "topology");
  runs.add("fsdp shard", 2, {"--use_fsdp", "--dp_shard_size", "2"}, "train");
  runs.add("shard alone", 2, {"--dp_shard_size", "2"}, "topology", true);
  runs.add("hybrid", 4, {"--use_fsdp", "--dp_replicate_size", "2"}, "train");
  runs.run();
  auto r = runs["plain"];
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "topology pp 1 x dp_replicate 2 x dp_shard 1 x tp 1 x dp 2; dp 2 "
                               "(the world group); shard 1; strategy ddp; mesh built\n"),
            1)
      << r.output;
  // A ZeRO stage shards over every data-parallel rank.
  r = runs["fsdp"];
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "topology pp 1 x dp_replicate 1 x dp_shard 2 x tp 1 x dp 2; dp 2 "
                               "(the world group); shard 2; strategy zero-3"),
            1)
      << r.output;
  r = runs["zero-2 tp"];
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "topology pp 1 x dp_replicate 1 x dp_shard 2 x tp 2 x dp 2; dp 2; "
                               "shard 2; strategy zero-2"),
            1)
      << r.output;
  // dp_shard_size set: ZeRO-3 over those ranks trains as one dense process.
  expect_dense(runs["fsdp shard"], "fsdp --dp_shard_size 2");
  // Sizes no strategy honours are refused on every rank, naming the flag and the fix.
  r = runs["shard alone"];
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_GE(count_of(r.output, "dp_shard_size 2 (--dp_shard_size"), 1) << r.output;
  EXPECT_GE(count_of(r.output, "--use_fsdp"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "topology pp"), 0) << r.output;
  // dp_replicate_size with a ZeRO stage is hybrid sharding (Note [Hybrid sharding]): ZeRO-3
  // over each pair of ranks, the pairs' shards averaged, trains as one dense process.
  r = runs["hybrid"];
  expect_dense(r, "fsdp --dp_replicate_size 2", 4);
  EXPECT_EQ(count_of(r.output, "hybrid: shards over dp_shard 2, replicas over dp_replicate 2"), 1)
      << r.output;
}

}  // namespace
