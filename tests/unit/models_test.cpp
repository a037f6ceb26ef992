// The Llama family's config reader and LoRA's adapters, in one process (the models against
// transformers, peft and PyTorch's training: tests/oracle/llama_*.py).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <nlohmann/json.hpp>

#include "../common/temp_dir.h"
#include "tandem/error.h"
#include "tandem/models/llama.h"
#include "tandem/peft/lora.h"

namespace models = tandem::models;
namespace peft = tandem::peft;
using nlohmann::json;

namespace {

models::LlamaConfig parse(json j) { return models::LlamaConfig::from_json_text(j.dump(), "test"); }

json small(const std::string& type) {
  return {{"model_type", type},         {"vocab_size", 40},          {"hidden_size", 16},
          {"intermediate_size", 24},    {"num_hidden_layers", 3},    {"num_attention_heads", 4},
          {"num_key_value_heads", 2}};
}

std::string refusal(json j) {
  try {
    parse(j);
  } catch (const tandem::Refused& e) {
    return e.what();
  }
  return "";
}

int64_t numel(torch::nn::Module& m) {
  int64_t n = 0;
  std::set<const void*> seen;
  for (auto& p : m.parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  return n;
}

}  // namespace

TEST(LlamaConfig, ReadsEachFamilysKeysAndItsDefaults) {
  // The older files' rope_theta + rope_scaling (Llama 3.1) and transformers 5's rope_parameters.
  auto j = small("llama");
  j["rope_theta"] = 500000.0;
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 1024}};
  auto c = parse(j);
  EXPECT_EQ(c.rope_type, "llama3");
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_original_max_position_embeddings, 1024);
  EXPECT_EQ(c.head_dim, 4);
  // llama3 leaves high frequencies (a wavelength under 1024 / 4), divides low ones (over 1024) by
  // the factor: head_dim 4 has wavelengths 2 pi and 2 pi sqrt(500000) = 4443.
  auto f = models::rope_inverse_frequencies(c);
  auto plain = c;
  plain.rope_type = "default";
  auto d = models::rope_inverse_frequencies(plain);
  EXPECT_FLOAT_EQ(f[0].item<float>(), d[0].item<float>());
  EXPECT_FLOAT_EQ(f[1].item<float>(), d[1].item<float>() / 8.0f);

  // Qwen2: sliding layers from max_window_layers when layer_types is absent.
  j = small("qwen2");
  j["use_sliding_window"] = true;
  j["sliding_window"] = 8;
  j["max_window_layers"] = 1;
  c = parse(j);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_EQ(c.sliding_layers, (std::vector<bool>{false, true, true}));
  ASSERT_TRUE(c.sliding_window.has_value());
  // ... and none without use_sliding_window (transformers' rule).
  j["use_sliding_window"] = false;
  EXPECT_FALSE(parse(j).sliding_window.has_value());

  // Qwen3's own head_dim; Qwen3-MoE's dense layers; Mixtral's defaults.
  c = parse(small("qwen3"));
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_TRUE(c.qk_norm);
  j = small("qwen3_moe");
  j["num_experts"] = 4;
  j["num_experts_per_tok"] = 2;
  j["moe_intermediate_size"] = 12;
  j["mlp_only_layers"] = {1};
  j["decoder_sparse_step"] = 1;
  c = parse(j);
  EXPECT_EQ(c.moe_layers, (std::vector<bool>{true, false, true}));
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.head_dim, 4);
  c = parse(small("mixtral"));
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.moe_intermediate_size, 24);
}

TEST(LlamaConfig, WritesBackWhatItReadAndCountsParameters) {
  for (const auto& type : {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"}) {
    auto j = small(type);
    j["bos_token_id"] = 7;
    j["tie_word_embeddings"] = std::string(type) == "qwen3";
    if (std::string(type) == "qwen3_moe") {
      j["num_experts"] = 4;
      j["num_experts_per_tok"] = 2;
      j["moe_intermediate_size"] = 12;
      j["mlp_only_layers"] = {0};
    }
    const auto c = parse(j);
    const auto back = json::parse(c.to_json_text());
    EXPECT_EQ(back["bos_token_id"], 7) << type;  // a kept key
    const auto again = models::LlamaConfig::from_json_text(c.to_json_text(), "again");
    EXPECT_EQ(again.to_json_text(), c.to_json_text()) << type;
    EXPECT_EQ(again.moe_layers, c.moe_layers) << type;
    models::LlamaForCausalLM model(c);
    EXPECT_EQ(numel(*model), c.parameter_count()) << type;
  }
}

TEST(LlamaConfig, RefusesWhatItDoesNotCompute) {
  auto j = small("llama");
  j["quantization_config"] = {{"quant_method", "awq"}};
  EXPECT_NE(refusal(j).find("quantization_config is set"), std::string::npos);
  j = small("llama");
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e4}};
  EXPECT_NE(refusal(j).find("'yarn'"), std::string::npos);
  j = small("llama");
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e4},
                          {"partial_rotary_factor", 0.5}};
  EXPECT_NE(refusal(j).find("rope_parameters.partial_rotary_factor"), std::string::npos);
  j = small("mistral");
  j["attention_bias"] = true;  // not a key of Mistral's config
  EXPECT_NE(refusal(j).find("attention_bias is not a key of mistral's config"), std::string::npos);
  j = small("gemma");
  EXPECT_NE(refusal(j).find("model_type is 'gemma'"), std::string::npos);
  j = small("llama");
  j["num_key_value_heads"] = 3;
  EXPECT_NE(refusal(j).find("does not divide num_attention_heads"), std::string::npos);
  j = small("mixtral");
  j["num_experts_per_tok"] = 9;
  EXPECT_NE(refusal(j).find("num_experts_per_tok is 9"), std::string::npos);
  const auto c = parse(small("llama"));
  EXPECT_THROW(models::check_llama_tensor_parallel(c, 3), tandem::Refused);
  EXPECT_NO_THROW(models::check_llama_tensor_parallel(c, 2));
}

// Note [Llama pipeline stages]: the Sequential computes the model's logits with the model's own
// modules, its paths map back to transformers' names, and what stages cannot hold is refused.
TEST(LlamaSequential, ComputesTheModelsLogitsUnderTransformersNames) {
  torch::manual_seed(4);
  auto j = small("qwen3");
  j["tie_word_embeddings"] = false;
  const auto c = parse(j);
  models::LlamaForCausalLM model(c);
  model->eval();
  auto seq = models::llama_sequential(model);
  ASSERT_EQ(seq->size(), static_cast<size_t>(c.num_hidden_layers + 3));
  auto ids = torch::randint(0, 40, {2, 5});
  EXPECT_TRUE(torch::allclose(seq->forward(ids), model(ids)));
  std::set<std::string> dense;
  for (auto& p : model->named_parameters()) dense.insert(p.key());
  std::set<std::string> mapped;
  for (auto& p : seq->named_parameters()) {
    const auto name = models::llama_name_of_sequential(c, p.key());
    EXPECT_TRUE(dense.count(name)) << p.key() << " -> " << name;
    EXPECT_TRUE(model->named_parameters()[name].is_same(p.value())) << name;
    mapped.insert(name);
  }
  EXPECT_EQ(mapped, dense);
  EXPECT_EQ(models::llama_name_of_sequential(c, "0.weight"), "model.embed_tokens.weight");
  EXPECT_EQ(models::llama_name_of_sequential(c, "3.mlp.up_proj.weight"),
            "model.layers.2.mlp.up_proj.weight");
  EXPECT_EQ(models::llama_name_of_sequential(c, "4.weight"), "model.norm.weight");
  EXPECT_EQ(models::llama_name_of_sequential(c, "5.weight"), "lm_head.weight");
  EXPECT_THROW(models::llama_name_of_sequential(c, "6.weight"), std::invalid_argument);
  EXPECT_THROW(models::llama_name_of_sequential(c, "x.weight"), std::invalid_argument);

  auto refused = [](json j) {
    try {
      models::llama_sequential(models::LlamaForCausalLM(parse(j)));
    } catch (const tandem::Refused& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto tied = small("llama");
  tied["tie_word_embeddings"] = true;
  EXPECT_NE(refused(tied).find("set \"tie_word_embeddings\": false in config.json"),
            std::string::npos);
  auto moe = small("qwen3_moe");
  moe.update({{"num_experts", 4}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 8},
              {"output_router_logits", true}});
  EXPECT_NE(refused(moe).find("set \"output_router_logits\": false"), std::string::npos);
}

TEST(Lora, AddsZeroAdaptersTrainsOnlyThemAndRoundTripsPeftsFiles) {
  torch::manual_seed(3);
  const auto c = parse(small("llama"));
  models::LlamaForCausalLM model(c);
  model->eval();
  auto ids = torch::randint(0, 40, {2, 6});
  auto before = model(ids).detach();
  const auto opts = peft::LoraOptions().r(2).alpha(4).target_modules({"q_proj", "down_proj"});
  auto adapters = peft::apply_lora(*model, opts);
  ASSERT_EQ(adapters.size(), 12u);  // 3 layers x 2 targets x (A, B)
  for (auto& p : model->named_parameters())
    EXPECT_EQ(p.value().requires_grad(), p.key().find(".lora_") != std::string::npos) << p.key();
  // B starts at zero: the adapted model computes the base model.
  EXPECT_TRUE(torch::equal(model(ids), before));
  {
    torch::NoGradGuard no_grad;
    for (auto& a : adapters) a.normal_(0, 0.1);
  }
  auto adapted = model(ids).detach();
  EXPECT_FALSE(torch::allclose(adapted, before));
  // Trained on its own: gradients reach the adapters only.
  models::causal_lm_loss(model(ids), ids).backward();
  for (auto& p : model->named_parameters())
    EXPECT_EQ(p.value().grad().defined(), p.key().find(".lora_") != std::string::npos) << p.key();

  tandem::testing::TempDir dir;
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (auto& p : model->named_parameters()) state.emplace_back(p.key(), p.value());
  peft::save_adapter(state, opts, dir.str());
  const auto read = peft::read_adapter_config(dir.str());
  EXPECT_EQ(read.r(), 2);
  EXPECT_EQ(read.alpha(), 4);
  EXPECT_EQ(read.target_modules(), opts.target_modules());
  models::LlamaForCausalLM other(c);
  other->eval();
  {
    torch::NoGradGuard no_grad;  // the same base weights
    auto mine = model->named_parameters();
    for (auto& p : other->named_parameters()) p.value().copy_(mine[p.key()]);
  }
  peft::apply_lora(*other, read);
  peft::load_adapter(*other, dir.str());
  EXPECT_TRUE(torch::equal(other(ids), adapted));
}

TEST(Lora, RefusesTargetsItCannotAdaptAndSettingsItDoesNotCompute) {
  const auto c = parse(small("llama"));
  auto refusal_of = [&](const peft::LoraOptions& o) -> std::string {
    models::LlamaForCausalLM model(c);
    try {
      peft::apply_lora(*model, o);
    } catch (const tandem::Refused& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(refusal_of(peft::LoraOptions().target_modules({"q_proj", "nope"}))
                .find("'nope', which matches no module"),
            std::string::npos);
  EXPECT_NE(refusal_of(peft::LoraOptions().target_modules({"input_layernorm"}))
                .find("not a linear layer"),
            std::string::npos);
  EXPECT_NE(refusal_of(peft::LoraOptions().r(0)).find("r is 0"), std::string::npos);
  models::LlamaForCausalLM twice(c);
  peft::apply_lora(*twice, peft::LoraOptions());
  EXPECT_THROW(peft::apply_lora(*twice, peft::LoraOptions()), tandem::Refused);

  tandem::testing::TempDir dir;
  std::ofstream(dir.str() + "/adapter_config.json")
      << R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
            "use_dora": true})";
  try {
    peft::read_adapter_config(dir.str());
    ADD_FAILURE() << "use_dora was not refused";
  } catch (const tandem::Refused& e) {
    EXPECT_NE(std::string(e.what()).find("use_dora is set"), std::string::npos) << e.what();
  }
}
