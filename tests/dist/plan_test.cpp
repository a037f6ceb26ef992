// `tandem plan` on the example GPT with real runs: every layout that fits on 2 processes is run
// (a GPT of 3.2M parameters, whose model states outweigh the program's own fixed allocations)
// and its measured peaks (the counting allocator's, and resident memory outside
// AddressSanitizer, whose shadow and quarantine the probe cannot see apart) are within 10% of
// the prediction; the winner's config file drives `tandem launch`; a memory budget drops the
// layouts over it; bad requests are refused by name.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "../common/sanitizers.h"
#include "../common/subprocess.h"
#include "../common/temp_dir.h"
#include "tandem/config/config.h"

using tandem::testing::run_command;
using tandem::testing::TempDir;

namespace {

using tandem::testing::kAsan;

std::vector<std::string> gpt_args() {
  return {TRAIN_GPT,
          "--layers",
          "4",
          "--width",
          "256",
          "--heads",
          "4",
          "--context",
          "32",
          "--batch-size",
          "{batch_size}",
          "--microbatches",
          "{microbatches}",
          "--steps",
          "{steps}",
          "--eval-every",
          "0"};
}

std::vector<std::string> plan_command(const std::string& dir, std::vector<std::string> extra) {
  std::vector<std::string> a{TANDEM_CLI,
                             "plan",
                             "--layers",
                             "4",
                             "--hidden",
                             "256",
                             "--heads",
                             "4",
                             "--vocab",
                             "256",
                             "--seq_len",
                             "32",
                             "--num_processes",
                             "2",
                             "--global_batch_size",
                             "4",
                             "--max_micro_batch",
                             "2",
                             "--no_activation_checkpointing",
                             "--work_dir",
                             dir + "/runs",
                             "--output",
                             dir + "/plan.yaml"};
  a.insert(a.end(), extra.begin(), extra.end());
  a.push_back("--");
  for (const auto& x : gpt_args()) a.push_back(x);
  return a;
}

}  // namespace

TEST(Plan, PredictedPeaksMatchTheRunsAndTheWinnersConfigLaunches) {
  TempDir dir;
  auto r = run_command(plan_command(dir.str(), {"--measure_all", "--timed_steps", "2",
                                               "--pp_virtual_stages", "1,2"}),
                       {}, 900);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  nlohmann::json j;
  std::ifstream(dir.str() + "/runs/plan.json") >> j;
  ASSERT_TRUE(j["probe"]["measured"].get<bool>());
  EXPECT_GT(j["probe"]["activations_per_sample"].get<double>(), 0);
  int measured = 0;
  std::set<std::string> kinds;
  for (const auto& l : j["layouts"]) {
    if (!l.contains("measured")) continue;
    const auto& m = l["measured"];
    ASSERT_TRUE(m["ok"].get<bool>()) << l["name"] << ": " << m["error"];
    ++measured;
    kinds.insert(std::to_string(l["zero_stage"].get<int>()) + "/" +
                 std::to_string(l["tp"].get<int>()) + "/" + std::to_string(l["pp"].get<int>()) +
                 (l["virtual_stages"].get<int>() > 1 ? " v" + std::to_string(l["virtual_stages"].get<int>()) : ""));
    const double pt = l["predicted"]["tensor_peak"], mt = m["tensor_peak"];
    EXPECT_NEAR(pt / mt, 1.0, 0.10)
        << l["name"] << ": tensors predicted " << pt << ", measured " << mt;
    if (!kAsan) {
      const double pr = l["predicted"]["rss_peak"], mr = m["rss_peak"];
      EXPECT_NEAR(pr / mr, 1.0, 0.10)
          << l["name"] << ": resident predicted " << pr << ", measured " << mr;
    }
    // The parameters on the rank (the rank with the largest resident peak: under a pipeline,
    // which stage that is may differ from the stage predicted to hold the most).
    if (l["pp"].get<int>() == 1) {
      EXPECT_EQ(l["predicted"]["parameters"], m["parameters"]) << l["name"];
    }
  }
  // dp 2 under every ZeRO stage, tp 2, pp 2 and pp 2 interleaved (2 stages per rank): every
  // kind of layout was run (the interleaved ones measured 1-5% above their predictions here).
  EXPECT_EQ(kinds, (std::set<std::string>{"0/1/1", "1/1/1", "2/1/1", "3/1/1", "0/2/1", "0/1/2",
                                          "0/1/2 v2"}));
  EXPECT_GE(measured, 10);
  EXPECT_NE(r.output.find("best: "), std::string::npos) << r.output;

  // The winner's config file is one the launcher reads, and it trains the program.
  const auto cfg = tandem::config::load_config_file(dir.str() + "/plan.yaml");
  EXPECT_EQ(cfg.num_processes, 2);
  std::vector<std::string> launch{TANDEM_CLI, "launch", "--config_file", dir.str() + "/plan.yaml"};
  std::ifstream yaml(dir.str() + "/plan.yaml");
  std::string text((std::istreambuf_iterator<char>(yaml)), {});
  const auto at = text.find("--batch-size ");
  ASSERT_NE(at, std::string::npos) << text;
  const std::string batch = text.substr(at + 13, text.find(' ', at + 13) - at - 13);
  const auto mat = text.find("--microbatches ");
  const std::string micro = text.substr(mat + 15, text.find(' ', mat + 15) - mat - 15);
  for (auto a : gpt_args()) {
    if (a == "{batch_size}") a = batch;
    if (a == "{microbatches}") a = micro;
    if (a == "{steps}") a = "3";
    launch.push_back(a);
  }
  auto t = run_command(launch, {}, 300);
  EXPECT_EQ(t.exit_code, 0) << t.output;
  EXPECT_NE(t.output.find("2 processes"), std::string::npos) << t.output;
}

TEST(Plan, ABudgetDropsTheLayoutsOverItAndPredictsWithoutAProgram) {
  TempDir dir;
  // Without a program: predicted only, from the GPT formula; a budget below every layout.
  auto r = run_command({TANDEM_CLI, "plan", "--layers", "24", "--hidden", "2048", "--heads", "16",
                        "--vocab", "50257", "--seq_len", "1024", "--num_processes", "4",
                        "--memory_per_process", "2GB", "--output", dir.str() + "/none.yaml"},
                       {}, 120);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("no layout fits 2.0 GB per process"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir.str() + "/none.yaml"));
  // A budget that ZeRO-3 meets and data parallel does not: the winner shards.
  r = run_command({TANDEM_CLI,
                   "plan",
                   "--layers",
                   "24",
                   "--hidden",
                   "2048",
                   "--heads",
                   "16",
                   "--vocab",
                   "50257",
                   "--seq_len",
                   "256",
                   "--num_processes",
                   "4",
                   "--global_batch_size",
                   "4",
                   "--memory_per_process",
                   "12GB",
                   "--output",
                   dir.str() + "/big.yaml"},
                  {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("predicted only"), std::string::npos) << r.output;
  const auto cfg = tandem::config::load_config_file(dir.str() + "/big.yaml");
  EXPECT_TRUE(cfg.distributed_type == "DEEPSPEED" || cfg.parallelism_config.count("pp_size") ||
              cfg.parallelism_config.count("parallelism_config_tp_size"))
      << r.output;
}

// `tandem plan --ep_size` over a mixture's checkpoint (Note [Expert parallel]): the experts found
// by their names, the ep layouts listed beside the others with their launch flags, and the ep
// sizes the rules leave out named with the rule. The file is written byte by byte here (a
// safetensors header and zeros), as any tool writes one.
TEST(Plan, SearchesExpertParallelOverAMixturesCheckpoint) {
  TempDir dir;
  nlohmann::json header;
  int64_t offset = 0;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 4;
    for (auto d : shape) n *= d;
    header[name] = {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  };
  add("model.embed_tokens.weight", {64, 16});
  add("model.norm.weight", {16});
  add("lm_head.weight", {64, 16});
  for (int layer = 0; layer < 2; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer);
    add(p + ".self_attn.q_proj.weight", {16, 16});
    add(p + ".mlp.gate.weight", {4, 16});
    for (int e = 0; e < 4; ++e)
      add(p + ".mlp.experts." + std::to_string(e) + ".up_proj.weight", {32, 16});
  }
  const std::string text = header.dump();
  {
    std::ofstream out(dir.str() + "/model.safetensors", std::ios::binary);
    const uint64_t size = text.size();
    out.write(reinterpret_cast<const char*>(&size), 8);
    out << text << std::string(static_cast<size_t>(offset), '\0');
  }
  std::ofstream(dir.str() + "/config.json")
      << R"({"num_attention_heads": 4, "max_position_embeddings": 32, "num_experts": 4})";
  // ep 2 and 3 only: every layout listed splits the experts over 2 ranks, and the winner's
  // launch flags say so.
  auto r = run_command({TANDEM_CLI, "plan", dir.str(), "--num_processes", "4",
                        "--global_batch_size", "8", "--ep_size", "2,3", "--output",
                        dir.str() + "/plan.yaml"},
                       {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("dp4 ep2 "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("launch flags: --num_processes 4 --cpu"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--ep_size 2"), std::string::npos) << r.output;
  const auto cfg = tandem::config::load_config_file(dir.str() + "/plan.yaml");
  EXPECT_EQ(cfg.parallelism_config.at("parallelism_config_ep_size"), "2");
  EXPECT_NE(r.output.find("ep must divide the 4 experts of a layer: tp1 pp1 dp4 ep3"),
            std::string::npos) << r.output;
  // Note [Expert parallel beside a pipeline]: ep within each stage's data-parallel ranks: the
  // shape pp 2 x dp 2 x ep 2 is searched (only its ZeRO forms are left out, by the pipeline's
  // rule), and no rule leaves ep out beside a pipeline.
  EXPECT_NE(r.output.find("ZeRO stages do not combine with a pipeline in tandem: tp1 pp2 dp2 ep2"),
            std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("expert parallel does not combine with a pipeline"), std::string::npos)
      << r.output;
  // A dense model: every ep layout out, and why.
  r = run_command({TANDEM_CLI, "plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab",
                   "256", "--seq_len", "32", "--num_processes", "2", "--ep_size", "1,2"},
                  {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find(" ep2 "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("expert parallel needs a mixture of experts"), std::string::npos)
      << r.output;
}

TEST(Plan, RefusesWhatCannotTakeEffect) {
  TempDir dir;
  // A program whose arguments do not take the layout's batch.
  auto r = run_command(
      {TANDEM_CLI, "plan", "--layers", "2", "--hidden", "128", "--heads", "4", "--vocab", "256",
       "--seq_len", "32", "--num_processes", "2", "--", TRAIN_GPT, "--steps", "2"},
      {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("{batch_size}"), std::string::npos) << r.output;
  // No model.
  r = run_command({TANDEM_CLI, "plan", "--num_processes", "2"}, {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("give the model one way"), std::string::npos) << r.output;
  // Heads that no tp divides and a batch no dp divides: no layout, with the rules named.
  r = run_command({TANDEM_CLI, "plan", "--layers", "2", "--hidden", "129", "--heads", "3",
                   "--vocab", "257", "--seq_len", "32", "--num_processes", "2",
                   "--global_batch_size", "1", "--memory_per_process", "1GB"},
                  {}, 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("the global batch 1 must divide among dp ranks"), std::string::npos)
      << r.output;
  // A probe that fails says which run and where its log is.
  r = run_command({TANDEM_CLI,
                   "plan",
                   "--layers",
                   "2",
                   "--hidden",
                   "128",
                   "--heads",
                   "4",
                   "--vocab",
                   "256",
                   "--seq_len",
                   "32",
                   "--num_processes",
                   "2",
                   "--work_dir",
                   dir.str() + "/bad",
                   "--",
                   TRAIN_GPT,
                   "--batch-size",
                   "{batch_size}",
                   "--no-such-flag"},
                  {}, 120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("probe run probe_mb1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("probe_mb1.log"), std::string::npos) << r.output;
}

TEST(Plan, RefusesRunFlagsThatWouldNotAct) {
  // Run settings without a program to run, {steps} counts without {steps}, and both ways of
  // choosing what runs.
  const std::vector<std::string> shape{TANDEM_CLI,  "plan", "--layers", "2", "--hidden", "128",
                                       "--heads",   "4",    "--vocab",  "256",
                                       "--seq_len", "32",   "--num_processes", "2"};
  auto with = [&](std::vector<std::string> extra) {
    auto a = shape;
    a.insert(a.end(), extra.begin(), extra.end());
    return run_command(a, {}, 60);
  };
  auto r = with({"--measure_all"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("--measure_all acts on runs of the program"), std::string::npos)
      << r.output;
  r = with({"--timed_steps", "4", "--", TRAIN_GPT, "--batch-size", "{batch_size}"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("--timed_steps sets {steps}"), std::string::npos) << r.output;
  r = with({"--measure_all", "--candidates", "2", "--", TRAIN_GPT, "--batch-size",
            "{batch_size}"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("drop --candidates or --measure_all"), std::string::npos) << r.output;
}
