// The worker side of tandem::testing::launch_jobs (tests/common/launch.h): `WORKER --jobs FILE`
// runs the file's jobs one after another in this process, each with the environment
// `tandem launch` would have given it alone and its own arguments.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

namespace tandem::testing {

/// main() of a worker that can run batched jobs: `return main_with_jobs(argc, argv, run);`,
/// where `run` is the worker's own main. Without `--jobs FILE` it is `run(argc, argv)`.
///
/// Each job: the variables the previous job set and this one does not are put back as the
/// process started with them, this job's are set (its `unset` lines removed), then
/// `run(argv[0], args...)`. Prints "tandem-job i" before and "tandem-job-exit i code" after it
/// on stdout; a job that fails (non-zero or an exception) ends the process with its code, as
/// the job alone would have ended its launch, unless the file says it `may_fail` (a refusal
/// every rank makes alike): then the next job runs, and the process ends with 0 if no other
/// job failed.
inline int main_with_jobs(int argc, char** argv, const std::function<int(int, char**)>& run) {
  if (argc != 3 || std::string(argv[1]) != "--jobs") return run(argc, argv);
  // One stream for the jobs' lines: the launcher reads a rank's stdout and stderr from two pipes,
  // so a job's last line on stderr could reach it after the next job's first line on stdout and
  // be counted to the wrong job. Through one pipe they keep the order they were written in.
  std::fflush(nullptr);
  std::cerr.flush();
  ::dup2(STDOUT_FILENO, STDERR_FILENO);
  struct Job {
    std::map<std::string, std::optional<std::string>> env;  // nullopt: unset
    std::vector<std::string> args;
    bool may_fail = false;
  };
  std::vector<Job> jobs;
  std::ifstream in(argv[2]);
  if (!in) {
    std::cerr << "cannot read the jobs file " << argv[2] << std::endl;
    return 2;
  }
  for (std::string line; std::getline(in, line);) {
    if (line == "job") {
      jobs.emplace_back();
    } else if (jobs.empty()) {
      std::cerr << "jobs file: '" << line << "' before the first 'job'" << std::endl;
      return 2;
    } else if (line.rfind("env ", 0) == 0) {
      const auto eq = line.find('=');
      jobs.back().env[line.substr(4, eq - 4)] = line.substr(eq + 1);
    } else if (line.rfind("unset ", 0) == 0) {
      jobs.back().env[line.substr(6)] = std::nullopt;
    } else if (line.rfind("arg ", 0) == 0) {
      jobs.back().args.push_back(line.substr(4));
    } else if (line == "may_fail") {
      jobs.back().may_fail = true;
    } else {
      std::cerr << "jobs file: unknown line '" << line << "'" << std::endl;
      return 2;
    }
  }
  std::map<std::string, std::optional<std::string>> started;  // what a job changed, as it was
  for (size_t i = 0; i < jobs.size(); ++i) {
    for (const auto& [key, value] : started) {
      if (jobs[i].env.count(key)) continue;
      if (value) setenv(key.c_str(), value->c_str(), 1);
      else unsetenv(key.c_str());
    }
    for (const auto& [key, value] : jobs[i].env) {
      if (!started.count(key)) {
        const char* now = std::getenv(key.c_str());
        started[key] = now ? std::optional<std::string>(now) : std::nullopt;
      }
      if (value) setenv(key.c_str(), value->c_str(), 1);
      else unsetenv(key.c_str());
    }
    std::vector<std::string> args{argv[0]};
    args.insert(args.end(), jobs[i].args.begin(), jobs[i].args.end());
    std::vector<char*> cargs;
    for (auto& a : args) cargs.push_back(a.data());
    cargs.push_back(nullptr);
    std::cout << "tandem-job " << i << std::endl;
    int code = 0;
    try {
      code = run(static_cast<int>(args.size()), cargs.data());
    } catch (const std::exception& e) {
      std::cerr << e.what() << std::endl;
      code = 1;
    }
    std::cout << std::flush;
    std::cerr << std::flush;
    std::fflush(nullptr);
    std::cout << "tandem-job-exit " << i << " " << code << std::endl;
    if (code != 0 && !jobs[i].may_fail) return code;
  }
  return 0;
}

}  // namespace tandem::testing
