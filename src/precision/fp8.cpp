// fp8 options, and the stand-ins used where the fp8 kernels are not compiled (see fp8.h).
#include "tandem/precision/fp8.h"
#include "tandem/error.h"

#include <stdexcept>


namespace tandem::precision {

void Fp8Options::validate() const {
  if (fp8_format() != "HYBRID" && fp8_format() != "E4M3")
    throw ::tandem::Refused("fp8_format is '" + fp8_format() +
                                "': expected HYBRID (E4M3 forward, E5M2 backward) or E4M3");
  if (amax_compute_algo() != "max" && amax_compute_algo() != "most_recent")
    throw ::tandem::Refused("amax_compute_algo is '" + amax_compute_algo() +
                                "': expected max or most_recent");
  if (amax_history_len() < 1 || interval() < 1)
    throw ::tandem::Refused("amax_history_len and interval must be at least 1, found " +
                                std::to_string(amax_history_len()) + " and " +
                                std::to_string(interval()));
  if (margin() < 0)
    throw ::tandem::Refused("margin must be >= 0, found " + std::to_string(margin()));
}

#ifndef TANDEM_FP8_KERNELS
namespace {
[[noreturn]] void no_fp8() {
  throw std::runtime_error(
      "Fp8Linear: this build of tandem has no fp8 kernels: they need a CUDA LibTorch >= 2.1 "
      "(float8 dtypes and _scaled_mm) and a GPU of compute capability 8.9 or newer; use "
      "mixed_precision bf16 instead");
}
}  // namespace

bool fp8_compiled() { return false; }
bool fp8_available() { return false; }
Fp8LinearImpl::Fp8LinearImpl(const torch::nn::LinearOptions& o, Fp8Options r)
    : options(o), recipe(std::move(r)) {
  no_fp8();
}
Fp8LinearImpl::Fp8LinearImpl(const torch::nn::LinearImpl& l, Fp8Options r)
    : options(l.options), recipe(std::move(r)) {
  no_fp8();
}
void Fp8LinearImpl::reset() { no_fp8(); }
at::Tensor Fp8LinearImpl::forward(const at::Tensor&) { no_fp8(); }
int64_t convert_to_fp8_linear(torch::nn::Module&, const Fp8Options&, const std::set<std::string>&) {
  no_fp8();
}
#endif

}  // namespace tandem::precision
