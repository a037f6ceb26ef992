// Conv1D, RMSNorm and causal attention (tandem/nn/layers.h).
#include "tandem/nn/layers.h"
#include "tandem/error.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <cmath>
#include <limits>
#include <stdexcept>

#include "../compat/inference_kernels.h"

namespace tandem::nn {

Conv1DImpl::Conv1DImpl(int64_t in, int64_t out) : in_features(in), out_features(out) { reset(); }

void Conv1DImpl::reset() {
  weight = register_parameter("weight", at::empty({in_features, out_features}));
  bias = register_parameter("bias", at::zeros({out_features}));
  at::NoGradGuard no_grad;
  weight.normal_(0.0, 0.02);
}

at::Tensor Conv1DImpl::forward(const at::Tensor& x) {
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  return at::addmm(bias, x.reshape({-1, in_features}), weight).view(shape);
}

RMSNormImpl::RMSNormImpl(int64_t d, double e) : dim(d), eps(e) { reset(); }

void RMSNormImpl::reset() { weight = register_parameter("weight", at::ones({dim})); }

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  const auto dtype = x.scalar_type();
  auto h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * h.to(dtype);
}

bool fused_attention_available() { return TANDEM_HAS_SDPA; }

AttentionKernel parse_attention_kernel(const std::string& text) {
  if (text == "auto") return AttentionKernel::kAuto;
  if (text == "manual") return AttentionKernel::kManual;
  if (text == "sdpa") {
    if (!fused_attention_available())
      throw ::tandem::Refused(
          "attention 'sdpa': this LibTorch (" + std::to_string(TORCH_VERSION_MAJOR) + "." +
          std::to_string(TORCH_VERSION_MINOR) +
          ") has no scaled_dot_product_attention (it came with 2.0); use 'manual' or 'auto'");
    return AttentionKernel::kFused;
  }
  throw ::tandem::Refused("attention '" + text + "': expected auto, sdpa or manual");
}

std::string attention_kernel_name(AttentionKernel kernel) {
  const bool fused = kernel == AttentionKernel::kFused ||
                     (kernel == AttentionKernel::kAuto && fused_attention_available());
  return fused ? "sdpa" : "manual";
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            AttentionKernel kernel) {
  const int64_t L = q.size(-2), S = k.size(-2);
  TANDEM_CHECK(S >= L, "causal_attention: ", L, " queries over ", S,
              " keys; the queries must be the last of the key positions");
  if (attention_kernel_name(kernel) == "sdpa") {
    // The fused kernel's is_causal aligns the mask top-left; with a cache (L < S) the queries
    // are the last L positions, so the mask is given: one query needs none.
    if (L == S) return compat::sdpa(q, k, v, c10::nullopt, true);
    if (L == 1) return compat::sdpa(q, k, v, c10::nullopt, false);
    auto allowed = at::ones({L, S}, q.options().dtype(at::kBool)).tril(S - L);
    return compat::sdpa(q, k, v, allowed, false);
  }
  auto att = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  if (L > 1) {
    auto masked = at::ones({L, S}, q.options().dtype(at::kBool)).triu(S - L + 1);
    att = att.masked_fill(masked, -std::numeric_limits<float>::infinity());
  }
  return at::matmul(at::softmax(att, -1), v);
}

}  // namespace tandem::nn
