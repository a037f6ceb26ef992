// The readers of the TANDEM_* variables (run_config.h; Note [The environment is read in one
// place]): no LibTorch at run time, so that the launcher links them (Note [A launcher without
// LibTorch]). resolve_run_config is in run_config.cpp.
#include "env_reader.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace tandem::config {
namespace detail {

using ::tandem::detail::lower;
using ::tandem::detail::parse_bool;
using ::tandem::detail::upper;

::tandem::Refused bad(const std::string& name, const std::string& value,
                          const std::string& expected) {
  return ::tandem::Refused(env_value_origin(name, value) + ": " + expected);
}

std::optional<parallel::ShardingOptions> sharding_of(const Reader& env) {
  using parallel::DistributedType;
  const auto type =
      parallel::distributed_type_from_name(env.get(var::kDistributedType).value_or("NO"));
  if (type != DistributedType::kDeepSpeed && type != DistributedType::kFsdp) return std::nullopt;
  parallel::ShardingOptions o;
  if (type == DistributedType::kDeepSpeed) {
    o.origin("deepspeed_config");
    const auto stage = env.get(var::kZeroStage).value_or("2");  // Accelerate's default
    if (stage != "0" && stage != "1" && stage != "2" && stage != "3")
      throw bad(var::kZeroStage, stage, "expected 0, 1, 2 or 3");
    o.stage(std::stoi(stage));
    for (const char* name : {var::kOffloadOptimizerDevice, var::kOffloadParamDevice}) {
      const auto v = lower(env.get(name).value_or("none"));
      const bool optimizer = std::string(name) == var::kOffloadOptimizerDevice;
      if (v == "nvme" && optimizer) {
        // Note [Optimizer state on disk]
        const auto path = env.get(var::kOffloadOptimizerNvmePath).value_or("");
        if (path.empty())
          throw bad(name, v, "the optimizer state goes to files in a directory: set "
                    "offload_optimizer_nvme_path (" + env_origin(var::kOffloadOptimizerNvmePath) + ")");
        if (o.stage() == 0)
          throw bad(name, v, "ZeRO stage 0 shards no optimizer state to put on disk; use stage 1-3");
        o.nvme_path(path);
        continue;
      }
      if (v != "none" && v != "cpu")
        throw bad(name, v, v == "nvme" ? "parameter offload to NVMe is not implemented; use cpu "
                                         "or none (offload_optimizer_device takes nvme)"
                                       : "expected none, cpu or nvme");
      if (v == "cpu") {
        if (optimizer)
          o.offload_optimizer(true);
        else
          o.offload_params(true);
      }
    }
    if (auto p = env.get(var::kOffloadOptimizerNvmePath); p && !p->empty() && o.nvme_path().empty())
      throw bad(var::kOffloadOptimizerNvmePath, *p,
                "a directory for the optimizer state, but offload_optimizer_device is not nvme (" +
                    env_origin(var::kOffloadOptimizerDevice) +
                    "): set it to nvme, or drop the path");
    env.boolean(var::kZero3Save16bitModel);
  } else {
    o.origin("fsdp_config");
    // Every fsdp_ key Accelerate writes has a row in the table; tandem acts on some and accepts
    // the others as hints that do not change results (docs/sharding.md says which).
    for (const auto& [k, v] : env.with_prefix(var::kFsdpPrefix)) {
      if (!find_env_var(k))
        throw ::tandem::Refused(k + ": fsdp_config key fsdp_" + lower(k.substr(12)) +
                                    " is not one tandem knows; remove it from the config file");
      env.note(k, v);
    }
    const auto s = env.get(var::kFsdpShardingStrategy).value_or("FULL_SHARD");
    try {
      const auto& strategy = parallel::fsdp_sharding_strategy(s);
      o.stage(strategy.stage);
      // Note [Hybrid sharding]: shards within a machine, replicas across machines (the mesh is
      // resolved below: dp_replicate = the number of machines unless the sizes are given).
      o.hybrid(strategy.hybrid);
    } catch (const std::invalid_argument& e) {
      throw bad(var::kFsdpShardingStrategy, upper(s), e.what());
    }
    if (env.boolean(var::kFsdpOffloadParams).value_or(false)) {
      o.offload_optimizer(true);  // FSDP's CPU offload moves the step to the host as well
      o.offload_params(o.stage() == 3);
    }
    if (auto v = env.get(var::kFsdpAutoWrapPolicy)) {
      const auto t = upper(*v);
      if (t != "TRANSFORMER_BASED_WRAP" && t != "SIZE_BASED_WRAP" && t != "NO_WRAP")
        throw bad(var::kFsdpAutoWrapPolicy, *v,
                  "expected TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP");
      o.auto_wrap_policy(t);
    }
    if (auto v = env.get(var::kFsdpTransformerLayerClsToWrap)) {
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
    if (auto v = env.get(var::kFsdpMinNumParams)) {
      try {
        size_t pos = 0;
        o.min_num_params(std::stoll(*v, &pos));
        if (pos != v->size()) throw ::tandem::Refused("");
      } catch (const std::exception&) {
        throw bad(var::kFsdpMinNumParams, *v, "expected a whole number");
      }
    }
    if (auto v = env.get(var::kFsdpStateDictType)) {
      const auto t = upper(*v);
      if (t != "FULL_STATE_DICT" && t != "SHARDED_STATE_DICT")
        throw bad(var::kFsdpStateDictType, *v,
                  "expected FULL_STATE_DICT or SHARDED_STATE_DICT");
      o.state_dict_type(t);
    }
    // fsdp_activation_checkpointing is the Accelerator's (activation_checkpointing_from_env);
    // it is only checked here.
    for (const char* b : {var::kFsdpActivationCheckpointing, var::kFsdpSyncModuleStates,
                          var::kFsdpUseOrigParams, var::kFsdpCpuRamEfficientLoading})
      env.boolean(b);
    // Note [Prefetching units]: stage 3's all-gathers ahead of use.
    if (auto f = env.boolean(var::kFsdpForwardPrefetch)) o.forward_prefetch(*f);
    if (auto v = env.get(var::kFsdpBackwardPrefetch)) {
      const auto t = upper(*v);
      if (t != "BACKWARD_PRE" && t != "BACKWARD_POST" && t != "NO_PREFETCH" && t != "NONE")
        throw bad(var::kFsdpBackwardPrefetch, *v,
                  "expected BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH");
      o.backward_prefetch(t == "NONE" ? "NO_PREFETCH" : t);
    }
    if (auto v = env.get(var::kFsdpReshardAfterForward)) {
      // FSDP2's boolean; an FSDP1 strategy name here is left to fsdp_sharding_strategy.
      const auto l = lower(*v);
      if (l == "true" || l == "1" || l == "yes") o.reshard_after_forward(true);
      if (l == "false" || l == "0" || l == "no") o.reshard_after_forward(false);
    }
  }
  if (auto v = env.get(var::kReduceScatter)) {
    const auto l = lower(*v);
    if (l == "alltoall")
      o.reduce_scatter(ProcessGroup::ReduceScatterAlgorithm::kAlltoall);
    else if (l == "allreduce")
      o.reduce_scatter(ProcessGroup::ReduceScatterAlgorithm::kAllreduceSlice);
    else
      throw bad(var::kReduceScatter, *v, "expected alltoall or allreduce");
  }
  return o;
}

int mesh_size(const Reader& env, const char* name) {
  auto v = env.get(name);
  if (!v) return 0;
  size_t used = 0;
  int x = 0;
  try {
    x = std::stoi(*v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v->size() || x < 1) {
    const EnvVar* row = find_env_var(name);
    throw ::tandem::Refused(std::string(name) + "=" + *v +
                                " is not a mesh size: expected a positive integer (unset it to "
                                "let tandem choose; it comes from config " +
                                row->key + ", tandem launch " + row->flag + ")");
  }
  return x;
}

comm::MeshShape mesh_shape_of(const Reader& env) {
  comm::MeshShape s;
  s.pp = mesh_size(env, var::kPpSize);
  s.dp_replicate = mesh_size(env, var::kDpReplicateSize);
  s.dp_shard = mesh_size(env, var::kDpShardSize);
  s.tp = mesh_size(env, var::kTpSize);
  s.cp = mesh_size(env, var::kCpSize);
  return s;
}

bool activation_checkpointing_of(const EnvMap& map, const Reader& env) {
  for (const char* name : {var::kActivationCheckpointing, var::kFsdpActivationCheckpointing}) {
    auto it = map.find(name);
    if (it == map.end()) continue;
    if (it->second.empty()) return false;  // set and empty: off, whatever the FSDP key says
    return env.boolean(name).value_or(false);
  }
  return false;
}

precision::Fp8Options fp8_of(const Reader& env) {
  precision::Fp8Options o;
  if (auto v = env.get(var::kFp8Format)) o.fp8_format(*v);
  if (auto v = env.integer(var::kFp8AmaxHistoryLen)) o.amax_history_len(*v);
  if (auto v = env.get(var::kFp8AmaxComputeAlgo)) o.amax_compute_algo(*v);
  if (auto v = env.integer(var::kFp8Margin)) o.margin(*v);
  if (auto v = env.integer(var::kFp8Interval)) o.interval(*v);
  return o;
}

}  // namespace detail

using detail::Reader;

std::optional<parallel::ShardingOptions> sharding_from_env(const EnvMap& env) {
  return sharding_of(Reader(env));
}

comm::MeshShape mesh_shape_from_env(const EnvMap& env) { return mesh_shape_of(Reader(env)); }

bool activation_checkpointing_from_env(const EnvMap& env) {
  return activation_checkpointing_of(env, Reader(env));
}

precision::Fp8Options fp8_options_from_env(const EnvMap& env) { return fp8_of(Reader(env)); }

std::string timeline_dir_from_env(const EnvMap& env) {
  return Reader(env).get(var::kTimeline).value_or("");
}

FaultInjection fault_injection_from_env(const EnvMap& env) {
  Reader r(env);
  FaultInjection f;
  f.checkpoint_crash = r.get(var::kCheckpointCrash).value_or("");
  if (!f.checkpoint_crash.empty() && f.checkpoint_crash != "mid_files" &&
      f.checkpoint_crash != "after_files" && f.checkpoint_crash != "before_rename" &&
      f.checkpoint_crash != "after_rename")
    throw detail::bad(var::kCheckpointCrash, f.checkpoint_crash,
              "expected a point of a save: mid_files, after_files, before_rename or after_rename");
  f.checkpoint_crash_rank = static_cast<int>(r.integer(var::kCheckpointCrashRank).value_or(0));
  return f;
}

FaultInjection fault_injection() { return fault_injection_from_env(current_environment()); }

}  // namespace tandem::config
