// The layout planner's logic (plan.h): the model's tensors, the layouts the rules allow, the
// per-rank memory each one is predicted to need, and a layout as launch flags or a config file.
#include "tandem/trials/plan.h"
#include "tandem/error.h"
#include "tandem/track/memory_estimate.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "tandem/checkpoint/safetensors_header.h"

namespace tandem::trials {

namespace fs = std::filesystem;

int64_t PlanModel::num_parameters() const {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.numel;
  return n;
}

PlanModel gpt_plan_model(int64_t layers, int64_t hidden, int64_t heads, int64_t vocab,
                         int64_t context) {
  if (layers < 1 || hidden < 1 || heads < 1 || vocab < 1 || context < 1)
    throw ::tandem::Refused(
        "GPT shape: layers, hidden, heads, vocab and context must all be "
        "positive, got " +
        std::to_string(layers) + ", " + std::to_string(hidden) + ", " + std::to_string(heads) +
        ", " + std::to_string(vocab) + ", " + std::to_string(context));
  if (hidden % heads != 0)
    throw ::tandem::Refused("GPT shape: hidden " + std::to_string(hidden) +
                                " must be a multiple of heads " + std::to_string(heads));
  PlanModel m;
  m.blocks = layers;
  m.heads = heads;
  m.hidden = hidden;
  m.vocab = vocab;
  m.context = context;
  m.source = "GPT " + std::to_string(layers) + " x " + std::to_string(hidden) + ", " +
             std::to_string(heads) + " heads, vocab " + std::to_string(vocab) + ", context " +
             std::to_string(context) + " (head tied to the token embedding)";
  const int64_t h = hidden;
  auto add = [&](std::string name, int64_t n, int block, bool split, bool tied = false) {
    m.tensors.push_back({std::move(name), n, block, split, tied});
  };
  add("wte.weight", vocab * h, PlanTensor::kBeforeBlocks, true, /*tied=*/true);
  add("wpe.weight", context * h, PlanTensor::kBeforeBlocks, false);
  for (int i = 0; i < layers; ++i) {
    const std::string p = "h" + std::to_string(i) + ".";
    add(p + "ln1.weight", h, i, false);
    add(p + "ln1.bias", h, i, false);
    add(p + "attn.qkv.weight", 3 * h * h, i, true);
    add(p + "attn.qkv.bias", 3 * h, i, true);
    add(p + "attn.proj.weight", h * h, i, true);
    add(p + "attn.proj.bias", h, i, false);
    add(p + "ln2.weight", h, i, false);
    add(p + "ln2.bias", h, i, false);
    add(p + "fc.weight", 4 * h * h, i, true);
    add(p + "fc.bias", 4 * h, i, true);
    add(p + "fc_proj.weight", 4 * h * h, i, true);
    add(p + "fc_proj.bias", h, i, false);
  }
  add("ln_f.weight", h, PlanTensor::kAfterBlocks, false);
  add("ln_f.bias", h, PlanTensor::kAfterBlocks, false);
  return m;
}

namespace {

// A name component that is an index: digits only, short enough for an int.
bool is_index(const std::string& part) {
  return !part.empty() && part.size() < 9 &&
         std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The first name component that is a number ("model.layers.3.mlp" -> 3), or -1.
int block_of(const std::string& name) {
  std::stringstream ss(name);
  std::string part;
  while (std::getline(ss, part, '.'))
    if (is_index(part)) return std::stoi(part);
  return -1;
}

bool contains(const std::string& s, const char* what) {
  return s.find(what) != std::string::npos;
}

// The header files of a checkpoint path: one .safetensors, or the shards an index names.
std::vector<std::string> checkpoint_files(const std::string& path, std::string* dir) {
  fs::path p(path);
  if (fs::is_directory(p)) {
    if (fs::exists(p / "model.safetensors.index.json"))
      p = p / "model.safetensors.index.json";
    else if (fs::exists(p / "model.safetensors"))
      p = p / "model.safetensors";
    else
      throw ::tandem::Refused("tandem plan: " + path +
                                  " holds neither model.safetensors nor "
                                  "model.safetensors.index.json; give a checkpoint or a GPT shape "
                                  "(--layers --hidden --heads --vocab)");
  }
  if (!fs::exists(p)) throw ::tandem::Refused("tandem plan: no such file: " + p.string());
  *dir = p.parent_path().string();
  if (p.extension() != ".json") return {p.string()};
  // The validating index parser (shard names without directories), as loading uses.
  std::vector<std::string> files;
  for (const auto& f : checkpoint::read_safetensors_index(p.string()).files)
    files.push_back((p.parent_path() / f).string());
  return files;
}

}  // namespace

PlanModel safetensors_plan_model(const std::string& path, int64_t heads) {
  std::string dir;
  PlanModel m;
  m.source = "safetensors: " + path;
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (const auto& f : checkpoint_files(path, &dir)) {
    const auto header = checkpoint::read_safetensors_header(f);
    for (const auto& [name, t] : header.tensors) shapes.emplace_back(name, t.shape);
  }
  std::sort(shapes.begin(), shapes.end());
  std::set<int> blocks;
  for (const auto& [name, shape] : shapes) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    PlanTensor t;
    t.name = name;
    t.numel = n;
    t.block = block_of(name);
    const bool embedding = contains(name, "emb") || contains(name, "wte") || contains(name, "wpe");
    if (t.block < 0)
      t.block = embedding ? PlanTensor::kBeforeBlocks : PlanTensor::kAfterBlocks;
    else
      blocks.insert(t.block);
    // Note [Expert parallel]: every tp rank holds its experts whole.
    t.expert = contains(name, ".experts.");
    t.tp_split = shape.size() >= 2 && !contains(name, "wpe") && !contains(name, "position") &&
                 !t.expert;
    if (t.expert) {
      const auto at = name.find(".experts.") + 9;
      const auto end = name.find('.', at);
      const std::string index = name.substr(at, end == std::string::npos ? end : end - at);
      if (is_index(index))
        m.experts = std::max<int64_t>(m.experts, std::stoll(index) + 1);
      else if (shape.size() == 3)  // transformers' fused experts: [experts, out, in]
        m.experts = std::max<int64_t>(m.experts, shape[0]);
    }
    if (embedding && shape.size() == 2 && !contains(name, "wpe") && !contains(name, "position")) {
      m.vocab = std::max<int64_t>(m.vocab, shape[0]);
      m.hidden = shape[1];
    }
    m.tensors.push_back(std::move(t));
  }
  if (m.tensors.empty()) throw ::tandem::Refused("tandem plan: " + path + " holds no tensors");
  // Block numbers as they come ("h.0" ... "h.11"), renumbered from 0 without gaps.
  std::map<int, int> index;
  for (int b : blocks) index.emplace(b, static_cast<int>(index.size()));
  for (auto& t : m.tensors)
    if (t.block >= 0) t.block = index[t.block];
  m.blocks = static_cast<int64_t>(blocks.size());
  // A head whose weights the file does not store is tied to the token embedding.
  const bool has_head = std::any_of(m.tensors.begin(), m.tensors.end(), [](const PlanTensor& t) {
    return t.block == PlanTensor::kAfterBlocks && contains(t.name, "weight") &&
           (contains(t.name, "head") || contains(t.name, "out"));
  });
  if (!has_head)
    for (auto& t : m.tensors)
      if (t.block == PlanTensor::kBeforeBlocks && t.tp_split) t.tied_to_head = true;
  m.heads = heads;
  const fs::path cfg = fs::path(dir) / "config.json";
  if (fs::exists(cfg)) {
    try {
      nlohmann::json j;
      std::ifstream(cfg) >> j;
      for (const char* k : {"n_head", "num_attention_heads"})
        if (heads == 0 && j.contains(k) && j[k].is_number_integer()) m.heads = j[k].get<int64_t>();
      for (const char* k : {"n_positions", "max_position_embeddings"})
        if (j.contains(k) && j[k].is_number_integer()) m.context = j[k].get<int64_t>();
      for (const char* k : {"num_experts", "num_local_experts"})
        if (m.experts == 0 && j.contains(k) && j[k].is_number_integer())
          m.experts = j[k].get<int64_t>();
    } catch (const std::exception&) {
      // A config.json that is not JSON says nothing about heads; --heads can.
    }
  }
  return m;
}

std::string Layout::name() const {
  std::string s = "dp" + std::to_string(dp);
  if (cp > 1) s += " cp" + std::to_string(cp);
  if (ep > 1) s += " ep" + std::to_string(ep);
  if (tp > 1) s += " tp" + std::to_string(tp);
  if (pp > 1) s += " pp" + std::to_string(pp);
  if (pp > 1 && virtual_stages > 1) s += " v" + std::to_string(virtual_stages);
  if (zero_stage > 0) s += " zero" + std::to_string(zero_stage);
  s += " mb" + std::to_string(micro_batch);
  if (accumulation > 1) s += " ga" + std::to_string(accumulation);
  if (pp > 1) s += " m" + std::to_string(microbatches);
  if (activation_checkpointing) s += " ckpt";
  if (!offload.empty()) s += " offload-" + offload;
  return s;
}

bool Layout::operator==(const Layout& o) const {
  return dp == o.dp && tp == o.tp && pp == o.pp && zero_stage == o.zero_stage &&
         activation_checkpointing == o.activation_checkpointing && micro_batch == o.micro_batch &&
         accumulation == o.accumulation && microbatches == o.microbatches && offload == o.offload &&
         virtual_stages == o.virtual_stages && cp == o.cp && ep == o.ep;
}

namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t k = 1; k <= n; ++k)
    if (n % k == 0) d.push_back(k);
  return d;
}

}  // namespace

std::vector<Layout> enumerate_layouts(const PlanModel& model, const PlanMachine& machine,
                                      const PlanSearch& search,
                                      std::vector<std::string>* excluded) {
  const int n = machine.num_processes;
  if (n < 1 || machine.num_machines < 1 || n % machine.num_machines != 0)
    throw ::tandem::Refused("tandem plan: --num_processes " + std::to_string(n) +
                                " must be a positive multiple of --num_machines " +
                                std::to_string(machine.num_machines));
  if (search.global_batch < 1)
    throw ::tandem::Refused("tandem plan: --global_batch_size must be positive, got " +
                                std::to_string(search.global_batch));
  std::map<std::string, std::set<std::string>> why;  // rule -> the shapes it removed
  auto out_by = [&](const std::string& rule, const std::string& what) { why[rule].insert(what); };
  std::vector<Layout> layouts;
  for (int ep : search.expert_parallel)
  for (int cp : search.context_parallel)
  for (int tp = 1; tp <= n; ++tp) {
    if (ep < 1 || cp < 1 || n % (tp * cp)) continue;
    for (int pp = 1; pp * tp * cp <= n; ++pp) {
      if ((n / tp / cp) % pp) continue;
      const int dp = n / tp / pp / cp;
      const std::string shape = "tp" + std::to_string(tp) + " pp" + std::to_string(pp) + " dp" +
                                std::to_string(dp) + (cp > 1 ? " cp" + std::to_string(cp) : "") +
                                (ep > 1 ? " ep" + std::to_string(ep) : "");
      // Note [Expert parallel]: ep groups are carved from dp x cp (of each tp coordinate).
      if (ep > 1 && model.experts == 0) {
        out_by("expert parallel needs a mixture of experts (the model has no \".experts.\" "
               "tensors)", shape);
        continue;
      }
      if (ep > 1 && model.experts % ep) {
        out_by("ep must divide the " + std::to_string(model.experts) + " experts of a layer",
               shape);
        continue;
      }
      if (ep > 1 && (dp * cp) % ep) {
        out_by("ep is carved from dp x cp and must divide it", shape);
        continue;
      }
      if (cp > 1 && (model.context <= 0 || model.context % (2 * cp))) {
        out_by("context parallel needs a context that is a multiple of 2 x cp", shape);
        continue;
      }
      if (tp > 1) {
        if (tp > machine.processes_per_machine()) {
          out_by("tensor parallel stays within a machine (" +
                     std::to_string(machine.processes_per_machine()) + " processes each)",
                 shape);
          continue;
        }
        std::string bad;
        if (model.heads > 0 && model.heads % tp)
          bad = "heads " + std::to_string(model.heads);
        else if (model.hidden > 0 && (4 * model.hidden) % tp)
          bad = "MLP width " + std::to_string(4 * model.hidden);
        else if (model.vocab > 0 && model.vocab % tp)
          bad = "vocab " + std::to_string(model.vocab);
        if (!bad.empty()) {
          out_by("tp must divide the " + bad, shape);
          continue;
        }
      }
      if (pp > 1 && pp > model.blocks + 2) {
        out_by("a pipeline stage needs at least one of the model's " +
                   std::to_string(model.blocks + 2) + " children",
               shape);
        continue;
      }
      if (search.global_batch % dp) {
        out_by("the global batch " + std::to_string(search.global_batch) +
                   " must divide among dp ranks",
               shape);
        continue;
      }
      const int64_t per_rank = search.global_batch / dp;
      std::vector<int> stages{0};
      if (dp * cp > 1 && pp == 1)  // ZeRO shards over dp x cp
        stages = {0, 1, 2, 3};
      else if (dp > 1)
        out_by("ZeRO stages do not combine with a pipeline in tandem", shape);
      for (int zero : stages) {
        std::vector<std::string> offloads{""};
        if (zero > 0 && machine.cuda) offloads.push_back("cpu");
        if (zero > 0 && !search.offload_dir.empty()) {
          if (ep > 1)
            out_by("optimizer state on disk does not combine with expert parallel in tandem",
                   shape);
          else
            offloads.push_back("nvme");
        }
        for (const auto& offload : offloads)
          for (bool ckpt : {false, true}) {
            if (ckpt && !search.search_checkpointing) continue;
            std::vector<int64_t> ms{1};
            if (pp > 1) {
              ms.clear();
              for (int64_t m : divisors(per_rank))
                if (m >= pp && (search.search_microbatches || m == pp)) ms.push_back(m);
              if (ms.empty()) {
                out_by("a pipeline needs at least pp micro-batches dividing each rank's " +
                           std::to_string(per_rank) + " sequences" +
                           (search.search_microbatches ? ""
                                                       : " (and {microbatches} in the args "
                                                         "to search more than pp)"),
                       shape);
                continue;
              }
            }
            const std::vector<int> vs = pp > 1 ? search.virtual_stages : std::vector<int>{1};
            for (int v : vs)
            for (int64_t m : ms) {
              if (v > 1 && (m % pp != 0 || pp * v > model.blocks + 2)) {
                out_by("interleaved 1F1B needs micro-batches that are a multiple of pp and at "
                       "least pp x virtual stages children (blocks + 2)",
                       shape + " v" + std::to_string(v) + " m" + std::to_string(m));
                continue;
              }
              for (int64_t mb : divisors(per_rank / m)) {
                if (search.max_micro_batch > 0 && mb > search.max_micro_batch) continue;
                Layout l;
                l.dp = dp;
                l.cp = cp;
                l.ep = ep;
                l.tp = tp;
                l.pp = pp;
                l.virtual_stages = v;
                l.zero_stage = zero;
                l.activation_checkpointing = ckpt;
                l.offload = offload;
                l.microbatches = m;
                l.micro_batch = mb;
                // A pipeline's micro-batches are its accumulation: the whole share in one step.
                if (pp > 1 && mb * m != per_rank) continue;
                l.accumulation = per_rank / (mb * m);
                layouts.push_back(l);
              }
            }
          }
      }
    }
  }
  if (excluded) {
    for (const auto& [rule, shapes] : why) {
      std::string s;
      for (const auto& x : shapes) s += (s.empty() ? "" : ", ") + x;
      excluded->push_back(rule + ": " + s);
    }
    if (search.offload_dir.empty() && !machine.cuda)
      excluded->push_back("optimizer offload to disk: give --offload_dir DIR to search it");
  }
  return layouts;
}

namespace {

// Activation weight of one child (the embeddings, a block, the head) per sequence, in values:
// a block's per-layer count (Korthikanti et al.: 34 T h + 5 a T^2 in 16-bit values, halved into
// values), the embeddings' sum and the head's logits with their log-softmax and gradient.
struct ChildWeights {
  double before, block, after;
};
ChildWeights child_weights(const PlanModel& m) {
  const double t = static_cast<double>(std::max<int64_t>(m.context, 1));
  const double h = static_cast<double>(std::max<int64_t>(m.hidden, 1));
  const double a = static_cast<double>(std::max<int64_t>(m.heads, 1));
  const double v = static_cast<double>(std::max<int64_t>(m.vocab, 1));
  return {2 * t * h, 17 * t * h + 2.5 * a * t * t, 2 * t * h + 3 * t * v};
}

}  // namespace

std::vector<RankParameters> rank_parameters(const PlanModel& model, const Layout& layout) {
  const int64_t children = model.blocks + 2;  // the embeddings, the blocks, the head
  const int pp = std::max(1, layout.pp);
  const int v = pp > 1 ? std::max(1, layout.virtual_stages) : 1;
  const int stages = pp * v;  // rank s holds stages s, s + pp, ... (Note [Interleaved stages])
  std::vector<int64_t> first;
  for (int g = 0; g < stages; ++g) first.push_back(g * children / stages);  // split_sequential's rule
  first.push_back(children);
  auto child_of = [&](const PlanTensor& t) -> int64_t {
    if (t.block == PlanTensor::kBeforeBlocks) return 0;
    if (t.block == PlanTensor::kAfterBlocks) return children - 1;
    return t.block + 1;
  };
  auto held = [&](int s, int64_t c) {
    for (int k = 0; k < v; ++k)
      if (c >= first[k * pp + s] && c < first[k * pp + s + 1]) return true;
    return false;
  };
  const auto w = child_weights(model);
  const double total_weight = w.before + w.after + static_cast<double>(model.blocks) * w.block;
  std::vector<RankParameters> out;
  for (int s = 0; s < pp; ++s) {
    RankParameters r;
    r.stage = s;
    std::map<int64_t, int64_t> units;  // child -> parameters on this rank
    const int ep = std::max(1, layout.ep);
    for (const auto& t : model.tensors) {
      int64_t n = t.tp_split ? (t.numel + layout.tp - 1) / layout.tp : t.numel;
      if (t.expert) n = (n + ep - 1) / ep;
      const int64_t c = child_of(t);
      if (held(s, c) && t.expert) r.expert_parameters += n;
      // Under expert parallel the experts are outside every unit (counted apart below).
      if (held(s, c) && t.expert && ep > 1) continue;
      if (held(s, c)) units[c] += n;
      // Stages share no tensor: the last stage keeps its own copy of a tied head.
      if (pp > 1 && t.tied_to_head && s == pp - 1 && c != children - 1) units[children - 1] += n;
    }
    double weight = 0;
    for (int64_t c = 0; c < children; ++c)
      if (held(s, c)) weight += c == 0 ? w.before : c == children - 1 ? w.after : w.block;
    for (const auto& [c, n] : units) {
      r.parameters += n;
      r.largest_unit = std::max(r.largest_unit, n);
    }
    if (ep > 1) r.parameters += r.expert_parameters;
    // Under 1F1B the stage holds min(m, pp - s) micro-batches; interleaved, up to its warm-up
    // plus one of its stages' micro-batches, each about 1/v of the rank's activations.
    r.activation_share = pp > 1 ? weight / total_weight / v : 1.0;
    // Note [Context parallel]: each rank holds 1/cp of every sequence's activations (attention
    // runs block by block: no rank holds the whole sequence's scores).
    r.activation_share /= std::max(1, layout.cp);
    r.in_flight = pp == 1  ? 1
                  : v == 1 ? std::min<int64_t>(layout.microbatches, pp - s)
                           : std::min<int64_t>(layout.microbatches * v,
                                               (v - 1) * pp + 2 * (pp - 1 - s) + 1);
    out.push_back(r);
  }
  return out;
}

ProbeFigures gpt_activation_formula(const PlanModel& model, int64_t seq_len, double baseline_rss) {
  PlanModel m = model;
  if (seq_len > 0) m.context = seq_len;
  const auto w = child_weights(m);
  ProbeFigures f;
  f.baseline_rss = baseline_rss;
  // fp32 values: 4 bytes each.
  f.activations_per_sample = 4 * (w.before + w.after + static_cast<double>(m.blocks) * w.block);
  f.checkpointed_per_sample =
      4 * (w.before + w.after + w.block + static_cast<double>(m.blocks * m.context * m.hidden));
  // Megatron: of a block's 34 T h + 5 a T^2, 10 T h stay whole under tensor parallel.
  const double t = static_cast<double>(m.context), h = static_cast<double>(m.hidden);
  f.tp_split_fraction = w.block > 0 ? 1.0 - (5 * t * h) / w.block : 0.0;
  f.measured = false;
  return f;
}

// Note [Planner memory model]
// A rank's tensor peak is its model states, what its strategy holds beside them, its
// activations and a workspace, but these do not all peak together. Measured on the example GPT
// (4 x 256 and 4 x 512, dp 2 and 4, TANDEM_PROFILE): under data parallel the buckets live
// through the forward and the peak is the sum (20P + activations); under every ZeRO stage the
// peak tensor count did not move with the micro-batch (1 to 4), so it comes after the
// activations are gone, at the end of backward or in the step. The per-stage terms are the
// library's (Note [One memory model] in tandem/track/memory_estimate.h, which the memory tests
// hold to measured peaks): ZeRO-1 8P + 8P/W + 2B, ZeRO-2 4P + 12P/W + 2B + 4G, ZeRO-3 16P/W +
// 16U, + 8P/W with gradient accumulation. Under tensor parallel the ZeRO stages
// hold more than the formulas say, and the terms differ from model to model (a GPT of 8 x 256
// holds 42 bytes per parameter of its largest block under ZeRO-3 on 4 ranks, one of 4 x 512
// holds 27), so `tandem plan` measures each stage's transient term (for each tp size) with a
// probe at the layouts' own data-parallel size and uses the library's only where it could not
// probe. The states are DESIGN.md's formulas; the transients are tandem's buckets
// and gathers as they run today. Activations come from the probe (micro-batches 1 and 2; the share
// tensor parallel splits from a tp 2 run), scaled by the micro-batch, the stage's share of the
// model (by Korthikanti et al.'s per-layer weights) and, under 1F1B, the micro-batches in flight on
// that stage (min(m, pp - stage); interleaved 1F1B: its warm-up (v - 1) pp + 2 (pp - 1 - stage) plus
// one, of its stages' micro-batches, each 1/v of the rank's share).
MemoryPrediction predict_memory(const PlanModel& model, const Layout& layout,
                                const ProbeFigures& probe) {
  MemoryPrediction best;
  bool first = true;
  const double w = static_cast<double>(layout.dp) * std::max(1, layout.cp);  // dp x cp replicas
  const double per_sample = layout.activation_checkpointing ? probe.checkpointed_per_sample
                                                            : probe.activations_per_sample;
  const double tp_factor =
      1.0 - probe.tp_split_fraction + probe.tp_split_fraction / static_cast<double>(layout.tp);
  for (const auto& r : rank_parameters(model, layout)) {
    MemoryPrediction p;
    // Note [Expert parallel]: under a ZeRO stage the rank's experts stay whole outside its
    // shards (strategy_memory's 20E); n is the rest, which the stage shards and the probes scale.
    const double experts = layout.ep > 1 ? static_cast<double>(r.expert_parameters) : 0.0;
    const double n =
        static_cast<double>(r.parameters) - (layout.zero_stage > 0 ? experts : 0.0);
    const double l = static_cast<double>(r.largest_unit);
    const bool disk = layout.offload == "nvme";
    const bool host = layout.offload == "cpu";  // on a GPU: moments (and the step) in host memory
    // Note [One memory model]: the library's terms for the stage; offloaded moments leave the
    // rank. `p.buffers` peak after the activations are gone (end of backward, the step), except
    // under data parallel, whose buckets live through the forward as well, as do the experts'.
    const auto shared =
        track::strategy_memory(layout.zero_stage, static_cast<double>(r.parameters), w,
                               track::default_bucket_bytes(n), l, l, experts);
    p.model_states = shared.states - ((disk || host) && layout.zero_stage > 0 ? 8 * n / w : 0.0);
    p.buffers = shared.transient;
    double forward_buffers = shared.expert_transient;
    if (layout.zero_stage == 0) {
      // A pipeline averages its stage's gradients itself, once per step, without buckets.
      p.buffers = w > 1 && layout.pp == 1 ? shared.transient : 0;
      forward_buffers = p.buffers;
    } else if (layout.zero_stage == 3) {
      forward_buffers += 8 * l;  // two units gathered during the forward
    }
    // A probed figure replaces the formula's transient for the sharded rest.
    if (auto it = probe.zero_buffers.find({layout.zero_stage, layout.tp});
        it != probe.zero_buffers.end())
      p.buffers = it->second * (layout.zero_stage == 3 ? l : n) + shared.expert_transient;
    // Under ZeRO-3 with accumulation, the micro-steps between reductions keep more gradient
    // (measured on the example GPT: 8.8-10.6 bytes per parameter of the shard with LibTorch
    // 1.13, about 4.4 with 2.12, whose zero_grad frees gradients): probed where it can be.
    if (layout.zero_stage == 3 && layout.accumulation > 1) {
      const auto it = probe.zero3_accumulation.find(layout.tp);
      p.buffers += (it != probe.zero3_accumulation.end() ? it->second : 8.0) * n / w;
    }
    p.forward_buffers = forward_buffers;
    if (disk) p.buffers += 3 * 8 * l / w;  // each unit's moments streamed through 3 buffers
    p.activations = per_sample * static_cast<double>(layout.micro_batch) * r.activation_share *
                    static_cast<double>(r.in_flight) * tp_factor;
    p.workspace = probe.workspace;
    p.tensor_peak =
        p.workspace + p.model_states + std::max(p.buffers, p.forward_buffers + p.activations);
    const double world = w * layout.tp * layout.pp;
    p.rss_peak =
        probe.baseline_rss + p.tensor_peak + probe.rss_overhead + probe.rss_per_peer * (world - 1);
    p.stage = r.stage;
    p.parameters = r.parameters;
    if (first || p.rss_peak > best.rss_peak) best = p;
    first = false;
  }
  return best;
}

double layout_cost(const Layout& l) {
  double c = 1.0;
  if (l.activation_checkpointing) c *= 1.33;  // one more forward per backward
  if (l.pp > 1) {  // the 1F1B bubble; interleaved: (v m + pp - 1) / (v m)
    const double vm = static_cast<double>(l.microbatches) * std::max(1, l.virtual_stages);
    c *= (vm + l.pp - 1) / vm;
  }
  c *= 1.0 + 0.15 * (l.tp - 1);  // two all-reduces per block, forward and backward
  c *= 1.0 + 0.1 * (std::max(1, l.cp) - 1);  // keys and values around the ring, every layer
  c *= 1.0 + 0.05 * (std::max(1, l.ep) - 1);  // tokens to their experts and back, every MoE layer
  c *= 1.0 + 0.02 * l.zero_stage + (l.zero_stage == 3 ? 0.1 : 0.0);
  if (!l.offload.empty()) c *= 1.5;
  c *= 1.0 + 0.5 / static_cast<double>(l.micro_batch);  // small matrices, per-step overheads
  return c;
}

std::vector<std::string> launch_flags(const Layout& l, const PlanMachine& machine,
                                      const std::string& offload_dir) {
  std::vector<std::string> f{"--num_processes", std::to_string(machine.num_processes)};
  if (machine.num_machines > 1) {
    f.push_back("--num_machines");
    f.push_back(std::to_string(machine.num_machines));
  }
  if (!machine.cuda) f.push_back("--cpu");
  if (l.zero_stage > 0) {
    f.insert(f.end(), {"--use_deepspeed", "--zero_stage", std::to_string(l.zero_stage)});
    if (!l.offload.empty()) f.insert(f.end(), {"--offload_optimizer_device", l.offload});
    if (l.offload == "nvme") f.insert(f.end(), {"--offload_optimizer_nvme_path", offload_dir});
  }
  if (l.cp > 1) f.insert(f.end(), {"--cp_size", std::to_string(l.cp)});
  if (l.ep > 1) f.insert(f.end(), {"--ep_size", std::to_string(l.ep)});
  if (l.tp > 1) f.insert(f.end(), {"--tp_size", std::to_string(l.tp)});
  if (l.pp > 1) f.insert(f.end(), {"--pp_size", std::to_string(l.pp)});
  if (l.pp > 1 && l.virtual_stages > 1)
    f.insert(f.end(), {"--pp_schedule", "interleaved_1f1b", "--pp_virtual_stages",
                       std::to_string(l.virtual_stages)});
  if (l.accumulation > 1)
    f.insert(f.end(), {"--gradient_accumulation_steps", std::to_string(l.accumulation)});
  if (l.activation_checkpointing) f.push_back("--activation_checkpointing");
  return f;
}

config::LaunchConfig layout_config(const Layout& l, const PlanMachine& machine,
                                   const std::string& offload_dir) {
  using config::Source;
  config::LaunchConfig c;
  auto set = [&](const std::string& k, const std::string& v) {
    config::set_value(c, k, v, Source::kConfigFile, "tandem plan");
  };
  const int n = machine.num_processes;
  std::string type = n > 1 ? (machine.cuda ? "MULTI_GPU" : "MULTI_CPU") : "NO";
  if (l.zero_stage > 0) type = "DEEPSPEED";
  set("distributed_type", type);
  set("num_processes", std::to_string(n));
  set("num_machines", std::to_string(machine.num_machines));
  set("use_cpu", machine.cuda ? "false" : "true");
  if (l.zero_stage > 0) {
    set("deepspeed_config.zero_stage", std::to_string(l.zero_stage));
    set("deepspeed_config.offload_optimizer_device", l.offload.empty() ? "none" : l.offload);
    if (l.offload == "nvme") set("deepspeed_config.offload_optimizer_nvme_path", offload_dir);
  }
  if (l.accumulation > 1) set("gradient_accumulation_steps", std::to_string(l.accumulation));
  if (l.cp > 1) set("parallelism_config.parallelism_config_cp_size", std::to_string(l.cp));
  if (l.ep > 1) set("parallelism_config.parallelism_config_ep_size", std::to_string(l.ep));
  if (l.tp > 1) set("parallelism_config.parallelism_config_tp_size", std::to_string(l.tp));
  if (l.pp > 1) set("parallelism_config.pp_size", std::to_string(l.pp));
  if (l.pp > 1 && l.virtual_stages > 1) {
    set("parallelism_config.pp_schedule", "interleaved_1f1b");
    set("parallelism_config.pp_virtual_stages", std::to_string(l.virtual_stages));
  }
  if (l.activation_checkpointing) set("fsdp_config.fsdp_activation_checkpointing", "true");
  return c;
}

std::vector<std::string> program_args(const std::vector<std::string>& args, const Layout& l,
                                      int64_t steps) {
  std::vector<std::string> out;
  for (std::string a : args) {
    auto replace = [&](const std::string& key, const std::string& value) {
      for (size_t pos; (pos = a.find(key)) != std::string::npos;) a.replace(pos, key.size(), value);
    };
    replace("{batch_size}", std::to_string(l.batch_per_rank()));
    replace("{microbatches}", std::to_string(l.microbatches));
    replace("{accumulation}", std::to_string(l.accumulation));
    if (steps > 0) replace("{steps}", std::to_string(steps));
    out.push_back(a);
  }
  return out;
}

}  // namespace tandem::trials
