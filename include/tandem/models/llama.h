// The Llama family of decoders as transformers defines them (LlamaForCausalLM, and the members
// that differ from it only in flags: Mistral, Qwen2, Qwen3, and the mixtures of experts Mixtral
// and Qwen3-MoE), with transformers' parameter names
// and shapes, so that a `save_pretrained` folder loads as it is and a folder written here loads in
// transformers: token embedding, decoder layers of RMSNorm, grouped-query attention with rotary
// embeddings (default, linear and llama3 frequencies), a SwiGLU MLP, the final RMSNorm and the
// output head (tied to the embedding or not). Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm
// and Mistral's sliding window are flags of the one architecture (Note [One Llama]).
//
// Every module is hookable (TANDEM_MODULE), the decoder layer outermost, so that each layer is a
// ZeRO-3 unit and an activation-checkpointing region of its own, and tensor parallel reaches the
// projections the layers call directly (llama_tensor_parallel_plan).
//
// Example:
//   auto cfg = tandem::models::LlamaConfig::from_file("Qwen3-0.6B/config.json");
//   auto model = acc.build([&] { return tandem::models::LlamaForCausalLM(cfg); });
//   acc.prepare(model);
//   acc.load_model(*model, "Qwen3-0.6B");
//   auto loss = model->loss(ids, labels);  // transformers' causal-LM loss, -100 ignored
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tandem/nn/layers.h"
#include "tandem/nn/module.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/parallel/expert_parallel.h"

namespace tandem::parallel {
struct TensorParallelPlan;
}

namespace tandem::models {

/// The fields of a config.json that shape the model (transformers' LlamaConfig, MistralConfig,
/// Qwen2Config, Qwen3Config). from_json refuses, by name, any key it does not compute (a
/// quantization_config, a rope type other than default/linear/llama3, a partial rotary factor,
/// remote code) instead of running another model than the checkpoint's.
struct LlamaConfig {
  std::string model_type = "llama";  ///< llama, mistral, qwen2, qwen3, mixtral or qwen3_moe
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;
  int64_t head_dim = 128;  ///< hidden_size / heads unless given (Qwen3's default is 128)
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double initializer_range = 0.02;
  double attention_dropout = 0.0;
  std::string hidden_act = "silu";  ///< silu, gelu, gelu_pytorch_tanh/gelu_new, relu
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  ///< Llama/Qwen3: attention_bias; Qwen2: always
  bool o_bias = false;    ///< Llama/Qwen3: attention_bias
  bool mlp_bias = false;
  bool qk_norm = false;  ///< Qwen3's per-head RMSNorm of queries and keys
  // Rotary embeddings (transformers' rope_parameters, or the older rope_theta + rope_scaling).
  double rope_theta = 10000.0;
  std::string rope_type = "default";  ///< default, linear or llama3
  double rope_factor = 1.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int64_t rope_original_max_position_embeddings = 8192;
  /// Attention over at most this many past positions (Mistral's sliding_window; Qwen's on the
  /// layers layer_types calls "sliding_attention"); nullopt: full causal attention.
  std::optional<int64_t> sliding_window;
  /// Per layer: whether sliding_window applies to it.
  std::vector<bool> sliding_layers;
  // Mixture of experts (mixtral, qwen3_moe; Note [One Llama]): num_experts 0 is a dense model.
  int64_t num_experts = 0;          ///< num_local_experts (Qwen3-MoE's files: num_experts)
  int64_t num_experts_per_tok = 2;  ///< top-k
  int64_t moe_intermediate_size = 0;  ///< each expert's SwiGLU width (Mixtral: intermediate_size)
  bool norm_topk_prob = true;  ///< renormalise the top-k probabilities (Mixtral always)
  double router_aux_loss_coef = 0.001;
  double router_jitter_noise = 0.0;  ///< Mixtral: inputs scaled by U(1 - j, 1 + j) in training
  /// transformers adds the load-balancing loss to loss() only when the config says so.
  bool output_router_logits = false;
  /// Per layer: a sparse block of experts (else the dense MLP of intermediate_size).
  std::vector<bool> moe_layers;
  /// The keys of the file that do not change the computation (token ids, dtype, generation
  /// defaults, architectures, ...), as JSON text, written back by to_json_text.
  std::string kept_json = "{}";

  /// Reads a config.json's object; `where` names it in errors. Throws tandem::Refused naming a
  /// key this port does not compute, or a value it cannot take.
  static LlamaConfig from_json_text(const std::string& text, const std::string& where);
  static LlamaConfig from_file(const std::string& path);
  /// The config.json transformers reads back (model_type's own keys, rope_parameters, the kept
  /// keys, architectures).
  std::string to_json_text() const;
  /// transformers' class name for model_type ("LlamaForCausalLM", "Qwen3ForCausalLM", ...).
  std::string architecture() const;
  /// Parameters of the model (the head counted once when tied).
  int64_t parameter_count() const;
};

/// RoPE's inverse frequencies [head_dim / 2] (float32), as transformers computes them for the
/// config's rope type.
at::Tensor rope_inverse_frequencies(const LlamaConfig& c);

/// Causal attention of q [B, H, L, D] over k, v [B, H, S, D] (S >= L, the queries the last L
/// positions), scaled by 1/sqrt(D): keys more than `window` positions back are masked when a
/// window is given, and attention dropout `dropout` applies in training.
at::Tensor llama_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           std::optional<int64_t> window, double dropout, bool training,
                           tandem::nn::AttentionKernel kernel);

struct LlamaAttentionImpl : torch::nn::Module, tandem::parallel::ContextParallelLayer {
  LlamaAttentionImpl(const LlamaConfig& c, int64_t layer);
  /// x [B, T, hidden] -> [B, T, hidden]. Heads are counted from the projections' outputs, so a
  /// tensor-parallel plan that splits q/k/v by whole heads leaves this rank its share.
  at::Tensor forward(const at::Tensor& x);
  int64_t head_dim;
  double dropout;
  std::optional<int64_t> window;
  at::Tensor inv_freq;  ///< not a buffer: transformers does not save it (persistent=False)
  tandem::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  tandem::nn::RMSNorm q_norm{nullptr}, k_norm{nullptr};  ///< Qwen3 only
  // The key/value cache (generation): while use_cache is set, each forward appends its keys and
  // values; past_length positions are cached.
  bool use_cache = false;
  at::Tensor past_k, past_v;
  int64_t past_length = 0;
  tandem::nn::AttentionKernel kernel = tandem::nn::AttentionKernel::kAuto;
  /// Context parallel (LlamaForCausalLM::set_context_parallel): x holds this rank's chunks of
  /// each sequence, RoPE takes their positions and attention runs over the cp group.
  std::shared_ptr<const tandem::parallel::ContextParallel> cp;
  void set_layer_context_parallel(
      std::shared_ptr<const tandem::parallel::ContextParallel> group) override {
    cp = group && group->size() > 1 ? std::move(group) : nullptr;
  }
};
TANDEM_MODULE(LlamaAttention);

/// SwiGLU: down(act(gate(x)) * up(x)). `width` 0 is the config's intermediate_size; Mixtral's
/// experts name their layers w1 (gate), w3 (up) and w2 (down).
struct LlamaMLPImpl : torch::nn::Module {
  explicit LlamaMLPImpl(const LlamaConfig& c, int64_t width = 0, bool mixtral_names = false);
  at::Tensor forward(const at::Tensor& x);
  std::string act;
  tandem::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TANDEM_MODULE(LlamaMLP);

/// A sparse block of experts (Mixtral's block_sparse_moe, Qwen3-MoE's mlp): a router (`gate`,
/// [experts, hidden], no bias) picks the top-k experts of each token from the softmax of its
/// logits (renormalised over the k when norm_topk_prob), each expert a SwiGLU of its own under
/// `experts.<e>` (one module per expert, so that an expert-parallel split keeps the names), their
/// outputs summed with those weights. Dropless: every token reaches its k experts.
struct LlamaSparseMoeImpl : torch::nn::Module, tandem::parallel::ExpertParallelLayer {
  explicit LlamaSparseMoeImpl(const LlamaConfig& c);
  /// x [B, T, hidden] -> [B, T, hidden]; keeps this forward's router logits [B * T, experts].
  at::Tensor forward(const at::Tensor& x);
  int64_t top_k;
  bool norm_topk_prob;
  double jitter;
  tandem::nn::Linear gate{nullptr};
  torch::nn::ModuleList experts_list{nullptr};  ///< registered as "experts" (without ep)
  std::vector<LlamaMLP> experts;  ///< the experts this rank holds (all of them without ep)
  /// Each held expert's number in the layer ("experts.<e>": the names stay those of the whole
  /// layer under ep).
  std::vector<int64_t> expert_ids;
  int64_t num_experts = 0;  ///< the layer's experts, on every rank
  /// Note [Expert parallel]: keeps this rank's experts of `ep` (the others' modules dropped) and
  /// dispatches tokens to their ranks from now on.
  void keep_experts(std::shared_ptr<const tandem::parallel::ExpertParallel> ep) override;
  std::shared_ptr<const tandem::parallel::ExpertParallel> layer_expert_parallel() const override {
    return ep;
  }
  std::vector<at::Tensor> held_expert_parameters() override;
  at::Tensor forward_expert_parallel(const at::Tensor& h, const at::Tensor& weights,
                                     const at::Tensor& chosen);
  std::shared_ptr<const tandem::parallel::ExpertParallel> ep;
  at::Tensor router_logits;  ///< of the last forward (the load-balancing loss reads them)
  at::Tensor tokens_per_expert;  ///< of the last forward: [experts] counts (int64)
  /// The top-k choices each expert got, summed over the training forwards since the last
  /// LlamaForCausalLM::take_tokens_routed() (an activation checkpoint's recompute is not a
  /// forward of its own): [experts] int64, undefined before the first.
  at::Tensor tokens_routed;
};
TANDEM_MODULE(LlamaSparseMoe);

struct LlamaDecoderLayerImpl : torch::nn::Module {
  LlamaDecoderLayerImpl(const LlamaConfig& c, int64_t layer);
  at::Tensor forward(const at::Tensor& x);
  tandem::nn::RMSNorm input_layernorm{nullptr};
  LlamaAttention self_attn{nullptr};
  tandem::nn::RMSNorm post_attention_layernorm{nullptr};
  LlamaMLP mlp{nullptr};        ///< a dense layer's
  LlamaSparseMoe moe{nullptr};  ///< a sparse layer's ("mlp", Mixtral's "block_sparse_moe")
};
TANDEM_MODULE(LlamaDecoderLayer);

/// transformers' LlamaModel: hidden states [B, T, hidden] for token ids [B, T]. Not hookable
/// itself (the decoder layers are the outermost units).
struct LlamaModelImpl : torch::nn::Module {
  explicit LlamaModelImpl(const LlamaConfig& c);
  at::Tensor forward(const at::Tensor& ids);
  tandem::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers_list{nullptr};  ///< registered as "layers"
  std::vector<LlamaDecoderLayer> layers;
  tandem::nn::RMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaModel);

/// The output projection: logits = x @ weight^T, weight [vocab, hidden]; the embedding's tensor
/// when the config ties them.
struct LlamaHeadImpl : torch::nn::Module {
  explicit LlamaHeadImpl(at::Tensor w);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
};
TANDEM_MODULE(LlamaHead);

/// transformers' LlamaForCausalLM (and MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM):
/// logits [B, T, vocab]. Built with transformers' initialisation (normal(0, initializer_range)
/// matrices and embeddings, zero biases, unit norms), module by module, so that Accelerator::build
/// can shard each layer as it is made.
///
/// Context parallel (tandem launch --cp_size; Note [Context parallel]): prepare hands the model
/// the cp group, and forward and loss go on taking whole sequences [B, T] (T a multiple of
/// 2 cp): each rank embeds and computes its two chunks of every sequence, attention runs over
/// the group, loss is the whole batch's on every cp rank and forward gathers the whole logits.
struct LlamaForCausalLMImpl : torch::nn::Module,
                              tandem::parallel::ContextParallelModel,
                              tandem::parallel::ExpertParallelModel {
  explicit LlamaForCausalLMImpl(const LlamaConfig& c);
  at::Tensor forward(const at::Tensor& ids);
  /// transformers' causal-LM loss: the mean cross entropy of the logits at positions 0..T-2
  /// against labels 1..T-1, float32, positions whose label is -100 left out. `labels` [B, T]
  /// (usually the ids themselves). A mixture of experts whose config sets output_router_logits
  /// adds router_aux_loss_coef times router_aux_loss(), as transformers does.
  at::Tensor loss(const at::Tensor& ids, const at::Tensor& labels);
  /// The load-balancing loss of the last forward (Switch Transformer's, as transformers computes
  /// it): experts x sum over experts of (the fraction of top-k choices that went to it) x (its
  /// mean router probability), over the tokens of every sparse layer together. Undefined for a
  /// dense model.
  at::Tensor router_aux_loss();
  /// Per sparse layer, how many of the last forward's top-k choices each expert got.
  std::vector<at::Tensor> tokens_per_expert();
  /// Per sparse layer, the top-k choices each expert got over the training forwards since the
  /// last call (zeros for a layer that ran none: another pipeline stage's), [experts] int64 on
  /// the CPU each; the counts start again from zero.
  std::vector<at::Tensor> take_tokens_routed();
  /// Turns the key/value cache on or off and empties it.
  void use_cache(bool on);
  void set_attention(tandem::nn::AttentionKernel kernel);
  /// Splits every sequence over `cp` from now on (nullptr: whole sequences again). Refused for
  /// attention dropout in training and under the key/value cache (generation).
  void set_context_parallel(std::shared_ptr<const tandem::parallel::ContextParallel> cp) override;
  /// Expert parallel (tandem launch --ep_size; Note [Expert parallel]): every sparse layer keeps
  /// this rank's experts of `ep` and sends tokens to the others' ranks. Refused for a dense model
  /// and for an ep_size that does not divide the experts.
  void set_expert_parallel(std::shared_ptr<const tandem::parallel::ExpertParallel> ep) override;
  std::shared_ptr<const tandem::parallel::ExpertParallel> expert_parallel() const override {
    return expert_parallel_;
  }
  std::vector<at::Tensor> expert_parameters() override;
  LlamaConfig config;
  std::shared_ptr<const tandem::parallel::ContextParallel> context_parallel;
  LlamaModel model{nullptr};
  LlamaHead lm_head{nullptr};

 private:
  std::shared_ptr<const tandem::parallel::ExpertParallel> expert_parallel_;
};
TORCH_MODULE(LlamaForCausalLM);

/// The cross entropy transformers' causal-LM models compute (ForCausalLMLoss): logits [B, T, V]
/// at positions 0..T-2 against labels [B, T] at 1..T-1, in float32, mean over the labels that
/// are not -100.
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels);
/// The same loss of the whole batch from this rank's chunks under context parallel: `logits`
/// [B, T / cp, V] of this rank's chunks (ContextParallel::shard of the ids), `labels` [B, T]
/// whole; its value is the whole batch's mean on every cp rank, and averaging its gradients over
/// cp gives the whole batch's (Note [Context parallel]).
at::Tensor context_parallel_causal_lm_loss(const tandem::parallel::ContextParallel& cp,
                                           const at::Tensor& logits, const at::Tensor& labels);

/// transformers' base_model_tp_plan for the family: q/k/v and gate/up column-parallel, o and down
/// row-parallel (Megatron's split; the embedding, norms and head stay whole); Qwen3's q/k norms,
/// replicated but applied to this rank's heads only, get their gradients summed over tp. Needs
/// heads, KV heads and intermediate_size divisible by the tensor-parallel size
/// (check_llama_tensor_parallel).
tandem::parallel::TensorParallelPlan llama_tensor_parallel_plan(const LlamaConfig& c);
/// Throws tandem::Refused naming what a tensor-parallel size of `tp` does not divide.
void check_llama_tensor_parallel(const LlamaConfig& c, int64_t tp);

/// Note [Llama pipeline stages]: the model as a Sequential for pipeline parallel
/// (Accelerator::prepare_pipeline): children "0" (the token embedding), "1" .. "L" (the decoder
/// layers), "L+1" (the final norm) and "L+2" (the head), the very modules of `model`, so a model
/// loaded before is the pipeline's. Refused, naming the config key, for a head tied to the
/// embedding (they would live on the first and the last stage: tie_word_embeddings false) and
/// for the load-balancing loss (the router logits stay on their stages: output_router_logits
/// false). Its output: logits [B, T, vocab]; its loss: causal_lm_loss.
torch::nn::Sequential llama_sequential(const LlamaForCausalLM& model);
/// transformers' name of a llama_sequential parameter or path: "3.self_attn.q_proj.weight" ->
/// "model.layers.2.self_attn.q_proj.weight", "0.weight" -> "model.embed_tokens.weight".
std::string llama_name_of_sequential(const LlamaConfig& c, const std::string& name);
/// llama_tensor_parallel_plan on llama_sequential's paths ("*.self_attn.q_proj", ...).
tandem::parallel::TensorParallelPlan llama_sequential_tensor_parallel_plan(const LlamaConfig& c);

/// Writes a folder transformers' from_pretrained loads: config.json and the weights
/// (model.safetensors, or shards and an index past max_shard_size), every floating tensor as
/// `dtype` ("float32", "bfloat16", "float16"; "" keeps each tensor's). `tensors` are the dense
/// weights by name (Accelerator::get_state_dict on the main process, or named_parameters); a
/// tied head is left out, as transformers writes it.
void save_pretrained(const LlamaConfig& c,
                     const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     const std::string& dir, const std::string& dtype = "",
                     const std::string& max_shard_size = "5GB");

}  // namespace tandem::models
