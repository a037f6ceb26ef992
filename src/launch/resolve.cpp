// Merging flags over the config file, resolving the distributed type and process count, the
// device-count check, and the TANDEM_* environment of the ranks.
#include "tandem/launch/resolve.h"
#include "tandem/error.h"
#include "../detail/env.h"
#include "tandem/comm/mesh.h"
#include "tandem/config/run_env.h"
#include "tandem/config/run_config.h"
#include "tandem/parallel/sharding_options.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>


#include <algorithm>
#include <cctype>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

namespace tandem::launch {
namespace {

using config::Source;

using ::tandem::detail::upper;

std::vector<int> gpu_id_list(const std::string& gpu_ids) {
  std::vector<int> ids;
  if (gpu_ids.empty() || gpu_ids == "all") return ids;
  std::stringstream ss(gpu_ids);
  std::string item;
  while (std::getline(ss, item, ',')) ids.push_back(std::stoi(item));
  return ids;
}

bool is_multi(const std::string& t) {
  return t != "NO";
}

const char* type_flag(const std::string& t) {
  if (t == "MULTI_GPU") return "--multi_gpu";
  if (t == "FSDP") return "--use_fsdp";
  if (t == "DEEPSPEED") return "--use_deepspeed";
  return "--distributed_type";
}

}  // namespace

std::string flag_for_key(const std::string& key) {
  if (key == "use_cpu") return "--cpu";
  if (key == "distributed_type") return "--multi_gpu/--use_fsdp/--use_deepspeed";
  auto dot = key.find('.');
  if (dot == std::string::npos) return "--" + key;
  std::string sub = key.substr(dot + 1);
  if (key.rfind("fsdp_config.", 0) == 0 && sub.rfind("fsdp_", 0) != 0) sub = "fsdp_" + sub;
  if (key.rfind("fp8_config.", 0) == 0 && sub.rfind("fp8_", 0) != 0) sub = "fp8_" + sub;
  if (key.rfind("parallelism_config.", 0) == 0 && sub.rfind("parallelism_config_", 0) == 0)
    sub = sub.substr(19);  // --tp_size sets parallelism_config.parallelism_config_tp_size
  return "--" + sub;
}

void check_device_count(int processes_per_machine, int cuda_devices, const std::string& gpu_ids,
                        const std::string& cuda_visible_devices) {
  const std::string visible_note =
      cuda_visible_devices.empty() ? "" : " (CUDA_VISIBLE_DEVICES=" + cuda_visible_devices + ")";
  const std::string have = std::to_string(cuda_devices) + " GPU" + (cuda_devices == 1 ? "" : "s") +
                           " visible" + visible_note;
  int usable = cuda_devices;
  auto ids = gpu_id_list(gpu_ids);
  if (!ids.empty()) {
    for (int id : ids)
      if (id >= cuda_devices)
        throw ::tandem::Refused("--gpu_ids " + gpu_ids + ": device " + std::to_string(id) +
                                    " does not exist; this "
                                    "machine has " +
                                    have +
                                    (cuda_devices > 0
                                         ? ", numbered 0 to " + std::to_string(cuda_devices - 1)
                                         : std::string()) +
                                    ". Pick devices from that range, or pass --gpu_ids all");
    usable = static_cast<int>(ids.size());
  }
  if (processes_per_machine > usable) {
    std::string which = ids.empty() ? have
                                    : std::to_string(usable) + " GPU" + (usable == 1 ? "" : "s") +
                                          " chosen by --gpu_ids " + gpu_ids + " (of " + have + ")";
    throw ::tandem::Refused(
        std::to_string(processes_per_machine) + " processes per machine need " +
        std::to_string(processes_per_machine) + " GPUs, one each, but there " +
        (usable == 1 ? "is " : "are ") + which + ". Start at most " + std::to_string(usable) +
        " processes per machine (--num_processes counts all machines), choose other devices "
        "with --gpu_ids, or pass --cpu to run on the CPU");
  }
}

ResolvedLaunch resolve_launch(const config::LaunchConfig& base, const FlagValues& flags,
                              const MachineInfo& machine) {
  ResolvedLaunch r;
  r.config = base;
  auto& c = r.config;
  std::vector<std::string> type_flags;
  bool cpu_flag = false;
  for (const auto& [key, value] : flags) {
    std::string origin = flag_for_key(key);
    if (key == "distributed_type") {
      origin = type_flag(upper(value));
      type_flags.push_back(origin);
    }
    if (key == "use_cpu") cpu_flag = true;
    config::set_value(c, key, value, Source::kCommandLine, origin);
  }
  if (type_flags.size() > 1)
    throw ::tandem::Refused(
        "only one of --multi_gpu, --use_fsdp, --use_deepspeed can be given "
        "(got " +
        type_flags[0] + " and " + type_flags[1] + ")");
  if (cpu_flag && c.use_cpu && !type_flags.empty() && type_flags[0] == "--multi_gpu")
    throw ::tandem::Refused(
        "--cpu and --multi_gpu contradict each other: pass --cpu to run "
        "on the CPU (MULTI_CPU), or --multi_gpu to use the GPUs");

  // A sharding flag without the flag that turns its strategy on would change nothing: refused,
  // naming both (the strategy may also come from the config file's distributed_type).
  for (const auto& [key, value] : flags) {
    const bool deepspeed = key.rfind("deepspeed_config.", 0) == 0 &&
                           key != "deepspeed_config.gradient_clipping" &&
                           key != "deepspeed_config.gradient_accumulation_steps";
    const bool fsdp =
        key.rfind("fsdp_config.", 0) == 0 && key != "fsdp_config.fsdp_activation_checkpointing";
    const std::string wanted = deepspeed ? "DEEPSPEED" : fsdp ? "FSDP" : "";
    if (wanted.empty() || c.distributed_type == wanted) continue;
    const std::string flag = flag_for_key(key);
    std::string needs = deepspeed ? "--use_deepspeed" : "--use_fsdp";
    std::string alternative;
    if (key == "deepspeed_config.zero_stage" && c.distributed_type == "FSDP") {
      alternative = " (under --use_fsdp, --fsdp_sharding_strategy sets the stage)";
    } else if (key == "deepspeed_config.zero_stage") {
      if (value == "3") alternative = " (or use --use_fsdp for FSDP's FULL_SHARD)";
      if (value == "2") alternative = " (or use --use_fsdp --fsdp_sharding_strategy SHARD_GRAD_OP)";
    } else if (key == "deepspeed_config.offload_optimizer_device") {
      alternative = " (or use --use_fsdp --fsdp_offload_params true)";
    } else if (key == "deepspeed_config.offload_param_device") {
      needs = "--use_deepspeed --zero_stage 3";
      alternative = " (or use --use_fsdp --fsdp_offload_params true)";
    } else if (key.rfind("deepspeed_config.zero3_", 0) == 0) {
      needs = "--use_deepspeed --zero_stage 3";
    } else if (key == "fsdp_config.fsdp_sharding_strategy") {
      alternative = " (or use --use_deepspeed --zero_stage N for ZeRO stage N)";
    }
    auto src = c.sources.find("distributed_type");
    const std::string t = c.distributed_type;
    const std::string from = src == c.sources.end()                ? ""
                             : src->second == Source::kCommandLine ? " from the command line"
                             : c.path.empty()                      ? ""
                                                                   : " from " + c.path;
    const bool plain = t == "NO" || t == "MULTI_CPU" || t == "MULTI_GPU";
    const std::string runs =
        plain ? "plain data parallel" + (from.empty() ? "" : " (distributed_type " + t + from + ")")
              : "distributed_type " + t + from;
    throw ::tandem::Refused(flag + " " + value + " needs " + needs + alternative +
                                ": without it the run is " + runs + ", where " + flag +
                                " would change nothing. Add " + needs + ", or leave out " + flag);
  }

  // A type tandem refuses is refused before anything else is resolved: the same answer as
  // `tandem config validate` gives, whatever else the file lacks.
  if (!parallel::unavailable_distributed_type_message(c.distributed_type).empty()) {
    ResolvedLaunch refused;
    refused.config = c;
    refused.distributed_type = c.distributed_type;
    check_strategy_available(refused);
  }
  // DATA_PARALLEL runs as plain data parallel (config::set_value noted it).
  std::string t = c.distributed_type;
  const auto& ours = config::tandem_distributed_types();
  if (std::find(ours.begin(), ours.end(), t) == ours.end()) t = "MULTI_GPU";
  const bool gpus_here = !c.use_cpu && machine.cuda_devices > 0;

  if (c.num_processes == -1)
    throw ::tandem::Refused(
        "num_processes is -1 in " + (c.path.empty() ? std::string("the configuration") : c.path) +
        ", which leaves it to the command line: pass --num_processes N (processes over all "
        "machines)");
  if (!c.given("num_processes")) {
    if (is_multi(t) && gpus_here) {
      auto ids = gpu_id_list(c.gpu_ids);
      int per_machine = ids.empty() ? machine.cuda_devices : static_cast<int>(ids.size());
      c.num_processes = per_machine * c.num_machines;
    } else if (is_multi(t) && c.given("distributed_type")) {
      throw ::tandem::Refused(
          "distributed_type " + c.distributed_type +
          " needs a number of processes, and none is "
          "set: pass --num_processes N (processes over all machines) or add num_processes to "
          "the config file");
    } else {
      c.num_processes = c.num_machines;
    }
  }
  const int total = c.num_processes;
  if (t == "MULTI_GPU" && c.use_cpu) {
    t = "MULTI_CPU";
  } else if (t == "MULTI_GPU" && machine.cuda_devices == 0) {
    t = "MULTI_CPU";
    r.notes.push_back("distributed_type " + c.distributed_type + ": no GPU is visible, so the " +
                      std::to_string(total) + " processes run on the CPU (MULTI_CPU)");
  }
  if (t == "NO" && total > 1) t = gpus_here ? "MULTI_GPU" : "MULTI_CPU";
  if ((t == "MULTI_CPU" || t == "MULTI_GPU") && total == 1) {
    if (!type_flags.empty() && type_flags[0] == "--multi_gpu")
      throw ::tandem::Refused(
          "--multi_gpu needs at least 2 processes, but --num_processes is "
          "1: pass --num_processes 2 or more, or leave out --multi_gpu");
    t = "NO";
  }
  config::validate(c);
  r.distributed_type = t;
  r.processes_per_machine = total / c.num_machines;
  r.on_gpu = gpus_here;
  if (r.on_gpu)
    check_device_count(r.processes_per_machine, machine.cuda_devices, c.gpu_ids,
                       machine.cuda_visible_devices);
  return r;
}

EnvMap program_environment(const ResolvedLaunch& r) {
  // Note [One table of variables]: every name written here has a row in config/run_env.h, read
  // back by config::resolve_run_config.
  namespace var = config::var;
  const auto& c = r.config;
  EnvMap env;
  env[var::kDistributedType] = r.distributed_type;
  env[var::kMixedPrecision] = c.mixed_precision;
  env[var::kGradientAccumulationSteps] = std::to_string(c.gradient_accumulation_steps);
  if (c.use_cpu) env[var::kUseCpu] = "1";
  if (c.num_machines > 1) env[var::kNumMachines] = std::to_string(c.num_machines);
  if (c.debug) env[var::kDebug] = "1";
  if (c.downcast_bf16) env[var::kDowncastBf16] = "1";
  if (c.ddp_comm_hook != "none") env[var::kDdpCommHook] = c.ddp_comm_hook;
  if (c.gradient_as_bucket_view) env[var::kGradientAsBucketView] = "1";
  if (!c.use_cpu && !c.gpu_ids.empty()) {
    env[var::kGpuIds] = c.gpu_ids;
    if (c.gpu_ids != "all") env["CUDA_VISIBLE_DEVICES"] = c.gpu_ids;
  }
  if (r.distributed_type == "DEEPSPEED") {
    auto get = [&](const std::string& k, const std::string& fallback) {
      auto it = c.deepspeed_config.find(k);
      return it == c.deepspeed_config.end() ? fallback : it->second;
    };
    env[var::kZeroStage] = get("zero_stage", "2");  // Accelerate's default stage
    env[var::kOffloadOptimizerDevice] = get("offload_optimizer_device", "none");
    env[var::kOffloadParamDevice] = get("offload_param_device", "none");
    if (auto p = get("offload_optimizer_nvme_path", "none"); p != "none" && !p.empty())
      env[var::kOffloadOptimizerNvmePath] = p;
    for (const auto& [k, name] : {std::pair{"gradient_clipping", var::kGradientClipping},
                                  std::pair{"zero3_init_flag", var::kZero3InitFlag},
                                  std::pair{"zero3_save_16bit_model", var::kZero3Save16bitModel}})
      if (c.deepspeed_config.count(k)) env[name] = c.deepspeed_config.at(k);
  } else if (c.deepspeed_config.count("gradient_clipping")) {
    env[var::kGradientClipping] = c.deepspeed_config.at("gradient_clipping");
  }
  // Activation checkpointing is not tied to FSDP in tandem (parallel/activation_checkpoint.h):
  // Accelerate's key asks for it under any strategy.
  if (auto it = c.fsdp_config.find("fsdp_activation_checkpointing");
      it != c.fsdp_config.end() && it->second == "true")
    env[var::kActivationCheckpointing] = "true";
  if (r.distributed_type == "FSDP") {
    env[std::string(var::kFsdpPrefix) + "SHARDING_STRATEGY"] = "FULL_SHARD";
    for (const auto& [k, v] : c.fsdp_config) env[var::kFsdpPrefix + upper(k.substr(5))] = v;
  }
  // The mesh sizes as set (config::resolve_run_config reads them back); validate() refused a
  // shape that does not fit the job before any rank started.
  for (const auto& [k, v] : mesh_shape_environment(config::mesh_shape(c))) env[k] = v;
  for (const auto& [key, name] : {std::pair{"pp_schedule", var::kPpSchedule},
                                  std::pair{"pp_virtual_stages", var::kPpVirtualStages},
                                  std::pair{"parallelism_config_cp_comm_strategy", var::kCpComm},
                                  std::pair{"parallelism_config_ep_size", var::kEpSize}})
    if (auto it = c.parallelism_config.find(key); it != c.parallelism_config.end())
      env[name] = it->second;
  if (c.mixed_precision == "fp8") {
    for (const auto& [k, v] : c.fp8_config) {
      std::string name = k.rfind("fp8_", 0) == 0 ? k.substr(4) : k;
      env[var::kFp8Prefix + upper(name)] = v;
    }
  }
  return env;
}

const std::vector<std::pair<std::string, std::string>>& launcher_variables() {
  // What make_plan and run() write for every rank, and how to choose each instead.
  static const std::vector<std::pair<std::string, std::string>> v = {
      {"RANK",
       "choose the ranks with --num_processes, --num_machines and --machine_rank (rank = "
       "machine_rank x processes per machine + local rank)"},
      {"WORLD_SIZE", "choose it with --num_processes (processes over all machines)"},
      {"LOCAL_RANK",
       "choose the local ranks with --num_processes (0 to processes per machine - 1)"},
      {"LOCAL_WORLD_SIZE", "choose it with --num_processes and --num_machines"},
      {"GROUP_RANK", "choose it with --machine_rank"},
      {"NODE_RANK", "choose it with --machine_rank"},
      {"MASTER_ADDR", "choose it with --main_process_ip"},
      {"MASTER_PORT", "choose it with --main_process_port"},
      {config::var::kNumCpuThreads, "choose it with --num_cpu_threads_per_process"},
      {config::var::kCpuAffinity, "choose it with --enable_cpu_affinity"},
      {config::var::kUseCpu, "choose it with --cpu"},
      {config::var::kPreemptionSignal,
       "choose it with --preemption_signal (which the launcher also forwards)"},
      {config::var::kLauncher, "it marks a rank that tandem launch started"},
      {config::var::kRestartCount, "it counts restarts (0, 1, ...; --max_restarts)"},
      {config::var::kErrorFile, "it is the launcher's own file for each rank's failure"},
      {config::var::kHeartbeatFile, "choose it with --heartbeat_timeout_s"},
      {config::var::kHeartbeatIntervalS, "choose it with --heartbeat_timeout_s"},
  };
  return v;
}

void check_user_environment(const EnvMap& user_env) {
  for (const auto& [name, hint] : launcher_variables()) {
    auto it = user_env.find(name);
    if (it == user_env.end()) continue;
    throw ::tandem::Refused("--env " + name + "=" + it->second + ": tandem launch sets " +
                                name + " for every rank itself and would replace this value; " +
                                hint + ", and pass --env only for other variables");
  }
}

LaunchOptions to_launch_options(const ResolvedLaunch& r, const EnvMap& user_env,
                                LaunchOptions launcher) {
  const auto& c = r.config;
  check_user_environment(user_env);
  EnvMap env = program_environment(r);
  for (const auto& [k, v] : launcher.extra_env()) env[k] = v;
  for (const auto& [k, v] : user_env) env[k] = v;
  launcher.num_processes(r.processes_per_machine)
      .num_machines(c.num_machines)
      .machine_rank(c.machine_rank)
      .main_process_ip(c.main_process_ip.empty() ? "127.0.0.1" : c.main_process_ip)
      .main_process_port(c.main_process_port)
      .cpu(c.use_cpu)
      .cpu_affinity(c.enable_cpu_affinity)
      .rdzv_backend(c.rdzv_backend)
      .extra_env(env);
  return launcher;
}

EnvMap mesh_shape_environment(const comm::MeshShape& shape) {
  EnvMap env;
  if (shape.pp) env[config::var::kPpSize] = std::to_string(shape.pp);
  if (shape.dp_replicate) env[config::var::kDpReplicateSize] = std::to_string(shape.dp_replicate);
  if (shape.dp_shard) env[config::var::kDpShardSize] = std::to_string(shape.dp_shard);
  if (shape.tp) env[config::var::kTpSize] = std::to_string(shape.tp);
  if (shape.cp) env[config::var::kCpSize] = std::to_string(shape.cp);
  return env;
}

void check_strategy_available(const ResolvedLaunch& r) {
  const auto& c = r.config;
  auto msg = parallel::unavailable_distributed_type_message(r.distributed_type);
  if (msg.empty()) msg = parallel::unavailable_distributed_type_message(c.distributed_type);
  if (msg.empty()) {
    // The sharding the ranks would run: refused here, before any process starts.
    auto env = program_environment(r);
    if (auto sharding = config::sharding_from_env(env)) {
      auto why = parallel::unsupported_sharding_message(*sharding);
      if (!why.empty())
        throw ::tandem::Refused("distributed_type " + r.distributed_type +
                                    (c.path.empty() ? "" : " (from " + c.path + ")") + ", " + why);
    }
    return;
  }
  auto src = c.sources.find("distributed_type");
  std::string from;
  if (src != c.sources.end() && src->second == Source::kCommandLine)
    from = " (from the command line)";
  else if (!c.path.empty())
    from = " (from " + c.path + ")";
  throw ::tandem::Refused(msg.insert(msg.find(" asks for"), from));
}

std::string describe_resolved(const ResolvedLaunch& r) {
  const auto& c = r.config;
  std::ostringstream os;
  os << "tandem launch configuration (config file: " << (c.path.empty() ? "none" : c.path)
     << "):\n";
  auto line = [&](const std::string& key, const std::string& value, const std::string& extra = "") {
    auto it = c.sources.find(key);
    Source s = it == c.sources.end() ? Source::kDefault : it->second;
    os << "  " << key << ": " << value << extra << "  [" << config::to_string(s) << "]\n";
  };
  line("compute_environment", c.compute_environment);
  line("distributed_type", r.distributed_type,
       c.distributed_type != r.distributed_type ? " (configured: " + c.distributed_type + ")" : "");
  line("num_processes", std::to_string(c.num_processes),
       " (" + std::to_string(r.processes_per_machine) + " on this machine)");
  line("num_machines", std::to_string(c.num_machines));
  line("machine_rank", std::to_string(c.machine_rank));
  line("main_process_ip", c.main_process_ip.empty() ? "127.0.0.1" : c.main_process_ip);
  line("main_process_port", std::to_string(c.main_process_port),
       c.main_process_port == 0 ? " (a free port)" : "");
  line("rdzv_backend", c.rdzv_backend);
  line("same_network", c.same_network ? "true" : "false");
  line("use_cpu", c.use_cpu ? "true" : "false",
       r.on_gpu ? " (ranks use GPUs)" : " (ranks use the CPU)");
  line("gpu_ids", c.gpu_ids.empty() ? "all" : c.gpu_ids);
  line("mixed_precision", c.mixed_precision);
  line("gradient_accumulation_steps", std::to_string(c.gradient_accumulation_steps));
  line("debug", c.debug ? "true" : "false");
  line("downcast_bf16", c.downcast_bf16 ? "true" : "false");
  for (const auto& [k, v] : c.fsdp_config) line("fsdp_config." + k, v);
  for (const auto& [k, v] : c.deepspeed_config) line("deepspeed_config." + k, v);
  for (const auto& [k, v] : c.fp8_config) line("fp8_config." + k, v);
  for (const auto& [k, v] : c.parallelism_config) line("parallelism_config." + k, v);
  if (!c.ignored.empty()) {
    os << "  ignored:";
    for (const auto& i : c.ignored) os << " " << i << ";";
    os << "\n";
  }
  for (const auto& n : r.notes) os << "  note: " << n << "\n";
  return os.str();
}

std::string local_address_for(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port > 0 ? port : 9);
  if (::getaddrinfo(host.c_str(), service.c_str(), &hints, &res) != 0 || !res) return "";
  std::string out;
  int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  // connect() on a UDP socket only asks the routing table for a source address: no packet.
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    char buf[INET_ADDRSTRLEN] = {0};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        ::inet_ntop(AF_INET, &local.sin_addr, buf, sizeof(buf)))
      out = buf;
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  return out;
}

}  // namespace tandem::launch
