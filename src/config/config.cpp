// Accelerate-compatible configuration files: which keys exist, which tandem acts on, which it
// accepts and ignores, and the validation of every value.
#include "tandem/config/config.h"
#include "../detail/env.h"
#include "../detail/read_file.h"
#include "tandem/error.h"

#include "tandem/comm/mesh.h"
#include "tandem/config/run_env.h"
#include "tandem/parallel/cp_comm.h"
#include "tandem/parallel/schedule_kind.h"
#include "tandem/parallel/sharding_options.h"

#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

namespace tandem::config {
namespace {

using ::tandem::detail::lower;
using ::tandem::detail::parse_bool;
using ::tandem::detail::upper;

std::string trim(const std::string& s) {
  size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return "";
  size_t b = s.find_last_not_of(" \t\r\n");
  return s.substr(a, b - a + 1);
}

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

[[noreturn]] void bad(const std::string& origin, const std::string& value,
                      const std::string& expected) {
  throw ::tandem::Refused(origin + ": got '" + value + "', expected " + expected);
}

bool is_integer(const std::string& v) {
  size_t i = (!v.empty() && (v[0] == '-' || v[0] == '+')) ? 1 : 0;
  if (i >= v.size() || v.size() - i > 9) return false;
  for (; i < v.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(v[i]))) return false;
  return true;
}

int parse_int(const std::string& origin, const std::string& value, int min, int max,
              const std::string& expected) {
  const std::string v = trim(value);
  if (!is_integer(v)) bad(origin, value, expected);
  int n = std::stoi(v);
  if (n < min || n > max) bad(origin, value, expected);
  return n;
}

std::string one_of(const std::string& origin, const std::string& value,
                   const std::vector<std::string>& allowed, bool upper_case) {
  const std::string v = upper_case ? upper(trim(value)) : lower(trim(value));
  for (const auto& a : allowed)
    if (v == a) return a;
  bad(origin, value, "one of " + join(allowed, ", "));
}

const std::vector<std::string> kComputeEnvironments = {"LOCAL_MACHINE", "AMAZON_SAGEMAKER"};
const std::vector<std::string> kRdzvBackends = {"static", "c10d"};
const std::vector<std::string> kOffloadDevices = {"none", "cpu", "nvme"};
const std::vector<std::string> kAutoWrap = {"TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"};
const std::vector<std::string> kStateDict = {"FULL_STATE_DICT", "LOCAL_STATE_DICT",
                                             "SHARDED_STATE_DICT"};
const std::vector<std::string> kPrefetch = {"BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"};

// Accelerate's top-level keys (BaseConfig, ClusterConfig, SageMakerConfig, and the two legacy
// keys its process_config converts), split by what tandem does with them.
const std::set<std::string> kActedOn = {"compute_environment",
                                        "distributed_type",
                                        "mixed_precision",
                                        "use_cpu",
                                        "debug",
                                        "num_processes",
                                        "num_machines",
                                        "machine_rank",
                                        "main_process_ip",
                                        "main_process_port",
                                        "gpu_ids",
                                        "rdzv_backend",
                                        "same_network",
                                        "downcast_bf16",
                                        "enable_cpu_affinity",
                                        "main_training_function",
                                        "fsdp_config",
                                        "deepspeed_config",
                                        "fp8_config",
                                        "parallelism_config",
                                        "fp16",
                                        // tandem's own (LaunchConfig::ddp_comm_hook)
                                        "ddp_comm_hook",
                                        "gradient_as_bucket_view"};
const std::set<std::string> kIgnoredKeys = {
    // TPU pods
    "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm",
    "tpu_env",
    // other engines and launchers
    "megatron_lm_config", "dynamo_config", "dynamo_backend", "ipex_config", "mpirun_config",
    "tp_config",
    // Amazon SageMaker
    "ec2_instance_type", "iam_role_name", "image_uri", "profile", "region", "base_job_name",
    "pytorch_version", "transformers_version", "py_version", "sagemaker_inputs_file",
    "sagemaker_metrics_file", "additional_args"};
const std::set<std::string> kSections = {"fsdp_config", "deepspeed_config", "fp8_config",
                                         "parallelism_config"};

// deepspeed_config keys Accelerate's questionnaire and launcher know; tandem checks the first
// group and reports the second as ignored. Any other key is refused (a typo such as zero_stgae
// would otherwise leave the default stage running).
const std::vector<std::string> kDeepSpeedKeys = {"zero_stage",
                                                 "offload_optimizer_device",
                                                 "offload_param_device",
                                                 "offload_optimizer_nvme_path",
                                                 "gradient_accumulation_steps",
                                                 "gradient_clipping",
                                                 "zero3_init_flag",
                                                 "zero3_save_16bit_model"};
const std::vector<std::string> kDeepSpeedIgnoredKeys = {
    "deepspeed_config_file",        "offload_param_nvme_path",
    "deepspeed_hostfile",           "deepspeed_exclusion_filter",   "deepspeed_inclusion_filter",
    "deepspeed_multinode_launcher", "deepspeed_moe_layer_cls_names"};
// Every fsdp_config key Accelerate writes (FSDP1 and FSDP2), with its fsdp_ prefix.
const std::vector<std::string> kFsdpKeys = {"fsdp_sharding_strategy",
                                            "fsdp_offload_params",
                                            "fsdp_auto_wrap_policy",
                                            "fsdp_min_num_params",
                                            "fsdp_transformer_layer_cls_to_wrap",
                                            "fsdp_state_dict_type",
                                            "fsdp_backward_prefetch",
                                            "fsdp_forward_prefetch",
                                            "fsdp_sync_module_states",
                                            "fsdp_cpu_ram_efficient_loading",
                                            "fsdp_use_orig_params",
                                            "fsdp_activation_checkpointing",
                                            "fsdp_reshard_after_forward",
                                            "fsdp_version"};

// Levenshtein distance, for "did you mean" in the errors about unknown keys.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = up;
    }
  }
  return row[b.size()];
}

[[noreturn]] void unknown_key(const std::string& origin, const std::string& section,
                              const std::string& key, const std::vector<std::string>& known) {
  std::string closest;
  size_t best = std::string::npos;
  for (const auto& k : known) {
    const size_t d = edit_distance(lower(key), k);
    if (d < best) {
      best = d;
      closest = k;
    }
  }
  std::string msg = origin + ": '" + key + "' is not a key of " + section;
  if (best <= std::max<size_t>(2, closest.size() / 4)) msg += "; did you mean " + closest + "?";
  throw ::tandem::Refused(msg + " Expected one of " + join(known, ", "));
}

// A value that means "not used": such ignored keys are not worth a warning (Accelerate writes
// tpu_env: [], tpu_use_cluster: false, dynamo_config: {} into every file).
bool unset_value(const std::string& key, const std::string& v) {
  const std::string l = lower(trim(v));
  if (l.empty() || l == "false" || l == "null" || l == "~" || l == "[]" || l == "{}") return true;
  if ((key == "dynamo_backend" || key == "downcast_bf16") && l == "no") return true;
  if (key == "main_training_function" && l == "main") return true;
  return false;
}

void note_ignored(LaunchConfig& c, const std::string& entry) {
  if (std::find(c.ignored.begin(), c.ignored.end(), entry) == c.ignored.end())
    c.ignored.push_back(entry);
}

void set_fsdp(LaunchConfig& c, std::string key, const std::string& value,
              const std::string& origin) {
  const std::string written = key;
  if (key.rfind("fsdp_", 0) != 0) key = "fsdp_" + key;  // as Accelerate's launcher does
  if (std::find(kFsdpKeys.begin(), kFsdpKeys.end(), key) == kFsdpKeys.end())
    unknown_key(origin, "fsdp_config", written, kFsdpKeys);
  std::string v = trim(value);
  if (key == "fsdp_sharding_strategy") {
    const auto& names = fsdp_sharding_strategies();
    if (is_integer(v)) {
      int n = std::stoi(v);
      if (n < 1 || n > static_cast<int>(names.size()))
        bad(origin, value,
            "1-5 or a name (1 FULL_SHARD, 2 SHARD_GRAD_OP, 3 NO_SHARD, 4 "
            "HYBRID_SHARD, 5 HYBRID_SHARD_ZERO2)");
      v = names[static_cast<size_t>(n - 1)];
    } else {
      v = one_of(origin, value, names, true);
    }
  } else if (key == "fsdp_offload_params" || key == "fsdp_forward_prefetch" ||
             key == "fsdp_sync_module_states" || key == "fsdp_cpu_ram_efficient_loading" ||
             key == "fsdp_use_orig_params" || key == "fsdp_activation_checkpointing") {
    v = parse_bool(origin, value) ? "true" : "false";
  } else if (key == "fsdp_reshard_after_forward") {
    // FSDP2 takes a boolean; FSDP1 configs may name a sharding strategy here.
    std::string l = lower(v);
    if (l == "true" || l == "false" || l == "yes" || l == "no" || l == "1" || l == "0")
      v = parse_bool(origin, value) ? "true" : "false";
    else
      v = one_of(origin, value, fsdp_sharding_strategies(), true);
  } else if (key == "fsdp_auto_wrap_policy") {
    v = one_of(origin, value, kAutoWrap, true);
  } else if (key == "fsdp_state_dict_type") {
    v = one_of(origin, value, kStateDict, true);
  } else if (key == "fsdp_backward_prefetch") {
    std::string u = upper(v);
    v = (u == "NONE" || u == "NO") ? "NO_PREFETCH" : one_of(origin, value, kPrefetch, true);
  } else if (key == "fsdp_min_num_params") {
    v = std::to_string(parse_int(origin, value, 0, 1000000000, "a number of parameters >= 0"));
  } else if (key == "fsdp_version") {
    v = std::to_string(parse_int(origin, value, 1, 2, "1 or 2"));
  }
  c.fsdp_config[key] = v;
}

void set_deepspeed(LaunchConfig& c, const std::string& key, const std::string& value,
                   const std::string& origin) {
  std::string v = trim(value);
  if (key == "zero_stage") {
    v = std::to_string(parse_int(origin, value, 0, 3, "a ZeRO stage 0, 1, 2 or 3"));
  } else if (key == "offload_optimizer_device" || key == "offload_param_device") {
    v = one_of(origin, value, kOffloadDevices, false);
  } else if (key == "offload_optimizer_nvme_path") {
    if (v.empty()) bad(origin, value, "a directory for the optimizer state's files");
  } else if (key == "gradient_clipping") {
    char* end = nullptr;
    double d = std::strtod(v.c_str(), &end);
    if (v.empty() || end != v.c_str() + v.size() || !(d >= 0))
      bad(origin, value, "a gradient norm >= 0 such as 1.0");
  } else if (key == "zero3_init_flag" || key == "zero3_save_16bit_model") {
    v = parse_bool(origin, value) ? "true" : "false";
  } else if (std::find(kDeepSpeedIgnoredKeys.begin(), kDeepSpeedIgnoredKeys.end(), key) !=
             kDeepSpeedIgnoredKeys.end()) {
    if (!unset_value(key, v)) note_ignored(c, "deepspeed_config." + key + ": " + v);
    return;
  } else {
    std::vector<std::string> known = kDeepSpeedKeys;
    known.insert(known.end(), kDeepSpeedIgnoredKeys.begin(), kDeepSpeedIgnoredKeys.end());
    unknown_key(origin, "deepspeed_config", key, known);
  }
  c.deepspeed_config[key] = v;
}

// parallelism_config: Accelerate's parallelism_config_<name> keys (the prefix may be left out,
// as Accelerate's launcher adds it), plus tandem's pp_size, pp_schedule and pp_virtual_stages;
// cp_size and cp_comm_strategy (Note [Context parallel]); ep_size (Note [Expert parallel]).
void set_parallelism(LaunchConfig& c, std::string key, const std::string& value,
                     const std::string& origin) {
  const std::string prefix = "parallelism_config_";
  if (key.rfind(prefix, 0) == 0) key = key.substr(prefix.size());
  if (key == "dp_replicate_size" || key == "dp_shard_size" || key == "tp_size" ||
      key == "cp_size" || key == "ep_size" || key == "pp_size") {
    const int v = parse_int(origin, value, 1, 1 << 20, "a size >= 1");
    c.parallelism_config[key == "pp_size" ? key : prefix + key] = std::to_string(v);
  } else if (key == "pp_schedule") {
    c.parallelism_config[key] = parallel::to_string(parallel::schedule_from_name(trim(value), origin));
  } else if (key == "pp_virtual_stages") {
    c.parallelism_config[key] =
        std::to_string(parse_int(origin, value, 1, 1 << 10, "a number of stages per rank >= 1"));
  } else if (key == "cp_comm_strategy") {
    c.parallelism_config[prefix + key] =
        parallel::to_string(parallel::context_parallel_comm_from_name(trim(value), origin));
  } else if (key == "sp_size" || key == "sp_backend") {
    note_ignored(c, "parallelism_config." + prefix + key + ": " + trim(value) +
                        " (DeepSpeed's sequence parallel; its all-to-all of heads is cp_size with "
                        "cp_comm_strategy: ulysses)");
  } else {
    throw ::tandem::Refused(origin + ": unknown parallelism_config key '" + key +
                                "'; expected parallelism_config_dp_replicate_size, "
                                "parallelism_config_dp_shard_size, parallelism_config_tp_size, "
                                "parallelism_config_cp_size, parallelism_config_ep_size, "
                                "pp_size, pp_schedule or "
                                "pp_virtual_stages");
  }
}

std::string check_ip(const std::string& origin, const std::string& value) {
  std::string v = trim(value);
  bool ok = !v.empty() && v.size() < 254;
  for (char ch : v)
    ok = ok && (std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '-' ||
                ch == ':' || ch == '_');
  if (!ok) bad(origin, value, "an IP address or host name of machine 0, such as 10.0.0.1");
  return v;
}

std::string check_gpu_ids(const std::string& origin, const std::string& value) {
  std::string v = trim(value);
  if (lower(v) == "all") return "all";
  std::vector<std::string> out;
  std::set<int> seen;
  std::stringstream ss(v);
  std::string item;
  const std::string expected = "comma-separated device indices such as 0,1 or 'all'";
  if (v.empty()) bad(origin, value, expected);
  while (std::getline(ss, item, ',')) {
    item = trim(item);
    if (item.empty() || !is_integer(item) || item[0] == '-' || item[0] == '+')
      throw ::tandem::Refused(origin + ": the entry '" + item + "' of '" + value +
                                  "' is not a device index; expected " + expected);
    int id = std::stoi(item);
    if (!seen.insert(id).second)
      throw ::tandem::Refused(origin + ": device " + item + " appears twice in '" + value +
                                  "'; expected " + expected + ", each device once");
    out.push_back(std::to_string(id));
  }
  return join(out, ",");
}

// A YAML node as text: scalars as written, sequences joined by ','. Null is "".
std::string node_text(const YAML::Node& n) {
  if (!n || n.IsNull()) return "";
  if (n.IsScalar()) return n.Scalar();
  if (n.IsSequence()) {
    std::vector<std::string> items;
    for (const auto& e : n) items.push_back(node_text(e));
    return n.size() == 0 ? "[]" : join(items, ",");
  }
  return n.size() == 0 ? "{}" : "{...}";
}

std::string where(const YAML::Node& n) {
  auto m = n.Mark();
  if (m.line < 0) return "";
  return " (line " + std::to_string(m.line + 1) + ")";
}

}  // namespace

std::string to_string(Source source) {
  switch (source) {
    case Source::kDefault:
      return "default";
    case Source::kConfigFile:
      return "config file";
    case Source::kCommandLine:
      return "command line";
  }
  return "?";
}

const std::vector<std::string>& tandem_distributed_types() {
  static const std::vector<std::string> v = {"NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED"};
  return v;
}

const std::vector<std::string>& accelerate_distributed_types() {
  static const std::vector<std::string> v = {
      "NO",        "MULTI_CPU", "MULTI_GPU",   "FSDP",          "DEEPSPEED",     "MULTI_NPU",
      "MULTI_MLU", "MULTI_XPU", "MULTI_HPU",   "MULTI_SDAA",    "MULTI_MUSA",    "MULTI_NEURON",
      "XLA",       "TPU",       "MEGATRON_LM", "DATA_PARALLEL", "MODEL_PARALLEL"};
  return v;
}

const std::vector<std::string>& mixed_precision_values() {
  static const std::vector<std::string> v = {"no", "fp16", "bf16", "fp8", "bf16-true", "fp16-true"};
  return v;
}

const std::vector<std::string>& fsdp_sharding_strategies() {
  static const std::vector<std::string> v = [] {
    std::vector<std::string> names;
    for (const auto& s : parallel::fsdp_sharding_strategies()) names.push_back(s.name);
    return names;
  }();
  return v;
}

void set_value(LaunchConfig& c, const std::string& key, const std::string& value, Source source,
               const std::string& origin) {
  auto dot = key.find('.');
  if (dot != std::string::npos) {
    const std::string section = key.substr(0, dot), sub = key.substr(dot + 1);
    if (section == "fsdp_config") {
      set_fsdp(c, sub, value, origin);
      c.sources[sub.rfind("fsdp_", 0) == 0 ? key : "fsdp_config.fsdp_" + sub] = source;
    } else if (section == "deepspeed_config" && sub == "gradient_accumulation_steps") {
      set_value(c, "gradient_accumulation_steps", value, source, origin);
    } else if (section == "deepspeed_config") {
      set_deepspeed(c, sub, value, origin);
      if (c.deepspeed_config.count(sub)) c.sources[key] = source;
    } else if (section == "fp8_config") {
      c.fp8_config[sub] = trim(value);
      c.sources[key] = source;
    } else if (section == "parallelism_config") {
      set_parallelism(c, sub, value, origin);
      std::string name = sub.rfind("parallelism_config_", 0) == 0 ? sub.substr(19) : sub;
      c.sources["parallelism_config." +
                (name.rfind("pp_", 0) == 0 ? name : "parallelism_config_" + name)] =
          source;
    } else {
      throw ::tandem::Refused(origin + ": unknown section '" + section +
                                  "'; expected fsdp_config, deepspeed_config, fp8_config or "
                                  "parallelism_config");
    }
    return;
  }
  const std::string v = trim(value);
  if (key == "compute_environment") {
    c.compute_environment = one_of(origin, value, kComputeEnvironments, true);
    if (c.compute_environment != "LOCAL_MACHINE")
      note_ignored(c, "compute_environment: " + c.compute_environment +
                          " (tandem starts the job on this machine)");
  } else if (key == "distributed_type") {
    std::string t = one_of(origin, value, accelerate_distributed_types(), true);
    if (t == "TPU") t = "XLA";
    c.distributed_type = t;
    // Only DATA_PARALLEL (SageMaker's data parallel) runs as something else, as data parallel.
    // The device types tandem cannot drive (XLA, MULTI_XPU, ...) and the model-parallel ones
    // (MEGATRON_LM, MODEL_PARALLEL) are refused, by `tandem launch` and `tandem config validate`
    // alike (parallel::unavailable_distributed_type_message), never ignored.
    if (t == "DATA_PARALLEL")
      note_ignored(c, "distributed_type: " + t + " (runs as plain data parallel)");
  } else if (key == "mixed_precision") {
    c.mixed_precision = one_of(origin, value, mixed_precision_values(), false);
  } else if (key == "fp16") {  // Accelerate's legacy key
    if (parse_bool(origin, value) && !c.given("mixed_precision")) c.mixed_precision = "fp16";
    return;
  } else if (key == "use_cpu") {
    c.use_cpu = parse_bool(origin, value);
  } else if (key == "debug") {
    c.debug = parse_bool(origin, value);
  } else if (key == "downcast_bf16") {
    c.downcast_bf16 = parse_bool(origin, value);
  } else if (key == "same_network") {
    c.same_network = parse_bool(origin, value);
  } else if (key == "enable_cpu_affinity") {
    c.enable_cpu_affinity = parse_bool(origin, value);
  } else if (key == "main_training_function") {
    c.main_training_function = v;
    if (!unset_value(key, v)) note_ignored(c, "main_training_function: " + v);
  } else if (key == "num_processes") {
    if (v == "-1") {
      c.num_processes = -1;  // Accelerate's "pass --num_processes at launch time"
    } else {
      c.num_processes = parse_int(origin, value, 1, 1 << 20,
                                  "an integer of at least 1 (processes over all machines)");
    }
  } else if (key == "num_machines") {
    c.num_machines = parse_int(origin, value, 1, 1 << 20, "an integer of at least 1");
  } else if (key == "machine_rank") {
    c.machine_rank = parse_int(origin, value, 0, 1 << 20,
                               "an integer from 0 to num_machines - 1 (this machine's index)");
  } else if (key == "main_process_ip") {
    c.main_process_ip = check_ip(origin, value);
  } else if (key == "main_process_port") {
    c.main_process_port = parse_int(origin, value, 0, 65535,
                                    "a TCP port 1-65535 (or 0 to pick a free one on one machine)");
  } else if (key == "gpu_ids") {
    c.gpu_ids = check_gpu_ids(origin, value);
  } else if (key == "rdzv_backend") {
    c.rdzv_backend = one_of(origin, value, kRdzvBackends, false);
  } else if (key == "ddp_comm_hook") {
    c.ddp_comm_hook = one_of(origin, value, {"none", "fp16", "bf16"}, false);
  } else if (key == "gradient_as_bucket_view") {
    c.gradient_as_bucket_view = parse_bool(origin, value);
  } else if (key == "gradient_accumulation_steps") {
    c.gradient_accumulation_steps =
        parse_int(origin, value, 1, 1 << 30, "an integer of at least 1");
  } else if (kIgnoredKeys.count(key)) {
    if (!unset_value(key, v)) note_ignored(c, key);
    return;
  } else {
    throw ::tandem::Refused(origin + ": unknown setting '" + key + "'");
  }
  c.sources[key] = source;
}

LaunchConfig parse_config(const std::string& text, const std::string& path) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw ::tandem::Refused("config file " + path + " is not valid YAML: line " +
                                std::to_string(e.mark.line + 1) + ", column " +
                                std::to_string(e.mark.column + 1) + ": " + e.msg +
                                ". Fix the file, or write a new one with `tandem config`.");
  }
  if (!root || root.IsNull())
    throw ::tandem::Refused("config file " + path +
                                " is empty: expected a YAML map of "
                                "Accelerate's keys, e.g. `distributed_type: MULTI_CPU` and "
                                "`num_processes: 2`; `tandem config` writes one");
  if (!root.IsMap())
    throw ::tandem::Refused("config file " + path +
                                " is not a map of keys to values: "
                                "expected lines such as `num_processes: 2`");
  LaunchConfig c;
  c.path = path;
  std::vector<std::string> errors;
  std::vector<std::string> unknown;
  auto origin = [&](const std::string& key) { return "config file " + path + ", key " + key; };
  auto try_set = [&](const std::string& key, const YAML::Node& n) {
    try {
      if (n.IsMap())
        throw ::tandem::Refused(origin(key) + where(n) +
                                    ": got a map, expected a single value");
      std::string v = node_text(n);
      if (v.empty() && !kIgnoredKeys.count(key)) return;  // null: not set
      set_value(c, key, v, Source::kConfigFile, origin(key) + where(n));
    } catch (const std::invalid_argument& e) {
      errors.push_back(e.what());
    }
  };
  YAML::Node fp16;
  for (const auto& kv : root) {
    const std::string key = kv.first.as<std::string>();
    const YAML::Node& value = kv.second;
    if (!kActedOn.count(key) && !kIgnoredKeys.count(key)) {
      unknown.push_back(key);
      continue;
    }
    if (key == "fp16") {
      fp16 = value;
      continue;
    }
    if (kSections.count(key)) {
      if (!value || value.IsNull()) continue;
      if (!value.IsMap()) {
        errors.push_back(origin(key) + where(value) + ": got '" + node_text(value) +
                         "', expected a map of " + key.substr(0, key.find('_')) + " settings");
        continue;
      }
      for (const auto& sub : value) {
        const std::string skey = sub.first.as<std::string>();
        try {
          if (sub.second.IsMap())
            throw ::tandem::Refused(origin(key + "." + skey) + where(sub.second) +
                                        ": got a map, expected a single value");
          std::string v = node_text(sub.second);
          if (v.empty() || v == "[]") continue;
          set_value(c, key + "." + skey, v, Source::kConfigFile,
                    origin(key + "." + skey) + where(sub.second));
        } catch (const std::invalid_argument& e) {
          errors.push_back(e.what());
        }
      }
      continue;
    }
    if (kIgnoredKeys.count(key)) {
      std::string v = value.IsMap() ? (value.size() ? "{...}" : "{}") : node_text(value);
      if (!unset_value(key, v)) note_ignored(c, key);
      continue;
    }
    try_set(key, value);
  }
  if (fp16) try_set("fp16", fp16);
  if (!root["distributed_type"] || root["distributed_type"].IsNull())
    errors.push_back("config file " + path + ": distributed_type is missing; expected one of " +
                     join(tandem_distributed_types(), ", ") + " (Accelerate requires it too)");
  if (!unknown.empty()) {
    std::sort(unknown.begin(), unknown.end());
    errors.insert(errors.begin(),
                  "config file " + path +
                      " has keys that Accelerate does not know: " + join(unknown, ", ") +
                      ". Remove or rename them (`tandem config` writes a "
                      "valid file)");
  }
  if (!errors.empty()) {
    if (errors.size() == 1) throw ::tandem::Refused(errors.front());
    std::string msg =
        "config file " + path + " has " + std::to_string(errors.size()) + " problems:";
    for (const auto& e : errors) msg += "\n  - " + e;
    throw ::tandem::Refused(msg);
  }
  return c;
}

LaunchConfig load_config_file(const std::string& path) {
  const auto text = ::tandem::detail::read_file(path);
  if (!text)
    throw ::tandem::Refused("cannot read the config file " + path + ": " +
                                std::strerror(errno) +
                                ". Check the path, or write one with "
                                "`tandem config` (or `tandem config default`)");
  return parse_config(*text, path);
}

void validate(const LaunchConfig& c) {
  const std::string where = c.path.empty() ? "" : " (config file " + c.path + ")";
  if (c.machine_rank >= c.num_machines)
    throw ::tandem::Refused("machine_rank " + std::to_string(c.machine_rank) +
                                " is not below num_machines " + std::to_string(c.num_machines) +
                                where + ": machines are numbered 0 to " +
                                std::to_string(c.num_machines - 1) + "; fix --machine_rank");
  if (c.num_processes > 0 && c.num_processes % c.num_machines != 0)
    throw ::tandem::Refused(
        "num_processes " + std::to_string(c.num_processes) + " is not a multiple of num_machines " +
        std::to_string(c.num_machines) + where +
        ": num_processes counts the processes of all "
        "machines (as in Accelerate), the same number on each; e.g. --num_processes " +
        std::to_string(c.num_machines * std::max(1, c.num_processes / c.num_machines)));
  if (c.num_machines > 1) {
    if (c.main_process_ip.empty())
      throw ::tandem::Refused("main_process_ip is required with num_machines " +
                                  std::to_string(c.num_machines) + where +
                                  ": pass --main_process_ip with the address of machine 0");
    if (c.main_process_port == 0)
      throw ::tandem::Refused("main_process_port is required with num_machines " +
                                  std::to_string(c.num_machines) + where +
                                  ": pass --main_process_port with a free port on machine 0, "
                                  "the same on every machine (e.g. 29500)");
  }
  const auto shape = mesh_shape(c);
  if (!shape.empty() && c.num_processes > 0) {
    try {
      shape.resolve(c.num_processes, c.num_processes / c.num_machines);
    } catch (const std::invalid_argument& e) {
      throw ::tandem::Refused(std::string("parallelism_config") + where + ", " +
                                  std::to_string(c.num_processes) + " processes on " +
                                  std::to_string(c.num_machines) + " machine" +
                                  (c.num_machines == 1 ? "" : "s") + ": " + e.what() +
                                  " (--tp_size, --cp_size, --pp_size, --dp_replicate_size, --dp_shard_size)");
    }
  }
  // Note [Pipelines and ZeRO]: refused before any rank starts, naming both settings as given.
  if (shape.pp > 1) {
    auto from_flag = [&](const std::string& key) {
      auto it = c.sources.find(key);
      return it != c.sources.end() && it->second == Source::kCommandLine;
    };
    const std::string in_file = c.path.empty() ? "" : " in " + c.path;
    std::string zero;
    if (c.distributed_type == "DEEPSPEED") {
      auto st = c.deepspeed_config.find("zero_stage");
      const std::string stage = st == c.deepspeed_config.end() ? "2" : st->second;
      const std::string type = from_flag("distributed_type")
                                   ? "--use_deepspeed"
                                   : "distributed_type: DEEPSPEED" + in_file;
      if (stage != "0")
        zero = type + (!c.given("deepspeed_config.zero_stage") ? " (ZeRO stage 2, its default)"
                       : from_flag("deepspeed_config.zero_stage")
                           ? " --zero_stage " + stage
                           : " (deepspeed_config.zero_stage: " + stage + ")");
    } else if (c.distributed_type == "FSDP") {
      auto st = c.fsdp_config.find("fsdp_sharding_strategy");
      const std::string strategy = st == c.fsdp_config.end() ? "FULL_SHARD" : st->second;
      if (strategy != "NO_SHARD")
        zero = (from_flag("distributed_type") ? "--use_fsdp" : "distributed_type: FSDP" + in_file) +
               " (" + strategy + ")";
    }
    if (!zero.empty())
      throw ::tandem::Refused(
          (from_flag("parallelism_config.pp_size")
               ? "--pp_size " + std::to_string(shape.pp)
               : "parallelism_config.pp_size: " + std::to_string(shape.pp) + in_file) +
          " does not combine with " + zero +
          ": tandem's pipeline averages each stage's gradients over the data-parallel ranks "
          "itself, so a ZeRO stage has no place in it (DeepSpeed, too, refuses ZeRO-2/3 with "
          "pipeline parallel). Drop one of the two: run the pipeline with plain data parallel "
          "(no --use_deepspeed/--use_fsdp, or --zero_stage 0), or use ZeRO with --tp_size "
          "instead of --pp_size");
  }
  const bool sharded = c.distributed_type == "DEEPSPEED";
  if (sharded) {
    auto it = c.deepspeed_config.find("offload_param_device");
    auto st = c.deepspeed_config.find("zero_stage");
    if (it != c.deepspeed_config.end() && it->second != "none" &&
        (st == c.deepspeed_config.end() || st->second != "3"))
      throw ::tandem::Refused("deepspeed_config.offload_param_device " + it->second +
                                  " needs zero_stage 3 (parameters are sharded only there)" +
                                  where + "; set zero_stage: 3 or offload_param_device: none");
  }
}

comm::MeshShape mesh_shape(const LaunchConfig& c) {
  auto get = [&](const std::string& k) {
    auto it = c.parallelism_config.find(k);
    return it == c.parallelism_config.end() ? 0 : std::stoi(it->second);
  };
  comm::MeshShape s;
  s.pp = get("pp_size");
  s.dp_replicate = get("parallelism_config_dp_replicate_size");
  s.dp_shard = get("parallelism_config_dp_shard_size");
  s.tp = get("parallelism_config_tp_size");
  s.cp = get("parallelism_config_cp_size");
  return s;
}

std::string ignored_warning(const LaunchConfig& c) {
  if (c.ignored.empty()) return "";
  return "tandem: warning: " + std::string(c.path.empty() ? "the configuration" : c.path) +
         " has settings for things tandem does not do; they are ignored: " + join(c.ignored, ", ");
}

std::vector<std::string> not_acted_on(const LaunchConfig& c) {
  std::vector<std::string> out;
  auto value = [](const std::map<std::string, std::string>& m, const std::string& k) {
    auto it = m.find(k);
    return it == m.end() ? std::string() : it->second;
  };
  if (c.distributed_type == "FSDP") {
    // The value in each pair is what tandem does; any other value asks for something else.
    const std::vector<std::pair<std::string, std::string>> fsdp = {
        {"fsdp_sync_module_states", "true"},          // rank 0's parameters are broadcast
        {"fsdp_use_orig_params", "true"},             // the original parameters are kept
        {"fsdp_reshard_after_forward", "true"},       // a strategy name: fsdp_sharding_strategy decides
        {"fsdp_state_dict_type", "FULL_STATE_DICT"},  // checkpoints hold the whole model
    };
    for (const auto& [k, does] : fsdp) {
      const std::string v = value(c.fsdp_config, k);
      // FSDP2's reshard_after_forward: false keeps gathered units until their backward.
      if (k == "fsdp_reshard_after_forward" && v == "false") continue;
      if (!v.empty() && v != does) out.push_back("fsdp_config." + k + ": " + v);
    }
    // fsdp_transformer_layer_cls_to_wrap takes effect (ShardingOptions, Note [ZeRO-3 units on
    // hooks]).
  } else {
    // Only fsdp_activation_checkpointing acts outside FSDP (parallel/activation_checkpoint.h).
    for (const auto& [k, v] : c.fsdp_config)
      if (k != "fsdp_activation_checkpointing")
        out.push_back("fsdp_config." + k + ": " + v + " (distributed_type is " +
                      c.distributed_type + ", not FSDP)");
  }
  if (c.distributed_type == "DEEPSPEED") {
    // The model is built whole on every rank and saved in the dtype it trains in.
    for (const char* k : {"zero3_init_flag", "zero3_save_16bit_model"})
      if (value(c.deepspeed_config, k) == "true")
        out.push_back(std::string("deepspeed_config.") + k + ": true");
  } else {
    // gradient_clipping acts under every strategy (TANDEM_GRADIENT_CLIPPING).
    for (const auto& [k, v] : c.deepspeed_config)
      if (k != "gradient_clipping")
        out.push_back("deepspeed_config." + k + ": " + v + " (distributed_type is " +
                      c.distributed_type + ", not DEEPSPEED)");
  }
  if (c.given("same_network") && !c.same_network) out.push_back("same_network: false");
  return out;
}

std::string not_acted_on_warning(const LaunchConfig& c) {
  const auto keys = not_acted_on(c);
  if (keys.empty()) return "";
  return "tandem: warning: tandem accepts these settings but does not act on them yet; they "
         "change nothing in this run: " +
         join(keys, ", ");
}

namespace {

// PyYAML (Accelerate) reads these plain scalars as booleans, nulls or numbers: quote them.
bool needs_quotes(const std::string& s) {
  static const std::set<std::string> words = {"yes",  "no",    "on",   "off", "y", "n",
                                              "true", "false", "null", "~",   ""};
  if (words.count(lower(s))) return true;
  char* end = nullptr;
  std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size();
}

void emit_text(YAML::Emitter& out, const std::string& s, bool typed) {
  if (typed && (s == "true" || s == "false")) {
    out << (s == "true");
  } else if (typed && is_integer(s)) {
    out << std::stoll(s);
  } else if (typed && !s.empty() && [&] {
               char* end = nullptr;
               std::strtod(s.c_str(), &end);
               return end == s.c_str() + s.size();
             }()) {
    out << YAML::Node(s);  // a float, plain
  } else if (needs_quotes(s)) {
    out << YAML::SingleQuoted << s;
  } else {
    out << s;
  }
}

}  // namespace

std::string to_yaml(const LaunchConfig& c) {
  std::map<std::string, std::string> ds = c.deepspeed_config;
  if (c.gradient_accumulation_steps != 1 || c.distributed_type == "DEEPSPEED")
    ds["gradient_accumulation_steps"] = std::to_string(c.gradient_accumulation_steps);
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "compute_environment" << YAML::Value << c.compute_environment;
  if (c.ddp_comm_hook != "none") out << YAML::Key << "ddp_comm_hook" << YAML::Value << c.ddp_comm_hook;
  out << YAML::Key << "debug" << YAML::Value << c.debug;
  if (!ds.empty()) {
    out << YAML::Key << "deepspeed_config" << YAML::Value << YAML::BeginMap;
    for (const auto& [k, v] : ds) {
      out << YAML::Key << k << YAML::Value;
      emit_text(out, v, true);
    }
    out << YAML::EndMap;
  }
  out << YAML::Key << "distributed_type" << YAML::Value;
  emit_text(out, c.distributed_type, false);
  out << YAML::Key << "downcast_bf16" << YAML::Value << c.downcast_bf16;
  out << YAML::Key << "enable_cpu_affinity" << YAML::Value << c.enable_cpu_affinity;
  if (!c.fp8_config.empty()) {
    out << YAML::Key << "fp8_config" << YAML::Value << YAML::BeginMap;
    for (const auto& [k, v] : c.fp8_config) {
      out << YAML::Key << k << YAML::Value;
      emit_text(out, v, true);
    }
    out << YAML::EndMap;
  }
  if (!c.fsdp_config.empty()) {
    out << YAML::Key << "fsdp_config" << YAML::Value << YAML::BeginMap;
    for (const auto& [k, v] : c.fsdp_config) {
      out << YAML::Key << k << YAML::Value;
      emit_text(out, v, true);
    }
    out << YAML::EndMap;
  }
  if (c.gradient_as_bucket_view) out << YAML::Key << "gradient_as_bucket_view" << YAML::Value << true;
  if (!c.parallelism_config.empty()) {
    out << YAML::Key << "parallelism_config" << YAML::Value << YAML::BeginMap;
    // Sizes as numbers, pp_schedule as its name.
    for (const auto& [k, v] : c.parallelism_config) {
      out << YAML::Key << k << YAML::Value;
      if (!v.empty() && std::all_of(v.begin(), v.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); }))
        out << std::stoi(v);
      else
        out << v;
    }
    out << YAML::EndMap;
  }
  if (!c.gpu_ids.empty()) {
    out << YAML::Key << "gpu_ids" << YAML::Value;
    emit_text(out, c.gpu_ids, false);
  }
  out << YAML::Key << "machine_rank" << YAML::Value << c.machine_rank;
  if (!c.main_process_ip.empty())
    out << YAML::Key << "main_process_ip" << YAML::Value << c.main_process_ip;
  if (c.main_process_port != 0)
    out << YAML::Key << "main_process_port" << YAML::Value << c.main_process_port;
  out << YAML::Key << "main_training_function" << YAML::Value << c.main_training_function;
  out << YAML::Key << "mixed_precision" << YAML::Value;
  emit_text(out, c.mixed_precision, false);
  out << YAML::Key << "num_machines" << YAML::Value << c.num_machines;
  out << YAML::Key << "num_processes" << YAML::Value << c.num_processes;
  out << YAML::Key << "rdzv_backend" << YAML::Value << c.rdzv_backend;
  out << YAML::Key << "same_network" << YAML::Value << c.same_network;
  out << YAML::Key << "use_cpu" << YAML::Value << c.use_cpu;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string default_config_path(const EnvMap& env) {
  auto get = [&](const char* k) {
    auto it = env.find(k);
    return it == env.end() ? std::string() : it->second;
  };
  if (auto home = get(var::kConfigHome); !home.empty()) return home + "/default_config.yaml";
  if (auto xdg = get("XDG_CACHE_HOME"); !xdg.empty()) return xdg + "/tandem/default_config.yaml";
  std::string home = get("HOME");
  if (home.empty()) home = ".";
  return home + "/.cache/tandem/default_config.yaml";
}

LaunchConfig basic_config(int cuda_devices, const std::string& mixed_precision) {
  LaunchConfig c;
  set_value(c, "mixed_precision", mixed_precision, Source::kConfigFile, "--mixed_precision");
  set_value(c, "compute_environment", "LOCAL_MACHINE", Source::kConfigFile, "basic config");
  if (cuda_devices > 0) {
    c.num_processes = cuda_devices;
    c.use_cpu = false;
    c.distributed_type = cuda_devices > 1 ? "MULTI_GPU" : "NO";
    c.gpu_ids = "all";
  } else {
    c.num_processes = 1;
    c.use_cpu = true;
    c.distributed_type = "NO";
  }
  for (const char* k : {"num_processes", "use_cpu", "distributed_type"})
    c.sources[k] = Source::kConfigFile;
  return c;
}

void write_config_file(const std::string& path, const std::string& text) {
  // Create the parent folders one by one (mkdir -p).
  for (size_t pos = path.find('/', 1); pos != std::string::npos; pos = path.find('/', pos + 1)) {
    std::string dir = path.substr(0, pos);
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
      throw std::runtime_error("cannot create the folder " + dir + " for " + path + ": " +
                               std::strerror(errno));
  }
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream f(tmp);
    f << text;
    if (!f.flush())
      throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(errno) +
                               "; check that the folder is writable");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    throw std::runtime_error("cannot write " + path + ": " + why);
  }
}

std::string default_config_report(const EnvMap& env) {
  const std::string path = default_config_path(env);
  std::ifstream f(path);
  if (!f) return "Default config: none (" + path + " does not exist; `tandem config` writes it)\n";
  std::ostringstream os;
  os << "Default config: " << path << "\n";
  std::string line;
  while (std::getline(f, line)) os << "    " << line << "\n";
  return os.str();
}

}  // namespace tandem::config
