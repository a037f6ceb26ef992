// resolve_run_config and describe (run_config.h); the readers of the TANDEM_* variables are in
// env_readers.cpp (Note [The environment is read in one place]).
#include "tandem/config/run_config.h"
#include "tandem/error.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "env_reader.h"
#include "tandem/accelerator_options.h"
#include "tandem/preemption.h"
#include "tandem/parallel/comm_hook.h"
#include "tandem/parallel/cp_comm.h"
#include "tandem/parallel/schedule_kind.h"

namespace tandem::config {
namespace {

using detail::Reader;
using detail::sharding_of;
using detail::mesh_shape_of;
using detail::activation_checkpointing_of;
using detail::fp8_of;
using ::tandem::detail::lower;

}  // namespace

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
  // A communication hook reduces data parallel's gradient buckets; ZeRO reduces (and shards)
  // them with its own collectives, and a pipeline averages its stages' gradients itself: a hook
  // there would be accepted and never run.
  if (parallel::comm_hook_from_name(c.comm_hook)->name() != "allreduce" &&
      (stage > 0 || c.mesh_shape.pp > 1))
    throw ::tandem::Refused(
        prefix + "comm_hook " + c.comm_hook + " (tandem launch --ddp_comm_hook, the config "
        "file's ddp_comm_hook, or AcceleratorOptions().comm_hook) compresses data parallel's "
        "gradient allreduce, and this run reduces its gradients another way: " +
        (stage > 0 ? "ZeRO stage " + std::to_string(stage) + " reduce-scatters them itself"
                   : "the pipeline (pp_size " + std::to_string(c.mesh_shape.pp) +
                         ") averages each stage's gradients itself") +
        ". Leave the hook out (or run plain data parallel)");
  with_prefix([&] {
    c.activation_checkpointing =
        options.activation_checkpointing().value_or(activation_checkpointing_of(map, env));
    c.timeline_dir =
        options.timeline_dir().empty() ? env.get(var::kTimeline).value_or("") : options.timeline_dir();
    c.profile = env.get(var::kProfile).value_or("");
    if (auto name = env.get(var::kPpSchedule))
      c.pp_schedule = parallel::to_string(parallel::schedule_from_name(
          *name, env_value_origin(var::kPpSchedule, *name)));
    c.pp_virtual_stages = env.positive_int(var::kPpVirtualStages).value_or(0);
    if ((!c.pp_schedule.empty() || c.pp_virtual_stages > 0) && c.mesh_shape.pp == 1)
      throw ::tandem::Refused(
          std::string(c.pp_schedule.empty() ? "pp_virtual_stages" : "pp_schedule") +
          " is set (tandem launch --pp_schedule/--pp_virtual_stages, or parallelism_config), but "
          "this run has no pipeline dimension: set pp_size above 1 (--pp_size), or leave the "
          "pipeline settings out");
    // Note [Context parallel].
    if (auto name = env.get(var::kCpComm)) {
      c.cp_comm = parallel::to_string(parallel::context_parallel_comm_from_name(
          *name, env_value_origin(var::kCpComm, *name)));
      if (c.mesh_shape.cp <= 1)
        throw ::tandem::Refused("cp_comm_strategy is set (tandem launch --cp_comm_strategy, or "
                                "parallelism_config), but this run has no context-parallel "
                                "dimension: set cp_size above 1 (--cp_size), or leave it out");
    }
    // Note [Expert parallel].
    if (const int ep = detail::mesh_size(env, var::kEpSize); ep > 0) c.ep_size = ep;
    c.host_allocator =
        options.host_allocator().value_or(env.boolean(var::kHostAllocator).value_or(true));
    c.host_cache_mb =
        options.host_cache_mb().value_or(env.non_negative(var::kHostCacheMb).value_or(32.0));
    if (c.host_cache_mb < 0)
      throw ::tandem::Refused("host_cache_mb is " + std::to_string(c.host_cache_mb) +
                                  " (AcceleratorOptions().host_cache_mb); it must be 0 or more");
    // Note [Preemption].
    const bool checkpoints = options.checkpoint_every_steps() > 0 ||
                             options.checkpoint_every_minutes() > 0 || options.auto_resume();
    c.checkpoint_on_preemption = options.checkpoint_on_preemption().value_or(
        checkpoints && options.automatic_checkpoint_naming());
    if (c.checkpoint_on_preemption && !options.automatic_checkpoint_naming())
      throw ::tandem::Refused(
          "checkpoint_on_preemption is true and automatic_checkpoint_naming is false "
          "(AcceleratorOptions): the checkpoint of a preemption is written as "
          "project_dir/checkpoints/checkpoint_<n>; set automatic_checkpoint_naming(true), or "
          "checkpoint_on_preemption(false)");
    if (auto name = env.get(var::kPreemptionSignal))
      c.preemption_signal = preemption::signal_from_name(
          *name, std::string(var::kPreemptionSignal) + " (tandem launch --preemption_signal)");
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
  if (c.mesh_shape.cp > 1)
    os << "  context parallel: keys/values by " << c.cp_comm << "\n";
  if (c.ep_size > 1) os << "  expert parallel: ep " << c.ep_size << "\n";
  os << "  activation_checkpointing: " << yes(c.activation_checkpointing) << "\n";
  if (!c.pp_schedule.empty() || c.pp_virtual_stages > 0)
    os << "  pipeline: " << (c.pp_schedule.empty() ? "the program's schedule" : c.pp_schedule)
       << ", " << (c.pp_virtual_stages > 0 ? c.pp_virtual_stages : 1) << " stage(s) per rank\n";
  os << "  timeline_dir: " << (c.timeline_dir.empty() ? "none" : c.timeline_dir) << "\n";
  os << "  profile: " << (c.profile.empty() ? "none" : c.profile) << "\n";
  os << "  checkpoint_on_preemption: " << yes(c.checkpoint_on_preemption)
     << (c.preemption_signal ? " (SIGTERM and " + preemption::signal_name(c.preemption_signal) + ")"
                             : std::string())
     << "\n";
  os << "  host_allocator: " << yes(c.host_allocator) << ", host_cache_mb: " << c.host_cache_mb
     << "\n";
  os << "  from the environment:";
  if (c.from_environment.empty()) os << " nothing";
  for (const auto& [k, v] : c.from_environment) os << " " << k << "=" << v;
  os << "\n";
  return os.str();
}

}  // namespace tandem::config
