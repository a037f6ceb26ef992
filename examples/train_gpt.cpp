// Training of a byte-level GPT on this project's own text, under every layout tandem launch
// gives it: data parallel, ZeRO 1-3, tensor parallel (--tp_size), pipeline parallel (--pp_size)
// and their combinations.
//   tandem launch --num_processes 2 --cpu build/examples/train_gpt --steps 200
//   tandem launch --num_processes 4 --cpu --tp_size 2 --pp_size 2 build/examples/train_gpt
// Settings the launcher gives (accumulation, precision, layout) hold unless a flag here is given.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>

#include "common/gpt.h"
#include "common/resident.h"
#include "tandem/tandem.h"

int main(int argc, char** argv) {
  CLI::App app{"train_gpt: a byte-level GPT trained on this project's own text"};
  examples::GPTConfig cfg;
  int64_t steps = 200, batch = 8, accum = 1, eval_every = 100, eval_batches = 8;
  int tp_size = 1, pp_size = 1, microbatches = 0;
  double lr = 3e-3;
  std::string mixed_precision;  // empty: the launcher's (TANDEM_MIXED_PRECISION), else "no"
  std::string data = TANDEM_SOURCE_DIR, text_file, project_dir;
  std::vector<std::string> log_with;
  app.add_option("--steps", steps, "Optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch, "Sequences per data-parallel rank per micro-step")
      ->check(CLI::PositiveNumber);
  auto* accum_opt = app.add_option("--accumulate", accum,
                                   "Gradient accumulation steps (default: the launcher's "
                                   "--gradient_accumulation_steps, else 1)")
                        ->check(CLI::PositiveNumber);
  app.add_option("--mixed_precision", mixed_precision, "no, bf16, fp16, bf16-true, fp16-true, fp8");
  auto* tp_opt = app.add_option("--tp_size", tp_size,
                                "Tensor-parallel size (default: the launcher's --tp_size, else 1)")
                     ->check(CLI::PositiveNumber);
  auto* pp_opt = app.add_option("--pp_size", pp_size,
                                "Pipeline stages (default: the launcher's --pp_size, else 1)")
                     ->check(CLI::PositiveNumber);
  app.add_option("--microbatches", microbatches,
                 "Pipeline micro-batches per step (default: the number of stages); they must "
                 "divide --batch-size")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "Learning rate (AdamW)");
  app.add_option("--context", cfg.context, "Context length")->check(CLI::PositiveNumber);
  app.add_option("--layers", cfg.layers, "Transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--heads", cfg.heads, "Attention heads")->check(CLI::PositiveNumber);
  app.add_option("--width", cfg.width, "Embedding width")->check(CLI::PositiveNumber);
  app.add_option("--eval-every", eval_every, "Evaluate every N steps and at the end (0: only at the end)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--eval-batches", eval_batches, "Held-out batches per process per evaluation");
  app.add_option("--source-tree", data, "Directory whose text to train on");
  app.add_option("--text", text_file, "A text file to train on instead");
  app.add_option("--log_with", log_with,
                 "Trackers that record the losses: jsonl, csv, tensorboard or all (default: none)")
      ->delimiter(',');
  app.add_option("--project_dir", project_dir,
                 "Where the trackers write (<dir>/logs/train_gpt/); needs --log_with");
  CLI11_PARSE(app, argc, argv);
  if (!project_dir.empty() && log_with.empty()) {
    std::cerr << "--project_dir " << project_dir << " is where --log_with's trackers write: give "
              << "--log_with jsonl (or csv, tensorboard, all)\n";
    return 2;
  }
  try {
    auto options = tandem::AcceleratorOptions().seed(1234);
    if (!log_with.empty()) options.log_with(log_with);
    if (!project_dir.empty()) options.project_dir(project_dir);
    if (accum_opt->count()) options.gradient_accumulation_steps(static_cast<int>(accum));
    if (!mixed_precision.empty()) options.mixed_precision(mixed_precision);
    if (tp_opt->count() || pp_opt->count()) {
      auto shape = tandem::config::mesh_shape_from_env(tandem::current_environment());
      if (tp_opt->count()) shape.tp_size(tp_size);
      if (pp_opt->count()) shape.pp_size(pp_size);
      options.parallelism(shape);
    }
    tandem::Accelerator acc(options);
    const int tp = acc.topology().tp(), pp = acc.topology().pp();
    const int dp = acc.data_parallel_group().size();
    const std::string text = text_file.empty() ? examples::project_text(data)
                                                 : examples::read_text_file(text_file);
    if (text.size() < static_cast<size_t>(20 * (cfg.context + 1)))
      throw std::runtime_error("too little text (" + std::to_string(text.size()) + " bytes) for " +
                               "context " + std::to_string(cfg.context));
    const size_t split = text.size() * 9 / 10;
    examples::ByteWindows train(text, cfg.context, 0, split), held_out(text, cfg.context, split, text.size());

    // The model as the layout needs it: the GPT (head tied to the token embedding), split by its
    // tensor-parallel plan under tp; under pp the same blocks as a Sequential (untied head),
    // this rank's stage of it, split over tp too when tp > 1.
    examples::GPT model{nullptr};
    std::shared_ptr<tandem::parallel::Pipeline> pipeline;
    std::shared_ptr<torch::nn::Module> trained;
    if (pp > 1) {
      if (microbatches == 0) microbatches = pp;
      if (batch % microbatches != 0)
        throw std::runtime_error("--batch-size " + std::to_string(batch) +
                                 " must be a multiple of --microbatches " +
                                 std::to_string(microbatches));
      auto tp_group = tp > 1 ? acc.topology().group("tp") : nullptr;
      auto loss = [tp_group](const torch::Tensor& logits, const torch::Tensor& targets) {
        return examples::gpt_sequential_loss(logits, targets, tp_group);
      };
      auto popts = tandem::parallel::PipelineOptions().microbatches(microbatches);
      pipeline = tp > 1 ? acc.prepare_pipeline(examples::gpt_sequential(cfg), loss, popts,
                                               examples::gpt_sequential_tensor_parallel_plan())
                        : acc.prepare_pipeline(examples::gpt_sequential(cfg), loss, popts);
      trained = pipeline->module();
      acc.print("pipeline: schedule " + tandem::parallel::to_string(pipeline->schedule()) + ", " +
                std::to_string(pipeline->virtual_stages()) + " stage(s) per rank, " +
                std::to_string(microbatches) + " micro-batches");
    } else {
      // Under ZeRO-3 each block is sharded as it is built: no rank holds the dense model.
      // Tensor parallel splits the dense layers, so it builds them whole.
      model = tp > 1 ? examples::GPT(cfg) : acc.build([&] { return examples::GPT(cfg); });
      if (tp > 1) acc.parallelize(*model, examples::gpt_tensor_parallel_plan());
      model = acc.prepare(model);
      trained = model.ptr();
    }
    auto opt = acc.prepare(std::make_shared<torch::optim::AdamW>(
        trained->parameters(), torch::optim::AdamWOptions(lr).weight_decay(0.01)));
    auto loader = acc.prepare_data_loader(
        train, tandem::data::DataLoaderOptions().batch_size(batch).shuffle(true).seed(7));
    acc.print("GPT with", examples::gpt_parameter_count(cfg, /*tied_head=*/pp == 1), "parameters in", acc.mixed_precision(), "precision;",
              text.size(), "bytes of text;", acc.num_processes(), "processes (dp", dp, "x tp", tp,
              "x pp", std::to_string(pp) + ")");
    if (pp > 1)
      acc.print("pipeline: the held-out evaluation is skipped (a pipeline runs training steps "
                "only); the head is untied from the token embedding, as stages need");

    auto evaluate = [&]() {
      torch::NoGradGuard no_grad;
      auto autocast = acc.autocast();  // as in training (nested inside accumulate() it is a no-op)
      model->eval();
      auto eval = acc.prepare_data_loader(held_out, tandem::data::DataLoaderOptions().batch_size(batch));
      double sum = 0;
      int64_t count = 0, k = 0;
      for (auto& b : *eval) {
        if (k++ >= eval_batches) break;
        auto losses = acc.gather_for_metrics(model->loss_per_sample(b.data, b.target));
        sum += losses.sum().item<double>();
        count += losses.size(0);
      }
      model->train();
      return std::make_pair(sum / std::max<int64_t>(1, count), count);
    };

    if (!log_with.empty())
      acc.init_trackers("train_gpt", {{"lr", lr}, {"width", cfg.width}, {"layers", cfg.layers},
                                      {"heads", cfg.heads}, {"context", cfg.context},
                                      {"batch_size", batch}, {"steps", steps}});
    tandem::track::ProgressBar bar(tandem::track::ProgressOptions()
                                       .total(steps)
                                       .description("train_gpt")
                                       .is_main_process(acc.is_main_process()));
    int64_t step = 0, tokens = 0;
    auto start = std::chrono::steady_clock::now();
    double first_loss = -1, last_loss = 0;
    for (int64_t epoch = 0; step < steps; ++epoch) {
      loader->set_epoch(epoch);
      for (auto& b : *loader) {
        auto scope = acc.accumulate();  // autocast on for this micro-step, in bf16/fp16 modes
        torch::Tensor loss;
        if (pipeline) {
          loss = torch::tensor(pipeline->step(b.data, b.target));  // mean over dp, every rank
        } else {
          loss = model->loss_per_sample(b.data, b.target).mean();
          acc.backward(loss);
        }
        acc.clip_grad_norm_(trained->parameters(), 1.0);
        opt.step();
        opt.zero_grad();
        tokens += b.data.numel() * dp;
        if (!acc.sync_gradients()) continue;
        last_loss = acc.reduce(loss.detach()).item<double>();
        if (first_loss < 0) first_loss = last_loss;
        bar.update(++step, last_loss);
        if (!log_with.empty()) acc.log({{"loss", last_loss}}, step);
        if ((eval_every > 0 && step % eval_every == 0) || step == steps) {
          double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          if (pipeline) {
            acc.print("step", step, "train loss", last_loss, static_cast<int64_t>(tokens / secs),
                      "tokens/s");
          } else {
            auto [eval_loss, n] = evaluate();
            if (!log_with.empty()) acc.log({{"eval_loss", eval_loss}}, step);
            acc.print("step", step, "train loss", last_loss, "held-out loss", eval_loss, "over", n,
                      "sequences,", static_cast<int64_t>(tokens / secs), "tokens/s");
          }
        }
        if (step >= steps) break;
      }
    }
    bar.close();
    if (!log_with.empty()) acc.end_training();
    acc.print("loss", last_loss < first_loss ? "fell" : "rose", "from", first_loss, "to", last_loss);
    examples::print_peak_resident(acc);
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
  return 0;
}
