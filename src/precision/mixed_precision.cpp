// MixedPrecision (mixed_precision.h): the policy from its options, the model's
// dtype, fp32 master weights, loss scaling with a skip agreed by every rank, and the precision
// of metric reductions. See docs/mixed_precision.md.
#include "tandem/precision/mixed_precision.h"
#include "tandem/error.h"

#include <torch/torch.h>

#include <ATen/autocast_mode.h>
#include <nlohmann/json.hpp>

#include <iostream>
#include <set>

#include "tandem/checkpoint/optimizer_state.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/comm/process_group.h"

namespace tandem::precision {
MixedPrecision::MixedPrecision(MixedPrecisionOptions options, c10::DeviceType device,
                               std::string prefix)
    : prefix_(std::move(prefix)), device_(device) {
  // Note [The environment is read in one place]: the Accelerator passes its RunConfig's mode,
  // downcast and fp8 recipe; unset here means the defaults.
  const std::string mode = options.mode().value_or("no");
  const bool downcast = options.downcast_bf16().value_or(false);
  policy_ = PrecisionPolicy::create(PolicyOptions()
                                        .mode(mode)
                                        .master_weights(options.master_weights())
                                        .downcast_bf16(downcast)
                                        .loss_scaling(options.loss_scaling())
                                        .prefix(prefix_),
                                    Capabilities::detect(device_));
  if (policy_.fp8) {
    auto recipe = options.fp8().value_or(Fp8Options());
    try {
      recipe.validate();
    } catch (const std::exception& e) {
      throw ::tandem::Refused(prefix_ + " fp8 options: " + e.what());
    }
    fp8_ = recipe;
  }
  if (policy_.loss_scaling) scaler_ = std::make_unique<GradScaler>(options.grad_scaler());
}

AutocastGuard MixedPrecision::autocast(bool enabled) const {
  if (policy_.autocast_dtype) return AutocastGuard(device_, *policy_.autocast_dtype, enabled);
  // Modes without autocast: entering changes nothing; disabling still turns off a region the
  // user opened by hand.
  if (!enabled) return AutocastGuard(device_, at::kBFloat16, false);
  return AutocastGuard();
}

void MixedPrecision::cast_model(torch::nn::Module& model) const {
  if (policy_.param_dtype != at::kFloat) model.to(policy_.param_dtype);
}

at::Tensor MixedPrecision::loss_for_backward(const at::Tensor& loss, int accumulation_steps) {
  // Note [Loss in fp32]: a half loss is cast up before dividing and scaling.
  auto l = policy_.is_half() && loss.scalar_type() != at::kDouble ? loss.to(at::kFloat) : loss;
  if (accumulation_steps > 1) l = l / static_cast<double>(accumulation_steps);
  if (scaler_) l = scaler_->scale(l);
  boundary_prepared_ = false;
  return l;
}

void MixedPrecision::register_optimizer(torch::optim::Optimizer& optimizer,
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
      if (!policy_.master_weights || !p.is_floating_point() || !is_half(p.scalar_type())) {
        continue;
      }
      const void* key = p.unsafeGetTensorImpl();
      auto it = master_of_.find(key);
      if (it == master_of_.end()) {
        TANDEM_CHECK(optimizer.state().empty(), prefix_,
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

std::vector<std::pair<std::string, at::Tensor>> MixedPrecision::master_weights_of(
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
void MixedPrecision::load_master_weights(torch::optim::Optimizer& optimizer,
                                         const checkpoint::SafetensorsFile* file,
                                         const std::string& dir, bool announce) {
  torch::NoGradGuard no_grad;
  std::map<const void*, at::Tensor> half_of;  // master -> its half parameter
  for (const auto& set : masters_)
    for (size_t k = 0; k < set.params.size(); ++k)
      half_of.emplace(set.masters[k].unsafeGetTensorImpl(), set.params[k]);
  if (half_of.empty()) {
    if (file && announce)
      std::cerr << prefix_ << " load_state: " << dir
                << " holds fp32 master weights, but this run keeps none (mixed precision "
                << policy_.name() << "); the saved half weights are used" << std::endl;
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
        TANDEM_CHECK(file->contains(key), prefix_, " load_state: ", dir,
                    " has master weights without '", key,
                    "': the checkpoint was saved with other parameter groups; build the "
                    "optimizer as in the run that saved it");
        auto t = file->tensor(key);
        TANDEM_CHECK(t.sizes() == master.sizes() && t.scalar_type() == master.scalar_type(),
                    prefix_, " load_state: master weight '", key, "' in ", dir, " is ",
                    t.scalar_type(), t.sizes(), ", expected ", master.scalar_type(),
                    master.sizes(), ": build the same model and optimizer before load_state");
        master.copy_(t);
      } else {
        master.copy_(it->second);
        rebuilt = true;
      }
    }
  if (rebuilt && announce)
    std::cerr << prefix_ << " load_state: " << dir
              << " has no fp32 master weights (it was saved without them); they are rebuilt from "
                 "the loaded " << policy_.name() << " weights, as prepare() builds them" << std::endl;
}

at::Tensor MixedPrecision::master_parameter(const at::Tensor& p) const {
  auto it = master_of_.find(p.unsafeGetTensorImpl());
  return it == master_of_.end() ? at::Tensor() : it->second;
}

void MixedPrecision::unscale_gradients(ProcessGroup* pg) {
  if (boundary_prepared_) return;
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
  if (pg && pg->size() > 1) pg->allreduce(flag, ReduceOp::kMax);
  found_inf_ = flag.item<float>() > 0;
  scaler_->update(found_inf_);
}

bool MixedPrecision::before_step(ProcessGroup* pg) {
  unscale_gradients(pg);
  step_skipped_ = found_inf_;
  return !found_inf_;
}

void MixedPrecision::after_step(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  for (auto& set : masters_) {
    if (set.optimizer != &optimizer) continue;
    for (size_t i = 0; i < set.params.size(); ++i) set.params[i].copy_(set.masters[i]);
  }
  // The autocast cache holds casts of the weights as they were before this step: a forward
  // later in the same region (an evaluation inside the accumulate scope) must cast afresh.
  at::autocast::clear_cache();
}

void MixedPrecision::zero_grad(torch::optim::Optimizer& optimizer) {
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
std::vector<at::Tensor> MixedPrecision::grads_to_clip(
    const std::vector<at::Tensor>& parameters) const {
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

at::Tensor MixedPrecision::metric_input(const at::Tensor& t) const {
  return policy_.is_half() && t.defined() && is_half(t.scalar_type()) ? t.to(at::kFloat) : t;
}

at::Tensor MixedPrecision::metric_result(const at::Tensor& t) const {
  return policy_.downcast_bf16 && t.defined() && t.scalar_type() == at::kFloat
             ? t.to(at::kBFloat16)
             : t;
}

std::string MixedPrecision::state_dict() const {
  nlohmann::json out = nlohmann::json::object();
  if (scaler_) out = scaler_->state_dict();
  return out.dump();
}

void MixedPrecision::load_state_dict(const std::string& state) {
  if (!scaler_ || state.empty()) return;
  auto j = nlohmann::json::parse(state);
  if (j.is_object() && !j.empty()) scaler_->load_state_dict(j.get<std::map<std::string, double>>());
}

}  // namespace tandem::precision
