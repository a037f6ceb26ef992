// Memory estimates: parameter counting (GPT shape, safetensors headers) and the size formulas.
#include "tandem/track/memory_estimate.h"
#include "tandem/error.h"

#include <nlohmann/json.hpp>

#include "tandem/checkpoint/safetensors_header.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace tandem::track {
namespace fs = std::filesystem;

namespace {

constexpr double kZeroK = 12;  // fp32 master weights (4) + Adam momentum (4) + variance (4)

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

// Tensors counted so far; a layer can span shards, so groups are summed before the maximum.
struct Tally {
  int64_t total = 0;
  std::map<std::string, int64_t> groups;
  std::map<std::string, int64_t> dtypes;
  size_t tensors = 0;
};

std::string layer_of(const std::string& name) {
  std::vector<std::string> parts;
  std::stringstream ss(name);
  std::string part;
  while (std::getline(ss, part, '.')) parts.push_back(part);
  for (size_t i = 0; i < parts.size(); ++i) {
    bool numeric = !parts[i].empty() &&
                   std::all_of(parts[i].begin(), parts[i].end(),
                               [](unsigned char c) { return std::isdigit(c) != 0; });
    if (numeric && i > 0) {
      std::string out = parts[0];
      for (size_t k = 1; k <= i; ++k) out += "." + parts[k];
      return out;
    }
  }
  auto dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(0, dot);
}

// Note [One safetensors parser]: every header and index a user hands to estimate-memory goes
// through checkpoint/'s validating, fuzzed parser (tests/fuzz), never through code of its own.
void tally_header(const checkpoint::SafetensorsHeader& header, Tally& tally) {
  for (const auto& [name, info] : header.tensors) {
    const auto n = static_cast<int64_t>(info.numel());
    auto& group = tally.groups[layer_of(name)];
    if (__builtin_add_overflow(tally.total, n, &tally.total) ||
        __builtin_add_overflow(group, n, &group))
      throw std::runtime_error("the tensors' element counts add up to more than 2^63 - 1 at '" +
                               name + "'; expected a checkpoint whose shapes are real");
    tally.dtypes[std::string(checkpoint::dtype_name(info.dtype))] += n;
    ++tally.tensors;
  }
}

void tally_file(const fs::path& file, Tally& tally) {
  try {
    tally_header(checkpoint::read_safetensors_header(file.string()), tally);
  } catch (const checkpoint::SafetensorsError& e) {
    throw std::runtime_error(e.what());
  }
}

ModelSize finish_tally(const Tally& tally, const std::string& source) {
  ModelSize m;
  m.source = source;
  m.num_parameters = tally.total;
  m.stored_dtypes = tally.dtypes;
  for (const auto& [name, n] : tally.groups) {
    if (n > m.largest_layer_parameters) {
      m.largest_layer_parameters = n;
      m.largest_layer_name = name;
    }
  }
  m.notes.push_back("counted " + std::to_string(tally.tensors) +
                    " tensors from the checkpoint header; buffers stored in it count as "
                    "parameters");
  return m;
}

ModelSize read_index(const fs::path& index) {
  checkpoint::SafetensorsIndex parsed;
  try {
    parsed = checkpoint::read_safetensors_index(index.string());
  } catch (const checkpoint::SafetensorsError& e) {
    throw std::runtime_error(e.what());
  }
  Tally tally;
  for (const auto& s : parsed.files) {
    auto p = index.parent_path() / s;
    if (!fs::exists(p)) {
      throw std::runtime_error(index.string() + ": expected shard '" + s + "' beside the index, " +
                               "but it is missing; download every shard (only their headers " +
                               "are read)");
    }
    tally_file(p, tally);
  }
  return finish_tally(tally, "safetensors index " + index.filename().string() + " (" +
                                 std::to_string(parsed.files.size()) + " shards)");
}

}  // namespace

ModelSize count_gpt_parameters(const GptShape& s) {
  if (s.layers <= 0 || s.hidden <= 0 || s.vocab <= 0 || s.context <= 0) {
    throw ::tandem::Refused(
        "expected positive --layers, --hidden, --vocab and --context for a GPT "
        "shape, found layers " +
        std::to_string(s.layers) + ", hidden " + std::to_string(s.hidden) + ", vocab " +
        std::to_string(s.vocab) + ", context " + std::to_string(s.context) + "; give all four");
  }
  // Every product and sum is checked: a count past 2^63 - 1 would wrap around into nonsense.
  auto overflow = [&](const std::string& flags) {
    return ::tandem::Refused(
        flags + ": the parameter count of this shape (layers " + std::to_string(s.layers) +
        ", hidden " + std::to_string(s.hidden) + ", vocab " + std::to_string(s.vocab) +
        ", context " + std::to_string(s.context) +
        ") overflows a 64-bit integer (more than 9.2e18 parameters); expected a shape whose "
        "count fits, e.g. --layers 96 --hidden 12288 for a GPT-3-sized model");
  };
  auto mul = [&](int64_t a, int64_t b, const char* flags) {
    int64_t out = 0;
    if (__builtin_mul_overflow(a, b, &out)) throw overflow(flags);
    return out;
  };
  auto add = [&](int64_t a, int64_t b, const char* flags) {
    int64_t out = 0;
    if (__builtin_add_overflow(a, b, &out)) throw overflow(flags);
    return out;
  };
  const int64_t h = s.hidden;
  const int64_t token = mul(s.vocab, h, "--vocab with --hidden");
  const int64_t position = mul(s.context, h, "--context with --hidden");
  const int64_t block =
      add(mul(12, mul(h, h, "--hidden"), "--hidden"), mul(13, h, "--hidden"), "--hidden");
  const int64_t blocks = mul(s.layers, block, "--layers with --hidden");
  const int64_t total = add(add(add(token, position, "--vocab, --context and --hidden"), blocks,
                                "--layers, --hidden, --vocab and --context"),
                            2 * h, "--layers, --hidden, --vocab and --context");
  ModelSize m;
  m.num_parameters = total;
  m.source = "GPT: " + std::to_string(s.layers) + " layers, hidden " + std::to_string(h) +
             ", vocab " + std::to_string(s.vocab) + ", context " + std::to_string(s.context);
  std::vector<std::pair<std::string, int64_t>> layers = {
      {"token embedding", token}, {"position embedding", position}, {"transformer block", block}};
  for (const auto& [name, n] : layers) {
    if (n > m.largest_layer_parameters) {
      m.largest_layer_parameters = n;
      m.largest_layer_name = name;
    }
  }
  m.notes.push_back("output head tied to the token embedding (no extra parameters); untied adds " +
                    with_commas(token));
  m.notes.push_back("per block 12h^2 + 13h: qkv 3h^2+3h, attention projection h^2+h, MLP "
                    "4h^2+4h and 4h^2+h, two LayerNorms 2h each; final LayerNorm 2h");
  return m;
}

int64_t parse_parameter_count(const std::string& text) {
  auto fail = [&]() {
    return ::tandem::Refused(
        "expected a parameter count like 125M, 7.5B, "
        "1e9 or 350000, found '" +
        text + "'");
  };
  std::string s = text;
  s.erase(std::remove_if(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c); }),
          s.end());
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  if (s.empty()) throw fail();
  double mult = 1;
  switch (std::tolower(static_cast<unsigned char>(s.back()))) {
    case 'k': mult = 1e3; break;
    case 'm': mult = 1e6; break;
    case 'b':
    case 'g': mult = 1e9; break;
    case 't': mult = 1e12; break;
    default: break;
  }
  if (mult != 1) s.pop_back();
  if (s.empty()) throw fail();
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(v) || v <= 0 || v * mult >= 9.2e18) {
    throw fail();
  }
  return static_cast<int64_t>(std::llround(v * mult));
}

ModelSize model_size_from_count(int64_t n) {
  if (n <= 0) {
    throw ::tandem::Refused("expected a positive parameter count, found " + std::to_string(n));
  }
  ModelSize m;
  m.num_parameters = n;
  m.source = "parameter count";
  m.notes.push_back("largest layer unknown: give a checkpoint or a GPT shape to see it");
  return m;
}

ModelSize model_size_from_safetensors_header(const checkpoint::SafetensorsHeader& header,
                                             const std::string& source) {
  Tally tally;
  tally_header(header, tally);
  return finish_tally(tally, source);
}

ModelSize read_safetensors_model_size(const std::string& path_text) {
  fs::path path(path_text);
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw std::runtime_error(
        "expected a .safetensors file, a "
        "model.safetensors.index.json or a folder with one, but '" +
        path_text + "' does not exist");
  }
  if (fs::is_directory(path, ec)) {
    if (fs::exists(path / "model.safetensors.index.json")) {
      return read_index(path / "model.safetensors.index.json");
    }
    if (fs::exists(path / "model.safetensors")) path = path / "model.safetensors";
    else {
      std::vector<fs::path> indexes, files;
      for (const auto& e : fs::directory_iterator(path)) {
        auto name = e.path().filename().string();
        auto ends = [&](const std::string& suf) {
          return name.size() >= suf.size() && name.compare(name.size() - suf.size(), suf.size(), suf) == 0;
        };
        if (ends(".safetensors.index.json")) indexes.push_back(e.path());
        else if (ends(".safetensors")) files.push_back(e.path());
      }
      if (indexes.size() == 1) return read_index(indexes.front());
      if (indexes.empty() && !files.empty()) {
        std::sort(files.begin(), files.end());
        Tally tally;
        for (const auto& f : files) tally_file(f, tally);
        return finish_tally(tally, "safetensors: " + std::to_string(files.size()) +
                                       " files in " + path_text);
      }
      throw std::runtime_error("expected '" + path_text +
                               "' to hold model.safetensors, one "
                               "*.safetensors.index.json or *.safetensors files, found " +
                               std::to_string(indexes.size()) + " index files and " +
                               std::to_string(files.size()) +
                               " safetensors files; pass the file to use");
    }
  }
  auto name = path.filename().string();
  if (name.size() > 5 && name.compare(name.size() - 5, 5, ".json") == 0) return read_index(path);
  return finish_tally(
      [&] {
        Tally t;
        tally_file(path, t);
        return t;
      }(),
      "safetensors: " + path.filename().string());
}

std::vector<std::string> memory_dtypes() { return {"float32", "float16/bfloat16", "int8", "int4"}; }

StrategyMemory strategy_memory(int stage, double parameters, double world, double bucket_bytes,
                               double largest_parameter, double largest_unit, double experts) {
  // Note [Expert parallel]: under a ZeRO stage the experts a rank holds stay whole, held as data
  // parallel holds them (16 bytes each, and their own reducer's bucket copies, 4 more); the
  // stage's formula takes the rest.
  const double e = stage > 0 ? std::clamp(experts, 0.0, parameters) : 0.0;
  const double p = parameters - e, w = std::max(1.0, world);
  StrategyMemory m;
  switch (stage) {
    case 0:
      m.states = 16 * p;
      m.transient = w > 1 ? 4 * p : 0;
      m.formula = "16P + 4P";
      break;
    case 1:
      m.states = 8 * p + 8 * p / w;
      m.transient = 2 * bucket_bytes;
      m.formula = "8P + 8P/W + 2B";
      break;
    case 2:
      m.states = 4 * p + 12 * p / w;
      m.transient = 2 * bucket_bytes + 4 * largest_parameter;
      m.formula = "4P + 12P/W + 2B + 4G";
      break;
    case 3:
      m.states = 16 * p / w;
      m.transient = 16 * largest_unit;
      m.formula = "16P/W + 16U";
      break;
    default:
      throw ::tandem::Refused("strategy_memory: ZeRO stage " + std::to_string(stage) +
                              "; expected 0 (data parallel), 1, 2 or 3");
  }
  if (e > 0) {
    m.states += 16 * e;
    m.expert_transient = 4 * e;
    m.transient += m.expert_transient;
    m.formula += " + 20E";
  }
  return m;
}

double default_bucket_bytes(double parameters) {
  return std::min(4 * parameters, 25.0 * (1 << 20));
}

MemoryEstimate estimate_memory(const ModelSize& model, int64_t num_processes,
                               const std::vector<std::string>& dtypes) {
  if (num_processes < 1) {
    throw ::tandem::Refused("--num_processes must be at least 1, got " +
                                std::to_string(num_processes));
  }
  static const std::vector<std::pair<std::string, double>> kRows = {
      {"float32", 4}, {"float16/bfloat16", 2}, {"int8", 1}, {"int4", 0.5}};
  std::vector<std::string> wanted;
  for (const auto& d : dtypes) {
    std::string k = d;
    std::transform(k.begin(), k.end(), k.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    std::string row;
    if (k == "float32" || k == "fp32") row = "float32";
    else if (k == "float16" || k == "fp16" || k == "bfloat16" || k == "bf16" ||
             k == "float16/bfloat16") row = "float16/bfloat16";
    else if (k == "int8") row = "int8";
    else if (k == "int4") row = "int4";
    else {
      throw ::tandem::Refused(
          "expected dtypes among float32, float16, "
          "bfloat16, int8, int4, found '" +
          d + "'");
    }
    wanted.push_back(row);
  }
  MemoryEstimate e;
  e.model = model;
  e.num_processes = num_processes;
  const double p = static_cast<double>(model.num_parameters);
  for (const auto& [name, b] : kRows) {
    if (!wanted.empty() && std::find(wanted.begin(), wanted.end(), name) == wanted.end()) continue;
    DtypeMemory d;
    d.dtype = name;
    d.bytes_per_parameter = b;
    d.largest_layer_bytes = static_cast<double>(model.largest_layer_parameters) * b;
    d.total_bytes = p * b;
    d.training_adam_bytes = p * (2 * b + 8);
    e.dtypes.push_back(d);
  }
  const double n = static_cast<double>(num_processes);
  e.zero = {
      {"ddp", "DDP (no sharding)", "(2+2+K)P", (2 + 2 + kZeroK) * p},
      {"zero1", "ZeRO-1 (optimizer states)", "4P + KP/N", 4 * p + kZeroK * p / n},
      {"zero2", "ZeRO-2 (+ gradients)", "2P + (2+K)P/N", 2 * p + (2 + kZeroK) * p / n},
      {"zero3", "ZeRO-3 (+ parameters)", "(2+2+K)P/N", (2 + 2 + kZeroK) * p / n},
  };
  const double l = static_cast<double>(model.largest_layer_parameters);
  const double bucket = default_bucket_bytes(p);
  const std::vector<std::pair<std::string, std::string>> schemes{
      {"ddp", "DDP"}, {"zero1", "ZeRO-1"}, {"zero2", "ZeRO-2"}, {"zero3", "ZeRO-3"}};
  for (int stage = 0; stage < 4; ++stage) {
    const auto m = strategy_memory(stage, p, n, bucket, l, l);
    e.tandem_fp32.push_back({schemes[static_cast<size_t>(stage)].first,
                             schemes[static_cast<size_t>(stage)].second, m.formula, m.total()});
  }
  e.caveats = {
      "activations (they grow with batch size and sequence length, and are often the largest "
      "part of training memory; activation checkpointing trades them for compute)",
      "temporary buffers: gradient buckets for allreduce, ZeRO-3's gathered parameters, "
      "optimizer-step scratch",
      "model buffers that are not parameters (unless the checkpoint stores them)",
      "the CUDA context and library workspaces (cuBLAS, cuDNN, NCCL)",
      "allocator fragmentation and caching: keep 10-20% headroom",
  };
  return e;
}

std::string LayoutShare::name() const {
  std::string s = "pp " + std::to_string(pp);
  if (virtual_stages > 1) s += " (" + std::to_string(virtual_stages) + " stages per rank)";
  s += " x dp " + std::to_string(dp);
  if (ep > 1) s += " (ep " + std::to_string(ep) + ")";
  if (cp > 1) s += " x cp " + std::to_string(cp);
  return s + " x tp " + std::to_string(tp);
}

MemoryEstimate estimate_memory(const ModelSize& model, int64_t num_processes,
                               const std::vector<std::string>& dtypes, const LayoutShare& layout) {
  auto e = estimate_memory(model, num_processes, dtypes);
  const int64_t product = static_cast<int64_t>(layout.dp) * layout.cp * layout.tp * layout.pp;
  if (layout.dp < 1 || layout.cp < 1 || layout.tp < 1 || layout.pp < 1 ||
      product != num_processes)
    throw ::tandem::Refused("the layout " + layout.name() + " lays out " + std::to_string(product) +
                            " processes, not --num_processes " + std::to_string(num_processes));
  e.has_layout = true;
  e.layout = layout;
  const double p = static_cast<double>(layout.rank_parameters);
  const double u = static_cast<double>(layout.largest_unit);
  const double w = static_cast<double>(layout.dp) * layout.cp;
  const double experts = static_cast<double>(layout.expert_parameters);
  const std::vector<std::pair<std::string, std::string>> schemes{
      {"ddp", "DDP"}, {"zero1", "ZeRO-1"}, {"zero2", "ZeRO-2"}, {"zero3", "ZeRO-3"}};
  // tandem runs a pipeline without ZeRO (Note [Pipeline gradient sync]); ZeRO needs W > 1.
  const int last = layout.pp > 1 || w < 2 ? 0 : 3;
  for (int stage = 0; stage <= last; ++stage) {
    // The buckets over what the stage shards (under ZeRO the experts stay whole).
    const double bucket = default_bucket_bytes(stage > 0 ? p - experts : p);
    auto m = strategy_memory(stage, p, w, bucket, u, u, experts);
    if (layout.pp > 1) {
      // A pipeline averages its stage's gradients itself, once per step, without buckets.
      m.transient = 0;
      m.formula = "16P";
    }
    e.layout_fp32.push_back({schemes[static_cast<size_t>(stage)].first,
                             schemes[static_cast<size_t>(stage)].second, m.formula, m.total()});
  }
  if (layout.cp > 1)
    e.caveats.insert(e.caveats.begin(),
                     "context parallel divides each rank's activations by cp, not its model "
                     "states: the cp ranks of a replica hold the same parameters");
  return e;
}

std::string format_bytes(double bytes) {
  static const char* kUnits[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  int u = 0;
  double v = bytes;
  while (std::fabs(v) >= 1000 && u < 5) {
    v /= 1000;
    ++u;
  }
  char buf[64];
  if (u == 0 || std::fabs(v) >= 100) std::snprintf(buf, sizeof(buf), "%.0f %s", v, kUnits[u]);
  else std::snprintf(buf, sizeof(buf), "%.1f %s", v, kUnits[u]);
  return buf;
}

namespace {

std::string table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) {
      if (width.size() <= i) width.push_back(0);
      width[i] = std::max(width[i], r[i].size());
    }
  }
  std::string out;
  for (size_t k = 0; k < rows.size(); ++k) {
    std::string line = "  ";
    for (size_t i = 0; i < rows[k].size(); ++i) {
      const auto& cell = rows[k][i];
      // First column left-aligned, numbers right-aligned.
      if (i == 0) line += cell + std::string(width[i] - cell.size(), ' ');
      else line += "  " + std::string(width[i] - cell.size(), ' ') + cell;
    }
    out += line + "\n";
    if (k == 0) {
      size_t total = 0;
      for (auto w : width) total += w + 2;
      out += "  " + std::string(total - 2, '-') + "\n";
    }
  }
  return out;
}

// Word-wraps `text` at `width` columns; continuation lines start with `indent`.
std::string wrap(const std::string& first, const std::string& text, const std::string& indent,
                 size_t width = 96) {
  std::string out = first, word;
  size_t col = first.size();
  std::stringstream ss(text);
  bool line_start = true;
  while (ss >> word) {
    if (!line_start && col + 1 + word.size() > width) {
      out += "\n" + indent;
      col = indent.size();
      line_start = true;
    }
    if (!line_start) {
      out += ' ';
      ++col;
    }
    out += word;
    col += word.size();
    line_start = false;
  }
  return out + "\n";
}

}  // namespace

std::string format_memory_estimate(const MemoryEstimate& e) {
  std::string out;
  const auto& m = e.model;
  out += "Model: " + with_commas(m.num_parameters) + " parameters (" + m.source + ")\n";
  if (m.largest_layer_parameters > 0) {
    out += "Largest layer: " + m.largest_layer_name + ", " +
           with_commas(m.largest_layer_parameters) + " parameters\n";
  }
  if (!m.stored_dtypes.empty()) {
    out += "Stored as:";
    for (const auto& [d, n] : m.stored_dtypes) out += " " + d + " (" + with_commas(n) + ")";
    out += "\n";
  }
  for (const auto& note : m.notes) out += wrap("Note: ", note, "      ");

  if (!e.dtypes.empty()) {
    std::vector<std::vector<std::string>> rows = {
        {"dtype", "largest layer", "total size", "training with Adam"}};
    for (const auto& d : e.dtypes) {
      rows.push_back({d.dtype, m.largest_layer_parameters > 0 ? format_bytes(d.largest_layer_bytes)
                                                              : "-",
                      format_bytes(d.total_bytes), format_bytes(d.training_adam_bytes)});
    }
    out += "\nMemory per dtype (one copy of the model):\n" + table(rows);
    out += wrap("  training with Adam = ",
                "weights + gradients in the dtype + Adam's two moments in fp32 = P x (2b+8) "
                "bytes, b = bytes per parameter (float32: 16P, the \"4 x model size\" of "
                "Accelerate's estimate). The int8/int4 rows assume gradients in that dtype "
                "too; real quantized fine-tuning (QLoRA) trains small fp16/bf16 adapters "
                "instead.",
                "    ");
  }

  std::vector<std::vector<std::string>> rows = {{"scheme", "formula", "per device"}};
  for (const auto& z : e.zero) rows.push_back({z.stage, z.formula, format_bytes(z.bytes_per_device)});
  out += "\nModel states per device on N = " + std::to_string(e.num_processes) +
         (e.num_processes == 1 ? " process" : " processes") +
         " (ZeRO paper; fp16/bf16 mixed-precision Adam:\n"
         "2P fp16 weights, 2P fp16 gradients, K = 12 bytes/parameter of fp32 optimizer states):\n" +
         table(rows);
  rows = {{"scheme", "formula", "per device"}};
  for (const auto& z : e.tandem_fp32)
    rows.push_back({z.stage, z.formula, format_bytes(z.bytes_per_device)});
  out += "\ntandem's strategies on fp32 weights with AdamW (the memory tests hold them to the "
         "measured peaks;\nW = processes, B = a gradient bucket (25 MiB, or the model when smaller), "
         "G = U = the largest layer):\n" + table(rows);

  if (e.has_layout) {
    const auto& l = e.layout;
    rows = {{"scheme", "formula", "per device"}};
    for (const auto& z : e.layout_fp32)
      rows.push_back({z.stage, z.formula, format_bytes(z.bytes_per_device)});
    out += "\n" + wrap("On the layout " + l.name() + ": ",
                       "the rank that holds the most" +
                           (l.pp > 1 ? " (pipeline stage " + std::to_string(l.stage) + ")"
                                     : std::string()) +
                           " has " + with_commas(l.rank_parameters) + " parameters" +
                           (l.largest_unit > 0 ? ", its largest unit " + with_commas(l.largest_unit)
                                               : std::string()) +
                           " (" + l.counted + "); tandem's strategies there, W = dp x cp = " +
                           std::to_string(l.dp * l.cp) +
                           (l.pp > 1 ? " (a pipeline runs without ZeRO and reduces its "
                                       "gradients without buckets)"
                            : l.ep > 1 ? " (under ZeRO the rank's " +
                                             with_commas(l.expert_parameters) +
                                             " expert parameters E stay whole)"
                                     : std::string()) +
                           ":",
                       "") +
           table(rows);
  }
  out += "\nNot included:\n";
  for (const auto& c : e.caveats) out += wrap("  - ", c, "    ");
  out += "Units are decimal: 1 GB = 10^9 bytes.\n";
  return out;
}

std::string memory_estimate_to_json(const MemoryEstimate& e) {
  nlohmann::json j;
  const auto& m = e.model;
  j["parameters"] = m.num_parameters;
  j["source"] = m.source;
  j["largest_layer"] = {{"name", m.largest_layer_name}, {"parameters", m.largest_layer_parameters}};
  j["stored_dtypes"] = m.stored_dtypes;
  j["notes"] = m.notes;
  j["num_processes"] = e.num_processes;
  j["dtypes"] = nlohmann::json::array();
  for (const auto& d : e.dtypes) {
    j["dtypes"].push_back({{"dtype", d.dtype},
                           {"bytes_per_parameter", d.bytes_per_parameter},
                           {"largest_layer_bytes", d.largest_layer_bytes},
                           {"total_bytes", d.total_bytes},
                           {"training_adam_bytes", d.training_adam_bytes}});
  }
  j["training_adam_formula"] = "P * (2 * bytes_per_parameter + 8)";
  j["zero"] = nlohmann::json::array();
  for (const auto& z : e.zero) {
    j["zero"].push_back({{"id", z.id},
                         {"stage", z.stage},
                         {"formula", z.formula},
                         {"bytes_per_device", z.bytes_per_device},
                         {"gb_per_device", z.bytes_per_device / 1e9}});
  }
  j["zero_k"] = kZeroK;
  j["tandem_fp32"] = nlohmann::json::array();
  for (const auto& z : e.tandem_fp32)
    j["tandem_fp32"].push_back({{"id", z.id},
                                {"stage", z.stage},
                                {"formula", z.formula},
                                {"bytes_per_device", z.bytes_per_device}});
  if (e.has_layout) {
    const auto& l = e.layout;
    j["layout"] = {{"name", l.name()},
                   {"dp", l.dp},
                   {"cp", l.cp},
                   {"tp", l.tp},
                   {"pp", l.pp},
                   {"virtual_stages", l.virtual_stages},
                   {"ep", l.ep},
                   {"rank_parameters", l.rank_parameters},
                   {"expert_parameters", l.expert_parameters},
                   {"largest_unit", l.largest_unit},
                   {"stage", l.stage},
                   {"counted", l.counted},
                   {"tandem_fp32", nlohmann::json::array()}};
    for (const auto& z : e.layout_fp32)
      j["layout"]["tandem_fp32"].push_back({{"id", z.id},
                                            {"stage", z.stage},
                                            {"formula", z.formula},
                                            {"bytes_per_device", z.bytes_per_device}});
  }
  j["caveats"] = e.caveats;
  j["units"] = "bytes; gb = 10^9 bytes";
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace tandem::track
