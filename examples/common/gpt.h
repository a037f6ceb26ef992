// A byte-level GPT: token and position embeddings, causal self-attention blocks, LayerNorm, and
// an output head tied to the token embedding, GPT-2's residual dropout; tensor (and sequence)
// parallel by a plan (gpt_tensor_parallel_plan).
// Plus the text it trains on: files of this source tree, so that the default run needs no download.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "tandem/comm/process_group.h"
#include "tandem/nn/module.h"
#include "tandem/parallel/tensor_parallel.h"

namespace examples {

struct GPTConfig {
  int64_t vocab = 256;
  int64_t context = 128;
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t width = 128;
  /// GPT-2's residual dropout: on the embeddings and on the attention and MLP outputs before
  /// each residual add (0: none).
  double dropout = 0.0;
};

/// Calls the child `name` of `self`: through the tensor-parallel layer a plan put in its place
/// (tandem::parallel::parallelize_module), else through `built`, the member that built it. For
/// members held by torch::nn holders; the GPT below declares tandem's hookable ones
/// (tandem/nn/module.h), whose own calls reach the planned layer.
template <typename Holder>
torch::Tensor call_child(torch::nn::Module& self, const char* name, Holder& built,
                         const torch::Tensor& x) {
  if (auto tp = tandem::parallel::planned_child(self, name)) return tp->forward(x);
  return built(x);
}

/// The tensor-parallel plan of this GPT (Megatron's split): q, k, v column-parallel by whole
/// heads, the attention projection row-parallel, the MLP column- then row-parallel, and the
/// token embedding vocab-parallel with the tied head column-parallel over the same rows, so
/// that the logits stay split by vocabulary (loss_per_sample then uses the vocab-parallel cross
/// entropy). Needs heads, 4 * width and vocab divisible by the tensor-parallel size.
///
/// `sequence_parallel`: Megatron's sequence parallelism on top. The LayerNorms, residual adds
/// and dropout run on this rank's part of the sequence (the forward scatters the embeddings
/// along it); q/k/v, fc and the head all-gather the sequence, the attention projection and
/// fc_proj reduce-scatter it. Needs the sequence length divisible by the tensor-parallel size,
/// and with dropout > 0 a per-rank stream (GPTImpl::seed_tensor_parallel_rng).
inline tandem::parallel::TensorParallelPlan gpt_tensor_parallel_plan(
    bool sequence_parallel = false) {
  tandem::parallel::TensorParallelPlan plan;
  if (!sequence_parallel) {
    plan.colwise("h*.attn.qkv", /*parts=*/3)
        .rowwise("h*.attn.proj")
        .colwise("h*.fc")
        .rowwise("h*.fc_proj")
        .vocab("wte")
        .colwise("head");
    return plan;
  }
  plan.sequence_parallel("h*.ln1")
      .colwise_from_sequence("h*.attn.qkv", /*parts=*/3)
      .rowwise_to_sequence("h*.attn.proj")
      .sequence_parallel("h*.ln2")
      .colwise_from_sequence("h*.fc")
      .rowwise_to_sequence("h*.fc_proj")
      .vocab("wte")
      .sequence_parallel("ln_f")
      .colwise_from_sequence("head");
  return plan;
}

/// GPT-2's residual dropout with the stream it must draw from: on replicated activations
/// (no plan, or tensor parallel without sequence parallel) the default stream every tp rank
/// shares, so that all draw the same mask; on sequence shards (`sequence_parallel`) this tp
/// rank's stream, so that each position gets a mask of its own, as in the dense model.
inline torch::Tensor residual_dropout(const torch::Tensor& x, double p, bool training,
                                      bool sequence_parallel,
                                      tandem::parallel::TensorParallelRng* rng) {
  if (p == 0.0 || !training) return x;
  if (!sequence_parallel) return torch::dropout(x, p, true);
  TORCH_CHECK(rng != nullptr, "GPT: dropout ", p,
              " on sequence-parallel activations needs a per-rank random "
              "stream; call model->seed_tensor_parallel_rng(seed) after parallelizing it");
  auto scope = rng->scope();
  return torch::dropout(x, p, true);
}

struct CausalSelfAttentionImpl : torch::nn::Module {
  explicit CausalSelfAttentionImpl(const GPTConfig& c)
      : heads(c.heads),
        qkv(register_module("qkv", tandem::nn::Linear(c.width, 3 * c.width))),
        proj(register_module("proj", tandem::nn::Linear(c.width, c.width))) {
    TORCH_CHECK(c.width % c.heads == 0, "width ", c.width, " must be a multiple of heads ", c.heads);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto hd = x.size(2) / heads;
    auto y = qkv(x);
    // qkv's output has the whole sequence (a sequence-parallel qkv gathers it).
    const auto B = y.size(0), T = y.size(1);
    // This rank's heads: all of them, or its share when a tensor-parallel plan split qkv.
    const auto C = y.size(2) / 3, h = C / hd;
    TORCH_CHECK(C % hd == 0, "qkv gives ", C, " features per q/k/v, not whole heads of ", hd);
    auto parts = y.split(C, 2);
    auto shape = [&](const torch::Tensor& t) { return t.view({B, T, h, hd}).transpose(1, 2); };
    auto q = shape(parts[0]), k = shape(parts[1]), v = shape(parts[2]);
    auto att = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    auto mask = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(x.device()))
                    .triu(1);
    att = torch::softmax(att.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
    return proj(att.matmul(v).transpose(1, 2).contiguous().view({B, T, C}));
  }
  int64_t heads;
  tandem::nn::Linear qkv, proj;
};
TANDEM_MODULE(CausalSelfAttention);

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const GPTConfig& c)
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})))),
        attn(register_module("attn", CausalSelfAttention(c))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})))),
        fc(register_module("fc", tandem::nn::Linear(c.width, 4 * c.width))),
        fc_proj(register_module("fc_proj", tandem::nn::Linear(4 * c.width, c.width))),
        dropout(c.dropout) {}
  torch::Tensor forward(torch::Tensor x) {
    // Sequence parallel: x is this rank's part of the sequence, and so are both branches'
    // outputs (fc_proj and attn.proj reduce-scatter it).
    auto planned = std::dynamic_pointer_cast<tandem::parallel::RowParallelLinearImpl>(
        tandem::parallel::planned_child(*this, "fc_proj"));
    const bool sp = planned && planned->options.sequence_parallel();
    auto drop = [&](const torch::Tensor& y) {
      return residual_dropout(y, dropout, is_training(), sp, tp_rng.get());
    };
    x = x + drop(attn(ln1(x)));
    return x + drop(fc_proj(torch::gelu(fc(ln2(x)))));
  }
  torch::nn::LayerNorm ln1;
  CausalSelfAttention attn;
  torch::nn::LayerNorm ln2;
  tandem::nn::Linear fc, fc_proj;
  double dropout;
  /// The per-tp-rank stream of sequence-parallel dropout (GPTImpl::seed_tensor_parallel_rng).
  std::shared_ptr<tandem::parallel::TensorParallelRng> tp_rng;
};
// Hookable (tandem/nn/module.h): each block is a ZeRO-3 unit and an activation-checkpointing
// region of its own, though GPTImpl calls it through a typed member.
TANDEM_MODULE(Block);

/// The output projection, sharing its weight tensor with the token embedding: the model lists it
/// under two names (wte.weight and head.weight) that are one tensor.
struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(torch::Tensor w) : weight(register_parameter("weight", std::move(w))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(weight.t()); }
  torch::Tensor weight;
};
TANDEM_MODULE(TiedHead);

struct GPTImpl : torch::nn::Module {
  // GPT-2's initialisation (N(0, 0.02) for weights and embeddings) is given to each module as
  // it is built, not by a pass over the finished model: under Accelerator::build (ZeRO-3) a
  // block is cut into shards as soon as the next one starts, and the weights are the same.
  explicit GPTImpl(const GPTConfig& c) : config(c) {
    wte = register_module("wte", tandem::nn::Embedding(c.vocab, c.width));
    init_matrices(*wte);
    wpe = register_module("wpe", torch::nn::Embedding(c.context, c.width));
    init_matrices(*wpe);
    for (int64_t i = 0; i < c.layers; ++i) {
      Block b(c);
      init_matrices(*b);
      blocks.push_back(register_module("h" + std::to_string(i), b));
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
    head = register_module("head", TiedHead(wte->weight));
  }
  static void init_matrices(torch::nn::Module& m) {
    torch::NoGradGuard no_grad;
    for (auto& p : m.named_parameters())
      if (p.key().find("weight") != std::string::npos && p.value().dim() == 2)
        p.value().normal_(0.0, 0.02);
  }
  /// Logits [B, T, vocab] for byte ids [B, T] (with a tensor-parallel head: this rank's part of
  /// the vocabulary, [B, T, vocab / tp]).
  torch::Tensor forward(const torch::Tensor& idx) {
    auto pos = torch::arange(idx.size(1), torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
    auto x = wte(idx) + wpe(pos);
    auto sp = sequence_parallel_head();
    if (sp) x = tandem::parallel::scatter_to_sequence_region(x, sp->group());
    x = residual_dropout(x, config.dropout, is_training(), sp != nullptr, tp_rng.get());
    for (auto& b : blocks) x = b(x);
    return head(ln_f(x));
  }
  /// The planned head when the plan is sequence parallel (gpt_tensor_parallel_plan(true)), else
  /// nullptr.
  std::shared_ptr<tandem::parallel::ColumnParallelLinearImpl> sequence_parallel_head() {
    auto h = std::dynamic_pointer_cast<tandem::parallel::ColumnParallelLinearImpl>(
        tandem::parallel::planned_child(*this, "head"));
    return h && h->options.sequence_parallel() ? h : nullptr;
  }
  /// Gives the model its per-tensor-parallel-rank random stream (TensorParallelRng(seed, tp
  /// rank)), from which dropout on sequence shards draws; call after parallelizing it, with the
  /// same seed on every rank. Dropout on replicated activations keeps the default stream.
  void seed_tensor_parallel_rng(uint64_t seed) {
    auto h = std::dynamic_pointer_cast<tandem::parallel::TensorParallelModule>(
        tandem::parallel::planned_child(*this, "head"));
    TORCH_CHECK(h != nullptr,
                "GPT::seed_tensor_parallel_rng: the model is not tensor parallel; "
                "parallelize it (gpt_tensor_parallel_plan) first");
    tp_rng = std::make_shared<tandem::parallel::TensorParallelRng>(seed, h->group()->rank());
    for (auto& b : blocks) b->tp_rng = tp_rng;
  }
  /// Mean cross-entropy per sequence [B] (so that per-sample losses can be gathered).
  torch::Tensor loss_per_sample(const torch::Tensor& idx, const torch::Tensor& targets) {
    auto logits = forward(idx);
    auto split_head = std::dynamic_pointer_cast<tandem::parallel::ColumnParallelLinearImpl>(
        tandem::parallel::planned_child(*this, "head"));
    if (split_head && !split_head->options.gather_output())
      return tandem::parallel::vocab_parallel_cross_entropy(
                 logits, targets, split_head->group(),
                 tandem::parallel::VocabParallelCrossEntropyOptions().reduction("none"))
          .mean(1);
    auto l = torch::nn::functional::cross_entropy(
        logits.view({-1, logits.size(-1)}), targets.view({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    return l.view({idx.size(0), idx.size(1)}).mean(1);
  }
  GPTConfig config;
  tandem::nn::Embedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  TiedHead head{nullptr};
  std::shared_ptr<tandem::parallel::TensorParallelRng> tp_rng;
};
TORCH_MODULE(GPT);

// --- The same GPT as a torch::nn::Sequential, for pipelines ------------------------------------
// Entry 0 the embeddings, 1..layers the blocks, the last the final LayerNorm and an untied head
// (a pipeline splits a Sequential by entries; the tied head of GPT would join the first and the
// last stage).

/// Token and position embeddings: ids [B, T] -> activations [B, T, width].
struct GPTEmbeddingsImpl : torch::nn::Module {
  explicit GPTEmbeddingsImpl(const GPTConfig& c)
      : wte(register_module("wte", tandem::nn::Embedding(c.vocab, c.width))),
        wpe(register_module("wpe", torch::nn::Embedding(c.context, c.width))) {}
  torch::Tensor forward(const torch::Tensor& idx) {
    auto pos =
        torch::arange(idx.size(1), torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
    return wte(idx) + wpe(pos);
  }
  tandem::nn::Embedding wte;
  torch::nn::Embedding wpe;
};
TORCH_MODULE(GPTEmbeddings);

/// The final LayerNorm and the output projection: [B, T, width] -> logits [B, T, vocab] (with a
/// tensor-parallel plan: this rank's part of the vocabulary).
struct GPTHeadImpl : torch::nn::Module {
  explicit GPTHeadImpl(const GPTConfig& c)
      : ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})))),
        out(register_module(
            "out", tandem::nn::Linear(torch::nn::LinearOptions(c.width, c.vocab).bias(false)))) {}
  torch::Tensor forward(const torch::Tensor& x) { return out(ln_f(x)); }
  torch::nn::LayerNorm ln_f;
  tandem::nn::Linear out;
};
TORCH_MODULE(GPTHead);

/// The dense model's parameter count: embeddings, blocks (12 w^2 + 13 w each), the final
/// LayerNorm, and the head's own matrix unless it is tied to the token embedding.
inline int64_t gpt_parameter_count(const GPTConfig& c, bool tied_head) {
  const int64_t w = c.width;
  return (c.vocab + c.context) * w + c.layers * (12 * w * w + 13 * w) + 2 * w +
         (tied_head ? 0 : c.vocab * w);
}

/// The GPT as a Sequential (GPT-2's N(0, 0.02) initialisation of every matrix). Seed before the
/// call for the same model on every rank.
inline torch::nn::Sequential gpt_sequential(const GPTConfig& c) {
  torch::nn::Sequential net;
  net->push_back(GPTEmbeddings(c));
  for (int64_t i = 0; i < c.layers; ++i) net->push_back(Block(c));
  net->push_back(GPTHead(c));
  torch::NoGradGuard no_grad;
  for (auto& p : net->named_parameters())
    if (p.value().dim() == 2) p.value().normal_(0.0, 0.02);
  return net;
}

/// The tensor-parallel plan of gpt_sequential (paths "3.attn.qkv"): every block split as in
/// gpt_tensor_parallel_plan, the token embedding vocab-parallel and the head column-parallel,
/// so the logits stay split by vocabulary (gpt_sequential_loss). On a pipeline stage only the
/// entries that match its layers apply (Accelerator::prepare_pipeline).
inline tandem::parallel::TensorParallelPlan gpt_sequential_tensor_parallel_plan() {
  tandem::parallel::TensorParallelPlan plan;
  plan.colwise("*.attn.qkv", /*parts=*/3)
      .rowwise("*.attn.proj")
      .colwise("*.fc")
      .rowwise("*.fc_proj")
      .vocab("*.wte")
      .colwise("*.out");
  return plan;
}

/// Mean cross entropy of gpt_sequential's logits: of logits split by vocabulary over `tp`
/// (vocab_parallel_cross_entropy) when `tp` is given, else of whole logits.
inline torch::Tensor gpt_sequential_loss(const torch::Tensor& logits, const torch::Tensor& targets,
                                         std::shared_ptr<tandem::ProcessGroup> tp = nullptr) {
  if (tp) return tandem::parallel::vocab_parallel_cross_entropy(logits, targets, std::move(tp));
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              targets.reshape({-1}));
}

/// The bytes of `path` (a --text file); throws naming `flag` when it cannot be read.
inline std::string read_text_file(const std::string& path, const std::string& flag = "--text") {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + flag + " " + path);
  std::ostringstream bytes;  // one block copy, not a character at a time
  bytes << in.rdbuf();
  return bytes.str();
}

/// Bytes of this project's own text (README, docs, headers and sources), in a fixed order.
inline std::string project_text(const std::string& root) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (const char* top : {"README.md", "docs", "include", "src", "examples"}) {
    fs::path p = fs::path(root) / top;
    if (fs::is_regular_file(p)) files.push_back(p);
    if (fs::is_directory(p))
      for (auto& e : fs::recursive_directory_iterator(p))
        if (e.is_regular_file()) {
          auto ext = e.path().extension().string();
          if (ext == ".md" || ext == ".h" || ext == ".cpp") files.push_back(e.path());
        }
  }
  std::sort(files.begin(), files.end());
  std::ostringstream text;
  for (auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + f.string() + " (the example's text)");
    if (fs::file_size(f) > 0) text << in.rdbuf();  // an empty file would set text's failbit
  }
  return text.str();
}

/// Non-overlapping windows of `context + 1` bytes: input = first `context`, target = shifted by
/// one. `begin`/`end` select a byte range (train / held-out split).
class ByteWindows : public torch::data::datasets::Dataset<ByteWindows> {
 public:
  ByteWindows(const std::string& text, int64_t context, size_t begin, size_t end)
      : context_(context) {
    auto all = torch::from_blob(const_cast<char*>(text.data() + begin),
                                {static_cast<int64_t>(end - begin)}, torch::kUInt8)
                   .to(torch::kLong);
    bytes_ = all.clone();
    count_ = std::max<int64_t>(0, (bytes_.size(0) - 1) / context_);
  }
  torch::data::Example<> get(size_t i) override {
    auto s = static_cast<int64_t>(i) * context_;
    return {bytes_.slice(0, s, s + context_), bytes_.slice(0, s + 1, s + context_ + 1)};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(count_); }

 private:
  int64_t context_;
  int64_t count_;
  torch::Tensor bytes_;
};

}  // namespace examples
