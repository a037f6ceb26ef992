// Distributed types and sharding options: names, parsing and checks (sharding_options.h).
#include "tandem/parallel/sharding_options.h"
#include "tandem/error.h"

#include <map>
#include <stdexcept>

#include "../detail/env.h"

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

using ::tandem::detail::upper;

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
  throw ::tandem::Refused("distributed type '" + name + "': expected one of " + all);
}

const std::vector<FsdpShardingStrategy>& fsdp_sharding_strategies() {
  static const std::vector<FsdpShardingStrategy> v = {{"FULL_SHARD", 3, false},
                                                      {"SHARD_GRAD_OP", 2, false},
                                                      {"NO_SHARD", 0, false},
                                                      {"HYBRID_SHARD", 3, true},
                                                      {"HYBRID_SHARD_ZERO2", 2, true}};
  return v;
}

const FsdpShardingStrategy& fsdp_sharding_strategy(const std::string& value) {
  const auto& all = fsdp_sharding_strategies();
  const std::string s = upper(value);
  if (s.size() == 1 && s[0] >= '1' && s[0] <= '0' + static_cast<int>(all.size()))
    return all[static_cast<size_t>(s[0] - '1')];
  for (const auto& st : all)
    if (st.name == s) return st;
  std::string names;
  for (size_t i = 0; i < all.size(); ++i)
    names += (i ? ", " : "") + std::to_string(i + 1) + " " + all[i].name;
  throw ::tandem::Refused("expected one of " + names + " (a name or its number)");
}

std::string unsupported_sharding_message(const ShardingOptions& o) {
  if (!o.nvme_path().empty() && o.stage() == 0)
    return o.origin() + ": the optimizer state on disk (nvme_path " + o.nvme_path() +
           ") needs ZeRO stage 1-3, which shard the optimizer state; stage 0 has none to offload";
  if (o.stage() < 0 || o.stage() > 3)
    return o.origin() + ": stage " + std::to_string(o.stage()) + ": expected 0, 1, 2 or 3";
  if (o.offload_params() && o.stage() != 3)
    return o.origin() + ": parameter offload needs stage 3 (parameters are sharded only there); "
           "set offload_param_device: none";
  return "";
}

std::string unavailable_distributed_type_message(const std::string& t) {
  static const std::map<std::string, std::string> devices = {
      {"XLA", "TPUs (Accelerate's TPU/XLA type)"},
      {"TPU", "TPUs (Accelerate's TPU/XLA type)"},
      {"MULTI_XPU", "Intel GPUs (XPU)"},
      {"MULTI_NPU", "Ascend NPUs"},
      {"MULTI_MLU", "Cambricon MLUs"},
      {"MULTI_HPU", "Intel Gaudi HPUs"},
      {"MULTI_SDAA", "SDAA accelerators"},
      {"MULTI_MUSA", "Moore Threads GPUs (MUSA)"},
      {"MULTI_NEURON", "AWS Neuron devices"}};
  const std::string instead =
      ". Plain data parallel runs instead when you ask for it: set `distributed_type: MULTI_CPU` "
      "(MULTI_GPU on GPUs) in the config file, or pass --multi_gpu on GPUs";
  if (auto it = devices.find(t); it != devices.end())
    return "distributed_type " + t + " asks for " + it->second +
           ", which tandem does not drive (it runs on CPUs and CUDA GPUs); it refuses rather "
           "than run the job on other devices" +
           instead;
  std::string what;
  if (t == "MEGATRON_LM")
    what = "distributed_type MEGATRON_LM asks for Megatron-LM's tensor and pipeline parallelism";
  else if (t == "MODEL_PARALLEL")
    what = "distributed_type MODEL_PARALLEL asks for SageMaker's model parallelism";
  else
    return "";
  return what +
         ", which this version of tandem does not implement; it refuses rather than run "
         "something else (tandem's own tensor and pipeline parallel: --tp_size, --pp_size)" +
         instead +
         "; every rank then holds the whole model, its gradients and the optimizer "
         "state";
}

}  // namespace tandem::parallel
