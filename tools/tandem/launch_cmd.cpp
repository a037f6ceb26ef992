// `tandem launch` and `tandem config`: flags in; merging, validation and the environment of the
// ranks live in tandem/launch/resolve.h and tandem/config/.
#include "launch_cmd.h"
#include "tandem/error.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <sstream>

#include "tandem/config/config.h"
#include "tandem/config/questionnaire.h"
#include "tandem/config/run_env.h"
#include "tandem/launch/launcher.h"
#include "tandem/launch/resolve.h"
#include "tandem/parallel/sharding_options.h"

#include "flag_names.h"
#include "full_cli.h"

namespace tandem::cli {
namespace {


bool file_exists(const std::string& path) {
  return ::access(path.c_str(), F_OK) == 0;
}

}  // namespace

CLI::Option* LaunchCommand::track(CLI::Option* option, const std::string& key, std::string* text,
                                  const std::string& fixed) {
  tracked_.push_back({option, key, text, fixed});
  return option;
}

LaunchCommand::LaunchCommand(CLI::App& app) {
  sub_ = app.add_subcommand("launch", "Start a program on N processes (and machines)");
  sub_->footer(
      "PROGRAM [ARGS...] follows the flags: the program every rank runs, with its own "
      "arguments (never read as tandem's flags).\n"
      "Settings come from the command line, then the config file (--config_file, else the "
      "default one written by `tandem config`), then defaults. --num_processes counts the "
      "processes of all machines, as in Accelerate. The program gets them as TANDEM_* "
      "variables (see docs/launching.md).\nExamples:\n"
      "  tandem launch --num_processes 4 --cpu ./train --epochs 3\n"
      "  tandem launch --config_file multi_cpu.yaml --mixed_precision bf16 ./train\n"
      "  tandem launch --num_machines 2 --machine_rank 1 --num_processes 8 \\\n"
      "      --main_process_ip 10.0.0.1 --main_process_port 29500 ./train");
  // A value option that sets config `key` when given.
  auto value = [&](const std::string& name, const std::string& key, const std::string& help,
                   const std::string& group) {
    texts_.emplace_back();
    return track(sub_->add_option(both(name), texts_.back(), help)->group(group), key,
                 &texts_.back());
  };
  // A switch that sets config `key` to `fixed` when given.
  auto flag = [&](const std::string& names, const std::string& key, const std::string& fixed,
                  const std::string& help, const std::string& group) {
    return track(sub_->add_flag(names, help)->group(group), key, nullptr, fixed);
  };
  sub_->add_option(both("config_file"), config_file_,
                   "YAML config (Accelerate's keys); default: the one `tandem config` wrote");

  const std::string hw = "Hardware", res = "Resources", dist = "Distributed", prec = "Precision",
                    shard = "Sharding", log = "Logging";
  flag(both("cpu"), "use_cpu", "true", "Run on the CPU even when GPUs are visible", hw);
  flag(both("multi_gpu"), "distributed_type", "MULTI_GPU", "Data parallel over several GPUs", hw);
  value("gpu_ids", "gpu_ids", "GPUs to use, by index (0,1,3) or all; sets CUDA_VISIBLE_DEVICES",
        hw);

  value("num_processes", "num_processes", "Processes over all machines (default: every GPU, or 1)",
        res);
  sub_->add_option(both("num_cpu_threads_per_process"), threads_,
                   "OMP and LibTorch threads per process (default: cores / processes)")
      ->group(res);
  flag(both("enable_cpu_affinity"), "enable_cpu_affinity", "true",
       "Bind each local process to its own cores (threads-per-process cores each)", res);
  sub_->add_option(both("env"), env_kv_, "KEY=VALUE for every rank (repeatable)")
      ->allow_extra_args(false)  // one value per --env: the program's name never becomes one
      ->group(res);

  value("num_machines", "num_machines", "Machines in the job", dist);
  value("machine_rank", "machine_rank", "This machine's index, from 0", dist);
  value("main_process_ip", "main_process_ip", "Address of machine 0", dist);
  value("main_process_port", "main_process_port",
        "Port of rank 0's store (default: a free one on one machine)", dist);
  flag(both("same_network"), "same_network", "true",
       "Machines share a local network (recorded; tandem's rendezvous is the same either way)",
       dist);
  value("rdzv_backend", "rdzv_backend",
        "static or c10d (with both, machines may start in any order)", dist);
  sub_->add_option(both("max_restarts"), max_restarts_, "Restart every rank up to K times")
      ->group(dist);
  sub_->add_option(both("min_processes"), min_processes_,
                   "Elastic: after ranks are lost (killed by a signal), restart on the ones that "
                   "remain while at least N do (needs --max_restarts)")
      ->group(dist);
  sub_->add_option(both("min_machines"), min_machines_,
                   "Elastic machines: before every attempt the machines meet (machine 0 hosts "
                   "it on --main_process_port + 1); run on those that came, at least N")
      ->group(dist);
  sub_->add_flag(both("fault_tolerant_replicas"), fault_tolerant_replicas_,
                 "Every machine is one replica of one process: a machine lost while the job runs "
                 "is dropped at the next step and the others go on; one started again joins at a "
                 "step boundary with the state of a live replica (machine 0 keeps the quorum on "
                 "--main_process_port + 1)")
      ->group(dist);
  sub_->add_option(both("replica_timeout_s"), replica_timeout_,
                   "Seconds a replica's gradient sum or vote may take before the others go on "
                   "without it (30)")
      ->group(dist);
  sub_->add_option(both("start_method"), start_method_,
                   "exec: every rank starts the program (default); fork: the program starts once "
                   "and forks its ranks after LibTorch has loaded, for an executable that links "
                   "libtandem (a rank then starts in a fraction of the time)")
      ->group(res);
  sub_->add_option(both("rdzv_timeout"), rdzv_timeout_,
                   "Seconds machine 0 waits for the other machines at each meeting (30)")
      ->group(dist);
  sub_->add_option(both("monitor_interval"), monitor_, "Seconds between health checks")
      ->group(dist);
  sub_->add_option(both("grace_period"), grace_, "Seconds between SIGTERM and SIGKILL")
      ->group(dist);
  sub_->add_option(both("preemption_signal"), preemption_signal_,
                   "A signal forwarded to every rank as SIGTERM is, for a checkpoint and a stop "
                   "(e.g. USR1 of SLURM's --signal=USR1@90)")
      ->group(dist);
  sub_->add_option(both("preemption_grace_s"), preemption_grace_,
                   "Seconds the ranks get to save and stop after SIGTERM or --preemption_signal, "
                   "before SIGKILL (30)")
      ->group(dist);
  sub_->add_option(both("heartbeat_timeout_s"), heartbeat_timeout_,
                   "End the job (or restart it under --max_restarts) when a rank stops running, "
                   "or waits in one collective, for this many seconds, naming it and its "
                   "collective; every rank's flight recorder dumps first (0: off)")
      ->group(dist);

  value("mixed_precision", "mixed_precision", "no, fp16, bf16, fp8, bf16-true or fp16-true", prec);
  flag(both("downcast_bf16"), "downcast_bf16", "true", "Store fp32 tensors as bf16 (bf16 runs)",
       prec);
  value("ddp_comm_hook", "ddp_comm_hook",
        "Gradient buckets travel as: none (fp32), fp16 or bf16 (compression)", dist);
  flag(both("gradient_as_bucket_view"), "gradient_as_bucket_view", "true",
       "Gradients live in the communication buckets (no copies)", dist);
  value("gradient_accumulation_steps", "gradient_accumulation_steps", "Batches per optimizer step",
        prec);

  flag(both("use_fsdp"), "distributed_type", "FSDP", "Fully sharded data parallel", shard);
  flag(both("use_deepspeed"), "distributed_type", "DEEPSPEED", "ZeRO sharding, DeepSpeed-style",
       shard);
  value("zero_stage", "deepspeed_config.zero_stage", "ZeRO stage 0-3 (with --use_deepspeed)",
        shard);
  value("offload_optimizer_device", "deepspeed_config.offload_optimizer_device",
        "none, cpu or nvme", shard);
  value("offload_optimizer_nvme_path", "deepspeed_config.offload_optimizer_nvme_path",
        "The directory for the optimizer state's files (--offload_optimizer_device nvme)", shard);
  value("offload_param_device", "deepspeed_config.offload_param_device",
        "none, cpu or nvme (ZeRO stage 3)", shard);
  value("gradient_clipping", "deepspeed_config.gradient_clipping", "Clip gradients to this norm",
        shard);
  value("zero3_init_flag", "deepspeed_config.zero3_init_flag", "true or false", shard);
  value("zero3_save_16bit_model", "deepspeed_config.zero3_save_16bit_model", "true or false",
        shard);
  flag(both("activation_checkpointing"), "fsdp_config.fsdp_activation_checkpointing", "true",
       "Recompute checkpointed blocks' activations in backward (fsdp_activation_checkpointing)",
       shard);
  for (const char* f :
       {"fsdp_sharding_strategy", "fsdp_offload_params", "fsdp_auto_wrap_policy",
        "fsdp_min_num_params", "fsdp_transformer_layer_cls_to_wrap", "fsdp_state_dict_type",
        "fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_sync_module_states",
        "fsdp_cpu_ram_efficient_loading", "fsdp_use_orig_params", "fsdp_activation_checkpointing",
        "fsdp_reshard_after_forward", "fsdp_version"}) {
    std::string help = std::string("FSDP: ") + (f + 5);
    if (std::string(f) == "fsdp_sharding_strategy")
      help = "1-5 or FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2";
    value(f, std::string("fsdp_config.") + f, help, shard);
  }

  const std::string mesh = "Device mesh (parallelism_config)";
  value("tp_size", "parallelism_config.parallelism_config_tp_size",
        "Tensor-parallel ranks (within one machine)", mesh);
  value("cp_size", "parallelism_config.parallelism_config_cp_size",
        "Context-parallel ranks: every sequence split over them (ring attention)", mesh);
  value("cp_comm_strategy", "parallelism_config.parallelism_config_cp_comm_strategy",
        "Context parallel keys/values: alltoall (ring, default) or allgather", mesh);
  value("ep_size", "parallelism_config.parallelism_config_ep_size",
        "Expert-parallel ranks: a mixture's experts split over them, within dp", mesh);
  value("pp_size", "parallelism_config.pp_size", "Pipeline stages", mesh);
  value("pp_schedule", "parallelism_config.pp_schedule",
        "Pipeline schedule: gpipe, 1f1b (default), interleaved_1f1b or zero_bubble", mesh);
  value("pp_virtual_stages", "parallelism_config.pp_virtual_stages",
        "Pipeline stages per rank (interleaved_1f1b; default 1)", mesh);
  value("dp_replicate_size", "parallelism_config.parallelism_config_dp_replicate_size",
        "Data-parallel replicas (derived when unset)", mesh);
  value("dp_shard_size", "parallelism_config.parallelism_config_dp_shard_size",
        "Data-parallel shards (derived when unset)", mesh);

  sub_->add_flag(both("tee"), tee_, "With --log_dir: also print to the terminal")->group(log);
  sub_->add_option(both("log_dir"), log_dir_, "Write one log file per rank here")->group(log);
  sub_->add_flag("-q," + both("quiet"), quiet_, "Only the ranks' output")->group(log);
  flag(both("debug"), "debug", "true",
       "Print the resolved configuration; TANDEM_DEBUG=1 for the program", log);
  sub_->add_flag(both("dry_run"), dry_run_,
                 "Print the configuration and every rank's command and environment, then exit")
      ->group(log);
  // PROGRAM [ARGS...] is cut off before parsing (split_program), so that the program's own flags
  // never meet the launcher's parser.
}

int LaunchCommand::split_program(int argc, char** argv) {
  int i = 1;
  while (i < argc && argv[i][0] == '-') ++i;  // global flags (--version, --help)
  if (i >= argc || std::string(argv[i]) != "launch") return argc;
  for (++i; i < argc; ++i) {
    std::string t = argv[i];
    if (t == "--") {
      command_.assign(argv + i + 1, argv + argc);
      return i;
    }
    if (t.size() > 1 && t[0] == '-') {
      if (t.find('=') != std::string::npos) continue;
      const CLI::Option* opt = sub_->get_option_no_throw(t);
      if (opt && opt->get_items_expected_min() > 0) ++i;  // the flag's value
      continue;
    }
    command_.assign(argv + i, argv + argc);
    return i;
  }
  return argc;
}

int LaunchCommand::run() {
  try {
    // What needs LibTorch comes first, before anything is printed (Note [A launcher without
    // LibTorch]): bin/tandem hands such a launch to the full command line at that point.
    if (min_machines_ > 0) needs_libtorch();  // the machines' rendezvous store
    if (fault_tolerant_replicas_) needs_libtorch();  // the replicas' store
    launch::FlagValues flags;
    bool cpu_flag = false;
    for (const auto& t : tracked_) {
      if (t.option->count() == 0) continue;
      flags.emplace_back(t.key, t.text ? *t.text : t.fixed);
      cpu_flag = cpu_flag || t.key == "use_cpu";
    }
    launch::MachineInfo machine;
    if (!cpu_flag) machine.cuda_devices = launch::visible_cuda_devices();

    const EnvMap environment = current_environment();
    config::LaunchConfig base;
    std::string path = config_file_;
    if (path.empty() && file_exists(config::default_config_path(environment)))
      path = config::default_config_path(environment);
    if (!path.empty()) base = config::load_config_file(path);
    if (auto w = config::ignored_warning(base); !w.empty()) std::cerr << w << "\n";
    if (auto it = environment.find("CUDA_VISIBLE_DEVICES"); it != environment.end())
      machine.cuda_visible_devices = it->second;
    auto resolved = launch::resolve_launch(base, flags, machine);
    launch::check_strategy_available(resolved);
    if (auto w = config::not_acted_on_warning(resolved.config); !w.empty()) std::cerr << w << "\n";
    if (!quiet_)
      for (const auto& n : resolved.notes) std::cerr << "tandem launch: note: " << n << "\n";

    EnvMap user_env;
    for (const auto& kv : env_kv_) {
      auto eq = kv.find('=');
      if (eq == std::string::npos || eq == 0)
        throw ::tandem::Refused("--env: got '" + kv + "', expected KEY=VALUE");
      user_env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    int threads = 0;
    if (!threads_.empty()) {
      size_t pos = 0;
      try {
        threads = std::stoi(threads_, &pos);
      } catch (const std::exception&) {
        pos = 0;
      }
      if (pos != threads_.size() || threads < 1)
        throw ::tandem::Refused("--num_cpu_threads_per_process: got '" + threads_ +
                                    "', expected an integer of at least 1");
    }
    launch::LaunchOptions lo;
    lo.max_restarts(max_restarts_)
        .min_processes(min_processes_)
        .min_machines(min_machines_)
        .fault_tolerant_replicas(fault_tolerant_replicas_)
        .replica_timeout_s(replica_timeout_)
        .rdzv_timeout_s(rdzv_timeout_)
        .start_method(start_method_)
        .monitor_interval_s(monitor_)
        .grace_period_s(grace_)
        .preemption_signal(preemption_signal_)
        .preemption_grace_s(preemption_grace_)
        .heartbeat_timeout_s(heartbeat_timeout_)
        .log_dir(log_dir_)
        .tee(tee_)
        .quiet(quiet_)
        .num_cpu_threads_per_process(threads);
    // Note [Gloo address]: on several machines every rank's Gloo device must listen on an
    // address the other machines reach. ProcessState reads GLOO_SOCKET_IFNAME or
    // TANDEM_LOCAL_ADDR for the process group; unless the user set one, use the address that routes to machine 0.
    const auto& c = resolved.config;
    auto has = [&](const char* k) { return environment.count(k) || user_env.count(k); };
    if (c.num_machines > 1 && !has("GLOO_SOCKET_IFNAME") && !has(config::var::kLocalAddr)) {
      std::string addr = launch::local_address_for(c.main_process_ip, c.main_process_port);
      if (!addr.empty())
        lo.extra_env({{config::var::kLocalAddr, addr}});
      else if (!quiet_)
        std::cerr << "tandem launch: warning: found no local address that reaches "
                  << c.main_process_ip << "; set GLOO_SOCKET_IFNAME (e.g. --env "
                  << "GLOO_SOCKET_IFNAME=eth0) if the ranks cannot connect\n";
    }
    lo = launch::to_launch_options(resolved, user_env, lo);
    auto plan = launch::make_plan(lo, command_, environment);
    if (dry_run_ || c.debug) std::cout << launch::describe_resolved(resolved);
    if (dry_run_ || c.debug) std::cout << launch::describe_plan(plan) << std::flush;
    if (dry_run_) return 0;
    return launch::run(std::move(plan), lo);
  } catch (const std::exception& e) {
    std::cerr << "tandem launch: " << e.what() << "\n";
    return 2;
  }
}

ConfigCommand::ConfigCommand(CLI::App& app) {
  sub_ = app.add_subcommand(
      "config",
      "Write the launch configuration by answering questions (or: default, show, validate)");
  sub_->footer(
      "The file uses Accelerate's keys; `tandem launch` reads it when no --config_file "
      "is given. Its place: $TANDEM_CONFIG_HOME/default_config.yaml, else "
      "~/.cache/tandem/default_config.yaml.");
  sub_->add_option(both("config_file"), file_, "Write here instead of the default place");
  sub_->require_subcommand(0, 1);
  default_ = sub_->add_subcommand("default",
                                  "Write a basic configuration for this machine, "
                                  "without questions");
  default_->add_option(both("mixed_precision"), mixed_precision_,
                       "no, fp16, bf16, fp8, bf16-true or fp16-true (default no)");
  default_->add_option(both("config_file"), default_file_,
                       "Write here instead of the default place");
  show_ = sub_->add_subcommand("show", "Print the configuration's path and contents");
  show_->add_option(both("config_file"), show_file_, "Show this file instead of the default one");
  validate_ = sub_->add_subcommand("validate", "Check a configuration file and summarize it");
  validate_->add_option("file", validate_file_, "The file (default: the default configuration)");
}

int ConfigCommand::run() {
  const EnvMap environment = current_environment();
  const std::string default_path = config::default_config_path(environment);
  auto pick = [&](const std::string& a) {
    if (!a.empty()) return a;
    return file_.empty() ? default_path : file_;
  };
  try {
    if (default_->parsed()) {
      const std::string path = pick(default_file_);
      if (file_exists(path)) {
        std::cerr << "tandem config default: a configuration already exists at " << path
                  << "; it is left as it is. Remove it first, or pass --config_file to write "
                     "elsewhere.\n";
        return 1;
      }
      auto cfg = config::basic_config(launch::visible_cuda_devices(), mixed_precision_);
      config::write_config_file(path, config::to_yaml(cfg));
      std::cout << "tandem configuration saved at " << path << "\n";
      return 0;
    }
    if (show_->parsed()) {
      const std::string path = pick(show_file_);
      std::ifstream f(path);
      if (!f) {
        std::cerr << "tandem config show: no configuration at " << path
                  << ": write one with `tandem config` or `tandem config default`\n";
        return 1;
      }
      std::cout << "Configuration file: " << path << "\n" << f.rdbuf();
      return 0;
    }
    if (validate_->parsed()) {
      const std::string path = pick(validate_file_);
      try {
        auto cfg = config::load_config_file(path);
        // What tandem launch refuses is invalid here too, with the same message and in the
        // same order: a type tandem does not run, the checks of several keys, the sharding.
        launch::ResolvedLaunch plan;
        plan.config = cfg;
        plan.distributed_type = cfg.distributed_type;
        if (!parallel::unavailable_distributed_type_message(cfg.distributed_type).empty())
          launch::check_strategy_available(plan);
        config::validate(cfg);
        launch::check_strategy_available(plan);
        if (auto w = config::ignored_warning(cfg); !w.empty()) std::cerr << w << "\n";
        if (auto w = config::not_acted_on_warning(cfg); !w.empty()) std::cerr << w << "\n";
        std::cout << path << " is valid: distributed_type " << cfg.distributed_type
                  << ", num_processes " << cfg.num_processes << ", num_machines "
                  << cfg.num_machines << ", mixed_precision " << cfg.mixed_precision
                  << (cfg.use_cpu ? ", CPU" : "") << "\n";
        return 0;
      } catch (const std::invalid_argument& e) {
        std::cerr << "tandem config validate: " << e.what() << "\n";
        return 1;
      }
    }
    // The questionnaire.
    if (!::isatty(0)) {
      std::cerr << "tandem config asks questions and needs a terminal. In scripts use `tandem "
                   "config default`, or write the YAML file yourself (docs/launching.md).\n";
      return 2;
    }
    const std::string path = pick("");
    const int cuda_devices = launch::visible_cuda_devices();  // before the first question
    std::cout << "tandem config: answer each question, or press Enter for the default in "
                 "brackets.\n";
    auto cfg = config::ask_config(std::cin, std::cout,
                                  config::QuestionnaireOptions().cuda_devices(cuda_devices));
    config::write_config_file(path, config::to_yaml(cfg));
    std::cout << "tandem configuration saved at " << path << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "tandem config: " << e.what() << "\n";
    return 2;
  }
}

}  // namespace tandem::cli
