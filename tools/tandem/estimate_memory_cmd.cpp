// `tandem estimate-memory`: flags in, text table or JSON out.
#include "estimate_memory_cmd.h"

#include <algorithm>
#include <iostream>

#include "tandem/track/memory_estimate.h"

#include "flag_names.h"

namespace tandem::cli {

EstimateMemoryCommand::EstimateMemoryCommand(CLI::App& app) {
  sub_ = app.add_subcommand(
      "estimate-memory",
      "Memory a model needs: size per dtype, training with Adam, DDP and ZeRO 1-3 per device");
  sub_->footer(
      "Give the model one way: a safetensors checkpoint (only its header is read), --params, or "
      "a GPT shape.\nExamples:\n"
      "  tandem estimate-memory model.safetensors.index.json --num_processes 8\n"
      "  tandem estimate-memory --params 7.5B --num_processes 64\n"
      "  tandem estimate-memory --layers 12 --hidden 768 --vocab 50257 --context 1024 --json");
  sub_->add_option("model", model_,
                   "A .safetensors file, a model.safetensors.index.json, or a folder with one")
      ->group("Model");
  sub_->add_option(both("params"), params_, "Parameter count: 125M, 7.5B, 1e9")->group("Model");
  sub_->add_option(both("layers"), layers_, "GPT shape: transformer blocks")->group("GPT shape");
  sub_->add_option(both("hidden"), hidden_, "GPT shape: hidden size")->group("GPT shape");
  sub_->add_option(both("vocab"), vocab_, "GPT shape: vocabulary size")->group("GPT shape");
  sub_->add_option(both("context"), context_, "GPT shape: context length (positions)")
      ->group("GPT shape");
  sub_->add_option(both("num_processes"), num_processes_,
                   "Devices for the DDP / ZeRO table (default 1)")
      ->group("Output");
  sub_->add_option(both("dtypes"), dtypes_,
                   "Rows to show among float32, float16, bfloat16, int8, int4 (default all)")
      ->delimiter(',')
      ->group("Output");
  sub_->add_flag(both("json"), json_, "Print JSON for scripts instead of tables")->group("Output");
}

int EstimateMemoryCommand::run() const {
  if (num_processes_ < 1) {
    std::cerr << "tandem estimate-memory: --num_processes must be at least 1, got "
              << num_processes_ << "\n";
    return 2;
  }
  const bool shape_given = layers_ || hidden_ || vocab_ || context_;
  const int ways = !model_.empty() + !params_.empty() + shape_given;
  if (ways != 1) {
    std::cerr << "tandem estimate-memory: expected exactly one model description (a safetensors "
                 "path, --params N, or --layers/--hidden/--vocab/--context), found "
              << ways << "; see tandem estimate-memory --help\n";
    return 2;
  }
  try {
    track::ModelSize model;
    if (!model_.empty()) {
      model = track::read_safetensors_model_size(model_);
    } else if (!params_.empty()) {
      model = track::model_size_from_count(track::parse_parameter_count(params_));
      model.source = "--params " + params_;
    } else {
      model = track::count_gpt_parameters({layers_, hidden_, vocab_, context_});
    }
    auto estimate = track::estimate_memory(model, num_processes_, dtypes_);
    if (json_) {
      std::cout << track::memory_estimate_to_json(estimate) << "\n";
    } else {
      std::cout << track::format_memory_estimate(estimate);
    }
  } catch (const std::exception& e) {
    std::cerr << "tandem estimate-memory: " << e.what() << "\n";
    return 2;
  }
  return 0;
}

}  // namespace tandem::cli
