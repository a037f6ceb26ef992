// `tandem plan`: flags in, the planner's table and config file out.
#include "plan_cmd.h"

#include <torch/cuda.h>

#include <algorithm>
#include <iostream>

#include "tandem/checkpoint/model_io.h"
#include "tandem/trials/planner.h"

#include "flag_names.h"

namespace tandem::cli {

PlanCommand::PlanCommand(CLI::App& app) {
  sub_ = app.add_subcommand(
      "plan",
      "Pick the layout (dp, ZeRO stage, tp, pp, cp, ep, activation checkpointing, micro-batch, offload) "
      "that fits a model on these machines and trains fastest: predicts each one's peak memory "
      "per process, times the best with the real program, writes the winner's config file");
  sub_->footer(
      "Give the model as a safetensors checkpoint (its header is read) or as a GPT shape.\n"
      "After --, the program to probe and time; {batch_size} in its arguments becomes the "
      "sequences per data-parallel rank per micro-step, {microbatches} the pipeline's "
      "micro-batches, {steps} the steps of each run. Without a program the plan is predicted "
      "only.\nExamples:\n"
      "  tandem plan --layers 4 --hidden 256 --heads 4 --vocab 256 --seq_len 64 \\\n"
      "      --num_processes 4 --global_batch_size 8 --output plan.yaml -- \\\n"
      "      build/examples/train_gpt --layers 4 --width 256 --heads 4 --context 64 \\\n"
      "      --batch-size {batch_size} --microbatches {microbatches} --steps {steps}\n"
      "  tandem launch --config_file plan.yaml build/examples/train_gpt ...\n"
      "  tandem plan model.safetensors.index.json --num_processes 8 --num_machines 2 \\\n"
      "      --memory_per_process 80GB --seq_len 2048 --global_batch_size 64");
  const std::string model = "Model", machine = "Machines", run = "Runs";
  sub_->add_option("model", model_, "A .safetensors file, an index .json, or a folder with one")
      ->group(model);
  sub_->add_option(both("layers"), layers_, "GPT shape: transformer blocks")->group(model);
  sub_->add_option(both("hidden"), hidden_, "GPT shape: hidden size (train_gpt's --width)")
      ->group(model);
  sub_->add_option(both("heads"), heads_, "Attention heads (tp must divide them)")->group(model);
  sub_->add_option(both("vocab"), vocab_, "GPT shape: vocabulary size")->group(model);
  sub_->add_option(both("seq_len"), seq_len_,
                   "Tokens per sequence (GPT shape: also its context; default: the checkpoint's "
                   "config.json)")
      ->group(model);
  sub_->add_option(both("num_processes"), num_processes_, "Processes over all machines")
      ->required()
      ->group(machine);
  sub_->add_option(both("num_machines"), num_machines_, "Machines (default 1)")->group(machine);
  sub_->add_option(both("memory_per_process"), memory_,
                   "What one process may use: 8GB, 1.5GiB (default: this machine's available "
                   "memory / processes per machine, or the GPU's)")
      ->group(machine);
  sub_->add_flag(both("cpu"), cpu_, "Plan CPU processes even where a GPU is visible")
      ->group(machine);
  sub_->add_option(both("global_batch_size"), global_batch_,
                   "Sequences per optimizer step over all data-parallel ranks (default 8)")
      ->group(run);
  sub_->add_option(both("max_micro_batch"), max_micro_batch_,
                   "Largest micro-batch to try (default: the whole share of a rank)")
      ->group(run);
  sub_->add_flag(both("no_activation_checkpointing"), no_checkpointing_,
                 "Leave activation checkpointing out of the search")
      ->group(run);
  sub_->add_option(both("pp_virtual_stages"), virtual_stages_,
                   "Pipeline stages per rank to try, e.g. 1,2 (above 1: interleaved 1F1B; "
                   "default 1)")
      ->delimiter(',')
      ->check(CLI::PositiveNumber)
      ->group(run);
  sub_->add_option(both("cp_size"), context_parallel_,
                   "Context-parallel sizes to try, e.g. 1,2 (above 1: every sequence split over "
                   "that many ranks; the program's model must split its sequences, as train_llm's "
                   "does; default 1)")
      ->delimiter(',')
      ->check(CLI::PositiveNumber)
      ->group(run);
  sub_->add_option(both("ep_size"), expert_parallel_,
                   "Expert-parallel sizes to try, e.g. 1,2 (above 1: every mixture layer's "
                   "experts split over that many ranks of dp x cp, as train_llm's Qwen3-MoE and "
                   "Mixtral do; the model must have experts; default 1)")
      ->delimiter(',')
      ->check(CLI::PositiveNumber)
      ->group(run);
  sub_->add_option(both("offload_dir"), offload_dir_,
                   "Search ZeRO's optimizer state on disk in this directory")
      ->group(run);
  sub_->add_option(both("candidates"), candidates_,
                   "Layouts timed with the program, best guesses first (default 3)")
      ->group(run);
  sub_->add_flag(both("measure_all"), measure_all_,
                 "Run every layout that fits (predicted against measured)")
      ->group(run);
  sub_->add_option(both("probe_steps"), probe_steps_, "{steps} of the probe runs (default 3)")
      ->group(run);
  sub_->add_option(both("timed_steps"), timed_steps_, "{steps} of the timed runs (default 6)")
      ->group(run);
  sub_->add_option(both("run_timeout"), run_timeout_,
                   "Seconds one run may take before it counts as failed (default 600)")
      ->group(run);
  sub_->add_option(both("work_dir"), work_dir_,
                   "Where the runs' logs, profiles and plan.json go (default: OUTPUT.runs, or "
                   "plan_runs)")
      ->group(run);
  sub_->add_option(both("output"), output_,
                   "The winner's config file (tandem launch --config_file)")
      ->group(run);
}

int PlanCommand::split_program(int argc, char** argv) {
  int i = 1;
  while (i < argc && argv[i][0] == '-') ++i;
  if (i >= argc || std::string(argv[i]) != "plan") return argc;
  for (++i; i < argc; ++i)
    if (std::string(argv[i]) == "--") {
      command_.assign(argv + i + 1, argv + argc);
      return i;
    }
  return argc;
}

int PlanCommand::run(const std::string& tandem_exe) const {
  const bool shape = layers_ || hidden_ || vocab_;
  if (model_.empty() == !shape) {
    std::cerr << "tandem plan: give the model one way: a safetensors checkpoint, or a GPT shape "
                 "(--layers --hidden --heads --vocab --seq_len)\n";
    return 2;
  }
  // Flags that act only on runs of the program, or on {steps}: refused where they would not.
  auto given = [&](const char* flag) { return sub_->count(flag) > 0; };
  if (given("--measure_all") && given("--candidates")) {
    std::cerr << "tandem plan: --measure_all runs every layout that fits; drop --candidates or "
                 "--measure_all\n";
    return 2;
  }
  auto has_steps = std::any_of(command_.begin(), command_.end(), [](const std::string& a) {
    return a.find("{steps}") != std::string::npos;
  });
  for (const char* flag : {"--candidates", "--measure_all", "--probe_steps", "--timed_steps",
                           "--run_timeout", "--work_dir"}) {
    if (!given(flag)) continue;
    if (command_.empty()) {
      std::cerr << "tandem plan: " << flag << " acts on runs of the program, and none was given: "
                << "put the program after --, or drop " << flag << "\n";
      return 2;
    }
    if ((std::string(flag) == "--probe_steps" || std::string(flag) == "--timed_steps") &&
        !has_steps) {
      std::cerr << "tandem plan: " << flag << " sets {steps} in the program's arguments, and they "
                << "have none: put {steps} where the program reads its step count, or drop " << flag
                << "\n";
      return 2;
    }
  }
  try {
    trials::PlannerOptions o;
    o.tandem_exe = tandem_exe;
    if (model_.empty()) {
      if (!seq_len_) {
        std::cerr << "tandem plan: a GPT shape needs --seq_len (its context)\n";
        return 2;
      }
      o.model = trials::gpt_plan_model(layers_, hidden_, heads_ ? heads_ : 1, vocab_, seq_len_);
      if (!heads_) {
        std::cerr << "tandem plan: a GPT shape needs --heads (tensor parallel splits whole "
                     "heads)\n";
        return 2;
      }
    } else {
      o.model = trials::safetensors_plan_model(model_, heads_);
      if (o.model.heads == 0)
        std::cerr << "tandem plan: the number of attention heads is unknown (no config.json "
                     "beside the checkpoint names it): tensor parallel sizes are checked against "
                     "the widths only; give --heads\n";
    }
    o.seq_len = seq_len_;
    o.machine.num_processes = num_processes_;
    o.machine.num_machines = num_machines_;
    o.machine.cuda = !cpu_ && torch::cuda::is_available();
    if (o.machine.cuda && !command_.empty()) {
      std::cerr << "tandem plan: probing and timing a program on GPUs is not supported yet: a "
                   "run's profile (TANDEM_PROFILE) reads host memory, not the device's. Give "
                   "--cpu to plan CPU processes, or leave the program out to predict only\n";
      return 2;
    }
    if (!memory_.empty()) {
      o.machine.memory_per_process = static_cast<double>(checkpoint::parse_size(memory_));
    } else if (o.machine.cuda) {
      std::cerr << "tandem plan: give --memory_per_process (the GPU memory one process may use)\n";
      return 2;
    } else {
      o.machine.memory_per_process =
          trials::available_memory_per_process(num_processes_ / std::max(1, num_machines_));
    }
    o.search.global_batch = global_batch_;
    o.search.max_micro_batch = max_micro_batch_;
    o.search.offload_dir = offload_dir_;
    o.search.search_checkpointing = !no_checkpointing_;
    if (!virtual_stages_.empty()) o.search.virtual_stages = virtual_stages_;
    if (!context_parallel_.empty()) o.search.context_parallel = context_parallel_;
    if (!expert_parallel_.empty()) o.search.expert_parallel = expert_parallel_;
    if (!command_.empty()) {
      o.program = command_[0];
      o.args.assign(command_.begin() + 1, command_.end());
    }
    o.candidates = candidates_;
    o.measure_all = measure_all_;
    o.probe_steps = probe_steps_;
    o.timed_steps = timed_steps_;
    o.run_timeout_s = run_timeout_;
    o.output = output_;
    o.work_dir = !work_dir_.empty() ? work_dir_
                 : !output_.empty() ? output_ + ".runs"
                                    : "plan_runs";
    o.out = &std::cout;
    const auto result = trials::run_plan(o);
    std::cout << trials::format_plan(result, o);
    return result.winner ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "tandem plan: " << e.what() << "\n";
    return 2;
  }
}

}  // namespace tandem::cli
