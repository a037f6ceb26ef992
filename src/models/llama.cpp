// The Llama family's modules, loss, tensor-parallel plan and save_pretrained
// (tandem/models/llama.h; Note [One Llama] in llama_config.cpp).
#include "tandem/models/llama.h"

#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "tandem/checkpoint/model_io.h"
#include "tandem/error.h"
#include "tandem/parallel/tensor_parallel.h"

namespace tandem::models {
namespace {

tandem::nn::Linear linear(int64_t in, int64_t out, bool bias, double std) {
  tandem::nn::Linear l(torch::nn::LinearOptions(in, out).bias(bias));
  torch::NoGradGuard no_grad;
  l->weight.normal_(0.0, std);
  if (bias) l->bias.zero_();
  return l;
}

at::Tensor rotate_half(const at::Tensor& x) {
  const auto half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

at::Tensor activation(const std::string& act, const at::Tensor& x) {
  if (act == "silu") return torch::silu(x);
  if (act == "relu") return torch::relu(x);
  if (act == "gelu") return torch::gelu(x);
  return torch::gelu(x, "tanh");  // gelu_pytorch_tanh, gelu_new
}

}  // namespace

at::Tensor rope_inverse_frequencies(const LlamaConfig& c) {
  const auto dim = c.head_dim;
  // As transformers: int64 steps cast to float32, the power and the division in float32.
  auto exponents = torch::arange(0, dim, 2, torch::kLong).to(torch::kFloat) / static_cast<double>(dim);
  auto inv_freq = 1.0 / torch::pow(c.rope_theta, exponents);
  if (c.rope_type == "linear") return inv_freq / c.rope_factor;
  if (c.rope_type != "llama3") return inv_freq;
  const double factor = c.rope_factor, low = c.rope_low_freq_factor, high = c.rope_high_freq_factor;
  const double old_len = static_cast<double>(c.rope_original_max_position_embeddings);
  const double low_wavelen = old_len / low, high_wavelen = old_len / high;
  auto wavelen = 2 * M_PI / inv_freq;
  auto scaled = torch::where(wavelen > low_wavelen, inv_freq / factor, inv_freq);
  auto smooth = (old_len / wavelen - low) / (high - low);
  auto smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
  auto medium = (wavelen < high_wavelen).logical_not().logical_and((wavelen > low_wavelen).logical_not());
  return torch::where(medium, smoothed, scaled);
}

at::Tensor llama_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           std::optional<int64_t> window, double dropout, bool training,
                           tandem::nn::AttentionKernel kernel) {
  const int64_t L = q.size(-2), S = k.size(-2);
  const bool windowed = window && S > *window;
  if (!windowed && (dropout == 0.0 || !training))
    return tandem::nn::causal_attention(q, k, v, kernel);
  // The explicit form: query i (position S - L + i) sees keys j <= S - L + i, and with a window
  // only those with (S - L + i) - j < window.
  auto qpos = torch::arange(S - L, S, torch::TensorOptions().dtype(torch::kLong).device(q.device()))
                  .unsqueeze(1);
  auto kpos = torch::arange(0, S, torch::TensorOptions().dtype(torch::kLong).device(q.device()))
                  .unsqueeze(0);
  auto allowed = kpos <= qpos;
  if (window) allowed = allowed.logical_and(qpos - kpos < *window);
  auto att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  att = att.masked_fill(allowed.logical_not(), -std::numeric_limits<float>::infinity());
  att = torch::softmax(att, -1, torch::kFloat).to(q.scalar_type());
  if (dropout > 0.0 && training) att = torch::dropout(att, dropout, true);
  return torch::matmul(att, v);
}

// ---- modules ---------------------------------------------------------------------------------

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& c, int64_t layer)
    : head_dim(c.head_dim),
      dropout(c.attention_dropout),
      inv_freq(rope_inverse_frequencies(c)) {
  if (c.sliding_layers.at(static_cast<size_t>(layer))) window = c.sliding_window;
  const double std = c.initializer_range;
  q_proj = register_module("q_proj", linear(c.hidden_size, c.num_attention_heads * c.head_dim,
                                            c.qkv_bias, std));
  k_proj = register_module("k_proj", linear(c.hidden_size, c.num_key_value_heads * c.head_dim,
                                            c.qkv_bias, std));
  v_proj = register_module("v_proj", linear(c.hidden_size, c.num_key_value_heads * c.head_dim,
                                            c.qkv_bias, std));
  o_proj = register_module("o_proj", linear(c.num_attention_heads * c.head_dim, c.hidden_size,
                                            c.o_bias, std));
  if (c.qk_norm) {
    q_norm = register_module("q_norm", tandem::nn::RMSNorm(c.head_dim, c.rms_norm_eps));
    k_norm = register_module("k_norm", tandem::nn::RMSNorm(c.head_dim, c.rms_norm_eps));
  }
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x) {
  const auto B = x.size(0), T = x.size(1);
  auto q = q_proj(x), k = k_proj(x), v = v_proj(x);
  const auto H = q.size(-1) / head_dim, KV = k.size(-1) / head_dim;
  TANDEM_CHECK(H * head_dim == q.size(-1) && KV * head_dim == k.size(-1) && KV > 0 && H % KV == 0,
               "LlamaAttention: q/k/v give ", q.size(-1), "/", k.size(-1),
               " features, not whole heads of ", head_dim,
               " with the query heads a multiple of the key/value heads");
  q = q.view({B, T, H, head_dim});
  k = k.view({B, T, KV, head_dim});
  v = v.view({B, T, KV, head_dim});
  if (!q_norm.is_empty()) {
    q = q_norm(q);
    k = k_norm(k);
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  v = v.transpose(1, 2);
  // Rotary embeddings of positions past_length .. past_length + T - 1, in x's dtype.
  auto pos = torch::arange(past_length, past_length + T,
                           torch::TensorOptions().dtype(torch::kFloat).device(x.device()));
  auto freqs = pos.unsqueeze(1) * inv_freq.to(x.device()).unsqueeze(0);
  auto emb = torch::cat({freqs, freqs}, -1);
  auto cos = emb.cos().to(x.scalar_type()), sin = emb.sin().to(x.scalar_type());
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  if (use_cache) {
    if (past_k.defined()) {
      k = torch::cat({past_k, k}, 2);
      v = torch::cat({past_v, v}, 2);
    }
    past_k = k;
    past_v = v;
    past_length += T;
  }
  if (H != KV) {  // grouped-query attention: each key/value head serves H / KV query heads
    const auto S = k.size(2), groups = H / KV;
    k = k.unsqueeze(2).expand({B, KV, groups, S, head_dim}).reshape({B, H, S, head_dim});
    v = v.unsqueeze(2).expand({B, KV, groups, S, head_dim}).reshape({B, H, S, head_dim});
  }
  auto y = llama_attention(q, k, v, window, dropout, is_training(), kernel);
  return o_proj(y.transpose(1, 2).reshape({B, T, H * head_dim}));
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& c) : act(c.hidden_act) {
  const double std = c.initializer_range;
  gate_proj = register_module("gate_proj", linear(c.hidden_size, c.intermediate_size, c.mlp_bias, std));
  up_proj = register_module("up_proj", linear(c.hidden_size, c.intermediate_size, c.mlp_bias, std));
  down_proj = register_module("down_proj", linear(c.intermediate_size, c.hidden_size, c.mlp_bias, std));
}

at::Tensor LlamaMLPImpl::forward(const at::Tensor& x) {
  return down_proj(activation(act, gate_proj(x)) * up_proj(x));
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& c, int64_t layer) {
  input_layernorm = register_module("input_layernorm", tandem::nn::RMSNorm(c.hidden_size, c.rms_norm_eps));
  self_attn = register_module("self_attn", LlamaAttention(c, layer));
  post_attention_layernorm =
      register_module("post_attention_layernorm", tandem::nn::RMSNorm(c.hidden_size, c.rms_norm_eps));
  mlp = register_module("mlp", LlamaMLP(c));
}

at::Tensor LlamaDecoderLayerImpl::forward(const at::Tensor& x) {
  auto h = x + self_attn(input_layernorm(x));
  return h + mlp(post_attention_layernorm(h));
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c) {
  embed_tokens = register_module("embed_tokens", tandem::nn::Embedding(c.vocab_size, c.hidden_size));
  {
    torch::NoGradGuard no_grad;
    embed_tokens->weight.normal_(0.0, c.initializer_range);
  }
  layers_list = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    layers.push_back(LlamaDecoderLayer(c, i));
    layers_list->push_back(layers.back());
  }
  norm = register_module("norm", tandem::nn::RMSNorm(c.hidden_size, c.rms_norm_eps));
}

at::Tensor LlamaModelImpl::forward(const at::Tensor& ids) {
  auto x = embed_tokens(ids);
  for (auto& layer : layers) x = layer(x);
  return norm(x);
}

LlamaHeadImpl::LlamaHeadImpl(at::Tensor w) : weight(register_parameter("weight", std::move(w))) {}

at::Tensor LlamaHeadImpl::forward(const at::Tensor& x) { return torch::linear(x, weight); }

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& c) : config(c) {
  model = register_module("model", LlamaModel(c));
  at::Tensor w;
  if (c.tie_word_embeddings) {
    w = model->embed_tokens->weight;
  } else {
    torch::NoGradGuard no_grad;
    w = torch::empty({c.vocab_size, c.hidden_size}).normal_(0.0, c.initializer_range);
  }
  lm_head = register_module("lm_head", LlamaHead(w));
}

at::Tensor LlamaForCausalLMImpl::forward(const at::Tensor& ids) { return lm_head(model(ids)); }

at::Tensor LlamaForCausalLMImpl::loss(const at::Tensor& ids, const at::Tensor& labels) {
  return causal_lm_loss(forward(ids), labels);
}

void LlamaForCausalLMImpl::use_cache(bool on) {
  for (auto& layer : model->layers) {
    auto& a = layer->self_attn;
    a->use_cache = on;
    a->past_k = a->past_v = at::Tensor();
    a->past_length = 0;
  }
}

void LlamaForCausalLMImpl::set_attention(tandem::nn::AttentionKernel kernel) {
  for (auto& layer : model->layers) layer->self_attn->kernel = kernel;
}

at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  TANDEM_CHECK(logits.dim() == 3 && labels.dim() == 2 && logits.size(0) == labels.size(0) &&
                   logits.size(1) == labels.size(1),
               "causal_lm_loss: logits [B, T, V] and labels [B, T] expected, got ",
               logits.sizes(), " and ", labels.sizes());
  const auto T = logits.size(1), V = logits.size(2);
  auto shifted = labels.narrow(1, 1, T - 1).reshape({-1}).to(logits.device());
  auto l = logits.narrow(1, 0, T - 1).to(torch::kFloat).reshape({-1, V});
  return torch::nn::functional::cross_entropy(
      l, shifted, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
}

parallel::TensorParallelPlan llama_tensor_parallel_plan(const LlamaConfig& c) {
  parallel::TensorParallelPlan plan;
  plan.colwise("model.layers.*.self_attn.q_proj")
      .colwise("model.layers.*.self_attn.k_proj")
      .colwise("model.layers.*.self_attn.v_proj")
      .rowwise("model.layers.*.self_attn.o_proj")
      .colwise("model.layers.*.mlp.gate_proj")
      .colwise("model.layers.*.mlp.up_proj")
      .rowwise("model.layers.*.mlp.down_proj");
  if (c.qk_norm)
    plan.sum_gradients("model.layers.*.self_attn.q_norm")
        .sum_gradients("model.layers.*.self_attn.k_norm");
  return plan;
}

void check_llama_tensor_parallel(const LlamaConfig& c, int64_t tp) {
  if (tp <= 1) return;
  for (auto [what, n] : {std::pair<const char*, int64_t>{"num_attention_heads", c.num_attention_heads},
                         {"num_key_value_heads", c.num_key_value_heads},
                         {"intermediate_size", c.intermediate_size}})
    if (n % tp != 0)
      throw Refused("tensor parallel size " + std::to_string(tp) + " does not divide the " +
                    c.model_type + " model's " + what + " (" + std::to_string(n) +
                    "): each rank must hold whole heads and an equal share of the MLP; choose a "
                    "tp size that divides it");
}

void save_pretrained(const LlamaConfig& c,
                     const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     const std::string& dir, const std::string& dtype,
                     const std::string& max_shard_size) {
  std::optional<at::ScalarType> to;
  if (dtype == "float32" || dtype == "fp32") to = at::kFloat;
  else if (dtype == "bfloat16" || dtype == "bf16") to = at::kBFloat16;
  else if (dtype == "float16" || dtype == "fp16") to = at::kHalf;
  else if (!dtype.empty())
    throw Refused("save dtype '" + dtype + "': expected float32, bfloat16 or float16 (or none "
                  "to keep each tensor's)");
  std::vector<std::pair<std::string, at::Tensor>> out;
  at::ScalarType written = at::kFloat;
  for (const auto& [name, t] : tensors) {
    if (c.tie_word_embeddings && name == "lm_head.weight") continue;  // transformers ties it
    auto v = t.detach().to(at::kCPU);
    if (to && v.is_floating_point()) v = v.to(*to);
    if (v.is_floating_point()) written = v.scalar_type();
    out.emplace_back(name, v.contiguous());
  }
  std::filesystem::create_directories(dir);
  checkpoint::save_model_tensors(out, dir, max_shard_size);
  // The dtype the weights are in, as transformers records it.
  auto j = nlohmann::json::parse(c.to_json_text());
  j.erase("torch_dtype");
  j["dtype"] = written == at::kBFloat16 ? "bfloat16" : written == at::kHalf ? "float16" : "float32";
  const std::string text = j.dump(2) + "\n";
  std::ofstream f(std::filesystem::path(dir) / "config.json");
  f << text;
  if (!f) throw std::runtime_error("save_pretrained: cannot write " + dir + "/config.json");
}

}  // namespace tandem::models
