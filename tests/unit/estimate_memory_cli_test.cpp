// `tandem estimate-memory` end to end: the binary's JSON and text output and its exit codes.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "../common/subprocess.h"

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
