// Note [Fork start]: `tandem launch --start_method fork` starts the program once and lets it fork
// its ranks after LibTorch has loaded, instead of starting every rank from nothing.
//
// Every rank a launcher execs maps LibTorch and its several hundred shared libraries, relocates
// them and runs LibTorch's static initializers (the registration of every operator): about
// 0.45 s of CPU per rank for LibTorch 2.12, 1.1 s for Debian's 1.13 under AddressSanitizer, most
// of what a short job costs. With fork start the launcher execs the program once, as the fork
// server: its environment is rank 0's plus TANDEM_FORK_SERVER="<spec fd>,<result fd>", and it
// inherits every rank's output pipes. libtandem's initializer (fork_start.cpp), which runs after
// LibTorch's and before the program's own, reads the spec (each rank's environment, output pipes
// and cores), checks that the process is still one thread with CUDA not loaded, forks the ranks,
// writes their pids to the result pipe and exits. The launcher is a child subreaper, so the ranks
// become its own children when the server exits: it waits on them, signals their process groups
// and reads their output exactly as for exec'd ranks. Each rank, once it is the launcher's child,
// takes its own process group, the death signal, its cores, its output pipes and its whole
// environment (the one exec would have given it), then returns from the initializer into the
// rest of the program's start and main().
//
// What the program's libraries read from the environment while they load (OMP_NUM_THREADS,
// OPENBLAS_CORETYPE, the sanitizers' options) they read once, from rank 0's: the launcher refuses
// a fork start whose ranks' environments differ in any other variable than those that say which
// rank a process is (may_differ). A program that is not an executable linking libtandem has no
// fork server: refused before anything starts, naming --start_method exec.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace tandem::launch::fork_start {

/// The variable of the fork server, "<spec fd>,<result fd>" (a row of config/run_env.cpp's table).
inline constexpr const char kServerVar[] = "TANDEM_FORK_SERVER";

/// One rank the fork server starts.
struct Rank {
  int rank = 0;
  int out_fd = -1;               ///< in the server: the write end of the rank's stdout pipe
  int err_fd = -1;               ///< ... and of its stderr pipe
  std::vector<int> cpus;         ///< the cores it is bound to; empty: not bound
  std::vector<std::string> env;  ///< its whole environment, "KEY=VALUE"
};

/// What the launcher hands the fork server.
struct Spec {
  int launcher_pid = 0;
  std::vector<Rank> ranks;
};

std::string encode(const Spec& spec);
/// nullopt when `bytes` is not a spec encode() wrote.
std::optional<Spec> decode(const std::string& bytes);

/// Whether two ranks of one fork start may have different values of `key`: the variables that
/// say which rank a process is, read after main() begins.
bool may_differ(const std::string& key);

/// Why `program` (argv[0]; looked up on `path` when it has no '/') cannot be started with fork
/// start, or "" when it can: it must be an ELF executable that links libtandem.
std::string unsupported_program(const std::string& program, const std::string& path);

/// The threads of this process (/proc/self/task): a fork keeps only the calling one.
int process_threads();

/// Whether this process initialized CUDA (it maps the driver library), which a fork cannot use.
bool cuda_loaded();

}  // namespace tandem::launch::fork_start
