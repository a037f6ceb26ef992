// Layers that models ported from transformers need, hookable like tandem::nn::Linear:
// Conv1D (GPT-2's linear layer, weight stored [in, out]), RMSNorm (the Llama family's) and causal
// attention through LibTorch's
// fused scaled-dot-product kernel where the build has it, the manual form otherwise.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/cloneable.h>

#include <string>

#include "tandem/nn/module.h"

namespace tandem::nn {

/// transformers' pytorch_utils.Conv1D: y = x @ weight + bias with weight [in, out] (the
/// transpose of Linear's), as GPT-2's checkpoints store it. Initialised as transformers does:
/// weight ~ N(0, 0.02), bias 0.
class Conv1DImpl : public torch::nn::Cloneable<Conv1DImpl> {
 public:
  Conv1DImpl(int64_t in_features, int64_t out_features);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t in_features, out_features;
  at::Tensor weight, bias;
};
TANDEM_MODULE_IMPL(Conv1D, Conv1DImpl);

/// RMSNorm as transformers' Llama family computes it: y = weight * (x / sqrt(mean(x^2) + eps))
/// with the normalisation in float32 and cast back to x's dtype before the weight multiplies it.
/// weight [dim], initialised to ones. A standard layer (as LayerNorm): not a ZeRO-3 unit or an
/// activation-checkpointing region of its own.
class RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl> {
 public:
  static constexpr bool kStandardLayer = true;
  explicit RMSNormImpl(int64_t dim, double eps = 1e-6);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t dim;
  double eps;
  at::Tensor weight;
};
TANDEM_MODULE_IMPL(RMSNorm, RMSNormImpl);

/// How attention is computed: kFused is LibTorch's scaled_dot_product_attention (LibTorch 2.0
/// and later; FlashAttention-2 or memory-efficient kernels on CUDA, a fused CPU kernel
/// otherwise), kManual the matmul-softmax-matmul form, kAuto the fused one where the build has
/// it.
enum class AttentionKernel { kAuto, kFused, kManual };

/// "auto", "sdpa" or "manual"; throws std::invalid_argument naming the accepted spellings, and
/// for "sdpa" on a LibTorch without the kernel (1.x), naming the version and "manual".
AttentionKernel parse_attention_kernel(const std::string& text);
/// Whether this LibTorch has scaled_dot_product_attention.
bool fused_attention_available();
/// "sdpa" or "manual": what `kernel` runs on this build.
std::string attention_kernel_name(AttentionKernel kernel);

/// Causal attention of queries q [B, H, L, D] over keys and values [B, H, S, D], S >= L, where
/// the L queries are the last L of the S positions (bottom-right alignment: what a key/value
/// cache needs; for L == S it is the usual causal mask). Scaled by 1/sqrt(D).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            AttentionKernel kernel = AttentionKernel::kAuto);

}  // namespace tandem::nn
