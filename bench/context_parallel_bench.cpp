// Context parallel: tokens/s and per-rank memory of one small Llama (tandem::models::
// LlamaForCausalLM: 2 layers, width 128, 4 query heads over 2 key/value heads, vocab 256)
// trained with AdamW on long sequences, against the context length:
//   context_parallel_bench plain  plain LibTorch, one process, the whole batch (the reference);
//   context_parallel_bench acc    the Accelerator under `tandem launch`: plain data parallel
//                                 (each rank whole sequences of its share of the batch), or
//                                 with --cp_size every sequence split over the cp ranks.
// Prints on rank 0 "RESULT context_parallel <name> tokens_per_s=<x> step_s=<t>
// peak_tensor_bytes=<max over ranks> peak_rss_bytes=<max over ranks of VmHWM> loss=<last step's>";
// peak tensor bytes from tandem's counting allocator over the timed steps, VmHWM over the whole
// process (model, prepare and loading included).
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <iostream>

#include "tandem/tandem.h"
#include "tandem/models/llama.h"
#include "timed_steps.h"

int main(int argc, char** argv) {
  tandem::track::install_counting_cpu_allocator();  // before any tensor exists
  CLI::App app("context_parallel_bench");
  std::string mode = "plain";
  int steps = 3, warmup = 1;
  int64_t batch = 1, seq_len = 1024;
  app.add_option("mode", mode)->check(CLI::IsMember({"plain", "acc"}));
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--warmup", warmup, "steps before the timed ones");
  app.add_option("--batch", batch, "global batch (sequences per step, over the dp ranks)");
  app.add_option("--seq_len", seq_len, "tokens per sequence");
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);
  tandem::models::LlamaConfig c;
  c.model_type = "qwen3";
  c.vocab_size = 256;
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.max_position_embeddings = seq_len;
  // Step i's global batch: ids [batch, seq_len], the same in every mode; labels the ids.
  auto global_batch = [&](int i) {
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(i + 1));
    return torch::randint(c.vocab_size, {batch, seq_len}, gen, torch::kLong);
  };
  torch::manual_seed(1);
  tandem::models::LlamaForCausalLM model(c);
  auto adamw = [](std::vector<torch::Tensor> params) {
    return std::make_shared<torch::optim::AdamW>(std::move(params), torch::optim::AdamWOptions(1e-4));
  };
  auto report = [&](const std::string& name, double s, int64_t tensor_peak, int64_t rss_peak,
                    double loss) {
    std::cout << "RESULT context_parallel " << name << " tokens_per_s=" << batch * seq_len * steps / s
              << " step_s=" << s / steps << " peak_tensor_bytes=" << tensor_peak
              << " peak_rss_bytes=" << rss_peak << " loss=" << loss << std::endl;
  };
  if (mode == "plain") {
    auto opt = adamw(model->parameters());
    double last = 0;
    const double s = bench::timed_steps(warmup, steps, [&](int i) {
      auto ids = global_batch(i);
      auto loss = model->loss(ids, ids);
      loss.backward();
      opt->step();
      opt->zero_grad();
      last = loss.item<double>();
    });
    report("plain", s, tandem::track::cpu_memory_stats().peak_bytes,
           tandem::track::resident_memory().peak_bytes, last);
    return 0;
  }
  tandem::Accelerator acc;
  model = acc.prepare(model);
  auto opt = acc.prepare(adamw(model->parameters()));
  const int dp = acc.data_parallel_group().size(), d = acc.data_parallel_group().rank();
  TORCH_CHECK(batch % dp == 0, "--batch ", batch, " does not split over ", dp, " dp ranks");
  double last = 0;
  const double s = bench::timed_steps(
      warmup, steps,
      [&](int i) {
        auto ids = global_batch(i).chunk(dp)[d];
        auto loss = model->loss(ids, ids);
        acc.backward(loss);
        opt.step();
        opt.zero_grad();
        last = acc.reduce(loss.detach()).item<double>();
      },
      [&] { acc.wait_for_everyone(); });
  auto peaks = acc.process_group().allgather(torch::tensor(
      {static_cast<int64_t>(tandem::track::cpu_memory_stats().peak_bytes),
       tandem::track::resident_memory().peak_bytes},
      torch::kLong));
  int64_t tensor_peak = 0, rss_peak = 0;
  for (const auto& p : peaks) {
    tensor_peak = std::max(tensor_peak, p[0].item<int64_t>());
    rss_peak = std::max(rss_peak, p[1].item<int64_t>());
  }
  const int cp = acc.topology().cp();
  if (acc.is_main_process())
    report(cp > 1 ? "cp" + std::to_string(cp) : "dp" + std::to_string(dp), s, tensor_peak,
           rss_peak, last);
  return 0;
}
