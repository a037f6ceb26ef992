// save_model / load_model: a module's parameters and buffers as (sharded) safetensors in
// transformers' layout, plus the pure helpers (size strings, greedy shard assignment).
#include "tandem/checkpoint/model_io.h"
#include "tandem/error.h"

#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>

#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "tandem/checkpoint/safetensors.h"

namespace tandem::checkpoint {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const SafetensorsMetadata kFileMetadata = {{"format", "pt"}};

NamedTensors model_tensors(const torch::nn::Module& module) {
  NamedTensors out;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (item.value().defined()) out.emplace_back(item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (item.value().defined()) out.emplace_back(item.key(), item.value());
  }
  return out;
}

std::string shape_text(c10::IntArrayRef shape) {
  return c10::str(shape);
}

std::string dtype_text(c10::ScalarType type) {
  try {
    return std::string(dtype_name(dtype_of(type)));
  } catch (const std::invalid_argument&) {
    return c10::toString(type);
  }
}

// "model-00001-of-00003.safetensors": the shard names that save_model writes.
bool is_shard_file_name(const std::string& name) {
  const std::string head = "model-", mid = "-of-", tail = ".safetensors";
  if (name.size() != head.size() + 5 + mid.size() + 5 + tail.size()) return false;
  if (name.compare(0, head.size(), head) != 0) return false;
  if (name.compare(head.size() + 5, mid.size(), mid) != 0) return false;
  if (name.compare(name.size() - tail.size(), tail.size(), tail) != 0) return false;
  for (std::size_t i : {head.size(), head.size() + 5 + mid.size()}) {
    for (std::size_t k = i; k < i + 5; ++k) {
      if (!std::isdigit(static_cast<unsigned char>(name[k]))) return false;
    }
  }
  return true;
}

void write_file_synced(const fs::path& path, const std::string& content) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    throw std::runtime_error("save_model: cannot create '" + path.string() +
                             "': " + std::strerror(errno));
  }
  bool ok = std::fwrite(content.data(), 1, content.size(), f) == content.size();
  ok = std::fflush(f) == 0 && ok;
  ok = ::fsync(fileno(f)) == 0 && ok;
  ok = std::fclose(f) == 0 && ok;
  if (!ok) {
    throw std::runtime_error("save_model: writing '" + path.string() +
                             "' failed: " + std::strerror(errno) + " (is the disk full?)");
  }
}

// The files of a checkpoint and, for an index, which file each name is said to be in.
struct CheckpointFiles {
  std::vector<fs::path> files;
  std::optional<fs::path> index;
  std::map<std::string, std::string> weight_map;  // name -> file name (index only)
};

CheckpointFiles read_index(const fs::path& index_path) {
  SafetensorsIndex index;
  try {
    index = read_safetensors_index(index_path.string());
  } catch (const SafetensorsError& e) {
    throw std::runtime_error(std::string("load_model: ") + e.what());
  }
  CheckpointFiles out;
  out.index = index_path;
  out.weight_map = std::move(index.weight_map);
  for (const auto& f : index.files) out.files.push_back(index_path.parent_path() / f);
  return out;
}

CheckpointFiles resolve(const std::string& path) {
  fs::path p(path);
  std::error_code ec;
  auto st = fs::status(p, ec);
  if (fs::is_directory(st)) {
    if (fs::exists(p / kModelFileName)) return {{p / kModelFileName}, std::nullopt, {}};
    if (fs::exists(p / kModelIndexFileName)) return read_index(p / kModelIndexFileName);
    throw std::runtime_error("load_model: directory '" + path + "' holds neither " +
                             kModelFileName + " nor " + kModelIndexFileName +
                             " (expected a directory written by save_model)");
  }
  if (!fs::exists(st)) {
    throw std::runtime_error("load_model: '" + path + "' does not exist (expected a " +
                             ".safetensors file, an index .json or a checkpoint directory)");
  }
  if (p.extension() == ".json") return read_index(p);
  return {{p}, std::nullopt, {}};
}

struct Entry {
  std::string file;
  TensorInfo info;
};

// Every header of the checkpoint, checked against the index when there is one.
std::map<std::string, Entry> read_headers(const CheckpointFiles& files) {
  std::map<std::string, Entry> out;
  for (const auto& path : files.files) {
    SafetensorsFile f(path.string());
    for (const auto& [name, info] : f.header().tensors) {
      auto [it, inserted] = out.emplace(name, Entry{path.string(), info});
      if (!inserted) {
        throw std::runtime_error("load_model: tensor '" + name + "' is in both '" +
                                 it->second.file + "' and '" + path.string() +
                                 "' (expected each name in one shard)");
      }
      if (files.index) {
        auto m = files.weight_map.find(name);
        if (m == files.weight_map.end() || m->second != path.filename().string()) {
          throw std::runtime_error(
              "load_model: the index '" + files.index->string() + "' maps '" + name + "' to " +
              (m == files.weight_map.end() ? std::string("no file") : "'" + m->second + "'") +
              ", but it is in '" + path.string() +
              "' (the index and the shards disagree: "
              "re-save the checkpoint)");
        }
      }
    }
  }
  for (const auto& [name, file] : files.weight_map) {
    if (!out.count(name)) {
      throw std::runtime_error("load_model: the index '" + files.index->string() + "' maps '" +
                               name + "' to '" + file +
                               "', which has no such tensor (the index "
                               "and the shards disagree: re-save the checkpoint)");
    }
  }
  return out;
}

bool same_tensor(const at::Tensor& a, const at::Tensor& b) {
  return a.is_alias_of(b) && a.storage_offset() == b.storage_offset() && a.sizes() == b.sizes() &&
         a.strides() == b.strides() && a.scalar_type() == b.scalar_type();
}

}  // namespace

uint64_t parse_size(const std::string& text) {
  auto bad = [&](const std::string& why) {
    return ::tandem::Refused("size '" + text + "': " + why +
                                 " (expected a number and a unit: \"10GB\", \"1.5GB\", "
                                 "\"200MB\", \"500KB\", \"2GiB\", or bytes \"1048576\")");
  };
  std::size_t i = 0, n = text.size();
  while (i < n && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  while (n > i && std::isspace(static_cast<unsigned char>(text[n - 1]))) --n;
  unsigned __int128 whole = 0, frac = 0, scale = 1;
  std::size_t digits = 0;
  for (; i < n && std::isdigit(static_cast<unsigned char>(text[i])); ++i, ++digits) {
    if (digits >= 20) throw bad("the number is too large");
    whole = whole * 10 + static_cast<unsigned>(text[i] - '0');
  }
  if (i < n && text[i] == '.') {
    ++i;
    for (; i < n && std::isdigit(static_cast<unsigned char>(text[i])); ++i, ++digits) {
      if (scale >= static_cast<unsigned __int128>(1e18)) throw bad("too many decimals");
      frac = frac * 10 + static_cast<unsigned>(text[i] - '0');
      scale *= 10;
    }
  }
  if (digits == 0) throw bad("no number");
  while (i < n && text[i] == ' ') ++i;
  std::string unit = text.substr(i, n - i);
  uint64_t multiplier = 1;
  if (!unit.empty()) {
    if (unit.back() == 'b') {
      throw bad(
          "a lowercase 'b' is ambiguous (transformers reads \"Gb\" as gigabits); write B "
          "for bytes");
    }
    if (unit.back() != 'B') throw bad("unknown unit '" + unit + "'");
    std::string prefix;
    for (std::size_t k = 0; k + 1 < unit.size(); ++k) {
      prefix += static_cast<char>(std::tolower(static_cast<unsigned char>(unit[k])));
    }
    static const std::map<std::string, uint64_t> kUnits = {
        {"", 1},
        {"k", 1000ULL},
        {"m", 1000ULL * 1000},
        {"g", 1000ULL * 1000 * 1000},
        {"t", 1000ULL * 1000 * 1000 * 1000},
        {"ki", 1ULL << 10},
        {"mi", 1ULL << 20},
        {"gi", 1ULL << 30},
        {"ti", 1ULL << 40},
    };
    auto it = kUnits.find(prefix);
    if (it == kUnits.end()) throw bad("unknown unit '" + unit + "'");
    multiplier = it->second;
  }
  unsigned __int128 bytes = (whole * scale + frac) * multiplier / scale;
  if (bytes > std::numeric_limits<uint64_t>::max()) throw bad("more than 2^64 bytes");
  return static_cast<uint64_t>(bytes);
}

std::vector<std::vector<std::size_t>> assign_shards(const std::vector<uint64_t>& sizes,
                                                    uint64_t max_shard_size) {
  std::vector<std::vector<std::size_t>> shards;
  uint64_t current = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    uint64_t sum = 0;
    bool over = __builtin_add_overflow(current, sizes[i], &sum) || sum > max_shard_size;
    if (shards.empty() || (over && !shards.back().empty())) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(i);
    current = shards.back().size() == 1 ? sizes[i] : sum;
  }
  return shards;
}

std::string shard_file_name(std::size_t index, std::size_t count) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return buf;
}

std::vector<std::string> model_tensor_names(const torch::nn::Module& module) {
  std::vector<std::string> names;
  for (const auto& [name, _] : model_tensors(module)) names.push_back(name);
  return names;
}

void save_model(const torch::nn::Module& module, const std::string& dir,
                const std::string& max_shard_size) {
  save_model_tensors(model_tensors(module), dir, max_shard_size);
}

void save_model_tensors(const NamedTensors& tensors, const std::string& dir,
                        const std::string& max_shard_size) {
  uint64_t limit = parse_size(max_shard_size);
  if (limit == 0) {
    throw ::tandem::Refused("save_model: max_shard_size '" + max_shard_size +
                                "' is zero (expected a positive size such as \"10GB\")");
  }
  std::vector<uint64_t> sizes;
  uint64_t total = 0;
  for (const auto& [name, t] : tensors) {
    try {
      dtype_of(t.scalar_type());
    } catch (const std::invalid_argument& e) {
      throw ::tandem::Refused("save_model: tensor '" + name + "': " + e.what());
    }
    sizes.push_back(static_cast<uint64_t>(t.numel()) * t.element_size());
    total += sizes.back();
  }
  auto shards = assign_shards(sizes, limit);

  fs::path out(dir);
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec || !fs::is_directory(out)) {
    throw std::runtime_error("save_model: cannot create the directory '" + dir +
                             "': " + (ec ? ec.message() : std::string("not a directory")));
  }
  std::set<std::string> produced;
  if (shards.size() <= 1) {
    save_safetensors((out / kModelFileName).string(), tensors, kFileMetadata);
    produced.insert(kModelFileName);
  } else {
    json weight_map = json::object();
    for (std::size_t s = 0; s < shards.size(); ++s) {
      std::string file = shard_file_name(s, shards.size());
      NamedTensors part;
      for (std::size_t i : shards[s]) {
        part.push_back(tensors[i]);
        weight_map[tensors[i].first] = file;
      }
      save_safetensors((out / file).string(), part, kFileMetadata);
      produced.insert(file);
    }
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    // As transformers: json.dumps(index, indent=2, sort_keys=True) + "\n".
    write_file_synced(out / kModelIndexFileName, index.dump(2) + "\n");
    produced.insert(kModelIndexFileName);
  }
  // A stale index or shard from an earlier save would be loaded instead of, or with, this one.
  for (const auto& e : fs::directory_iterator(out, ec)) {
    std::string name = e.path().filename().string();
    bool ours = name == kModelFileName || name == kModelIndexFileName || is_shard_file_name(name);
    if (ours && !produced.count(name)) fs::remove(e.path(), ec);
  }
}

std::map<std::string, std::string> checkpoint_tensor_files(const std::string& path) {
  std::map<std::string, std::string> out;
  for (auto& [name, entry] : read_headers(resolve(path))) out[name] = entry.file;
  return out;
}

std::string LoadReport::to_string() const {
  std::string s;
  for (const auto& n : missing) s += "  missing from the checkpoint: " + n + "\n";
  for (const auto& n : unexpected) s += "  unexpected in the checkpoint: " + n + "\n";
  for (const auto& m : mismatched) {
    s += "  mismatched: " + m.name + ": checkpoint " + shape_text(m.checkpoint_shape) + " " +
         m.checkpoint_dtype + " (in '" + m.file + "'), model " + shape_text(m.model_shape) + " " +
         m.model_dtype + "\n";
  }
  return s;
}

LoadReport load_model(torch::nn::Module& module, const std::string& path,
                      const LoadOptions& options) {
  return load_model(module, path, options, SliceMap());
}

LoadReport load_model(torch::nn::Module& module, const std::string& path,
                      const LoadOptions& options, const SliceMap& slices) {
  CheckpointFiles files = resolve(path);
  std::map<std::string, Entry> entries = read_headers(files);
  NamedTensors targets = model_tensors(module);

  LoadReport report;
  std::map<std::string, const at::Tensor*> by_name;
  std::set<std::string> loadable;
  for (const auto& [name, t] : targets) by_name.emplace(name, &t);
  for (const auto& [name, t] : targets) {
    auto it = entries.find(name);
    if (it == entries.end()) continue;
    const TensorInfo& info = it->second.info;
    bool shape_ok = t.sizes().vec() == info.shape;
    bool dtype_ok = dtype_supported(info.dtype) &&
                    (options.allow_dtype_cast() || to_scalar_type(info.dtype) == t.scalar_type());
    if (shape_ok && dtype_ok) {
      loadable.insert(name);
    } else {
      report.mismatched.push_back({name, it->second.file, info.shape, t.sizes().vec(),
                                   std::string(dtype_name(info.dtype)),
                                   dtype_text(t.scalar_type())});
    }
  }
  for (const auto& target : targets) {
    const std::string& name = target.first;
    if (entries.count(name)) continue;
    // Tied weights stored once (as transformers does) are loaded through the other name.
    bool tied = std::any_of(loadable.begin(), loadable.end(), [&](const std::string& other) {
      return same_tensor(target.second, *by_name.at(other));
    });
    if (!tied) report.missing.push_back(name);
  }
  for (const auto& [name, _] : entries) {
    if (!by_name.count(name)) report.unexpected.push_back(name);
  }
  if (options.strict() && !report.ok()) {
    throw std::runtime_error(
        "load_model: checkpoint '" + path + "' does not match the module (" +
        std::to_string(report.missing.size()) + " missing, " +
        std::to_string(report.unexpected.size()) + " unexpected, " +
        std::to_string(report.mismatched.size()) + " mismatched); nothing was loaded:\n" +
        report.to_string() +
        "Fix: load the checkpoint of this model, or pass LoadOptions().strict(false) to load "
        "what matches and get this list back as a LoadReport" +
        (options.allow_dtype_cast()
             ? ""
             : " (dtype differences: LoadOptions().allow_dtype_cast(true))"));
  }

  at::NoGradGuard no_grad;
  for (const auto& file : files.files) {
    SafetensorsFile f(file.string());  // one shard mapped at a time
    for (const auto& name : f.names()) {
      if (!loadable.count(name)) continue;
      at::Tensor dst = *by_name.at(name);
      if (auto parts = slices ? slices(dst) : std::nullopt) {
        for (auto& part : *parts) f.read_range_into(name, part.begin, part.dst);
        continue;
      }
      f.read_into(name, dst);
    }
  }
  return report;
}

}  // namespace tandem::checkpoint
