// fp8 training of Linear layers (the HYBRID recipe of Transformer Engine, as Accelerate's fp8
// options): E4M3 for weights and activations in forward, E5M2 for gradients in backward, each
// tensor with a per-tensor scale derived from a history of its absolute maxima.
//
// The kernels need a CUDA LibTorch >= 2.1 (float8 dtypes and _scaled_mm) and a GPU with fp8
// arithmetic (compute capability >= 8.9); they live in src/precision/fp8_cuda.cpp, compiled
// only there. Elsewhere the declarations remain, fp8_compiled() is false and constructing an
// Fp8Linear throws an error that says why and suggests bf16.
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <set>
#include <string>

namespace tandem::precision {

/// The fp8 recipe (Accelerate's FP8RecipeKwargs names; env TANDEM_FP8_* from `tandem launch`).
///
/// Example:
///   auto recipe = tandem::precision::Fp8Options().amax_history_len(16).margin(0);
struct Fp8Options {
  /// "HYBRID" (E4M3 forward, E5M2 backward) or "E4M3" (E4M3 both ways).
  TORCH_ARG(std::string, fp8_format) = "HYBRID";
  /// Absolute maxima remembered per tensor.
  TORCH_ARG(int64_t, amax_history_len) = 1024;
  /// "max" (the largest in the history) or "most_recent".
  TORCH_ARG(std::string, amax_compute_algo) = "most_recent";
  /// The scale leaves 2^margin of headroom below the format's largest value.
  TORCH_ARG(int64_t, margin) = 0;
  /// Scales are recomputed every `interval` forward passes.
  TORCH_ARG(int64_t, interval) = 1;

 public:  // TORCH_ARG leaves the struct in a private section
  /// Throws std::invalid_argument for an unknown format or algorithm or a non-positive length.
  void validate() const;
};

/// Whether this build has the fp8 kernels (CUDA and LibTorch >= 2.1).
bool fp8_compiled();
/// Whether fp8 Linear layers can run here: compiled, and the current GPU has fp8 arithmetic.
bool fp8_available();

/// A drop-in for torch::nn::Linear whose matrix products run in fp8 (see the file comment);
/// the weight and bias stay in the parameter dtype (the optimizer sees ordinary tensors).
class Fp8LinearImpl : public torch::nn::Cloneable<Fp8LinearImpl> {
 public:
  Fp8LinearImpl(const torch::nn::LinearOptions& options, Fp8Options recipe = {});
  /// Takes over `linear`'s weight and bias (the same tensors).
  Fp8LinearImpl(const torch::nn::LinearImpl& linear, Fp8Options recipe = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& input);

  torch::nn::LinearOptions options;
  Fp8Options recipe;
  at::Tensor weight, bias;
  /// Absolute-maximum histories (amax_history_len rows; columns: input, weight, grad output).
  at::Tensor amax_history;
  /// Current scales of input, weight and grad output.
  at::Tensor scales;
  int64_t forwards = 0;
};
TORCH_MODULE(Fp8Linear);

/// Replaces every torch::nn::Linear registered under `module` (recursively) by an Fp8Linear that
/// shares its parameters, except those whose qualified name ("blocks.0.fc") or last name ("head")
/// is in `skip`; returns the number replaced. Note: replacement changes the registered child;
/// a parent that calls a Linear through its own typed member (`torch::nn::Linear fc;` used as
/// fc(x)) still calls the old one, so this helper fits models built from Sequential /
/// ModuleList / AnyModule; write Fp8Linear in the model for the others.
int64_t convert_to_fp8_linear(torch::nn::Module& module, const Fp8Options& recipe = {},
                              const std::set<std::string>& skip = {"lm_head", "head"});

}  // namespace tandem::precision
