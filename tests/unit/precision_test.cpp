// Mixed precision without processes: the policy and every refused combination, the loss
// scaler's arithmetic on injected gradients, unscale-then-clip, the autocast guard.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "tandem/precision/autocast.h"
#include "tandem/precision/fp8.h"
#include "tandem/precision/grad_scaler.h"
#include "tandem/precision/policy.h"

using namespace tandem::precision;

namespace {

Capabilities cpu_113() {  // what LibTorch 1.13 on a CPU offers
  Capabilities c;
  c.device = c10::kCPU;
  c.description = "LibTorch 1.13.0 without CUDA, running on the CPU";
  return c;
}

Capabilities hopper() {
  Capabilities c;
  c.device = c10::kCUDA;
  c.cuda_bf16 = c.cuda_fp8 = c.fp8_compiled = true;
  return c;
}

std::string refusal(const PolicyOptions& o, const Capabilities& c) {
  try {
    PrecisionPolicy::create(o, c);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(PrecisionPolicy, ModesMapToDtypes) {
  auto p = PrecisionPolicy::create(PolicyOptions().mode("no"), cpu_113());
  EXPECT_FALSE(p.autocast_dtype);
  EXPECT_EQ(p.param_dtype, c10::kFloat);
  EXPECT_FALSE(p.is_half());
  p = PrecisionPolicy::create(PolicyOptions().mode("bf16"), cpu_113());
  EXPECT_EQ(p.autocast_dtype, c10::kBFloat16);
  EXPECT_EQ(p.param_dtype, c10::kFloat);
  EXPECT_FALSE(p.loss_scaling);
  EXPECT_FALSE(p.master_weights);
  p = PrecisionPolicy::create(PolicyOptions().mode("bf16-true"), cpu_113());
  EXPECT_FALSE(p.autocast_dtype);
  EXPECT_EQ(p.param_dtype, c10::kBFloat16);
  EXPECT_FALSE(p.master_weights);  // default off for bf16-true
  p = PrecisionPolicy::create(PolicyOptions().mode("bf16-true").master_weights(true), cpu_113());
  EXPECT_TRUE(p.master_weights);
  p = PrecisionPolicy::create(PolicyOptions().mode("fp16"), hopper());
  EXPECT_EQ(p.autocast_dtype, c10::kHalf);
  EXPECT_TRUE(p.loss_scaling);
  p = PrecisionPolicy::create(PolicyOptions().mode("fp16-true"), hopper());
  EXPECT_EQ(p.param_dtype, c10::kHalf);
  EXPECT_TRUE(p.master_weights);  // default on for fp16-true
  EXPECT_TRUE(p.loss_scaling);
  p = PrecisionPolicy::create(PolicyOptions().mode("fp8"), hopper());
  EXPECT_TRUE(p.fp8);
  EXPECT_EQ(p.autocast_dtype, c10::kBFloat16);
  p = PrecisionPolicy::create(PolicyOptions().mode("bf16").downcast_bf16(true), cpu_113());
  EXPECT_TRUE(p.downcast_bf16);
  EXPECT_EQ(p.name(), "bf16");
}

TEST(PrecisionPolicy, RefusesImpossibleCombinationsNamingTheFix) {
  auto e = refusal(PolicyOptions().mode("bf17").prefix("[rank 1/4]"), cpu_113());
  EXPECT_TRUE(has(e, "[rank 1/4]") && has(e, "'bf17'") &&
              has(e, "no, bf16, fp16, bf16-true, fp16-true, fp8"))
      << e;
  e = refusal(PolicyOptions().mode("fp16"), cpu_113());
  EXPECT_TRUE(has(e, "bfloat16 only") && has(e, "use bf16")) << e;
  e = refusal(PolicyOptions().mode("fp16-true"), cpu_113());
  EXPECT_TRUE(has(e, "float16 CPU kernels") && has(e, "use bf16-true")) << e;
  auto old_gpu = hopper();
  old_gpu.cuda_bf16 = old_gpu.cuda_fp8 = false;
  e = refusal(PolicyOptions().mode("bf16"), old_gpu);
  EXPECT_TRUE(has(e, "compute capability 8.0") && has(e, "use fp16")) << e;
  e = refusal(PolicyOptions().mode("fp8"), cpu_113());
  EXPECT_TRUE(has(e, "fp8 arithmetic") && has(e, "8.9") && has(e, "use bf16") &&
              has(e, "no fp8 kernels"))
      << e;
  e = refusal(PolicyOptions().mode("fp8"), old_gpu);
  EXPECT_TRUE(has(e, "use bf16")) << e;
  e = refusal(PolicyOptions().mode("fp16").downcast_bf16(true), hopper());
  EXPECT_TRUE(has(e, "downcast_bf16 applies to bf16") && has(e, "drop downcast_bf16")) << e;
  e = refusal(PolicyOptions().mode("no").downcast_bf16(true), cpu_113());
  EXPECT_TRUE(has(e, "downcast_bf16")) << e;
  e = refusal(PolicyOptions().mode("bf16").master_weights(true), cpu_113());
  EXPECT_TRUE(has(e, "master_weights applies to bf16-true and fp16-true")) << e;
  // With float16 CPU kernels (LibTorch 2.x), the CPU float16 modes are allowed.
  auto cpu2 = cpu_113();
  cpu2.cpu_autocast_fp16 = cpu2.cpu_half_matmul = true;
  EXPECT_NO_THROW(PrecisionPolicy::create(PolicyOptions().mode("fp16"), cpu2));
  EXPECT_NO_THROW(PrecisionPolicy::create(PolicyOptions().mode("fp16-true"), cpu2));
}

TEST(PrecisionPolicy, DetectsThisLibTorch) {
  auto c = Capabilities::detect(c10::kCPU);
  EXPECT_EQ(c.device, c10::kCPU);
  EXPECT_FALSE(c.cuda_fp8);
  EXPECT_EQ(c.fp8_compiled, fp8_compiled());
  // The probe restores the CPU autocast dtype it tried.
  EXPECT_EQ(AutocastGuard::dtype(c10::kCPU), c10::kBFloat16);
}

TEST(GradScaler, GrowsAfterTheIntervalBacksOffOnInfAndKeepsAFloor) {
  GradScaler s(GradScalerOptions().init_scale(8).growth_interval(3).min_scale(2));
  EXPECT_EQ(s.get_scale(), 8);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.get_scale(), 8);
  EXPECT_EQ(s.growth_tracker(), 2);
  s.update(false);  // third consecutive finite step
  EXPECT_EQ(s.get_scale(), 16);
  EXPECT_EQ(s.growth_tracker(), 0);
  s.update(false);
  s.update(true);  // overflow: halve, restart the count
  EXPECT_EQ(s.get_scale(), 8);
  EXPECT_EQ(s.growth_tracker(), 0);
  s.update(true);
  s.update(true);
  EXPECT_EQ(s.get_scale(), 2);
  s.update(true);  // at the floor
  EXPECT_EQ(s.get_scale(), 2);
  GradScaler d;  // PyTorch's defaults
  EXPECT_EQ(d.get_scale(), 65536.0);
  EXPECT_EQ(d.options().growth_interval(), 2000);
  EXPECT_EQ(d.options().backoff_factor(), 0.5);
}

TEST(GradScaler, ScalesInFp32AndUnscalesInjectedGradients) {
  GradScaler s(GradScalerOptions().init_scale(1024));
  auto loss = torch::tensor(60000.0f).to(torch::kHalf);  // near half's limit
  auto scaled = s.scale(loss);
  EXPECT_EQ(scaled.scalar_type(), torch::kFloat);
  EXPECT_TRUE(std::isfinite(scaled.item<float>()));
  auto g1 = torch::full({3}, 2048.0f), g2 = torch::full({2, 2}, -512.0f);
  EXPECT_FALSE(s.unscale_({g1, g2, torch::Tensor()}));
  EXPECT_TRUE(g1.equal(torch::full({3}, 2.0f)));
  EXPECT_TRUE(g2.equal(torch::full({2, 2}, -0.5f)));
  auto inf = torch::ones({4});
  inf[2] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(s.unscale_({g1, inf}));
  auto nan = torch::ones({4});
  nan[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(s.unscale_({nan}));
}

// Training with the scaler on a tiny linear model: a step whose gradients overflow is skipped
// (parameters unchanged) and the scale halves; unscaled gradients equal the true ones.
TEST(GradScaler, SkipsTheStepOfAnOverflowAndStepsOtherwise) {
  torch::manual_seed(0);
  auto lin = torch::nn::Linear(4, 2);
  torch::optim::SGD opt(lin->parameters(), 0.1);
  GradScaler s(GradScalerOptions().init_scale(256).growth_interval(100));
  auto x = torch::randn({8, 4});
  auto reference = [&] {
    lin->zero_grad();
    lin->forward(x).pow(2).mean().backward();
    std::vector<torch::Tensor> g;
    for (auto& p : lin->parameters()) g.push_back(p.grad().clone());
    lin->zero_grad();
    return g;
  }();
  s.scale(lin->forward(x).pow(2).mean()).backward();
  std::vector<torch::Tensor> grads;
  for (auto& p : lin->parameters()) grads.push_back(p.grad());
  ASSERT_FALSE(s.unscale_(grads));
  for (size_t i = 0; i < grads.size(); ++i)
    EXPECT_TRUE(torch::allclose(grads[i], reference[i], 1e-6, 1e-6));
  // Inject an overflow.
  opt.zero_grad();
  s.scale(lin->forward(x).pow(2).mean()).backward();
  lin->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
  auto before = lin->weight.detach().clone();
  grads.clear();
  for (auto& p : lin->parameters()) grads.push_back(p.grad());
  const bool inf = s.unscale_(grads);
  if (!inf) opt.step();
  s.update(inf);
  EXPECT_TRUE(inf);
  EXPECT_TRUE(lin->weight.detach().equal(before));
  EXPECT_EQ(s.get_scale(), 128);
}

TEST(GradScaler, UnscaleThenClipEqualsClippingTheTrueGradients) {
  torch::manual_seed(1);
  auto make = [] {
    torch::manual_seed(2);
    return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
  };
  auto a = make(), b = make();
  auto x = torch::randn({32, 16}) * 10;
  GradScaler s;
  // True fp32 gradients, clipped.
  a->forward(x).pow(2).mean().backward();
  const double true_norm = torch::nn::utils::clip_grad_norm_(a->parameters(), 0.5);
  // Scaled gradients, unscaled, then clipped.
  s.scale(b->forward(x).pow(2).mean()).backward();
  std::vector<torch::Tensor> grads;
  for (auto& p : b->parameters()) grads.push_back(p.grad());
  ASSERT_FALSE(s.unscale_(grads));
  const double norm = torch::nn::utils::clip_grad_norm_(b->parameters(), 0.5);
  EXPECT_GT(true_norm, 0.5);  // clipping did act
  EXPECT_NEAR(norm, true_norm, 1e-5 * true_norm);
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(torch::allclose(pa[i].grad(), pb[i].grad(), 1e-5, 1e-7)) << i;
}

TEST(GradScaler, StateDictRoundTrip) {
  GradScaler s(GradScalerOptions().init_scale(1024).growth_interval(5).min_scale(4));
  s.update(false);
  s.update(false);
  s.update(true);
  s.update(false);
  auto state = s.state_dict();
  EXPECT_EQ(state.at("scale"), 512);
  EXPECT_EQ(state.at("growth_tracker"), 1);
  EXPECT_EQ(state.at("growth_interval"), 5);
  EXPECT_EQ(state.at("min_scale"), 4);
  GradScaler t;
  t.load_state_dict(state);
  EXPECT_EQ(t.state_dict(), state);
  for (int i = 0; i < 4; ++i) {
    s.update(false);
    t.update(false);
  }
  EXPECT_EQ(t.get_scale(), 1024);
  EXPECT_EQ(t.get_scale(), s.get_scale());
  state.erase("growth_tracker");
  try {
    t.load_state_dict(state);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_TRUE(has(e.what(), "'growth_tracker'")) << e.what();
  }
  EXPECT_THROW(GradScaler(GradScalerOptions().backoff_factor(2)), std::invalid_argument);
}

TEST(AutocastGuard, NestsAndRestores) {
  const auto outside_dtype = AutocastGuard::dtype(c10::kCPU);
  ASSERT_FALSE(AutocastGuard::is_enabled(c10::kCPU));
  auto a = torch::randn({4, 4}), w = torch::randn({4, 4});
  {
    AutocastGuard on(c10::kCPU, c10::kBFloat16);
    EXPECT_TRUE(AutocastGuard::is_enabled(c10::kCPU));
    EXPECT_EQ(torch::mm(a, w).scalar_type(), torch::kBFloat16);
    EXPECT_EQ(torch::softmax(a, -1).scalar_type(), torch::kFloat);
    {
      AutocastGuard off(c10::kCPU, c10::kBFloat16, false);
      EXPECT_FALSE(AutocastGuard::is_enabled(c10::kCPU));
      EXPECT_EQ(torch::mm(a, w).scalar_type(), torch::kFloat);
      {
        AutocastGuard again(c10::kCPU, c10::kBFloat16);
        EXPECT_EQ(torch::mm(a, w).scalar_type(), torch::kBFloat16);
      }
      EXPECT_FALSE(AutocastGuard::is_enabled(c10::kCPU));
    }
    EXPECT_TRUE(AutocastGuard::is_enabled(c10::kCPU));
    auto moved = std::move(on);  // a moved guard restores once
  }
  EXPECT_FALSE(AutocastGuard::is_enabled(c10::kCPU));
  EXPECT_EQ(AutocastGuard::dtype(c10::kCPU), outside_dtype);
  EXPECT_EQ(torch::mm(a, w).scalar_type(), torch::kFloat);
  { AutocastGuard nothing; }
  EXPECT_FALSE(AutocastGuard::is_enabled(c10::kCPU));
}

// The outermost region's exit clears the cache of casted weights: a weight changed in place
// between two regions is cast afresh.
TEST(AutocastGuard, LeavingTheOutermostRegionClearsTheCache) {
  auto w = torch::ones({2, 2}, torch::requires_grad());
  auto x = torch::ones({1, 2});
  {
    AutocastGuard on(c10::kCPU, c10::kBFloat16);
    EXPECT_EQ(torch::mm(x, w).sum().item<float>(), 4);
  }
  {
    torch::NoGradGuard g;
    w.mul_(2);
  }
  {
    AutocastGuard on(c10::kCPU, c10::kBFloat16);
    EXPECT_EQ(torch::mm(x, w).sum().item<float>(), 8);
  }
}

TEST(Fp8, OptionsValidateAndKernelsSkipWhereAbsent) {
  EXPECT_NO_THROW(Fp8Options().validate());
  EXPECT_THROW(Fp8Options().fp8_format("E5M2X").validate(), std::invalid_argument);
  EXPECT_THROW(Fp8Options().amax_compute_algo("mean").validate(), std::invalid_argument);
  EXPECT_THROW(Fp8Options().amax_history_len(0).validate(), std::invalid_argument);
  if (!fp8_compiled()) {
    // No fp8 in this build (no CUDA, or LibTorch < 2.1): the module says what to use instead.
    try {
      Fp8Linear(torch::nn::LinearOptions(16, 16));
      FAIL();
    } catch (const std::exception& e) {
      EXPECT_TRUE(has(e.what(), "bf16")) << e.what();
    }
  } else if (!fp8_available()) {
    // Compiled, but no GPU with fp8 here: the module is built (to be moved to a GPU later);
    // a forward on the CPU is refused, naming CUDA.
    Fp8Linear l(torch::nn::LinearOptions(16, 16));
    try {
      l(torch::ones({2, 16}));
      FAIL();
    } catch (const std::exception& e) {
      EXPECT_TRUE(has(e.what(), "CUDA")) << e.what();
    }
  }
  if (!fp8_available()) GTEST_SKIP() << "no fp8 kernels or no GPU with fp8 arithmetic here";
}
