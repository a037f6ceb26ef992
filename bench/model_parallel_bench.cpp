// Model parallel: samples/s and per-rank peak tensor memory of one small GPT (examples/common/
// gpt.h's Blocks in a torch::nn::Sequential: embeddings, the blocks, LayerNorm + untied head)
// trained with AdamW on a fixed global batch, in every way tandem splits the work:
//   model_parallel_bench plain   plain LibTorch, one process, the whole batch (the reference);
//                                with --microbatches m, the batch in m accumulated micro-batches
//                                (what a pipeline stage computes, without the pipeline);
//   model_parallel_bench ddp     the Accelerator's data parallel, each rank its share of the
//                                batch (under `tandem launch`; with --activation_checkpointing
//                                every entry of the Sequential is checkpointed: named "ckpt");
//   model_parallel_bench tp      tensor parallel (`tandem launch --tp_size N`): every block's
//                                attention and MLP split over the ranks, the whole batch on each;
//   model_parallel_bench pp      pipeline parallel (`tandem launch --pp_size N`), --schedule
//                                gpipe|1f1b|interleaved_1f1b|zero_bubble (--virtual_stages v),
//                                --microbatches m, the whole batch through the stages.
// Prints "RESULT model_parallel <name> samples_per_s=<x> step_s=<t> peak_bytes=<max over ranks>
// peak_bytes_ranks=<r0,r1,...>" on rank 0, for pp also "schedule_bubble=<the schedule's formula>"
// and "measured_idle=<1 - compute / schedule time, per rank from Pipeline::last_step_times,
// averaged over the ranks and the timed steps>", and
// for plain "parameters=<n>"; and "loss=<the last step's loss on the global batch>", the same
// in every mode up to rounding (every mode trains the same model on the same batches).
// peak_bytes come from tandem's counting CPU allocator over the timed steps (after the warm-up
// steps created the optimizer state).
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <iostream>
#include <sstream>

#include "../examples/common/gpt.h"
#include "tandem/tandem.h"
#include "timed_steps.h"

namespace {

using examples::GPTConfig;

/// The same dense model on every rank and in every mode (examples::gpt_sequential): entry 0 the
/// embeddings, 1..layers the blocks, the last the head.
torch::nn::Sequential make_model(const GPTConfig& c) {
  torch::manual_seed(1);
  return examples::gpt_sequential(c);
}

/// Tensor parallel over the Sequential's paths ("3.attn.qkv"): Megatron's split of every block;
/// the embeddings and the head stay replicated.
tandem::parallel::TensorParallelPlan block_plan() {
  tandem::parallel::TensorParallelPlan plan;
  plan.colwise("*.attn.qkv", /*parts=*/3)
      .rowwise("*.attn.proj")
      .colwise("*.fc")
      .rowwise("*.fc_proj");
  return plan;
}

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& target) {
  return examples::gpt_sequential_loss(logits, target);
}

}  // namespace

int main(int argc, char** argv) {
  // Before any tensor exists, so that every tensor byte is counted.
  tandem::track::install_counting_cpu_allocator();
  CLI::App app("model_parallel_bench");
  std::string mode = "plain", schedule = "1f1b";
  int steps = 10, warmup = 2, microbatches = 0, virtual_stages = 1;
  int64_t batch = 8;
  GPTConfig c;
  c.vocab = 256;
  c.context = 64;
  c.layers = 8;
  c.heads = 4;
  c.width = 256;
  app.add_option("mode", mode)->check(CLI::IsMember({"plain", "ddp", "tp", "pp"}));
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--warmup", warmup, "steps before the timed ones");
  app.add_option("--batch", batch,
                 "global batch (sequences per step, over all data-parallel ranks)");
  app.add_option("--schedule", schedule, "pp: gpipe, 1f1b, interleaved_1f1b or zero_bubble")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"}));
  app.add_option("--virtual_stages", virtual_stages, "pp: stages per rank (interleaved_1f1b)");
  app.add_option("--microbatches", microbatches,
                 "micro-batches per step (pp: default 4; plain: default 1, accumulated)");
  app.add_option("--layers", c.layers);
  app.add_option("--width", c.width);
  app.add_option("--heads", c.heads);
  app.add_option("--context", c.context);
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);
  // Step i's global batch: ids [batch, context + 1], the same in every mode.
  auto global_batch = [&](int i) {
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(i + 1));
    auto ids = torch::randint(c.vocab, {batch, c.context + 1}, gen, torch::kLong);
    return std::make_pair(ids.slice(1, 0, c.context).contiguous(), ids.slice(1, 1).contiguous());
  };
  auto net = make_model(c);
  int64_t parameters = 0;
  for (const auto& p : net->parameters()) parameters += p.numel();
  auto adamw = [](std::vector<torch::Tensor> params) {
    return std::make_shared<torch::optim::AdamW>(std::move(params),
                                                 torch::optim::AdamWOptions(1e-4));
  };

  if (mode == "plain") {
    const int m = microbatches > 0 ? microbatches : 1;
    TORCH_CHECK(batch % m == 0, "the batch of ", batch, " does not split into ", m,
                " micro-batches of equal size: use a multiple of ", m);
    auto opt = adamw(net->parameters());
    double last_loss = 0;
    const double s = bench::timed_steps(warmup, steps, [&](int i) {
      auto [x, y] = global_batch(i);
      const auto xs = x.chunk(m), ys = y.chunk(m);
      last_loss = 0;
      for (int j = 0; j < m; ++j) {
        auto loss = lm_loss(net->forward(xs[j]), ys[j]) / m;
        loss.backward();
        last_loss += loss.item<double>();
      }
      opt->step();
      opt->zero_grad();
    });
    const auto peak = tandem::track::cpu_memory_stats().peak_bytes;
    std::cout << "RESULT model_parallel " << (m > 1 ? "plain_m" + std::to_string(m) : "plain")
              << " samples_per_s=" << batch * steps / s << " step_s=" << s / steps
              << " peak_bytes=" << peak << " peak_bytes_ranks=" << peak
              << " parameters=" << parameters << " loss=" << last_loss << std::endl;
    return 0;
  }

  tandem::Accelerator acc;
  std::string name = mode;
  std::function<void(int)> train_step;
  torch::Tensor last_loss;  // this rank's loss of the last step
  std::shared_ptr<tandem::parallel::Pipeline> pipe;
  std::optional<tandem::AcceleratedOptimizer> opt;
  double schedule_bubble = -1;
  // pp: each rank's schedule and compute seconds over the timed steps (Pipeline::StepTimes).
  double schedule_s = 0, compute_s = 0;
  if (mode == "ddp") {
    if (tandem::config::activation_checkpointing_from_env(tandem::current_environment())) name = "ckpt";
    acc.prepare(net);
    opt = acc.prepare(adamw(net->parameters()));
    auto& dp = acc.data_parallel_group();
    TORCH_CHECK(batch % dp.size() == 0, "the batch of ", batch, " does not split over ", dp.size(),
                " data-parallel ranks: use a multiple of ", dp.size());
    const int64_t rows = batch / dp.size(), first = dp.rank() * rows;
    train_step = [&, rows, first](int i) {
      auto [x, y] = global_batch(i);
      auto scope = acc.accumulate();
      last_loss =
          lm_loss(net->forward(x.slice(0, first, first + rows)), y.slice(0, first, first + rows));
      acc.backward(last_loss);
      opt->step();
      opt->zero_grad();
    };
  } else if (mode == "tp") {
    acc.parallelize(*net, block_plan());
    acc.prepare(net);
    opt = acc.prepare(adamw(net->parameters()));
    train_step = [&](int i) {
      auto [x, y] = global_batch(i);
      auto scope = acc.accumulate();
      last_loss = lm_loss(net->forward(x), y);
      acc.backward(last_loss);
      opt->step();
      opt->zero_grad();
    };
  } else {
    namespace par = tandem::parallel;
    const auto kind = par::schedule_from_name(schedule, "--schedule");
    if (microbatches <= 0) microbatches = 4;
    name = "pp_" + schedule + (virtual_stages > 1 ? "_v" + std::to_string(virtual_stages) : "") +
           "_m" + std::to_string(microbatches);
    pipe = acc.prepare_pipeline(net, lm_loss,
                                par::PipelineOptions().schedule(kind).microbatches(microbatches)
                                    .virtual_stages(virtual_stages));
    opt = acc.prepare(adamw(pipe->module()->parameters()));
    // The schedule's idle share with a backward twice a forward (Note [Pipeline schedules]).
    const double p = pipe->stages(), m = microbatches, v = virtual_stages;
    schedule_bubble = kind == par::ScheduleKind::kInterleaved1F1B ? (p - 1) / (v * m + p - 1)
                      : kind == par::ScheduleKind::kZeroBubble    ? 2 * (p - 1) / (3 * m + 2 * (p - 1))
                                                                  : (p - 1) / (m + p - 1);
    train_step = [&](int i) {
      auto [x, y] = global_batch(i);
      last_loss = torch::tensor(
          pipe->step(pipe->is_first() ? x : torch::Tensor(), pipe->is_last() ? y : torch::Tensor()),
          torch::kDouble);
      if (i >= warmup) {
        schedule_s += pipe->last_step_times().schedule_s;
        compute_s += pipe->last_step_times().compute_s;
      }
      opt->step();
      opt->zero_grad();
    };
  }
  const double s = bench::timed_steps(warmup, steps, train_step, [&] { acc.wait_for_everyone(); });
  auto peaks = acc.process_group().allgather(torch::tensor(
      {static_cast<int64_t>(tandem::track::cpu_memory_stats().peak_bytes)}, torch::kLong));
  // The global batch's loss: ddp ranks hold equal shares of it; tp and pp ranks the whole of it.
  double loss = 0;
  for (const auto& l :
       acc.process_group().allgather(last_loss.detach().to(torch::kDouble).reshape({1})))
    loss += l.item<double>() / acc.num_processes();
  int64_t peak_max = 0;
  std::ostringstream per_rank;
  for (size_t r = 0; r < peaks.size(); ++r) {
    const int64_t v = peaks[r].item<int64_t>();
    peak_max = std::max(peak_max, v);
    per_rank << (r ? "," : "") << v;
  }
  if (acc.is_main_process()) {
    std::cout << "RESULT model_parallel " << name << " samples_per_s=" << batch * steps / s
              << " step_s=" << s / steps << " peak_bytes=" << peak_max
              << " peak_bytes_ranks=" << per_rank.str();
    std::cout << " loss=" << loss;
    if (schedule_bubble >= 0) std::cout << " schedule_bubble=" << schedule_bubble;
  }
  if (pipe) {  // the measured bubble: each rank's idle share of its schedule, averaged
    auto idle = acc.process_group().allgather(
        torch::tensor({schedule_s > 0 ? 1 - compute_s / schedule_s : 0.0}, torch::kDouble));
    double mean = 0;
    std::ostringstream ranks;
    for (size_t r = 0; r < idle.size(); ++r) {
      mean += idle[r].item<double>() / static_cast<double>(idle.size());
      ranks << (r ? "," : "") << idle[r].item<double>();
    }
    if (acc.is_main_process())
      std::cout << " measured_idle=" << mean << " measured_idle_ranks=" << ranks.str();
  }
  if (acc.is_main_process()) std::cout << std::endl;
  return 0;
}
