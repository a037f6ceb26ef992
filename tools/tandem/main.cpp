// The `tandem` command line: launch, env, estimate-memory. Thin: the logic lives in src/.
#include <CLI/CLI.hpp>

#include <iostream>

#include "tandem/launch/launcher.h"
#include "tandem/version.h"
#include "estimate_memory_cmd.h"

namespace {

// Accelerate spells flags with underscores; accept dashes too.
std::string both(const std::string& name) {
  std::string dashed = name;
  std::replace(dashed.begin(), dashed.end(), '_', '-');
  return dashed == name ? "--" + name : "--" + name + ",--" + dashed;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tandem: distributed training for LibTorch"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("tandem ") + tandem::kVersion);

  // --- launch ---------------------------------------------------------------------------------
  auto* launch = app.add_subcommand("launch", "Start a program on N processes (and machines)");
  launch->prefix_command();  // everything after PROGRAM belongs to the program
  tandem::launch::LaunchOptions lo;
  int num_processes = 1, num_machines = 1, machine_rank = 0, port = 0, threads = 0,
      max_restarts = 0;
  std::string ip = "127.0.0.1", log_dir, rdzv = "static";
  bool cpu = false, tee = false, quiet = false, dry_run = false, debug = false;
  double monitor = 0.1, grace = 5.0;
  std::vector<std::string> env_kv;
  launch->add_option(both("num_processes"), num_processes, "Processes on this machine")
      ->group("Hardware")->check(CLI::PositiveNumber);
  launch->add_flag(both("cpu"), cpu, "Run on the CPU even when GPUs are visible")->group("Hardware");
  launch->add_option(both("num_cpu_threads_per_process"), threads,
                     "OMP and LibTorch threads per process (default: cores / processes)")
      ->group("Resources");
  launch->add_option(both("num_machines"), num_machines, "Machines in the job")->group("Distributed");
  launch->add_option(both("machine_rank"), machine_rank, "This machine's index, from 0")
      ->group("Distributed");
  launch->add_option(both("main_process_ip"), ip, "Address of machine 0")->group("Distributed");
  launch->add_option(both("main_process_port"), port, "Port of rank 0's store (default: a free one)")
      ->group("Distributed");
  launch->add_option(both("max_restarts"), max_restarts, "Restart every rank up to K times")
      ->group("Distributed");
  launch->add_option(both("monitor_interval"), monitor, "Seconds between health checks")
      ->group("Distributed");
  launch->add_option(both("rdzv_backend"), rdzv, "static or c10d")->group("Distributed");
  launch->add_option(both("grace_period"), grace, "Seconds between SIGTERM and SIGKILL")
      ->group("Distributed");
  launch->add_option(both("log_dir"), log_dir, "Write one log file per rank here")->group("Logging");
  launch->add_flag(both("tee"), tee, "With --log_dir: also print to the terminal")->group("Logging");
  launch->add_flag("-q," + both("quiet"), quiet, "Only the ranks' output")->group("Logging");
  launch->add_flag(both("debug"), debug, "Print the resolved configuration")->group("Logging");
  launch->add_flag(both("dry_run"), dry_run, "Print every rank's command and environment, then exit")
      ->group("Logging");
  launch->add_option(both("env"), env_kv, "KEY=VALUE for every rank (repeatable)")->group("Logging");
  std::vector<std::string> command;
  launch->add_option("command", command, "PROGRAM [ARGS...]")->required();

  // --- env ------------------------------------------------------------------------------------
  auto* env = app.add_subcommand("env", "Print what a bug report needs");

  // --- estimate-memory (flags and handler in estimate_memory_cmd.cpp) ----------------------------
  tandem::cli::EstimateMemoryCommand estimate_memory(app);

  CLI11_PARSE(app, argc, argv);

  if (estimate_memory.chosen()) return estimate_memory.run();

  try {
    if (*launch) {
      tandem::EnvMap extra;
      for (const auto& kv : env_kv) {
        auto eq = kv.find('=');
        if (eq == std::string::npos || eq == 0) {
          std::cerr << "tandem launch: --env '" << kv << "' is not KEY=VALUE\n";
          return 2;
        }
        extra[kv.substr(0, eq)] = kv.substr(eq + 1);
      }
      lo.num_processes(num_processes).num_machines(num_machines).machine_rank(machine_rank)
          .main_process_ip(ip).main_process_port(port).cpu(cpu).num_cpu_threads_per_process(threads)
          .extra_env(extra).max_restarts(max_restarts).monitor_interval_s(monitor)
          .grace_period_s(grace).log_dir(log_dir).tee(tee).quiet(quiet).rdzv_backend(rdzv);
      auto plan = tandem::launch::make_plan(lo, command, tandem::current_environment());
      if (dry_run || debug) std::cout << tandem::launch::describe_plan(plan) << std::flush;
      if (dry_run) return 0;
      return tandem::launch::run(std::move(plan), lo);
    }
    if (*env) {
      std::cout << tandem::environment_report();
      return 0;
    }
  } catch (const std::exception& e) {
    std::cerr << "tandem: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
