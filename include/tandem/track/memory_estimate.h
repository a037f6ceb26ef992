// How much memory a model needs, before it is ever loaded: parameter counts from a safetensors
// header, a GPT shape or a plain number, turned into sizes per dtype, training memory with Adam
// and the per-device model states of DDP and ZeRO stages 1-3. Pure functions over plain data;
// `tandem estimate-memory` prints them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tandem/checkpoint/safetensors_header.h"

namespace tandem::track {

/// What a memory estimate starts from: the parameter count and the largest single layer.
struct ModelSize {
  int64_t num_parameters = 0;
  /// Elements of the largest layer: the biggest unit that must fit on a device at once.
  int64_t largest_layer_parameters = 0;
  std::string largest_layer_name;
  /// Where the numbers came from ("safetensors: model.safetensors", "GPT ...", "--params").
  std::string source;
  /// Elements per stored dtype ("F32", "BF16", ...), for checkpoints.
  std::map<std::string, int64_t> stored_dtypes;
  /// Assumptions made while counting (tied embeddings, buffers counted, ...).
  std::vector<std::string> notes;
};

/// A GPT-2 style decoder: learned token and position embeddings, pre-LayerNorm blocks with
/// biases, MLP of width 4 x hidden, output head tied to the token embedding.
struct GptShape {
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t vocab = 0;
  int64_t context = 0;
};

/// Parameters of a GPT of that shape:
///   vocab*hidden (token embedding) + context*hidden (position embedding)
///   + layers * (12 hidden^2 + 13 hidden) + 2 hidden (final LayerNorm),
/// where one block is qkv 3h^2+3h, attention projection h^2+h, MLP 4h^2+4h and 4h^2+h, and two
/// LayerNorms 2h each. The output head shares the token embedding's weight and adds nothing.
/// The largest layer is the biggest of the token embedding, the position embedding and a block.
/// Throws std::invalid_argument unless every dimension is positive.
///
/// Example:
///   auto m = tandem::track::count_gpt_parameters({12, 768, 50257, 1024});  // 124,439,808
ModelSize count_gpt_parameters(const GptShape& shape);

/// Parses "125M", "7.5B", "1e9", "350k", "1.2T", "1000000" (K, M, B or G, T: powers of 1000,
/// either case). Throws std::invalid_argument saying what was expected.
int64_t parse_parameter_count(const std::string& text);

/// A model known only by its parameter count (the largest layer is unknown and reported as 0).
ModelSize model_size_from_count(int64_t num_parameters);

/// Counts the tensors of a validated safetensors header (checkpoint::parse_safetensors_header or
/// read_safetensors_header: the one, fuzzed parser of untrusted files). Layers are grouped by
/// name: up to and including the first numeric component ("model.layers.3.mlp.up.weight" ->
/// "model.layers.3"), otherwise the module ("lm_head.weight" -> "lm_head"). Every tensor
/// counts, buffers included, since the format does not tell them apart.
ModelSize model_size_from_safetensors_header(const checkpoint::SafetensorsHeader& header,
                                             const std::string& source = "safetensors");

/// Reads a safetensors checkpoint's header only (never its tensors): a `.safetensors` file, a
/// `model.safetensors.index.json` with its shards beside it, or a folder holding either.
/// Throws std::runtime_error naming the file and what was wrong with it.
ModelSize read_safetensors_model_size(const std::string& path);

/// Memory for one dtype.
struct DtypeMemory {
  std::string dtype;            ///< "float32", "float16/bfloat16", "int8", "int4"
  double bytes_per_parameter;   ///< 4, 2, 1, 0.5
  double largest_layer_bytes;
  double total_bytes;           ///< the weights
  /// Weights and gradients in this dtype plus Adam's two moments in fp32:
  /// P * (2 * bytes_per_parameter + 8).
  double training_adam_bytes;
};

/// Per-device model states of one data-parallel scheme (ZeRO paper, mixed-precision Adam).
struct ZeroMemory {
  std::string id;       ///< "ddp", "zero1", "zero2", "zero3"
  std::string stage;    ///< "DDP (no sharding)", "ZeRO-1", "ZeRO-2", "ZeRO-3"
  std::string formula;  ///< "(2+2+K)P", "4P + KP/N", ...
  double bytes_per_device;
};

/// Note [One memory model]: what one rank holds of its model under each of tandem's strategies,
/// on fp32 weights with AdamW, in bytes. `tandem estimate-memory` prints it, `tandem plan`
/// starts from it where it has not measured a stage, and the memory tests hold it to the
/// counting allocator's peaks (tests/dist/zero_worker.cpp, within 10%).
///   data parallel  16P states              + 4P of gradient buckets (W > 1)
///   ZeRO-1         8P + 8P/W (gradients kept in their buckets)  + 2B (a unit's all-gather)
///   ZeRO-2         4P + 12P/W              + 2B (the bucket in flight and its receive buffer:
///                                            Note [Two buckets at a time]) + 4G (a gradient)
///   ZeRO-3         16P/W                   + 16U (two units in use: the one computing, its
///                                            gathered weights and its gradient; the one in
///                                            flight, its bucket and the receive buffer)
///   with E of P experts held whole under expert parallel (Note [Expert parallel]): a ZeRO stage
///   shards P - E by its formula and adds 16E of states and 4E of the experts' own buckets.
/// P: the rank's parameters; W: the data-parallel size; B: the largest bucket's bytes (a bucket
/// closes at the first parameter that reaches the cap); G: the largest parameter's elements;
/// U: the largest unit's elements.
struct StrategyMemory {
  double states = 0;     ///< weights, gradients, Adam's two moments the rank keeps
  double transient = 0;  ///< buckets, receive buffers and gathered units at their peak
  /// Of `transient`, the whole experts' buckets (4E under ZeRO), which live through the forward
  /// too and which a measured figure for the sharded rest does not include.
  double expert_transient = 0;
  std::string formula;   ///< e.g. "4P + 12P/W + 2B + 4G"
  double total() const { return states + transient; }
};

/// The terms of Note [One memory model] for ZeRO stage `stage` (0: data parallel), of which
/// `experts` of the `parameters` stay whole under a ZeRO stage (expert parallel). The bucket,
/// largest parameter and unit are the sharded rest's.
StrategyMemory strategy_memory(int stage, double parameters, double world, double bucket_bytes,
                               double largest_parameter, double largest_unit,
                               double experts = 0);

/// A bucket's bytes for a model of `parameters` fp32 elements under the default cap (25 MiB;
/// a model smaller than that is one bucket).
double default_bucket_bytes(double parameters);

/// A model-parallel layout's share of the model on the rank that holds the most (`tandem
/// estimate-memory --tp_size 2 --pp_size 2 ...`; trials::rank_parameters counts it from the
/// model's tensors): estimate_memory gives that rank's model states under each strategy.
struct LayoutShare {
  int dp = 1, cp = 1, tp = 1, pp = 1;
  int virtual_stages = 1;  ///< pipeline stages per rank (interleaved 1F1B)
  int ep = 1;  ///< expert parallel: each layer's experts split over ep of the dp ranks
  int64_t rank_parameters = 0;  ///< parameters on that rank, after tp's split and pp's stages
  /// Of those, the experts it holds under ep (whole under ZeRO, which shards the rest).
  int64_t expert_parameters = 0;
  int64_t largest_unit = 0;     ///< its largest block or embedding (ZeRO-3's unit)
  int stage = 0;                ///< its pipeline rank
  /// How the share was counted ("per tensor", or an assumption such as an even split).
  std::string counted;
  /// "pp 2 (2 stages per rank) x dp 2 (ep 2) x cp 2 x tp 2".
  std::string name() const;
};

/// Everything `tandem estimate-memory` prints.
struct MemoryEstimate {
  ModelSize model;
  int64_t num_processes = 1;
  std::vector<DtypeMemory> dtypes;
  std::vector<ZeroMemory> zero;
  /// The same schemes as tandem runs them on fp32 weights with Adam(W): strategy_memory
  /// (Note [One memory model]) with the default buckets and the largest layer as G and U.
  std::vector<ZeroMemory> tandem_fp32;
  /// With a model-parallel layout: its share, and tandem's strategies on the rank that holds the
  /// most, W = dp x cp (the ranks ZeRO shards over; none under a pipeline, which tandem runs
  /// without ZeRO).
  bool has_layout = false;
  LayoutShare layout;
  std::vector<ZeroMemory> layout_fp32;
  /// What the estimate leaves out.
  std::vector<std::string> caveats;
};

/// The dtypes estimate_memory knows, in the order printed.
std::vector<std::string> memory_dtypes();

/// The estimate for a model over `num_processes` devices. ZeRO uses the paper's formulas with
/// K = 12 (fp32 master weights, momentum and variance) and fp16/bf16 weights and gradients:
///   DDP (2+2+K)P, ZeRO-1 4P + KP/N, ZeRO-2 2P + (2+K)P/N, ZeRO-3 (2+2+K)P/N bytes per device.
/// `dtypes` picks rows among memory_dtypes() ("float16" and "bfloat16" name the same row; empty:
/// all). Throws std::invalid_argument for num_processes < 1 or an unknown dtype.
///
/// Example:
///   auto e = tandem::track::estimate_memory(tandem::track::model_size_from_count(7'500'000'000),
///                                           64);
///   // e.zero: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device
MemoryEstimate estimate_memory(const ModelSize& model, int64_t num_processes,
                               const std::vector<std::string>& dtypes = {});
/// The same, and tandem's strategies on the rank of `layout` that holds the most. Throws
/// tandem::Refused unless dp x cp x tp x pp = num_processes.
MemoryEstimate estimate_memory(const ModelSize& model, int64_t num_processes,
                               const std::vector<std::string>& dtypes, const LayoutShare& layout);

/// Bytes in decimal units with three significant digits or so: "120 GB", "31.4 GB", "512 B".
std::string format_bytes(double bytes);

/// The estimate as text tables, with the formulas and what the numbers leave out.
std::string format_memory_estimate(const MemoryEstimate& estimate);

/// The estimate as a JSON document (bytes as numbers, plus "gb" values in decimal GB).
std::string memory_estimate_to_json(const MemoryEstimate& estimate);

}  // namespace tandem::track
