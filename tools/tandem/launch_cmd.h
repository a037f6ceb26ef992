// `tandem launch` and `tandem config`: the subcommands' flags and handlers (logic in
// tandem/launch/ and tandem/config/).
#pragma once

#include <CLI/CLI.hpp>

#include <deque>
#include <string>
#include <vector>

namespace tandem::cli {

/// The launch subcommand: registered on construction, run() after parsing.
class LaunchCommand {
 public:
  explicit LaunchCommand(CLI::App& app);
  /// Whether the command line chose this subcommand.
  bool chosen() const { return sub_->parsed(); }
  /// Splits `tandem launch [FLAGS] PROGRAM [ARGS...]` before parsing: keeps PROGRAM and its
  /// arguments, untouched and in order, and returns how many leading arguments the CLI parses.
  int split_program(int argc, char** argv);
  /// Resolves flags over the config file, then starts the ranks (or prints them with
  /// --dry_run). Returns the exit code: the failing rank's, or 2 for bad flags or config.
  int run();

 private:
  // A flag that sets a config key when given: its option, the key, and the text (bound to the
  // option, or fixed for switches such as --cpu).
  struct Tracked {
    CLI::Option* option;
    std::string key;
    std::string* text;
    std::string fixed;
  };
  CLI::Option* track(CLI::Option* option, const std::string& key, std::string* text,
                     const std::string& fixed = "");

  CLI::App* sub_ = nullptr;
  std::vector<Tracked> tracked_;
  std::deque<std::string> texts_;  // stable storage of the tracked options' values
  std::string config_file_, threads_;
  int max_restarts_ = 0;
  int min_processes_ = 0;
  int min_machines_ = 0;
  double rdzv_timeout_ = 30.0;
  bool fault_tolerant_replicas_ = false;
  double replica_timeout_ = 30.0;
  std::string start_method_ = "exec";
  double monitor_ = 0.1, grace_ = 5.0, preemption_grace_ = 30.0, heartbeat_timeout_ = 0.0;
  std::string preemption_signal_;
  std::string log_dir_;
  bool tee_ = false, quiet_ = false, dry_run_ = false;
  std::vector<std::string> env_kv_;
  std::vector<std::string> command_;
};

/// The config subcommand: questionnaire, and `default`, `show`, `validate`.
class ConfigCommand {
 public:
  explicit ConfigCommand(CLI::App& app);
  bool chosen() const { return sub_->parsed(); }
  int run();

 private:
  CLI::App* sub_ = nullptr;
  CLI::App* default_ = nullptr;
  CLI::App* show_ = nullptr;
  CLI::App* validate_ = nullptr;
  std::string file_, default_file_, show_file_, validate_file_;
  std::string mixed_precision_ = "no";
};

}  // namespace tandem::cli
