// The full `tandem` command line (libexec/tandem/tandem): launch, config, env, estimate-memory,
// merge-weights, merge-lora, quantize, sweep, plan. Thin: the logic lives in src/. Users type bin/tandem
// (front.cpp), which runs launch and config itself and the rest here (Note [A launcher without
// LibTorch]).
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <iostream>

#include "tandem/checkpoint/merge_weights.h"
#include "tandem/peft/lora.h"
#include "tandem/config/config.h"
#include "tandem/inference/quantize.h"
#include "tandem/track/flight_doctor.h"
#include "tandem/trials/sweep.h"
#include "tandem/version.h"
#include "estimate_memory_cmd.h"
#include "full_cli.h"
#include "launch_cmd.h"
#include "plan_cmd.h"

namespace tandem::cli {

// This executable has LibTorch.
void needs_libtorch() {}

}  // namespace tandem::cli

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

  // --- merge-lora -----------------------------------------------------------------------------
  auto* merge_lora = app.add_subcommand(
      "merge-lora",
      "Merge PEFT LoRA adapters (adapter_model.safetensors + adapter_config.json) into the "
      "weights of a save_pretrained folder: the folder transformers loads as the merged model "
      "(PEFT's merge_and_unload)");
  std::string lora_base, lora_adapter, lora_out;
  merge_lora->add_option("base_model", lora_base, "The base model's folder (config.json, weights)")
      ->required();
  merge_lora->add_option("adapter", lora_adapter, "The adapter's folder (PEFT's files)")->required();
  merge_lora->add_option("output_path", lora_out, "Where the merged folder is written")->required();

  // --- doctor ---------------------------------------------------------------------------------
  auto* doctor = app.add_subcommand(
      "doctor",
      "Read a job's flight recorder dumps (project_dir/flight/rank<r>.json) and say which rank "
      "is behind, and where ranks called different collectives");
  std::string doctor_dir;
  doctor->add_option("flight_directory", doctor_dir, "The folder of rank<r>.json dumps")
      ->required();

  // --- quantize ------------------------------------------------------------------------------
  auto* quant = app.add_subcommand(
      "quantize",
      "Write a checkpoint with its linear layers' weights quantized for inference: int8 with a "
      "scale per output channel, or int4 in groups with a scale and zero point each");
  std::string quant_in, quant_out, quant_layout = "auto";
  bool quant_int8 = false, quant_int4 = false;
  int64_t quant_group = 128;
  std::vector<std::string> quant_skip{"lm_head"};
  quant->add_option("input", quant_in, "A checkpoint: directory, .safetensors or index .json")
      ->required();
  quant->add_option("output", quant_out, "A new directory: model.safetensors and IN's JSON files")
      ->required();
  auto* q8 = quant->add_flag("--int8", quant_int8, "int8, one scale per output channel");
  auto* q4 = quant->add_flag("--int4", quant_int4, "int4 in groups along the input");
  q8->excludes(q4);
  quant->add_option("--group_size", quant_group, "int4 group size: 32, 64, 128 or 256");
  quant->add_option("--skip", quant_skip, "Layers kept in floating point: names containing any "
                    "of these (default lm_head)");
  quant->add_option("--weight_layout", quant_layout, "auto (in_out for a GPT-2 config.json, else "
                    "out_in), out_in (Linear) or in_out (Conv1D)");

  // --- sweep ---------------------------------------------------------------------------------
  auto* sweep = app.add_subcommand(
      "sweep",
      "Run a hyper-parameter study: each trial a `tandem launch` job of the study's program, "
      "sampled by grid, random or TPE, pruned by the median rule or ASHA; resumable "
      "(docs/trials.md)");
  std::string study_file;
  bool sweep_dry = false;
  sweep->add_option("study", study_file, "The study file (YAML)")->required();
  sweep->add_flag("--dry_run", sweep_dry, "Check the study and print the first trial's command");

  // --- plan (flags and handler in plan_cmd.cpp) ----------------------------------------------
  tandem::cli::PlanCommand plan(app);

  int parsed_argc = launch.split_program(argc, argv);  // PROGRAM [ARGS...] stays untouched
  parsed_argc = std::min(parsed_argc, plan.split_program(argc, argv));
  CLI11_PARSE(app, parsed_argc, argv);

  if (estimate_memory.chosen()) return estimate_memory.run();
  if (launch.chosen()) return launch.run();
  if (config.chosen()) return config.run();

  // Trials and plans start their jobs through bin/tandem (Note [A launcher without LibTorch]).
  auto self_exe = [] { return tandem::cli::launcher_path(tandem::cli::self_executable()); };
  try {
    if (plan.chosen()) return plan.run(self_exe());
    if (*merge) {
      auto r = tandem::checkpoint::merge_weights(merge_in, merge_out, merge_index);
      std::cout << "merged " << r.tensors << " tensors (" << r.bytes << " bytes) from " << r.sources
                << " file" << (r.sources == 1 ? "" : "s") << " into " << r.output << "\n";
      return 0;
    }
    if (*merge_lora) {
      tandem::peft::merge_adapter_files(lora_base, lora_adapter, lora_out);
      std::cout << "merged the adapters of " << lora_adapter << " into " << lora_base << ": "
                << lora_out << "\n";
      return 0;
    }
    if (*quant) {
      if (!quant_int8 && !quant_int4) {
        std::cerr << "tandem quantize: give --int8 or --int4\n";
        return 2;
      }
      if (quant_int8 && quant->count("--group_size")) {
        std::cerr << "tandem quantize: --group_size applies to --int4\n";
        return 2;
      }
      auto r = tandem::inference::quantize_checkpoint(
          quant_in, quant_out,
          tandem::inference::QuantizeOptions()
              .method(quant_int4 ? "int4" : "int8")
              .group_size(quant_group)
              .skip(quant_skip),
          quant_layout);
      std::cout << "quantized " << quant_in << " into " << quant_out << ": " << r.to_string()
                << "\n";
      return 0;
    }
    if (*doctor) {
      std::cout << tandem::track::diagnose_flight_dumps(doctor_dir);
      return 0;
    }
    if (*sweep) {
      const std::string self = self_exe();
      auto study = tandem::trials::load_study(study_file);
      if (sweep_dry) {
        tandem::trials::TrialRecord first;
        first.params = *tandem::trials::sample(study.sampler, study.space, {}, study.direction,
                                               study.seed, 0);
        std::vector<std::pair<std::string, std::string>> env_params;
        for (const auto& a : tandem::trials::trial_command(study, self, first,
                                                           study.study_dir + "/trial_0", &env_params))
          std::cout << a << " ";
        std::cout << "\n";
        for (const auto& [k, v] : env_params) std::cout << "env " << k << "=" << v << "\n";
        return 0;
      }
      auto r = tandem::trials::run_sweep(study, {self, &std::cout});
      return r.interrupted ? 130 : 0;
    }
    if (*env) {
      std::cout << tandem::config::environment_report();
      return 0;
    }
  } catch (const std::exception& e) {
    std::cerr << "tandem: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
