// From flags and config file to what the launcher does: precedence (command line > config file >
// defaults), the checks that need several settings, and the TANDEM_* variables the program gets.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "tandem/comm/mesh.h"
#include "tandem/config/config.h"
#include "tandem/launch/launcher.h"

namespace tandem::launch {

/// The command-line flags that were given (CLI11's count() > 0), in order, as (config key, raw
/// text): ("num_processes", "4"), ("use_cpu", "true"), ("distributed_type", "FSDP") for
/// --use_fsdp, ("fsdp_config.fsdp_offload_params", "true"), ("deepspeed_config.zero_stage", "3").
using FlagValues = std::vector<std::pair<std::string, std::string>>;

/// What the launcher knows about this machine; injected so that resolution stays pure.
struct MachineInfo {
  int cuda_devices = 0;              ///< CUDA devices LibTorch sees (0 without CUDA)
  std::string cuda_visible_devices;  ///< the launcher's CUDA_VISIBLE_DEVICES, for messages
};

/// The merged configuration and what follows from it.
struct ResolvedLaunch {
  config::LaunchConfig config;
  /// NO, MULTI_CPU, MULTI_GPU, FSDP or DEEPSPEED: the value of TANDEM_DISTRIBUTED_TYPE.
  std::string distributed_type = "NO";
  int processes_per_machine = 1;
  /// True when the ranks use GPUs (not --cpu, and CUDA devices are visible).
  bool on_gpu = false;
  /// Things the user should know (a type tandem runs differently, a GPU config on a CPU machine).
  std::vector<std::string> notes;
};

/// The flag that sets a config key, for messages ("--num_processes", "--fsdp_offload_params").
std::string flag_for_key(const std::string& key);

/// Applies `flags` over `base` (a config file's settings, or defaults) and resolves what is left:
/// the distributed type (flags --multi_gpu/--use_fsdp/--use_deepspeed/--cpu, then the file,
/// then from the process count and devices), the number of processes (default: every visible
/// GPU, or 1), the checks of config::validate and the device count (check_device_count).
/// Throws std::invalid_argument naming the flag or key, the value and the fix.
ResolvedLaunch resolve_launch(const config::LaunchConfig& base, const FlagValues& flags,
                              const MachineInfo& machine);

/// The variables handed to every rank (besides RANK, WORLD_SIZE, ... from make_plan):
/// TANDEM_DISTRIBUTED_TYPE, TANDEM_MIXED_PRECISION, TANDEM_GRADIENT_ACCUMULATION_STEPS; and when
/// they apply TANDEM_USE_CPU=1, TANDEM_DEBUG=1, TANDEM_DOWNCAST_BF16=1, TANDEM_GPU_IDS with
/// CUDA_VISIBLE_DEVICES, TANDEM_ZERO_STAGE, TANDEM_OFFLOAD_OPTIMIZER_DEVICE,
/// TANDEM_OFFLOAD_PARAM_DEVICE, TANDEM_GRADIENT_CLIPPING, TANDEM_ZERO3_INIT_FLAG,
/// TANDEM_ZERO3_SAVE_16BIT_MODEL (DeepSpeed), TANDEM_FSDP_<KEY> (FSDP), TANDEM_FP8_<KEY> (fp8),
/// TANDEM_TP_SIZE, TANDEM_PP_SIZE, TANDEM_DP_REPLICATE_SIZE, TANDEM_DP_SHARD_SIZE (the
/// parallelism_config sizes that were set; comm::mesh_shape_from_environment).
/// TANDEM_ACTIVATION_CHECKPOINTING=true (fsdp_config.fsdp_activation_checkpointing: true).
EnvMap program_environment(const ResolvedLaunch& resolved);

/// The variables the launcher itself writes for every rank (RANK, WORLD_SIZE, MASTER_ADDR, ...,
/// TANDEM_RESTART_COUNT), each with the flag that sets it.
const std::vector<std::pair<std::string, std::string>>& launcher_variables();

/// Throws std::invalid_argument when `user_env` (--env KEY=VALUE) names one of
/// launcher_variables(), which the launcher would overwrite: the message names the flag to use.
void check_user_environment(const EnvMap& user_env);

/// The LaunchOptions of a resolved launch: processes on this machine, machines, address, port,
/// CPU, and extra_env = program_environment() overridden by `user_env` (--env KEY=VALUE; checked
/// by check_user_environment). Launcher-only settings (restarts, logging) are taken from
/// `launcher`.
LaunchOptions to_launch_options(const ResolvedLaunch& resolved, const EnvMap& user_env,
                                LaunchOptions launcher = {});

/// The device-count check of a GPU run: `processes_per_machine` ranks need as many visible GPUs.
/// `gpu_ids` ("", "all" or "0,2") picks the devices among `cuda_devices`. Throws
/// std::invalid_argument saying how many GPUs there are and what to change.
void check_device_count(int processes_per_machine, int cuda_devices, const std::string& gpu_ids,
                        const std::string& cuda_visible_devices = "");

/// Throws std::invalid_argument when `resolved` asks for a strategy tandem does not run yet
/// (parallel::unavailable_distributed_type_message, which the run configuration refuses from
/// TANDEM_DISTRIBUTED_TYPE too): it names what was asked for, where it came
/// from, and what runs instead. `tandem launch` calls it before starting (or describing) any rank,
/// so that nothing is accepted and then run as something else.
void check_strategy_available(const ResolvedLaunch& resolved);

/// The TANDEM_* variables of a mesh shape, as the launcher exports them (only the sizes that
/// are set; config::mesh_shape_from_env reads them back).
EnvMap mesh_shape_environment(const comm::MeshShape& shape);

/// The resolved configuration, one "key: value  (source)" line each, for --debug and --dry_run.
std::string describe_resolved(const ResolvedLaunch& resolved);

/// The address of this machine that traffic to `host` leaves from (the routing table's choice;
/// a UDP socket is connected, nothing is sent). "" when it cannot be found. Used to set
/// TANDEM_LOCAL_ADDR on multi-machine jobs so that Gloo listens on the right interface.
std::string local_address_for(const std::string& host, int port);

/// The CUDA devices LibTorch sees in this process (0 without CUDA).
int visible_cuda_devices();

}  // namespace tandem::launch
