// The shipped examples as users run them: train_gpt under every layout flag the launcher takes
// (data parallel, ZeRO, tensor, pipeline and their combinations) against one process, the
// launcher's settings reaching the example unless its own flag is given, the tied head stepped
// once under every strategy, a layout flag that a program never acts on refused by name, and
// generate_gpt2 and generate_llm on several processes and with their blocks on disk.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <sstream>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "../../examples/common/gpt2.h"
#include "../common/launch.h"
#include "tandem/checkpoint/model_io.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/models/llama.h"

using tandem::testing::count_of;
using tandem::testing::launch;
using tandem::testing::LaunchOptions;

namespace {

const std::string kTrainGpt = TRAIN_GPT;
const std::string kTrainGptJobs = TRAIN_GPT_JOBS;  // train_gpt that runs a launch's jobs
const std::string kTrainMlp = TRAIN_MLP;
const std::string kTrainLlmJobs = TRAIN_LLM_JOBS;  // train_llm that runs a launch's jobs

// A small GPT, a few steps: seconds per run.
const std::vector<std::string> kSmallGpt{"--steps", "4", "--layers", "2", "--width", "64",
                                         "--heads", "4", "--context", "32", "--eval-every", "100",
                                         "--eval-batches", "2"};

// A fixed text for train_gpt (the default, this source tree, changes as it is edited): words
// drawn by a fixed linear congruential sequence, 256 KB.
const std::string& fixed_text() {
  static const std::string path = [] {
    const std::string p = tandem::testing::temp_path("examples", "text.txt");
    const char* words[] = {"the ", "rank ", "gradient ", "of ", "a ", "model ", "shard ",
                           "pipeline ", "tensor ", "sum ", "and ", "step ", "loss\n", "batch ",
                           "every ", "stage "};
    std::ofstream out(p, std::ios::binary);
    uint64_t x = 12345;
    for (size_t n = 0; n < 256 * 1024;) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      const char* w = words[(x >> 33) % 16];
      out << w;
      n += std::strlen(w);
    }
    return p;
  }();
  return path;
}

// train_gpt's arguments: `args` (the small GPT by default) on the fixed text.
std::vector<std::string> gpt_args(std::vector<std::string> args = kSmallGpt) {
  args.insert(args.end(), {"--text", fixed_text()});
  return args;
}

// One thread per rank, 240 s per job; `flags` go to the launcher.
LaunchOptions with_flags(std::vector<std::string> flags = {}) {
  return LaunchOptions().flags(std::move(flags)).timeout_s(240);
}

// The last loss of "loss fell from <a> to <b>", or NaN.
double final_loss(const std::string& output) {
  const auto at = output.rfind("loss fell from ");
  if (at == std::string::npos) return std::nan("");
  const auto to = output.find(" to ", at);
  return std::stod(output.substr(to + 4));
}

}  // namespace

// Every layout the README lists trains the example; tensor parallel equals the dense model on
// one process (the same global batch: dp 1), and pp 2 x tp 2 equals pp 2 (the pipeline's GPT has
// an untied head, so it is its own reference). The main process names the layout once.
TEST(Examples, TrainGptUnderEveryLayout) {
  // The runs of one size are jobs of one launch (launch_jobs_by_size), each with exactly the
  // variables its own launch would give it; the other tests launch the example itself.
  auto gpt = [](std::vector<std::string> flags) {
    return tandem::testing::Job{gpt_args(), with_flags(std::move(flags))};
  };
  auto runs = tandem::testing::launch_jobs_by_size(kTrainGptJobs, {
      {"one", 1, gpt({})},
      {"tp", 2, gpt({"--tp_size", "2"})},
      {"pp", 2, gpt({"--pp_size", "2"})},
      {"pptp", 4, gpt({"--pp_size", "2", "--tp_size", "2"})},
      // The launcher's schedules: interleaved 1F1B with 2 stages per rank (the embedding and
      // block 1 on rank 0, block 0 and the head on rank 1) and zero bubble train as 1F1B does.
      {"interleaved", 2, gpt({"--pp_size", "2", "--pp_schedule", "interleaved_1f1b",
                              "--pp_virtual_stages", "2"})},
      {"zero bubble", 2, gpt({"--pp_size", "2", "--pp_schedule", "zero_bubble"})},
      {"dp", 2, gpt({})},
      {"zero_tp", 4, gpt({"--tp_size", "2", "--use_deepspeed", "--zero_stage", "3"})}});
  for (const auto& [name, r] : runs) ASSERT_EQ(r.exit_code, 0) << name << ": " << r.output;
  const auto& one = runs["one"];
  EXPECT_EQ(count_of(one.output, "strategy ddp; mesh pp 1 x dp 1 x tp 1; precision no; "
                                 "gradient accumulation 1"), 1) << one.output;
  const auto& tp = runs["tp"];
  EXPECT_EQ(count_of(tp.output, "mesh pp 1 x dp 1 x tp 2"), 1) << tp.output;
  EXPECT_NEAR(final_loss(tp.output), final_loss(one.output), 1e-4) << tp.output << one.output;

  const auto& pp = runs["pp"];
  EXPECT_EQ(count_of(pp.output, "mesh pp 2 x dp 1 x tp 1"), 1) << pp.output;
  const auto& pptp = runs["pptp"];
  EXPECT_EQ(count_of(pptp.output, "mesh pp 2 x dp 1 x tp 2"), 1) << pptp.output;
  EXPECT_NEAR(final_loss(pptp.output), final_loss(pp.output), 1e-4) << pptp.output << pp.output;
  EXPECT_LT(final_loss(pp.output), 5.0) << pp.output;
  EXPECT_EQ(count_of(pp.output, "pipeline: schedule 1F1B, 1 stage(s) per rank, 2 micro-batches"), 1)
      << pp.output;
  for (const auto& [name, line] : std::vector<std::pair<std::string, std::string>>{
           {"interleaved", "pipeline: schedule Interleaved1F1B, 2 stage(s) per rank"},
           {"zero bubble", "pipeline: schedule ZeroBubble, 1 stage(s) per rank"}}) {
    const auto& other = runs[name];
    EXPECT_EQ(count_of(other.output, line), 1) << other.output;
    EXPECT_NEAR(final_loss(other.output), final_loss(pp.output), 1e-5) << other.output << pp.output;
  }

  // dp 2 x tp 2 under ZeRO-3 equals plain data parallel on 2 processes (the same global batch).
  const auto& dp = runs["dp"];
  const auto& zero_tp = runs["zero_tp"];
  EXPECT_EQ(count_of(zero_tp.output, "strategy zero-3 (ZeRO stage 3); mesh pp 1 x dp 2 x tp 2"), 1)
      << zero_tp.output;
  EXPECT_NEAR(final_loss(zero_tp.output), final_loss(dp.output), 1e-4) << zero_tp.output;
}

// The example GPT's head is tied to its token embedding, and LibTorch's parameters() lists that
// tensor twice: prepare(optimizer) keeps it once (saying so), so data parallel equals every ZeRO
// stage, as in PyTorch (before, data parallel stepped it twice: 5.260 against 5.133 after one
// step). The runs are jobs of one launch.
TEST(Examples, TiedHeadIsSteppedOnceUnderEveryStrategy) {
  const std::vector<std::vector<std::string>> strategies{
      {}, {"--use_deepspeed", "--zero_stage", "1"}, {"--use_deepspeed", "--zero_stage", "2"},
      {"--use_fsdp"}};
  std::vector<tandem::testing::Job> jobs;
  for (const auto& flags : strategies) jobs.push_back({gpt_args(), with_flags(flags)});
  auto runs = tandem::testing::launch_jobs(2, kTrainGptJobs, jobs);
  const auto& ddp = runs[0];
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  EXPECT_EQ(count_of(ddp.output, "prepare: the optimizer listed 1 tensor more than once"), 1)
      << ddp.output;
  for (size_t i = 1; i < runs.size(); ++i) {
    ASSERT_EQ(runs[i].exit_code, 0) << runs[i].output;
    EXPECT_NEAR(final_loss(runs[i].output), final_loss(ddp.output), 2e-5)
        << strategies[i][0] << "\n" << runs[i].output << ddp.output;
  }
}

// --activation_checkpointing recomputes the blocks in backward and changes nothing else: on 2
// data-parallel processes and under ZeRO-3 the example's losses equal those without it. (The
// tied head is left to the plain backward: checkpointed, its weight got its gradient twice.)
// The runs are jobs of one launch.
TEST(Examples, TrainGptUnderActivationCheckpointingEqualsWithout) {
  auto runs = tandem::testing::launch_jobs(
      2, kTrainGptJobs,
      {{gpt_args(), with_flags()},
       {gpt_args(), with_flags({"--activation_checkpointing"})},
       {gpt_args(),
        with_flags({"--activation_checkpointing", "--use_deepspeed", "--zero_stage", "3"})}});
  for (const auto& r : runs) ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto& plain = runs[0];
  const auto& ckpt = runs[1];
  const auto& zero3 = runs[2];
  EXPECT_EQ(count_of(ckpt.output, "activation checkpointing on"), 1) << ckpt.output;
  EXPECT_NEAR(final_loss(ckpt.output), final_loss(plain.output), 1e-5) << ckpt.output;
  EXPECT_NEAR(final_loss(zero3.output), final_loss(plain.output), 1e-4) << zero3.output;
}

// The launcher's --gradient_accumulation_steps reaches the examples, and their own --accumulate
// overrides it.
TEST(Examples, LauncherSettingsHoldUnlessTheExampleIsToldOtherwise) {
  std::vector<std::string> args = kSmallGpt;
  args.insert(args.end(), {"--accumulate", "3"});
  auto runs = tandem::testing::launch_jobs(  // jobs of one launch
      1, kTrainGptJobs,
      {{gpt_args(), with_flags({"--gradient_accumulation_steps", "2"})},
       {gpt_args(), with_flags()},
       {gpt_args(args), with_flags({"--gradient_accumulation_steps", "2"})}});
  const auto &launcher = runs[0], &plain = runs[1], &own = runs[2];
  ASSERT_EQ(launcher.exit_code, 0) << launcher.output;
  EXPECT_EQ(count_of(launcher.output, "gradient accumulation 2;"), 1) << launcher.output;
  EXPECT_GT(std::abs(final_loss(launcher.output) - final_loss(plain.output)), 1e-4)
      << "accumulation changed nothing\n"
      << launcher.output << plain.output;
  ASSERT_EQ(own.exit_code, 0) << own.output;
  EXPECT_EQ(count_of(own.output, "gradient accumulation 3;"), 1) << own.output;
  auto mlp = launch(1, kTrainMlp, {"--samples", "512", "--epochs", "1"},
                    with_flags({"--gradient_accumulation_steps", "4"}));
  ASSERT_EQ(mlp.exit_code, 0) << mlp.output;
  EXPECT_EQ(count_of(mlp.output, "gradient accumulation 4;"), 1) << mlp.output;
}

// A layout the program never acts on (train_mlp splits nothing) is refused at the first
// backward on every rank, naming the flag and the missing call; before, every rank trained the
// whole model and nothing was said.
TEST(Examples, LayoutFlagsAProgramNeverActsOnAreRefused) {
  const std::vector<std::string> mlp{"--samples", "512", "--epochs", "1"};
  auto tp = launch(2, kTrainMlp, mlp, with_flags({"--tp_size", "2"}));
  EXPECT_NE(tp.exit_code, 0) << tp.output;
  EXPECT_GE(count_of(tp.output, "backward: this run has tp_size 2"), 1) << tp.output;
  EXPECT_GE(count_of(tp.output, "acc.parallelize(model, plan)"), 1) << tp.output;
  auto pp = launch(2, kTrainMlp, mlp, with_flags({"--pp_size", "2"}));
  EXPECT_NE(pp.exit_code, 0) << pp.output;
  EXPECT_GE(count_of(pp.output, "backward: this run has pp_size 2"), 1) << pp.output;
  EXPECT_GE(count_of(pp.output, "acc.prepare_pipeline"), 1) << pp.output;
  // A pipeline does not accumulate across steps: its micro-batches are the accumulation.
  auto accumulated = launch(2, kTrainGpt, gpt_args(),
                            with_flags({"--pp_size", "2", "--gradient_accumulation_steps", "2"}));
  EXPECT_NE(accumulated.exit_code, 0) << accumulated.output;
  EXPECT_GE(count_of(accumulated.output, "prepare_pipeline: gradient_accumulation_steps is 2"), 1)
      << accumulated.output;
}

namespace {

const std::string kGenerateGpt2 = GENERATE_GPT2;
const std::string kGenerateLlm = GENERATE_LLM;
// The two that run a launch's jobs (tandem::testing::launch_jobs).
const std::string kGenerateGpt2Jobs = GENERATE_GPT2_JOBS;
const std::string kGenerateLlmJobs = GENERATE_LLM_JOBS;

// A small GPT-2 checkpoint as save_pretrained lays it out: config.json and model.safetensors.
const std::string& small_gpt2() {
  static const std::string dir = [] {
    const std::string d = tandem::testing::temp_path("examples", "gpt2");
    std::filesystem::create_directories(d);
    examples::GPT2Config c;
    c.vocab_size = 101;
    c.n_positions = 32;
    c.n_embd = 32;
    c.n_layer = 3;
    c.n_head = 2;
    torch::manual_seed(11);
    examples::GPT2LMHeadModel model(c);
    tandem::checkpoint::save_model(*model, d);
    std::ofstream(d + "/config.json")
        << "{\"model_type\": \"gpt2\", \"vocab_size\": 101, \"n_positions\": 32, \"n_embd\": 32, "
           "\"n_layer\": 3, \"n_head\": 2}";
    return d;
  }();
  return dir;
}

// A small Qwen3 checkpoint (tied head, grouped-query attention) as save_pretrained lays it out.
const std::string& small_llm() {
  static const std::string dir = [] {
    const std::string d = tandem::testing::temp_path("examples", "qwen3");
    std::filesystem::create_directories(d);
    const std::string config =
        "{\"model_type\": \"qwen3\", \"vocab_size\": 101, \"hidden_size\": 32, "
        "\"intermediate_size\": 48, \"num_hidden_layers\": 3, \"num_attention_heads\": 4, "
        "\"num_key_value_heads\": 2, \"head_dim\": 8, \"tie_word_embeddings\": true, "
        "\"max_position_embeddings\": 64}";
    torch::manual_seed(11);
    tandem::models::LlamaForCausalLM model(
        tandem::models::LlamaConfig::from_json_text(config, "small_llm"));
    tandem::checkpoint::save_model(*model, d);
    std::ofstream(d + "/config.json") << config;
    return d;
  }();
  return dir;
}

// The `tokens: ...` lines of a run, in order.
std::vector<std::string> token_lines(const std::string& output) {
  std::vector<std::string> out;
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    // "tokens: ..." or "[rank r] tokens: ..." (not a device map's "model.embed_tokens: disk").
    const auto at = line.find("tokens: ");
    if (at != std::string::npos && (at == 0 || line.compare(at - 2, 2, "] ") == 0))
      out.push_back(line.substr(at));
  }
  return out;
}

const std::vector<std::string> kPrompts{"--prompt_ids", "1,2,3", "--prompt_ids", "40,41",
                                        "--prompt_ids", "7", "--max_new_tokens", "6"};

std::vector<std::string> generate_args(const std::string& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> args{dir};
  args.insert(args.end(), kPrompts.begin(), kPrompts.end());
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// A generation example under the launcher: the prompts split between the processes give the
// lines of one process, in prompt order, also with every block on disk; the layouts it does not
// compute (tensor, pipeline, sharded, mixed precision) and flags without the cap they need are
// refused. `program` runs a launch's jobs: one launch per number of ranks, the refusals (every
// rank refuses alike) as jobs that may fail.
void expect_generation_under_the_launcher(const std::string& program, const std::string& dir) {
  using Run = std::tuple<std::string, int, tandem::testing::Job>;
  std::vector<Run> runs{{"one", 1, {generate_args(dir), with_flags()}},
                        {"two", 2, {generate_args(dir), with_flags()}},
                        {"disk", 2, {generate_args(dir, {"--max_memory", "1KB"}), with_flags()}}};
  std::map<std::string, std::string> words;  // what each refusal says
  auto refused = [&](int n, std::vector<std::string> flags, std::vector<std::string> extra,
                     const std::string& what) {
    const std::string name = "refused " + std::to_string(runs.size());
    tandem::testing::Job job{generate_args(dir, std::move(extra)), with_flags(std::move(flags))};
    job.may_fail = true;
    runs.emplace_back(name, n, std::move(job));
    words[name] = what;
  };
  refused(2, {"--tp_size", "2"}, {}, "runs data-parallel inference");
  refused(2, {"--pp_size", "2"}, {}, "runs data-parallel inference");
  refused(2, {"--use_deepspeed", "--zero_stage", "3"}, {}, "runs data-parallel inference");
  refused(1, {"--mixed_precision", "bf16"}, {}, "computes in float32");
  refused(1, {}, {"--offload_dir", "/tmp/x"}, "give --max_memory");
  refused(1, {}, {"--quantize", "int8", "--max_memory", "1KB"}, "tandem quantize");
  refused(1, {}, {"--attention", "flash"}, "expected auto, sdpa or manual");
  if (!torch::cuda::is_available()) refused(1, {}, {"--device", "cuda:0"}, "no CUDA device");
  auto r = tandem::testing::launch_jobs_by_size(program, runs);
  ASSERT_EQ(r["one"].exit_code, 0) << r["one"].output;
  const auto want = token_lines(r["one"].output);
  ASSERT_EQ(want.size(), 3u) << r["one"].output;
  ASSERT_EQ(r["two"].exit_code, 0) << r["two"].output;
  EXPECT_EQ(token_lines(r["two"].output), want) << r["two"].output;
  ASSERT_EQ(r["disk"].exit_code, 0) << r["disk"].output;
  EXPECT_EQ(token_lines(r["disk"].output), want) << r["disk"].output;
  EXPECT_GE(count_of(r["disk"].output, "disk reads"), 1) << r["disk"].output;
  for (const auto& [name, what] : words) {
    EXPECT_GT(r[name].exit_code, 0) << name << ": " << r[name].output;
    EXPECT_GE(count_of(r[name].output, what), 1) << what << "\n" << r[name].output;
  }
}

}  // namespace

// generate_gpt2 and generate_llm (one body, examples/common/generate.h) under the launcher;
// tests/oracle/gpt2_oracle.py and llama_generate_oracle.py hold their tokens to transformers'.
TEST(Examples, GenerateGpt2UnderTheLauncher) {
  expect_generation_under_the_launcher(kGenerateGpt2Jobs, small_gpt2());
}

TEST(Examples, GenerateLlmUnderTheLauncher) {
  expect_generation_under_the_launcher(kGenerateLlmJobs, small_llm());
}


// train_llm's checkpoints: --checkpoint_every 2 (asynchronous) of 4 steps; its step-2 checkpoint
// alone, resumed with --resume, ends bitwise where the uninterrupted run ended, and resumed on
// tensor parallel 2 (another layout: resharded) within float rounding of it, and to and from ZeRO-3
// x context parallel 2; the flags without what they need are refused.
TEST(Examples, TrainLlmResumesFromItsCheckpoints) {
  // The runs are jobs of launches by size, in two rounds: the runs that write the step-2
  // checkpoints (and the refusals), then the runs that resume from copies of them.
  const auto dir = tandem::testing::temp_path("examples", "llm_ckpt");
  std::filesystem::remove_all(dir);
  const std::vector<std::string> args{"--steps", "4", "--seq_len", "32", "--batch_size", "2",
                                      "--text", fixed_text()};
  auto with = [&](std::vector<std::string> extra) {
    auto a = args;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  using tandem::testing::Job;
  auto first = tandem::testing::launch_jobs_by_size(
      kTrainLlmJobs, {{"a", 1,
                       Job{with({"--checkpoint_every", "2", "--checkpoint_async", "--project_dir",
                                 dir + "/a", "--save", dir + "/out_a"}),
                           with_flags()}},
                      // Note [Context parallel]: ZeRO-3 over dp_shard x cp (every sequence split
                      // over 2 ranks, the global batch the same), checkpointing at step 2.
                      {"e", 2,
                       Job{with({"--checkpoint_every", "2", "--project_dir", dir + "/e", "--save",
                                 dir + "/out_e"}),
                           with_flags({"--use_fsdp", "--cp_size", "2"})}},
                      {"resume alone", 1, Job{with({"--resume"}), with_flags(), true}},
                      {"async alone", 1, Job{with({"--checkpoint_async"}), with_flags(), true}}});
  ASSERT_EQ(first["a"].exit_code, 0) << first["a"].output;
  ASSERT_TRUE(std::filesystem::exists(dir + "/a/checkpoints/checkpoint_1/manifest.json"))
      << first["a"].output;
  ASSERT_EQ(first["e"].exit_code, 0) << first["e"].output;
  for (const auto& [name, words] : std::vector<std::pair<std::string, std::string>>{
           {"resume alone", "--resume needs --project_dir"},
           {"async alone", "give --checkpoint_every N"}}) {
    EXPECT_NE(first[name].exit_code, 0) << first[name].output;
    EXPECT_GE(count_of(first[name].output, words), 1) << words << "\n" << first[name].output;
  }
  // The step-2 checkpoint alone, resumed with --resume: on the same layout (b), on tensor
  // parallel 2 (c: resharded), on ZeRO-3 x context parallel 2 (d), and e's, which that layout
  // wrote, on one process (f).
  auto resume_from_step_2 = [&](const std::string& name, const std::string& from,
                                std::vector<std::string> flags) {
    std::filesystem::create_directories(dir + "/" + name + "/checkpoints");
    std::filesystem::copy(dir + "/" + from + "/checkpoints/checkpoint_0",
                          dir + "/" + name + "/checkpoints/checkpoint_0",
                          std::filesystem::copy_options::recursive);
    return Job{
        with({"--resume", "--project_dir", dir + "/" + name, "--save", dir + "/out_" + name}),
        with_flags(std::move(flags))};
  };
  auto second = tandem::testing::launch_jobs_by_size(
      kTrainLlmJobs, {{"b", 1, resume_from_step_2("b", "a", {})},
                      {"f", 1, resume_from_step_2("f", "e", {})},
                      {"c", 2, resume_from_step_2("c", "a", {"--tp_size", "2"})},
                      {"d", 2, resume_from_step_2("d", "a", {"--use_fsdp", "--cp_size", "2"})}});
  for (const std::string name : {"b", "c", "d", "f"}) {
    EXPECT_EQ(second[name].exit_code, 0) << name << ": " << second[name].output;
    EXPECT_EQ(count_of(second[name].output, "at step 2"), 1) << name << ": " << second[name].output;
  }
  // Resumed on the same layout, it ends bitwise where the uninterrupted run ended.
  std::ifstream fa(dir + "/out_a/model.safetensors", std::ios::binary),
      fb(dir + "/out_b/model.safetensors", std::ios::binary);
  const std::string a_bytes((std::istreambuf_iterator<char>(fa)), {}),
      b_bytes((std::istreambuf_iterator<char>(fb)), {});
  ASSERT_GT(a_bytes.size(), 1000u);
  EXPECT_TRUE(a_bytes == b_bytes) << "resumed on the same layout, the model differs";
  EXPECT_EQ(count_of(second["c"].output, "resharded"), 1) << second["c"].output;
  tandem::checkpoint::SafetensorsFile want(dir + "/out_a/model.safetensors"),
      got(dir + "/out_c/model.safetensors");
  for (const auto& name : want.names()) {
    auto w = want.tensor(name), g = got.tensor(name);
    EXPECT_LE((w - g).abs().max().item<double>(), 1e-5 * w.abs().max().item<double>()) << name;
  }
  // To and from ZeRO-3 x cp 2, each within float rounding of the uninterrupted run (and that
  // layout's own uninterrupted run too): within 1% of the distance 4 AdamW steps can move an
  // element (4 x lr 3e-3). AdamW gives an element whose gradient is near zero a step of
  // rounding's sign (seen: 2e-5); a checkpoint restored wrong (moments, step, schedule, data
  // position) moves elements by whole steps.
  auto near_a = [&](const std::string& out) {
    tandem::checkpoint::SafetensorsFile w(dir + "/out_a/model.safetensors"),
        g(dir + "/" + out + "/model.safetensors");
    for (const auto& name : w.names())
      EXPECT_LE((w.tensor(name) - g.tensor(name)).abs().max().item<double>(), 1e-2 * 4 * 3e-3)
          << out << ": " << name;
  };
  EXPECT_EQ(count_of(second["d"].output, "context parallel: cp 2"), 1) << second["d"].output;
  near_a("out_d");
  near_a("out_e");
  near_a("out_f");
  std::filesystem::remove_all(dir);
}

// train_llm (the Llama family; tests/oracle/llama_training_oracle.py holds its layouts to
// PyTorch's own steps): the launcher's accumulation and precision take effect and equal data
// parallel's arithmetic where they should, and what the example cannot do is refused by name:
// a pipeline over a tied head, --microbatches without a pipeline, a tp size that splits heads, a model whose vocabulary the byte data overflows, and
// data shorter than a global batch.
TEST(Examples, TrainLlmTakesTheLaunchersSettingsAndRefusesWhatItCannotDo) {
  // The runs of one size are jobs of one launch (launch_jobs_by_size): each job gets exactly the
  // variables its own launch would give it; a refusal is a job that may fail.
  const std::vector<std::string> args{"--steps", "4", "--seq_len", "32", "--batch_size", "2",
                                      "--text", fixed_text()};
  const auto logs = tandem::testing::temp_path("examples", "llm_logs");
  auto dp_args = args;
  dp_args.insert(dp_args.end(), {"--log_with", "jsonl", "--project_dir", logs});
  // Accumulating 2 micro-steps of 1 sequence equals 1 step of 2 sequences.
  auto accum_args = args;
  accum_args[5] = "1";
  auto micro_args = args;
  micro_args.insert(micro_args.end(), {"--microbatches", "2"});
  const auto config = tandem::testing::temp_path("examples", "small_vocab.json");
  std::ofstream(config) << R"({"model_type": "qwen3", "vocab_size": 100, "hidden_size": 32,
      "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
      "num_key_value_heads": 1, "head_dim": 16})";
  // A mixture of experts whose loss adds the load-balancing term trains (experts a rank's batch
  // did not choose have no gradient there), and under activation checkpointing, where the
  // router's logits would carry no gradient, is refused naming the fix.
  const auto moe = tandem::testing::temp_path("examples", "moe.json");
  std::ofstream(moe) << R"({"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 32,
      "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 24, "output_router_logits": true, "router_aux_loss_coef": 0.5})";
  auto moe_args = args;
  moe_args.insert(moe_args.end(), {"--config", moe});
  const auto data = tandem::testing::temp_path("examples", "short.jsonl");
  std::ofstream(data) << "{\"input_ids\": [1, 2, 3]}\n";
  using tandem::testing::Job;
  auto refusal = [](std::vector<std::string> a, std::vector<std::string> flags) {
    return Job{std::move(a), with_flags(std::move(flags)), true};
  };
  auto runs = tandem::testing::launch_jobs_by_size(
      kTrainLlmJobs,
      {{"dp", 2, Job{dp_args, with_flags()}},
       {"accum", 2, Job{accum_args, with_flags({"--gradient_accumulation_steps", "2"})}},
       {"bf16", 2, Job{args, with_flags({"--mixed_precision", "bf16"})}},
       // Pipeline stages (tests/oracle/llama_training_oracle.py trains them): a head tied to the
       // embedding cannot be split from it, and --microbatches without a pipeline would act on
       // nothing.
       {"pp", 2, refusal(args, {"--pp_size", "2"})},
       {"micro", 1, refusal(micro_args, {})},
       {"tp3", 3, refusal(args, {"--tp_size", "3"})},
       {"vocab", 1, refusal({"--config", config, "--steps", "1"}, {})},
       {"sparse", 2, Job{moe_args, with_flags()}},
       // On pipeline stages the load-balancing loss cannot be summed (its router logits stay on
       // their stages): refused naming the key.
       {"sparse_pp", 2, refusal(moe_args, {"--pp_size", "2"})},
       {"sparse_ckpt", 2, refusal(moe_args, {"--activation_checkpointing"})},
       {"short_data", 2, refusal({"--config", config, "--data", data, "--steps", "1"}, {})}});
  for (const std::string name : {"dp", "accum", "bf16", "sparse"})
    ASSERT_EQ(runs[name].exit_code, 0) << name << ": " << runs[name].output;
  const auto& dp = runs["dp"];
  EXPECT_EQ(count_of(dp.output, "llama with"), 1) << dp.output;
  EXPECT_EQ(count_of(dp.output, "MFU"), 1) << dp.output;  // the report at step 4
  std::ifstream metrics(logs + "/logs/train_llm/metrics.jsonl");
  const std::string logged((std::istreambuf_iterator<char>(metrics)), {});
  EXPECT_NE(logged.find("\"mfu\""), std::string::npos) << logged;
  EXPECT_NE(logged.find("\"tokens_per_s\""), std::string::npos) << logged;
  const auto& accum = runs["accum"];
  EXPECT_EQ(count_of(accum.output, "gradient accumulation 2"), 1) << accum.output;
  EXPECT_NEAR(final_loss(accum.output), final_loss(dp.output), 1e-5) << accum.output;
  const auto& bf16 = runs["bf16"];
  EXPECT_EQ(count_of(bf16.output, "precision bf16"), 1) << bf16.output;
  EXPECT_NEAR(final_loss(bf16.output), final_loss(dp.output), 0.05) << bf16.output;
  EXPECT_NE(final_loss(bf16.output), final_loss(dp.output)) << "bf16 changed nothing";
  EXPECT_EQ(count_of(runs["sparse"].output, "qwen3_moe with"), 1) << runs["sparse"].output;
  for (const auto& [name, words] : std::vector<std::pair<std::string, std::string>>{
           {"pp", "with tie_word_embeddings true cannot be split into pipeline stages"},
           {"micro", "--microbatches 2 splits a pipeline's batch, and this run has no pipeline"},
           {"tp3",
            "tensor parallel size 3 does not divide the llama model's "
            "num_attention_heads (4)"},
           {"vocab", "vocab_size is 100; give --data"},
           {"sparse_pp", "set \"output_router_logits\": false, or train without --pp_size"},
           {"sparse_ckpt",
            "Turn activation checkpointing off for this model, or set "
            "output_router_logits to false"},
           {"short_data", "fewer than one global batch"}}) {
    EXPECT_NE(runs[name].exit_code, 0) << name << ": " << runs[name].output;
    EXPECT_NE(runs[name].output.find(words), std::string::npos) << name << ": " << words << "\n"
                                                                << runs[name].output;
  }
}
