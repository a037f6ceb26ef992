// The layout planner without processes: the model's tensors and their per-rank counts under tp
// and pp (checked against the example GPT's own count), the rules of enumeration, the memory
// prediction's terms, the config file a layout becomes, and the program's placeholders.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "../common/errors.h"
#include "../common/temp_dir.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/config/config.h"
#include "tandem/track/memory_estimate.h"
#include "tandem/parallel/pipeline.h"
#include "tandem/trials/plan.h"

namespace tt = tandem::trials;
using tandem::testing::error_of;

namespace {

tt::PlanMachine machine(int n, double memory = 1e12) {
  tt::PlanMachine m;
  m.num_processes = n;
  m.memory_per_process = memory;
  return m;
}

}  // namespace

TEST(PlanModel, GptCountsWhatTheMemoryEstimateCounts) {
  for (auto [l, h, v, c] :
       std::vector<std::array<int64_t, 4>>{{4, 256, 256, 64}, {12, 768, 50257, 1024}}) {
    const auto m = tt::gpt_plan_model(l, h, 4, v, c);
    EXPECT_EQ(m.num_parameters(), tandem::track::count_gpt_parameters({l, h, v, c}).num_parameters);
    EXPECT_EQ(m.blocks, l);
  }
  EXPECT_NE(error_of([] { tt::gpt_plan_model(4, 250, 4, 256, 64); }).find("multiple of heads"),
            std::string::npos);
  EXPECT_NE(error_of([] { tt::gpt_plan_model(0, 256, 4, 256, 64); }).find("positive"),
            std::string::npos);
}

TEST(PlanModel, RankParametersFollowTheSplits) {
  const int64_t h = 256, v = 256, c = 64;
  const auto m = tt::gpt_plan_model(4, h, 4, v, c);
  tt::Layout l;
  auto one = tt::rank_parameters(m, l);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].parameters, m.num_parameters());
  EXPECT_EQ(one[0].largest_unit, 12 * h * h + 13 * h);  // a block
  // Tensor parallel: the block's matrices, qkv's and fc's biases and the token embedding split.
  l.tp = 2;
  const int64_t block_tp = 12 * h * h / 2 + (3 * h + 4 * h) / 2 + 6 * h;
  EXPECT_EQ(tt::rank_parameters(m, l)[0].parameters, v * h / 2 + c * h + 4 * block_tp + 2 * h);
  // A pipeline of 2 over 6 children (embeddings, 4 blocks, head): split_sequential's rule puts
  // the embeddings and 2 blocks on stage 0, 2 blocks and the head on stage 1, which keeps its
  // own copy of the tied token embedding.
  l.tp = 1;
  l.pp = 2;
  l.microbatches = 4;
  const auto pp = tt::rank_parameters(m, l);
  ASSERT_EQ(pp.size(), 2u);
  const int64_t block = 12 * h * h + 13 * h;
  EXPECT_EQ(pp[0].parameters, v * h + c * h + 2 * block);
  EXPECT_EQ(pp[1].parameters, 2 * block + 2 * h + v * h);
  EXPECT_EQ(pp[0].in_flight, 2);  // 1F1B: min(m, pp - stage)
  EXPECT_EQ(pp[1].in_flight, 1);
  EXPECT_NEAR(pp[0].activation_share + pp[1].activation_share, 1.0, 1e-12);
}

// Interleaved stages: with 2 stages per rank over 2 ranks the 6 children (embeddings, 4 blocks,
// head) become 4 stages, rank 0 holding children 0 and 3 (the embeddings and block 2), rank 1
// children 1-2 and 4-5; each rank's micro-batches in flight are those the schedule's simulator
// finds (its warm-up plus one), of stages 1/v of its share. Every layout's flags and config name
// the schedule.
TEST(PlanModel, InterleavedStagesFollowTheSchedule) {
  const int64_t h = 256, v = 256, c = 64;
  const auto m = tt::gpt_plan_model(4, h, 4, v, c);
  const int64_t block = 12 * h * h + 13 * h;
  tt::Layout l;
  l.pp = 2;
  l.virtual_stages = 2;
  l.microbatches = 4;
  const auto r = tt::rank_parameters(m, l);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].parameters, v * h + c * h + block);
  EXPECT_EQ(r[1].parameters, 3 * block + 2 * h + v * h);  // the head keeps a tied copy
  const auto sim = tandem::parallel::simulate_schedule(tandem::parallel::pipeline_schedule(
      tandem::parallel::ScheduleKind::kInterleaved1F1B, 2, 4, 2));
  ASSERT_TRUE(sim.error.empty()) << sim.error;
  for (int s = 0; s < 2; ++s) EXPECT_EQ(r[s].in_flight, sim.max_in_flight[s]) << "rank " << s;
  EXPECT_NEAR(2 * (r[0].activation_share + r[1].activation_share), 1.0, 1e-12);
  EXPECT_EQ(l.name(), "dp1 pp2 v2 mb1 m4");
  const auto flags = tt::launch_flags(l, machine(2), "");
  const std::vector<std::string> tail{"--pp_size", "2", "--pp_schedule", "interleaved_1f1b",
                                      "--pp_virtual_stages", "2"};
  EXPECT_NE(std::search(flags.begin(), flags.end(), tail.begin(), tail.end()), flags.end());
  auto cfg = tandem::config::parse_config(
      tandem::config::to_yaml(tt::layout_config(l, machine(2), "")), "plan.yaml");
  EXPECT_EQ(cfg.parallelism_config.at("pp_schedule"), "Interleaved1F1B");
  EXPECT_EQ(cfg.parallelism_config.at("pp_virtual_stages"), "2");
  // Enumerated only when asked, and only where the schedule runs: m a multiple of pp, pp x v
  // children at most.
  tt::PlanSearch search;
  search.global_batch = 4;
  auto count_v = [&](int want) {
    std::vector<std::string> excluded;
    int n = 0;
    for (const auto& x : tt::enumerate_layouts(m, machine(2), search, &excluded))
      n += x.pp == 2 && x.virtual_stages == want;
    return n;
  };
  EXPECT_EQ(count_v(2), 0);
  search.virtual_stages = {1, 2};
  EXPECT_GT(count_v(2), 0);
  EXPECT_GT(count_v(1), 0);
  std::vector<std::string> excluded;
  for (const auto& x : tt::enumerate_layouts(m, machine(2), search, &excluded))
    if (x.virtual_stages == 2) {
      EXPECT_EQ(x.microbatches % 2, 0) << x.name();
    }
  search.virtual_stages = {4};  // 8 stages of 6 children
  excluded.clear();
  for (const auto& x : tt::enumerate_layouts(m, machine(2), search, &excluded))
    EXPECT_NE(x.pp, 2) << x.name();
  bool said = false;
  for (const auto& e : excluded) said |= e.find("interleaved 1F1B needs") != std::string::npos;
  EXPECT_TRUE(said);
}

TEST(PlanModel, SafetensorsHeaderGivesBlocksAndTies) {
  tandem::testing::TempDir dir;
  const std::string path = dir.str() + "/model.safetensors";
  // A transformers-style GPT-2 without lm_head (tied), two blocks.
  tandem::checkpoint::NamedTensors t{{"transformer.wte.weight", torch::zeros({50, 8})},
                                     {"transformer.wpe.weight", torch::zeros({16, 8})},
                                     {"transformer.h.0.attn.c_attn.weight", torch::zeros({8, 24})},
                                     {"transformer.h.0.ln_1.weight", torch::zeros({8})},
                                     {"transformer.h.1.attn.c_attn.weight", torch::zeros({8, 24})},
                                     {"transformer.h.1.ln_1.weight", torch::zeros({8})},
                                     {"transformer.ln_f.weight", torch::zeros({8})}};
  tandem::checkpoint::save_safetensors(path, t);
  const auto m = tt::safetensors_plan_model(dir.str(), /*heads=*/2);
  EXPECT_EQ(m.blocks, 2);
  EXPECT_EQ(m.vocab, 50);
  EXPECT_EQ(m.hidden, 8);
  EXPECT_EQ(m.num_parameters(), 50 * 8 + 16 * 8 + 2 * (8 * 24 + 8) + 8);
  int tied = 0;
  for (const auto& x : m.tensors) {
    if (x.tied_to_head) ++tied;
    if (x.name == "transformer.wpe.weight") {
      EXPECT_FALSE(x.tp_split);
    }
    if (x.name == "transformer.h.1.ln_1.weight") {
      EXPECT_EQ(x.block, 1);
    }
    if (x.name == "transformer.ln_f.weight") {
      EXPECT_EQ(x.block, tt::PlanTensor::kAfterBlocks);
    }
  }
  EXPECT_EQ(tied, 1);  // the token embedding
  EXPECT_NE(error_of([&] { tt::safetensors_plan_model(dir.str() + "/none"); }).find("no such"),
            std::string::npos);
}

TEST(Enumerate, FollowsTheRules) {
  const auto m = tt::gpt_plan_model(4, 256, 4, 256, 64);
  tt::PlanSearch s;
  s.global_batch = 8;
  std::vector<std::string> excluded;
  const auto layouts = tt::enumerate_layouts(m, machine(4), s, &excluded);
  ASSERT_FALSE(layouts.empty());
  std::set<std::string> names;
  for (const auto& l : layouts) {
    EXPECT_TRUE(names.insert(l.name()).second) << "twice: " << l.name();
    EXPECT_EQ(l.dp * l.tp * l.pp, 4) << l.name();
    EXPECT_EQ(l.dp * l.batch_per_rank() * l.accumulation, 8) << l.name();
    if (l.pp > 1) {
      EXPECT_EQ(l.zero_stage, 0) << l.name();
      EXPECT_EQ(l.accumulation, 1) << l.name();
      EXPECT_GE(l.microbatches, l.pp) << l.name();
    }
    if (l.dp == 1) {
      EXPECT_EQ(l.zero_stage, 0) << l.name();
    }
    EXPECT_TRUE(l.offload.empty()) << "no --offload_dir: " << l.name();
  }
  // Every ZeRO stage, tp 4 and pp 4, checkpointing on and off, are among them.
  for (const char* want : {"dp4 zero3 mb2", "dp1 tp4 mb1 ga8", "dp1 pp4 mb2 m4 ckpt",
                           "dp2 tp2 zero2 mb4", "dp4 mb1 ga2 ckpt"})
    EXPECT_TRUE(names.count(want)) << want;
  const std::string all = [&] {
    std::string s2;
    for (const auto& e : excluded) s2 += e + "\n";
    return s2;
  }();
  EXPECT_NE(all.find("ZeRO stages do not combine with a pipeline"), std::string::npos) << all;
  EXPECT_NE(all.find("--offload_dir"), std::string::npos) << all;

  // 3 heads: tp 2 and 4 are out, with the reason.
  excluded.clear();
  const auto m3 = tt::gpt_plan_model(4, 252, 3, 256, 64);
  for (const auto& l : tt::enumerate_layouts(m3, machine(4), s, &excluded)) EXPECT_EQ(l.tp, 1);
  EXPECT_TRUE(std::any_of(excluded.begin(), excluded.end(), [](const std::string& e) {
    return e.find("tp must divide the heads 3: tp2 pp1 dp2") != std::string::npos;
  }));
  // Two machines of 2: tp 4 would cross machines.
  excluded.clear();
  auto two = machine(4);
  two.num_machines = 2;
  for (const auto& l : tt::enumerate_layouts(m, two, s, &excluded)) EXPECT_LE(l.tp, 2);
  // Offload searched with a directory, only under ZeRO.
  s.offload_dir = "/tmp/x";
  int offloaded = 0;
  for (const auto& l : tt::enumerate_layouts(m, machine(2), s, nullptr))
    if (!l.offload.empty()) {
      ++offloaded;
      EXPECT_EQ(l.offload, "nvme");
      EXPECT_GT(l.zero_stage, 0);
    }
  EXPECT_GT(offloaded, 0);
  // A global batch that no dp divides leaves nothing, said.
  s.global_batch = 0;
  EXPECT_NE(error_of([&] { tt::enumerate_layouts(m, machine(2), s, nullptr); }).find("positive"),
            std::string::npos);
}

TEST(Predict, TermsFollowTheFormulas) {
  const auto m = tt::gpt_plan_model(4, 512, 4, 256, 64);
  const double n = static_cast<double>(m.num_parameters());
  tt::ProbeFigures f;
  f.baseline_rss = 100e6;
  f.rss_overhead = 10e6;
  f.workspace = 5e6;
  f.activations_per_sample = 1e6;
  f.checkpointed_per_sample = 0.25e6;
  f.rss_per_peer = 2e6;
  tt::Layout l;
  l.dp = 4;
  l.micro_batch = 2;
  auto p = tt::predict_memory(m, l, f);
  EXPECT_DOUBLE_EQ(p.model_states, 16 * n);
  EXPECT_DOUBLE_EQ(p.buffers, 4 * n);
  EXPECT_DOUBLE_EQ(p.activations, 2e6);
  EXPECT_DOUBLE_EQ(p.tensor_peak, 5e6 + 20 * n + 2e6);
  EXPECT_DOUBLE_EQ(p.rss_peak, 100e6 + p.tensor_peak + 10e6 + 3 * 2e6);
  l.activation_checkpointing = true;
  EXPECT_DOUBLE_EQ(tt::predict_memory(m, l, f).activations, 0.5e6);
  l.activation_checkpointing = false;
  // ZeRO-1: 8P + 8P/W, a unit's all-gather (2B) after the activations (Note [One memory model]).
  l.zero_stage = 1;
  p = tt::predict_memory(m, l, f);
  EXPECT_DOUBLE_EQ(p.model_states, 8 * n + 2 * n);
  const double bucket = tandem::track::default_bucket_bytes(n);
  EXPECT_DOUBLE_EQ(p.tensor_peak, 5e6 + 10 * n + std::max(2 * bucket, 2e6));
  EXPECT_DOUBLE_EQ(p.model_states + p.buffers,
                   tandem::track::strategy_memory(1, n, 4, bucket, 0, 0).total());
  // A probed buffer term replaces the formula's.
  f.zero_buffers[{1, 1}] = 5.0;
  EXPECT_DOUBLE_EQ(tt::predict_memory(m, l, f).buffers, 5 * n);
  // ZeRO-3 shrinks with W; its buffers follow the largest unit.
  l.zero_stage = 3;
  const auto z3_4 = tt::predict_memory(m, l, f);
  l.dp = 2;
  const auto z3_2 = tt::predict_memory(m, l, f);
  EXPECT_LT(z3_4.model_states, z3_2.model_states);
  EXPECT_DOUBLE_EQ(z3_4.buffers, z3_2.buffers);
  // Optimizer state on disk drops the moments.
  l.offload = "nvme";
  EXPECT_LT(tt::predict_memory(m, l, f).model_states, z3_2.model_states);
  // A pipeline: no buckets; the stage with the most is the one reported.
  tt::Layout pp;
  pp.dp = 2;
  pp.pp = 2;
  pp.microbatches = 2;
  p = tt::predict_memory(m, pp, f);
  EXPECT_DOUBLE_EQ(p.buffers, 0.0);
  const auto ranks = tt::rank_parameters(m, pp);
  EXPECT_EQ(p.parameters, std::max(ranks[0].parameters, ranks[1].parameters));
}

TEST(Layouts, BecomeLaunchFlagsAndAConfigTheLauncherReads) {
  tt::Layout l;
  l.dp = 2;
  l.tp = 2;
  l.zero_stage = 2;
  l.accumulation = 2;
  l.activation_checkpointing = true;
  const auto m = machine(4);
  const auto flags = tt::launch_flags(l, m, "");
  const std::vector<std::string> want{"--num_processes",
                                      "4",
                                      "--cpu",
                                      "--use_deepspeed",
                                      "--zero_stage",
                                      "2",
                                      "--tp_size",
                                      "2",
                                      "--gradient_accumulation_steps",
                                      "2",
                                      "--activation_checkpointing"};
  EXPECT_EQ(flags, want);
  auto cfg = tt::layout_config(l, m, "");
  tandem::config::validate(cfg);
  const auto back = tandem::config::parse_config(tandem::config::to_yaml(cfg), "plan.yaml");
  EXPECT_EQ(back.distributed_type, "DEEPSPEED");
  EXPECT_EQ(back.num_processes, 4);
  EXPECT_EQ(back.gradient_accumulation_steps, 2);
  EXPECT_EQ(back.deepspeed_config.at("zero_stage"), "2");
  EXPECT_EQ(back.parallelism_config.at("parallelism_config_tp_size"), "2");
  EXPECT_EQ(back.fsdp_config.at("fsdp_activation_checkpointing"), "true");
  EXPECT_TRUE(tandem::config::not_acted_on(back).empty());
  // A pipeline: MULTI_CPU with pp_size; offload to disk carries its directory.
  tt::Layout p;
  p.pp = 4;
  p.microbatches = 4;
  auto pc = tandem::config::parse_config(tandem::config::to_yaml(tt::layout_config(p, m, "")), "x");
  EXPECT_EQ(pc.distributed_type, "MULTI_CPU");
  EXPECT_EQ(pc.parallelism_config.at("pp_size"), "4");
  tt::Layout o;
  o.dp = 4;
  o.zero_stage = 3;
  o.offload = "nvme";
  const auto oc = tt::layout_config(o, m, "/data/opt");
  EXPECT_EQ(oc.deepspeed_config.at("offload_optimizer_nvme_path"), "/data/opt");
}

TEST(Layouts, PlaceholdersInTheProgramsArguments) {
  tt::Layout l;
  l.pp = 2;
  l.micro_batch = 3;
  l.microbatches = 4;
  const std::vector<std::string> args{"--batch-size",      "{batch_size}", "--microbatches",
                                      "{microbatches}",    "--steps",      "{steps}",
                                      "--x={accumulation}"};
  const std::vector<std::string> want{"--batch-size", "12", "--microbatches", "4",
                                      "--steps",      "5",  "--x=1"};
  EXPECT_EQ(tt::program_args(args, l, 5), want);
  EXPECT_EQ(tt::program_args(args, l, 0)[5], "{steps}");  // a printed command keeps it
  EXPECT_EQ(l.name(), "dp1 pp2 mb3 m4");
}

TEST(Predict, OrderGuessPrefersFewerCosts) {
  tt::Layout plain;
  plain.dp = 4;
  plain.micro_batch = 4;
  tt::Layout ckpt = plain;
  ckpt.activation_checkpointing = true;
  tt::Layout small = plain;
  small.micro_batch = 1;
  small.accumulation = 4;
  EXPECT_LT(tt::layout_cost(plain), tt::layout_cost(ckpt));
  EXPECT_LT(tt::layout_cost(plain), tt::layout_cost(small));
}

// Note [Context parallel]: enumerated only when asked (--cp_size 1,2), never beside a pipeline
// or with a context that does not split into 2 cp chunks; a cp layout's activations are 1/cp of
// its data-parallel twin's, ZeRO shards over dp x cp, and it becomes --cp_size and
// parallelism_config_cp_size.
TEST(Predict, ContextParallelSplitsActivationsAndShardsOverDpTimesCp) {
  const auto m = tt::gpt_plan_model(4, 512, 4, 256, 64);
  tt::PlanSearch search;
  search.global_batch = 4;
  bool beside_pipeline = false;  // Note [Context parallel beside a pipeline]
  auto with_cp = [&](int cp, std::vector<std::string>* excluded) {
    int n = 0;
    for (const auto& x : tt::enumerate_layouts(m, machine(4), search, excluded)) {
      n += x.cp == cp;
      beside_pipeline = beside_pipeline || (x.cp > 1 && x.pp > 1);
      EXPECT_EQ(x.dp * x.cp * x.tp * x.pp, 4) << x.name();
    }
    return n;
  };
  EXPECT_EQ(with_cp(2, nullptr), 0);
  search.context_parallel = {1, 2};
  std::vector<std::string> excluded;
  EXPECT_GT(with_cp(2, &excluded), 0);
  EXPECT_GT(with_cp(1, nullptr), 0);
  EXPECT_TRUE(beside_pipeline);
  bool said = false;
  for (const auto& e : excluded) said |= e.find("context parallel does not combine") != std::string::npos;
  EXPECT_FALSE(said);
  const auto odd = tt::gpt_plan_model(4, 512, 4, 256, 66);  // 66 is not a multiple of 2 x 2
  excluded.clear();
  for (const auto& x : tt::enumerate_layouts(odd, machine(4), search, &excluded))
    EXPECT_EQ(x.cp, 1) << x.name();
  said = false;
  for (const auto& e : excluded) said |= e.find("multiple of 2 x cp") != std::string::npos;
  EXPECT_TRUE(said);
  tt::ProbeFigures f;
  f.activations_per_sample = 1e6;
  tt::Layout dp;
  dp.dp = 4;
  dp.zero_stage = 3;
  tt::Layout cp = dp;
  cp.dp = 2;
  cp.cp = 2;
  const auto pd = tt::predict_memory(m, dp, f), pc = tt::predict_memory(m, cp, f);
  EXPECT_DOUBLE_EQ(pc.activations, pd.activations / 2);
  EXPECT_DOUBLE_EQ(pc.model_states, pd.model_states);  // shards over dp x cp = 4 either way
  EXPECT_EQ(cp.name(), "dp2 cp2 zero3 mb1");
  const auto flags = tt::launch_flags(cp, machine(4), "");
  EXPECT_NE(std::find(flags.begin(), flags.end(), "--cp_size"), flags.end());
  auto cfg = tandem::config::parse_config(
      tandem::config::to_yaml(tt::layout_config(cp, machine(4), "")), "plan.yaml");
  EXPECT_EQ(cfg.parallelism_config.at("parallelism_config_cp_size"), "2");
}

// Note [Expert parallel]: a mixture's experts found in a checkpoint's names (kept whole under
// tp), ep enumerated where it divides the experts and dp x cp (not with a pipeline nor optimizer
// state on disk), and under ZeRO the rank's 1/ep of the experts held whole beside the shards:
// 16E of states and 4E of buckets, the rest by the stage's formula.
TEST(Predict, ExpertParallelSplitsTheExpertsAndKeepsThemWholeUnderZero) {
  tandem::testing::TempDir dir;
  tandem::checkpoint::NamedTensors t{{"model.embed_tokens.weight", torch::zeros({64, 8})},
                                     {"model.norm.weight", torch::zeros({8})},
                                     {"lm_head.weight", torch::zeros({64, 8})}};
  for (int layer = 0; layer < 2; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer);
    t.emplace_back(p + ".self_attn.q_proj.weight", torch::zeros({8, 8}));
    t.emplace_back(p + ".mlp.gate.weight", torch::zeros({4, 8}));
    for (int e = 0; e < 4; ++e)
      t.emplace_back(p + ".mlp.experts." + std::to_string(e) + ".up_proj.weight",
                     torch::zeros({16, 8}));
  }
  tandem::checkpoint::save_safetensors(dir.str() + "/model.safetensors", t);
  auto m = tt::safetensors_plan_model(dir.str(), /*heads=*/2);
  m.context = 16;
  EXPECT_EQ(m.experts, 4);
  int64_t experts = 0;
  for (const auto& x : m.tensors) {
    EXPECT_EQ(x.expert, x.name.find(".experts.") != std::string::npos) << x.name;
    if (x.expert) {
      experts += x.numel;
      EXPECT_FALSE(x.tp_split) << x.name;  // every tp rank holds its experts whole
    }
  }
  EXPECT_EQ(experts, 2 * 4 * 16 * 8);
  const int64_t rest = m.num_parameters() - experts;

  tt::PlanSearch search;
  search.global_batch = 4;
  search.offload_dir = dir.str();
  search.expert_parallel = {1, 2, 4, 3};
  std::vector<std::string> excluded;
  std::set<int> eps;
  bool beside_pipeline = false;  // Note [Expert parallel beside a pipeline]
  for (const auto& x : tt::enumerate_layouts(m, machine(4), search, &excluded)) {
    eps.insert(x.ep);
    if (x.ep > 1) {
      beside_pipeline = beside_pipeline || x.pp > 1;
      EXPECT_EQ(x.dp * x.cp % x.ep, 0) << x.name();
      EXPECT_NE(x.offload, "nvme") << x.name();
    }
  }
  EXPECT_EQ(eps, (std::set<int>{1, 2, 4}));
  auto said = [&](const std::string& what) {
    return std::any_of(excluded.begin(), excluded.end(),
                       [&](const std::string& e) { return e.find(what) != std::string::npos; });
  };
  EXPECT_TRUE(said("ep must divide the 4 experts of a layer"));
  EXPECT_TRUE(beside_pipeline);
  EXPECT_FALSE(said("expert parallel does not combine with a pipeline"));
  EXPECT_TRUE(said("ep is carved from dp x cp"));  // ep 4 beside tp 2: dp 2
  EXPECT_TRUE(said("optimizer state on disk does not combine with expert parallel"));
  excluded.clear();
  search.expert_parallel = {2};
  EXPECT_TRUE(tt::enumerate_layouts(tt::gpt_plan_model(4, 256, 4, 256, 64), machine(4), search,
                                    &excluded).empty());
  EXPECT_TRUE(said("expert parallel needs a mixture of experts"));

  tt::ProbeFigures none;  // model states and buffers only
  tt::Layout dp;
  dp.dp = 4;
  dp.ep = 2;
  const double e = static_cast<double>(experts) / 2, r = static_cast<double>(rest);
  const auto plain = tt::predict_memory(m, dp, none);
  EXPECT_EQ(plain.parameters, rest + experts / 2);
  EXPECT_DOUBLE_EQ(plain.model_states, 16 * (r + e));
  tt::Layout zero1 = dp;
  zero1.zero_stage = 1;
  const auto z1 = tt::predict_memory(m, zero1, none);
  EXPECT_DOUBLE_EQ(z1.model_states, 8 * r + 8 * r / 4 + 16 * e);
  const auto shared = tandem::track::strategy_memory(
      1, r, 4, tandem::track::default_bucket_bytes(r), 0, 0);
  EXPECT_DOUBLE_EQ(z1.buffers, shared.transient + 4 * e);
  tt::Layout zero3 = dp;
  zero3.zero_stage = 3;
  const auto ranks = tt::rank_parameters(m, zero3);
  ASSERT_EQ(ranks.size(), 1u);
  EXPECT_EQ(ranks[0].expert_parameters, experts / 2);
  // Outside the units: the largest is the head (and final norm), where with the experts inside
  // it was a block (attention, router, four experts).
  EXPECT_EQ(ranks[0].largest_unit, 64 * 8 + 8);
  tt::Layout whole = zero3;
  whole.ep = 1;
  EXPECT_EQ(tt::rank_parameters(m, whole)[0].largest_unit, 64 + 32 + 4 * 128);
  EXPECT_DOUBLE_EQ(tt::predict_memory(m, zero3, none).model_states, 16 * r / 4 + 16 * e);

  EXPECT_EQ(zero3.name(), "dp4 ep2 zero3 mb1");
  const auto flags = tt::launch_flags(zero3, machine(4), "");
  const auto at = std::find(flags.begin(), flags.end(), "--ep_size");
  ASSERT_NE(at, flags.end());
  EXPECT_EQ(*(at + 1), "2");
  auto cfg = tandem::config::parse_config(
      tandem::config::to_yaml(tt::layout_config(zero3, machine(4), "")), "plan.yaml");
  EXPECT_EQ(cfg.parallelism_config.at("parallelism_config_ep_size"), "2");
}
