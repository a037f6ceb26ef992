// The launch configuration file: Accelerate's keys (an Accelerate default_config.yaml works as
// is), parsed and validated with errors that name the key, the value and what is allowed.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "tandem/comm/mesh.h"
#include "tandem/state.h"

namespace tandem::config {

/// Where a setting's value came from; `tandem launch --debug` prints it next to the value.
enum class Source { kDefault, kConfigFile, kCommandLine };

/// "default", "config file", "command line".
std::string to_string(Source source);

/// A job's configuration under Accelerate's key names (ClusterConfig). Values are normalized:
/// mixed precision in lower case, distributed type in upper case, FSDP sharding strategy by
/// name, booleans as "true"/"false" inside the sections.
///
/// Example:
///   auto cfg = tandem::config::load_config_file("default_config.yaml");
///   tandem::config::validate(cfg);
///   std::cout << cfg.num_processes << " processes, " << cfg.mixed_precision << "\n";
struct LaunchConfig {
  std::string compute_environment = "LOCAL_MACHINE";
  /// As written: NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED, or a type tandem runs as plain data
  /// parallel (MULTI_NPU, XLA, MEGATRON_LM, ...; listed in `ignored`).
  std::string distributed_type = "NO";
  std::string mixed_precision = "no";  ///< no | fp16 | bf16 | fp8 | bf16-true | fp16-true
  bool use_cpu = false;
  /// Processes over all machines (Accelerate's meaning); -1: to be given on the command line.
  int num_processes = 1;
  int num_machines = 1;
  int machine_rank = 0;
  std::string main_process_ip;          ///< empty: 127.0.0.1 (one machine only)
  int main_process_port = 0;            ///< 0: a free port (one machine only)
  std::string gpu_ids;                  ///< empty (not set), "all", or indices "0,1,3"
  std::string rdzv_backend = "static";  ///< static | c10d
  bool same_network = true;
  bool debug = false;
  bool downcast_bf16 = false;
  bool enable_cpu_affinity = false;
  std::string main_training_function = "main";
  /// tandem's own keys (Accelerate's loader rejects a file that has them, so `tandem config`
  /// writes them only when they differ from the default): how gradient buckets travel (none,
  /// fp16, bf16) and whether gradients live in the buckets.
  std::string ddp_comm_hook = "none";
  bool gradient_as_bucket_view = false;
  /// deepspeed_config.gradient_accumulation_steps in the file (where Accelerate keeps it).
  int gradient_accumulation_steps = 1;
  /// fsdp_config, every key with its fsdp_ prefix (as Accelerate's launcher adds it).
  std::map<std::string, std::string> fsdp_config;
  /// deepspeed_config except gradient_accumulation_steps (zero_stage, offload_*, ...).
  std::map<std::string, std::string> deepspeed_config;
  /// parallelism_config: the mesh sizes under Accelerate's key names
  /// (parallelism_config_dp_replicate_size, parallelism_config_dp_shard_size,
  /// parallelism_config_tp_size) and tandem's pp_size; only the sizes that were set.
  std::map<std::string, std::string> parallelism_config;
  /// fp8_config as written (backend, fp8_format, amax_history_len, ...); lists joined by ','.
  std::map<std::string, std::string> fp8_config;
  /// Settings tandem accepts but does not act on (TPU, SageMaker, dynamo, Megatron-LM, ...), as
  /// "key" or "key: value"; reported in one warning (ignored_warning).
  std::vector<std::string> ignored;
  /// The keys that were set ("num_processes", "fsdp_config.fsdp_offload_params", ...) and from
  /// where; keys absent here hold their defaults.
  std::map<std::string, Source> sources;
  /// The file this configuration was read from ("" when none).
  std::string path;

  /// True when `key` was set by a config file or on the command line.
  bool given(const std::string& key) const { return sources.count(key) > 0; }
};

/// Sets one setting from its text, validating it. `key` is a top-level key ("num_processes")
/// or "<section>.<key>" for fsdp_config, deepspeed_config and fp8_config. `origin` names where
/// the value came from in the error ("--num_processes", "config file x.yaml, key
/// num_processes"). Throws std::invalid_argument naming the origin, the value and what is
/// allowed. Keys tandem accepts without acting on them go to `ignored`.
void set_value(LaunchConfig& config, const std::string& key, const std::string& value,
               Source source, const std::string& origin);

/// Parses a configuration from YAML text. `path` is used in messages. Throws
/// std::invalid_argument with every problem found: malformed YAML (with line and column),
/// every key that Accelerate does not know, every bad value.
LaunchConfig parse_config(const std::string& yaml_text, const std::string& path = "<config>");

/// Reads and parses a configuration file (parse_config). Throws std::invalid_argument when the
/// file cannot be read, saying how to create one.
LaunchConfig load_config_file(const std::string& path);

/// Checks what needs several keys together: machine_rank < num_machines, num_processes a
/// multiple of num_machines, main_process_ip and main_process_port with several machines, and
/// parallelism_config's sizes against num_processes (comm::MeshShape::resolve: the product is
/// the world, tp within one machine).
/// Throws std::invalid_argument naming the keys, their values and the fix.
void validate(const LaunchConfig& config);

/// The mesh sizes of parallelism_config (unset sizes 0; comm::MeshShape::resolve fills them).
comm::MeshShape mesh_shape(const LaunchConfig& config);

/// The one warning about ignored settings ("" when there are none).
std::string ignored_warning(const LaunchConfig& config);

/// Settings tandem checks but does not act on yet, whose value asks for something tandem does
/// not do, as "section.key: value": fsdp_forward_prefetch true, fsdp_backward_prefetch other
/// than NO_PREFETCH, fsdp_cpu_ram_efficient_loading true, fsdp_sync_module_states or
/// fsdp_use_orig_params false, fsdp_reshard_after_forward other than true, fsdp_state_dict_type
/// other than FULL_STATE_DICT, fsdp_transformer_layer_cls_to_wrap (FSDP); zero3_init_flag and
/// zero3_save_16bit_model true (DeepSpeed); the keys of fsdp_config / deepspeed_config under
/// another distributed_type (except fsdp_activation_checkpointing and gradient_clipping, which
/// act under every type); same_network false.
std::vector<std::string> not_acted_on(const LaunchConfig& config);

/// The one warning line naming not_acted_on(config) ("" when there are none).
std::string not_acted_on_warning(const LaunchConfig& config);

/// The configuration as YAML with Accelerate's keys, readable by `accelerate launch` too.
std::string to_yaml(const LaunchConfig& config);

/// Where `tandem config` writes and `tandem launch` looks: $TANDEM_CONFIG_HOME/default_config.yaml,
/// else $XDG_CACHE_HOME/tandem/default_config.yaml, else ~/.cache/tandem/default_config.yaml.
std::string default_config_path(const EnvMap& env);

/// The configuration `tandem config default` writes: one machine, all of its GPUs (MULTI_GPU
/// when more than one), else one CPU process.
LaunchConfig basic_config(int cuda_devices, const std::string& mixed_precision = "no");

/// Writes `text` to `path` atomically, creating the parent folders. Throws std::runtime_error.
void write_config_file(const std::string& path, const std::string& text);

/// For `tandem env`: the default config's path and contents, or "none".
std::string default_config_report(const EnvMap& env);

/// `tandem env`, what a bug report needs: tandem and LibTorch versions, CUDA and its devices,
/// NCCL and Gloo, CPU count, BLAS, memory, OS, and the default launch config (path and
/// contents, or "none"). One "key: value" per line.
std::string environment_report();

/// The tandem distributed types (the values of TANDEM_DISTRIBUTED_TYPE).
const std::vector<std::string>& tandem_distributed_types();

/// Every distributed_type value Accelerate knows.
const std::vector<std::string>& accelerate_distributed_types();

/// Every mixed_precision value tandem accepts.
const std::vector<std::string>& mixed_precision_values();

/// FSDP sharding strategies by number (1-5), as Accelerate numbers them.
const std::vector<std::string>& fsdp_sharding_strategies();

}  // namespace tandem::config
