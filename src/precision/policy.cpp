// PrecisionPolicy parsing and validation (see policy.h); Capabilities::detect probes LibTorch.
#include "tandem/precision/policy.h"
#include "tandem/error.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <sstream>
#include <stdexcept>

#include "../compat/autocast.h"
#include "tandem/precision/fp8.h"

namespace tandem::precision {
namespace detail {
// Compute capability of the current CUDA device as major*10+minor; 0 without CUDA
// (src/precision/cuda_capability.cpp in CUDA builds).
int cuda_compute_capability();
}  // namespace detail

#ifndef TANDEM_WITH_CUDA
int detail::cuda_compute_capability() { return 0; }
#endif

namespace {

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

std::string lead(const std::string& prefix) { return prefix.empty() ? "" : prefix + " "; }

[[noreturn]] void refuse(const PolicyOptions& o, const std::string& what) {
  throw ::tandem::Refused(lead(o.prefix()) + "mixed_precision '" + o.mode() + "': " + what);
}

}  // namespace

const std::vector<std::string>& mode_names() {
  static const std::vector<std::string> v = {"no", "bf16", "fp16", "bf16-true", "fp16-true", "fp8"};
  return v;
}

std::string mode_name(Mode mode) { return mode_names().at(static_cast<size_t>(mode)); }

Capabilities Capabilities::detect(c10::DeviceType device) {
  Capabilities c;
  c.device = device;
  // CPU autocast refuses float16 where it has no float16 kernels (1.13: "AutocastCPU only
  // support Bfloat16"); asking is the most reliable test across versions.
  {
    auto previous = compat::autocast_dtype(c10::kCPU);
    try {
      compat::set_autocast_dtype(c10::kCPU, at::kHalf);
      c.cpu_autocast_fp16 = true;
    } catch (const std::exception&) {
    }
    compat::set_autocast_dtype(c10::kCPU, previous);
  }
  try {
    auto h = at::ones({2, 2}, at::TensorOptions().dtype(at::kHalf));
    (void)at::mm(h, h);
    c.cpu_half_matmul = true;
  } catch (const std::exception&) {
  }
  const int cc = device == c10::kCUDA ? detail::cuda_compute_capability() : 0;
  c.cuda_bf16 = cc >= 80;
  c.cuda_fp8 = cc >= 89;
  c.fp8_compiled = tandem::precision::fp8_compiled();
  std::ostringstream d;
  d << "LibTorch " << TORCH_VERSION << (torch::cuda::is_available() ? " with CUDA" : " without CUDA")
    << ", running on " << (device == c10::kCUDA ? "a CUDA GPU" : "the CPU");
  if (cc) d << " of compute capability " << cc / 10 << "." << cc % 10;
  c.description = d.str();
  return c;
}

PrecisionPolicy PrecisionPolicy::create(const PolicyOptions& o, const Capabilities& caps) {
  PrecisionPolicy p;
  const auto& names = mode_names();
  size_t i = 0;
  while (i < names.size() && names[i] != o.mode()) ++i;
  if (i == names.size())
    throw ::tandem::Refused(lead(o.prefix()) + "mixed_precision is '" + o.mode() +
                                "', which is not a mode: expected one of " + join(names) +
                                " (AcceleratorOptions().mixed_precision(...), tandem launch "
                                "--mixed_precision or TANDEM_MIXED_PRECISION)");
  p.mode = static_cast<Mode>(i);
  const bool cpu = caps.device == c10::kCPU;
  switch (p.mode) {
    case Mode::kNo:
      break;
    case Mode::kBf16:
      p.autocast_dtype = c10::kBFloat16;
      break;
    case Mode::kFp16:
      p.autocast_dtype = c10::kHalf;
      p.loss_scaling = true;
      break;
    case Mode::kBf16True:
      p.param_dtype = c10::kBFloat16;
      p.master_weights = o.master_weights().value_or(false);
      break;
    case Mode::kFp16True:
      p.param_dtype = c10::kHalf;
      p.master_weights = o.master_weights().value_or(true);
      p.loss_scaling = true;
      break;
    case Mode::kFp8:
      p.autocast_dtype = c10::kBFloat16;
      p.fp8 = true;
      break;
  }
  // Impossible combinations, each with its fix.
  if (p.mode == Mode::kFp16 && cpu && !caps.cpu_autocast_fp16)
    refuse(o, "CPU autocast of " + caps.description +
                  " supports bfloat16 only (float16 CPU autocast arrived in LibTorch 2.x); use "
                  "bf16 instead (the same memory savings, and no loss scaling needed), or run "
                  "on a GPU");
  if (p.mode == Mode::kFp16True && cpu && !caps.cpu_half_matmul)
    refuse(o, caps.description + " has no float16 CPU kernels for matrix products "
                  "(\"addmm_impl_cpu_ not implemented for 'Half'\"); use bf16-true instead, or "
                  "run on a GPU");
  if ((p.mode == Mode::kBf16 || p.mode == Mode::kBf16True) && caps.device == c10::kCUDA &&
      !caps.cuda_bf16)
    refuse(o, "this GPU has no bfloat16 arithmetic (it needs compute capability 8.0 or newer; " +
                  caps.description + "); use fp16 (with its loss scaler) instead");
  if (p.mode == Mode::kFp8) {
    if (!caps.fp8_compiled || caps.device != c10::kCUDA || !caps.cuda_fp8)
      refuse(o, "fp8 needs a GPU with fp8 arithmetic (compute capability 8.9 or newer: H100, "
                "H200, L4, L40, RTX 4090) and tandem built against a CUDA LibTorch >= 2.1; "
                "found " + caps.description +
                (caps.fp8_compiled ? "" : ", and this build has no fp8 kernels") +
                "; use bf16 instead");
  }
  if (o.master_weights() && p.mode != Mode::kBf16True && p.mode != Mode::kFp16True)
    refuse(o, "master_weights applies to bf16-true and fp16-true, whose weights are half "
              "precision; this mode keeps fp32 weights already: drop master_weights or choose "
              "a -true mode");
  if (o.loss_scaling()) p.loss_scaling = *o.loss_scaling();
  if (o.downcast_bf16()) {
    if (p.mode != Mode::kBf16 && p.mode != Mode::kBf16True)
      refuse(o, "downcast_bf16 applies to bf16 runs only; drop downcast_bf16 (or "
                "TANDEM_DOWNCAST_BF16) or use mixed_precision bf16 or bf16-true");
    p.downcast_bf16 = true;
  }
  return p;
}

}  // namespace tandem::precision
