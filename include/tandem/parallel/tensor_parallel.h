// Tensor parallel after Megatron-LM: the conjugate communication regions (autograd functions),
// the column/row-parallel linear layers, the vocab-parallel embedding and cross entropy, a plan
// that swaps a model's layers for their tensor-parallel forms (sequence parallel included), and
// the per-rank RNG for dropout.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tandem/parallel/activation_checkpoint.h"

namespace tandem {
class ProcessGroup;
}

namespace tandem::parallel {

// ---------------------------------------------------------------------------------------------
// Communication regions. Each is the identity on a group of size 1. Megatron's names: f and g of
// the paper are copy_to_region and reduce_from_region; they are each other's conjugate (what one
// does forward the other does backward).

/// Identity forward; the gradient is all-reduced (summed) over `group` backward. Enters a
/// tensor-parallel region whose input is replicated.
at::Tensor copy_to_region(const at::Tensor& input, std::shared_ptr<ProcessGroup> group);
/// All-reduce (sum) forward; identity backward. Leaves a region whose ranks hold partial sums.
at::Tensor reduce_from_region(const at::Tensor& input, std::shared_ptr<ProcessGroup> group);
/// All-gather along the last dimension forward (rank order); backward keeps this rank's part.
at::Tensor gather_from_region(const at::Tensor& input, std::shared_ptr<ProcessGroup> group);
/// This rank's part of the last dimension forward; all-gather backward. The last dimension must
/// be divisible by the group size.
at::Tensor scatter_to_region(const at::Tensor& input, std::shared_ptr<ProcessGroup> group);
/// Sequence parallel: all-gather along `dim` (the sequence dimension of [batch, seq, hidden])
/// forward, reduce-scatter backward.
at::Tensor gather_from_sequence_region(const at::Tensor& input, std::shared_ptr<ProcessGroup> group,
                                       int64_t dim = 1);
/// Sequence parallel: reduce-scatter (sum) along `dim` forward, all-gather backward. The size
/// of `dim` must be divisible by the group size: ProcessGroup::reduce_scatter pads uneven chunks,
/// and padded sequence positions would be silently wrong, so they are refused.
at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& input,
                                             std::shared_ptr<ProcessGroup> group, int64_t dim = 1);
/// Sequence parallel: this rank's part of `dim` forward (rank r keeps positions
/// [r T/n, (r+1) T/n)), all-gather backward. Enters the sequence-parallel part of a model from
/// replicated activations (the example GPT's embeddings). The size of `dim` must be divisible
/// by the group size, as for reduce_scatter_to_sequence_region.
at::Tensor scatter_to_sequence_region(const at::Tensor& input, std::shared_ptr<ProcessGroup> group,
                                      int64_t dim = 1);

// ---------------------------------------------------------------------------------------------
// Layers. Every split dimension must be divisible by the group size (uneven shards are refused
// with the sizes that would fit).

/// The base of the tensor-parallel layers: a module whose forward maps one tensor to one tensor
/// (called through this base where a plan replaced a torch::nn::Linear or Embedding).
///
/// Note [Adapters on tensor-parallel layers]: add_adapter puts a function of the layer's input
/// beside its weight (a LoRA adapter, tandem/peft/lora.h), whose output is added to the layer's:
/// a column-parallel layer adds it to this rank's columns (before any gather), a row-parallel one
/// after the reduction, where the output is whole. The function sees the input as the layer
/// computes with it (a row-parallel layer's part of the last dimension), splits its own tensors
/// as the layer does and says so with mark_split, so that get_state_dict and checkpoints join
/// and cut them as they do the layer's weight (tensor_parallel_splits).
class TensorParallelModule : public torch::nn::Module {
 public:
  explicit TensorParallelModule(std::shared_ptr<ProcessGroup> group);
  virtual at::Tensor forward(const at::Tensor& input) = 0;
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  /// Whether the layer computes on a sequence-parallel region (no adapter there yet).
  virtual bool sequence_parallel() const { return false; }
  /// Adds `adapter(input)` to every forward's output (Note [Adapters on tensor-parallel
  /// layers]). Refused on an embedding, under sequence parallel, and for a second adapter of
  /// the same name.
  void add_adapter(const std::string& name, std::function<at::Tensor(const at::Tensor&)> adapter);
  bool has_adapter(const std::string& name) const;
  /// Records how an adapter's tensor `t` is split over the group ("rows/<parts>" or "cols", as
  /// tensor_parallel_splits says); a tensor never marked is whole on every rank.
  void mark_split(const at::Tensor& t, const std::string& how);
  const std::map<const c10::TensorImpl*, std::string>& marked_splits() const { return marked_; }

 protected:
  /// `output` plus every adapter's output for `input`.
  at::Tensor with_adapters(const at::Tensor& input, at::Tensor output) const;
  /// Whether add_adapter applies to this layer (the linear layers).
  virtual bool takes_adapters() const { return false; }
  std::shared_ptr<ProcessGroup> group_;

 private:
  std::vector<std::pair<std::string, std::function<at::Tensor(const at::Tensor&)>>> adapters_;
  std::map<const c10::TensorImpl*, std::string> marked_;
};

/// Options of ColumnParallelLinear.
///
/// Example:
///   auto qkv = ColumnParallelLinear(ColumnParallelLinearOptions(64, 192).parts(3), tp);
struct ColumnParallelLinearOptions {
  ColumnParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  /// The dense layer's output features; each rank holds out_features / group size.
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  /// All-gather the output to the full out_features (else each rank keeps its part, the input
  /// of a RowParallelLinear or of vocab_parallel_cross_entropy).
  TORCH_ARG(bool, gather_output) = false;
  /// The output is `parts` blocks fused in one layer (3 for an attention's q, k, v): each block
  /// is split on its own, so that a rank holds whole heads of q, k and v. The local output is
  /// this rank's part of block 0, then of block 1, ...
  TORCH_ARG(int64_t, parts) = 1;
  /// Sequence parallel: the input is this rank's part of the sequence ([B, T/tp, in], dimension
  /// 1); forward all-gathers it to [B, T, in] (gather_from_sequence_region), and backward
  /// reduce-scatters the input gradient to this rank's positions, in place of copy_to_region's
  /// all-reduce.
  TORCH_ARG(bool, sequence_parallel) = false;
};

/// A Linear whose output features (weight rows) are split over the group: y_r = x W_r^T + b_r.
/// Backward all-reduces the input gradient (copy_to_region), or reduce-scatters it along the
/// sequence with options.sequence_parallel().
class ColumnParallelLinearImpl : public TensorParallelModule {
 public:
  /// Parameters allocated for this rank's shard, initialised as torch::nn::Linear initialises
  /// the dense layer's (uniform in +-1/sqrt(in_features)); load_dense sets them.
  ColumnParallelLinearImpl(ColumnParallelLinearOptions options, std::shared_ptr<ProcessGroup> group);
  /// Adopts `weight` and `bias` (this rank's shards, [out/tp, in] and [out/tp]) as the
  /// parameters: the same tensor objects, so that a tensor tied elsewhere stays tied.
  ColumnParallelLinearImpl(ColumnParallelLinearOptions options, std::shared_ptr<ProcessGroup> group,
                           at::Tensor weight, at::Tensor bias);
  /// Copies this rank's shard of the dense layer's weight [out, in] and bias [out] (undefined
  /// when the layer has none) into the parameters.
  void load_dense(const at::Tensor& weight, const at::Tensor& bias = {});
  at::Tensor forward(const at::Tensor& input) override;
  bool sequence_parallel() const override { return options.sequence_parallel(); }

  ColumnParallelLinearOptions options;
  at::Tensor weight, bias;

 protected:
  bool takes_adapters() const override { return true; }
};
TORCH_MODULE(ColumnParallelLinear);

/// Options of RowParallelLinear.
struct RowParallelLinearOptions {
  RowParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  /// The dense layer's input features; each rank holds in_features / group size.
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  /// The input is already split along its last dimension (the output of a ColumnParallelLinear
  /// without gather_output); else it is the full input and each rank takes its part.
  TORCH_ARG(bool, input_is_parallel) = true;
  /// Sequence parallel: the partial products are reduce-scattered along the sequence
  /// (dimension 1; reduce_scatter_to_sequence_region) instead of all-reduced, so each rank gets
  /// the summed output of its positions, [B, T/tp, out]; T must be divisible by the group size.
  /// The bias is added after, to the local positions; its gradient (a sum over this rank's
  /// positions only) is all-reduced over the group, so the replicated bias stays replicated.
  TORCH_ARG(bool, sequence_parallel) = false;
};

/// A Linear whose input features (weight columns) are split: y = sum_r x_r W_r^T (all-reduced
/// forward, reduce_from_region) + b, the bias added once, after the reduction, on every rank.
/// With options.sequence_parallel() the sum is reduce-scattered along the sequence instead.
class RowParallelLinearImpl : public TensorParallelModule {
 public:
  RowParallelLinearImpl(RowParallelLinearOptions options, std::shared_ptr<ProcessGroup> group);
  /// Adopts this rank's weight shard [out, in/tp] and the (replicated) bias [out].
  RowParallelLinearImpl(RowParallelLinearOptions options, std::shared_ptr<ProcessGroup> group,
                        at::Tensor weight, at::Tensor bias);
  /// Copies this rank's columns of the dense weight [out, in] and the whole bias [out].
  void load_dense(const at::Tensor& weight, const at::Tensor& bias = {});
  at::Tensor forward(const at::Tensor& input) override;
  bool sequence_parallel() const override { return options.sequence_parallel(); }

  RowParallelLinearOptions options;
  at::Tensor weight, bias;

 protected:
  bool takes_adapters() const override { return true; }
};
TORCH_MODULE(RowParallelLinear);

/// An Embedding whose rows (the vocabulary) are split: rank r holds ids [r V/tp, (r+1) V/tp).
/// Ids outside this rank's range look up zeros, and the outputs are all-reduced.
class VocabParallelEmbeddingImpl : public TensorParallelModule {
 public:
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim,
                             std::shared_ptr<ProcessGroup> group);
  /// Adopts this rank's rows [V/tp, dim] of the dense table.
  VocabParallelEmbeddingImpl(int64_t num_embeddings, std::shared_ptr<ProcessGroup> group,
                             at::Tensor weight);
  /// Copies this rank's rows of the dense table [V, dim].
  void load_dense(const at::Tensor& weight, const at::Tensor& bias = {});
  at::Tensor forward(const at::Tensor& input) override;
  /// The first id this rank holds, and one past the last.
  int64_t vocab_start() const { return start_; }
  int64_t vocab_end() const { return end_; }

  at::Tensor weight;

 private:
  int64_t num_embeddings_, start_ = 0, end_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding);

/// Options of vocab_parallel_cross_entropy.
struct VocabParallelCrossEntropyOptions {
  /// Targets equal to this contribute no loss and no gradient (PyTorch's default -100).
  TORCH_ARG(int64_t, ignore_index) = -100;
  /// "mean" (over targets that are not ignored), "sum" or "none" (one loss per target, 0 where
  /// ignored).
  TORCH_ARG(std::string, reduction) = "mean";
};

/// Cross entropy of logits split along the vocabulary (the output of a ColumnParallelLinear
/// without gather_output; rank r holds classes [r V/tp, (r+1) V/tp)) against full targets
/// (shape of local_logits without its last dimension): the logits are never gathered. The
/// maximum, the target's logit and the sum of exponentials are each all-reduced; the gradient
/// of the local logits is softmax - onehot, on this rank's classes. Equals
/// torch::nn::functional::cross_entropy of the gathered logits.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& target,
                                        std::shared_ptr<ProcessGroup> group,
                                        const VocabParallelCrossEntropyOptions& options = {});

// ---------------------------------------------------------------------------------------------
// Plans.

/// How a planned layer is split.
enum class ParallelStyle {
  kColwise,  ///< a Linear (or a module with a 2-D `weight` [out, in], optional `bias`):
             ///< ColumnParallelLinear
  kRowwise,  ///< a Linear: RowParallelLinear (input_is_parallel)
  kVocab,    ///< an Embedding (a 2-D `weight` [V, dim]): VocabParallelEmbedding
  /// A per-token module (LayerNorm, RMSNorm, ...) that runs on this rank's part of the sequence
  /// with replicated parameters. The module stays as it is (no TensorParallelModule: its
  /// parameters are not split); each of its parameters gets a gradient hook that all-reduces
  /// (sums) the gradient over the tp group, since each rank's gradient is the sum over its own
  /// positions only.
  kSequenceParallel,
  /// A module whose random numbers must differ per tp rank (dropout on sequence shards, or on
  /// activations split by a tensor-parallel layer): its forward draws from this tp rank's
  /// stream (TensorParallelRng(seed, tp rank)) through a forward hook, so the module must be
  /// hookable (tandem::nn::Dropout, or a TANDEM_MODULE type). Its parameters stay as they are.
  kRankRandom,
};

/// One entry of a plan: the module paths it matches and how they are split.
struct PlanEntry {
  /// A path as named_modules() names it ("h0.attn.qkv"); `*` matches any run of characters
  /// within one path component ("h*.attn.qkv" matches h0.attn.qkv, h11.attn.qkv).
  std::string pattern;
  ParallelStyle style = ParallelStyle::kColwise;
  /// kColwise: blocks fused in the layer, split one by one (3 for a fused q, k, v projection).
  int64_t parts = 1;
  /// kColwise: all-gather the output.
  bool gather_output = false;
  /// kRowwise: the input is already split (after a kColwise layer).
  bool input_is_parallel = true;
  /// kColwise: the input is this rank's part of the sequence (all-gathered forward);
  /// kRowwise: the output is reduce-scattered along the sequence. See
  /// ColumnParallelLinearOptions::sequence_parallel and RowParallelLinearOptions's.
  bool sequence_parallel = false;
  /// kRankRandom: the seed of the per-rank stream (the same on every rank; the stream of tp
  /// rank r is seeded seed + 2718 + r, Megatron's offset).
  uint64_t seed = 0;
};

/// Which layers of a model become tensor parallel, and how.
///
/// Example (the example GPT of examples/common/gpt.h):
///   TensorParallelPlan plan;
///   plan.colwise("h*.attn.qkv", /*parts=*/3).rowwise("h*.attn.proj")
///       .colwise("h*.fc").rowwise("h*.fc_proj").vocab("wte").colwise("head");
///   parallelize_module(*model, mesh["tp"], plan);
///
/// Sequence parallel (Megatron's, Korthikanti et al. 2022): the norms run on sequence shards,
/// the column-parallel layers gather the sequence, the row-parallel ones scatter it:
///   plan.sequence_parallel("h*.ln*").colwise_from_sequence("h*.attn.qkv", 3)
///       .rowwise_to_sequence("h*.attn.proj").colwise_from_sequence("h*.fc")
///       .rowwise_to_sequence("h*.fc_proj").vocab("wte").sequence_parallel("ln_f")
///       .colwise_from_sequence("head");
struct TensorParallelPlan {
  std::vector<PlanEntry> entries;
  /// The model calls the planned modules it holds in typed torch::nn members through
  /// planned_child (`if (auto tp = planned_child(*this, "up")) return tp->forward(x);`).
  /// Without it, parallelize_module refuses a planned module that a typed torch::nn member
  /// still holds (called as `up(x)` it would compute with this rank's shard and no
  /// collective); tandem's hookable holders (tandem::nn::Linear) need neither.
  bool calls_planned_children = false;

  TensorParallelPlan& add(PlanEntry entry);
  TensorParallelPlan& colwise(const std::string& pattern, int64_t parts = 1,
                              bool gather_output = false);
  TensorParallelPlan& rowwise(const std::string& pattern, bool input_is_parallel = true);
  TensorParallelPlan& vocab(const std::string& pattern);
  /// kColwise with sequence_parallel: the input is this rank's part of the sequence.
  TensorParallelPlan& colwise_from_sequence(const std::string& pattern, int64_t parts = 1);
  /// kRowwise with sequence_parallel (input split by features, as after a kColwise layer): the
  /// output is this rank's part of the sequence.
  TensorParallelPlan& rowwise_to_sequence(const std::string& pattern);
  /// kSequenceParallel: a per-token module (a norm) on sequence shards, its replicated
  /// parameters' gradients summed over the tp group.
  TensorParallelPlan& sequence_parallel(const std::string& pattern);
  /// A module with replicated parameters that runs on activations split across tp ranks (Qwen3's
  /// per-head q/k norms under split heads: each rank's gradient covers its own heads only): each
  /// parameter's gradient summed over the tp group. The same treatment as sequence_parallel.
  TensorParallelPlan& sum_gradients(const std::string& pattern);
  /// kRankRandom: the modules matching `pattern` draw from this tp rank's stream, seeded
  /// `seed` (the same on every rank).
  TensorParallelPlan& rank_random(const std::string& pattern, uint64_t seed);
  /// Sets calls_planned_children.
  TensorParallelPlan& through_planned_child(bool yes = true) {
    calls_planned_children = yes;
    return *this;
  }
};

/// Whether `path` matches `pattern` (`*`: any characters except '.').
bool plan_pattern_matches(const std::string& pattern, const std::string& path);

/// For each plan entry, the paths among `module_paths` it matches (in their order). Throws
/// std::invalid_argument naming every entry that matches nothing, and a path two entries claim.
std::vector<std::vector<std::string>> match_plan(const TensorParallelPlan& plan,
                                                 const std::vector<std::string>& module_paths);

/// Replaces every module the plan names with its tensor-parallel form over `tp`
/// (torch::nn::Module::replace_module on its parent), holding this rank's shard of the dense
/// parameters. The dense parameter tensors are kept and their data replaced by the shard
/// (Tensor::set_data), so that a parameter tied to another module (the example GPT's head and
/// token embedding) becomes that shard there too, and is sharded once: two planned modules
/// sharing a tensor must split it the same way (kVocab and kColwise both split rows). Every rank
/// of `tp` must hold the same dense model (same seed, or a broadcast) before the call. Members
/// of the parent that hold the old module (typed holders such as torch::nn::Linear) are not
/// changed: a model calls planned children through their parent's registered children (see
/// planned_child). kSequenceParallel modules stay in place (their parameters replicated, with a
/// gradient hook that sums over `tp`; a parameter a split layer shares is refused). Throws
/// std::invalid_argument for an entry that matches nothing, a module of a type the style cannot
/// split, and an uneven split.
void parallelize_module(torch::nn::Module& model, std::shared_ptr<ProcessGroup> tp,
                        const TensorParallelPlan& plan);

/// How each split parameter of `model` is cut, by its name in model.named_parameters():
/// "rows/<parts>" (a column-parallel weight and bias, split block by block over `parts` fused
/// blocks; a vocab-parallel embedding, "rows/1") or "cols" (a row-parallel weight). Parameters
/// every tp rank holds whole (norms, row-parallel biases, layers no plan split) are not listed.
std::map<std::string, std::string> tensor_parallel_splits(torch::nn::Module& model);

/// The tensor-parallel module that parallelize_module registered as `parent`'s child `name`,
/// or nullptr when that child is still the module the parent built.
std::shared_ptr<TensorParallelModule> planned_child(torch::nn::Module& parent,
                                                    const std::string& name);

// ---------------------------------------------------------------------------------------------
// Randomness.

/// Megatron's model-parallel RNG tracker, for dropout inside a tensor-parallel region (on
/// activations each rank holds a different part of, which must be masked independently), while
/// dropout outside (on replicated activations) must draw the same mask on every tp rank. The
/// default generators keep the stream every tp rank shares; this object keeps a second one per
/// tp rank, seeded seed + 2718 + tp_rank (Megatron's offset), for the CPU and, when CUDA is
/// available, the current CUDA device. A Scope swaps it in and back. The stream is registered
/// with activation checkpointing (RandomStream), so a checkpointed region that draws from it
/// recomputes with the same masks.
///
/// Example:
///   TensorParallelRng rng(/*seed=*/1234, mesh.coordinate("tp"));
///   {
///     auto scope = rng.scope();                    // this tp rank's stream
///     h = torch::dropout(h, 0.1, is_training());  // a mask of its own on its part of h
///   }                                              // the shared stream again
class TensorParallelRng : public RandomStream {
 public:
  TensorParallelRng(uint64_t seed, int tp_rank);
  ~TensorParallelRng() override;
  TensorParallelRng(const TensorParallelRng&) = delete;  // registered by address
  TensorParallelRng& operator=(const TensorParallelRng&) = delete;

  std::vector<at::Tensor> stream_state() const override { return {cpu_state_, cuda_state_}; }
  void set_stream_state(const std::vector<at::Tensor>& state) override;

  /// While alive, the default generators draw from this rank's tensor-parallel stream; on
  /// destruction the stream's state is saved here and the default state restored.
  class Scope {
   public:
    explicit Scope(TensorParallelRng& rng);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    TensorParallelRng& rng_;
    at::Tensor saved_cpu_, saved_cuda_;
  };
  /// A Scope over this stream (C++17 returns it without a copy: `auto s = rng.scope();`).
  Scope scope() { return Scope(*this); }

  uint64_t seed() const { return seed_; }

 private:
  uint64_t seed_;
  at::Tensor cpu_state_, cuda_state_;
};

}  // namespace tandem::parallel
