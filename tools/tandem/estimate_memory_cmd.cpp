// `tandem estimate-memory`: flags in, text table or JSON out.
#include "estimate_memory_cmd.h"

#include <algorithm>
#include <iostream>

#include "tandem/track/memory_estimate.h"
#include "tandem/error.h"
#include "tandem/trials/plan.h"

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
      "  tandem estimate-memory --layers 12 --hidden 768 --vocab 50257 --context 1024 --json\n"
      "  tandem estimate-memory model.safetensors --num_processes 8 --tp_size 2 --pp_size 2");
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
  sub_->add_option(both("tp_size"), tp_, "Layout: tensor-parallel size (as tandem launch's)")
      ->check(CLI::PositiveNumber)
      ->group("Layout");
  sub_->add_option(both("pp_size"), pp_, "Layout: pipeline stages")
      ->check(CLI::PositiveNumber)
      ->group("Layout");
  sub_->add_option(both("pp_virtual_stages"), virtual_stages_,
                   "Layout: pipeline stages per rank (interleaved 1F1B)")
      ->check(CLI::PositiveNumber)
      ->group("Layout");
  sub_->add_option(both("cp_size"), cp_, "Layout: context-parallel size")
      ->check(CLI::PositiveNumber)
      ->group("Layout");
  sub_->add_option(both("ep_size"), ep_,
                   "Layout: expert-parallel size (within dp; a checkpoint's '.experts.' tensors "
                   "split over it)")
      ->check(CLI::PositiveNumber)
      ->group("Layout");
  sub_->add_option(both("dtypes"), dtypes_,
                   "Rows to show among float32, float16, bfloat16, int8, int4 (default all)")
      ->delimiter(',')
      ->group("Output");
  sub_->add_flag(both("json"), json_, "Print JSON for scripts instead of tables")->group("Output");
}

track::LayoutShare EstimateMemoryCommand::layout_share(const track::ModelSize& model) const {
  track::LayoutShare l;
  l.tp = tp_;
  l.pp = pp_;
  l.cp = cp_;
  l.virtual_stages = virtual_stages_;
  l.ep = ep_;
  const int64_t split = static_cast<int64_t>(tp_) * pp_ * cp_;
  if (num_processes_ % split != 0)
    throw Refused("--num_processes " + std::to_string(num_processes_) +
                  " is not a multiple of tp x pp x cp = " + std::to_string(split) +
                  ": the data-parallel size is what remains; give a multiple");
  l.dp = static_cast<int>(num_processes_ / split);
  if (ep_ > 1 && ((l.dp * cp_) % ep_ != 0 || pp_ > 1))
    throw Refused("--ep_size " + std::to_string(ep_) + " splits the experts over data-parallel "
                  "ranks (dp x cp): it must divide dp x cp (" + std::to_string(l.dp * cp_) +
                  "), and tandem runs it without --pp_size");
  if (ep_ > 1 && model_.empty())
    throw Refused("--ep_size needs a checkpoint whose expert tensors ('.experts.' in their "
                  "names) it can count; --params and a GPT shape have none");
  if (virtual_stages_ > 1 && pp_ < 2)
    throw Refused("--pp_virtual_stages " + std::to_string(virtual_stages_) +
                  " gives each pipeline rank several stages: give --pp_size 2 or more");
  if (!params_.empty()) {
    // A count alone has no tensors to split: an even share, said as such.
    if (virtual_stages_ > 1 || pp_ > 1 || tp_ > 1) {
      l.rank_parameters = (model.num_parameters + tp_ * pp_ - 1) / (tp_ * pp_);
      l.counted = "an even split of --params over tp x pp; give a checkpoint or a GPT shape to "
                  "count it per tensor";
    } else {
      l.rank_parameters = model.num_parameters;
      l.counted = "--params";
    }
    l.largest_unit = 0;
    return l;
  }
  auto plan_model = model_.empty()
                        ? trials::gpt_plan_model(layers_, hidden_, 1, vocab_, context_)
                        : trials::safetensors_plan_model(model_);
  if (ep_ > 1) {
    // Note [Expert parallel]: a rank holds 1/ep of each layer's experts.
    // Every tp rank holds its experts whole (their input is whole).
    bool any = false;
    for (auto& t : plan_model.tensors)
      if (t.name.find(".experts.") != std::string::npos) {
        t.numel = (t.numel + ep_ - 1) / ep_;
        t.tp_split = false;
        l.expert_parameters += t.numel;
        any = true;
      }
    if (!any)
      throw Refused("--ep_size " + std::to_string(ep_) + ": " + model_ + " has no expert "
                    "tensors ('.experts.' in their names) to split");
  }
  const int64_t children = plan_model.blocks + 2;
  if (static_cast<int64_t>(pp_) * virtual_stages_ > children)
    throw Refused("pp " + std::to_string(pp_) + " x " + std::to_string(virtual_stages_) +
                  " stages per rank is more stages than the model's " + std::to_string(children) +
                  " children (its embeddings, " + std::to_string(plan_model.blocks) +
                  " blocks and its head)");
  trials::Layout layout;
  layout.dp = l.dp;
  layout.tp = tp_;
  layout.pp = pp_;
  layout.cp = cp_;
  layout.virtual_stages = virtual_stages_;
  for (const auto& r : trials::rank_parameters(plan_model, layout)) {
    if (r.parameters > l.rank_parameters) {
      l.rank_parameters = r.parameters;
      l.largest_unit = r.largest_unit;
      l.stage = r.stage;
    }
  }
  l.counted = ep_ > 1 ? "counted per tensor: each expert tensor 1/ep per rank"
                      : "counted per tensor: tensor parallel splits every matrix, pipeline stages "
                        "take whole blocks";
  return l;
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
    const bool layout_given = tp_ > 1 || pp_ > 1 || cp_ > 1 || virtual_stages_ > 1 || ep_ > 1;
    track::MemoryEstimate estimate;
    if (!layout_given) {
      estimate = track::estimate_memory(model, num_processes_, dtypes_);
    } else {
      estimate = track::estimate_memory(model, num_processes_, dtypes_, layout_share(model));
    }
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
