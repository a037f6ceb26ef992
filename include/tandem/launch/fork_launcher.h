// The in-process launcher (Accelerate's notebook_launcher): forks N workers from the running
// program, each with the distributed environment of one rank, runs a function in each, and
// rethrows the first failure in the parent.
#pragma once

#include <torch/arg.h>

#include <functional>
#include <stdexcept>
#include <string>

#include "tandem/state.h"

namespace tandem::launch {

/// Options of launch().
///
/// Example:
///   tandem::launch::launch([] {
///     auto state = tandem::ProcessState::from_environment();
///     auto pg = tandem::ProcessGroup::create(state);
///     // ... train ...
///   }, 2, tandem::launch::ForkLaunchOptions().mixed_precision("bf16"));
struct ForkLaunchOptions {
  TORCH_ARG(std::string, master_addr) = "127.0.0.1";
  TORCH_ARG(int, master_port) = 0;  ///< 0: a free port
  /// TANDEM_MIXED_PRECISION in the workers (no | fp16 | bf16 | fp8 | bf16-true | fp16-true).
  TORCH_ARG(std::string, mixed_precision) = "no";
  TORCH_ARG(bool, cpu) = false;  ///< TANDEM_USE_CPU=1 in the workers
  /// LibTorch intra-op threads per worker (and OMP_NUM_THREADS); 0: cores / workers, at most
  /// what LibTorch takes by itself (launch::default_threads_per_process).
  TORCH_ARG(int, num_threads) = 0;
  /// Extra environment for every worker.
  TORCH_ARG(EnvMap, env) = {};
  /// Seconds between SIGTERM and SIGKILL when the other workers are stopped after a failure.
  TORCH_ARG(double, grace_period_s) = 5.0;
};

/// A worker of launch() failed. what() reads "tandem::launch: rank r of n failed: <message>".
class WorkerFailed : public std::runtime_error {
 public:
  WorkerFailed(int rank, std::string worker_message, const std::string& what)
      : std::runtime_error(what), rank_(rank), worker_message_(std::move(worker_message)) {}
  /// The rank that failed first.
  int rank() const { return rank_; }
  /// Its exception's what(), or how it ended (exit code, signal).
  const std::string& worker_message() const { return worker_message_; }

 private:
  int rank_;
  std::string worker_message_;
};

/// What makes forking unsafe, read from this process.
struct ForkSafety {
  int live_process_groups = 0;    ///< tandem ProcessGroups of more than one rank alive
  bool cuda_initialized = false;  ///< the CUDA driver library is loaded (CUDA was used)
  int threads = 1;                ///< entries of /proc/self/task
};

/// Reads ForkSafety from this process without initializing anything (CUDA included).
ForkSafety probe_fork_safety();

/// Throws std::runtime_error explaining what to change when forking is unsafe: a live process
/// group, initialized CUDA, or more than one thread.
void check_fork_safety(const ForkSafety& safety);

/// Runs `fn` in `num_processes` forked workers of this program, each with RANK, WORLD_SIZE,
/// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a free port unless given) and the
/// TANDEM_* settings of `options` set, so that ProcessState::from_environment() and the
/// Accelerator see a job of `num_processes` ranks. Waits for every worker. When one fails
/// (throws, exits non-zero, or is killed), the others are stopped and WorkerFailed is thrown
/// here with the failing rank's message. Workers end with _exit: no static destructors run
/// twice, and output is flushed first.
///
/// Refuses (check_fork_safety) when this process holds a ProcessGroup, has initialized CUDA, or
/// runs more than one thread.
///
/// Memory: workers share the parent's memory copy-on-write. Build a large model *before*
/// calling launch and capture it in `fn`: the workers then read the parent's copy instead of
/// each building their own (pages are copied only when a worker writes them; an optimizer step
/// writes every parameter, so plan for one copy per worker during training).
void launch(const std::function<void()>& fn, int num_processes,
            const ForkLaunchOptions& options = {});

}  // namespace tandem::launch
