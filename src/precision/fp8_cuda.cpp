// fp8 Linear on GPUs with fp8 arithmetic (see fp8.h). Compiled only with CUDA and LibTorch >= 2.1
// (CMake: TANDEM_WITH_FP8).
//
// Forward: input and weight quantised to E4M3 with per-tensor scales, multiplied by
// _scaled_mm into the input's dtype. Backward (HYBRID): the output gradient quantised to E5M2
// (its wider exponent suits gradients), multiplied with the saved E4M3 weight and input.
// Scales are "delayed": each tensor's absolute maximum goes into a history of amax_history_len
// rows, and every `interval` forwards the scale becomes fp8_max / amax / 2^margin, amax being
// the history's maximum ("max") or its latest row ("most_recent"). _scaled_mm needs every
// dimension to be a multiple of 16; other shapes fall back to the plain product.
#include <torch/torch.h>
#include "tandem/error.h"

#include <ATen/cuda/CUDAContext.h>

#include <cmath>

#include "../compat/float8.h"
#include "../compat/scaled_mm.h"
#include "tandem/precision/fp8.h"

namespace tandem::precision {
namespace {

constexpr double kE4M3Max = 448.0;
constexpr double kE5M2Max = 57344.0;

// Records `amax` into column `col` of the history (newest row first) and returns the scale the
// recipe derives from the history.
at::Tensor record_and_scale(Fp8LinearImpl& m, int64_t col, const at::Tensor& amax, double fp8_max,
                            bool refresh) {
  auto column = m.amax_history.select(1, col);
  column.copy_(column.roll(1, 0));
  column[0] = amax;
  if (refresh || m.forwards == 0) {
    auto a = m.recipe.amax_compute_algo() == "max" ? column.max() : column[0];
    auto s = (fp8_max / a.clamp_min(1e-12)) / std::pow(2.0, static_cast<double>(m.recipe.margin()));
    m.scales[col] = s;
  }
  return m.scales[col].clone();
}

at::Tensor quantise(const at::Tensor& t, const at::Tensor& scale, c10::ScalarType fp8, double max) {
  return (t.to(at::kFloat) * scale).clamp(-max, max).to(fp8);
}

bool aligned(int64_t m, int64_t k, int64_t n) { return m % 16 == 0 && k % 16 == 0 && n % 16 == 0; }

struct Fp8Matmul : torch::autograd::Function<Fp8Matmul> {
  // input [M, K], weight [N, K] -> [M, N]
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, Fp8LinearImpl* module) {
    auto& m = *module;
    const bool refresh = m.forwards % m.recipe.interval() == 0;
    auto sx = record_and_scale(m, 0, input.abs().max().to(at::kFloat), kE4M3Max, refresh);
    auto sw = record_and_scale(m, 1, weight.abs().max().to(at::kFloat), kE4M3Max, refresh);
    const auto e4m3 = *compat::float8_e4m3fn();
    auto xq = quantise(input, sx, e4m3, kE4M3Max);
    auto wq = quantise(weight, sw, e4m3, kE4M3Max);
    ctx->save_for_backward({xq, wq, sx, sw});
    ctx->saved_data["module"] = reinterpret_cast<int64_t>(module);
    ctx->saved_data["dtype"] = static_cast<int64_t>(input.scalar_type());
    // wq.t() is [K, N] column-major, as _scaled_mm wants its second operand.
    return compat::scaled_mm(xq, wq.t(), sx.reciprocal(), sw.reciprocal(), input.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto xq = saved[0], wq = saved[1], sx = saved[2], sw = saved[3];
    auto& m = *reinterpret_cast<Fp8LinearImpl*>(ctx->saved_data["module"].toInt());
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    const bool hybrid = m.recipe.fp8_format() == "HYBRID";
    const auto gfmt = hybrid ? *compat::float8_e5m2() : *compat::float8_e4m3fn();
    const double gmax = hybrid ? kE5M2Max : kE4M3Max;
    auto go = grads[0].contiguous();
    at::Tensor sg;
    {
      torch::NoGradGuard no_grad;
      sg = record_and_scale(m, 2, go.abs().max().to(at::kFloat), gmax, true);
    }
    auto gq = quantise(go, sg, gfmt, gmax);
    // grad_input [M, K] = go [M, N] @ weight [N, K]: weight as column-major [N, K].
    auto grad_input = compat::scaled_mm(gq, wq.t().contiguous().t(), sg.reciprocal(),
                                        sw.reciprocal(), dtype);
    // grad_weight [N, K] = go^T [N, M] @ input [M, K]: input as column-major [M, K].
    auto grad_weight = compat::scaled_mm(gq.t().contiguous(), xq.t().contiguous().t(),
                                         sg.reciprocal(), sx.reciprocal(), dtype);
    return {grad_input, grad_weight, at::Tensor()};
  }
};

}  // namespace

bool fp8_compiled() { return true; }

bool fp8_available() {
  if (!torch::cuda::is_available()) return false;
  const auto* p = at::cuda::getCurrentDeviceProperties();
  return p->major * 10 + p->minor >= 89;
}

Fp8LinearImpl::Fp8LinearImpl(const torch::nn::LinearOptions& o, Fp8Options r)
    : options(o), recipe(std::move(r)) {
  recipe.validate();
  reset();
}

Fp8LinearImpl::Fp8LinearImpl(const torch::nn::LinearImpl& l, Fp8Options r)
    : options(l.options), recipe(std::move(r)) {
  recipe.validate();
  weight = register_parameter("weight", l.weight);
  if (l.bias.defined()) bias = register_parameter("bias", l.bias);
  amax_history = register_buffer("amax_history",
                                 torch::zeros({recipe.amax_history_len(), 3}, weight.options().dtype(at::kFloat)));
  scales = register_buffer("scales", torch::ones({3}, weight.options().dtype(at::kFloat)));
}

void Fp8LinearImpl::reset() {
  torch::nn::Linear init(options);  // LibTorch's initialisation of a Linear
  weight = register_parameter("weight", init->weight.detach().clone());
  if (options.bias()) bias = register_parameter("bias", init->bias.detach().clone());
  amax_history = register_buffer("amax_history", torch::zeros({recipe.amax_history_len(), 3}));
  scales = register_buffer("scales", torch::ones({3}));
}

at::Tensor Fp8LinearImpl::forward(const at::Tensor& input) {
  TANDEM_CHECK(input.is_cuda(), "Fp8Linear: expected a CUDA input, found one on ", input.device(),
              "; fp8 runs on GPUs only (use mixed_precision bf16 on the CPU)");
  auto x = input.reshape({-1, options.in_features()});
  at::Tensor out;
  if (!is_training() || !aligned(x.size(0), options.in_features(), options.out_features())) {
    // Evaluation and shapes _scaled_mm cannot take: the plain product in the input's dtype.
    out = at::matmul(x, weight.to(x.scalar_type()).t());
  } else {
    auto w = weight.to(x.scalar_type());
    out = Fp8Matmul::apply(x.contiguous(), w, this);
    ++forwards;
  }
  if (bias.defined()) out = out + bias.to(out.scalar_type());
  auto shape = input.sizes().vec();
  shape.back() = options.out_features();
  return out.view(shape);
}

int64_t convert_to_fp8_linear(torch::nn::Module& module, const Fp8Options& recipe,
                              const std::set<std::string>& skip) {
  int64_t replaced = 0;
  for (auto& item : module.named_modules("", /*include_self=*/true)) {
    auto& parent = *item.value();
    for (auto& child : parent.named_children()) {
      const std::string qualified = item.key().empty() ? child.key() : item.key() + "." + child.key();
      auto* linear = dynamic_cast<torch::nn::LinearImpl*>(child.value().get());
      if (!linear || skip.count(child.key()) || skip.count(qualified)) continue;
      parent.replace_module(child.key(), Fp8Linear(*linear, recipe));
      ++replaced;
    }
  }
  return replaced;
}

}  // namespace tandem::precision
