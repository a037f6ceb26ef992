// Strategy selection and the data parallel strategy (see strategy.h).
#include "tandem/parallel/strategy.h"
#include "tandem/error.h"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <set>
#include <stdexcept>

#include "detail/strategies.h"
#include "tandem/parallel/expert_parallel.h"
#include "tandem/nn/module.h"
#include "tandem/checkpoint/model_io.h"

namespace tandem::parallel {
namespace {


}  // namespace

std::string model_label(const torch::nn::Module& model, int index) {
  return "model " + std::to_string(index) + " (" + tandem::nn::module_type_name(model) + ")";
}

namespace {

// Data parallel: one gradient reducer per prepared model (none in a one-process run).
class DdpStrategy : public Strategy {
 public:
  explicit DdpStrategy(StrategyContext ctx) : ctx_(std::move(ctx)) {}
  std::string name() const override { return "ddp"; }
  void prepare_model(const std::shared_ptr<torch::nn::Module>& model) override {
    if (ctx_.pg->size() <= 1) return;
    ++models_;
    auto options = ctx_.reducer;
    options.model_label(model_label(*model, models_));
    auto named = model->named_parameters().pairs();
    // Note [Expert parallel]: the experts this rank holds are reduced over their replicas, every
    // other parameter over dp.
    if (const auto held = held_experts(*model)) {
      std::vector<std::pair<std::string, at::Tensor>> rest, experts;
      for (auto& kv : named) (held.contains(kv.second) ? experts : rest).push_back(std::move(kv));
      named = std::move(rest);
      if (!experts.empty()) {
        auto r = detail::make_expert_reducer(experts, held, options);
        expert_reducers_.push_back(r.get());
        reducers_.push_back(std::move(r));
      }
    }
    reducers_.push_back(std::make_unique<GradientReducer>(named, ctx_.pg, options));
    // A second model: a backward may reach one and not the other (a GAN's two losses). A rank's
    // experts may get no token in a step.
    for (auto& r : reducers_)
      r->allow_untouched_backward(models_ > 1 ||
                                  std::count(expert_reducers_.begin(), expert_reducers_.end(),
                                             r.get()) > 0);
  }
  bool prepare_optimizer(torch::optim::Optimizer&) override { return false; }
  void set_sync(bool sync) override {
    for (auto& r : reducers_) r->set_sync(sync);
  }
  void after_backward() override {
    for (auto& r : reducers_) r->after_backward();
  }
  std::vector<const GradientReducer*> reducers() const override {
    std::vector<const GradientReducer*> out;
    for (const auto& r : reducers_) out.push_back(r.get());
    return out;
  }

 private:
  StrategyContext ctx_;
  std::vector<std::unique_ptr<GradientReducer>> reducers_;
  std::vector<const GradientReducer*> expert_reducers_;
  int models_ = 0;
};

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> Strategy::model_state(torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& kv : model.named_parameters())
    if (kv.value().defined()) out.emplace_back(kv.key(), kv.value().detach());
  for (const auto& kv : model.named_buffers())
    if (kv.value().defined()) out.emplace_back(kv.key(), kv.value().detach());
  return out;
}

checkpoint::LoadReport Strategy::load_model_state(torch::nn::Module& model,
                                                  const std::string& path,
                                                  const checkpoint::LoadOptions& options) {
  return checkpoint::load_model(model, path, options);
}

checkpoint::OptimizerState Strategy::optimizer_shard_state(const torch::optim::Optimizer&) const {
  throw std::logic_error(name() + " does not shard optimizer state");
}

void Strategy::load_optimizer_shards(torch::optim::Optimizer&,
                                     const std::function<std::string(int)>&,
                                     const std::function<at::Tensor(int, const std::string&)>&) {
  throw std::logic_error(name() + " does not shard optimizer state");
}

void Strategy::load_optimizer_resharded(torch::optim::Optimizer&, const ResavedOptimizer&) {
  throw std::logic_error(name() + " does not shard optimizer state");
}

void Strategy::load_model_tensors(torch::nn::Module& model,
                                  const std::function<at::Tensor(const std::string&)>& local) {
  at::NoGradGuard no_grad;
  for (const auto& p : model.named_parameters()) p.value().copy_(local(p.key()));
  for (const auto& b : model.named_buffers())
    if (b.value().defined()) b.value().copy_(local(b.key()));
}

void Strategy::step(torch::optim::Optimizer& optimizer) { optimizer.step(); }

namespace detail {

std::unique_ptr<GradientReducer> make_expert_reducer(
    const std::vector<std::pair<std::string, at::Tensor>>& experts, const HeldExperts& held,
    ReducerOptions options) {
  options.divide_by(held.ep->data_parallel_size()).find_unused_parameters(true);
  auto r = std::make_unique<GradientReducer>(experts, held.ep->replicas(), options);
  r->allow_untouched_backward(true);
  return r;
}

}  // namespace detail

std::unique_ptr<Strategy> make_strategy(DistributedType type,
                                        const std::optional<ShardingOptions>& sharding,
                                        StrategyContext context) {
  // The type decides the family: DEEPSPEED and FSDP shard as their options say (stage 0,
  // NO_SHARD: data parallel); the others run data parallel unless the program itself asked for
  // a sharding (AcceleratorOptions().sharding). CPU and GPU run the same strategies.
  if ((type == DistributedType::kDeepSpeed || type == DistributedType::kFsdp) && !sharding)
    throw ::tandem::Refused(
        context.pg->prefix() + " distributed_type " + to_string(type) +
        " without sharding options: set them (tandem launch --zero_stage / --fsdp_sharding_strategy, "
        "the config file's deepspeed_config / fsdp_config, or AcceleratorOptions().sharding)");
  if (sharding && sharding->stage() == 0 && !sharding->nvme_path().empty())
    throw ::tandem::Refused(context.pg->prefix() + " " + unsupported_sharding_message(*sharding));
  if (!sharding || sharding->stage() == 0) return std::make_unique<DdpStrategy>(std::move(context));
  auto msg = unsupported_sharding_message(*sharding);
  if (!msg.empty()) throw ::tandem::Refused(context.pg->prefix() + " " + msg);
  context.dp_pg = context.pg;
  if (context.shard_pg) context.pg = context.shard_pg;  // ZeRO runs over dp_shard
  return detail::make_zero_strategy(*sharding, std::move(context));
}

}  // namespace tandem::parallel
