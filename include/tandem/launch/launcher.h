// Starting the local ranks of a job and supervising them: environment per rank, output
// prefixed by rank, fail-fast when one rank fails, signals forwarded, restarts.
#pragma once

#include "tandem/runtime.h"

#include <torch/arg.h>

#include <map>
#include <string>
#include <vector>

#include "tandem/state.h"

namespace tandem::launch {

/// What `tandem launch` was asked to do, after flags and config file are merged.
///
/// Example:
///   auto opts = tandem::launch::LaunchOptions().num_processes(2).cpu(true);
///   auto plan = tandem::launch::make_plan(opts, {"./train"}, tandem::current_environment());
///   int rc = tandem::launch::run(plan, opts);
struct LaunchOptions {
  TORCH_ARG(int, num_processes) = 1;  ///< processes on this machine
  TORCH_ARG(int, num_machines) = 1;
  TORCH_ARG(int, machine_rank) = 0;
  TORCH_ARG(std::string, main_process_ip) = "127.0.0.1";
  TORCH_ARG(int, main_process_port) = 0;  ///< 0: pick a free port (single machine only)
  TORCH_ARG(bool, cpu) = false;
  /// OMP_NUM_THREADS and LibTorch's intra-op threads per rank. 0: OMP_NUM_THREADS when --env or
  /// the launcher's environment sets it (the user's choice is kept), else
  /// default_threads_per_process(): the cores this launcher may use (its affinity mask) divided
  /// by the local processes, at most what LibTorch takes by itself (Note [Threads per rank]).
  TORCH_ARG(int, num_cpu_threads_per_process) = 0;
  /// Bind each local rank to its own cores (sched_setaffinity before exec): local rank k gets
  /// the k-th run of threads-per-process cores of the launcher's affinity mask, so that the
  /// ranks' OpenMP pools never share a core (--enable_cpu_affinity, config enable_cpu_affinity).
  TORCH_ARG(bool, cpu_affinity) = false;
  /// Extra environment for every rank (--env KEY=VALUE), and settings handed to the program as
  /// TANDEM_* variables (mixed precision, gradient accumulation, sharding, ...).
  TORCH_ARG(EnvMap, extra_env) = {};
  /// Seconds between SIGTERM and SIGKILL when the other ranks are stopped.
  TORCH_ARG(double, grace_period_s) = 5.0;
  /// Note [Preemption]: a signal that, as SIGTERM, the launcher forwards to every rank for a
  /// checkpoint and a stop (--preemption_signal USR1; TANDEM_PREEMPTION_SIGNAL to the ranks);
  /// empty: SIGTERM alone.
  TORCH_ARG(std::string, preemption_signal) = "";
  /// Seconds the ranks get after a forwarded SIGTERM or preemption signal to save and exit,
  /// before SIGKILL (--preemption_grace_s); keep it below the cluster's own grace period.
  TORCH_ARG(double, preemption_grace_s) = 30.0;
  /// Note [Heartbeat]: a rank that stops running, or waits in one collective, for longer than
  /// this many seconds ends the job (restarted under max_restarts), named with its collective;
  /// every rank's flight recorder is asked for its dump first (--heartbeat_timeout_s). 0: off.
  /// Keep it well below the collectives' timeout and above the longest collective.
  TORCH_ARG(double, heartbeat_timeout_s) = 0.0;
  TORCH_ARG(int, max_restarts) = 0;
  /// Elastic on one machine (--min_processes): when ranks are lost (killed by a signal: the
  /// out-of-memory killer, kill -9, a crash), a restart runs on the processes that remain while
  /// at least this many do, instead of the full count; the program resumes from its latest
  /// checkpoint on the smaller world (AcceleratorOptions().auto_resume). 0: every restart runs
  /// num_processes ranks. Needs max_restarts >= 1.
  TORCH_ARG(int, min_processes) = 0;
  /// Elastic across machines (--min_machines): before every attempt the machines' launchers
  /// meet (machine 0 hosts the meeting on main_process_port + 1) and the attempt runs on the
  /// machines that came, while at least this many did (Note [Elastic machines]); a lost
  /// machine's launcher never comes again. 0: a fixed set of machines.
  TORCH_ARG(int, min_machines) = 0;
  /// Note [Replica recovery] (--fault_tolerant_replicas): every machine is one replica of one
  /// process; a machine lost while the job runs is dropped at the next step and the others go
  /// on; a machine started again joins them at a step boundary. Machine 0's launcher hosts the
  /// replicas' store on main_process_port + 1.
  TORCH_ARG(bool, fault_tolerant_replicas) = false;
  /// Seconds a replica's gradient sum or vote may take before the others go on without it
  /// (--replica_timeout_s).
  TORCH_ARG(double, replica_timeout_s) = 30.0;
  /// How long machine 0 waits for the other machines at each meeting (--rdzv_timeout).
  TORCH_ARG(double, rdzv_timeout_s) = 30.0;
  /// Note [Fork start] (--start_method): "exec", every rank starts the program by itself; or
  /// "fork", the program starts once and forks its ranks after LibTorch has loaded (each rank
  /// then costs a fork instead of loading LibTorch again), for an executable that links
  /// libtandem.
  TORCH_ARG(std::string, start_method) = "exec";
  TORCH_ARG(double, monitor_interval_s) = 0.1;
  TORCH_ARG(std::string, log_dir) = "";  ///< one log file per rank when set
  TORCH_ARG(bool, tee) = false;          ///< with log_dir: also print to the terminal
  TORCH_ARG(bool, quiet) = false;        ///< no launcher messages on success
  TORCH_ARG(std::string, rdzv_backend) = "static";
};

/// One local rank's command line and the variables tandem sets for it.
struct RankPlan {
  int rank = 0;
  int local_rank = 0;
  std::vector<std::string> argv;
  EnvMap env;  ///< set on top of the launcher's own environment
  std::vector<int> cpus;  ///< cores the rank is bound to; empty: not bound
};

/// The cores this process may run on (tandem/runtime.h, below the launcher).
using ::tandem::usable_cpus;

/// Intra-op threads per local process when neither --num_cpu_threads_per_process nor
/// OMP_NUM_THREADS chose them: usable_cores / local_processes (at least 1), and never more than
/// LibTorch's own default for a process started by hand (Note [Threads per rank]).
int default_threads_per_process(int usable_cores, int local_processes);

/// The plan for this machine's ranks. Pure: no process is started. Throws std::invalid_argument
/// on inconsistent options (machine_rank >= num_machines, no program, ...).
std::vector<RankPlan> make_plan(const LaunchOptions& options, const std::vector<std::string>& command,
                                const EnvMap& environment);

/// The plan in readable form (for --dry_run): every rank's command and environment.
std::string describe_plan(const std::vector<RankPlan>& plan);

/// Starts the plan's ranks, forwards their output prefixed with "[rank r] ", and waits. When a
/// rank fails, the others are stopped (SIGTERM, then SIGKILL after the grace period) and that
/// rank's exit code is returned (128 + signal for a signal), after a message naming it. With
/// max_restarts, all ranks are started again (TANDEM_RESTART_COUNT counts restarts); with
/// min_processes, as many as survived the failure (ranks killed by a signal are lost).
int run(std::vector<RankPlan> plan, const LaunchOptions& options);

}  // namespace tandem::launch
