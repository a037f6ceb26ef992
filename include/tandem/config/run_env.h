// The TANDEM_* variables: one table of every name, the config-file key and the launch flag that
// set it, what kind of value it holds and who reads it. `tandem launch` writes its names from
// here and config::resolve_run_config reads them from here (Note [One table of variables]).
#pragma once

#include <string>
#include <vector>

namespace tandem::config {

// Note [One table of variables]: a TANDEM_* name is spelled once, below. The launcher
// (launch/resolve.cpp, launcher.cpp, fork_launcher.cpp) writes env[var::kX], the run
// configuration (config/run_config.cpp) reads the same constant and words its errors from the
// row of the table (name, config key, launch flag), and the unit tests check the two ends
// against each other: every row the launcher writes and the run configuration owns is read by
// resolve_run_config, and every name the launcher writes has a row. A variable tandem writes
// that nothing in tandem acts on is a row whose reader says who it is for (kProgram).
namespace var {
inline constexpr const char kDistributedType[] = "TANDEM_DISTRIBUTED_TYPE";
inline constexpr const char kMixedPrecision[] = "TANDEM_MIXED_PRECISION";
inline constexpr const char kGradientAccumulationSteps[] = "TANDEM_GRADIENT_ACCUMULATION_STEPS";
inline constexpr const char kNumCpuThreads[] = "TANDEM_NUM_CPU_THREADS";
inline constexpr const char kUseCpu[] = "TANDEM_USE_CPU";
inline constexpr const char kNumMachines[] = "TANDEM_NUM_MACHINES";
inline constexpr const char kDebug[] = "TANDEM_DEBUG";
inline constexpr const char kDowncastBf16[] = "TANDEM_DOWNCAST_BF16";
inline constexpr const char kDdpCommHook[] = "TANDEM_DDP_COMM_HOOK";
inline constexpr const char kGradientAsBucketView[] = "TANDEM_GRADIENT_AS_BUCKET_VIEW";
inline constexpr const char kGpuIds[] = "TANDEM_GPU_IDS";
inline constexpr const char kZeroStage[] = "TANDEM_ZERO_STAGE";
inline constexpr const char kOffloadOptimizerDevice[] = "TANDEM_OFFLOAD_OPTIMIZER_DEVICE";
inline constexpr const char kOffloadParamDevice[] = "TANDEM_OFFLOAD_PARAM_DEVICE";
inline constexpr const char kOffloadOptimizerNvmePath[] = "TANDEM_OFFLOAD_OPTIMIZER_NVME_PATH";
inline constexpr const char kGradientClipping[] = "TANDEM_GRADIENT_CLIPPING";
inline constexpr const char kZero3InitFlag[] = "TANDEM_ZERO3_INIT_FLAG";
inline constexpr const char kZero3Save16bitModel[] = "TANDEM_ZERO3_SAVE_16BIT_MODEL";
inline constexpr const char kActivationCheckpointing[] = "TANDEM_ACTIVATION_CHECKPOINTING";
inline constexpr const char kReduceScatter[] = "TANDEM_REDUCE_SCATTER";
inline constexpr const char kPpSize[] = "TANDEM_PP_SIZE";
inline constexpr const char kPpSchedule[] = "TANDEM_PP_SCHEDULE";
inline constexpr const char kPpVirtualStages[] = "TANDEM_PP_VIRTUAL_STAGES";
inline constexpr const char kDpReplicateSize[] = "TANDEM_DP_REPLICATE_SIZE";
inline constexpr const char kDpShardSize[] = "TANDEM_DP_SHARD_SIZE";
inline constexpr const char kTpSize[] = "TANDEM_TP_SIZE";
inline constexpr const char kCpSize[] = "TANDEM_CP_SIZE";
inline constexpr const char kCpComm[] = "TANDEM_CP_COMM_STRATEGY";
inline constexpr const char kEpSize[] = "TANDEM_EP_SIZE";
inline constexpr const char kTimeline[] = "TANDEM_TIMELINE";
inline constexpr const char kProfile[] = "TANDEM_PROFILE";
inline constexpr const char kPreemptionSignal[] = "TANDEM_PREEMPTION_SIGNAL";
inline constexpr const char kHostAllocator[] = "TANDEM_HOST_ALLOCATOR";
inline constexpr const char kHostCacheMb[] = "TANDEM_HOST_CACHE_MB";
/// fsdp_config.fsdp_<key> travels as TANDEM_FSDP_<KEY>; fp8_config.<key> as TANDEM_FP8_<KEY>.
inline constexpr const char kFsdpPrefix[] = "TANDEM_FSDP_";
inline constexpr const char kFsdpShardingStrategy[] = "TANDEM_FSDP_SHARDING_STRATEGY";
inline constexpr const char kFsdpOffloadParams[] = "TANDEM_FSDP_OFFLOAD_PARAMS";
inline constexpr const char kFsdpAutoWrapPolicy[] = "TANDEM_FSDP_AUTO_WRAP_POLICY";
inline constexpr const char kFsdpTransformerLayerClsToWrap[] = "TANDEM_FSDP_TRANSFORMER_LAYER_CLS_TO_WRAP";
inline constexpr const char kFsdpMinNumParams[] = "TANDEM_FSDP_MIN_NUM_PARAMS";
inline constexpr const char kFsdpStateDictType[] = "TANDEM_FSDP_STATE_DICT_TYPE";
inline constexpr const char kFsdpActivationCheckpointing[] = "TANDEM_FSDP_ACTIVATION_CHECKPOINTING";
inline constexpr const char kFsdpSyncModuleStates[] = "TANDEM_FSDP_SYNC_MODULE_STATES";
inline constexpr const char kFsdpUseOrigParams[] = "TANDEM_FSDP_USE_ORIG_PARAMS";
inline constexpr const char kFsdpCpuRamEfficientLoading[] = "TANDEM_FSDP_CPU_RAM_EFFICIENT_LOADING";
inline constexpr const char kFsdpForwardPrefetch[] = "TANDEM_FSDP_FORWARD_PREFETCH";
inline constexpr const char kFsdpBackwardPrefetch[] = "TANDEM_FSDP_BACKWARD_PREFETCH";
inline constexpr const char kFsdpReshardAfterForward[] = "TANDEM_FSDP_RESHARD_AFTER_FORWARD";
inline constexpr const char kFp8Format[] = "TANDEM_FP8_FORMAT";
inline constexpr const char kFp8AmaxHistoryLen[] = "TANDEM_FP8_AMAX_HISTORY_LEN";
inline constexpr const char kFp8AmaxComputeAlgo[] = "TANDEM_FP8_AMAX_COMPUTE_ALGO";
inline constexpr const char kFp8Margin[] = "TANDEM_FP8_MARGIN";
inline constexpr const char kFp8Interval[] = "TANDEM_FP8_INTERVAL";
inline constexpr const char kFp8Prefix[] = "TANDEM_FP8_";
// Written by the launcher itself for every rank.
inline constexpr const char kLauncher[] = "TANDEM_LAUNCHER";
inline constexpr const char kRestartCount[] = "TANDEM_RESTART_COUNT";
inline constexpr const char kErrorFile[] = "TANDEM_ERROR_FILE";
inline constexpr const char kHeartbeatFile[] = "TANDEM_HEARTBEAT_FILE";
inline constexpr const char kHeartbeatIntervalS[] = "TANDEM_HEARTBEAT_INTERVAL_S";
inline constexpr const char kCpuAffinity[] = "TANDEM_CPU_AFFINITY";
inline constexpr const char kLocalAddr[] = "TANDEM_LOCAL_ADDR";
inline constexpr const char kReplicaStore[] = "TANDEM_REPLICA_STORE";
inline constexpr const char kReplicas[] = "TANDEM_REPLICAS";
inline constexpr const char kReplicaTimeoutS[] = "TANDEM_REPLICA_TIMEOUT_S";
// Read by the CLI, and by the fault injection of the crash-consistency tests.
inline constexpr const char kConfigHome[] = "TANDEM_CONFIG_HOME";
inline constexpr const char kCheckpointCrash[] = "TANDEM_CHECKPOINT_CRASH";
inline constexpr const char kCheckpointCrashRank[] = "TANDEM_CHECKPOINT_CRASH_RANK";
}  // namespace var

/// What a variable holds (how resolve_run_config parses it).
enum class EnvKind {
  kBool,         ///< detail::parse_bool's words (Note [One vocabulary of booleans])
  kPositiveInt,  ///< 1, 2, ...
  kInt,          ///< a whole number
  kNumber,       ///< a number >= 0
  kChoice,       ///< one word of a fixed set (the reader names the set in its error)
  kText,         ///< free text (a path, a list)
};

/// Who acts on a variable.
enum class EnvReader {
  kRunConfig,     ///< config::resolve_run_config (the Accelerator and its parts)
  kProcessState,  ///< ProcessState::from_env (where the process stands in the job)
  kConfigSwitch,  ///< a process-level switch of the config part (config::fault_injection)
  kLauncher,      ///< the CLI and launcher themselves (config::default_config_path)
  kProgram,       ///< nothing in tandem: set for the user's program (or not acted on yet)
};

/// One row of the table.
struct EnvVar {
  const char* name;      ///< "TANDEM_GRADIENT_ACCUMULATION_STEPS"
  const char* key;       ///< the config-file key ("gradient_accumulation_steps"), "" when none
  const char* flag;      ///< the `tandem launch` flag ("--gradient_accumulation_steps"), "" when none
  EnvKind kind;
  EnvReader reader;
  bool written;          ///< `tandem launch` writes it (when its setting applies)
  const char* example;   ///< a valid value, for documentation and the table's tests
  const char* meaning;   ///< one line for docs and --help
};

/// Every TANDEM_* variable tandem knows, in the order of docs/launching.md.
const std::vector<EnvVar>& run_environment_table();

/// The row of `name`, or nullptr when the table has none.
const EnvVar* find_env_var(const std::string& name);

/// "TANDEM_ZERO_STAGE (config deepspeed_config.zero_stage, tandem launch --zero_stage)": the
/// variable and what sets it, for errors. A name without a row is returned as is.
std::string env_origin(const std::string& name);

/// "TANDEM_ZERO_STAGE='4' (config deepspeed_config.zero_stage, tandem launch --zero_stage)":
/// the variable, its value and what sets it, for errors.
std::string env_value_origin(const std::string& name, const std::string& value);

}  // namespace tandem::config
