// The run configuration: every setting of a run, resolved once from the Accelerator's options
// over the launcher's TANDEM_* variables, as a pure function of the two (Note [The environment
// is read in one place]).
#pragma once

#include <map>
#include <optional>
#include <string>

#include "tandem/accelerator_options.h"
#include "tandem/comm/mesh.h"
#include "tandem/config/run_env.h"
#include "tandem/parallel/sharding_options.h"
#include "tandem/precision/fp8.h"
#include "tandem/state.h"

namespace tandem::config {

// Note [The environment is read in one place]: tandem's settings come from code
// (AcceleratorOptions) or from the launcher (TANDEM_* variables, table in run_env.h). They are
// resolved once, by resolve_run_config over a snapshot of the environment (current_environment),
// and every part of a run is built from the resulting RunConfig: no strategy, precision
// component, recorder or mesh reads a variable itself. Outside src/config/ only ProcessState
// (where the process stands: RANK, WORLD_SIZE, TANDEM_ERROR_FILE, TANDEM_LOCAL_ADDR, ...) and
// the launcher touch the environment. Process-level switches that no Accelerator carries (the
// crash points of the checkpoint tests) are resolved here too, by fault_injection(), and handed
// to the part that acts on them. Nothing below this layer reads a TANDEM_* variable or calls
// back into it: a program that builds the parts itself reads them with the functions below
// (mesh_shape_from_env, activation_checkpointing_from_env, ...).

/// Every resolved setting of a run. Options given in code win over the environment.
///
/// Example:
///   auto run = tandem::config::resolve_run_config(tandem::AcceleratorOptions().cpu(true),
///                                                 tandem::current_environment());
///   std::cout << tandem::config::describe(run);
struct RunConfig {
  /// Where this process stands (ProcessState::from_env of the same environment).
  ProcessState process;
  /// TANDEM_DISTRIBUTED_TYPE (default NO).
  parallel::DistributedType distributed_type = parallel::DistributedType::kNo;
  /// AcceleratorOptions::sharding, else the DeepSpeed / FSDP settings (sharding_from_env).
  std::optional<parallel::ShardingOptions> sharding;
  bool cpu = false;
  bool gradient_as_bucket_view = false;
  int gradient_accumulation_steps = 1;
  /// LibTorch intra-op threads (TANDEM_NUM_CPU_THREADS); unset: leave LibTorch's.
  std::optional<int> num_threads;
  /// Clip to this norm before every optimizer step; unset: only when the program clips.
  std::optional<double> gradient_clipping;
  /// "none", "fp16" or "bf16" (checked by parallel::comm_hook_from_name).
  std::string comm_hook = "none";
  double bucket_cap_mb = 25.0;
  double first_bucket_cap_mb = 1.0;
  /// no, bf16, fp16, bf16-true, fp16-true or fp8 (checked against the device by the precision
  /// component).
  std::string mixed_precision = "no";
  bool downcast_bf16 = false;
  /// The fp8 recipe: the options', else TANDEM_FP8_* under mixed_precision fp8; unset otherwise.
  std::optional<precision::Fp8Options> fp8;
  /// The mesh sizes, always resolved against the job's world (every size >= 1; Note [A topology
  /// always built]). Without dp sizes given, a sharded run (a ZeRO stage) shards over every
  /// data-parallel rank (dp_shard), any other replicates (dp_replicate). dp_shard above 1 without
  /// a ZeRO stage, and dp_replicate above 1 with one (hybrid sharding), are refused.
  comm::MeshShape mesh_shape;
  bool activation_checkpointing = false;
  /// TANDEM_PP_SCHEDULE as parallel::to_string spells it ("1F1B", ...); empty: unset (the
  /// program's PipelineOptions, else 1F1B). Checked by parallel::schedule_from_name.
  std::string pp_schedule;
  /// TANDEM_PP_VIRTUAL_STAGES: stages per pipeline rank; 0: unset.
  int pp_virtual_stages = 0;
  /// TANDEM_CP_COMM_STRATEGY: how context parallel moves keys and values ("alltoall": the ring,
  /// the default; "allgather"). Checked by parallel::context_parallel_comm_from_name.
  std::string cp_comm = "alltoall";
  /// TANDEM_EP_SIZE: expert-parallel ranks (Note [Expert parallel]): consecutive data-parallel
  /// ranks that split each mixture-of-experts layer's experts; 1: none.
  int ep_size = 1;
  /// Note [Resident memory and large blocks]: tandem's host allocator serves large CPU blocks
  /// (AcceleratorOptions::host_allocator, else TANDEM_HOST_ALLOCATOR; default true; under
  /// AddressSanitizer it poisons what ASan's malloc would, Note [The host allocator under
  /// AddressSanitizer]), keeping at most host_cache_mb of freed ones for reuse
  /// (TANDEM_HOST_CACHE_MB; default 32).
  bool host_allocator = true;
  double host_cache_mb = 32;
  /// Per-rank timeline folder: AcceleratorOptions::timeline_dir, else TANDEM_TIMELINE; empty: none.
  std::string timeline_dir;
  /// TANDEM_PROFILE: each rank writes <this>.rank<r>.json (track/run_profile.h); empty: none.
  std::string profile;
  /// Note [Preemption]: whether SIGTERM (and preemption_signal) make every rank save a
  /// checkpoint at the end of its step and stop (AcceleratorOptions::checkpoint_on_preemption;
  /// unset: when the program checkpoints periodically or resumes by itself).
  bool checkpoint_on_preemption = false;
  /// TANDEM_PREEMPTION_SIGNAL (tandem launch --preemption_signal): a second such signal; 0: none.
  int preemption_signal = 0;
  /// TANDEM_DEBUG: the main process prints describe() at start.
  bool debug = false;
  int num_machines = 1;
  /// DeepSpeed's zero3 keys: checked, not acted on.
  bool zero3_init_flag = false;
  bool zero3_save_16bit_model = false;
  /// The TANDEM_* variables the resolution consulted that were set (name -> value).
  std::map<std::string, std::string> from_environment;
};

/// Resolves `options` over `env` (a snapshot: current_environment(), or a map in tests). Pure.
/// Throws std::invalid_argument naming the variable, its value, the config key and the launch
/// flag that set it, and what is accepted; errors after ProcessState is known carry the
/// "[rank r/w]" prefix.
RunConfig resolve_run_config(const AcceleratorOptions& options, const EnvMap& env);

/// The run configuration, one "name: value" line per setting (what TANDEM_DEBUG prints).
std::string describe(const RunConfig& config);

// ---- the pieces, for programs that build the parts themselves -----------------------------

/// The sharding a launcher's environment asks for: TANDEM_DISTRIBUTED_TYPE=DEEPSPEED with
/// TANDEM_ZERO_STAGE, TANDEM_OFFLOAD_OPTIMIZER_DEVICE, TANDEM_OFFLOAD_PARAM_DEVICE; or FSDP with
/// TANDEM_FSDP_SHARDING_STRATEGY, TANDEM_FSDP_OFFLOAD_PARAMS, TANDEM_FSDP_STATE_DICT_TYPE (and
/// the other TANDEM_FSDP_* keys, checked); TANDEM_REDUCE_SCATTER (alltoall or allreduce) for
/// either. nullopt for the other types. Throws std::invalid_argument naming the variable, its
/// value and what is accepted, for every value tandem cannot honour.
std::optional<parallel::ShardingOptions> sharding_from_env(const EnvMap& env);
/// TANDEM_PP_SIZE, TANDEM_DP_REPLICATE_SIZE, TANDEM_DP_SHARD_SIZE, TANDEM_TP_SIZE (absent: not
/// set), not resolved. Throws std::invalid_argument on a value that is not a positive integer.
comm::MeshShape mesh_shape_from_env(const EnvMap& env);
/// TANDEM_ACTIVATION_CHECKPOINTING, else TANDEM_FSDP_ACTIVATION_CHECKPOINTING; default false.
bool activation_checkpointing_from_env(const EnvMap& env);
/// TANDEM_FP8_FORMAT, _AMAX_HISTORY_LEN, _AMAX_COMPUTE_ALGO, _MARGIN, _INTERVAL over the defaults.
precision::Fp8Options fp8_options_from_env(const EnvMap& env);
/// TANDEM_TIMELINE ("" when unset or empty).
std::string timeline_dir_from_env(const EnvMap& env);

/// The fault injection of the crash-consistency tests: TANDEM_CHECKPOINT_CRASH names a point of
/// save_state ("mid_files", "after_files", "before_rename", "after_rename"; another value is
/// refused) where the rank
/// TANDEM_CHECKPOINT_CRASH_RANK (default 0) is killed.
struct FaultInjection {
  std::string checkpoint_crash;
  int checkpoint_crash_rank = 0;
};
FaultInjection fault_injection_from_env(const EnvMap& env);
/// fault_injection_from_env of this process's environment now: a process-level switch that a
/// test may set between two saves, so it is read at each use, not once per Accelerator.
FaultInjection fault_injection();

}  // namespace tandem::config
