// Note [Preemption]: a cluster that takes a job's machines back first sends a signal (SLURM:
// SIGTERM, or the one of --signal=USR1@90; Kubernetes: SIGTERM, then SIGKILL after the grace
// period). tandem launch forwards SIGTERM and --preemption_signal to every rank and gives them
// --preemption_grace_s before SIGKILL. A rank whose Accelerator checkpoints on preemption
// (AcceleratorOptions::checkpoint_on_preemption) records the signal here and goes on; at the end
// of the optimizer step it is in, every rank learns whether any rank was signalled (one
// maximum over the world), and if so they save a checkpoint together (save_state(), under
// project_dir/checkpoints), say "preempted at step k", and exit with kExitCode, which the
// launcher passes on as the job's code; auto_resume continues from that checkpoint. A rank keeps
// the first signal only (SLURM signals the launcher and the ranks alike, so each rank sees one
// preemption twice); a second signal to the launcher ends the job at once (SIGKILL to every
// rank), and a save it cuts short is never taken for a checkpoint (Note [Atomic checkpoints]).
#pragma once

#include <string>
#include <vector>

namespace tandem::preemption {

/// The exit code of a rank, and of tandem launch, that stopped after saving for a preemption
/// (EX_TEMPFAIL: try again later).
inline constexpr int kExitCode = 75;

/// The signal named `name` ("USR1", "SIGUSR1", "usr1", "TERM", "HUP", "INT", "USR2", "QUIT",
/// "ALRM", or its number): throws tandem::Refused naming `what` (the flag or variable) and the
/// signals accepted. KILL and STOP cannot be caught and are refused.
int signal_from_name(const std::string& name, const std::string& what);
/// "SIGUSR1".
std::string signal_name(int signal);

/// While alive, the signals given (0s skipped) are recorded instead of ending the process (the
/// first one; the others are ignored). The handlers before are put back on destruction. While one is alive, another made in the same process installs nothing and
/// shares its record.
class Watch {
 public:
  explicit Watch(std::vector<int> signals);
  ~Watch();
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;
  /// The first signal received since the Watch began, or 0.
  static int received();

 private:
  std::vector<int> signals_;
  std::vector<std::vector<char>> previous_;  // struct sigaction, by signal
};

}  // namespace tandem::preemption
