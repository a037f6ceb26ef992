// `tandem estimate-memory` end to end: the binary's JSON and text output and its exit codes.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "../common/subprocess.h"
#include "../common/temp_dir.h"

using tandem::testing::run_command;

TEST(EstimateMemoryCli, ZeroPaperNumbersAsJson) {
  auto r = run_command({TANDEM_CLI, "estimate-memory", "--params", "7.5B", "--num_processes", "64",
                        "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["parameters"], 7'500'000'000);
  ASSERT_EQ(j["zero"].size(), 4u);
  std::vector<double> gb;
  for (const auto& z : j["zero"]) gb.push_back(z["gb_per_device"].get<double>());
  EXPECT_DOUBLE_EQ(gb[0], 120.0);
  EXPECT_NEAR(gb[1], 31.4, 0.05);
  EXPECT_NEAR(gb[2], 16.6, 0.05);
  EXPECT_NEAR(gb[3], 1.9, 0.05);
  EXPECT_EQ(j["dtypes"].size(), 4u);
  EXPECT_FALSE(j["caveats"].empty());
}

TEST(EstimateMemoryCli, GptShapeAsTable) {
  auto r = run_command({TANDEM_CLI, "estimate-memory", "--layers", "4", "--hidden", "128",
                        "--vocab", "256", "--context", "128", "--num-processes", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("842,496 parameters"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("float16/bfloat16"), std::string::npos);
  EXPECT_NE(r.output.find("ZeRO-3"), std::string::npos);
  EXPECT_NE(r.output.find("Not included"), std::string::npos);
}

TEST(EstimateMemoryCli, BadInputExitsWithTwo) {
  auto none = run_command({TANDEM_CLI, "estimate-memory"});
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_NE(none.output.find("expected exactly one model description"), std::string::npos)
      << none.output;
  auto both = run_command({TANDEM_CLI, "estimate-memory", "--params", "1B", "--layers", "2"});
  EXPECT_EQ(both.exit_code, 2);
  auto bad = run_command({TANDEM_CLI, "estimate-memory", "--params", "lots"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.output.find("'lots'"), std::string::npos) << bad.output;
  auto missing = run_command({TANDEM_CLI, "estimate-memory", "/nonexistent/model.safetensors"});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_NE(missing.output.find("does not exist"), std::string::npos) << missing.output;
}

// Plain messages for bad numbers: --num_processes below 1, and a GPT shape whose parameter count
// does not fit in 64 bits (it used to wrap around into a wrong, positive count).
TEST(EstimateMemoryCli, BadNumbersGetPlainMessages) {
  for (const char* n : {"0", "-3"}) {
    auto r = run_command({TANDEM_CLI, "estimate-memory", "--params", "1B", "--num_processes", n});
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(std::string("tandem estimate-memory: --num_processes must be at least "
                                        "1, got ") +
                            n),
              std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("not in range"), std::string::npos) << r.output;
  }
  struct Case {
    std::vector<std::string> shape;
    std::string flags;
  };
  for (const auto& c : std::vector<Case>{
           {{"--layers", "100000000000", "--hidden", "1000000", "--vocab", "10", "--context", "10"},
            "--layers with --hidden"},
           {{"--layers", "2", "--hidden", "4000000000", "--vocab", "10", "--context", "10"},
            "--hidden"},
           {{"--layers", "1", "--hidden", "1000", "--vocab", "9000000000000000000", "--context",
             "10"},
            "--vocab with --hidden"},
           {{"--layers", "1", "--hidden", "1000", "--vocab", "10", "--context",
             "90000000000000000"},
            "--context with --hidden"}}) {
    std::vector<std::string> argv = {TANDEM_CLI, "estimate-memory"};
    argv.insert(argv.end(), c.shape.begin(), c.shape.end());
    auto r = run_command(argv);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("tandem estimate-memory: " + c.flags + ": the parameter count"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("overflows a 64-bit integer"), std::string::npos) << r.output;
  }
  // The CLI's prefix, once.
  auto r = run_command({TANDEM_CLI, "estimate-memory", "--params", "lots"});
  EXPECT_EQ(r.output.find("estimate-memory: estimate-memory"), std::string::npos) << r.output;
  r = run_command({TANDEM_CLI, "estimate-memory", "/nonexistent/model.safetensors"});
  EXPECT_EQ(r.output.find("estimate-memory: estimate-memory"), std::string::npos) << r.output;
}

// A layout's share, counted here by hand for a GPT of 4 blocks, hidden 128, vocab 256, context
// 128 (842,496 parameters; a block 12h^2 + 13h = 198,272): tensor parallel 2 halves qkv, proj,
// fc and fc_proj's weights, qkv's and fc's biases and the token embedding (a block 99,520; the
// model 431,104); two pipeline stages take the embeddings and blocks 0-1 (stage 0) and blocks
// 2-3, the final LayerNorm and the tied head's own copy (stage 1). Context parallel shards ZeRO
// over dp x cp and leaves every rank the whole model.
TEST(EstimateMemoryCli, ALayoutGivesTheRankThatHoldsTheMost) {
  auto json = [](std::vector<std::string> extra) {
    std::vector<std::string> cmd{TANDEM_CLI, "estimate-memory", "--layers", "4", "--hidden",
                                 "128", "--vocab", "256", "--context", "128", "--json"};
    cmd.insert(cmd.end(), extra.begin(), extra.end());
    auto r = run_command(cmd);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return nlohmann::json::parse(r.output);
  };
  auto tp = json({"--num_processes", "4", "--tp_size", "2"})["layout"];
  EXPECT_EQ(tp["dp"], 2);
  EXPECT_EQ(tp["rank_parameters"], 431104);
  EXPECT_EQ(tp["largest_unit"], 99520);
  ASSERT_EQ(tp["tandem_fp32"].size(), 4u);
  EXPECT_DOUBLE_EQ(tp["tandem_fp32"][0]["bytes_per_device"].get<double>(), 20.0 * 431104);
  EXPECT_DOUBLE_EQ(tp["tandem_fp32"][3]["bytes_per_device"].get<double>(),
                   16.0 * 431104 / 2 + 16.0 * 99520);

  auto pp = json({"--num_processes", "8", "--tp_size", "2", "--pp_size", "2"})["layout"];
  EXPECT_EQ(pp["dp"], 2);
  EXPECT_EQ(pp["stage"], 0);
  EXPECT_EQ(pp["rank_parameters"], 16384 + 16384 + 2 * 99520);
  ASSERT_EQ(pp["tandem_fp32"].size(), 1u);  // a pipeline runs without ZeRO
  EXPECT_DOUBLE_EQ(pp["tandem_fp32"][0]["bytes_per_device"].get<double>(),
                   16.0 * (16384 + 16384 + 2 * 99520));
  // Without tp, stage 0 (both embeddings, two blocks) still holds the most.
  EXPECT_EQ(json({"--num_processes", "2", "--pp_size", "2"})["layout"]["rank_parameters"],
            32768 + 16384 + 2 * 198272);

  auto cp = json({"--num_processes", "4", "--cp_size", "2"})["layout"];
  EXPECT_EQ(cp["dp"], 2);
  EXPECT_EQ(cp["rank_parameters"], 842496);
  EXPECT_DOUBLE_EQ(cp["tandem_fp32"][3]["bytes_per_device"].get<double>(),
                   16.0 * 842496 / 4 + 16.0 * 198272);  // W = dp x cp = 4

  auto text = run_command({TANDEM_CLI, "estimate-memory", "--layers", "4", "--hidden", "128",
                           "--vocab", "256", "--context", "128", "--num_processes", "8",
                           "--pp_size", "2", "--pp_virtual_stages", "2", "--tp_size", "2"});
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("On the layout pp 2 (2 stages per rank) x dp 2 x tp 2: the rank"),
            std::string::npos) << text.output;

  // Layouts that do not lay out the processes, or ask for what the model cannot give.
  auto odd = run_command({TANDEM_CLI, "estimate-memory", "--params", "1B", "--num_processes",
                          "6", "--tp_size", "4"});
  EXPECT_EQ(odd.exit_code, 2);
  EXPECT_NE(odd.output.find("not a multiple of tp x pp x cp = 4"), std::string::npos) << odd.output;
  auto virt = run_command({TANDEM_CLI, "estimate-memory", "--params", "1B", "--num_processes",
                           "2", "--pp_virtual_stages", "2"});
  EXPECT_EQ(virt.exit_code, 2);
  EXPECT_NE(virt.output.find("give --pp_size 2 or more"), std::string::npos) << virt.output;
  auto deep = run_command({TANDEM_CLI, "estimate-memory", "--layers", "2", "--hidden", "64",
                           "--vocab", "100", "--context", "16", "--num_processes", "4",
                           "--pp_size", "4", "--pp_virtual_stages", "2"});
  EXPECT_EQ(deep.exit_code, 2);
  EXPECT_NE(deep.output.find("more stages than the model's 4 children"), std::string::npos)
      << deep.output;
  // A bare count splits evenly, and says so.
  auto even = run_command({TANDEM_CLI, "estimate-memory", "--params", "1B", "--num_processes",
                           "4", "--tp_size", "2"});
  ASSERT_EQ(even.exit_code, 0) << even.output;
  std::string flat;  // the text as one line: the estimate wraps its sentences
  for (char c : even.output)
    if (c != '\n') flat += c;
    else if (!flat.empty() && flat.back() != ' ') flat += ' ';
  EXPECT_NE(flat.find("500,000,000 parameters (an even split"), std::string::npos) << even.output;
}

// Expert parallel splits a checkpoint's expert tensors: a file with one dense block (an
// attention matrix of 64 and a router of 16) and four experts of 32 each, 4 ranks at ep 2: each
// rank holds the dense 80 and two experts (64), 144 in all; under ZeRO the experts stay whole.
TEST(EstimateMemoryCli, ExpertParallelSplitsTheExpertTensors) {
  tandem::testing::TempDir dir;
  std::vector<std::pair<std::string, std::vector<int64_t>>> tensors{
      {"model.layers.0.self_attn.q_proj.weight", {8, 8}},
      {"model.layers.0.mlp.gate.weight", {4, 4}}};
  for (int e = 0; e < 4; ++e)
    tensors.push_back({"model.layers.0.mlp.experts." + std::to_string(e) + ".up_proj.weight", {4, 8}});
  nlohmann::json header;
  int64_t offset = 0;
  for (const auto& [name, shape] : tensors) {
    const int64_t bytes = 4 * shape[0] * shape[1];
    header[name] = {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  const std::string text = header.dump();
  {
    std::ofstream out(dir.str() + "/model.safetensors", std::ios::binary);
    const uint64_t n = text.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << text << std::string(static_cast<size_t>(offset), '\0');
  }
  auto r = run_command({TANDEM_CLI, "estimate-memory", dir.str() + "/model.safetensors",
                        "--num_processes", "4", "--ep_size", "2", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["parameters"], 64 + 16 + 4 * 32);
  EXPECT_EQ(j["layout"]["ep"], 2);
  EXPECT_EQ(j["layout"]["rank_parameters"], 64 + 16 + 2 * 32);
  EXPECT_EQ(j["layout"]["expert_parameters"], 2 * 32);
  // Under ZeRO the experts stay whole: ZeRO-1 shards the rest's 80 over W = 4 (8P + 8P/W, its
  // buckets over those 80: 2B = 2 x 4 x 80 bytes) beside the experts' 16E + 4E (their own bucket).
  ASSERT_EQ(j["layout"]["tandem_fp32"].size(), 4u);
  EXPECT_EQ(j["layout"]["tandem_fp32"][1]["formula"], "8P + 8P/W + 2B + 20E");
  EXPECT_DOUBLE_EQ(j["layout"]["tandem_fp32"][1]["bytes_per_device"].get<double>(),
                   8 * 80 + 8 * 80 / 4 + 2 * 4 * 80 + 20 * 64);
  auto gpt = run_command({TANDEM_CLI, "estimate-memory", "--params", "1B", "--num_processes", "4",
                          "--ep_size", "2"});
  EXPECT_EQ(gpt.exit_code, 2);
  EXPECT_NE(gpt.output.find("--ep_size needs a checkpoint"), std::string::npos) << gpt.output;
  auto odd = run_command({TANDEM_CLI, "estimate-memory", dir.str() + "/model.safetensors",
                          "--num_processes", "4", "--ep_size", "3"});
  EXPECT_EQ(odd.exit_code, 2);
  EXPECT_NE(odd.output.find("must divide dp x cp (4)"), std::string::npos) << odd.output;
}
