// resolve_run_config and the readers of the TANDEM_* variables (run_config.h; Note [The
// environment is read in one place]).
#include "tandem/config/run_config.h"
#include "tandem/error.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "../detail/env.h"
#include "tandem/accelerator_options.h"
#include "tandem/parallel/comm_hook.h"

namespace tandem::config {
namespace {

using ::tandem::detail::lower;
using ::tandem::detail::parse_bool;
using ::tandem::detail::upper;

// Reads one environment map: an empty value counts as unset, every value read is noted in
// `used` (RunConfig::from_environment), and every error names the variable by its table row.
class Reader {
 public:
  explicit Reader(const EnvMap& env, std::map<std::string, std::string>* used = nullptr)
      : env_(env), used_(used) {}

  std::optional<std::string> get(const std::string& name) const {
    auto it = env_.find(name);
    if (it == env_.end() || it->second.empty()) return std::nullopt;
    if (used_) (*used_)[name] = it->second;
    return it->second;
  }
  std::optional<bool> boolean(const std::string& name) const {
    auto v = get(name);
    if (!v) return std::nullopt;
    return parse_bool(env_origin(name), *v);
  }
  std::optional<int> positive_int(const std::string& name) const {
    auto v = get(name);
    if (!v) return std::nullopt;
    try {
      size_t pos = 0;
      const int x = std::stoi(*v, &pos);
      if (pos == v->size() && x >= 1) return x;
    } catch (const std::exception&) {
    }
    throw ::tandem::Refused(env_value_origin(name, *v) + " must be a positive integer");
  }
  std::optional<int64_t> integer(const std::string& name) const {
    auto v = get(name);
    if (!v) return std::nullopt;
    try {
      size_t pos = 0;
      const long long x = std::stoll(*v, &pos);
      if (pos == v->size()) return x;
    } catch (const std::exception&) {
    }
    throw ::tandem::Refused(env_value_origin(name, *v) + " must be an integer");
  }
  std::optional<double> non_negative(const std::string& name) const {
    auto v = get(name);
    if (!v) return std::nullopt;
    try {
      size_t pos = 0;
      const double x = std::stod(*v, &pos);
      if (pos == v->size() && x >= 0) return x;
    } catch (const std::exception&) {
    }
    throw ::tandem::Refused(env_value_origin(name, *v) + " must be a number >= 0");
  }
  /// Every variable whose name starts with `prefix` (consulted or not: the caller checks).
  std::vector<std::pair<std::string, std::string>> with_prefix(const std::string& prefix) const {
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& [k, v] : env_)
      if (k.rfind(prefix, 0) == 0) out.emplace_back(k, v);
    return out;
  }
  void note(const std::string& name, const std::string& value) const {
    if (used_ && !value.empty()) (*used_)[name] = value;
  }

 private:
  const EnvMap& env_;
  std::map<std::string, std::string>* used_;
};

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

}  // namespace

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
  f.checkpoint_crash_rank = static_cast<int>(r.integer(var::kCheckpointCrashRank).value_or(0));
  return f;
}

FaultInjection fault_injection() { return fault_injection_from_env(current_environment()); }

// Under AddressSanitizer the host allocator is off unless asked for: ASan checks every tensor's
// memory only where malloc hands it out.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif
#else
constexpr bool kAddressSanitizer = false;
#endif

RunConfig resolve_run_config(const AcceleratorOptions& options, const EnvMap& map) {
  RunConfig c;
  c.process = ProcessState::from_env(map);
  const std::string prefix = c.process.prefix() + " ";
  const Reader env(map, &c.from_environment);
  // Every error below names the rank; the readers' errors name the variable and its setters.
  auto with_prefix = [&](auto&& step) {
    try {
      step();
    } catch (const std::invalid_argument& e) {
      throw ::tandem::Refused(prefix + e.what());
    }
  };
  if (auto type = env.get(var::kDistributedType)) {
    auto msg = parallel::unavailable_distributed_type_message(*type);
    if (!msg.empty())
      throw ::tandem::Refused(prefix + var::kDistributedType + "=" + *type + ": " + msg);
    try {
      c.distributed_type = parallel::distributed_type_from_name(*type);
    } catch (const std::invalid_argument& e) {
      throw ::tandem::Refused(prefix + env_origin(var::kDistributedType) + ": " + e.what());
    }
  }
  with_prefix([&] {
    c.sharding = options.sharding() ? options.sharding() : sharding_of(env);
    if (c.sharding) {
      auto msg = parallel::unsupported_sharding_message(*c.sharding);
      if (!msg.empty()) throw ::tandem::Refused(msg);
    }
    c.cpu = options.cpu().value_or(env.boolean(var::kUseCpu).value_or(false));
    c.gradient_as_bucket_view = options.gradient_as_bucket_view().value_or(
        env.boolean(var::kGradientAsBucketView).value_or(false));
  });
  if (auto steps = options.gradient_accumulation_steps()) {
    if (*steps < 1)
      throw ::tandem::Refused(prefix + "gradient_accumulation_steps is " +
                                  std::to_string(*steps) + "; it must be at least 1");
    c.gradient_accumulation_steps = *steps;
  } else {
    with_prefix([&] {
      c.gradient_accumulation_steps =
          env.positive_int(var::kGradientAccumulationSteps).value_or(1);
    });
  }
  with_prefix([&] {
    c.num_threads = env.positive_int(var::kNumCpuThreads);
    c.gradient_clipping =
        options.gradient_clipping() ? options.gradient_clipping() : env.non_negative(var::kGradientClipping);
  });
  c.comm_hook = options.comm_hook() ? *options.comm_hook()
                                    : env.get(var::kDdpCommHook).value_or("none");
  try {
    parallel::comm_hook_from_name(c.comm_hook);
  } catch (const std::invalid_argument& e) {
    throw ::tandem::Refused(prefix + "comm_hook: " + e.what());
  }
  if (options.bucket_cap_mb() <= 0 || options.first_bucket_cap_mb() <= 0)
    throw ::tandem::Refused(prefix + "bucket_cap_mb and first_bucket_cap_mb must be "
                                "positive");
  c.bucket_cap_mb = options.bucket_cap_mb();
  c.first_bucket_cap_mb = options.first_bucket_cap_mb();
  with_prefix([&] {
    c.mixed_precision = options.mixed_precision() ? *options.mixed_precision()
                                                  : env.get(var::kMixedPrecision).value_or("no");
    c.downcast_bf16 =
        options.downcast_bf16().value_or(env.boolean(var::kDowncastBf16).value_or(false));
    if (options.fp8())
      c.fp8 = options.fp8();
    else if (lower(c.mixed_precision) == "fp8")
      c.fp8 = fp8_of(env);
  });
  try {
    c.mesh_shape = options.parallelism() ? *options.parallelism() : mesh_shape_of(env);
    // Note [Hybrid sharding]: HYBRID_SHARD shards over the ranks of one machine and replicates
    // across machines, as FSDP's; explicit dp sizes decide instead.
    if (c.sharding && c.sharding->hybrid() && c.mesh_shape.dp_replicate == 0 &&
        c.mesh_shape.dp_shard == 0 && c.process.local_world_size > 0 &&
        c.process.world_size % c.process.local_world_size == 0)
      c.mesh_shape.dp_replicate = c.process.world_size / c.process.local_world_size;
    c.mesh_shape = c.mesh_shape.resolve(c.process.world_size, c.process.local_world_size,
                                        c.sharding && c.sharding->stage() > 0);
  } catch (const std::invalid_argument& e) {
    throw ::tandem::Refused(prefix + "parallelism: " + e.what());
  }
  // Note [A topology always built]: the data-parallel sizes take effect through the strategy
  // (ZeRO shards over dp_shard), so a size no strategy can honour is refused here.
  const int stage = c.sharding ? c.sharding->stage() : 0;
  if (stage == 0 && c.mesh_shape.dp_shard > 1)
    throw ::tandem::Refused(
        prefix + "parallelism: dp_shard_size " + std::to_string(c.mesh_shape.dp_shard) +
        " (--dp_shard_size, parallelism_config_dp_shard_size, or AcceleratorOptions()."
        "parallelism) shards the training state over " + std::to_string(c.mesh_shape.dp_shard) +
        " ranks, but this run has no sharding strategy, so it would train as plain data parallel. "
        "Add one (--use_fsdp, or --use_deepspeed --zero_stage 1-3), or set dp_replicate_size "
        "instead of dp_shard_size");
  // Note [Pipelines and ZeRO]: a Pipeline averages its stage's gradients over mesh["dp"] once per
  // step itself, so a strategy that reduces (and shards) gradients in backward hooks has no place
  // in it (DeepSpeed, too, refuses ZeRO stages 2 and 3 with pipeline parallel). Refused here, so
  // that a program that never reaches prepare_pipeline cannot run a pipeline layout under ZeRO
  // either, and before the process group is built: the refusal needs no peer, and a rank that
  // refused after joining could end rank 0's store while a slower rank still connected.
  if (c.mesh_shape.pp > 1 && stage > 0)
    throw ::tandem::Refused(
        prefix + "ZeRO stage " + std::to_string(stage) +
        " does not combine with pipeline parallel in tandem: pp_size " +
        std::to_string(c.mesh_shape.pp) +
        " (tandem launch --pp_size, or AcceleratorOptions().parallelism) with ZeRO (--use_deepspeed "
        "--zero_stage, --use_fsdp, or AcceleratorOptions().sharding); the pipeline averages each "
        "stage's gradients itself. Drop one of the two (ZeRO combines with --tp_size)");
  with_prefix([&] {
    c.activation_checkpointing =
        options.activation_checkpointing().value_or(activation_checkpointing_of(map, env));
    c.timeline_dir =
        options.timeline_dir().empty() ? env.get(var::kTimeline).value_or("") : options.timeline_dir();
    c.profile = env.get(var::kProfile).value_or("");
    c.host_allocator = options.host_allocator().value_or(
        env.boolean(var::kHostAllocator).value_or(!kAddressSanitizer));
    c.host_cache_mb =
        options.host_cache_mb().value_or(env.non_negative(var::kHostCacheMb).value_or(32.0));
    if (c.host_cache_mb < 0)
      throw ::tandem::Refused("host_cache_mb is " + std::to_string(c.host_cache_mb) +
                                  " (AcceleratorOptions().host_cache_mb); it must be 0 or more");
    c.debug = env.boolean(var::kDebug).value_or(false);
    c.num_machines = env.positive_int(var::kNumMachines).value_or(1);
    if (c.distributed_type == parallel::DistributedType::kDeepSpeed) {
      c.zero3_init_flag = env.boolean(var::kZero3InitFlag).value_or(false);
      c.zero3_save_16bit_model = env.boolean(var::kZero3Save16bitModel).value_or(false);
    }
  });
  return c;
}

std::string describe(const RunConfig& c) {
  std::ostringstream os;
  auto yes = [](bool b) { return b ? "true" : "false"; };
  os << "tandem run configuration " << c.process.prefix() << ":\n";
  os << "  distributed_type: " << parallel::to_string(c.distributed_type) << "\n";
  os << "  sharding: ";
  if (c.sharding)
    os << "ZeRO stage " << c.sharding->stage() << " (" << c.sharding->origin() << ")"
       << (c.sharding->offload_optimizer() ? ", optimizer offload" : "")
       << (c.sharding->offload_params() ? ", parameter offload" : "") << "\n";
  else
    os << "none\n";
  os << "  cpu: " << yes(c.cpu) << "\n";
  os << "  mixed_precision: " << c.mixed_precision << (c.downcast_bf16 ? " (downcast_bf16)" : "")
     << "\n";
  os << "  gradient_accumulation_steps: " << c.gradient_accumulation_steps << "\n";
  os << "  num_threads: " << (c.num_threads ? std::to_string(*c.num_threads) : "LibTorch's") << "\n";
  os << "  gradient_clipping: "
     << (c.gradient_clipping ? std::to_string(*c.gradient_clipping) : std::string("none")) << "\n";
  os << "  comm_hook: " << c.comm_hook << ", gradient_as_bucket_view: "
     << yes(c.gradient_as_bucket_view) << ", bucket_cap_mb: " << c.bucket_cap_mb
     << ", first_bucket_cap_mb: " << c.first_bucket_cap_mb << "\n";
  os << "  mesh: " << c.mesh_shape.to_string() << "\n";
  os << "  activation_checkpointing: " << yes(c.activation_checkpointing) << "\n";
  os << "  timeline_dir: " << (c.timeline_dir.empty() ? "none" : c.timeline_dir) << "\n";
  os << "  profile: " << (c.profile.empty() ? "none" : c.profile) << "\n";
  os << "  host_allocator: " << yes(c.host_allocator) << ", host_cache_mb: " << c.host_cache_mb
     << "\n";
  os << "  from the environment:";
  if (c.from_environment.empty()) os << " nothing";
  for (const auto& [k, v] : c.from_environment) os << " " << k << "=" << v;
  os << "\n";
  return os.str();
}

}  // namespace tandem::config
