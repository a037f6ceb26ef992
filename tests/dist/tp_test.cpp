// Tensor parallel over real processes: every layer, the example GPT and tensor x data parallel
// training equal the dense model computed in one process (tp_worker prints the differences);
// a mesh that does not fit the job is refused by the launcher before any rank starts.
#include <gtest/gtest.h>
#include <fstream>

#include <map>
#include <sstream>

#include "../common/subprocess.h"

using tandem::testing::count_of;
using tandem::testing::run_command;

namespace {

const std::string kCli = TANDEM_CLI;
const std::string kWorker = TP_WORKER;

tandem::testing::RunResult launch(int n, const std::string& mode,
                                  std::vector<std::string> flags = {}) {
  std::vector<std::string> argv{kCli, "launch", "--num_processes", std::to_string(n), "--cpu",
                                "--num_cpu_threads_per_process", "1"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(kWorker);
  argv.push_back(mode);
  return run_command(argv, {}, 180);
}

// "check <name> <value>" lines: the largest value of each name, and how many ranks printed it.
struct Checks {
  std::map<std::string, double> worst;
  std::map<std::string, int> count;
};

Checks parse_checks(const std::string& output) {
  Checks c;
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    // The launcher prefixes each rank's lines with "[rank r] ".
    if (line.rfind("[rank ", 0) == 0) line = line.substr(line.find("] ") + 2);
    if (line.rfind("check ", 0) != 0) continue;
    const auto last = line.rfind(' ');
    const std::string name = line.substr(6, last - 6);
    const double v = std::stod(line.substr(last + 1));
    c.worst[name] = std::max(c.worst.count(name) ? c.worst[name] : 0.0, v);
    ++c.count[name];
  }
  return c;
}

void expect_all_within(const Checks& c, int ranks, double tolerance, const std::string& output) {
  for (const auto& [name, v] : c.worst) {
    EXPECT_LE(v, tolerance) << name << "\n" << output;
    EXPECT_EQ(c.count.at(name), ranks) << name;
  }
}

}  // namespace

// Each layer on 2 ranks against the dense layer (same seed on every rank): outputs, input
// gradients and this rank's shard of the weight gradients, within 1e-5 (float32 sums in
// another order; the largest differences seen are ~1e-6).
TEST(TensorParallel, EveryLayerEqualsTheDenseLayerOnTwoRanks) {
  auto r = launch(2, "layers");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto c = parse_checks(r.output);
  for (const char* name :
       {"column_output", "column_input_grad", "column_weight_grad", "column_bias_grad",
        "column_fused_gathered_output", "column_fused_input_grad", "column_fused_weight_grad",
        "column_fused_bias_grad", "row_full_input_output", "row_full_input_input_grad",
        "row_full_input_weight_grad", "row_full_input_bias_grad", "row_split_input_output",
        "row_split_input_input_grad", "row_split_input_weight_grad", "row_split_input_bias_grad",
        "vocab_embedding_output", "vocab_embedding_weight_grad", "vocab_cross_entropy_loss",
        "vocab_cross_entropy_logits_grad", "sequence_gather_output", "sequence_gather_input_grad",
        "sequence_reduce_scatter_output", "sequence_reduce_scatter_input_grad"})
    EXPECT_EQ(c.count[name], 2) << name << "\n" << r.output;
  expect_all_within(c, 2, 1e-5, r.output);
  // An uneven sequence is refused with the rule, not padded.
  EXPECT_EQ(count_of(r.output, "sequence_refusal 1"), 2) << r.output;
  EXPECT_EQ(count_of(r.output, "tp_worker done"), 2);
}

// The example GPT (width 32, 4 heads, 2 layers, vocab 64, 16 positions) parallelized by its
// plan on 2 ranks: the loss and every parameter's gradient (or its shard) equal the dense
// GPT's within 1e-5; the head stays tied to the (now vocab-parallel) token embedding.
TEST(TensorParallel, ExampleGptEqualsTheDenseGpt) {
  auto r = launch(2, "gpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto c = parse_checks(r.output);
  EXPECT_EQ(c.count["gpt_loss"], 2);
  EXPECT_EQ(c.count["gpt_grad h1.attn.qkv.weight"], 2) << r.output;
  EXPECT_EQ(c.count["gpt_grad wte.weight"], 2) << r.output;
  EXPECT_EQ(c.count["gpt_grad ln_f.weight"], 2) << r.output;
  EXPECT_GE(c.worst.size(), 40u);
  expect_all_within(c, 2, 1e-5, r.output);
  EXPECT_EQ(count_of(r.output, "gpt_tied 1 32"), 2) << r.output;  // 64 / 2 vocabulary rows
}

// 4 ranks launched with --tp_size 2: the mesh (from the launcher's TANDEM_TP_SIZE) is dp 2 x
// tp 2 with tp groups {0,1}, {2,3}; four SGD steps (momentum 0.9, weight decay) with gradients
// averaged over mesh["dp"]
// equal one dense process training on the global batch: losses within 1e-5, parameters within
// 1e-5 relative.
TEST(TensorParallel, TensorTimesDataParallelTrainingEqualsOneProcess) {
  auto r = launch(4, "train", {"--tp_size", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* line : {"mesh tp 2 dp 2 rank 0 tp_peers 0,1 dp_peers 0,2",
                           "mesh tp 2 dp 2 rank 1 tp_peers 0,1 dp_peers 1,3",
                           "mesh tp 2 dp 2 rank 2 tp_peers 2,3 dp_peers 0,2",
                           "mesh tp 2 dp 2 rank 3 tp_peers 2,3 dp_peers 1,3"})
    EXPECT_EQ(count_of(r.output, line), 1) << line << "\n" << r.output;
  auto c = parse_checks(r.output);
  EXPECT_EQ(c.count["train_loss_step3"], 4);
  EXPECT_EQ(c.count["train_params_relative"], 4);
  expect_all_within(c, 4, 1e-5, r.output);
}

// The same through the Accelerator: AcceleratorOptions come from the launcher's --tp_size, the
// Accelerator builds the mesh, splits the GPT by the plan, and averages gradients over
// mesh["dp"] with its bucketed data parallel; equal to one dense process within 1e-5.
TEST(TensorParallel, AcceleratorTensorTimesDataParallelEqualsOneProcess) {
  auto r = launch(4, "accelerate", {"--tp_size", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* line : {"acc mesh tp 2 dp 2 rank 0 dp_rank 0", "acc mesh tp 2 dp 2 rank 1 dp_rank 0",
                           "acc mesh tp 2 dp 2 rank 2 dp_rank 1", "acc mesh tp 2 dp 2 rank 3 dp_rank 1"})
    EXPECT_EQ(count_of(r.output, line), 1) << line << "\n" << r.output;
  auto c = parse_checks(r.output);
  EXPECT_EQ(c.count["acc_loss_step3"], 4);
  EXPECT_EQ(c.count["acc_params_relative"], 4);
  expect_all_within(c, 4, 1e-5, r.output);
}

// save_state in a model-parallel run writes every rank's shards (model.mp<r>, optimizer.mp<r>);
// stopped after 2 of 4 steps and resumed in a new job, the run ends with bitwise the parameters
// of the uninterrupted one on every rank.
TEST(TensorParallel, AcceleratorCheckpointResumesBitwise) {
  auto digests = [](const std::string& out) {
    std::map<std::string, std::string> d;
    std::istringstream in(out);
    for (std::string line; std::getline(in, line);) {
      auto at = line.find("param_digest rank ");
      if (at != std::string::npos) d[line.substr(at + 18, 1)] = line.substr(at + 20);
    }
    return d;
  };
  auto whole = launch(4, "accelerate", {"--tp_size", "2"});
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const auto dir = tandem::testing::temp_path("tp", "ckpt");
  std::vector<std::string> save{kCli, "launch", "--num_processes", "4", "--cpu",
                                "--num_cpu_threads_per_process", "1", "--tp_size", "2",
                                kWorker, "accelerate", "--save_dir", dir};
  auto saved = run_command(save, {}, 180);
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  EXPECT_EQ(count_of(saved.output, "saved at step 2"), 4) << saved.output;
  for (int r = 0; r < 4; ++r)
    EXPECT_TRUE(std::ifstream(dir + "/model.mp" + std::to_string(r) + ".safetensors").good()) << r;
  auto load = save;
  load[load.size() - 2] = "--load_dir";
  auto resumed = run_command(load, {}, 180);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  auto a = digests(whole.output), b = digests(resumed.output);
  EXPECT_EQ(a.size(), 4u) << whole.output;
  EXPECT_EQ(a, b) << resumed.output;
  // The shards resume only on the mesh that saved them: without --tp_size every rank refuses.
  auto other = load;
  other.erase(other.begin() + 7, other.begin() + 9);  // "--tp_size", "2"
  auto refused = run_command(other, {}, 180);
  EXPECT_NE(refused.exit_code, 0) << refused.output;
  EXPECT_GE(count_of(refused.output, "every rank's shards resume only on the same mesh"), 1)
      << refused.output;
  std::system(("rm -rf " + dir).c_str());
}

// A mesh that does not fit is refused before any rank starts, naming the flag and the fix.
TEST(TensorParallel, LauncherRefusesAMeshThatDoesNotFit) {
  auto r = launch(4, "train", {"--tp_size", "3"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(count_of(r.output, "tp_worker train rank"), 0) << r.output;
  EXPECT_NE(r.output.find("--tp_size"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("set sizes whose product is 4"), std::string::npos) << r.output;
}
