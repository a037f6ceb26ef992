// Sharded data parallel over real processes: every ZeRO stage trains to the parameters data
// parallel reaches, a rank with a different model fails fast, and a sharded checkpoint resumes
// on another number of ranks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include "../common/launch.h"
#include "../common/sanitizers.h"

using tandem::testing::count_of;
using tandem::testing::kAsan;
using tandem::testing::launch;
using tandem::testing::LaunchOptions;
using tandem::testing::max_rel_diff;
using tandem::testing::read_floats;
using tandem::testing::run_command;

namespace {

const std::string kCli = TANDEM_CLI;
const std::string kWorker = ZERO_WORKER;

std::string temp_path(const std::string& name) {
  return tandem::testing::temp_path("zero", name);
}

// The launcher's flags for ZeRO `stage` (< 0: data parallel) in `precision`, the reduce-scatter
// in TANDEM_REDUCE_SCATTER; one thread per rank, 240 s per job.
LaunchOptions zero_flags(int stage, const std::string& reduce_scatter = "alltoall",
                         const std::string& precision = "no",
                         const std::vector<std::string>& more = {}) {
  std::vector<std::string> flags{"--mixed_precision", precision};
  flags.insert(flags.end(), more.begin(), more.end());
  if (stage >= 0)
    flags.insert(flags.end(), {"--use_deepspeed", "--zero_stage", std::to_string(stage)});
  return LaunchOptions()
      .flags(flags)
      .env({{"TANDEM_REDUCE_SCATTER", reduce_scatter}})
      .timeout_s(240);
}

// One training of `train_all`: a ZeRO stage (< 0: data parallel), its reduce-scatter, precision
// and launcher flags, and the worker's extra arguments.
struct TrainRun {
  int stage;
  std::string reduce_scatter = "alltoall";
  std::vector<std::string> extra = {};
  std::string precision = "no";
  std::vector<std::string> launch_flags = {};
};

// The runs, on `n` ranks, in one launch (tandem::testing::launch_jobs: one set of rank processes
// for all), each checked to exit 0 having trained 10 steps under its strategy on every rank;
// their parameters in order.
std::vector<std::vector<float>> train_all(int n, const std::vector<TrainRun>& runs) {
  std::vector<tandem::testing::Job> jobs;
  std::vector<std::string> outs, whats;
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& run = runs[i];
    outs.push_back(temp_path("params-" + std::to_string(n) + "-" + std::to_string(i) + ".bin"));
    std::vector<std::string> args{"train", "--out", outs.back()};
    args.insert(args.end(), run.extra.begin(), run.extra.end());
    jobs.push_back(
        {args, zero_flags(run.stage, run.reduce_scatter, run.precision, run.launch_flags)});
    std::string what = "stage " + std::to_string(run.stage) + ", " + run.precision + ", " +
                       run.reduce_scatter;
    for (const auto& a : args) what += " " + a;
    whats.push_back(what);
  }
  const auto results = tandem::testing::launch_jobs(n, kWorker, jobs);
  std::vector<std::vector<float>> params;
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& r = results[i];
    EXPECT_EQ(r.exit_code, 0) << whats[i] << "\n" << r.output;
    const std::string name =
        runs[i].stage > 0 ? "zero-" + std::to_string(runs[i].stage) : "ddp";
    EXPECT_EQ(count_of(r.output, "strategy " + name + " trained to step 10"), n)
        << whats[i] << "\n" << r.output;
    params.push_back(read_floats(outs[i]));
    std::remove(outs[i].c_str());
  }
  return params;
}

}  // namespace

class ZeroEqualsDataParallel : public ::testing::TestWithParam<int> {};

// 10 AdamW steps of 2 accumulated micro-steps each. With one parameter group the units are
// exactly data parallel's buckets; stage 1, and stage 2 with allreduce + slice, then reduce the
// same bytes with the same Gloo calls, and AdamW's arithmetic is elementwise, so stepping
// per-unit chunks instead of per-parameter tensors gives the same bits: without clipping the
// parameters are bitwise data parallel's. With three parameter groups (units never mix groups,
// so they differ from data parallel's buckets and Gloo sums 3 or 4 ranks in another order),
// clipping (the norm summed over shards in another order) and alltoall (contributions added in
// rank order), the parameters stay within 1e-6 (relative) of data parallel's.
TEST_P(ZeroEqualsDataParallel, AfterTenStepsWithAccumulationAndClipping) {
  const int n = GetParam();
  const std::vector<std::string> exact{"--clip", "0", "--one_group"};
  const std::vector<std::pair<int, std::string>> clipped{
      {1, "allreduce"}, {2, "allreduce"}, {2, "alltoall"}, {3, "alltoall"}};
  std::vector<TrainRun> runs{{-1, "alltoall", exact}, {1, "allreduce", exact},
                        {2, "allreduce", exact}, {3, "allreduce", exact},
                        {-1},                    {-1, "alltoall", {"--clip", "0"}}};
  for (const auto& [stage, algo] : clipped) runs.push_back({stage, algo});
  const auto p = train_all(n, runs);
  const auto& ddp_exact = p[0];
  ASSERT_GT(ddp_exact.size(), 200u);
  EXPECT_EQ(max_rel_diff(p[1], ddp_exact), 0.0) << "stage 1 on " << n;
  EXPECT_EQ(max_rel_diff(p[2], ddp_exact), 0.0) << "stage 2 on " << n;
  // Stage 3's units are modules, not data parallel's buckets: the same sums on 2 ranks only.
  const auto& z3 = p[3];
  if (n == 2) {
    EXPECT_EQ(max_rel_diff(z3, ddp_exact), 0.0) << "stage 3 on 2";
  }
  EXPECT_LE(max_rel_diff(z3, ddp_exact), 1e-6) << "stage 3 on " << n;
  const auto& ddp = p[4];
  const auto& ddp_unclipped = p[5];
  EXPECT_GT(max_rel_diff(ddp, ddp_unclipped), 1e-3) << "the clipping binds";
  for (size_t i = 0; i < clipped.size(); ++i) {
    EXPECT_LE(max_rel_diff(p[6 + i], ddp), 1e-6)
        << "stage " << clipped[i].first << " " << clipped[i].second << " on " << n;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ZeroEqualsDataParallel, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

// Half weights (bf16-true). With fp32 master weights, data parallel steps fp32 masters of whole
// parameters and ZeRO fp32 copies of its chunks: bitwise on 2 ranks. Without masters the bf16
// parameters are stepped in bf16, where LibTorch's CPU kernels round a tensor's vectorised body
// and its scalar tail differently, and chunks have other tails than whole parameters: within 2
// bf16 ulps. With masters, the dynamic loss scaler (its inf/NaN check spans every rank's shards),
// three parameter groups and clipping: within 2 bf16 ulps of the weights too.
TEST(Zero, HalfWeightsAndMasterWeightsEqualDataParallel) {
  const std::string mode = "bf16-true";
  const std::vector<std::string> masters{"--clip", "0", "--one_group", "--master_weights"};
  const std::vector<std::string> plain{"--clip", "0", "--one_group"};
  const std::vector<std::string> scaled{"--master_weights", "--loss_scaling"};
  std::vector<TrainRun> runs{{-1, "allreduce", masters, mode},
                        {-1, "allreduce", plain, mode},
                        {-1, "allreduce", scaled, mode}};
  for (int stage : {1, 2, 3}) {
    runs.push_back({stage, "allreduce", masters, mode});
    runs.push_back({stage, "allreduce", plain, mode});
    runs.push_back({stage, "alltoall", scaled, mode});
  }
  const auto p = train_all(2, runs);
  const auto& ddp_masters = p[0];
  const auto& ddp_plain = p[1];
  const auto& ddp_scaled = p[2];
  ASSERT_GT(ddp_masters.size(), 200u);
  EXPECT_GT(max_rel_diff(ddp_masters, ddp_plain), 0.0) << "masters change the result";
  for (int stage : {1, 2, 3}) {
    const size_t at = 3 * static_cast<size_t>(stage);
    EXPECT_EQ(max_rel_diff(p[at], ddp_masters), 0.0) << "master weights, stage " << stage;
    EXPECT_LE(max_rel_diff(p[at + 1], ddp_plain), 1.0 / 128) << "bf16 weights, stage " << stage;
    EXPECT_LE(max_rel_diff(p[at + 2], ddp_scaled), 1.0 / 128) << "loss scaling, stage " << stage;
  }
}

// The tests' shared launches (tandem::testing::launch_jobs): each job trains under its own
// flags (the strategy it names), its lines are its own, a failing job ends the launch with its
// exit code and the jobs after it are not run.
TEST(LaunchJobs, EachJobHasItsFlagsItsOutputAndItsExitCode) {
  const auto out = temp_path("jobs.bin");
  const auto r = tandem::testing::launch_jobs(
      2, kWorker,
      {{{"train", "--out", out, "--steps", "2"}, zero_flags(2)},
       {{"train", "--out", out, "--steps", "2"}, zero_flags(-1)},
       {{"no_such_mode"}, zero_flags(1)},
       {{"train", "--out", out, "--steps", "2"}, zero_flags(3)}});
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0].exit_code, 0) << r[0].output;
  EXPECT_EQ(count_of(r[0].output, "strategy zero-2 trained to step 2"), 2) << r[0].output;
  EXPECT_EQ(count_of(r[0].output, "strategy ddp"), 0) << r[0].output;
  EXPECT_EQ(r[1].exit_code, 0) << r[1].output;
  EXPECT_EQ(count_of(r[1].output, "strategy ddp trained to step 2"), 2) << r[1].output;
  EXPECT_EQ(count_of(r[1].output, "strategy zero-2"), 0) << r[1].output;
  EXPECT_EQ(r[2].exit_code, 2) << r[2].output;
  EXPECT_GE(count_of(r[2].output, "unknown mode no_such_mode"), 1) << r[2].output;
  EXPECT_EQ(r[3].exit_code, -1) << r[3].output;
  EXPECT_EQ(count_of(r[3].output, "strategy zero-3"), 0) << r[3].output;
  std::remove(out.c_str());
  // A flag that acts on the launcher itself cannot differ between jobs of one launch.
  EXPECT_THROW(tandem::testing::launch_jobs(
                   2, kWorker,
                   {{{"train"}, LaunchOptions().flags({"--preemption_signal", "USR1"})}}),
               std::invalid_argument);
}

TEST(Zero, MismatchedModelsFailFastNamingBothLayouts) {
  auto r = launch(2, kWorker, {"mismatch"}, zero_flags(2));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("built different models"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Rank 0 has unit"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("prepared a mismatched model"), std::string::npos) << r.output;
}

// A run on 4 ranks saves its sharded state after 5 of 10 steps; resumed on 2 and on 3 ranks it
// ends where the uninterrupted 4-rank run ends (the rest of the difference: the sums of 2 or 3
// ranks instead of 4).
TEST(Zero, ShardedCheckpointResumesOnAnotherNumberOfRanks) {
  std::vector<std::string> dirs;
  std::vector<TrainRun> on4, on2, on3;
  for (int stage : {1, 2, 3}) {
    dirs.push_back(temp_path("ckpt-" + std::to_string(stage)));
    on4.push_back({stage, "alltoall", {"--save_at", "5", "--save_dir", dirs.back()}});
    on4.push_back({stage, "alltoall", {"--resume", dirs.back()}});
    on2.push_back({stage, "alltoall", {"--resume", dirs.back()}});
    on3.push_back({stage, "alltoall", {"--resume", dirs.back()}});
  }
  const auto p4 = train_all(4, on4), p2 = train_all(2, on2), p3 = train_all(3, on3);
  for (int i = 0; i < 3; ++i) {
    const auto& full = p4[2 * i];
    const int stage = i + 1;
    EXPECT_EQ(max_rel_diff(p4[2 * i + 1], full), 0.0) << "stage " << stage << ", resumed on 4";
    EXPECT_LE(max_rel_diff(p2[i], full), 1e-5) << "stage " << stage << ", resumed on 2";
    EXPECT_LE(max_rel_diff(p3[i], full), 1e-5) << "stage " << stage << ", resumed on 3";
    std::system(("rm -rf " + dirs[i]).c_str());
  }
}

// Note [Hybrid sharding] on one machine (dp_replicate 2 x dp_shard 2): stage 2 and 3 equal data
// parallel; a hybrid checkpoint (the first replica's shards) resumes on the same layout bit for
// bit and on 2 ranks without replicas.
TEST(Zero, HybridShardingEqualsDataParallelAndItsCheckpointResumes) {
  const std::vector<std::string> hybrid{"--dp_replicate_size", "2"};
  std::vector<TrainRun> on4{{-1}}, on2;
  std::vector<std::string> dirs;
  for (int stage : {2, 3}) {
    dirs.push_back(temp_path("hybrid-ckpt-" + std::to_string(stage)));
    on4.push_back({stage, "alltoall", {"--save_at", "5", "--save_dir", dirs.back()}, "no", hybrid});
    on4.push_back({stage, "alltoall", {"--resume", dirs.back()}, "no", hybrid});
    on2.push_back({stage, "alltoall", {"--resume", dirs.back()}});
  }
  const auto p4 = train_all(4, on4), p2 = train_all(2, on2);
  const auto& ddp = p4[0];
  for (int i = 0; i < 2; ++i) {
    const int stage = i + 2;
    const auto& full = p4[1 + 2 * i];
    EXPECT_LE(max_rel_diff(full, ddp), 1e-6) << "stage " << stage;
    int shards = 0;
    for (int r = 0; r < 4; ++r)
      shards += std::ifstream(dirs[i] + "/optimizer.rank" + std::to_string(r) + ".json").good();
    EXPECT_EQ(shards, 2) << "one replica's shards";
    EXPECT_EQ(max_rel_diff(p4[2 + 2 * i], full), 0.0) << "stage " << stage << " resumed hybrid";
    EXPECT_LE(max_rel_diff(p2[i], full), 1e-5) << "stage " << stage << " resumed on 2 ranks";
    std::system(("rm -rf " + dirs[i]).c_str());
  }
}

// Note [Optimizer state on disk]: with the optimizer state in files (offload_optimizer_device
// nvme), every stage trains bit for bit as with it in memory (three parameter groups, a unit
// no loss uses, accumulation and clipping); a checkpoint saved from the files resumes bit for
// bit; and the files are gone when the run ends (each run keeps them in a folder of its own).
TEST(Zero, OptimizerStateOnDiskTrainsBitwiseAsInMemory) {
  const auto dir = temp_path("nvme");
  auto nvme = [&](const std::string& sub) {
    std::filesystem::create_directories(dir + "/" + sub);
    return std::vector<std::string>{"--offload_optimizer_device", "nvme",
                                    "--offload_optimizer_nvme_path", dir + "/" + sub};
  };
  std::vector<TrainRun> runs;
  for (int stage : {1, 2, 3}) {
    runs.push_back({stage});
    runs.push_back({stage, "alltoall", {}, "no", nvme(std::to_string(stage))});
  }
  const auto ckpt = temp_path("nvme-ckpt");
  runs.push_back({3, "alltoall", {"--save_at", "5", "--save_dir", ckpt}, "no", nvme("save")});
  runs.push_back({3, "alltoall", {"--resume", ckpt}, "no", nvme("resume")});
  runs.push_back({3, "alltoall", {"--resume", ckpt}});
  const auto p = train_all(2, runs);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(max_rel_diff(p[2 * i + 1], p[2 * i]), 0.0) << "stage " << i + 1;
  for (const auto& sub : std::filesystem::directory_iterator(dir))
    EXPECT_TRUE(std::filesystem::is_empty(sub.path()))
        << "the state files of run " << sub.path().filename() << " outlived it";
  EXPECT_EQ(max_rel_diff(p[7], p[6]), 0.0);
  EXPECT_EQ(max_rel_diff(p[8], p[6]), 0.0) << "resumed with the state in memory";
  std::filesystem::remove_all(ckpt);
  std::filesystem::remove_all(dir);
}

// A ZeRO-2 checkpoint's model, merged into one file by `tandem merge-weights`, loads into the
// dense model and holds data parallel's trained weights, bit for bit.
TEST(Zero, MergedWeightsLoadIntoTheDenseModel) {
  const auto dir = temp_path("merge-ckpt"), out = temp_path("merged");
  const std::vector<std::string> exact{"--clip", "0", "--one_group"};
  auto args = exact;
  args.insert(args.end(), {"--save_at", "10", "--save_dir", dir});
  const auto p = train_all(4, {{2, "allreduce", args}, {-1, "alltoall", exact}});
  const auto& zero = p[0];
  const auto& ddp = p[1];
  auto m = run_command({kCli, "merge-weights", dir, out}, {}, 60);
  ASSERT_EQ(m.exit_code, 0) << m.output;
  EXPECT_NE(m.output.find("merged "), std::string::npos) << m.output;
  const auto loaded_path = temp_path("loaded.bin");
  auto r =
      launch(1, kWorker, {"load", "--resume", out + "/model.safetensors", "--out", loaded_path},
             zero_flags(-1));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto loaded = read_floats(loaded_path);
  EXPECT_EQ(max_rel_diff(loaded, zero), 0.0);
  EXPECT_EQ(max_rel_diff(loaded, ddp), 0.0);
  auto bad = run_command({kCli, "merge-weights", out + "/nothing", out + "2"}, {}, 60);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("does not exist"), std::string::npos) << bad.output;
  std::system(("rm -rf " + dir + " " + out + " " + loaded_path).c_str());
}

// Note [Sharded construction]: the example GPT built by acc.build under ZeRO-3 on 2 ranks has
// the weights of the dense construction with the same seed, after prepare and after 3 AdamW
// steps, bit for bit; so does the sharding tests' model of Sharded wrappers, a tied weight and
// three parameter groups (whose built units prepare must gather to cut its own). No rank holds
// the dense model: each rank's resident memory grows by at most 0.8x the dense weights over
// construction and prepare (its half, and one block and its broadcast at a time; 0.74x
// measured), and by at most 0.6x what the dense construction's grows (which holds all of them
// and its broadcast chunks: 1.67x the weights measured). A saved model loads into the built one (each rank reading its byte
// ranges, Note [Loading into shards]) and holds the saved weights.
TEST(Zero, ShardedConstructionEqualsTheDenseModelAndNeverHoldsIt) {
  // The model's size matters to the resident-memory checks, which need the host allocator;
  // under AddressSanitizer (no resident checks) 4 blocks show the rest as well as 16.
  const std::string layers = kAsan ? "4" : "16";
  const size_t min_params = kAsan ? 1500000u : 6000000u;
  auto flags = zero_flags(3);
  auto env = flags.env();
  env["TANDEM_HOST_CACHE_MB"] = "0";  // freed blocks go back to the system at once
  flags.env(env);
  // Resident memory as a rank started by itself has it: a forked rank (Note [Fork start]) faults
  // in again, inside the measured span, library pages the fork server touched while loading
  // (about 2 MB more growth on LibTorch 2.12).
  flags.start_method("exec");
  auto run = [&](bool built, std::vector<std::string> extra, const std::string& tag) {
    const auto out = temp_path("build-" + tag + ".bin");
    std::vector<std::string> args{"build", "--out", out, "--layers", layers};
    if (built) args.push_back("--built");
    args.insert(args.end(), extra.begin(), extra.end());
    auto r = launch(2, kWorker, args, flags);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    auto v = read_floats(out);
    std::remove(out.c_str());
    return std::make_pair(v, r.output);
  };
  auto value = [](const std::string& output, int rank, const std::string& key) -> int64_t {
    const auto line = output.find("build rank=" + std::to_string(rank) + " ");
    if (line == std::string::npos) return int64_t{-1};
    const auto at = output.find(" " + key + "=", line);
    return at == std::string::npos ? int64_t{-1} : std::stoll(output.substr(at + key.size() + 2));
  };
  const auto save_dir = temp_path("build-saved");
  const auto [dense, dense_out] = run(false, {"--save_dir", save_dir}, "dense");
  const auto [built, built_out] = run(true, {}, "built");
  ASSERT_GT(dense.size(), 2u * min_params);
  EXPECT_EQ(max_rel_diff(built, dense), 0.0) << "built and dense GPT, after prepare and after 3 steps";
  for (int rank = 0; rank < 2; ++rank) {
    const int64_t dense_kb = value(dense_out, rank, "dense_bytes") / 1024;
    ASSERT_GT(dense_kb, static_cast<int64_t>(min_params * 4 / 1024)) << dense_out;
    // AddressSanitizer keeps freed memory (its quarantine) and its shadow resident.
    if (kAsan || value(built_out, rank, "host_allocator") != 1) continue;
    EXPECT_GE(value(dense_out, rank, "rss_growth_kb"), dense_kb * 95 / 100) << dense_out;
    EXPECT_LE(value(built_out, rank, "rss_growth_kb"), dense_kb * 4 / 5) << built_out;
    EXPECT_LE(value(built_out, rank, "rss_growth_kb"), value(dense_out, rank, "rss_growth_kb") * 3 / 5)
        << built_out;
    std::cout << "rank " << rank << ": resident growth " << value(dense_out, rank, "rss_growth_kb")
              << " kB dense, " << value(built_out, rank, "rss_growth_kb") << " kB built; dense weights "
              << dense_kb << " kB" << std::endl;
  }
  // The dense run's trained weights, loaded into a built model, are its first dump.
  const auto [loaded, loaded_out] =
      run(true, {"--resume", save_dir + "/model.safetensors"}, "loaded");
  ASSERT_EQ(loaded.size(), dense.size());
  const std::vector<float> trained(dense.begin() + static_cast<long>(dense.size() / 2), dense.end());
  const std::vector<float> first(loaded.begin(), loaded.begin() + static_cast<long>(loaded.size() / 2));
  EXPECT_EQ(max_rel_diff(first, trained), 0.0) << loaded_out;
  std::system(("rm -rf " + save_dir).c_str());
  const std::vector<std::string> exact{"--clip", "0"};
  auto with_built = exact;
  with_built.push_back("--built");
  const auto p = train_all(2, {{3, "alltoall", with_built}, {3, "alltoall", exact}});
  EXPECT_EQ(max_rel_diff(p[0], p[1]), 0.0);
}

// Note [Prefetching units]: ZeRO-3 (--use_fsdp) on 2 ranks with the forward prefetch and either
// backward prefetch, and with gathered units kept from forward to backward
// (--fsdp_reshard_after_forward false), trains to the same parameters as without, bit for bit
// (only when the all-gathers run changes); the timelines show all-gathers issued ahead of their
// use, and issued while a forward or backward computed.
TEST(Zero, PrefetchedUnitsTrainTheSameAndRunUnderCompute) {
  // The three runs as jobs of one launch (tandem::testing::launch_jobs).
  std::vector<tandem::testing::Job> jobs;
  std::vector<std::string> outs, dirs;
  auto fsdp = [&](std::vector<std::string> extra, const std::string& tag, bool timeline) {
    outs.push_back(temp_path("prefetch-" + tag + ".bin"));
    dirs.push_back(temp_path("prefetch-tl-" + tag));
    std::vector<std::string> flags{"--use_fsdp"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    std::vector<std::string> args{"train", "--out", outs.back(), "--clip", "0"};
    if (timeline) args.insert(args.end(), {"--timeline_dir", dirs.back()});
    jobs.push_back({args, LaunchOptions().flags(flags).timeout_s(240)});
  };
  fsdp({}, "plain", true);
  fsdp({"--fsdp_forward_prefetch", "true", "--fsdp_backward_prefetch", "BACKWARD_PRE"}, "pre", true);
  fsdp({"--fsdp_backward_prefetch", "BACKWARD_POST", "--fsdp_reshard_after_forward", "false"},
       "post", false);
  const auto runs = tandem::testing::launch_jobs(2, kWorker, jobs);
  std::vector<std::vector<float>> params;
  for (size_t i = 0; i < runs.size(); ++i) {
    EXPECT_EQ(runs[i].exit_code, 0) << runs[i].output;
    EXPECT_EQ(count_of(runs[i].output, "strategy zero-3 trained to step 10"), 2) << runs[i].output;
    params.push_back(read_floats(outs[i]));
    std::remove(outs[i].c_str());
    std::system(("rm -rf " + dirs[i]).c_str());
  }
  auto stat = [](const std::string& output, int rank, const std::string& key) -> int64_t {
    const auto line = output.find("gathers rank=" + std::to_string(rank) + " ");
    if (line == std::string::npos) return -1;
    const auto at = output.find(" " + key + "=", line);
    return at == std::string::npos ? -1 : std::stoll(output.substr(at + key.size() + 2));
  };
  const auto &plain = params[0], &pre = params[1], &post = params[2];
  const auto &plain_out = runs[0].output, &pre_out = runs[1].output, &post_out = runs[2].output;
  ASSERT_GT(plain.size(), 200u);
  EXPECT_EQ(max_rel_diff(pre, plain), 0.0) << pre_out;
  EXPECT_EQ(max_rel_diff(post, plain), 0.0) << post_out;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_GT(stat(plain_out, rank, "all"), 0) << plain_out;
    EXPECT_EQ(stat(plain_out, rank, "prefetched"), 0) << plain_out;
    // 20 micro-steps of units a, b (run twice), c: forward prefetches b and c from the second
    // on, backward b and a from the first.
    EXPECT_GE(stat(pre_out, rank, "prefetched"), 19 * 2 + 20 * 2) << pre_out;
    EXPECT_GE(stat(pre_out, rank, "overlapped"), 1) << pre_out;
  }
  std::cout << plain_out.substr(plain_out.find("gathers rank=")) << pre_out.substr(pre_out.find("gathers rank="));
}

namespace {

struct MemoryLine {
  int64_t peak = 0, formula = 0, activations = 0;
  int64_t rss_peak_kb = 0, rss_baseline_kb = 0, host_cache = -1;  // -1: no host allocator
  int64_t lib_pages_kb = 0;
  // Peak resident bytes above the baseline, the libraries' pages first run after it left out.
  int64_t resident() const { return (rss_peak_kb - rss_baseline_kb - lib_pages_kb) * 1024; }
};

// Whether a run's resident memory holds to the formulas: with the host allocator, and not under
// AddressSanitizer, whose quarantine keeps freed malloc blocks resident (and whose runs are jobs
// of one launch, memory_runs).
bool resident_checked(const MemoryLine& m) {
  return !kAsan && m.host_cache >= 0;
}

// "memory rank=0 strategy=zero-2 world=4 N=... peak_bytes=... formula_bytes=... ..." per rank.
std::vector<MemoryLine> memory_lines(const std::string& out) {
  std::vector<MemoryLine> v;
  auto value = [](const std::string& line, const std::string& key) {
    auto at = line.find(" " + key + "=");
    return at == std::string::npos ? -1 : std::stoll(line.substr(at + key.size() + 2));
  };
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line))
    if (line.find("memory rank=") != std::string::npos)
      v.push_back({value(line, "peak_bytes"), value(line, "formula_bytes"),
                   value(line, "activation_bytes"), value(line, "rss_peak_kb"),
                   value(line, "rss_baseline_kb"), value(line, "host_cache_bytes"),
                   value(line, "lib_pages_kb")});
  return v;
}

// The memory worker under each of `options` on n ranks: each in processes of its own where
// resident memory is checked (a process's peak is its whole life's), as jobs of one launch under
// AddressSanitizer, where only tensor bytes are (the worker counts them from its second step).
std::vector<tandem::testing::RunResult> memory_runs(int n, const std::vector<LaunchOptions>& options) {
  if (kAsan) {
    std::vector<tandem::testing::Job> jobs;
    for (const auto& o : options) jobs.push_back({{"memory"}, o});
    return tandem::testing::launch_jobs(n, kWorker, jobs);
  }
  std::vector<tandem::testing::RunResult> out;
  // Ranks started by exec, as in ShardedConstructionEqualsTheDenseModelAndNeverHoldsIt.
  for (const auto& o : options)
    out.push_back(launch(n, kWorker, {"memory"}, LaunchOptions(o).start_method("exec")));
  return out;
}

}  // namespace

// Peak CPU tensor bytes per rank (a counting allocator installed before the model is built) of
// a 25.2M-parameter model with AdamW on 4 ranks: each strategy within 10% of its formula plus
// the activations, data parallel > ZeRO-1 > ZeRO-2 > ZeRO-3, and ZeRO-3 <= 0.4x data parallel.
// Note [Resident memory and large blocks]: what the operating system sees, too: each rank's peak
// resident memory over the whole run (VmHWM: the dense model's construction and prepare
// included) above its baseline (VmRSS before any tensor, plus the libraries' pages first run
// later) is within 10% of the formula plus the activations: the host allocator's cache never
// raises the peak. Not under AddressSanitizer, whose quarantine keeps freed memory resident on
// purpose.
TEST(Zero, PeakMemoryPerRankFollowsTheFormulas) {
  std::map<int, int64_t> worst, worst_rss;
  const std::vector<int> stages{-1, 1, 2, 3};
  std::vector<LaunchOptions> options;
  for (int stage : stages) options.push_back(zero_flags(stage));
  const auto runs = memory_runs(4, options);
  for (size_t i = 0; i < stages.size(); ++i) {
    const int stage = stages[i];
    const auto& r = runs[i];
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto lines = memory_lines(r.output);
    ASSERT_EQ(lines.size(), 4u) << r.output;
    for (const auto& m : lines) {
      EXPECT_LE(std::llabs(m.peak - m.formula), m.formula / 10 + m.activations)
          << "stage " << stage << "\n" << r.output;
      worst[stage] = std::max(worst[stage], m.peak);
      if (!resident_checked(m)) continue;
      ASSERT_GT(m.rss_peak_kb, 0) << r.output;
      ASSERT_GT(m.rss_baseline_kb, 0) << r.output;
      ASSERT_GE(m.lib_pages_kb, 0) << r.output;
      const int64_t resident = m.resident();
      EXPECT_LE(resident, m.formula + m.formula / 10 + m.activations)
          << "stage " << stage << ": resident " << resident << " bytes above the baseline\n"
          << r.output;
      std::cout << "stage " << stage << " resident above the baseline: " << resident / 1e6
                << " MB (" << (m.rss_peak_kb - m.rss_baseline_kb) * 1024 / 1e6 << " MB with "
                << m.lib_pages_kb * 1024 / 1e6 << " MB of library pages), formula + activations "
                << (m.formula + m.activations) / 1e6 << " MB" << std::endl;
      EXPECT_GE(resident, m.formula * 85 / 100) << "stage " << stage << "\n" << r.output;
      worst_rss[stage] = std::max(worst_rss[stage], resident);
    }
    std::cout << r.output;
  }
  EXPECT_GT(worst[-1], worst[1]);
  EXPECT_GT(worst[1], worst[2]);
  EXPECT_GT(worst[2], worst[3]);
  EXPECT_LE(worst[3], 0.4 * static_cast<double>(worst[-1]));
  if (!worst_rss.empty()) {
    EXPECT_GT(worst_rss[-1], worst_rss[1]);
    EXPECT_LT(worst_rss[2], 0.9 * static_cast<double>(worst_rss[1]));
    EXPECT_GT(worst_rss[1], worst_rss[3]);
    EXPECT_LE(worst_rss[3], 0.4 * static_cast<double>(worst_rss[-1]));
  } else {
    std::cout << "resident memory not held to the formulas: AddressSanitizer keeps freed "
                 "memory resident"
              << std::endl;
  }
}

// Six Linear(2000, 2000) (24M parameters, 16 MB weights) in 25 MB buckets, which close at 32 MB:
// buckets as large as a third of the gradients. ZeRO-2 keeps the bucket in flight and its
// receive buffer, not a third one filling beside them (Note [Two buckets at a time]): its
// tensors and resident memory stay within 10% of 4N + 12N/W + 2B (before: 329 MB above the
// baseline, 1.3x). ZeRO-3 on units as large: within 10% of 16N/W + 16U, tensors and resident
// memory (before: 216 MB resident, 16N/W + 32U), and below ZeRO-2.
TEST(Zero, StageTwoHoldsTwoBucketsWhenBucketsAreLarge) {
  std::map<int, int64_t> rss;
  const std::vector<int> stages{1, 2, 3};
  std::vector<LaunchOptions> all;
  for (int stage : stages) {
    auto options = zero_flags(stage);
    options.env({{"TANDEM_REDUCE_SCATTER", "alltoall"},
                 {"ZW_WIDTH", "2000"},
                 {"ZW_LAYERS", "6"},
                 {"ZW_BUCKET_MB", "25"}});
    all.push_back(options);
  }
  const auto runs = memory_runs(4, all);
  for (size_t i = 0; i < stages.size(); ++i) {
    const int stage = stages[i];
    const auto& r = runs[i];
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto lines = memory_lines(r.output);
    ASSERT_EQ(lines.size(), 4u) << r.output;
    for (const auto& m : lines) {
      EXPECT_LE(std::llabs(m.peak - m.formula), m.formula / 10 + m.activations)
          << "stage " << stage << "\n" << r.output;
      if (resident_checked(m)) {
        rss[stage] = std::max(rss[stage], (m.rss_peak_kb - m.rss_baseline_kb) * 1024);
        // Resident memory holds to the formula too. ZeRO-3's units are as large as a sixth of
        // the model here: two in use (16U: the one computing, its weights and gradient; the one
        // in flight, its bucket and receive buffer) are most of its peak.
        EXPECT_LE(m.resident(), m.formula + m.formula / 10 + m.activations)
            << "stage " << stage << "\n" << r.output;
      }
    }
  }
  // (ZeRO-2 against ZeRO-1: with buckets this large, ZeRO-2's bucket in flight and receive
  // buffer take back what sharding the gradients saves, and ZeRO-1's all-gather writes into its
  // buckets in place, so the two hold about the same; PeakMemoryPerRankFollowsTheFormulas holds
  // ZeRO-2 below 0.9x ZeRO-1 with the default buckets.)
  if (!rss.empty()) {
    EXPECT_LT(rss[3], rss[2]);
  }
}
