// The table of TANDEM_* variables (run_env.h; Note [One table of variables]).
#include "tandem/config/run_env.h"

namespace tandem::config {

const std::vector<EnvVar>& run_environment_table() {
  using K = EnvKind;
  using R = EnvReader;
  // clang-format off
  static const std::vector<EnvVar> table = {
      {var::kDistributedType, "distributed_type", "--multi_gpu/--use_fsdp/--use_deepspeed", K::kChoice, R::kRunConfig, true, "MULTI_CPU",
       "NO, MULTI_CPU, MULTI_GPU, FSDP or DEEPSPEED"},
      {var::kMixedPrecision, "mixed_precision", "--mixed_precision", K::kChoice, R::kRunConfig, true, "bf16",
       "no, fp16, bf16, fp8, bf16-true or fp16-true"},
      {var::kGradientAccumulationSteps, "gradient_accumulation_steps", "--gradient_accumulation_steps", K::kPositiveInt, R::kRunConfig, true, "4",
       "micro-steps per optimizer step"},
      {var::kNumCpuThreads, "", "--num_cpu_threads_per_process", K::kPositiveInt, R::kRunConfig, true, "2",
       "LibTorch intra-op threads of each rank"},
      {var::kUseCpu, "use_cpu", "--cpu", K::kBool, R::kRunConfig, true, "1",
       "run on the CPU even when GPUs are visible"},
      {var::kNumMachines, "num_machines", "--num_machines", K::kPositiveInt, R::kRunConfig, true, "2",
       "machines in the job"},
      {var::kDebug, "debug", "--debug", K::kBool, R::kRunConfig, true, "1",
       "the main process prints the resolved run configuration"},
      {var::kDowncastBf16, "downcast_bf16", "--downcast_bf16", K::kBool, R::kRunConfig, true, "1",
       "bf16 runs hand fp32 metric results back as bf16"},
      {var::kDdpCommHook, "ddp_comm_hook", "--ddp_comm_hook", K::kChoice, R::kRunConfig, true, "bf16",
       "how gradient buckets travel: none, fp16 or bf16"},
      {var::kGradientAsBucketView, "gradient_as_bucket_view", "--gradient_as_bucket_view", K::kBool, R::kRunConfig, true, "1",
       "gradients live in the communication buckets"},
      {var::kGpuIds, "gpu_ids", "--gpu_ids", K::kText, R::kProgram, true, "0,1",
       "the GPUs chosen (CUDA_VISIBLE_DEVICES, also set, is what selects them)"},
      {var::kZeroStage, "deepspeed_config.zero_stage", "--zero_stage", K::kChoice, R::kRunConfig, true, "2",
       "ZeRO stage 0-3 (DeepSpeed; default 2)"},
      {var::kOffloadOptimizerDevice, "deepspeed_config.offload_optimizer_device", "--offload_optimizer_device", K::kChoice, R::kRunConfig, true, "cpu",
       "none, cpu or nvme (DeepSpeed; nvme: with offload_optimizer_nvme_path)"},
      {var::kOffloadOptimizerNvmePath, "deepspeed_config.offload_optimizer_nvme_path", "--offload_optimizer_nvme_path", K::kText, R::kRunConfig, true, "/local_nvme",
       "the directory the optimizer state's files live in under offload_optimizer_device nvme"},
      {var::kOffloadParamDevice, "deepspeed_config.offload_param_device", "--offload_param_device", K::kChoice, R::kRunConfig, true, "none",
       "none or cpu (DeepSpeed, stage 3)"},
      {var::kGradientClipping, "deepspeed_config.gradient_clipping", "--gradient_clipping", K::kNumber, R::kRunConfig, true, "1.0",
       "clip the gradients' norm to this before every optimizer step"},
      {var::kZero3InitFlag, "deepspeed_config.zero3_init_flag", "--zero3_init_flag", K::kBool, R::kRunConfig, true, "false",
       "checked, not acted on (DeepSpeed)"},
      {var::kZero3Save16bitModel, "deepspeed_config.zero3_save_16bit_model", "--zero3_save_16bit_model", K::kBool, R::kRunConfig, true, "false",
       "checked, not acted on (DeepSpeed)"},
      {var::kActivationCheckpointing, "fsdp_config.fsdp_activation_checkpointing", "--activation_checkpointing", K::kBool, R::kRunConfig, true, "true",
       "recompute checkpointed blocks' activations in backward, under any strategy"},
      {"TANDEM_FSDP_SHARDING_STRATEGY", "fsdp_config.fsdp_sharding_strategy", "--fsdp_sharding_strategy", K::kChoice, R::kRunConfig, true, "FULL_SHARD",
       "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2 (or 1-5)"},
      {"TANDEM_FSDP_OFFLOAD_PARAMS", "fsdp_config.fsdp_offload_params", "--fsdp_offload_params", K::kBool, R::kRunConfig, true, "true",
       "the optimizer step (and at FULL_SHARD the parameters) on the host"},
      {"TANDEM_FSDP_AUTO_WRAP_POLICY", "fsdp_config.fsdp_auto_wrap_policy", "--fsdp_auto_wrap_policy", K::kChoice, R::kRunConfig, true, "SIZE_BASED_WRAP",
       "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP"},
      {"TANDEM_FSDP_MIN_NUM_PARAMS", "fsdp_config.fsdp_min_num_params", "--fsdp_min_num_params", K::kInt, R::kRunConfig, true, "1000",
       "parameters a Sequential entry needs to become a unit"},
      {"TANDEM_FSDP_STATE_DICT_TYPE", "fsdp_config.fsdp_state_dict_type", "--fsdp_state_dict_type", K::kChoice, R::kRunConfig, true, "SHARDED_STATE_DICT",
       "FULL_STATE_DICT or SHARDED_STATE_DICT"},
      {"TANDEM_FSDP_BACKWARD_PREFETCH", "fsdp_config.fsdp_backward_prefetch", "--fsdp_backward_prefetch", K::kChoice, R::kRunConfig, true, "BACKWARD_PRE",
       "checked, not acted on"},
      {"TANDEM_FSDP_FORWARD_PREFETCH", "fsdp_config.fsdp_forward_prefetch", "--fsdp_forward_prefetch", K::kBool, R::kRunConfig, true, "false",
       "checked, not acted on"},
      {"TANDEM_FSDP_SYNC_MODULE_STATES", "fsdp_config.fsdp_sync_module_states", "--fsdp_sync_module_states", K::kBool, R::kRunConfig, true, "true",
       "checked, not acted on (rank 0's state is always broadcast)"},
      {"TANDEM_FSDP_CPU_RAM_EFFICIENT_LOADING", "fsdp_config.fsdp_cpu_ram_efficient_loading", "--fsdp_cpu_ram_efficient_loading", K::kBool, R::kRunConfig, true, "false",
       "checked, not acted on"},
      {"TANDEM_FSDP_USE_ORIG_PARAMS", "fsdp_config.fsdp_use_orig_params", "--fsdp_use_orig_params", K::kBool, R::kRunConfig, true, "true",
       "checked, not acted on"},
      {"TANDEM_FSDP_ACTIVATION_CHECKPOINTING", "fsdp_config.fsdp_activation_checkpointing", "--fsdp_activation_checkpointing", K::kBool, R::kRunConfig, true, "true",
       "activation checkpointing (TANDEM_ACTIVATION_CHECKPOINTING, when set, wins)"},
      {"TANDEM_FSDP_TRANSFORMER_LAYER_CLS_TO_WRAP", "fsdp_config.fsdp_transformer_layer_cls_to_wrap", "--fsdp_transformer_layer_cls_to_wrap", K::kText, R::kRunConfig, true, "Block",
       "ZeRO-3 units and checkpointed blocks: the TANDEM_MODULE types of these names"},
      {"TANDEM_FSDP_VERSION", "fsdp_config.fsdp_version", "--fsdp_version", K::kText, R::kRunConfig, true, "2",
       "accepted, not acted on"},
      {"TANDEM_FSDP_RESHARD_AFTER_FORWARD", "fsdp_config.fsdp_reshard_after_forward", "--fsdp_reshard_after_forward", K::kText, R::kRunConfig, true, "true",
       "accepted, not acted on"},
      {"TANDEM_FSDP_CPU_OFFLOAD", "fsdp_config.fsdp_cpu_offload", "", K::kText, R::kRunConfig, true, "false",
       "accepted, not acted on (fsdp_offload_params is tandem's switch)"},
      {var::kPpSize, "parallelism_config.pp_size", "--pp_size", K::kPositiveInt, R::kRunConfig, true, "2",
       "pipeline stages"},
      {var::kPpSchedule, "parallelism_config.pp_schedule", "--pp_schedule", K::kChoice, R::kRunConfig, true, "interleaved_1f1b",
       "pipeline schedule: gpipe, 1f1b, interleaved_1f1b or zero_bubble"},
      {var::kPpVirtualStages, "parallelism_config.pp_virtual_stages", "--pp_virtual_stages", K::kPositiveInt, R::kRunConfig, true, "2",
       "pipeline stages per rank (interleaved 1F1B)"},
      {var::kDpReplicateSize, "parallelism_config.parallelism_config_dp_replicate_size", "--dp_replicate_size", K::kPositiveInt, R::kRunConfig, true, "2",
       "data-parallel replicas of the mesh"},
      {var::kDpShardSize, "parallelism_config.parallelism_config_dp_shard_size", "--dp_shard_size", K::kPositiveInt, R::kRunConfig, true, "1",
       "data-parallel shards of the mesh"},
      {var::kTpSize, "parallelism_config.parallelism_config_tp_size", "--tp_size", K::kPositiveInt, R::kRunConfig, true, "2",
       "tensor-parallel ranks (within one machine)"},
      {var::kCpSize, "parallelism_config.parallelism_config_cp_size", "--cp_size", K::kPositiveInt, R::kRunConfig, true, "2",
       "context-parallel ranks: every sequence split over them"},
      {var::kEpSize, "parallelism_config.parallelism_config_ep_size", "--ep_size", K::kPositiveInt, R::kRunConfig, true, "2",
       "expert-parallel ranks: each mixture-of-experts layer's experts split over them (within dp)"},
      {var::kCpComm, "parallelism_config.parallelism_config_cp_comm_strategy", "--cp_comm_strategy", K::kChoice, R::kRunConfig, true, "alltoall",
       "context parallel keys/values: alltoall (ring), allgather or ulysses (heads by all-to-all)"},
      {"TANDEM_FP8_FORMAT", "fp8_config.fp8_format", "", K::kChoice, R::kRunConfig, true, "E4M3",
       "HYBRID or E4M3 (mixed_precision fp8)"},
      {"TANDEM_FP8_AMAX_HISTORY_LEN", "fp8_config.amax_history_len", "", K::kInt, R::kRunConfig, true, "16",
       "absolute maxima remembered per tensor"},
      {"TANDEM_FP8_AMAX_COMPUTE_ALGO", "fp8_config.amax_compute_algo", "", K::kChoice, R::kRunConfig, true, "max",
       "max or most_recent"},
      {"TANDEM_FP8_MARGIN", "fp8_config.margin", "", K::kInt, R::kRunConfig, true, "0",
       "headroom of the fp8 scale, as a power of 2"},
      {"TANDEM_FP8_INTERVAL", "fp8_config.interval", "", K::kInt, R::kRunConfig, true, "1",
       "forward passes between scale updates"},
      {"TANDEM_FP8_BACKEND", "fp8_config.backend", "", K::kText, R::kProgram, true, "TE",
       "accepted, not acted on (tandem's fp8 has one backend)"},
      {"TANDEM_FP8_OVERRIDE_LINEAR_PRECISION", "fp8_config.override_linear_precision", "", K::kText, R::kProgram, true, "false,false,false",
       "accepted, not acted on (Transformer Engine's option)"},
      {"TANDEM_FP8_USE_AUTOCAST_DURING_EVAL", "fp8_config.use_autocast_during_eval", "", K::kText, R::kProgram, true, "false",
       "accepted, not acted on (Transformer Engine's option)"},
      {"TANDEM_FP8_OPT_LEVEL", "fp8_config.opt_level", "", K::kText, R::kProgram, true, "O1",
       "accepted, not acted on (MS-AMP's option)"},
      {var::kReduceScatter, "", "", K::kChoice, R::kRunConfig, false, "allreduce",
       "how ZeRO stages 2 and 3 reduce a bucket: alltoall or allreduce (--env)"},
      {var::kTimeline, "", "", K::kText, R::kRunConfig, false, "/tmp/timeline",
       "write a per-rank Chrome-trace timeline into this folder (--env)"},
      {var::kProfile, "", "", K::kText, R::kRunConfig, false, "/tmp/profile",
       "each rank writes its memory and step-time profile to <this>.rank<r>.json when its Accelerator ends, for tandem plan (--env)"},
      {var::kPreemptionSignal, "", "--preemption_signal", K::kText, R::kRunConfig, true, "USR1",
       "a signal that, as SIGTERM, makes the ranks save a checkpoint and stop (Note [Preemption])"},
      {var::kHostAllocator, "", "", K::kBool, R::kRunConfig, false, "0",
       "tandem's host allocator serves large CPU blocks (default true; false: malloc serves every block) (--env)"},
      {var::kHostCacheMb, "", "", K::kNumber, R::kRunConfig, false, "64",
       "MB of freed large CPU blocks the host allocator keeps for reuse (default 32; 0 keeps none) (--env)"},
      {var::kLauncher, "", "", K::kBool, R::kProcessState, true, "1",
       "marks a rank that tandem launch started"},
      {var::kRestartCount, "", "--max_restarts", K::kInt, R::kProgram, true, "0",
       "restarts so far (0, 1, ...), for the program"},
      {var::kErrorFile, "", "", K::kText, R::kProcessState, true, "/tmp/errors/rank0",
       "the launcher's file for this rank's failure (Note [Secondary failures])"},
      {var::kHeartbeatFile, "", "--heartbeat_timeout_s", K::kText, R::kProcessState, true, "/tmp/tandem-launch-x/rank0.beat",
       "the file this rank's heartbeat rewrites (Note [Heartbeat])"},
      {var::kHeartbeatIntervalS, "", "--heartbeat_timeout_s", K::kNumber, R::kProcessState, true, "1",
       "seconds between two heartbeats (Note [Heartbeat])"},
      {var::kCpuAffinity, "enable_cpu_affinity", "--enable_cpu_affinity", K::kText, R::kProgram, true, "0,1",
       "the cores this rank is bound to (the launcher binds it), for the program"},
      {var::kLocalAddr, "", "", K::kText, R::kProcessState, true, "10.0.0.2",
       "the address Gloo listens on in a job of several machines"},
      {var::kReplicaStore, "", "--fault_tolerant_replicas", K::kText, R::kProcessState, true, "10.0.0.1:29501",
       "the store of the replicas' quorum, on machine 0's launcher (Note [Replica recovery])"},
      {var::kReplicas, "", "--fault_tolerant_replicas", K::kPositiveInt, R::kProcessState, true, "2",
       "the replicas (machines) a fault-tolerant job starts with"},
      {var::kReplicaTimeoutS, "", "--replica_timeout_s", K::kNumber, R::kProcessState, true, "30",
       "seconds a replica's gradient sum or vote may take before the others go on without it"},
      {"TANDEM_FORK_SERVER", "", "--start_method fork", K::kText, R::kLauncher, true, "3,4",
       "the fork server's spec and result pipes, in the one process a fork start execs (Note [Fork start])"},
      {var::kConfigHome, "", "", K::kText, R::kLauncher, false, "/tmp/tandem",
       "where `tandem config` writes and `tandem launch` looks for default_config.yaml"},
      {var::kCheckpointCrash, "", "", K::kText, R::kConfigSwitch, false, "after_files",
       "fault injection of the crash tests: SIGKILL at this point of save_state"},
      {var::kCheckpointCrashRank, "", "", K::kInt, R::kConfigSwitch, false, "0",
       "the rank TANDEM_CHECKPOINT_CRASH kills (default 0)"},
  };
  // clang-format on
  return table;
}

const EnvVar* find_env_var(const std::string& name) {
  for (const auto& v : run_environment_table())
    if (name == v.name) return &v;
  return nullptr;
}

namespace {

std::string setters(const EnvVar& v) {
  const std::string key = v.key, flag = v.flag;
  if (key.empty() && flag.empty()) return "";
  std::string s = " (";
  if (!key.empty()) s += "config " + key;
  if (!key.empty() && !flag.empty()) s += ", ";
  if (!flag.empty()) s += "tandem launch " + flag;
  return s + ")";
}

}  // namespace

std::string env_origin(const std::string& name) {
  const EnvVar* v = find_env_var(name);
  return v ? name + setters(*v) : name;
}

std::string env_value_origin(const std::string& name, const std::string& value) {
  const EnvVar* v = find_env_var(name);
  return name + "='" + value + "'" + (v ? setters(*v) : "");
}

}  // namespace tandem::config
