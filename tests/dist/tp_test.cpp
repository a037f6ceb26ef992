// Tensor parallel over real processes: every layer, the example GPT (plain and sequence
// parallel) and tensor x data parallel training equal the dense model computed in one process
// (tp_worker prints the differences); dropout draws per-rank masks on sequence shards; a mesh that
// does not fit the job is refused by the launcher before any rank starts.
#include <gtest/gtest.h>
#include <fstream>

#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "../common/checks.h"
#include "../common/launch.h"

using tandem::testing::Checks;
using tandem::testing::count_of;
using tandem::testing::parse_checks;
using tandem::testing::launch;
using tandem::testing::LaunchOptions;
using tandem::testing::run_command;

namespace {

const std::string kCli = TANDEM_CLI;
const std::string kWorker = TP_WORKER;

// One thread per rank, 180 s per job; `flags` go to the launcher.
LaunchOptions with_flags(std::vector<std::string> flags = {}) {
  return LaunchOptions().flags(std::move(flags)).timeout_s(180);
}

// The numbers printed after `key` (one line per rank), e.g. numbers_after(out, "train ") for
// "dropout_halves eval 0 train 0.25".
std::vector<double> numbers_after(const std::string& output, const std::string& key) {
  std::vector<double> out;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    const auto at = line.find(key);
    if (at != std::string::npos) out.push_back(std::stod(line.substr(at + key.size())));
  }
  return out;
}

// Each of `lines` (one rank's view of the mesh) printed exactly once.
void expect_mesh_lines(const std::string& output, const std::vector<std::string>& lines) {
  for (const auto& line : lines) EXPECT_EQ(count_of(output, line), 1) << line << "\n" << output;
}

const std::vector<std::string> kAcceleratorMeshLines{
    "acc mesh tp 2 dp 2 rank 0 dp_rank 0", "acc mesh tp 2 dp 2 rank 1 dp_rank 0",
    "acc mesh tp 2 dp 2 rank 2 dp_rank 1", "acc mesh tp 2 dp 2 rank 3 dp_rank 1"};

void expect_all_within(const Checks& c, int ranks, double tolerance, const std::string& output) {
  for (const auto& [name, v] : c.worst) {
    EXPECT_LE(v, tolerance) << name << "\n" << output;
    EXPECT_EQ(c.count.at(name), ranks) << name;
  }
}

// The main process's "state_dict ..." line says names, shapes and values are the dense model's
// (within 1e-5 relative), and every other rank got no tensors.
void expect_state_dict_is_dense(const std::string& output, int ranks) {
  EXPECT_EQ(count_of(output, "names_and_shapes 1 relative "), 1) << output;
  for (double v : numbers_after(output, "names_and_shapes 1 relative ")) EXPECT_LE(v, 1e-5);
  EXPECT_EQ(count_of(output, ": 0 tensors"), ranks - 1) << output;
}

}  // namespace

namespace {

// Each layer on 2 ranks against the dense layer (same seed on every rank): outputs, input
// gradients and this rank's shard of the weight gradients, within 1e-5 (float32 sums in
// another order; the largest differences seen are ~1e-6). The sequence-parallel forms take or
// give this rank's half of the 8 positions; a row-parallel bias added to them still gets the
// whole dense gradient.
void check_every_layer_equals_the_dense_layer_on_two_ranks(const tandem::testing::RunResult& r) {
  SCOPED_TRACE("EveryLayerEqualsTheDenseLayerOnTwoRanks");
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
        "sequence_reduce_scatter_output", "sequence_reduce_scatter_input_grad",
        "column_sequence_output", "column_sequence_input_grad", "column_sequence_weight_grad",
        "column_sequence_bias_grad", "row_sequence_output", "row_sequence_input_grad",
        "row_sequence_weight_grad", "row_sequence_bias_grad", "sequence_scatter_output",
        "sequence_scatter_input_grad"})
    EXPECT_EQ(c.count[name], 2) << name << "\n" << r.output;
  expect_all_within(c, 2, 1e-5, r.output);
  // An uneven sequence is refused with the rule, not padded.
  EXPECT_EQ(count_of(r.output, "sequence_refusal 1"), 2) << r.output;
  EXPECT_EQ(count_of(r.output, "sequence_scatter_refusal 1"), 2) << r.output;
  EXPECT_EQ(count_of(r.output, "tp_worker done"), 2);
}

// The sequence-parallel plan (norms, residual adds on 8 of the 16 positions per rank): the same
// loss and gradients as the dense GPT within 1e-5. ln_f's own gradient on a rank is a partial
// sum that differs from the dense one; the plan's hook sums it over tp to the dense gradient.
void check_sequence_parallel_gpt_equals_the_dense_gpt(const tandem::testing::RunResult& r) {
  SCOPED_TRACE("SequenceParallelGptEqualsTheDenseGpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto c = parse_checks(r.output);
  EXPECT_EQ(c.count["gpt_loss"], 2);
  for (const char* name : {"gpt_grad h0.ln1.weight", "gpt_grad h1.ln2.bias", "gpt_grad ln_f.weight",
                           "gpt_grad h1.attn.proj.bias", "gpt_grad h0.fc_proj.bias",
                           "gpt_grad wpe.weight", "gpt_grad wte.weight", "gpt_ln_local_summed"})
    EXPECT_EQ(c.count[name], 2) << name << "\n" << r.output;
  EXPECT_GE(c.worst.size(), 40u);
  expect_all_within(c, 2, 1e-5, r.output);
  EXPECT_EQ(count_of(r.output, "gpt_sequence_parallel 1"), 2) << r.output;
  EXPECT_EQ(count_of(r.output, "gpt_tied 1 32"), 2) << r.output;
  auto local = numbers_after(r.output, "gpt_ln_local_difference ");
  ASSERT_EQ(local.size(), 2u) << r.output;
  for (double d : local) EXPECT_GT(d, 1e-4) << r.output;  // un-summed: not the dense gradient
}

// Residual dropout 0.1. Sequence parallel: each rank's positions get masks of their own (two
// identical sequence halves give different logits in training, equal ones in eval), drawn from
// the per-rank stream, so the shared stream is where the batch draws left it, on both ranks;
// the same seeds give bitwise the same loss and gradients, another tp seed another loss.
// Plain tensor parallel: the masks are the dense GPT's, from the shared stream.
void check_dropout_draws_per_rank_masks_on_sequence_shards(const tandem::testing::RunResult& r) {
  SCOPED_TRACE("DropoutDrawsPerRankMasksOnSequenceShards");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto c = parse_checks(r.output);
  EXPECT_EQ(c.count["dropout_shared_stream_untouched"], 6) << r.output;  // 3 runs x 2 ranks
  EXPECT_EQ(c.worst["dropout_shared_stream_untouched"], 0.0) << r.output;
  EXPECT_EQ(c.worst["dropout_shared_stream_across_ranks"], 0.0) << r.output;
  EXPECT_EQ(c.count["dropout_tp_grad h0.fc.weight"], 2) << r.output;
  EXPECT_LE(c.worst["dropout_tp_loss"], 1e-5) << r.output;
  for (const auto& [name, v] : c.worst) {
    if (name.rfind("dropout_tp_", 0) == 0) {
      EXPECT_LE(v, 1e-5) << name << "\n" << r.output;
    }
  }
  for (double d : numbers_after(r.output, "dropout_dense_effect ")) EXPECT_GT(d, 1e-3) << r.output;
  auto eval = numbers_after(r.output, "dropout_halves eval ");
  auto train = numbers_after(r.output, " train ");
  ASSERT_EQ(eval.size(), 2u) << r.output;
  ASSERT_EQ(train.size(), 2u) << r.output;
  for (int i = 0; i < 2; ++i) {
    EXPECT_LE(eval[i], 1e-6) << r.output;
    EXPECT_GT(train[i], 1e-2) << r.output;
  }
  auto repeat_loss = numbers_after(r.output, "dropout_repeat loss ");
  auto repeat_grads = numbers_after(r.output, " grads ");
  auto other_seed = numbers_after(r.output, " other_seed_loss ");
  ASSERT_EQ(repeat_loss.size(), 2u) << r.output;
  ASSERT_EQ(other_seed.size(), 2u) << r.output;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(repeat_loss[i], 0.0) << r.output;
    EXPECT_EQ(repeat_grads[i], 0.0) << r.output;
    EXPECT_GT(other_seed[i], 1e-5) << r.output;
  }
  EXPECT_EQ(count_of(r.output, "tp_worker done"), 2);
}

// 4 ranks launched with --tp_size 2: the mesh (from the launcher's TANDEM_TP_SIZE) is dp 2 x
// tp 2 with tp groups {0,1}, {2,3}; four SGD steps (momentum 0.9, weight decay) with gradients
// averaged over mesh["dp"]
// equal one dense process training on the global batch: losses within 1e-5, parameters within
// 1e-5 relative.
void check_tensor_times_data_parallel_training_equals_one_process(
    const tandem::testing::RunResult& r) {
  SCOPED_TRACE("TensorTimesDataParallelTrainingEqualsOneProcess");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_mesh_lines(r.output, {"mesh tp 2 dp 2 rank 0 tp_peers 0,1 dp_peers 0,2",
                               "mesh tp 2 dp 2 rank 1 tp_peers 0,1 dp_peers 1,3",
                               "mesh tp 2 dp 2 rank 2 tp_peers 2,3 dp_peers 0,2",
                               "mesh tp 2 dp 2 rank 3 tp_peers 2,3 dp_peers 1,3"});
  auto c = parse_checks(r.output);
  EXPECT_EQ(c.count["train_loss_step3"], 4);
  EXPECT_EQ(c.count["train_params_relative"], 4);
  expect_all_within(c, 4, 1e-5, r.output);
}

// The same through the Accelerator: AcceleratorOptions come from the launcher's --tp_size, the
// Accelerator builds the mesh, splits the GPT by the plan, and averages gradients over
// mesh["dp"] with its bucketed data parallel; equal to one dense process within 1e-5.
void check_accelerator_tensor_times_data_parallel_equals_one_process(
    const tandem::testing::RunResult& r) {
  SCOPED_TRACE("AcceleratorTensorTimesDataParallelEqualsOneProcess");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_mesh_lines(r.output, kAcceleratorMeshLines);
  auto c = parse_checks(r.output);
  EXPECT_EQ(c.count["acc_loss_step3"], 4);
  EXPECT_EQ(c.count["acc_params_relative"], 4);
  expect_all_within(c, 4, 1e-5, r.output);
  // get_state_dict joins the tp shards into the dense tensors under the dense names (the main
  // process; the others get nothing): 22 parameters of the GPT, the tied head included.
  expect_state_dict_is_dense(r.output, 4);
}

// A module written with typed members and called directly (`up(x)`) cannot be reached by a
// plan: parallelize refuses it on every rank, naming the member and the fixes, before the
// model's own code meets a half-width layer or each tp rank trains its own half-model.
void check_typed_members_called_directly_are_refused(const tandem::testing::RunResult& r) {
  SCOPED_TRACE("TypedMembersCalledDirectlyAreRefused");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_GE(count_of(r.output, "parallelize_module: up (torch::nn::LinearImpl"), 1) << r.output;
  EXPECT_GE(count_of(r.output, "`tandem::nn::Linear up;`"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "typed_loss_step0"), 0) << r.output;
  EXPECT_GE(count_of(r.output, "planned_child"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "typed trained rank"), 0) << r.output;
}

// The same with the GPT's sequence-parallel plan: LayerNorm gradients summed over tp, then
// averaged over dp by the Accelerator; the clipped norm (LayerNorms and row-parallel biases
// counted once) is the dense model's, and four steps equal one dense process within 1e-5.
void check_accelerator_sequence_parallel_equals_one_process(const tandem::testing::RunResult& r) {
  SCOPED_TRACE("AcceleratorSequenceParallelEqualsOneProcess");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_mesh_lines(r.output, kAcceleratorMeshLines);
  auto c = parse_checks(r.output);
  EXPECT_EQ(c.count["acc_grad_norm_step3"], 4);
  EXPECT_EQ(c.count["acc_loss_step3"], 4);
  EXPECT_EQ(c.count["acc_params_relative"], 4);
  expect_all_within(c, 4, 1e-5, r.output);
}

// The same module calling its members through the planned child, and a Sequential whose entries
// the plan replaces: AdamW steps equal the dense model, and get_state_dict gives it back.
void check_typed_members_through_planned_child_or_sequential(const tandem::testing::RunResult& r,
                                                             const std::string& variant) {
  SCOPED_TRACE("typed members: " + variant);
  ASSERT_EQ(r.exit_code, 0) << variant << "\n" << r.output;
  auto c = parse_checks(r.output);
  EXPECT_EQ(c.count["typed_loss_step2"], 2) << variant;
  expect_all_within(c, 2, 1e-5, r.output);
  expect_state_dict_is_dense(r.output, 2);
}

}  // namespace

// The layers, the sequence-parallel GPT, dropout, typed members and tensor x data parallel
// training (each checked as its function above says), as jobs of one launch per number of
// ranks (tandem::testing::launch_jobs_by_size): each job gets exactly the variables its own
// launch would give it.
TEST(TensorParallel, LayersGptDropoutTypedMembersAndTensorTimesDataParallelEqualTheDenseModel) {
  auto runs = tandem::testing::launch_jobs_by_size(
      kWorker, {{"EveryLayerEqualsTheDenseLayerOnTwoRanks", 2,
                 tandem::testing::Job{{"layers"}, with_flags()}},
                {"SequenceParallelGptEqualsTheDenseGpt", 2,
                 tandem::testing::Job{{"gpt", "--sequence_parallel"}, with_flags()}},
                {"DropoutDrawsPerRankMasksOnSequenceShards", 2,
                 tandem::testing::Job{{"dropout"}, with_flags()}},
                {"TensorTimesDataParallelTrainingEqualsOneProcess", 4,
                 tandem::testing::Job{{"train"}, with_flags({"--tp_size", "2"})}},
                {"AcceleratorTensorTimesDataParallelEqualsOneProcess", 4,
                 tandem::testing::Job{{"accelerate"}, with_flags({"--tp_size", "2"})}},
                {"TypedMembersCalledDirectlyAreRefused", 2,
                 tandem::testing::Job{{"typed", "direct"}, with_flags({"--tp_size", "2"}), true}},
                {"AcceleratorSequenceParallelEqualsOneProcess", 4,
                 tandem::testing::Job{{"accelerate", "--sequence_parallel"},
                                      with_flags({"--tp_size", "2"})}},
                {"typed planned", 2,
                 tandem::testing::Job{{"typed", "planned"}, with_flags({"--tp_size", "2"})}},
                {"typed sequential", 2,
                 tandem::testing::Job{{"typed", "sequential"}, with_flags({"--tp_size", "2"})}}});
  check_every_layer_equals_the_dense_layer_on_two_ranks(
      runs["EveryLayerEqualsTheDenseLayerOnTwoRanks"]);
  check_sequence_parallel_gpt_equals_the_dense_gpt(runs["SequenceParallelGptEqualsTheDenseGpt"]);
  check_dropout_draws_per_rank_masks_on_sequence_shards(
      runs["DropoutDrawsPerRankMasksOnSequenceShards"]);
  check_tensor_times_data_parallel_training_equals_one_process(
      runs["TensorTimesDataParallelTrainingEqualsOneProcess"]);
  check_accelerator_tensor_times_data_parallel_equals_one_process(
      runs["AcceleratorTensorTimesDataParallelEqualsOneProcess"]);
  check_typed_members_called_directly_are_refused(runs["TypedMembersCalledDirectlyAreRefused"]);
  check_accelerator_sequence_parallel_equals_one_process(
      runs["AcceleratorSequenceParallelEqualsOneProcess"]);
  for (const std::string variant : {"planned", "sequential"})
    check_typed_members_through_planned_child_or_sequential(runs["typed " + variant], variant);
}

// The example GPT (width 32, 4 heads, 2 layers, vocab 64, 16 positions) parallelized by its
// plan on 2 ranks: the loss and every parameter's gradient (or its shard) equal the dense
// GPT's within 1e-5; the head stays tied to the (now vocab-parallel) token embedding.
TEST(TensorParallel, ExampleGptEqualsTheDenseGpt) {
  auto r = launch(2, kWorker, {"gpt"}, with_flags());
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

// ZeRO over mesh["dp"] with tensor parallel: each tp rank's shards of the split GPT are sharded
// again over its data-parallel pair. Stages 1, 2 and 3 train as one dense process, and the clipped
// norm (the strategy's shard norms in split and replicated parts, summed over tp) is the dense
// model's; all within 1e-5.
TEST(TensorParallel, AcceleratorZeroTimesTensorParallelEqualsOneProcess) {
  std::vector<tandem::testing::Job> jobs;
  for (const char* stage : {"1", "2", "3"})
    jobs.push_back({{"accelerate"},
                    with_flags({"--tp_size", "2", "--use_deepspeed", "--zero_stage", stage})});
  const auto runs = tandem::testing::launch_jobs(4, kWorker, jobs);
  for (int i = 0; i < 3; ++i) {
    const int stage = i + 1;
    const auto& r = runs[i];
    ASSERT_EQ(r.exit_code, 0) << "stage " << stage << "\n" << r.output;
    expect_mesh_lines(r.output, kAcceleratorMeshLines);
    auto c = parse_checks(r.output);
    EXPECT_EQ(c.count["acc_grad_norm_step3"], 4) << "stage " << stage;
    EXPECT_EQ(c.count["acc_params_relative"], 4) << "stage " << stage;
    expect_all_within(c, 4, 1e-5, r.output);
  }
}

// save_state in a model-parallel run: the first data-parallel rank of each tp coordinate writes
// its shards of the model (model.mp<r>), every rank its optimizer state (optimizer.mp<r>, or its
// ZeRO shards optimizer.rank<r>). Stopped after 2 of 4 steps and resumed in a new job, the run
// ends with bitwise the parameters of the uninterrupted one on every rank. Returns the
// checkpoint's directory (removed by the caller).
std::string expect_resume_bitwise(const std::vector<std::string>& flags) {
  auto digests = [](const std::string& out) {
    std::map<std::string, std::string> d;
    std::istringstream in(out);
    for (std::string line; std::getline(in, line);) {
      auto at = line.find("param_digest rank ");
      if (at != std::string::npos) d[line.substr(at + 18, 1)] = line.substr(at + 20);
    }
    return d;
  };
  const auto dir = tandem::testing::temp_path("tp", "ckpt");
  // The three runs as jobs of one launch (tandem::testing::launch_jobs): each a fresh Accelerator.
  const auto runs = tandem::testing::launch_jobs(
      4, kWorker,
      {{{"accelerate"}, with_flags(flags)},
       {{"accelerate", "--save_dir", dir}, with_flags(flags)},
       {{"accelerate", "--load_dir", dir}, with_flags(flags)}});
  const auto &whole = runs[0], &saved = runs[1], &resumed = runs[2];
  EXPECT_EQ(whole.exit_code, 0) << whole.output;
  EXPECT_EQ(saved.exit_code, 0) << saved.output;
  EXPECT_EQ(count_of(saved.output, "saved at step 2"), 4) << saved.output;
  // Ranks 0 and 1 are data-parallel rank 0 of tp ranks 0 and 1; 2 and 3 hold the same model.
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ(std::ifstream(dir + "/model.mp" + std::to_string(r) + ".safetensors").good(), r < 2)
        << r;
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  auto a = digests(whole.output), b = digests(resumed.output);
  EXPECT_EQ(a.size(), 4u) << whole.output;
  EXPECT_EQ(a, b) << resumed.output;
  return dir;
}

// tandem merge-weights joins the model.mp<r> files of a tensor-parallel checkpoint into the dense
// model: the same tensor names as the dense GPT, each equal to the dense GPT trained alongside
// to the same step within 1e-5 relative.
void expect_merge_gives_the_dense_model(const std::string& dir) {
  const auto out = dir + ".merged";
  auto merged = run_command({kCli, "merge-weights", dir, out}, {}, 60);
  ASSERT_EQ(merged.exit_code, 0) << merged.output;
  auto compared = run_command(
      {kWorker, "compare", out + "/model.safetensors", dir + ".dense.safetensors"}, {}, 60);
  ASSERT_EQ(compared.exit_code, 0) << compared.output;
  EXPECT_EQ(count_of(compared.output, "same names 1"), 1) << compared.output;
  auto c = parse_checks(compared.output);
  EXPECT_GE(c.count["merged wte.weight"], 1) << compared.output;       // vocab rows
  EXPECT_GE(c.count["merged h0.attn.qkv.weight"], 1) << compared.output;  // q, k, v blocks
  EXPECT_GE(c.count["merged h1.fc_proj.weight"], 1) << compared.output;   // columns
  expect_all_within(c, 1, 1e-5, compared.output);
  std::system(("rm -rf " + out + " " + dir + ".dense.safetensors").c_str());
}

TEST(TensorParallel, AcceleratorCheckpointResumesBitwise) {
  const auto dir = expect_resume_bitwise({"--tp_size", "2"});
  expect_merge_gives_the_dense_model(dir);
  for (int r = 0; r < 4; ++r)
    EXPECT_TRUE(std::ifstream(dir + "/optimizer.mp" + std::to_string(r) + ".json").good()) << r;
  // On another mesh the shards are joined and cut again: tests/dist/reshard_test.cpp.
  std::system(("rm -rf " + dir).c_str());
}

TEST(TensorParallel, AcceleratorZeroCheckpointResumesBitwise) {
  for (const char* stage : {"2", "3"}) {
    const auto dir =
        expect_resume_bitwise({"--tp_size", "2", "--use_deepspeed", "--zero_stage", stage});
    for (int r = 0; r < 4; ++r)
      EXPECT_TRUE(std::ifstream(dir + "/optimizer.rank" + std::to_string(r) + ".json").good())
          << "stage " << stage << " rank " << r;
    expect_merge_gives_the_dense_model(dir);
    std::system(("rm -rf " + dir).c_str());
  }
}

// A mesh that does not fit is refused before any rank starts, naming the flag and the fix.
TEST(TensorParallel, LauncherRefusesAMeshThatDoesNotFit) {
  auto r = launch(4, kWorker, {"train"}, with_flags({"--tp_size", "3"}));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(count_of(r.output, "tp_worker train rank"), 0) << r.output;
  EXPECT_NE(r.output.find("--tp_size"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("set sizes whose product is 4"), std::string::npos) << r.output;
}
