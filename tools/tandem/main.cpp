// The `tandem` command line: launch, config, env, estimate-memory. Thin: the logic lives in src/.
#include <CLI/CLI.hpp>

#include <iostream>

#include "tandem/version.h"
#include "estimate_memory_cmd.h"
#include "launch_cmd.h"

int main(int argc, char** argv) {
  CLI::App app{"tandem: distributed training for LibTorch"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("tandem ") + tandem::kVersion);

  // --- launch, config (flags and handlers in launch_cmd.cpp) ------------------------------------
  tandem::cli::LaunchCommand launch(app);
  tandem::cli::ConfigCommand config(app);

  // --- env ------------------------------------------------------------------------------------
  auto* env = app.add_subcommand("env", "Print what a bug report needs");

  // --- estimate-memory (flags and handler in estimate_memory_cmd.cpp) ----------------------------
  tandem::cli::EstimateMemoryCommand estimate_memory(app);

  const int parsed_argc = launch.split_program(argc, argv);  // PROGRAM [ARGS...] stays untouched
  CLI11_PARSE(app, parsed_argc, argv);

  if (estimate_memory.chosen()) return estimate_memory.run();
  if (launch.chosen()) return launch.run();
  if (config.chosen()) return config.run();

  try {
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
