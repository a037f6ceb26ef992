// Weight-only quantization for inference: int8 with one scale per output channel, int4 in groups
// along the input (a scale and a zero point per group, as gpt-fast and torchao's int4 weight-only
// layouts), of a model's linear layers (tandem::nn::Linear, torch::nn::Linear, tandem::nn::Conv1D)
// or of a checkpoint file (`tandem quantize`). The matmul runs LibTorch's weight kernels where the
// build has them (_weight_int8pack_mm; _weight_int4pack_mm_for_cpu on the CPU and
// _weight_int4pack_mm on CUDA), and dequantize-then-matmul elsewhere (LibTorch 1.x).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tandem/nn/module.h"

namespace tandem::inference {

/// Options of quantize_model and quantize_checkpoint.
///
/// Example:
///   tandem::inference::quantize_model(*model,
///       tandem::inference::QuantizeOptions().method("int4").group_size(64));
struct QuantizeOptions {
  /// "int8" or "int4".
  TORCH_ARG(std::string, method) = "int8";
  /// int4: input features per group (32, 64, 128 or 256); each layer's input size must be a
  /// multiple of it.
  TORCH_ARG(int64_t, group_size) = 128;
  /// Modules kept in floating point: a layer whose qualified name contains one of these.
  /// transformers' bitsandbytes default keeps the output head.
  TORCH_ARG(std::vector<std::string>, skip) = std::vector<std::string>{"lm_head"};
  /// Exactly these layers (qualified names) and no others: what a quantized checkpoint lists.
  TORCH_ARG(std::vector<std::string>, layers);
  /// Use LibTorch's int8/int4 weight kernels where this build has them; false: always
  /// dequantize then matmul.
  TORCH_ARG(bool, use_kernels) = true;
};

/// Throws std::invalid_argument naming the bad option and the accepted values.
void check_quantize_options(const QuantizeOptions& options);

/// A quantized [out, in] weight: int8 `values` [out, in] with `scale` [out] (w = q * scale), or
/// int4 `values` packed two per byte [out, in / 2] (the high nibble first) with `scale` and
/// `zero` [out, in / group] (w = (q - 8) * scale + zero).
struct QuantizedWeight {
  at::Tensor values, scale, zero;
};
QuantizedWeight quantize_int8(const at::Tensor& weight);
QuantizedWeight quantize_int4(const at::Tensor& weight, int64_t group_size);
/// The float32 [out, in] weight a quantized one stands for.
at::Tensor dequantize(const QuantizedWeight& q, const std::string& method, int64_t group_size);

/// A Linear layer with a quantized weight, for inference (no gradients). Its tensors are buffers
/// named weight (int8, or uint8 for int4), weight_scale, weight_zero (int4) and bias (float, when
/// the layer has one), shaped as QuantizedWeight says.
class QuantizedLinearImpl : public torch::nn::Cloneable<QuantizedLinearImpl> {
 public:
  QuantizedLinearImpl(int64_t in_features, int64_t out_features, bool bias,
                      const QuantizeOptions& options);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  /// The kernel forward runs on `device` for inputs of `dtype`: "_weight_int8pack_mm",
  /// "_weight_int4pack_mm_for_cpu", "_weight_int4pack_mm" or "dequantize + matmul".
  std::string kernel(const at::Device& device, c10::ScalarType dtype) const;
  /// Drops the kernel's own copy of the weight (the CPU int4 kernel's layout), made again at the
  /// next forward: what disk offload calls when it gives the weights back.
  void drop_cache();
  int64_t in_features, out_features;
  bool has_bias;
  QuantizeOptions options;
  at::Tensor weight, weight_scale, weight_zero, bias;

 private:
  at::Tensor packed_, scales_zeros_;
  const void* packed_for_ = nullptr;
};
TANDEM_MODULE_IMPL(QuantizedLinear, QuantizedLinearImpl);

/// What quantize_model or quantize_checkpoint did.
struct QuantizeReport {
  int64_t layers = 0;           ///< layers quantized
  uint64_t float_bytes = 0;     ///< their weights before
  uint64_t quantized_bytes = 0; ///< after (values, scales, zero points)
  std::vector<std::string> kept;  ///< linear layers left in floating point, and why
  std::string to_string() const;
};

/// Replaces each linear layer of `model` (tandem::nn::Linear, torch::nn::Linear, Conv1D; not
/// those matched by skip) with a QuantizedLinear of its quantized weight: registered in its place
/// (named_parameters and checkpoints see it) and, for a hookable member the parent calls
/// directly, its calls redirected there (tandem/nn/module.h). The float weights are given back.
/// A model built with init_empty_weights gets empty quantized layers, to load from a checkpoint
/// quantize_checkpoint wrote. Throws std::invalid_argument for a layer whose input size is not a
/// multiple of the int4 group size (naming it), and for a `layers` entry the model lacks.
QuantizeReport quantize_model(torch::nn::Module& model, const QuantizeOptions& options);

/// The options a checkpoint written by quantize_checkpoint records (its layers included), or
/// nullopt for a checkpoint that is not quantized.
std::optional<QuantizeOptions> checkpoint_quantization(const std::string& path);

/// `tandem quantize`: reads the checkpoint `in` (file, index or directory) and writes `out` (a
/// directory: model.safetensors with the quantized layers and the other tensors as they were,
/// the metadata recording the method, group size and layers, and `in`'s config.json and other
/// JSON files copied). A tensor is a linear layer's weight when it is 2-D, floating point, named
/// "<layer>.weight", and <layer> matches none of `options.skip` nor the embedding and norm names
/// (embed, wte, wpe, norm, ln_). `weight_layout`: "out_in" (Linear), "in_out" (GPT-2's Conv1D),
/// or "auto": in_out when `in`'s config.json says model_type gpt2, else out_in.
QuantizeReport quantize_checkpoint(const std::string& in, const std::string& out,
                                   const QuantizeOptions& options,
                                   const std::string& weight_layout = "auto");

}  // namespace tandem::inference
