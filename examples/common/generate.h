// The body of the generation examples (generate_gpt2, generate_llm): greedy generation with a
// transformers checkpoint (config.json and safetensors as save_pretrained writes them, sharded or
// not), under a memory cap with disk offload (device maps), with weight-only int8/int4
// quantization, and data-parallel over the prompts under tandem launch. The model is any holder
// whose forward maps ids [1, T] to logits [1, T, vocab], with use_cache(bool) (a key/value cache
// fed one token at a time) and set_attention(kernel).
#pragma once

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "tandem/checkpoint/safetensors.h"
#include "tandem/inference/dispatch.h"
#include "tandem/inference/quantize.h"
#include "tandem/tandem.h"

namespace examples {

/// Greedy decoding of `prompt`: the argmax of the last position's logits, max_new_tokens times.
/// Returns the new ids; `step_logits` gets each step's last-position logits [vocab] and
/// `prompt_logits` the prompt's [T, vocab]. With `use_cache` false every step runs the whole
/// sequence again.
template <class Model>
std::vector<int64_t> generate_greedy(Model& model, const std::vector<int64_t>& prompt,
                                     int64_t max_new_tokens, bool use_cache,
                                     std::vector<torch::Tensor>* step_logits = nullptr,
                                     torch::Tensor* prompt_logits = nullptr) {
  torch::NoGradGuard no_grad;
  model->use_cache(use_cache);
  std::vector<int64_t> seq = prompt, out;
  auto ids_of = [](const std::vector<int64_t>& v) {
    return torch::tensor(v, torch::kLong).unsqueeze(0);
  };
  torch::Tensor logits = model(ids_of(seq)).to(torch::kCPU, torch::kFloat);  // [1, T, vocab]
  if (prompt_logits) *prompt_logits = logits[0].clone();
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    torch::Tensor last = logits[0][logits.size(1) - 1];
    if (step_logits) step_logits->push_back(last.clone());
    const int64_t next = last.argmax().item<int64_t>();
    out.push_back(next);
    seq.push_back(next);
    if (i + 1 == max_new_tokens) break;
    logits = (use_cache ? model(ids_of({next})) : model(ids_of(seq))).to(torch::kCPU, torch::kFloat);
  }
  model->use_cache(false);
  return out;
}

namespace generate_detail {

inline std::vector<int64_t> parse_ids(const std::string& text) {
  std::vector<int64_t> ids;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      size_t used = 0;
      ids.push_back(std::stoll(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      throw std::runtime_error("--prompt_ids '" + text + "': '" + item +
                               "' is not a token id (expected ids separated by commas)");
    }
  }
  if (ids.empty()) throw std::runtime_error("--prompt_ids is empty");
  return ids;
}

inline std::string join(const std::vector<int64_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

inline double mb(int64_t bytes) { return static_cast<double>(bytes) / 1e6; }

}  // namespace generate_detail

/// main() of a generation example named `name` for a model `family` ("GPT-2"): `build(dir,
/// described)` makes the model with empty weights (tandem::inference::init_empty_weights) from
/// the folder's config.json and says in `described` what it built ("GPT-2 12 x 768").
template <class Model>
int generate_main(const std::string& name, const std::string& family, int argc, char** argv,
                  const std::function<Model(const std::string& dir, std::string& described)>& build) {
  using generate_detail::join;
  using generate_detail::mb;
  using generate_detail::parse_ids;
  CLI::App app{name + ": greedy generation with a transformers " + family + " checkpoint"};
  std::string model_dir, attention = "auto", max_memory, offload_dir, policy = "auto",
                         quantize = "none", logits_out, device = "cpu";
  std::vector<std::string> prompts;
  int64_t max_new_tokens = 20, group_size = 128;
  bool no_cache = false, no_prefetch = false;
  app.add_option("model_dir", model_dir, "Directory with config.json and model.safetensors "
                 "(or model.safetensors.index.json and its shards)")->required();
  app.add_option("--prompt_ids", prompts, "A prompt's token ids, separated by commas; give it "
                 "once per prompt")->required();
  app.add_option("--max_new_tokens", max_new_tokens, "Tokens to generate per prompt")
      ->check(CLI::PositiveNumber);
  app.add_option("--attention", attention, "auto, sdpa (LibTorch's scaled_dot_product_attention, "
                 "2.0 and later) or manual");
  app.add_option("--device", device, "Where the model computes: cpu or cuda:<i>");
  app.add_option("--max_memory", max_memory, "Memory for the weights: a size (the CPU's, e.g. "
                 "64MB) or device=size entries (cuda:0=2GB,cpu=8GB); what does not fit stays on "
                 "disk and is read for each forward");
  app.add_option("--device_map", policy, "How --max_memory places the blocks: auto, balanced, "
                 "balanced_low_0 or sequential");
  app.add_option("--offload_dir", offload_dir, "Where offloaded weights are written when the "
                 "checkpoint cannot be read in their place");
  app.add_flag("--no_prefetch", no_prefetch, "Read an offloaded block only at its forward");
  app.add_option("--quantize", quantize, "none, int8 (per output channel) or int4 (grouped)");
  app.add_option("--group_size", group_size, "int4 group size: 32, 64, 128 or 256");
  app.add_flag("--no_cache", no_cache, "Recompute the whole sequence at every step");
  app.add_option("--logits_out", logits_out, "Write every prompt's logits (prompt positions and "
                 "each step) to this safetensors file (main process)");
  CLI11_PARSE(app, argc, argv);
  try {
    const auto before = tandem::track::resident_memory();
    tandem::Accelerator acc;
    if (acc.topology().tp() > 1 || acc.topology().pp() > 1 ||
        acc.distributed_type() == tandem::parallel::DistributedType::kFsdp ||
        acc.distributed_type() == tandem::parallel::DistributedType::kDeepSpeed)
      throw std::runtime_error(
          name + " runs data-parallel inference (each process generates its share of the "
          "prompts); the launch asks for " + tandem::parallel::to_string(acc.distributed_type()) +
          " with tp " + std::to_string(acc.topology().tp()) + " and pp " +
          std::to_string(acc.topology().pp()) + ": launch it without sharding, --tp_size or "
          "--pp_size");
    if (acc.mixed_precision() != "no")
      throw std::runtime_error(name + " computes in float32; the launch asks for mixed "
                               "precision " + acc.mixed_precision() + ": launch it without "
                               "--mixed_precision");
    const auto kernel = tandem::nn::parse_attention_kernel(attention);
    if (device != "cpu" && device.rfind("cuda:", 0) != 0)
      throw std::runtime_error("--device '" + device + "': expected cpu or cuda:<index>");
    if (device != "cpu" && !torch::cuda::is_available())
      throw std::runtime_error("--device " + device + ": no CUDA device is visible to this "
                               "process; use --device cpu");
    if (!max_memory.empty() && device != "cpu" && max_memory.find('=') == std::string::npos)
      throw std::runtime_error("--max_memory " + max_memory + " with --device " + device +
                               ": give each device's share (" + device + "=SIZE,cpu=SIZE)");
    if (max_memory.empty() && (policy != "auto" || !offload_dir.empty() || no_prefetch))
      throw std::runtime_error("--device_map, --offload_dir and --no_prefetch place the model "
                               "under --max_memory; give --max_memory");
    if (!logits_out.empty() && acc.num_processes() > 1)
      throw std::runtime_error("--logits_out writes one process's logits; run it in one process");
    if (group_size != 128 && quantize != "int4")
      throw std::runtime_error("--group_size applies to --quantize int4");

    auto saved_quantization = tandem::inference::checkpoint_quantization(model_dir);
    if (saved_quantization && quantize != "none")
      throw std::runtime_error("'" + model_dir + "' is already quantized (" +
                               saved_quantization->method() + "); leave out --quantize");
    std::string described;
    auto model = build(model_dir, described);
    model->eval();
    model->set_attention(kernel);
    if (saved_quantization) tandem::inference::quantize_model(*model, *saved_quantization);

    tandem::inference::DeviceMap map{{"", device}};
    if (!max_memory.empty())
      map = tandem::inference::infer_device_map(
          *model, tandem::inference::DeviceMapOptions()
                      .max_memory(tandem::inference::parse_max_memory(max_memory))
                      .policy(policy));
    bool on_disk = false;
    for (const auto& p : map) on_disk = on_disk || p.device == "disk";
    if (quantize != "none" && on_disk)
      throw std::runtime_error("--quantize " + quantize + " with blocks on disk (--max_memory " +
                               max_memory + "): quantize the checkpoint first (tandem quantize " +
                               model_dir + " OUT --" + quantize + ") and load OUT");
    auto placed = tandem::inference::load_checkpoint_and_dispatch(
        *model, model_dir, map,
        tandem::inference::DispatchOptions()
            .offload_dir(offload_dir)
            .prefetch(!no_prefetch)
            .main_device(device)
            .allow_dtype_cast(true));  // bf16/fp16 on disk: computed in float32
    std::string quantized;
    if (quantize != "none") {
      auto report = tandem::inference::quantize_model(
          *model, tandem::inference::QuantizeOptions().method(quantize).group_size(group_size));
      quantized = ", " + quantize + ": " + report.to_string();
    }
    for (const auto& m : model->modules())
      if (auto* q = dynamic_cast<tandem::inference::QuantizedLinearImpl*>(m.get())) {
        quantized += (quantized.empty() ? ", " : "; ") + q->options.method() + " matmul by " +
                     q->kernel(torch::Device(device), torch::kFloat);
        break;
      }
    const auto loaded = tandem::track::resident_memory();
    if (acc.is_main_process()) {
      std::cerr << name << ": " << described << ", attention " << tandem::nn::attention_kernel_name(kernel) << ", weights "
                << placed->summary() << quantized << "\n";
      if (!max_memory.empty()) {
        std::cerr << name << ": device map " << tandem::inference::describe_device_map(map)
                  << "\n";
        if (!offload_dir.empty() && placed->summary().find(offload_dir) == std::string::npos)
          std::cerr << name << ": offload_dir " << offload_dir
                    << " not needed: every offloaded weight is read from the checkpoint\n";
      }
    }

    // This process's share of the prompts: contiguous, as Accelerate's split_between_processes.
    const int world = acc.num_processes(), rank = acc.process_index();
    const size_t n = prompts.size();
    const size_t begin = n * static_cast<size_t>(rank) / static_cast<size_t>(world);
    const size_t end = n * static_cast<size_t>(rank + 1) / static_cast<size_t>(world);
    std::vector<std::string> lines;
    tandem::checkpoint::NamedTensors logits;
    const auto t0 = std::chrono::steady_clock::now();
    int64_t generated = 0;
    for (size_t i = begin; i < end; ++i) {
      std::vector<torch::Tensor> steps;
      torch::Tensor prompt_logits;
      auto ids = parse_ids(prompts[i]);
      auto out = generate_greedy(model, ids, max_new_tokens, !no_cache,
                                           logits_out.empty() ? nullptr : &steps,
                                           logits_out.empty() ? nullptr : &prompt_logits);
      generated += static_cast<int64_t>(out.size());
      lines.push_back("tokens: " + join(out));
      if (!logits_out.empty()) {
        logits.emplace_back("prompt" + std::to_string(i) + ".prompt", prompt_logits);
        logits.emplace_back("prompt" + std::to_string(i) + ".steps", torch::stack(steps));
      }
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::string mine;
    for (const auto& l : lines) mine += l + "\n";
    auto all = tandem::comm::gather_object(acc.process_group(), mine);
    const auto peak = tandem::track::resident_memory();
    std::ostringstream stats;
    stats << std::fixed << std::setprecision(1) << name << ": rank " << rank << ": "
          << generated << " tokens in " << seconds << " s ("
          << (seconds > 0 ? static_cast<double>(generated) / seconds : 0.0)
          << " tokens/s), peak resident memory " << mb(peak.peak_bytes) << " MB (before the "
          << "model " << mb(before.current_bytes) << " MB, after loading " << mb(loaded.current_bytes)
          << " MB)";
    if (on_disk) {
      const auto s = placed->stats();
      stats << ", disk reads " << s.loads << " (" << s.loads_read_ahead << " ahead, "
            << mb(s.bytes_read) << " MB, " << s.seconds_waited << " s waited), largest block "
            << mb(static_cast<int64_t>(placed->largest_offloaded_bytes())) << " MB";
    }
    auto all_stats = tandem::comm::gather_object(acc.process_group(), stats.str());
    if (acc.is_main_process()) {
      for (const auto& s : all_stats) std::cerr << s << "\n";
      for (const auto& part : all) std::cout << part;
      std::cout.flush();
    }
    if (!logits_out.empty()) tandem::checkpoint::save_safetensors(logits_out, logits);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << name << ": " << e.what() << "\n";
    return 1;
  }
}

}  // namespace examples
