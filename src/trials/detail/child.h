// Child processes of the trial tools (tandem sweep, tandem plan): a job started in its own
// process group with its output in a log file, and a short command whose output is captured.
#pragma once

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

namespace tandem::trials::detail {

/// Starts argv[0] (a path) in a process group of its own, stdout and stderr into `log`
/// (truncated), `env` added to this environment, pinned to `cpus` when not empty. The child
/// gets SIGTERM when this process dies (PR_SET_PDEATHSIG). Returns its pid (= its group).
/// Throws std::runtime_error when fork fails.
pid_t spawn_logged(const std::vector<std::string>& argv,
                   const std::vector<std::pair<std::string, std::string>>& env,
                   const std::string& log, const std::vector<int>& cpus = {});

/// Runs argv to its end: (exit code, or 128 + signal; its stdout and stderr together).
std::pair<int, std::string> capture(const std::vector<std::string>& argv);

/// Waits for `pid` at most `timeout_s` seconds (0: no limit); past it, SIGTERM to its group,
/// then SIGKILL after `grace_s`. Returns the exit code (128 + signal when killed); `timed_out`
/// says whether the limit was reached.
int wait_child(pid_t pid, double timeout_s, double grace_s, bool* timed_out);

/// The last `lines` lines of a text file, each after `indent` ("" when it cannot be read).
std::string tail_lines(const std::string& path, int lines, const std::string& indent = "");

}  // namespace tandem::trials::detail
