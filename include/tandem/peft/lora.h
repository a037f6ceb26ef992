// LoRA (Hu et al. 2021) as PEFT does it: low-rank adapters beside a model's linear layers, the
// base weights frozen, only the adapters trained, saved in PEFT's files
// (adapter_model.safetensors + adapter_config.json) so that Python's `peft` loads them onto the
// transformers model, and merged into the base weights (`tandem merge-lora`).
//
// Example:
//   auto model = tandem::models::LlamaForCausalLM(cfg);
//   tandem::checkpoint::load_model(*model, "Qwen3-0.6B");
//   auto lora = tandem::peft::LoraOptions().r(16).alpha(32).target_modules({"q_proj", "v_proj"});
//   auto adapters = tandem::peft::apply_lora(*model, lora);  // before acc.prepare
//   model = acc.prepare(model);
//   auto opt = acc.prepare(std::make_shared<torch::optim::AdamW>(adapters, ...));
//   ...
//   tandem::peft::save_adapter(acc.get_state_dict(*model), lora, "out/adapter");
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

#include <string>
#include <utility>
#include <vector>

namespace tandem::peft {

/// PEFT's LoraConfig, the settings tandem computes.
struct LoraOptions {
  /// alpha / r, or alpha / sqrt(r) with use_rslora.
  double scale() const;
  /// The rank of each adapter.
  TORCH_ARG(int64_t, r) = 8;
  /// The scale of the adapter's output is alpha / r (alpha / sqrt(r) with use_rslora).
  TORCH_ARG(double, alpha) = 8.0;
  /// Dropout on the adapter's input, in training.
  TORCH_ARG(double, dropout) = 0.0;
  /// The layers that get an adapter, as PEFT matches target_modules: a module whose path is one
  /// of these or ends with "." + one of these ("q_proj" matches model.layers.0.self_attn.q_proj).
  /// Each must be a linear layer (a weight [out, in], optional bias).
  TORCH_ARG(std::vector<std::string>, target_modules) = std::vector<std::string>{"q_proj", "v_proj"};
  /// rsLoRA's scale alpha / sqrt(r).
  TORCH_ARG(bool, use_rslora) = false;
  /// Written into adapter_config.json (PEFT's base_model_name_or_path).
  TORCH_ARG(std::string, base_model_name_or_path) = "";
};

/// Adds an adapter to every linear layer of `model` that `options.target_modules` names: a child
/// `lora_A` (weight [r, in], initialised as PEFT does: Kaiming-uniform with a = sqrt(5)) and a
/// child `lora_B` (weight [out, r], zeros), and a forward hook that adds
/// scale * lora_B(lora_A(dropout(x))) to the layer's output. Freezes every other parameter of the
/// model (requires_grad false) and returns the adapters' parameters, for the optimizer. Call it
/// before Accelerator::prepare (the strategies see the frozen and trainable parameters as they
/// are). Under tensor parallel call it after Accelerator::parallelize: a column- or row-parallel
/// layer at a target gets an adapter split as the layer is (Note [LoRA under tensor parallel]),
/// equal to the dense model's; get_state_dict joins it. Throws tandem::Refused naming a target
/// that matches no module, a matched module that is not a hookable linear layer
/// (tandem::nn::Linear) or a tensor-parallel linear layer (not under sequence parallel), or one
/// that already has an adapter.
std::vector<at::Tensor> apply_lora(torch::nn::Module& model, const LoraOptions& options);

/// The adapter tensors of a model's state (names with ".lora_A." or ".lora_B."), under PEFT's
/// names ("base_model.model." + name), written with adapter_config.json into `dir`.
void save_adapter(const std::vector<std::pair<std::string, at::Tensor>>& state,
                  const LoraOptions& options, const std::string& dir);

/// Reads PEFT's adapter_config.json in `dir`: r, lora_alpha, lora_dropout, target_modules,
/// use_rslora, base_model_name_or_path. Throws tandem::Refused naming a setting tandem does not
/// compute (use_dora, a rank_pattern or alpha_pattern, bias other than "none", modules_to_save,
/// fan_in_fan_out, layers_to_transform, a peft_type other than LORA).
LoraOptions read_adapter_config(const std::string& dir);

/// Copies the adapter weights saved in `dir` (PEFT's adapter_model.safetensors) into a model
/// that apply_lora gave adapters of the same shapes (under tensor parallel, each rank its shard
/// of the split ones). Throws tandem::Refused naming an adapter
/// tensor the model lacks or whose shape differs, or an adapter of the model the file lacks.
void load_adapter(torch::nn::Module& model, const std::string& dir);

/// Merges the adapters in `adapter_dir` into the weights of the save_pretrained folder
/// `base_dir`: W += scale * B A for every adapted layer, in float32, written in the base
/// tensors' dtype into `out_dir` with the base's config.json (transformers loads it as the merged
/// model, as PEFT's merge_and_unload gives). Throws tandem::Refused naming an adapted layer the base
/// lacks or a shape that does not fit.
void merge_adapter_files(const std::string& base_dir, const std::string& adapter_dir,
                         const std::string& out_dir);

}  // namespace tandem::peft
