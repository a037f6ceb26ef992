// Data-parallel training of a byte-level GPT on this project's own text.
//   tandem launch --num_processes 2 --cpu build/examples/train_gpt --steps 200
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>

#include "common/gpt.h"
#include "tandem/tandem.h"

int main(int argc, char** argv) {
  CLI::App app{"train_gpt: a byte-level GPT trained on this project's own text"};
  examples::GPTConfig cfg;
  int64_t steps = 200, batch = 8, accum = 1, eval_every = 100, eval_batches = 8;
  double lr = 3e-3;
  std::string mixed_precision;  // empty: the launcher's (TANDEM_MIXED_PRECISION), else "no"
  std::string data = TANDEM_SOURCE_DIR, text_file;
  app.add_option("--steps", steps, "Optimizer steps");
  app.add_option("--batch-size", batch, "Sequences per process per micro-step");
  app.add_option("--accumulate", accum, "Gradient accumulation steps");
  app.add_option("--mixed_precision", mixed_precision, "no, bf16, fp16, bf16-true, fp16-true, fp8");
  app.add_option("--lr", lr, "Learning rate (AdamW)");
  app.add_option("--context", cfg.context, "Context length");
  app.add_option("--layers", cfg.layers, "Transformer blocks");
  app.add_option("--heads", cfg.heads, "Attention heads");
  app.add_option("--width", cfg.width, "Embedding width");
  app.add_option("--eval-every", eval_every, "Evaluate every N steps (and at the end)");
  app.add_option("--eval-batches", eval_batches, "Held-out batches per process per evaluation");
  app.add_option("--source-tree", data, "Directory whose text to train on");
  app.add_option("--text", text_file, "A text file to train on instead");
  CLI11_PARSE(app, argc, argv);
  try {
    auto options = tandem::AcceleratorOptions().seed(1234).gradient_accumulation_steps(
        static_cast<int>(accum));
    if (!mixed_precision.empty()) options.mixed_precision(mixed_precision);
    tandem::Accelerator acc(options);
    std::string text;
    if (!text_file.empty()) {
      std::ifstream in(text_file, std::ios::binary);
      if (!in) throw std::runtime_error("cannot read --text " + text_file);
      text.assign(std::istreambuf_iterator<char>(in), {});
    } else {
      text = examples::project_text(data);
    }
    if (text.size() < static_cast<size_t>(20 * (cfg.context + 1)))
      throw std::runtime_error("too little text (" + std::to_string(text.size()) + " bytes) for " +
                               "context " + std::to_string(cfg.context));
    const size_t split = text.size() * 9 / 10;
    examples::ByteWindows train(text, cfg.context, 0, split), held_out(text, cfg.context, split, text.size());

    auto model = acc.prepare(examples::GPT(cfg));
    auto opt = acc.prepare(std::make_shared<torch::optim::AdamW>(
        model->parameters(), torch::optim::AdamWOptions(lr).weight_decay(0.01)));
    auto loader = acc.prepare_data_loader(
        train, tandem::data::DataLoaderOptions().batch_size(batch).shuffle(true).seed(7));
    acc.print("GPT with", model->num_parameters(), "parameters in", acc.mixed_precision(), "precision;", text.size(), "bytes of text;",
              acc.num_processes(), "processes");

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
        auto loss = model->loss_per_sample(b.data, b.target).mean();
        acc.backward(loss);
        acc.clip_grad_norm_(model->parameters(), 1.0);
        opt.step();
        opt.zero_grad();
        tokens += b.data.numel() * acc.num_processes();
        if (!acc.sync_gradients()) continue;
        last_loss = acc.reduce(loss.detach()).item<double>();
        if (first_loss < 0) first_loss = last_loss;
        bar.update(++step, last_loss);
        if (step % eval_every == 0 || step == steps) {
          auto [eval_loss, n] = evaluate();
          double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          acc.print("step", step, "train loss", last_loss, "held-out loss", eval_loss, "over", n,
                    "sequences,", static_cast<int64_t>(tokens / secs), "tokens/s");
        }
        if (step >= steps) break;
      }
    }
    bar.close();
    acc.print("loss fell from", first_loss, "to", last_loss);
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
  return 0;
}
