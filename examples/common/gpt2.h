// GPT-2 as transformers defines it (GPT2LMHeadModel), in LibTorch, with the same parameter names
// and shapes, so that a checkpoint written by save_pretrained loads as it is: token and position
// embeddings, blocks of LayerNorm, causal self-attention through Conv1D layers (weights stored
// [in, out]), a GELU MLP, the final LayerNorm and the output head tied to the token embedding.
// A key/value cache per attention layer for generation. Every module is hookable (TANDEM_MODULE),
// so device maps, disk offload and quantization reach the members the model calls directly.
#pragma once

#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "tandem/nn/layers.h"
#include "tandem/nn/module.h"

namespace examples {

/// The fields of transformers' GPT2Config that shape the model; from_file refuses the settings
/// this port does not compute (rather than running another model than the checkpoint's).
struct GPT2Config {
  int64_t vocab_size = 50257;
  int64_t n_positions = 1024;
  int64_t n_embd = 768;
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_inner = 0;  // 0: 4 * n_embd
  double layer_norm_epsilon = 1e-5;
  std::string activation_function = "gelu_new";
  bool tie_word_embeddings = true;

  static GPT2Config from_file(const std::string& path) {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("GPT-2: cannot read '" + path + "' (config.json)");
    nlohmann::json j = nlohmann::json::parse(in);
    auto refuse = [&](const std::string& key, const std::string& why) {
      throw std::runtime_error("GPT-2 config '" + path + "': " + key + " " + why +
                               "; this port computes GPT-2 as transformers' defaults do");
    };
    if (j.value("model_type", "gpt2") != "gpt2")
      refuse("model_type", "is '" + j.value("model_type", "") + "', not gpt2");
    GPT2Config c;
    c.vocab_size = j.value("vocab_size", c.vocab_size);
    c.n_positions = j.value("n_positions", c.n_positions);
    c.n_embd = j.value("n_embd", c.n_embd);
    c.n_layer = j.value("n_layer", c.n_layer);
    c.n_head = j.value("n_head", c.n_head);
    if (j.contains("n_inner") && !j["n_inner"].is_null()) c.n_inner = j["n_inner"].get<int64_t>();
    c.layer_norm_epsilon = j.value("layer_norm_epsilon", c.layer_norm_epsilon);
    c.activation_function = j.value("activation_function", c.activation_function);
    c.tie_word_embeddings = j.value("tie_word_embeddings", true);
    const auto& act = c.activation_function;
    if (act != "gelu_new" && act != "gelu_pytorch_tanh" && act != "gelu" && act != "relu")
      refuse("activation_function", "is '" + act + "' (gelu_new, gelu_pytorch_tanh, gelu, relu)");
    if (j.value("scale_attn_by_inverse_layer_idx", false))
      refuse("scale_attn_by_inverse_layer_idx", "is true");
    if (j.value("reorder_and_upcast_attn", false)) refuse("reorder_and_upcast_attn", "is true");
    if (!j.value("scale_attn_weights", true)) refuse("scale_attn_weights", "is false");
    if (j.value("add_cross_attention", false)) refuse("add_cross_attention", "is true");
    if (c.n_embd % c.n_head != 0) refuse("n_embd", "is not a multiple of n_head");
    return c;
  }
  int64_t inner() const { return n_inner > 0 ? n_inner : 4 * n_embd; }
};

/// Causal self-attention with a key/value cache: while `use_cache` is set, each forward appends
/// its keys and values and attends over all of them (its queries are the newest positions).
struct GPT2AttentionImpl : torch::nn::Module {
  explicit GPT2AttentionImpl(const GPT2Config& c)
      : heads(c.n_head),
        c_attn(register_module("c_attn", tandem::nn::Conv1D(c.n_embd, 3 * c.n_embd))),
        c_proj(register_module("c_proj", tandem::nn::Conv1D(c.n_embd, c.n_embd))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const auto B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads;
    auto parts = c_attn(x).split(C, 2);
    auto shape = [&](const torch::Tensor& t) { return t.view({B, T, heads, hd}).transpose(1, 2); };
    auto q = shape(parts[0]), k = shape(parts[1]), v = shape(parts[2]);
    if (use_cache) {
      if (past_k.defined()) {
        k = torch::cat({past_k, k}, 2);
        v = torch::cat({past_v, v}, 2);
      }
      past_k = k;
      past_v = v;
    }
    auto y = tandem::nn::causal_attention(q, k, v, kernel);
    return c_proj(y.transpose(1, 2).contiguous().view({B, T, C}));
  }
  int64_t heads;
  tandem::nn::Conv1D c_attn, c_proj;
  bool use_cache = false;
  tandem::nn::AttentionKernel kernel = tandem::nn::AttentionKernel::kAuto;
  torch::Tensor past_k, past_v;
};
TANDEM_MODULE(GPT2Attention);

struct GPT2MLPImpl : torch::nn::Module {
  explicit GPT2MLPImpl(const GPT2Config& c)
      : act(c.activation_function),
        c_fc(register_module("c_fc", tandem::nn::Conv1D(c.n_embd, c.inner()))),
        c_proj(register_module("c_proj", tandem::nn::Conv1D(c.inner(), c.n_embd))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = c_fc(x);
    if (act == "relu")
      h = torch::relu(h);
    else
      h = torch::gelu(h, act == "gelu" ? "none" : "tanh");  // gelu_new is the tanh form
    return c_proj(h);
  }
  std::string act;
  tandem::nn::Conv1D c_fc, c_proj;
};
TANDEM_MODULE(GPT2MLP);

inline tandem::nn::LayerNorm gpt2_layer_norm(const GPT2Config& c) {
  return tandem::nn::LayerNorm(
      torch::nn::LayerNormOptions({c.n_embd}).eps(c.layer_norm_epsilon));
}

struct GPT2BlockImpl : torch::nn::Module {
  explicit GPT2BlockImpl(const GPT2Config& c)
      : ln_1(register_module("ln_1", gpt2_layer_norm(c))),
        attn(register_module("attn", GPT2Attention(c))),
        ln_2(register_module("ln_2", gpt2_layer_norm(c))),
        mlp(register_module("mlp", GPT2MLP(c))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn(ln_1(x));
    return x + mlp(ln_2(x));
  }
  tandem::nn::LayerNorm ln_1;
  GPT2Attention attn;
  tandem::nn::LayerNorm ln_2;
  GPT2MLP mlp;
};
TANDEM_MODULE(GPT2Block);

/// transformers' GPT2Model: hidden states [B, T, n_embd] for token ids [B, T].
struct GPT2ModelImpl : torch::nn::Module {
  explicit GPT2ModelImpl(const GPT2Config& c) {
    wte = register_module("wte", tandem::nn::Embedding(c.vocab_size, c.n_embd));
    wpe = register_module("wpe", tandem::nn::Embedding(c.n_positions, c.n_embd));
    h = register_module("h", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.n_layer; ++i) {
      blocks.push_back(GPT2Block(c));
      h->push_back(blocks.back());
    }
    ln_f = register_module("ln_f", gpt2_layer_norm(c));
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    auto pos = torch::arange(past_length, past_length + ids.size(1),
                             torch::TensorOptions().dtype(torch::kLong).device(ids.device()));
    auto x = wte(ids) + wpe(pos).to(ids.device()).unsqueeze(0);
    for (auto& b : blocks) x = b(x);
    if (blocks.front()->attn->use_cache) past_length += ids.size(1);
    return ln_f(x);
  }
  tandem::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  std::vector<GPT2Block> blocks;
  tandem::nn::LayerNorm ln_f{nullptr};
  int64_t past_length = 0;
};
TANDEM_MODULE(GPT2Model);

/// The output head: logits = x @ weight^T, weight [vocab, n_embd] (the token embedding's when
/// tied).
struct GPT2HeadImpl : torch::nn::Module {
  explicit GPT2HeadImpl(torch::Tensor w) : weight(register_parameter("weight", std::move(w))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(weight.to(x.device()).t()); }
  torch::Tensor weight;
};
TANDEM_MODULE(GPT2Head);

/// transformers' GPT2LMHeadModel: logits [B, T, vocab].
struct GPT2LMHeadModelImpl : torch::nn::Module {
  explicit GPT2LMHeadModelImpl(const GPT2Config& c) : config(c) {
    transformer = register_module("transformer", GPT2Model(c));
    auto w = c.tie_word_embeddings ? transformer->wte->weight
                                   : torch::empty({c.vocab_size, c.n_embd}).normal_(0.0, 0.02);
    lm_head = register_module("lm_head", GPT2Head(w));
  }
  torch::Tensor forward(const torch::Tensor& ids) { return lm_head(transformer(ids)); }
  /// Turns the key/value cache on or off and empties it.
  void use_cache(bool on) {
    for (auto& b : transformer->blocks) {
      b->attn->use_cache = on;
      b->attn->past_k = b->attn->past_v = torch::Tensor();
    }
    transformer->past_length = 0;
  }
  void set_attention(tandem::nn::AttentionKernel k) {
    for (auto& b : transformer->blocks) b->attn->kernel = k;
  }
  GPT2Config config;
  GPT2Model transformer{nullptr};
  GPT2Head lm_head{nullptr};
};
TANDEM_MODULE(GPT2LMHeadModel);

}  // namespace examples
