// The `tandem` command line: launch, config, env, estimate-memory, merge-weights. Thin: the logic lives in src/.
#include <CLI/CLI.hpp>

#include <iostream>

#include "tandem/checkpoint/merge_weights.h"
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

  // --- merge-weights ----------------------------------------------------------------------------
  auto* merge = app.add_subcommand(
      "merge-weights",
      "Write a checkpoint's model (save_state or save_model output, sharded or not) as one "
      "model.safetensors in transformers' layout, streaming (Accelerate's merge-weights)");
  std::string merge_in, merge_out;
  std::size_t merge_index = 0;
  merge->add_option("checkpoint_directory", merge_in,
                    "A save_state() or save_model() directory, or a .safetensors/.index.json file")
      ->required();
  merge->add_option("output_path", merge_out, "Directory that gets model.safetensors")->required();
  merge->add_option("--model_index", merge_index,
                    "Which prepared model of a save_state() checkpoint (0: model.safetensors)");

  const int parsed_argc = launch.split_program(argc, argv);  // PROGRAM [ARGS...] stays untouched
  CLI11_PARSE(app, parsed_argc, argv);

  if (estimate_memory.chosen()) return estimate_memory.run();
  if (launch.chosen()) return launch.run();
  if (config.chosen()) return config.run();

  try {
    if (*merge) {
      auto r = tandem::checkpoint::merge_weights(merge_in, merge_out, merge_index);
      std::cout << "merged " << r.tensors << " tensors (" << r.bytes << " bytes) from " << r.sources
                << " file" << (r.sources == 1 ? "" : "s") << " into " << r.output << "\n";
      return 0;
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
