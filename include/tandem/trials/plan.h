// The layout planner's logic (`tandem plan`), as pure functions over plain data: the model as
// the planner sees it (its tensors, which block each belongs to, which ones tensor parallel
// splits), the layouts a machine allows (dp, ZeRO stage, tp, pp, activation checkpointing,
// micro-batch, optimizer offload), each layout's predicted per-rank peak memory (model states
// from the strategies' formulas, activations and buffers from a short profiled step), and the
// configuration file the winner becomes. The runs themselves are in planner.h.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tandem/config/config.h"

namespace tandem::trials {

/// One tensor of the model. `block`: the index of the repeated block it belongs to (the first
/// numeric component of its name: "h.3.attn.qkv.weight" -> 3), kBeforeBlocks (embeddings) or
/// kAfterBlocks (final norm, head). `tp_split`: tensor parallel keeps 1/tp of it per rank.
struct PlanTensor {
  static constexpr int kBeforeBlocks = -1;
  static constexpr int kAfterBlocks = -2;
  std::string name;
  int64_t numel = 0;
  int block = kBeforeBlocks;
  bool tp_split = false;
  /// A tensor that a module after the blocks uses too (a head tied to the token embedding):
  /// a pipeline keeps a copy of it on its last stage, since stages share no tensor.
  bool tied_to_head = false;
  /// A routed expert's tensor (".experts." in its name): expert parallel keeps 1/ep of every
  /// layer's experts per rank, whole (tensor parallel does not split them), outside ZeRO's
  /// units (Note [Expert parallel]).
  bool expert = false;
};

/// The model as the planner sees it.
struct PlanModel {
  std::vector<PlanTensor> tensors;
  int64_t blocks = 0;
  /// Attention heads, hidden width and vocabulary (0: unknown): tensor parallel splits whole
  /// heads, 4 x hidden (the MLP) and the vocabulary.
  int64_t heads = 0, hidden = 0, vocab = 0, context = 0;
  /// Routed experts per mixture-of-experts layer (0: a dense model).
  int64_t experts = 0;
  /// Where it came from ("GPT 4 x 256, ...", "safetensors: model.safetensors").
  std::string source;
  int64_t num_parameters() const;
};

/// The example GPT's tensors (examples/common/gpt.h; track::count_gpt_parameters' count): token
/// and position embeddings, `layers` pre-LayerNorm blocks (qkv, proj, fc, fc_proj with biases,
/// two LayerNorms), the final LayerNorm, the head tied to the token embedding. Tensor parallel
/// (gpt_tensor_parallel_plan) splits qkv, fc (weights and biases), proj and fc_proj (weights)
/// and the token embedding; the position embedding, LayerNorms and row-parallel biases stay
/// whole. Throws std::invalid_argument unless every dimension is positive.
PlanModel gpt_plan_model(int64_t layers, int64_t hidden, int64_t heads, int64_t vocab,
                         int64_t context);

/// A safetensors checkpoint's tensors (its header only; a file, an index, or a folder holding
/// either, as track::read_safetensors_model_size). Blocks by the first numeric name component;
/// names outside blocks whose name says embedding ("emb", "wte", "wpe") go before the blocks,
/// the rest after. Tensor parallel splits every tensor of two or more dimensions except
/// position embeddings ("wpe", "position") and experts (".experts." in the name, kept whole on
/// every tp rank; their count per layer from the largest index after ".experts.", from the first
/// dimension of transformers' fused expert tensors, or from config.json's num_experts or
/// num_local_experts). `heads`: 0 when unknown (read from a config.json
/// beside the checkpoint when it names n_head or num_attention_heads).
PlanModel safetensors_plan_model(const std::string& path, int64_t heads = 0);

/// The machines the plan is for.
struct PlanMachine {
  int num_processes = 1;  ///< over all machines (Accelerate's meaning)
  int num_machines = 1;
  /// Bytes one process may use (its peak resident memory, or device memory on a GPU).
  double memory_per_process = 0;
  bool cuda = false;
  int processes_per_machine() const { return num_processes / num_machines; }
};

/// One layout.
struct Layout {
  int dp = 1, tp = 1, pp = 1;
  /// Context parallel: every sequence split over cp ranks (dp x cp x tp x pp = processes).
  int cp = 1;
  /// Expert parallel: every mixture layer's experts split over ep ranks carved from dp x cp.
  int ep = 1;
  int zero_stage = 0;
  bool activation_checkpointing = false;
  /// Sequences per data-parallel rank in one forward (a pipeline's micro-batch).
  int64_t micro_batch = 1;
  /// Micro-steps per optimizer step (gradient accumulation; 1 under a pipeline).
  int64_t accumulation = 1;
  /// Pipeline micro-batches per step (1 without a pipeline).
  int64_t microbatches = 1;
  /// Pipeline stages per rank: 1, or v > 1 for interleaved 1F1B (--pp_schedule
  /// interleaved_1f1b --pp_virtual_stages v).
  int virtual_stages = 1;
  /// ZeRO's optimizer state: "" in memory, "nvme" in files, "cpu" in host memory (GPU only).
  std::string offload;
  /// Sequences per data-parallel rank per micro-step: what the program's loader batches
  /// (micro_batch x microbatches).
  int64_t batch_per_rank() const { return micro_batch * microbatches; }
  /// "dp2 zero1 mb4 ga2", "dp1 tp2 pp2 mb2 m4 ckpt", "dp1 pp2 v2 mb1 m4", "dp2 cp2 mb1",
  /// "dp4 ep2 zero3 mb1", ...
  std::string name() const;
  bool operator==(const Layout& o) const;
};

/// What enumerate_layouts searches.
struct PlanSearch {
  int64_t global_batch = 8;  ///< sequences per optimizer step, over all data-parallel ranks
  /// Whether the program takes its pipeline micro-batches ({microbatches} in its args); else
  /// pipelines run with microbatches = pp.
  bool search_microbatches = true;
  /// Largest micro-batch tried (0: no limit).
  int64_t max_micro_batch = 0;
  /// Where the optimizer state may go on disk ("": offload is not searched).
  std::string offload_dir;
  bool search_checkpointing = true;
  /// Pipeline stages per rank tried for each pipeline (1: one stage per rank, 1F1B; v > 1:
  /// interleaved 1F1B, where the micro-batches are a multiple of pp and the model has pp v
  /// children). `tandem plan --pp_virtual_stages 1,2`.
  std::vector<int> virtual_stages{1};
  /// Context-parallel sizes tried (1: none; c > 1 splits every sequence over c ranks, for a
  /// program whose model splits its sequences, such as train_llm; not with a pipeline, and the
  /// context a multiple of 2 c). `tandem plan --cp_size 1,2`.
  std::vector<int> context_parallel{1};
  /// Expert-parallel sizes tried (1: none; e > 1 splits a mixture's experts over e ranks, for a
  /// model with experts: e divides the experts per layer and dp x cp; not with a pipeline, nor
  /// with optimizer state on disk). `tandem plan --ep_size 1,2`.
  std::vector<int> expert_parallel{1};
};

/// Every layout the rules allow, each once, with why the others are out in `excluded` (one
/// line per rule that removed some): dp x tp x pp = processes; tp divides the heads, the MLP
/// width and the vocabulary, and stays within a machine; a pipeline has at most as many stages
/// as the model has children (blocks + 2) and no ZeRO stage (tandem refuses the pair) and no
/// accumulation, with at least pp micro-batches; ep dividing the experts and dp x cp, without a
/// pipeline or offload to disk; ZeRO stages 1-3 only where dp x cp > 1; the global
/// batch divisible by dp, the micro-batch dividing each rank's share; offload only with a ZeRO
/// stage (and a directory, on the CPU).
std::vector<Layout> enumerate_layouts(const PlanModel& model, const PlanMachine& machine,
                                      const PlanSearch& search, std::vector<std::string>* excluded);

/// Parameters on the rank of a layout that holds the most (the pipeline stage with the most,
/// after tensor parallel's split), and the stage.
struct RankParameters {
  int64_t parameters = 0;
  int64_t largest_unit = 0;  ///< the largest block (or embedding) on that rank: a ZeRO-3 unit
  /// The experts among `parameters` (1/ep of each layer's); under expert parallel they are
  /// outside every unit (largest_unit counts the rest).
  int64_t expert_parameters = 0;
  int stage = 0;
  /// Share of the model's activations per sample on that stage (1 without a pipeline).
  double activation_share = 1.0;
  /// Micro-batches whose activations that stage holds at once (1F1B: min(m, pp - stage)).
  int64_t in_flight = 1;
};
std::vector<RankParameters> rank_parameters(const PlanModel& model, const Layout& layout);

/// What the profiled step measured (planner.h's probes), in bytes.
struct ProbeFigures {
  /// Resident memory of a rank before its model (LibTorch, the program, its data).
  double baseline_rss = 0;
  /// Peak resident memory above baseline + tensor peak (allocator slack, thread stacks, Gloo).
  double rss_overhead = 0;
  /// Tensor bytes that are neither model states nor activations (the batch, optimizer-step
  /// scratch, LibTorch workspaces): probe tensor peak - 16 P - activations.
  double workspace = 0;
  /// Activations per sequence of the whole model, without and with activation checkpointing.
  double activations_per_sample = 0;
  double checkpointed_per_sample = 0;
  /// The part of activations tensor parallel splits (from a tp = 2 probe; 0: none measured).
  double tp_split_fraction = 0;
  /// Extra resident memory per additional process of a job (Gloo's pairs and buffers).
  double rss_per_peer = 0;
  /// What each ZeRO stage holds beside its states once the activations are gone, per
  /// parameter on the rank (stage 3: per parameter of its largest unit), measured by a probe of
  /// that stage at the layouts' data-parallel size, by (stage, tp); absent: the formula's term.
  std::map<std::pair<int, int>, double> zero_buffers;
  /// What ZeRO-3 holds more with gradient accumulation (between micro-steps), per parameter of
  /// the rank's shard (P/W), by tp: a second probe with 2 accumulation steps; absent: 8.
  std::map<int, double> zero3_accumulation;
  /// Whether activations came from a run (true) or from the GPT formula (false).
  bool measured = false;
};

/// Activations per sequence of the example GPT in fp32 from its shape, for a plan without a
/// program to probe (Korthikanti et al.'s per-layer count, 34 T h + 5 a T^2 values in 16 bits,
/// doubled for fp32, plus the logits and their gradient); checkpointed: each block's input.
ProbeFigures gpt_activation_formula(const PlanModel& model, int64_t seq_len, double baseline_rss);

/// A layout's predicted peak per rank (the rank that holds the most), in bytes.
struct MemoryPrediction {
  double model_states = 0;  ///< weights, gradients, Adam's moments (formulas of DESIGN.md)
  double buffers = 0;       ///< gradient buckets, ZeRO-3's gathered units, offload's buffers
  double activations = 0;
  double workspace = 0;
  double forward_buffers = 0;  ///< the part of `buffers` held during the forward as well
  double tensor_peak = 0;      ///< workspace + states + max(buffers, forward buffers + activations)
  double rss_peak = 0;         ///< baseline + tensor peak + overhead
  int stage = 0;               ///< the pipeline stage of that rank
  int64_t parameters = 0;      ///< parameters on that rank
};
/// The peak per rank with fp32 weights and AdamW, P parameters on the rank (after tp and pp),
/// W data-parallel ranks (dp x cp), B the default bucket, L the largest unit: the library's terms
/// (track::strategy_memory, Note [One memory model]) and the activations (Note [Planner memory
/// model] in plan.cpp):
///   data parallel   16P + 4P buckets (none when W = 1 or under a pipeline) + activations
///   ZeRO-1          8P + 8P/W + max(2B, activations)
///   ZeRO-2          4P + 12P/W + max(2B + 4L, activations)
///   ZeRO-3          16P/W + max(16L (+ 8P/W with accumulation), 8L + activations)
/// plus the probe's workspace; a ZeRO stage's probed buffers (ProbeFigures::zero_buffers)
/// replace its term; optimizer state on disk (or, on a GPU, in host memory) drops
/// Adam's 8P/W for three unit-sized buffers. Under expert parallel with a ZeRO stage, the rank's
/// experts E stay whole outside the shards: P is the rest and the experts add 16E of states and
/// 4E of their own buckets (held through the forward), as data parallel holds them (Note [One
/// memory model]: estimate-memory's `+ 20E`). Resident memory adds the probe's baseline and
/// overhead, and its per-peer overhead for every other process.
MemoryPrediction predict_memory(const PlanModel& model, const Layout& layout,
                                const ProbeFigures& probe);

/// A guess of relative step time, used only to order the candidates before they are timed:
/// recomputation, pipeline bubbles, tensor-parallel and ZeRO communication and small
/// micro-batches cost. Lower is better.
double layout_cost(const Layout& layout);

/// The `tandem launch` flags of a layout (without the program), e.g. {"--num_processes", "4",
/// "--use_deepspeed", "--zero_stage", "2", "--tp_size", "2"}.
std::vector<std::string> launch_flags(const Layout& layout, const PlanMachine& machine,
                                      const std::string& offload_dir);

/// The launch configuration of a layout (Accelerate's keys; tandem launch --config_file).
config::LaunchConfig layout_config(const Layout& layout, const PlanMachine& machine,
                                   const std::string& offload_dir);

/// The program's arguments with {batch_size}, {microbatches}, {accumulation} and {steps}
/// replaced ({steps} stays as it is when `steps` < 1: the printed command of a plan).
std::vector<std::string> program_args(const std::vector<std::string>& args, const Layout& layout,
                                      int64_t steps);

}  // namespace tandem::trials
