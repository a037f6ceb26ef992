// The Accelerator's mixed precision: the policy from options and environment, the model's
// dtype, fp32 master weights, loss scaling with a skip agreed by every rank, and the precision
// of metric reductions. See docs/mixed_precision.md.
#include <torch/torch.h>

#include <ATen/autocast_mode.h>

#include <cstdlib>
#include <set>

#include "../detail/env.h"

#include "tandem/accelerator.h"
#include "tandem/checkpoint/optimizer_state.h"
#include "tandem/checkpoint/safetensors.h"

namespace tandem {
namespace {

using detail::env;
using detail::env_true;

bool is_half(c10::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

}  // namespace

void Accelerator::init_precision() {
  const std::string mode =
      options_.mixed_precision().value_or(env("TANDEM_MIXED_PRECISION").value_or("no"));
  const bool downcast = options_.downcast_bf16().value_or(
      env("TANDEM_DOWNCAST_BF16") ? env_true(*env("TANDEM_DOWNCAST_BF16")) : false);
  precision_ = precision::PrecisionPolicy::create(precision::PolicyOptions()
                                                      .mode(mode)
                                                      .master_weights(options_.master_weights())
                                                      .downcast_bf16(downcast)
                                                      .loss_scaling(options_.loss_scaling())
                                                      .prefix(state_.prefix()),
                                                  precision::Capabilities::detect(device_.type()));
  if (precision_.fp8) {
    auto recipe = options_.fp8().value_or(precision::Fp8Options::from_environment());
    try {
      recipe.validate();
    } catch (const std::exception& e) {
      throw std::invalid_argument(state_.prefix() + " fp8 options: " + e.what());
    }
    options_.fp8(recipe);
  }
  if (precision_.loss_scaling) scaler_ = std::make_unique<precision::GradScaler>(options_.grad_scaler());
}

precision::AutocastGuard Accelerator::autocast(bool enabled) {
  if (precision_.autocast_dtype)
    return precision::AutocastGuard(device_.type(), *precision_.autocast_dtype, enabled);
  // Modes without autocast: entering changes nothing; disabling still turns off a region the
  // user opened by hand.
  if (!enabled) return precision::AutocastGuard(device_.type(), at::kBFloat16, false);
  return precision::AutocastGuard();
}

void Accelerator::cast_model_for_precision(torch::nn::Module& model) {
  if (precision_.param_dtype != at::kFloat) model.to(precision_.param_dtype);
}

void Accelerator::install_master_weights(torch::optim::Optimizer& optimizer,
                                         bool strategy_owns_masters) {
  MasterSet set;
  set.optimizer = &optimizer;
  if (strategy_owns_masters) {
    masters_.push_back(std::move(set));
    return;
  }
  std::set<const void*> seen;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (!precision_.master_weights || !p.is_floating_point() || !is_half(p.scalar_type())) {
        continue;
      }
      const void* key = p.unsafeGetTensorImpl();
      auto it = master_of_.find(key);
      if (it == master_of_.end()) {
        TORCH_CHECK(optimizer.state().empty(), state_.prefix(),
                    " prepare: master weights need an optimizer without state; expected a fresh "
                    "optimizer, found one that has stepped; prepare it before its first step");
        at::Tensor master = p.detach().to(at::kFloat).clone();
        master.set_requires_grad(true);
        it = master_of_.emplace(key, master).first;
      }
      if (seen.insert(key).second) {
        set.params.push_back(p);
        set.masters.push_back(it->second);
      }
      p = it->second;  // the optimizer steps the fp32 master
    }
  }
  masters_.push_back(std::move(set));
}

std::vector<std::pair<std::string, at::Tensor>> Accelerator::master_weights_of(
    const torch::optim::Optimizer& optimizer) const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (master_of_.empty()) return out;
  std::set<const void*> masters;
  for (const auto& kv : master_of_) masters.insert(kv.second.unsafeGetTensorImpl());
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g)
    for (size_t i = 0; i < groups[g].params().size(); ++i) {
      const auto& p = groups[g].params()[i];
      if (masters.count(p.unsafeGetTensorImpl()))
        out.emplace_back(checkpoint::optimizer_param_key(g, i), p.detach());
    }
  return out;
}

// Note [Masters on resume]: the optimizer steps the fp32 masters and copies them over the half
// weights after every step, so a resumed run must continue from the saved masters, not from the
// copies made at prepare() time. A checkpoint that has none (saved without master weights) gets
// masters rebuilt from the loaded half weights: exactly what prepare() would have built had the
// run started from those weights, so nothing stale survives; what cannot be recovered are the
// fp32 bits below half precision that such a run never kept.
void Accelerator::load_master_weights(torch::optim::Optimizer& optimizer,
                                      const checkpoint::SafetensorsFile* file,
                                      const std::string& dir) {
  torch::NoGradGuard no_grad;
  std::map<const void*, at::Tensor> half_of;  // master -> its half parameter
  for (const auto& set : masters_)
    for (size_t k = 0; k < set.params.size(); ++k)
      half_of.emplace(set.masters[k].unsafeGetTensorImpl(), set.params[k]);
  if (half_of.empty()) {
    if (file && is_main_process())
      std::cerr << state_.prefix() << " load_state: " << dir
                << " holds fp32 master weights, but this run keeps none (mixed precision "
                << precision_.name() << "); the saved half weights are used" << std::endl;
    return;
  }
  bool rebuilt = false;
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g)
    for (size_t i = 0; i < groups[g].params().size(); ++i) {
      auto master = groups[g].params()[i];
      auto it = half_of.find(master.unsafeGetTensorImpl());
      if (it == half_of.end()) continue;
      const std::string key = checkpoint::optimizer_param_key(g, i);
      if (file) {
        TORCH_CHECK(file->contains(key), state_.prefix(), " load_state: ", dir,
                    " has master weights without '", key,
                    "': the checkpoint was saved with other parameter groups; build the "
                    "optimizer as in the run that saved it");
        auto t = file->tensor(key);
        TORCH_CHECK(t.sizes() == master.sizes() && t.scalar_type() == master.scalar_type(),
                    state_.prefix(), " load_state: master weight '", key, "' in ", dir, " is ",
                    t.scalar_type(), t.sizes(), ", expected ", master.scalar_type(),
                    master.sizes(), ": build the same model and optimizer before load_state");
        master.copy_(t);
      } else {
        master.copy_(it->second);
        rebuilt = true;
      }
    }
  if (rebuilt && is_main_process())
    std::cerr << state_.prefix() << " load_state: " << dir
              << " has no fp32 master weights (it was saved without them); they are rebuilt from "
                 "the loaded " << precision_.name() << " weights, as prepare() builds them" << std::endl;
}

at::Tensor Accelerator::master_parameter(const at::Tensor& p) const {
  auto it = master_of_.find(p.unsafeGetTensorImpl());
  return it == master_of_.end() ? at::Tensor() : it->second;
}

void Accelerator::unscale_gradients() {
  if (boundary_prepared_ || !sync_gradients_) return;
  boundary_prepared_ = true;
  found_inf_ = false;
  if (!scaler_ && master_of_.empty()) return;
  torch::NoGradGuard no_grad;
  auto no_autocast = autocast(false);
  // Copy the half gradients up into the masters: unscaling then happens in fp32, where
  // gradients divided by the scale do not underflow.
  for (auto& set : masters_)
    for (size_t i = 0; i < set.params.size(); ++i) {
      const auto& g = set.params[i].grad();
      if (g.defined())
        set.masters[i].mutable_grad() = g.to(at::kFloat);
      else
        set.masters[i].mutable_grad().reset();
    }
  if (!scaler_) return;
  // Every gradient an optimizer will step with (masters' where they exist), each once.
  std::vector<at::Tensor> grads;
  std::set<const void*> seen;
  for (auto& set : masters_)
    for (auto& group : set.optimizer->param_groups())
      for (auto& p : group.params())
        if (p.grad().defined() && seen.insert(p.unsafeGetTensorImpl()).second)
          grads.push_back(p.grad());
  const bool local_inf = scaler_->unscale_(grads);
  // Note [Skip together]: one rank's overflow skips the step on every rank, so parameters and
  // scales stay identical everywhere.
  auto flag = at::full({1}, local_inf ? 1.0f : 0.0f, at::TensorOptions().dtype(at::kFloat));
  if (pg_ && pg_->size() > 1) pg_->allreduce(flag, ReduceOp::kMax);
  found_inf_ = flag.item<float>() > 0;
  scaler_->update(found_inf_);
}

bool Accelerator::before_optimizer_step() {
  unscale_gradients();
  step_skipped_ = found_inf_;
  return !found_inf_;
}

void Accelerator::after_optimizer_step_precision(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  for (auto& set : masters_) {
    if (set.optimizer != &optimizer) continue;
    for (size_t i = 0; i < set.params.size(); ++i) set.params[i].copy_(set.masters[i]);
  }
  // The autocast cache holds casts of the weights as they were before this step: a forward
  // later in the same region (an evaluation inside the accumulate scope) must cast afresh.
  at::autocast::clear_cache();
}

void Accelerator::zero_model_grads_for(torch::optim::Optimizer& optimizer) {
  for (auto& set : masters_) {
    if (set.optimizer != &optimizer) continue;
    for (auto& p : set.params) {
      auto& g = p.mutable_grad();
      if (g.defined()) {
        g.detach_();
        g.zero_();
      }
    }
  }
}

// Each tensor once: LibTorch's parameters() lists a tied weight under each of its names, which
// would count it twice in the norm (PyTorch's parameters() yields it once).
std::vector<at::Tensor> Accelerator::grads_to_clip(const std::vector<at::Tensor>& parameters) {
  std::vector<at::Tensor> out;
  out.reserve(parameters.size());
  std::set<const void*> seen;
  for (const auto& p : parameters) {
    auto m = master_of_.empty() ? at::Tensor() : master_parameter(p);
    auto t = m.defined() ? m : p;
    if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  }
  return out;
}

at::Tensor Accelerator::reduce(const at::Tensor& tensor, ReduceOp op) {
  return metric_result(comm::reduce(*pg_, metric_input(tensor), op));
}

at::Tensor Accelerator::metric_input(const at::Tensor& t) const {
  return precision_.is_half() && t.defined() && is_half(t.scalar_type()) ? t.to(at::kFloat) : t;
}

at::Tensor Accelerator::metric_result(const at::Tensor& t) const {
  return precision_.downcast_bf16 && t.defined() && t.scalar_type() == at::kFloat
             ? t.to(at::kBFloat16)
             : t;
}

}  // namespace tandem
