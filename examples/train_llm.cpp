// Pretraining or fine-tuning a Llama-family model (llama, mistral, qwen2, qwen3: tandem/models/llama.h)
// under every layout tandem launch gives it: data parallel, ZeRO 1-3 (FSDP), tensor parallel
// (--tp_size), pipeline parallel (--pp_size, --microbatches; Note [Llama pipeline stages]),
// context parallel (--cp_size: every sequence split over the cp ranks, ring attention), expert
// parallel for the mixtures (--ep_size: each layer's experts split over ep data-parallel ranks,
// tokens sent to them by all-to-all), their combinations, activation checkpointing, mixed
// precision, accumulation.
//
//   train_llm                                   a small byte-level Llama on this project's text
//   train_llm --text book.txt                   ... on a file's bytes
//   train_llm --config config.json              pretrain that model from scratch
//   train_llm --model Qwen3-0.6B --data train.jsonl --save out/   fine-tune a save_pretrained folder
//   tandem launch --num_processes 4 --cpu --use_fsdp --tp_size 2 build/examples/train_llm ...
//   tandem launch --num_processes 4 --cpu --pp_size 2 --tp_size 2 build/examples/train_llm --config c.json
//   tandem launch --num_processes 4 --cpu --cp_size 2 build/examples/train_llm --seq_len 512
//   tandem launch --num_processes 4 --cpu --ep_size 2 build/examples/train_llm --model qwen3-moe/
//
// Data: token ids in a flat binary file (uint16 or uint32, as llm.c and nanoGPT write them; cut
// into windows of --seq_len), or JSONL lines {"input_ids": [...], "labels": [...]} (labels
// optional, -100 leaves a position out; shorter lines padded with labels -100). The loss is
// transformers' causal-LM loss; AdamW with linear warm-up and cosine decay to --min_lr_ratio,
// gradient clipping. Each report gives tokens/s and the model FLOPs utilisation: 6 N + 12 L H Q T
// FLOPs per token (N the parameters outside the embedding, L layers, H heads, Q head size, T the
// sequence length) over the step time and the peak (--peak_tflops, a table of NVIDIA GPUs, or a
// matrix product measured on the CPU). --save writes a folder transformers loads. With --lora_r
// only LoRA adapters train, and --save writes PEFT's adapter files. --checkpoint_every N saves the
// whole training state into --project_dir/checkpoints (in the background with
// --checkpoint_async), and --resume continues from the latest one, on this run's layout whatever
// the saved one was.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/gpt.h"
#include "common/resident.h"
#include "tandem/models/llama.h"
#include "tandem/peft/lora.h"
#include "tandem/tandem.h"

namespace {

namespace models = tandem::models;

/// Windows of `seq_len` ids from one long sequence; labels are the ids (the loss shifts them).
class TokenWindows : public torch::data::datasets::Dataset<TokenWindows> {
 public:
  TokenWindows(torch::Tensor ids, int64_t seq_len) : ids_(std::move(ids)), seq_len_(seq_len) {}
  torch::data::Example<> get(size_t i) override {
    auto w = ids_.slice(0, static_cast<int64_t>(i) * seq_len_, (static_cast<int64_t>(i) + 1) * seq_len_);
    return {w, w};
  }
  torch::optional<size_t> size() const override {
    return static_cast<size_t>(ids_.size(0) / seq_len_);
  }

 private:
  torch::Tensor ids_;
  int64_t seq_len_;
};

/// Examples given whole: ids [n, seq_len] and labels [n, seq_len].
class TokenRows : public torch::data::datasets::Dataset<TokenRows> {
 public:
  TokenRows(torch::Tensor ids, torch::Tensor labels) : ids_(std::move(ids)), labels_(std::move(labels)) {}
  torch::data::Example<> get(size_t i) override {
    return {ids_[static_cast<int64_t>(i)], labels_[static_cast<int64_t>(i)]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(ids_.size(0)); }

 private:
  torch::Tensor ids_, labels_;
};

torch::Tensor read_bin(const std::string& path, const std::string& dtype) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("--data " + path + ": cannot read it");
  in.seekg(0, std::ios::end);
  std::string bytes(static_cast<size_t>(in.tellg()), '\0');
  in.seekg(0);
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!in) throw std::runtime_error("--data " + path + ": reading it failed");
  const int64_t width = dtype == "uint32" ? 4 : 2;
  if (bytes.size() % width != 0)
    throw std::runtime_error("--data " + path + ": " + std::to_string(bytes.size()) +
                             " bytes is not a whole number of " + dtype + " ids (--data_dtype)");
  const int64_t n = static_cast<int64_t>(bytes.size()) / width;
  auto out = torch::empty({n}, torch::kLong);
  auto* o = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (width == 2) {
      uint16_t v;
      std::memcpy(&v, bytes.data() + 2 * i, 2);
      o[i] = v;
    } else {
      uint32_t v;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      o[i] = v;
    }
  }
  return out;
}

std::pair<torch::Tensor, torch::Tensor> read_jsonl(const std::string& path, int64_t seq_len,
                                                   int64_t pad_id) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("--data " + path + ": cannot read it");
  std::vector<torch::Tensor> ids, labels;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto where = path + ":" + std::to_string(n);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      throw std::runtime_error(where + ": not JSON (" + e.what() + ")");
    }
    if (!j.contains("input_ids") || !j["input_ids"].is_array())
      throw std::runtime_error(where + ": expected {\"input_ids\": [...], \"labels\": [...]}");
    auto in_ids = j["input_ids"].get<std::vector<int64_t>>();
    auto in_labels = j.contains("labels") ? j["labels"].get<std::vector<int64_t>>() : in_ids;
    if (in_labels.size() != in_ids.size())
      throw std::runtime_error(where + ": labels and input_ids differ in length");
    if (static_cast<int64_t>(in_ids.size()) > seq_len)
      throw std::runtime_error(where + ": " + std::to_string(in_ids.size()) +
                               " ids, more than --seq_len " + std::to_string(seq_len) +
                               "; raise --seq_len or cut the line");
    auto row = torch::full({seq_len}, pad_id, torch::kLong);
    auto lab = torch::full({seq_len}, -100, torch::kLong);
    for (size_t i = 0; i < in_ids.size(); ++i) {
      row[static_cast<int64_t>(i)] = in_ids[i];
      lab[static_cast<int64_t>(i)] = in_labels[i];
    }
    ids.push_back(row);
    labels.push_back(lab);
  }
  if (ids.empty()) throw std::runtime_error("--data " + path + ": no examples");
  return {torch::stack(ids), torch::stack(labels)};
}

/// Linear warm-up from 0, then cosine decay to min_ratio of the base rate (transformers'
/// get_cosine_with_min_lr_schedule_with_warmup): the rate of optimizer step s.
class WarmupCosine : public torch::optim::LRScheduler {
 public:
  WarmupCosine(torch::optim::Optimizer& opt, int64_t warmup, int64_t total, double min_ratio)
      : LRScheduler(opt), warmup_(warmup), total_(total), min_ratio_(min_ratio) {
    for (auto& g : opt.param_groups()) base_.push_back(g.options().get_lr());
    for (size_t i = 0; i < base_.size(); ++i) opt.param_groups()[i].options().set_lr(base_[i] * factor(0));
  }
  double factor(int64_t s) const {
    if (s < warmup_) return static_cast<double>(s) / std::max<int64_t>(1, warmup_);
    const double progress =
        static_cast<double>(s - warmup_) / std::max<int64_t>(1, total_ - warmup_);
    const double cosine = 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, progress)));
    return cosine * (1.0 - min_ratio_) + min_ratio_;
  }

 protected:
  std::vector<double> get_lrs() override {
    std::vector<double> out;
    for (double b : base_) out.push_back(b * factor(static_cast<int64_t>(step_count_) + 1));
    return out;
  }

 private:
  int64_t warmup_, total_;
  double min_ratio_;
  std::vector<double> base_;
};

/// Dense bf16 peak of NVIDIA GPUs by name (TFLOP/s, without sparsity), 0 when unknown.
double gpu_peak_tflops(const std::string& name) {
  const std::vector<std::pair<std::string, double>> table{
      {"H200", 989}, {"H100", 989}, {"H800", 989}, {"GH200", 989}, {"B200", 2250}, {"A100", 312},
      {"A800", 312}, {"L40S", 362}, {"L40", 181}, {"L4", 121}, {"A10", 125}, {"A6000", 155},
      {"V100", 125}, {"4090", 165}, {"3090", 71}, {"T4", 65}};
  for (const auto& [key, peak] : table)
    if (name.find(key) != std::string::npos) return peak;
  return 0;
}

/// The NVIDIA driver's name of the first GPU ("NVIDIA H200"), or "" when the driver does not say.
std::string nvidia_gpu_name() {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", ec)) {
    std::ifstream in(e.path() / "information");
    std::string line;
    while (std::getline(in, line))
      if (line.rfind("Model:", 0) == 0) return line.substr(line.find_first_not_of(" \t", 6));
  }
  return "";
}

/// This process's float32 matrix-product rate (TFLOP/s) on the CPU, measured.
double cpu_peak_tflops() {
  torch::NoGradGuard no_grad;
  auto a = torch::randn({512, 512}), b = torch::randn({512, 512});
  auto c = torch::mm(a, b);  // warm-up
  const int reps = 8;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) c = torch::mm(a, b);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * 512 * 512 * 512 * reps / secs / 1e12;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"train_llm: pretrain or fine-tune a Llama-family model (llama, mistral, qwen2, qwen3)"};
  std::string model_dir, config_file, data, data_dtype = "uint16", save_dir, save_dtype, mixed_precision;
  std::string source_tree = TANDEM_SOURCE_DIR, text_file;
  int64_t steps = 20, batch = 4, seq_len = 64, warmup = 0, log_every = 5, pad_id = 0;
  int64_t microbatches = 0;
  double lr = 3e-3, min_lr_ratio = 0.1, weight_decay = 0.0, clip = 1.0, peak_tflops = 0;
  bool shuffle = false, checkpoint_async = false, resume = false;
  int64_t checkpoint_every = 0;
  int total_limit = 0;
  app.add_option("--model", model_dir, "A save_pretrained folder to fine-tune (config.json and weights)");
  app.add_option("--config", config_file, "A config.json to pretrain from scratch");
  app.add_option("--data", data, "Token ids: a .bin of uint16/uint32 ids, or .jsonl lines "
                 "{\"input_ids\": [...], \"labels\": [...]} (default: this project's text as bytes)");
  app.add_option("--data_dtype", data_dtype, "Ids in a .bin: uint16 or uint32")
      ->check(CLI::IsMember({"uint16", "uint32"}));
  app.add_option("--pad_id", pad_id, "The id .jsonl lines shorter than --seq_len are padded with");
  app.add_option("--seq_len", seq_len, "Tokens per sequence")->check(CLI::PositiveNumber);
  app.add_option("--batch_size", batch, "Sequences per data-parallel rank per micro-step")
      ->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "Optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--microbatches", microbatches, "Pipeline micro-batches per batch (default: the "
                 "stages; under the launcher's --pp_size)")->check(CLI::NonNegativeNumber);
  app.add_option("--lr", lr, "Peak learning rate (AdamW)");
  app.add_option("--warmup_steps", warmup, "Linear warm-up steps")->check(CLI::NonNegativeNumber);
  app.add_option("--min_lr_ratio", min_lr_ratio, "Where the cosine decay ends, as a fraction of --lr "
                 "(1: a constant rate after warm-up)")->check(CLI::Range(0.0, 1.0));
  app.add_option("--weight_decay", weight_decay, "AdamW's decoupled weight decay");
  app.add_option("--clip", clip, "Gradient-norm clipping (0: none)")->check(CLI::NonNegativeNumber);
  app.add_flag("--shuffle", shuffle, "Shuffle the examples each epoch");
  app.add_option("--mixed_precision", mixed_precision, "no, bf16, fp16, bf16-true, fp16-true (default: the launcher's)");
  app.add_option("--log_every", log_every, "Report every N steps (and at the end)")->check(CLI::PositiveNumber);
  app.add_option("--peak_tflops", peak_tflops, "The device's peak for the FLOPs utilisation "
                 "(default: a table of NVIDIA GPUs; on CPUs a measured matrix product)");
  app.add_option("--save", save_dir, "Write the trained model here as transformers' folder");
  app.add_option("--checkpoint_every", checkpoint_every, "Save the training state (model, "
                 "optimizer, schedule, data position, random states) every N optimizer steps "
                 "into --project_dir/checkpoints")->check(CLI::NonNegativeNumber);
  app.add_flag("--checkpoint_async", checkpoint_async, "Write those checkpoints from a background "
               "thread while training goes on");
  app.add_option("--total_limit", total_limit, "Keep at most this many checkpoints (0: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--resume", resume, "Continue from the latest checkpoint under --project_dir (saved "
               "on any layout)");
  app.add_option("--save_dtype", save_dtype, "Weights' dtype in --save: float32, bfloat16, float16 "
                 "(default: the model's)")->check(CLI::IsMember({"", "float32", "bfloat16", "float16"}));
  std::vector<std::string> log_with;
  std::string project_dir;
  app.add_option("--log_with", log_with, "Trackers that record loss, tokens/s and MFU: jsonl, csv, "
                 "tensorboard or all (default: none)")->delimiter(',');
  app.add_option("--project_dir", project_dir, "Where the trackers write "
                 "(<dir>/logs/train_llm/); needs --log_with");
  tandem::peft::LoraOptions lora;
  lora.r(0);
  std::string lora_adapter;
  std::vector<std::string> lora_targets{"q_proj", "v_proj"};
  double lora_alpha = 16, lora_dropout = 0;
  int64_t lora_r = 0;
  app.add_option("--lora_r", lora_r, "LoRA: the adapters' rank (0: train every weight)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--lora_alpha", lora_alpha, "LoRA: the adapters' scale is alpha / r");
  app.add_option("--lora_dropout", lora_dropout, "LoRA: dropout on the adapters' input");
  app.add_option("--lora_targets", lora_targets, "LoRA: the layers that get adapters")
      ->delimiter(',');
  app.add_option("--lora_adapter", lora_adapter, "LoRA: start from this adapter (PEFT's files; "
                 "its adapter_config.json sets r, alpha, dropout and targets)");
  app.add_option("--source-tree", source_tree, "Directory whose text is the default data");
  app.add_option("--text", text_file, "A text file whose bytes are the data instead");
  CLI11_PARSE(app, argc, argv);
  const bool checkpoints = checkpoint_every > 0 || resume;
  if (!project_dir.empty() && log_with.empty() && !checkpoints) {
    std::cerr << "--project_dir " << project_dir << " is where --log_with's trackers and "
              << "--checkpoint_every's checkpoints write: give --log_with jsonl (or csv, "
              << "tensorboard, all), --checkpoint_every N or --resume\n";
    return 2;
  }
  if (checkpoints && project_dir.empty()) {
    std::cerr << (resume ? "--resume" : "--checkpoint_every") << " needs --project_dir: the "
              << "checkpoints live in its checkpoints/ folder\n";
    return 2;
  }
  if ((checkpoint_async || total_limit > 0) && checkpoint_every == 0) {
    std::cerr << (checkpoint_async ? "--checkpoint_async" : "--total_limit")
              << " applies to --checkpoint_every's checkpoints: give --checkpoint_every N\n";
    return 2;
  }
  if (!text_file.empty() && !data.empty()) {
    std::cerr << "--text and --data both given: --text trains on a file's bytes, --data on token "
                 "ids; give one\n";
    return 2;
  }
  if (!model_dir.empty() && !config_file.empty()) {
    std::cerr << "--model and --config both given: --model fine-tunes a folder (its config.json "
                 "included), --config pretrains from scratch; give one\n";
    return 2;
  }
  try {
    if (!lora_adapter.empty()) {
      lora = tandem::peft::read_adapter_config(lora_adapter);
      if (lora_r > 0 && lora_r != lora.r()) {
        std::cerr << "--lora_r " << lora_r << " and --lora_adapter " << lora_adapter
                  << " (r " << lora.r() << ") disagree; the adapter's settings hold: drop --lora_r\n";
        return 2;
      }
    } else if (lora_r > 0) {
      lora.r(lora_r).alpha(lora_alpha).dropout(lora_dropout).target_modules(lora_targets);
    }
    models::LlamaConfig cfg;
    if (!model_dir.empty()) {
      cfg = models::LlamaConfig::from_file(model_dir + "/config.json");
    } else if (!config_file.empty()) {
      cfg = models::LlamaConfig::from_file(config_file);
    } else {
      cfg = models::LlamaConfig::from_json_text(
          R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 176,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 1024, "tie_word_embeddings": true})",
          "the default model");
    }
    auto options = tandem::AcceleratorOptions().seed(1234);
    if (!mixed_precision.empty()) options.mixed_precision(mixed_precision);
    if (!log_with.empty()) options.log_with(log_with);
    if (!project_dir.empty()) options.project_dir(project_dir);
    options.checkpoint_every_steps(checkpoint_every).checkpoint_async(checkpoint_async).total_limit(total_limit);
    // A mixture of experts leaves the experts no token chose without a gradient in a step.
    if (cfg.num_experts > 0) options.find_unused_parameters(true);
    tandem::Accelerator acc(options);
    const int tp = acc.topology().tp(), pp = acc.topology().pp(), cp = acc.topology().cp();
    const int dp = acc.data_parallel_group().size();
    const int ep = acc.expert_parallel()->size();
    models::check_llama_tensor_parallel(cfg, tp);
    if (pp > 1) {
      // Note [Llama pipeline stages]: what stages cannot hold, said before anything is built.
      if (lora.r() > 0 && tp > 1)
        throw tandem::Refused("train_llm: LoRA under --pp_size " + std::to_string(pp) +
                              " x --tp_size " + std::to_string(tp) +
                              ": adapters go on pipeline stages or on tensor-parallel layers, "
                              "not yet on both; drop one of the two for a LoRA run");
      if (microbatches == 0) microbatches = pp;
      if (batch % microbatches != 0)
        throw tandem::Refused("train_llm: --batch_size " + std::to_string(batch) +
                              " is not a multiple of --microbatches " +
                              std::to_string(microbatches) + " (the pipeline's micro-batches)");
    } else if (microbatches != 0) {
      throw tandem::Refused("train_llm: --microbatches " + std::to_string(microbatches) +
                            " splits a pipeline's batch, and this run has no pipeline: give "
                            "--pp_size (or the launcher's), or leave --microbatches out");
    }

    // The data, the same on every rank (the loader gives each its share).
    std::shared_ptr<TokenWindows> windows;
    std::shared_ptr<TokenRows> rows;
    if (data.empty()) {
      if (cfg.vocab_size < 256)
        throw tandem::Refused("train_llm: the default data is bytes (ids 0-255), and the model's "
                              "vocab_size is " + std::to_string(cfg.vocab_size) + "; give --data");
      std::string text = text_file.empty() ? examples::project_text(source_tree)
                                             : examples::read_text_file(text_file);
      auto ids = torch::from_blob(text.data(), {static_cast<int64_t>(text.size())}, torch::kUInt8)
                     .to(torch::kLong);
      windows = std::make_shared<TokenWindows>(ids, seq_len);
    } else if (data.size() > 6 && data.substr(data.size() - 6) == ".jsonl") {
      auto [ids, labels] = read_jsonl(data, seq_len, pad_id);
      rows = std::make_shared<TokenRows>(ids, labels);
    } else {
      windows = std::make_shared<TokenWindows>(read_bin(data, data_dtype), seq_len);
    }
    const int64_t examples_count =
        static_cast<int64_t>(windows ? *windows->size() : *rows->size());
    if (examples_count < batch * dp)
      throw tandem::Refused("train_llm: " + std::to_string(examples_count) + " examples of " +
                            std::to_string(seq_len) + " tokens, fewer than one global batch (" +
                            std::to_string(batch * dp) + "); give more data or a smaller batch");

    // The model as the layout needs it.
    models::LlamaForCausalLM model{nullptr};
    std::vector<torch::Tensor> adapters;
    std::shared_ptr<tandem::parallel::Pipeline> pipeline;
    std::shared_ptr<torch::nn::Module> trained;
    const auto load_options = tandem::checkpoint::LoadOptions().allow_dtype_cast(true);
    // A pipeline, LoRA and tensor parallel start from the whole model on every rank, loaded
    // before they cut or adapt it; the others build it through acc.build (under ZeRO-3 each
    // layer is sharded as it is made) and load into it once prepared.
    // Note [Expert parallel]: the whole model too, whose prepare keeps this rank's experts.
    const bool whole = pp > 1 || lora.r() > 0 || tp > 1 || ep > 1;
    if (whole) {
      model = models::LlamaForCausalLM(cfg);
      if (!model_dir.empty()) tandem::checkpoint::load_model(*model, model_dir, load_options);
    } else {
      model = acc.build([&] { return models::LlamaForCausalLM(cfg); });
    }
    // LoRA: the base gets its adapters before prepare, so that every strategy sees the frozen
    // and the trainable parameters as they are; under tp after the split, so that each adapter
    // splits as its layer (Note [LoRA under tensor parallel]); under a pipeline before the
    // stages are cut, so that each stage keeps its layers' adapters.
    auto add_lora = [&] {
      if (lora.r() <= 0) return;
      if (lora.base_model_name_or_path().empty()) lora.base_model_name_or_path(model_dir);
      adapters = tandem::peft::apply_lora(*model, lora);
      if (!lora_adapter.empty()) tandem::peft::load_adapter(*model, lora_adapter);
    };
    if (pp > 1) {
      add_lora();
      // Note [Llama pipeline stages]: the whole model as a Sequential; this rank keeps its
      // stage of it, split over tp too.
      // Note [Context parallel beside a pipeline]: under cp the stages compute this rank's
      // chunks of each sequence, and the loss is that of the chunks (the labels stay whole).
      auto cp_group = cp > 1 ? acc.context_parallel() : nullptr;
      auto loss = [cp_group](const torch::Tensor& logits, const torch::Tensor& labels) {
        return cp_group ? models::context_parallel_causal_lm_loss(*cp_group, logits, labels)
                        : models::causal_lm_loss(logits, labels);
      };
      // Note [Pipeline checkpoint names]: the stages' tensors under transformers' names in the
      // checkpoints and the saved model, so that they resume on every other layout.
      auto popts = tandem::parallel::PipelineOptions()
                       .microbatches(static_cast<int>(microbatches))
                       .checkpoint_names([cfg](const std::string& path) {
                         return models::llama_name_of_sequential(cfg, path);
                       });
      auto seq = models::llama_sequential(model);
      pipeline = tp > 1 ? acc.prepare_pipeline(seq, loss, popts,
                                               models::llama_sequential_tensor_parallel_plan(cfg))
                        : acc.prepare_pipeline(seq, loss, popts);
      trained = pipeline->module();
      acc.print("pipeline: schedule " + tandem::parallel::to_string(pipeline->schedule()) + ", " +
                std::to_string(pipeline->virtual_stages()) + " stage(s) per rank, " +
                std::to_string(microbatches) + " micro-batches");
    } else {
      if (tp > 1) acc.parallelize(*model, models::llama_tensor_parallel_plan(cfg));
      add_lora();
    }
    if (!pipeline) model = acc.prepare(model);
    // prepare (prepare_pipeline: each stage's layers, Note [Expert parallel beside a pipeline])
    // kept this rank's experts.
    if (ep > 1)
      acc.print("expert parallel: ep " + std::to_string(ep) + ", " +
                std::to_string(cfg.num_experts / ep) + " of every layer's " +
                std::to_string(cfg.num_experts) + " experts per rank");
    if (!pipeline) {
      if (!model_dir.empty() && !whole) acc.load_model(*model, model_dir, load_options);
      trained = model.ptr();
    }
    // Note [Context parallel]: prepare handed the model the cp group (prepare_pipeline each
    // stage's attention layers).
    if (cp > 1) {
      const auto& group = acc.context_parallel();
      acc.print("context parallel: cp " + std::to_string(cp) + " (" +
                tandem::parallel::to_string(group->comm()) + "), " +
                std::to_string(seq_len / cp) + " of every " + std::to_string(seq_len) +
                " positions per rank");
    }
    // A tied head is one tensor under two names: the optimizer lists it once. Under LoRA only
    // the adapters train; under a pipeline, this stage's parameters.
    std::vector<torch::Tensor> params;
    std::set<const void*> seen;
    for (auto& p : trained->parameters())
      if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) params.push_back(p);
    if (lora.r() > 0) {
      int64_t trainable = 0;
      for (const auto& a : adapters) trainable += a.numel();
      acc.print("LoRA: r", lora.r(), "alpha", lora.alpha(), "on", adapters.size() / 2,
                "layers;", trainable, "trainable parameters");
    }
    auto opt = acc.prepare(std::make_shared<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(lr).weight_decay(weight_decay)));
    auto sched = acc.prepare_scheduler(
        std::make_shared<WarmupCosine>(opt.optimizer(), warmup, steps, min_lr_ratio));
    auto loader_options = tandem::data::DataLoaderOptions().batch_size(batch).shuffle(shuffle).seed(7);

    // Model FLOPs per token and the peak they are measured against.
    const int64_t embedding = cfg.vocab_size * cfg.hidden_size;
    const double flops_per_token =
        6.0 * static_cast<double>(cfg.parameter_count() - embedding) +
        12.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len;
    std::string peak_source = "--peak_tflops";
    if (peak_tflops <= 0) {
      if (acc.device().is_cuda()) {
        const auto gpu = nvidia_gpu_name();
        peak_tflops = gpu_peak_tflops(gpu);
        peak_source = "the GPU table (" + gpu + ", bf16 dense)";
      } else {
        peak_tflops = cpu_peak_tflops();
        peak_source = "a measured float32 matrix product";
      }
    }
    acc.print(cfg.model_type, "with", cfg.parameter_count(), "parameters,", examples_count,
              "examples of", seq_len, "tokens;", acc.num_processes(), "processes (dp", dp, "x cp", cp,
              "x tp", tp, "x pp", std::to_string(pp) + ");", flops_per_token / 1e6, "MFLOPs per token; peak",
              peak_tflops > 0 ? std::to_string(peak_tflops) + " TFLOP/s from " + peak_source
                              : std::string("unknown for this GPU (give --peak_tflops)"));

    if (!log_with.empty())
      acc.init_trackers("train_llm", {{"model_type", cfg.model_type},
                                      {"parameters", cfg.parameter_count()},
                                      {"lr", lr},
                                      {"seq_len", seq_len},
                                      {"batch_size", batch},
                                      {"steps", steps},
                                      {"lora_r", lora.r()}});
    // A mixture of experts: the top-k choices each expert of each sparse layer got over the log
    // window, over every rank's tokens (the ranks of a tp group route the same tokens; each
    // pipeline stage counts its own layers), printed, and each layer's load (its busiest
    // expert over the mean) logged.
    std::vector<int64_t> sparse_layers;
    for (size_t i = 0; i < model->model->layers.size(); ++i)
      if (!model->model->layers[i]->moe.is_empty()) sparse_layers.push_back(static_cast<int64_t>(i));
    auto log_experts = [&](std::map<std::string, double>& m, int64_t step) {
      auto counts = torch::stack(model->take_tokens_routed()).to(torch::kLong);  // [layers, E]
      if (acc.num_processes() > 1) {
        acc.process_group().allreduce(counts, tandem::ReduceOp::kSum);
        counts = torch::div(counts, tp, "floor");
      }
      std::ostringstream line;
      line << "step " << step << " tokens per expert:";
      double worst = 0;
      for (size_t l = 0; l < sparse_layers.size(); ++l) {
        auto row = counts[static_cast<int64_t>(l)];
        line << " layer " << sparse_layers[l] << " [";
        for (int64_t e = 0; e < row.size(0); ++e) line << (e ? " " : "") << row[e].item<int64_t>();
        line << "]";
        const double mean = row.to(torch::kDouble).mean().item<double>();
        const double load = mean > 0 ? row.max().item<int64_t>() / mean : 0;
        m["experts/layer" + std::to_string(sparse_layers[l]) + "/max_load"] = load;
        worst = std::max(worst, load);
      }
      m["experts/max_load"] = worst;
      acc.print(line.str());
    };
    int64_t step = 0, tokens = 0;
    double first_loss = -1, last_loss = 0;
    auto window_start = std::chrono::steady_clock::now();
    int64_t window_tokens = 0, window_micro = 0;
    torch::Tensor window_loss;  // the sum of this step's micro-step losses
    double grad_norm = 0;
    auto run_epoch = [&](auto& loader) {
      for (auto& b : *loader) {
        auto scope = acc.accumulate();
        torch::Tensor loss;
        if (pipeline) {
          // The micro-batches' mean loss over this stage's data-parallel peers, on every rank.
          loss = torch::tensor(pipeline->step(
              cp > 1 ? acc.context_parallel()->shard(b.data, 1) : b.data, b.target));
        } else {
          loss = model->loss(b.data, b.target);
          acc.backward(loss);
        }
        window_loss = window_loss.defined() ? window_loss + loss.detach() : loss.detach();
        ++window_micro;
        // The norm before clipping, over every shard and stage (what transformers logs).
        if (clip > 0) grad_norm = acc.clip_grad_norm_(params, clip);
        opt.step();
        opt.zero_grad();
        window_tokens += b.data.numel() * dp;
        if (!acc.sync_gradients()) continue;
        sched->step();
        // The step's loss: the mean over its micro-steps and the data-parallel ranks.
        last_loss = acc.reduce(window_loss / window_micro).template item<double>();
        window_loss = torch::Tensor();
        window_micro = 0;
        if (first_loss < 0) first_loss = last_loss;
        ++step;
        if (step % log_every == 0 || step == steps) {
          const double secs =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - window_start).count();
          const double tps = window_tokens / secs;
          const double mfu = peak_tflops > 0
                                 ? tps * flops_per_token / (peak_tflops * 1e12 * acc.num_processes())
                                 : 0;
          acc.print("step", step, "loss", last_loss, "lr", opt->param_groups()[0].options().get_lr(),
                    clip > 0 ? "grad_norm " + std::to_string(grad_norm) : std::string(),
                    static_cast<int64_t>(tps), "tokens/s", "MFU",
                    peak_tflops > 0 ? std::to_string(100 * mfu) + "%" : std::string("n/a"));
          std::map<std::string, double> m{{"loss", last_loss}, {"tokens_per_s", tps}, {"mfu", mfu}};
          if (clip > 0) m["grad_norm"] = grad_norm;
          if (cfg.num_experts > 0) log_experts(m, step);
          if (!log_with.empty()) acc.log(m, step);
          tokens += window_tokens;
          window_tokens = 0;
          window_start = std::chrono::steady_clock::now();
        }
        if (step >= steps) return;
      }
    };
    // --resume: everything is prepared; the latest checkpoint (any layout) restores the model,
    // the optimizer, the schedule, the loader's epoch and sample, and the step.
    auto train = [&](auto& loader) {
      if (resume) {
        if (acc.latest_checkpoint().empty()) {
          acc.print("--resume: no checkpoint under", project_dir + "/checkpoints; starting at step 0");
        } else {
          const auto loaded = acc.load_state();
          step = acc.step();
          acc.print("resumed from", loaded.dir, "at step", step,
                    loaded.resharded ? "(saved on " + loaded.saved_layout + ", resharded)" : "");
        }
      }
      int64_t epoch = loader->epoch();
      while (step < steps) {  // run_epoch advances step
        loader->set_epoch(epoch++);
        run_epoch(loader);
      }
    };
    if (windows) {
      auto loader = acc.prepare_data_loader(*windows, loader_options);
      train(loader);
    } else {
      auto loader = acc.prepare_data_loader(*rows, loader_options);
      train(loader);
    }
    acc.wait_for_checkpoint();
    if (!log_with.empty()) acc.end_training();
    acc.print("loss", last_loss < first_loss ? "fell" : "rose", "from", first_loss, "to", last_loss);
    if (!save_dir.empty()) {
      // (A pipeline's stages come back under transformers' names: PipelineOptions above.)
      auto state = acc.get_state_dict(*trained);
      if (acc.is_main_process()) {
        if (lora.r() > 0)
          tandem::peft::save_adapter(state, lora, save_dir);
        else
          models::save_pretrained(cfg, state, save_dir, save_dtype);
      }
      acc.wait_for_everyone();
      acc.print("saved", save_dir,
                lora.r() > 0 ? "(PEFT's adapter files; `tandem merge-lora` merges them)"
                             : "(config.json and safetensors, as transformers reads them)");
    }
    examples::print_peak_resident(acc);
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
  return 0;
}
