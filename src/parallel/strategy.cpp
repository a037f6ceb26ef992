// Strategy selection, the data parallel strategy, and the sharding options a launcher's
// environment asks for (see strategy.h).
#include "tandem/parallel/strategy.h"
#include "../detail/env.h"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "detail/strategies.h"
#include "tandem/checkpoint/model_io.h"

namespace tandem::parallel {
namespace {

const std::vector<std::pair<DistributedType, std::string>>& type_names() {
  static const std::vector<std::pair<DistributedType, std::string>> v = {
      {DistributedType::kNo, "NO"},
      {DistributedType::kMultiCpu, "MULTI_CPU"},
      {DistributedType::kMultiGpu, "MULTI_GPU"},
      {DistributedType::kFsdp, "FSDP"},
      {DistributedType::kDeepSpeed, "DEEPSPEED"}};
  return v;
}

using ::tandem::detail::lower;
using ::tandem::detail::parse_bool;
using ::tandem::detail::upper;

// Data parallel: one gradient reducer per prepared model (none in a one-process run).
class DdpStrategy : public Strategy {
 public:
  explicit DdpStrategy(StrategyContext ctx) : ctx_(std::move(ctx)) {}
  std::string name() const override { return "ddp"; }
  void prepare_model(const std::shared_ptr<torch::nn::Module>& model) override {
    if (ctx_.pg->size() > 1)
      reducers_.push_back(std::make_unique<GradientReducer>(model->named_parameters().pairs(),
                                                            ctx_.pg, ctx_.reducer));
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
};

}  // namespace

std::string to_string(DistributedType type) {
  for (const auto& [t, n] : type_names())
    if (t == type) return n;
  return "NO";
}

DistributedType distributed_type_from_name(const std::string& name) {
  for (const auto& [t, n] : type_names())
    if (n == upper(name)) return t;
  std::string all;
  for (const auto& [t, n] : type_names()) all += (all.empty() ? "" : ", ") + n;
  throw std::invalid_argument("distributed type '" + name + "': expected one of " + all);
}

std::optional<ShardingOptions> sharding_from_environment(const EnvMap& env) {
  auto get = [&](const std::string& k) -> std::optional<std::string> {
    auto it = env.find(k);
    if (it == env.end() || it->second.empty()) return std::nullopt;  // as detail::env
    return it->second;
  };
  const auto type = distributed_type_from_name(get("TANDEM_DISTRIBUTED_TYPE").value_or("NO"));
  if (type != DistributedType::kDeepSpeed && type != DistributedType::kFsdp) return std::nullopt;
  ShardingOptions o;
  auto bad = [](const std::string& var, const std::string& v, const std::string& expected) {
    return std::invalid_argument(var + "='" + v + "': " + expected);
  };
  if (type == DistributedType::kDeepSpeed) {
    o.origin("deepspeed_config");
    const auto stage = get("TANDEM_ZERO_STAGE").value_or("2");  // Accelerate's default
    if (stage != "0" && stage != "1" && stage != "2" && stage != "3")
      throw bad("TANDEM_ZERO_STAGE (deepspeed_config.zero_stage)", stage, "expected 0, 1, 2 or 3");
    o.stage(std::stoi(stage));
    for (const char* var : {"TANDEM_OFFLOAD_OPTIMIZER_DEVICE", "TANDEM_OFFLOAD_PARAM_DEVICE"}) {
      const auto v = lower(get(var).value_or("none"));
      if (v != "none" && v != "cpu")
        throw bad(var, v, v == "nvme" ? "offload to NVMe is not implemented; use cpu or none"
                                      : "expected none or cpu");
      if (v == "cpu") {
        if (std::string(var) == "TANDEM_OFFLOAD_OPTIMIZER_DEVICE")
          o.offload_optimizer(true);
        else
          o.offload_params(true);
      }
    }
    if (auto v = get("TANDEM_ZERO3_SAVE_16BIT_MODEL")) parse_bool("TANDEM_ZERO3_SAVE_16BIT_MODEL", *v);
  } else {
    o.origin("fsdp_config");
    // Every fsdp_ key Accelerate writes; tandem acts on some and accepts the others as hints
    // that do not change results (docs/sharding.md says which).
    static const std::vector<std::string> known = {
        "SHARDING_STRATEGY",    "OFFLOAD_PARAMS",        "AUTO_WRAP_POLICY",
        "MIN_NUM_PARAMS",       "STATE_DICT_TYPE",       "SYNC_MODULE_STATES",
        "CPU_RAM_EFFICIENT_LOADING", "BACKWARD_PREFETCH", "FORWARD_PREFETCH",
        "USE_ORIG_PARAMS",      "TRANSFORMER_LAYER_CLS_TO_WRAP", "VERSION",
        "RESHARD_AFTER_FORWARD", "ACTIVATION_CHECKPOINTING", "CPU_OFFLOAD"};
    for (const auto& [k, v] : env) {
      if (k.rfind("TANDEM_FSDP_", 0) != 0) continue;
      const auto key = k.substr(12);
      if (std::find(known.begin(), known.end(), key) == known.end())
        throw std::invalid_argument(k + ": fsdp_config key fsdp_" + lower(key) +
                                    " is not one tandem knows; remove it from the config file");
    }
    static const std::vector<std::pair<std::string, int>> strategies = {
        {"FULL_SHARD", 3}, {"SHARD_GRAD_OP", 2}, {"NO_SHARD", 0},
        {"HYBRID_SHARD", 3}, {"HYBRID_SHARD_ZERO2", 2}};
    auto s = upper(get("TANDEM_FSDP_SHARDING_STRATEGY").value_or("FULL_SHARD"));
    if (s.size() == 1 && s[0] >= '1' && s[0] <= '5') s = strategies[s[0] - '1'].first;
    bool found = false;
    for (const auto& [n, stage] : strategies)
      if (n == s) {
        o.stage(stage);
        found = true;
      }
    if (!found)
      throw bad("TANDEM_FSDP_SHARDING_STRATEGY (fsdp_config.fsdp_sharding_strategy)", s,
                "expected FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or "
                "HYBRID_SHARD_ZERO2 (or 1-5)");
    if (s.rfind("HYBRID", 0) == 0) {
      auto machines = get("TANDEM_NUM_MACHINES").value_or("1");
      if (machines != "1")
        throw bad("TANDEM_FSDP_SHARDING_STRATEGY", s,
                  "hybrid sharding (shards within a machine, replicas across machines) is not "
                  "implemented for several machines; use FULL_SHARD or SHARD_GRAD_OP");
    }
    if (auto v = get("TANDEM_FSDP_OFFLOAD_PARAMS");
        v && parse_bool("TANDEM_FSDP_OFFLOAD_PARAMS", *v)) {
      o.offload_optimizer(true);  // FSDP's CPU offload moves the step to the host as well
      o.offload_params(o.stage() == 3);
    }
    if (auto v = get("TANDEM_FSDP_AUTO_WRAP_POLICY")) {
      const auto t = upper(*v);
      if (t != "TRANSFORMER_BASED_WRAP" && t != "SIZE_BASED_WRAP" && t != "NO_WRAP")
        throw bad("TANDEM_FSDP_AUTO_WRAP_POLICY (fsdp_config.fsdp_auto_wrap_policy)", *v,
                  "expected TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP");
      o.auto_wrap_policy(t);
    }
    if (auto v = get("TANDEM_FSDP_TRANSFORMER_LAYER_CLS_TO_WRAP")) {
      // Comma-separated class names, as Accelerate writes them ("Block,Embeddings").
      std::vector<std::string> classes;
      std::string item;
      std::stringstream ss(*v);
      while (std::getline(ss, item, ',')) {
        const auto b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
        if (b != std::string::npos) classes.push_back(item.substr(b, e - b + 1));
      }
      o.transformer_layer_cls_to_wrap(classes);
    }
    if (auto v = get("TANDEM_FSDP_MIN_NUM_PARAMS")) {
      try {
        o.min_num_params(std::stoll(*v));
      } catch (const std::exception&) {
        throw bad("TANDEM_FSDP_MIN_NUM_PARAMS (fsdp_config.fsdp_min_num_params)", *v,
                  "expected a whole number");
      }
    }
    if (auto v = get("TANDEM_FSDP_STATE_DICT_TYPE")) {
      const auto t = upper(*v);
      if (t != "FULL_STATE_DICT" && t != "SHARDED_STATE_DICT")
        throw bad("TANDEM_FSDP_STATE_DICT_TYPE (fsdp_config.fsdp_state_dict_type)", *v,
                  "expected FULL_STATE_DICT or SHARDED_STATE_DICT");
      o.state_dict_type(t);
    }
    // fsdp_activation_checkpointing is the Accelerator's (parallel/activation_checkpoint.h); it
    // is only checked here.
    for (const char* b : {"TANDEM_FSDP_ACTIVATION_CHECKPOINTING", "TANDEM_FSDP_SYNC_MODULE_STATES", "TANDEM_FSDP_USE_ORIG_PARAMS",
                          "TANDEM_FSDP_FORWARD_PREFETCH", "TANDEM_FSDP_CPU_RAM_EFFICIENT_LOADING"})
      if (auto v = get(b)) parse_bool(b, *v);
    if (auto v = get("TANDEM_FSDP_BACKWARD_PREFETCH")) {
      const auto t = upper(*v);
      if (t != "BACKWARD_PRE" && t != "BACKWARD_POST" && t != "NO_PREFETCH" && t != "NONE")
        throw bad("TANDEM_FSDP_BACKWARD_PREFETCH", *v,
                  "expected BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH");
    }
  }
  if (auto v = get("TANDEM_REDUCE_SCATTER")) {
    const auto l = lower(*v);
    if (l == "alltoall")
      o.reduce_scatter(ProcessGroup::ReduceScatterAlgorithm::kAlltoall);
    else if (l == "allreduce")
      o.reduce_scatter(ProcessGroup::ReduceScatterAlgorithm::kAllreduceSlice);
    else
      throw bad("TANDEM_REDUCE_SCATTER", *v, "expected alltoall or allreduce");
  }
  return o;
}

std::vector<std::pair<std::string, at::Tensor>> Strategy::model_state(torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& kv : model.named_parameters())
    if (kv.value().defined()) out.emplace_back(kv.key(), kv.value().detach());
  for (const auto& kv : model.named_buffers())
    if (kv.value().defined()) out.emplace_back(kv.key(), kv.value().detach());
  return out;
}

void Strategy::load_model_state(torch::nn::Module& model, const std::string& path) {
  checkpoint::load_model(model, path);
}

checkpoint::OptimizerState Strategy::optimizer_shard_state(const torch::optim::Optimizer&) const {
  throw std::logic_error(name() + " does not shard optimizer state");
}

void Strategy::load_optimizer_shards(torch::optim::Optimizer&, int,
                                     const std::function<std::string(int)>&,
                                     const std::function<at::Tensor(int, const std::string&)>&) {
  throw std::logic_error(name() + " does not shard optimizer state");
}

std::string unsupported_sharding_message(const ShardingOptions& o) {
  if (o.stage() < 0 || o.stage() > 3)
    return o.origin() + ": stage " + std::to_string(o.stage()) + ": expected 0, 1, 2 or 3";
  if (o.offload_params() && o.stage() != 3)
    return o.origin() + ": parameter offload needs stage 3 (parameters are sharded only there); "
           "set offload_param_device: none";
  return "";
}

std::unique_ptr<Strategy> make_strategy(DistributedType type,
                                        const std::optional<ShardingOptions>& sharding,
                                        StrategyContext context) {
  // The type decides the family: DEEPSPEED and FSDP shard as their options say (stage 0,
  // NO_SHARD: data parallel); the others run data parallel unless the program itself asked for
  // a sharding (AcceleratorOptions().sharding). CPU and GPU run the same strategies.
  if ((type == DistributedType::kDeepSpeed || type == DistributedType::kFsdp) && !sharding)
    throw std::invalid_argument(
        context.pg->prefix() + " distributed_type " + to_string(type) +
        " without sharding options: set them (tandem launch --zero_stage / --fsdp_sharding_strategy, "
        "the config file's deepspeed_config / fsdp_config, or AcceleratorOptions().sharding)");
  if (!sharding || sharding->stage() == 0) return std::make_unique<DdpStrategy>(std::move(context));
  auto msg = unsupported_sharding_message(*sharding);
  if (!msg.empty()) throw std::invalid_argument(context.pg->prefix() + " " + msg);
  return detail::make_zero_strategy(*sharding, std::move(context));
}

}  // namespace tandem::parallel
