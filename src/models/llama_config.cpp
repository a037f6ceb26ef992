// LlamaConfig: config.json in and out (tandem/models/llama.h).
//
// Note [One Llama]: transformers' Llama, Mistral, Qwen2 and Qwen3 are one computation with
// flags: Qwen2 adds biases to q/k/v, Qwen3 normalises each head's queries and keys (and makes
// head_dim its own setting), Mistral and the Qwen models may mask keys beyond a sliding window.
// The config reader turns each family's keys into those flags and refuses, by name, every key
// that would change the computation in a way the port does not follow; keys that do not change it
// (token ids, dtype, generation defaults) are kept and written back.
#include "tandem/models/llama.h"

#include "../detail/read_file.h"

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "tandem/error.h"

namespace tandem::models {
namespace {

using nlohmann::json;

// Keys of a config.json that do not change what the model computes.
const std::set<std::string>& neutral_keys() {
  static const std::set<std::string> keys{
      "_name_or_path", "architectures", "bos_token_id", "eos_token_id", "pad_token_id",
      "sep_token_id", "decoder_start_token_id", "dtype", "torch_dtype", "transformers_version",
      "use_cache", "id2label", "label2id", "output_attentions", "output_hidden_states",
      "return_dict", "problem_type", "chunk_size_feed_forward", "tokenizer_class", "pretraining_tp",
      "finetuning_task", "prefix", "task_specific_params", "torchscript", "use_bfloat16",
      "tf_legacy_loss", "tie_encoder_decoder", "cross_attention_hidden_size", "is_decoder",
      // Generation defaults that older transformers wrote into config.json.
      "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
      "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
      "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
      "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
      "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
      "suppress_tokens", "begin_suppress_tokens"};
  return keys;
}

// The keys each family's config has that shape the model.
const std::set<std::string>& shape_keys(const std::string& type) {
  static const std::set<std::string> common{
      "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
      "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
      "initializer_range", "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "rope_theta",
      "rope_scaling", "attention_dropout", "head_dim", "is_encoder_decoder", "add_cross_attention",
      "pruned_heads"};
  static const std::map<std::string, std::set<std::string>> own{
      {"llama", {"attention_bias", "mlp_bias"}},
      {"mistral", {"sliding_window"}},
      {"qwen2", {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
                 "use_mrope"}},
      {"qwen3", {"attention_bias", "sliding_window", "use_sliding_window", "max_window_layers",
                 "layer_types"}},
      {"mixtral", {"sliding_window", "num_local_experts", "num_experts_per_tok",
                   "router_aux_loss_coef", "router_jitter_noise", "output_router_logits"}},
      {"qwen3_moe", {"attention_bias", "sliding_window", "use_sliding_window", "max_window_layers",
                     "layer_types", "num_experts", "num_local_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
                     "norm_topk_prob", "router_aux_loss_coef", "output_router_logits"}}};
  static std::map<std::string, std::set<std::string>> all;
  auto& s = all[type];
  if (s.empty()) {
    s = common;
    s.insert(own.at(type).begin(), own.at(type).end());
  }
  return s;
}

}  // namespace

LlamaConfig LlamaConfig::from_json_text(const std::string& text, const std::string& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Refused(where + ": not JSON (" + e.what() + ")");
  }
  if (!j.is_object()) throw Refused(where + ": expected a JSON object");
  auto refuse = [&](const std::string& key, const std::string& why) -> void {
    throw Refused(where + ": " + key + " " + why);
  };
  LlamaConfig c;
  c.model_type = j.value("model_type", std::string());
  if (c.model_type != "llama" && c.model_type != "mistral" && c.model_type != "qwen2" &&
      c.model_type != "qwen3" && c.model_type != "mixtral" && c.model_type != "qwen3_moe")
    refuse("model_type", "is '" + c.model_type +
                             "'; this model computes llama, mistral, qwen2, qwen3, mixtral and "
                             "qwen3_moe");
  const auto& own = shape_keys(c.model_type);
  json kept = json::object();
  for (const auto& [key, value] : j.items()) {
    if (own.count(key)) continue;
    if (neutral_keys().count(key)) {
      kept[key] = value;
      continue;
    }
    if (key == "quantization_config")
      refuse(key, "is set: the weights are quantized by another tool; load an unquantized "
                  "checkpoint (tandem quantizes for inference with `tandem quantize`)");
    if (key == "auto_map")
      refuse(key, "is set: the model needs its own Python code (trust_remote_code); tandem "
                  "computes only the families it implements");
    refuse(key, "is not a key of " + c.model_type +
                    "'s config that this port computes; remove it if it does not change the "
                    "model, or use a checkpoint of a supported family");
  }
  auto get_int = [&](const char* key, int64_t fallback) -> int64_t {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    if (!j[key].is_number_integer()) refuse(key, "is " + j[key].dump() + ", not an integer");
    return j[key].get<int64_t>();
  };
  auto get_double = [&](const json& o, const char* key, double fallback) -> double {
    if (!o.contains(key) || o[key].is_null()) return fallback;
    if (!o[key].is_number()) refuse(key, "is " + o[key].dump() + ", not a number");
    return o[key].get<double>();
  };
  auto get_bool = [&](const char* key, bool fallback) -> bool {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    if (!j[key].is_boolean()) refuse(key, "is " + j[key].dump() + ", not true or false");
    return j[key].get<bool>();
  };
  const bool qwen = c.model_type == "qwen2" || c.model_type == "qwen3" || c.model_type == "qwen3_moe";
  const bool moe = c.model_type == "mixtral" || c.model_type == "qwen3_moe";
  const bool qwen_moe = c.model_type == "qwen3_moe";
  c.vocab_size = get_int("vocab_size", qwen ? 151936 : 32000);
  c.hidden_size = get_int("hidden_size", qwen_moe ? 2048 : 4096);
  c.intermediate_size = get_int("intermediate_size", c.model_type == "llama" ? 11008
                                                     : qwen_moe             ? 6144
                                                                            : 14336);
  c.num_hidden_layers = get_int("num_hidden_layers", qwen_moe ? 24 : 32);
  c.num_attention_heads = get_int("num_attention_heads", 32);
  c.num_key_value_heads = get_int("num_key_value_heads", c.num_attention_heads);
  if (c.model_type == "qwen2") c.num_key_value_heads = get_int("num_key_value_heads", 32);
  if (c.model_type == "mistral" || c.model_type == "mixtral")
    c.num_key_value_heads = get_int("num_key_value_heads", 8);
  if (qwen_moe) c.num_key_value_heads = get_int("num_key_value_heads", 4);
  for (auto [key, v] : {std::pair<const char*, int64_t>{"vocab_size", c.vocab_size},
                        {"hidden_size", c.hidden_size},
                        {"intermediate_size", c.intermediate_size},
                        {"num_hidden_layers", c.num_hidden_layers},
                        {"num_attention_heads", c.num_attention_heads},
                        {"num_key_value_heads", c.num_key_value_heads}})
    if (v <= 0) refuse(key, "is " + std::to_string(v) + "; it must be positive");
  c.head_dim = get_int("head_dim", c.model_type == "qwen3" ? 128
                                                           : c.hidden_size / c.num_attention_heads);
  if (c.model_type != "qwen3" && !j.contains("head_dim") &&
      c.hidden_size % c.num_attention_heads != 0)
    refuse("hidden_size", "(" + std::to_string(c.hidden_size) +
                              ") is not a multiple of num_attention_heads (" +
                              std::to_string(c.num_attention_heads) + ")");
  if (c.head_dim <= 0 || c.head_dim % 2 != 0)
    refuse("head_dim", "is " + std::to_string(c.head_dim) + "; rotary embeddings need it even");
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    refuse("num_key_value_heads", "(" + std::to_string(c.num_key_value_heads) +
                                      ") does not divide num_attention_heads (" +
                                      std::to_string(c.num_attention_heads) + ")");
  c.max_position_embeddings =
      get_int("max_position_embeddings", c.model_type == "llama" ? 2048
                                         : c.model_type == "mistral" || c.model_type == "mixtral"
                                             ? 131072
                                             : 32768);
  c.rms_norm_eps = get_double(j, "rms_norm_eps", c.model_type == "mixtral" ? 1e-5 : 1e-6);
  c.initializer_range = get_double(j, "initializer_range", 0.02);
  c.attention_dropout = get_double(j, "attention_dropout", 0.0);
  if (c.attention_dropout < 0 || c.attention_dropout >= 1)
    refuse("attention_dropout", "is " + std::to_string(c.attention_dropout) + "; expected [0, 1)");
  c.hidden_act = j.value("hidden_act", std::string("silu"));
  if (c.hidden_act != "silu" && c.hidden_act != "gelu" && c.hidden_act != "gelu_pytorch_tanh" &&
      c.hidden_act != "gelu_new" && c.hidden_act != "relu")
    refuse("hidden_act", "is '" + c.hidden_act + "' (silu, gelu, gelu_pytorch_tanh, gelu_new, relu)");
  c.tie_word_embeddings = get_bool("tie_word_embeddings", false);
  if (get_bool("is_encoder_decoder", false)) refuse("is_encoder_decoder", "is true");
  if (get_bool("add_cross_attention", false)) refuse("add_cross_attention", "is true");
  if (j.contains("pruned_heads") && !j["pruned_heads"].is_null() && !j["pruned_heads"].empty())
    refuse("pruned_heads", "is set; a pruned model has other shapes per layer");
  if (c.model_type == "llama" || c.model_type == "qwen3" || qwen_moe) {
    c.qkv_bias = c.o_bias = get_bool("attention_bias", false);
  }
  if (c.model_type == "qwen2") c.qkv_bias = true;
  if (c.model_type == "llama") c.mlp_bias = get_bool("mlp_bias", false);
  c.qk_norm = c.model_type == "qwen3" || qwen_moe;
  c.moe_layers.assign(static_cast<size_t>(c.num_hidden_layers), false);
  if (moe) {
    if (j.contains("num_experts") && j.contains("num_local_experts") &&
        j["num_experts"] != j["num_local_experts"])
      refuse("num_experts", "and num_local_experts differ (" + j["num_experts"].dump() + ", " +
                                j["num_local_experts"].dump() + "); they name one setting");
    c.num_experts = get_int(j.contains("num_experts") ? "num_experts" : "num_local_experts",
                            qwen_moe ? 128 : 8);
    c.num_experts_per_tok = get_int("num_experts_per_tok", qwen_moe ? 8 : 2);
    c.moe_intermediate_size =
        qwen_moe ? get_int("moe_intermediate_size", 768) : c.intermediate_size;
    c.norm_topk_prob = qwen_moe ? get_bool("norm_topk_prob", false) : true;
    c.router_aux_loss_coef = get_double(j, "router_aux_loss_coef", 0.001);
    c.router_jitter_noise = qwen_moe ? 0.0 : get_double(j, "router_jitter_noise", 0.0);
    c.output_router_logits = get_bool("output_router_logits", false);
    if (c.num_experts <= 0) refuse("num_experts", "must be positive");
    if (c.num_experts_per_tok <= 0 || c.num_experts_per_tok > c.num_experts)
      refuse("num_experts_per_tok", "is " + std::to_string(c.num_experts_per_tok) +
                                        "; expected 1.." + std::to_string(c.num_experts));
    if (c.moe_intermediate_size <= 0) refuse("moe_intermediate_size", "must be positive");
    if (c.router_jitter_noise < 0 || c.router_jitter_noise >= 1)
      refuse("router_jitter_noise", "expected [0, 1)");
    std::set<int64_t> dense;
    if (qwen_moe && j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
      if (!j["mlp_only_layers"].is_array()) refuse("mlp_only_layers", "must be a list of layers");
      for (const auto& v : j["mlp_only_layers"]) {
        if (!v.is_number_integer()) refuse("mlp_only_layers", "must list layer indices");
        dense.insert(v.get<int64_t>());
      }
    }
    const int64_t step = qwen_moe ? get_int("decoder_sparse_step", 1) : 1;
    if (step <= 0) refuse("decoder_sparse_step", "must be positive");
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      c.moe_layers[i] = !dense.count(i) && (i + 1) % step == 0;
  }
  if (c.model_type == "qwen2" && get_bool("use_mrope", false))
    refuse("use_mrope", "is true (multimodal rotary positions)");

  // Rotary embeddings: rope_parameters (transformers 5), else rope_theta + rope_scaling.
  json rope = json::object();
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null())
    rope = j["rope_parameters"];
  else if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
    rope = j["rope_scaling"];
  if (!rope.is_object()) refuse("rope_parameters", "is " + rope.dump() + ", not an object");
  const json theta_holder = rope.contains("rope_theta") ? rope : j;
  c.rope_theta = get_double(theta_holder, "rope_theta", c.model_type == "mixtral" ? 1e6 : 1e4);
  c.rope_type = rope.value("rope_type", rope.value("type", std::string("default")));
  for (const auto& [key, value] : rope.items()) {
    static const std::set<std::string> known{"rope_type", "type", "rope_theta", "factor",
                                             "low_freq_factor", "high_freq_factor",
                                             "original_max_position_embeddings"};
    if (!known.count(key))
      refuse("rope_parameters." + key,
             "is set; the rotary embeddings computed here are default, linear and llama3 "
             "(without " + key + ")");
  }
  if (c.rope_type == "linear") {
    c.rope_factor = get_double(rope, "factor", 1.0);
  } else if (c.rope_type == "llama3") {
    for (const char* key : {"factor", "low_freq_factor", "high_freq_factor"})
      if (!rope.contains(key)) refuse(std::string("rope_parameters.") + key, "is missing (llama3)");
    c.rope_factor = get_double(rope, "factor", 8.0);
    c.rope_low_freq_factor = get_double(rope, "low_freq_factor", 1.0);
    c.rope_high_freq_factor = get_double(rope, "high_freq_factor", 4.0);
    c.rope_original_max_position_embeddings = static_cast<int64_t>(get_double(
        rope, "original_max_position_embeddings", static_cast<double>(c.max_position_embeddings)));
    if (c.rope_high_freq_factor == c.rope_low_freq_factor)
      refuse("rope_parameters.high_freq_factor", "equals low_freq_factor (llama3 divides by the "
                                                 "difference)");
  } else if (c.rope_type != "default") {
    refuse("rope_parameters.rope_type", "is '" + c.rope_type +
                                            "'; the rotary embeddings computed here are default, "
                                            "linear and llama3");
  }
  if (c.rope_theta <= 0) refuse("rope_theta", "must be positive");
  if (c.rope_factor <= 0) refuse("rope_parameters.factor", "must be positive");

  // Sliding windows: Mistral's applies to every layer; the Qwen models' to the layers
  // layer_types marks (derived, when absent, as transformers does).
  std::optional<int64_t> window;
  if (j.contains("sliding_window") && !j["sliding_window"].is_null())
    window = get_int("sliding_window", 0);
  else if (qwen && !j.contains("sliding_window"))
    window = 4096;
  if (qwen && !get_bool("use_sliding_window", false)) window.reset();
  if (window && *window <= 0) refuse("sliding_window", "must be positive");
  c.sliding_layers.assign(static_cast<size_t>(c.num_hidden_layers), false);
  if (c.model_type == "mistral" || c.model_type == "mixtral") {
    c.sliding_window = window;
    if (window) c.sliding_layers.assign(c.sliding_layers.size(), true);
  } else if (qwen) {
    if (j.contains("layer_types") && !j["layer_types"].is_null()) {
      const auto& types = j["layer_types"];
      if (!types.is_array() || static_cast<int64_t>(types.size()) != c.num_hidden_layers)
        refuse("layer_types", "must list one type per layer (" +
                                  std::to_string(c.num_hidden_layers) + ")");
      for (size_t i = 0; i < types.size(); ++i) {
        const auto t = types[i].is_string() ? types[i].get<std::string>() : types[i].dump();
        if (t == "sliding_attention") {
          if (!window) refuse("layer_types", "marks layer " + std::to_string(i) +
                                                 " sliding_attention without a sliding_window");
          c.sliding_layers[i] = true;
        } else if (t != "full_attention") {
          refuse("layer_types", "has '" + t + "' (full_attention, sliding_attention)");
        }
      }
    } else if (window) {
      const int64_t first = get_int("max_window_layers", 28);
      for (int64_t i = first; i < c.num_hidden_layers; ++i) c.sliding_layers[i] = true;
    }
    bool any = false;
    for (bool s : c.sliding_layers) any = any || s;
    if (any) c.sliding_window = window;
  }
  kept.erase("architectures");
  c.kept_json = kept.dump();
  return c;
}

LlamaConfig LlamaConfig::from_file(const std::string& path) {
  const auto text = ::tandem::detail::read_file(path);
  if (!text) throw Refused("cannot read '" + path + "' (a model's config.json)");
  return from_json_text(*text, path);
}

std::string LlamaConfig::architecture() const {
  if (model_type == "llama") return "LlamaForCausalLM";
  if (model_type == "mixtral") return "MixtralForCausalLM";
  if (model_type == "qwen3_moe") return "Qwen3MoeForCausalLM";
  if (model_type == "mistral") return "MistralForCausalLM";
  if (model_type == "qwen2") return "Qwen2ForCausalLM";
  return "Qwen3ForCausalLM";
}

std::string LlamaConfig::to_json_text() const {
  json j = json::parse(kept_json);
  j["architectures"] = json::array({architecture()});
  j["model_type"] = model_type;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["hidden_act"] = hidden_act;
  j["max_position_embeddings"] = max_position_embeddings;
  j["initializer_range"] = initializer_range;
  j["rms_norm_eps"] = rms_norm_eps;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["attention_dropout"] = attention_dropout;
  json rope{{"rope_type", rope_type}, {"rope_theta", rope_theta}};
  if (rope_type == "linear") rope["factor"] = rope_factor;
  if (rope_type == "llama3") {
    rope["factor"] = rope_factor;
    rope["low_freq_factor"] = rope_low_freq_factor;
    rope["high_freq_factor"] = rope_high_freq_factor;
    rope["original_max_position_embeddings"] = rope_original_max_position_embeddings;
  }
  j["rope_parameters"] = rope;
  if (model_type == "llama") {
    j["attention_bias"] = qkv_bias;
    j["mlp_bias"] = mlp_bias;
  }
  if (model_type == "qwen3" || model_type == "qwen3_moe") j["attention_bias"] = qkv_bias;
  if (model_type == "mistral" || model_type == "mixtral")
    j["sliding_window"] = sliding_window ? json(*sliding_window) : json();
  if (num_experts > 0) {
    j["num_local_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["router_aux_loss_coef"] = router_aux_loss_coef;
    j["output_router_logits"] = output_router_logits;
  }
  if (model_type == "mixtral") j["router_jitter_noise"] = router_jitter_noise;
  if (model_type == "qwen3_moe") {
    j["moe_intermediate_size"] = moe_intermediate_size;
    j["norm_topk_prob"] = norm_topk_prob;
    j["decoder_sparse_step"] = 1;  // the dense layers listed instead
    json dense = json::array();
    for (size_t i = 0; i < moe_layers.size(); ++i)
      if (!moe_layers[i]) dense.push_back(i);
    j["mlp_only_layers"] = dense;
  }
  if (model_type == "qwen2" || model_type == "qwen3" || model_type == "qwen3_moe") {
    j["use_sliding_window"] = sliding_window.has_value();
    j["sliding_window"] = sliding_window ? json(*sliding_window) : json();
    json types = json::array();
    for (bool s : sliding_layers) types.push_back(s ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
  }
  return j.dump(2);
}

int64_t LlamaConfig::parameter_count() const {
  const int64_t h = hidden_size, q = num_attention_heads * head_dim,
                kv = num_key_value_heads * head_dim, f = intermediate_size;
  int64_t attention = h * q + 2 * h * kv + q * h + 2 * h;  // with the two norms
  if (qkv_bias) attention += q + 2 * kv;
  if (o_bias) attention += h;
  if (qk_norm) attention += 2 * head_dim;
  int64_t dense = 3 * h * f;
  if (mlp_bias) dense += 2 * f + h;
  const int64_t sparse = num_experts * 3 * h * moe_intermediate_size + num_experts * h;
  int64_t layers = 0;
  for (int64_t i = 0; i < num_hidden_layers; ++i)
    layers += attention + (moe_layers.empty() || !moe_layers[i] ? dense : sparse);
  return vocab_size * h * (tie_word_embeddings ? 1 : 2) + layers + h;
}

}  // namespace tandem::models
