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
#include "tandem/comm/process_group.h"
#include "tandem/error.h"
#include "tandem/parallel/activation_checkpoint.h"
#include "tandem/parallel/expert_parallel.h"
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

// Whether some layer has the dense MLP (every layer of a dense model; a mixture's listed ones).
bool has_dense_layer(const LlamaConfig& c) {
  for (bool sparse : c.moe_layers)
    if (!sparse) return true;
  return c.moe_layers.empty();
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
  if (static_cast<size_t>(layer) < c.sliding_layers.size() &&
      c.sliding_layers[static_cast<size_t>(layer)])
    window = c.sliding_window;
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
  // Rotary embeddings of positions past_length .. past_length + T - 1 (under context parallel:
  // this rank's chunks of the whole sequence), in x's dtype.
  auto pos = cp ? cp->positions(T * cp->size(), x.device()).to(torch::kFloat)
                : torch::arange(past_length, past_length + T,
                                torch::TensorOptions().dtype(torch::kFloat).device(x.device()));
  auto freqs = pos.unsqueeze(1) * inv_freq.to(x.device()).unsqueeze(0);
  auto emb = torch::cat({freqs, freqs}, -1);
  auto cos = emb.cos().to(x.scalar_type()), sin = emb.sin().to(x.scalar_type());
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  TANDEM_CHECK(!(cp && use_cache), "LlamaAttention: the key/value cache does not run under "
               "context parallel; generate without cp_size");
  if (use_cache) {
    if (past_k.defined()) {
      k = torch::cat({past_k, k}, 2);
      v = torch::cat({past_v, v}, 2);
    }
    past_k = k;
    past_v = v;
    past_length += T;
  }
  if (cp) {  // Note [Context parallel]: the key/value heads travel unexpanded
    TANDEM_CHECK(dropout == 0.0 || !is_training(), "LlamaAttention: attention_dropout ", dropout,
                 " does not run under context parallel; set attention_dropout to 0 in "
                 "config.json or train without cp_size");
    auto y = cp->attention(q, k, v, /*causal=*/true, window);
    return o_proj(y.transpose(1, 2).reshape({B, T, H * head_dim}));
  }
  if (H != KV) {  // grouped-query attention: each key/value head serves H / KV query heads
    const auto S = k.size(2), groups = H / KV;
    k = k.unsqueeze(2).expand({B, KV, groups, S, head_dim}).reshape({B, H, S, head_dim});
    v = v.unsqueeze(2).expand({B, KV, groups, S, head_dim}).reshape({B, H, S, head_dim});
  }
  auto y = llama_attention(q, k, v, window, dropout, is_training(), kernel);
  return o_proj(y.transpose(1, 2).reshape({B, T, H * head_dim}));
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& c, int64_t width, bool mixtral_names)
    : act(c.hidden_act) {
  const double std = c.initializer_range;
  const int64_t f = width > 0 ? width : c.intermediate_size;
  const bool bias = c.mlp_bias && width == 0;
  gate_proj = register_module(mixtral_names ? "w1" : "gate_proj", linear(c.hidden_size, f, bias, std));
  up_proj = register_module(mixtral_names ? "w3" : "up_proj", linear(c.hidden_size, f, bias, std));
  down_proj = register_module(mixtral_names ? "w2" : "down_proj", linear(f, c.hidden_size, bias, std));
}

at::Tensor LlamaMLPImpl::forward(const at::Tensor& x) {
  return down_proj(activation(act, gate_proj(x)) * up_proj(x));
}

LlamaSparseMoeImpl::LlamaSparseMoeImpl(const LlamaConfig& c)
    : top_k(c.num_experts_per_tok), norm_topk_prob(c.norm_topk_prob), jitter(c.router_jitter_noise) {
  gate = register_module("gate", linear(c.hidden_size, c.num_experts, false, c.initializer_range));
  experts_list = register_module("experts", torch::nn::ModuleList());
  const bool mixtral = c.model_type == "mixtral";
  num_experts = c.num_experts;
  for (int64_t e = 0; e < c.num_experts; ++e) {
    experts.push_back(LlamaMLP(c, c.moe_intermediate_size, mixtral));
    experts_list->push_back(experts.back());
    expert_ids.push_back(e);
  }
}

void LlamaSparseMoeImpl::keep_experts(std::shared_ptr<const tandem::parallel::ExpertParallel> group) {
  if (!group || group->size() == 1) return;
  TANDEM_CHECK(!ep, "LlamaSparseMoe: the experts were split over an ep group already");
  const auto [first, count] = group->local_experts(num_experts);
  // A plain container under "experts" whose children keep the layer's numbers: this rank's
  // parameters are named as in the whole model's files.
  auto held = std::make_shared<torch::nn::Module>("LlamaExperts");
  std::vector<LlamaMLP> kept;
  std::vector<int64_t> ids;
  for (int64_t e = first; e < first + count; ++e) {
    kept.push_back(experts[static_cast<size_t>(e)]);
    ids.push_back(e);
    held->register_module(std::to_string(e), kept.back().ptr());
  }
  replace_module("experts", held);
  experts_list = nullptr;
  experts = std::move(kept);
  expert_ids = std::move(ids);
  ep = std::move(group);
}

std::vector<at::Tensor> LlamaSparseMoeImpl::held_expert_parameters() {
  std::vector<at::Tensor> out;
  for (auto& e : experts)
    for (auto& p : e->parameters()) out.push_back(p);
  return out;
}

at::Tensor LlamaSparseMoeImpl::forward(const at::Tensor& x) {
  const auto B = x.size(0), T = x.size(1), H = x.size(2);
  auto h = x;
  if (is_training() && jitter > 0) h = h * torch::empty_like(h).uniform_(1.0 - jitter, 1.0 + jitter);
  h = h.reshape({-1, H});
  router_logits = gate(h);  // [tokens, experts]
  auto probs = torch::softmax(router_logits, -1, torch::kFloat);
  auto [weights, chosen] = torch::topk(probs, top_k, -1);  // [tokens, k]
  if (norm_topk_prob) weights = weights / weights.sum(-1, /*keepdim=*/true);
  weights = weights.to(router_logits.scalar_type());
  const int64_t E = num_experts;
  tokens_per_expert = torch::bincount(chosen.reshape({-1}).to(torch::kCPU), {}, E);
  if (is_training() && !tandem::parallel::in_checkpoint_recompute())
    tokens_routed =
        tokens_routed.defined() ? tokens_routed + tokens_per_expert : tokens_per_expert.clone();
  if (ep) return forward_expert_parallel(h, weights, chosen).view({B, T, H});
  auto out = torch::zeros_like(h);
  // Expert by expert in ascending order (transformers' order of the sums), each on its tokens.
  for (int64_t e = 0; e < E; ++e) {
    auto hit = (chosen == e).nonzero();  // [n, 2]: token, slot
    if (hit.size(0) == 0) continue;
    auto token = hit.select(1, 0), slot = hit.select(1, 1);
    auto y = experts[static_cast<size_t>(e)](h.index_select(0, token));
    y = y * weights.index({token, slot}).unsqueeze(1);
    out.index_add_(0, token, y.to(out.scalar_type()));
  }
  return out.view({B, T, H});
}

// Note [Expert parallel]: every (token, choice) pair, ordered by expert (so by the rank that
// holds it), goes to that rank with its expert's number; each rank runs its experts on what it
// got, the outputs come back the same way, and are weighted and summed per token in the order of
// the experts, as without ep.
at::Tensor LlamaSparseMoeImpl::forward_expert_parallel(const at::Tensor& h, const at::Tensor& weights,
                                                       const at::Tensor& chosen) {
  const int64_t k = top_k, n = ep->size();
  auto flat = chosen.reshape({-1});  // pair p: token p / k, slot p % k
  auto order = std::get<1>(torch::sort(flat, /*stable=*/true, 0, /*descending=*/false));
  auto expert = flat.index_select(0, order);
  auto token = at::div(order, k, "floor");
  auto slot = order - token * k;
  auto per_rank = torch::bincount(expert.to(torch::kCPU), {}, num_experts).view({n, -1}).sum(1);
  std::vector<int64_t> send(per_rank.data_ptr<int64_t>(), per_rank.data_ptr<int64_t>() + n);
  std::vector<int64_t> recv;
  auto got = ep->all_to_all(h.index_select(0, token), send, &recv);
  auto got_expert = ep->group()->all_to_all_v(expert, send, recv);
  // Every row received belongs to one of this rank's experts: each is overwritten (the product
  // keeps the backward of the way back on every rank, rows or none).
  auto done = got * 0;
  for (size_t j = 0; j < experts.size(); ++j) {
    auto rows = (got_expert == expert_ids[j]).nonzero().select(1, 0);
    if (rows.size(0) == 0) continue;
    done = done.index_copy(0, rows, experts[j](got.index_select(0, rows)).to(done.scalar_type()));
  }
  auto back = ep->all_to_all(done, recv, send);
  back = back * weights.index({token, slot}).unsqueeze(1);
  return torch::zeros_like(h).index_add(0, token, back.to(h.scalar_type()));
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& c, int64_t layer) {
  input_layernorm = register_module("input_layernorm", tandem::nn::RMSNorm(c.hidden_size, c.rms_norm_eps));
  self_attn = register_module("self_attn", LlamaAttention(c, layer));
  post_attention_layernorm =
      register_module("post_attention_layernorm", tandem::nn::RMSNorm(c.hidden_size, c.rms_norm_eps));
  if (static_cast<size_t>(layer) < c.moe_layers.size() && c.moe_layers[static_cast<size_t>(layer)])
    moe = register_module(c.model_type == "mixtral" ? "block_sparse_moe" : "mlp", LlamaSparseMoe(c));
  else
    mlp = register_module("mlp", LlamaMLP(c));
}

at::Tensor LlamaDecoderLayerImpl::forward(const at::Tensor& x) {
  auto h = x + self_attn(input_layernorm(x));
  auto n = post_attention_layernorm(h);
  return h + (moe.is_empty() ? mlp(n) : moe(n));
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

at::Tensor LlamaForCausalLMImpl::forward(const at::Tensor& ids) {
  if (context_parallel)  // this rank's chunks, then the whole logits (Note [Context parallel])
    return context_parallel->unshard(lm_head(model(context_parallel->shard(ids, 1))), 1);
  return lm_head(model(ids));
}

void LlamaForCausalLMImpl::set_expert_parallel(
    std::shared_ptr<const tandem::parallel::ExpertParallel> ep) {
  if (!ep || ep->size() == 1) return;
  if (config.num_experts <= 0)
    throw Refused("LlamaForCausalLM: this run has ep_size " + std::to_string(ep->size()) +
                  " (tandem launch --ep_size), and the " + config.model_type +
                  " model has no experts to split; run without --ep_size");
  TANDEM_CHECK(!expert_parallel_, "LlamaForCausalLM: the experts were split over ep already");
  for (auto& layer : model->layers)
    if (!layer->moe.is_empty()) layer->moe->keep_experts(ep);
  expert_parallel_ = std::move(ep);
}

std::vector<at::Tensor> LlamaForCausalLMImpl::expert_parameters() {
  std::vector<at::Tensor> out;
  for (auto& layer : model->layers)
    if (!layer->moe.is_empty())
      for (auto& p : layer->moe->held_expert_parameters()) out.push_back(p);
  return out;
}

void LlamaForCausalLMImpl::set_context_parallel(
    std::shared_ptr<const tandem::parallel::ContextParallel> cp) {
  if (cp && cp->size() == 1) cp = nullptr;
  // The load-balancing loss is not linear in the tokens: each rank's chunks alone would give
  // another gradient than the whole sequence's.
  if (cp && config.num_experts > 0 && config.output_router_logits)
    throw Refused("LlamaForCausalLM: the config's output_router_logits adds the load-balancing "
                  "loss, which context parallel would compute over each rank's chunks of the "
                  "sequences rather than the whole batch; set output_router_logits to false in "
                  "config.json, or train without cp_size");
  context_parallel = cp;
  for (auto& layer : model->layers) layer->self_attn->set_layer_context_parallel(cp);
}

// Note [Context parallel]: the causal-LM loss of the whole batch from this rank's chunks: the
// labels shifted over the whole sequence first, this rank's sum of token losses scaled so that
// the average over cp is the whole batch's mean; its value is that mean on every cp rank.
at::Tensor context_parallel_causal_lm_loss(const tandem::parallel::ContextParallel& cp,
                                           const at::Tensor& logits, const at::Tensor& labels) {
  TANDEM_CHECK(labels.dim() == 2, "LlamaForCausalLM::loss: labels [B, T] expected, got ",
               labels.sizes());
  const auto T = labels.size(1), V = logits.size(2);
  auto shifted = torch::cat({labels.narrow(1, 1, T - 1),
                             torch::full({labels.size(0), 1}, -100, labels.options())},
                            1).to(logits.device());
  const double counted = (shifted != -100).sum().item<double>();
  auto local = cp.shard(shifted, 1).reshape({-1});
  auto sum = torch::nn::functional::cross_entropy(
      logits.to(torch::kFloat).reshape({-1, V}), local,
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum));
  auto whole = sum.detach().clone().reshape({1});
  cp.group()->allreduce(whole, ReduceOp::kSum);
  auto scaled = sum * (static_cast<double>(cp.size()) / counted);
  auto value = whole.reshape({}) / counted;
  return scaled + (value - scaled).detach();
}

at::Tensor LlamaForCausalLMImpl::loss(const at::Tensor& ids, const at::Tensor& labels) {
  auto l = context_parallel
               ? context_parallel_causal_lm_loss(*context_parallel,
                                       lm_head(model(context_parallel->shard(ids, 1))), labels)
               : causal_lm_loss(forward(ids), labels);
  if (config.num_experts > 0 && config.output_router_logits) {
    if (l.requires_grad())
      for (auto& layer : model->layers)
        if (!layer->moe.is_empty() && !layer->moe->router_logits.requires_grad())
          throw Refused(
              "LlamaForCausalLM::loss: the config's output_router_logits adds the "
              "load-balancing loss, but the router logits of a layer carry no gradient: its "
              "forward ran without autograd (activation checkpointing recomputes it in "
              "backward), so the router would not learn from that loss. Turn activation "
              "checkpointing off for this model, or set output_router_logits to false in "
              "config.json");
    l = l + config.router_aux_loss_coef * router_aux_loss().to(l.device());
  }
  return l;
}

at::Tensor LlamaForCausalLMImpl::router_aux_loss() {
  at::Tensor counts, probs;
  int64_t rows = 0;
  const auto E = config.num_experts, k = config.num_experts_per_tok;
  for (auto& layer : model->layers) {
    if (layer->moe.is_empty()) continue;
    const auto& logits = layer->moe->router_logits;
    TANDEM_CHECK(logits.defined(), "router_aux_loss: no forward has run");
    auto p = torch::softmax(logits, -1);
    auto chosen = std::get<1>(torch::topk(p, k, -1));
    auto c = torch::zeros({E}, p.options().dtype(torch::kFloat))
                 .scatter_add_(0, chosen.reshape({-1}),
                               torch::ones({chosen.numel()}, p.options().dtype(torch::kFloat)));
    auto s = p.to(torch::kFloat).sum(0);
    counts = counts.defined() ? counts + c : c;
    probs = probs.defined() ? probs + s : s;
    rows += p.size(0);
  }
  if (!counts.defined()) return {};
  return (counts / rows * (probs / rows)).sum() * static_cast<double>(E);
}

std::vector<at::Tensor> LlamaForCausalLMImpl::tokens_per_expert() {
  std::vector<at::Tensor> out;
  for (auto& layer : model->layers)
    if (!layer->moe.is_empty()) out.push_back(layer->moe->tokens_per_expert);
  return out;
}

std::vector<at::Tensor> LlamaForCausalLMImpl::take_tokens_routed() {
  std::vector<at::Tensor> out;
  for (auto& layer : model->layers) {
    if (layer->moe.is_empty()) continue;
    auto& t = layer->moe->tokens_routed;
    out.push_back(t.defined() ? t : torch::zeros({layer->moe->num_experts},
                                                 torch::kLong));
    t = at::Tensor();
  }
  return out;
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

namespace {

// The plan with every decoder layer's paths under `layers` ("model.layers.*." or "*.").
parallel::TensorParallelPlan tensor_parallel_plan(const LlamaConfig& c, const std::string& layers) {
  parallel::TensorParallelPlan plan;
  plan.colwise(layers + "self_attn.q_proj")
      .colwise(layers + "self_attn.k_proj")
      .colwise(layers + "self_attn.v_proj")
      .rowwise(layers + "self_attn.o_proj");
  // Experts stay whole on every tp rank (their input is whole after o_proj's all-reduce).
  if (has_dense_layer(c))
    plan.colwise(layers + "mlp.gate_proj")
        .colwise(layers + "mlp.up_proj")
        .rowwise(layers + "mlp.down_proj");
  if (c.qk_norm)
    plan.sum_gradients(layers + "self_attn.q_norm").sum_gradients(layers + "self_attn.k_norm");
  return plan;
}

}  // namespace

parallel::TensorParallelPlan llama_tensor_parallel_plan(const LlamaConfig& c) {
  return tensor_parallel_plan(c, "model.layers.*.");
}

parallel::TensorParallelPlan llama_sequential_tensor_parallel_plan(const LlamaConfig& c) {
  return tensor_parallel_plan(c, "*.");
}

// Note [Llama pipeline stages]
torch::nn::Sequential llama_sequential(const LlamaForCausalLM& model) {
  const auto& c = model->config;
  if (c.tie_word_embeddings)
    throw Refused("a " + c.model_type + " model with tie_word_embeddings true cannot be split "
                  "into pipeline stages: its head is the token embedding, which lives on the "
                  "first stage and the head on the last; set \"tie_word_embeddings\": false in "
                  "config.json (a tied checkpoint holds no lm_head.weight: add one, a copy of "
                  "model.embed_tokens.weight, to its safetensors), or train without --pp_size");
  if (c.num_experts > 0 && c.output_router_logits)
    throw Refused("a " + c.model_type + " model with output_router_logits true cannot be split "
                  "into pipeline stages: its load-balancing loss needs every layer's router "
                  "logits, which stay on their stages; set \"output_router_logits\": false, or "
                  "train without --pp_size");
  torch::nn::Sequential seq;
  seq->push_back(model->model->embed_tokens);
  for (const auto& layer : model->model->layers) seq->push_back(layer);
  seq->push_back(model->model->norm);
  seq->push_back(model->lm_head);
  return seq;
}

std::string llama_name_of_sequential(const LlamaConfig& c, const std::string& name) {
  const auto dot = name.find('.');
  const std::string head = name.substr(0, dot), rest = dot == std::string::npos ? "" : name.substr(dot);
  int64_t k = -1;
  try {
    size_t pos = 0;
    k = std::stoll(head, &pos);
    if (pos != head.size()) k = -1;
  } catch (const std::exception&) {
    k = -1;
  }
  const int64_t L = c.num_hidden_layers;
  if (k < 0 || k > L + 2)
    throw std::invalid_argument("llama_name_of_sequential: '" + name + "' is not a path of a " +
                                std::to_string(L) + "-layer llama_sequential (0 .. " +
                                std::to_string(L + 2) + ")");
  if (k == 0) return "model.embed_tokens" + rest;
  if (k <= L) return "model.layers." + std::to_string(k - 1) + rest;
  if (k == L + 1) return "model.norm" + rest;
  return "lm_head" + rest;
}

void check_llama_tensor_parallel(const LlamaConfig& c, int64_t tp) {
  if (tp <= 1) return;
  const bool dense = has_dense_layer(c);
  for (auto [what, n] : {std::pair<const char*, int64_t>{"num_attention_heads", c.num_attention_heads},
                         {"num_key_value_heads", c.num_key_value_heads},
                         {"intermediate_size", dense ? c.intermediate_size : tp}})
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
