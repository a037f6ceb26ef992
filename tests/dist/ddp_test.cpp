// Data parallel over real processes: N ranks equal one process on the same global batches, and
// the properties of the gradient engine (unused parameters, tied weights, buffers, overlap,
// gather_for_metrics).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <tuple>
#include <vector>

#include "../common/launch.h"

using tandem::testing::count_of;
using tandem::testing::launch;
using tandem::testing::read_floats;

namespace {

const std::string kWorker = DDP_WORKER;

std::string temp_path(const std::string& name) {
  return tandem::testing::temp_path("ddp", name);
}

// One thread per rank, 240 s per job.
const auto kLaunch = tandem::testing::LaunchOptions().timeout_s(240);

}  // namespace

struct EquivalenceCase {
  std::string model;
  int ranks;
  int accumulate;
};

// Cases whose runs go as jobs of one launch per number of ranks (tandem::testing::launch_jobs).
struct EquivalenceGroup {
  std::string name;
  std::vector<EquivalenceCase> cases;
};

class Equivalence : public ::testing::TestWithParam<EquivalenceGroup> {};

// N ranks trained for K optimizer steps end with the parameters of one process trained on the
// same global batches: max abs difference <= 1e-5 in fp32 (the two differ only in the order of
// floating-point sums: per-rank means averaged by the allreduce vs. the same mean computed in one
// process). The data set size (203 for the MLP, 61 windows for the GPT) is divisible by none of
// 2, 3, 4, so the last batch is short and the sampler pads.
TEST_P(Equivalence, NRanksEqualOneProcessOnTheGlobalBatch) {
  std::vector<std::tuple<std::string, int, tandem::testing::Job>> jobs;
  auto name_of = [](const EquivalenceCase& c) {
    return c.model + "_" + std::to_string(c.ranks) + "ranks_accum" + std::to_string(c.accumulate);
  };
  for (const auto& c : GetParam().cases) {
    const std::string samples = c.model == "gpt" ? "61" : "203";
    const std::string steps = c.model == "gpt" ? "6" : "30";  // the MLP crosses an epoch boundary
    std::vector<std::string> common{"--model", c.model, "--steps", steps, "--accumulate",
                                    std::to_string(c.accumulate), "--samples", samples, "--batch",
                                    "4"};
    auto args = common;
    args.insert(args.begin(), "train");
    args.insert(args.end(), {"--out", temp_path(name_of(c) + "-dist.bin")});
    jobs.emplace_back(name_of(c), c.ranks, tandem::testing::Job{args, kLaunch});
    args = common;
    args.insert(args.begin(), "reference");
    args.insert(args.end(), {"--ranks", std::to_string(c.ranks), "--out",
                             temp_path(name_of(c) + "-ref.bin")});
    // The reference goes through the launcher too, so that it runs the same BLAS kernels as the
    // ranks (the launcher may pick OpenBLAS's kernels: Note [OpenBLAS kernels]).
    jobs.emplace_back(name_of(c) + "-ref", 1, tandem::testing::Job{args, kLaunch});
  }
  const auto runs = tandem::testing::launch_jobs_by_size(kWorker, jobs);
  for (const auto& c : GetParam().cases) {
    const auto& r = runs.at(name_of(c));
    const auto& ref = runs.at(name_of(c) + "-ref");
    const std::string steps = c.model == "gpt" ? "6" : "30";
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(count_of(r.output, "trained " + steps + " steps on " + std::to_string(c.ranks)),
              c.ranks)
        << r.output;
    EXPECT_EQ(ref.exit_code, 0) << ref.output;
    const auto dist_out = temp_path(name_of(c) + "-dist.bin");
    const auto ref_out = temp_path(name_of(c) + "-ref.bin");
    auto a = read_floats(dist_out), b = read_floats(ref_out);
    EXPECT_EQ(a.size(), b.size()) << name_of(c);
    EXPECT_GT(a.size(), 1000u) << name_of(c);
    double max_diff = a.size() == b.size() ? 0 : 1;
    for (size_t i = 0; i < a.size() && i < b.size(); ++i)
      max_diff = std::max(max_diff, std::fabs(double(a[i]) - b[i]));
    EXPECT_LE(max_diff, 1e-5) << c.model << " on " << c.ranks << " ranks, accumulating "
                              << c.accumulate;
    std::remove(dist_out.c_str());
    std::remove(ref_out.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Models, Equivalence,
    ::testing::Values(
        EquivalenceGroup{"mlp_2ranks_accum1", {{"mlp", 2, 1}}},
        EquivalenceGroup{"mlp", {{"mlp", 1, 1}, {"mlp", 3, 1}, {"mlp", 4, 1}, {"mlp", 2, 3},
                                 {"mlp", 3, 2}}},
        EquivalenceGroup{"gpt", {{"gpt", 2, 1}, {"gpt", 3, 1}, {"gpt", 2, 2}}}),
    [](const auto& info) { return info.param.name; });

TEST(DataParallel, BuffersAreBroadcast) {
  auto r = launch(2, kWorker, {"buffers"}, kLaunch);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "buffers OK"), 2) << r.output;
}

// The worker's own checks, each ending in "<mode> OK" on every rank: unused parameters named (or
// handled with find_unused_parameters), tied weights that stay tied and equal, the first
// bucket's allreduce started before backward ends, gather_for_metrics counting each sample once
// (2, 3 and 4 ranks), compression hooks equal to the allreduce of rounded gradients, gradients as
// bucket views training the same (2 and 3 ranks), the timeline and trackers. Jobs of one launch
// per number of ranks (tandem::testing::launch_jobs_by_size), each with exactly the variables its
// own launch would give it.
TEST(DataParallel, UnusedTiedOverlapMetricsCompressionBucketViewsAndTrackers) {
  const std::string dir = temp_path("tracking");
  const std::vector<std::pair<std::string, int>> modes{
      {"unused", 2},     {"unused-find", 2}, {"tied", 3},    {"overlap", 2},
      {"metrics", 2},    {"metrics", 3},     {"metrics", 4}, {"compress", 2},
      {"bucketview", 2}, {"bucketview", 3},  {"tracking", 2}};
  std::vector<std::tuple<std::string, int, tandem::testing::Job>> jobs;
  for (const auto& [mode, n] : modes) {
    std::vector<std::string> args{mode};
    if (mode == "tracking") args.insert(args.end(), {"--out", dir});
    jobs.emplace_back(mode + " " + std::to_string(n), n, tandem::testing::Job{args, kLaunch});
  }
  const auto runs = tandem::testing::launch_jobs_by_size(kWorker, jobs);
  for (const auto& [mode, n] : modes) {
    const auto& r = runs.at(mode + " " + std::to_string(n));
    EXPECT_EQ(r.exit_code, 0) << mode << " on " << n << " ranks\n" << r.output;
    const std::string ok = (mode == "unused-find" ? std::string("unused") : mode) + " OK";
    EXPECT_EQ(count_of(r.output, ok), n) << mode << " on " << n << " ranks\n" << r.output;
  }
  std::system(("rm -rf " + dir).c_str());
}
