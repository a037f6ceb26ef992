// The checkpoint's file names and records, written and read with checks: Note [Checkpoint
// layout] in layout.h.
#include "tandem/checkpoint/layout.h"

#include <limits>
#include <map>
#include <stdexcept>
#include <utility>

#include <nlohmann/json.hpp>

#include "detail/json_depth.h"
#include "detail/posix_file.h"
#include "tandem/checkpoint/model_io.h"
#include "tandem/checkpoint/training_state.h"

namespace tandem::checkpoint::layout {
namespace {

using json = nlohmann::json;

using detail::shown;

// A decimal integer in [lo, hi] written without sign, spaces or leading zeros, or nullopt.
std::optional<long long> parse_count(const std::string& text, long long lo, long long hi) {
  if (text.empty() || text.size() > 18 ||
      text.find_first_not_of("0123456789") != std::string::npos ||
      (text.size() > 1 && text[0] == '0'))
    return std::nullopt;
  const long long v = std::stoll(text);
  if (v < lo || v > hi) return std::nullopt;
  return v;
}

constexpr long long kMaxTpSize = 1 << 16;

// Parses JSON text read from a file (Note [JSON depth limit]); `fail` is called with what is
// wrong.
template <typename Fail>
json parse_file_json(const std::string& text, Fail&& fail) {
  if (auto deep = detail::json_depth_problem(text); !deep.empty()) fail("the value " + deep);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail(std::string("it does not parse: ") + e.what());
  }
  return json();  // not reached: fail throws
}

}  // namespace

std::string indexed(const std::string& stem, std::size_t i) {
  return stem + (i == 0 ? "" : "_" + std::to_string(i));
}

std::string model_file(std::size_t i) {
  return i == 0 ? std::string(kModelFileName) : indexed("model", i) + kTensors;
}
std::string model_index_file(std::size_t i) {
  return i == 0 ? std::string(kModelIndexFileName)
                : indexed("model", i) + kTensors + ".index" + kJson;
}
std::string model_part_file(std::size_t i, int rank) {
  return indexed("model", i) + ".mp" + std::to_string(rank) + kTensors;
}

std::optional<int> model_part_rank(const std::string& f, std::size_t i) {
  const std::string prefix = indexed("model", i) + ".mp", suffix = kTensors;
  if (f.size() <= prefix.size() + suffix.size() || f.compare(0, prefix.size(), prefix) != 0 ||
      f.compare(f.size() - suffix.size(), suffix.size(), suffix) != 0)
    return std::nullopt;
  const std::string rank = f.substr(prefix.size(), f.size() - prefix.size() - suffix.size());
  if (rank.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  if (rank.size() > 9)
    throw std::runtime_error(f + ": expected a rank of fewer than 10 digits in its name (" +
                             prefix + "<rank>" + suffix + "); rename or remove the file");
  return std::stoi(rank);
}

std::string optimizer_stem(std::size_t i) { return indexed("optimizer", i); }
std::string optimizer_part_stem(std::size_t i, int rank) {
  return optimizer_stem(i) + ".mp" + std::to_string(rank);
}
std::string optimizer_shard_stem(std::size_t i, int rank) {
  return optimizer_stem(i) + ".rank" + std::to_string(rank);
}
std::string master_weights_file(std::size_t i) { return indexed("master_weights", i) + kTensors; }
std::string master_weights_part_file(std::size_t i, int rank) {
  return indexed("master_weights", i) + ".mp" + std::to_string(rank) + kTensors;
}
std::string random_states_file(int rank) {
  return "random_states_" + std::to_string(rank) + kTensors;
}
std::string custom_file(const std::string& name) { return "custom_" + name + ".bin"; }

// --- The saving run's layout ----------------------------------------------------------------

std::string SavedRunLayout::describe() const {
  std::string out = mesh.empty() ? "an unrecorded layout" : short_mesh(mesh);
  std::string extra;
  if (world > 0) extra = std::to_string(world) + (world == 1 ? " process" : " processes");
  if (!strategy.empty()) extra += (extra.empty() ? "" : ", ") + strategy;
  if (pp_virtual_stages > 1)
    extra += (extra.empty() ? "" : ", ") + std::to_string(pp_virtual_stages) +
             " pipeline stages per rank";
  if (ep_size > 1) extra += (extra.empty() ? "" : ", ") + std::string("experts over ep ") +
                            std::to_string(ep_size);
  return extra.empty() ? out : out + " (" + extra + ")";
}

std::string run_layout_json(const std::string& mesh, const std::string& strategy,
                            int pp_virtual_stages, int ep_size) {
  json doc{{"mesh", mesh}, {"strategy", strategy}};
  if (pp_virtual_stages > 1) doc["pp_virtual_stages"] = pp_virtual_stages;
  if (ep_size > 1) doc["ep_size"] = ep_size;
  return doc.dump();
}

std::string mesh_json(const std::string& mesh) { return json(mesh).dump(); }

SavedRunLayout saved_run_layout(const StateReader& r) {
  SavedRunLayout out;
  out.world = r.saved_world_size();
  auto refuse = [&](const std::string& key, const std::string& what) {
    throw std::runtime_error(r.where() + r.dir() +
                             ": state.json's \"" + key + "\" " + what + kAlteredFileFix);
  };
  // A mesh string as the topology writes it, checked part by part.
  auto checked_mesh = [&](const std::string& key, const std::string& mesh) {
    try {
      mesh_dims(mesh);
    } catch (const std::invalid_argument& e) {
      refuse(key, std::string("holds the mesh ") + shown(mesh) + ": " + e.what());
    }
    return mesh;
  };
  if (auto text = r.state(kLayoutKey)) {
    const auto doc = parse_file_json(*text, [&](const std::string& what) {
      refuse(kLayoutKey, "is " + shown(*text) + ", expected {\"mesh\", \"strategy\"}: " + what);
    });
    if (!doc.is_object() || !doc.contains("mesh") || !doc["mesh"].is_string() ||
        (doc.contains("strategy") && !doc["strategy"].is_string()))
      refuse(kLayoutKey, "is " + shown(*text) +
                             ", expected an object with the strings \"mesh\" and \"strategy\"");
    out.recorded = true;
    out.mesh = checked_mesh(kLayoutKey, doc["mesh"].get<std::string>());
    out.strategy = doc.value("strategy", "");
    // The counts recorded when above 1.
    for (auto [key, count] : {std::pair<const char*, int*>{"pp_virtual_stages", &out.pp_virtual_stages},
                              std::pair<const char*, int*>{"ep_size", &out.ep_size}}) {
      if (!doc.contains(key)) continue;
      const auto& v = doc[key];
      if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > (1 << 20))
        refuse(kLayoutKey, std::string("holds ") + key + " " + v.dump() + ", expected a count >= 1");
      *count = v.get<int>();
    }
    return out;
  }
  if (auto text = r.state(kMeshKey)) {
    const auto doc = parse_file_json(*text, [&](const std::string& what) {
      refuse(kMeshKey, "is " + shown(*text) + ", expected a mesh string: " + what);
    });
    if (!doc.is_string()) refuse(kMeshKey, "is " + shown(*text) + ", expected a mesh string");
    out.mesh = checked_mesh(kMeshKey, doc.get<std::string>());
  }
  return out;
}

// --- Mesh strings ---------------------------------------------------------------------------

std::vector<std::pair<std::string, int>> mesh_dims(const std::string& mesh) {
  std::vector<std::pair<std::string, int>> dims;
  for (size_t at = 0; at < mesh.size();) {
    const auto end = mesh.find(" x ", at);
    const auto part = mesh.substr(at, end == std::string::npos ? std::string::npos : end - at);
    const auto space = part.rfind(' ');
    const auto size = space == std::string::npos
                          ? std::nullopt
                          : parse_count(part.substr(space + 1), 1, std::numeric_limits<int>::max());
    if (space == 0 || !size)
      throw std::invalid_argument("its part " + shown(part) +
                                  " is not a dimension's name and a positive size (\"tp 2\")");
    dims.emplace_back(part.substr(0, space), static_cast<int>(*size));
    if (end == std::string::npos) break;
    at = end + 3;
  }
  return dims;
}

bool model_parallel_mesh(const std::string& mesh) {
  for (const auto& [name, n] : mesh_dims(mesh))
    if ((name == "tp" || name == "pp") && n > 1) return true;
  return false;
}

std::string short_mesh(const std::string& mesh) {
  const auto dims = mesh_dims(mesh);
  std::map<std::string, int> size(dims.begin(), dims.end());
  const int replicate = size.count("dp_replicate") ? size["dp_replicate"] : 1;
  const int shard = size.count("dp_shard") ? size["dp_shard"] : 1;
  const bool hybrid = replicate > 1 && shard > 1;
  std::string out;
  auto add = [&](const std::string& name, int n) {
    if (n > 1) out += (out.empty() ? "" : " x ") + name + " " + std::to_string(n);
  };
  for (const auto& [name, n] : dims) {
    if (name == "dp" || name == "dp_cp" || name == "dp_shard_cp") continue;  // said once
    if (name == "dp_replicate" && hybrid) add(name, n);
    else if (name == "dp_shard" && hybrid) add(name, n);
    else if (name == "dp_replicate") add("dp", replicate * shard);
    else if (name != "dp_shard") add(name, n);
  }
  return out.empty() ? "1 process" : out;
}

// --- A model part's metadata ----------------------------------------------------------------

std::map<std::string, std::string> model_part_metadata(const std::string& mesh,
                                                       std::optional<int> pipeline_stage,
                                                       const TpCut& tp) {
  std::map<std::string, std::string> meta{{"format", "pt"}, {kMeshMeta, mesh}};
  if (pipeline_stage) meta[kPipelineStageMeta] = std::to_string(*pipeline_stage);
  if (tp.size == 0) return meta;
  json split = json::object();
  for (const auto& [name, how] : tp.split) split[name] = how;
  meta[kTpRankMeta] = std::to_string(tp.rank);
  meta[kTpSizeMeta] = std::to_string(tp.size);
  meta[kTpSplitMeta] = split.dump();
  return meta;
}

bool valid_split(const std::string& how) {
  return how == "cols" || (how.rfind("rows/", 0) == 0 &&
                           parse_count(how.substr(5), 1, std::numeric_limits<int32_t>::max()));
}

long long split_parts(const std::string& how) {
  if (!valid_split(how))
    throw std::invalid_argument("a tensor-parallel split " + shown(how) +
                                " (expected \"cols\" or \"rows/<parts>\" with <parts> >= 1)");
  return how == "cols" ? 1 : std::stoll(how.substr(5));
}

TpCut read_tp_cut(const std::map<std::string, std::string>& meta, const std::string& where,
                  const std::string& fix) {
  TpCut out;
  const bool any = meta.count(kTpSizeMeta) || meta.count(kTpRankMeta) || meta.count(kTpSplitMeta);
  if (!any) return out;
  auto bad = [&](const std::string& key, const std::string& value, const std::string& expected) {
    throw std::runtime_error(where + ": metadata \"" + key + "\" is " + shown(value) +
                             ", expected " + expected + fix);
  };
  for (const char* key : {kTpSizeMeta, kTpRankMeta, kTpSplitMeta})
    if (!meta.count(key))
      throw std::runtime_error(
          where + ": the metadata has " +
          (meta.count(kTpSizeMeta) ? "\"tandem_tp_size\"" : "tensor-parallel keys") +
          " but no \"" + key +
          "\" (expected tandem_tp_size, tandem_tp_rank and tandem_tp_split together)" + fix);
  const std::string& size = meta.at(kTpSizeMeta);
  const auto tp = parse_count(size, 1, kMaxTpSize);
  if (!tp)
    bad(kTpSizeMeta, size,
        "the number of tensor-parallel ranks, an integer from 1 to " + std::to_string(kMaxTpSize));
  out.size = static_cast<int>(*tp);
  const std::string& rank = meta.at(kTpRankMeta);
  const auto r = parse_count(rank, 0, *tp - 1);
  if (!r)
    bad(kTpRankMeta, rank,
        "this file's tensor-parallel rank, an integer from 0 to " + std::to_string(*tp - 1) +
            " (tandem_tp_size is " + size + ")");
  out.rank = static_cast<int>(*r);

  const std::string& text = meta.at(kTpSplitMeta);
  const std::string expected = "a JSON object {tensor name: \"cols\" or \"rows/<parts>\"}";
  const auto cuts = parse_file_json(
      text, [&](const std::string& what) { bad(kTpSplitMeta, text, expected + " (" + what + ")"); });
  if (!cuts.is_object()) bad(kTpSplitMeta, text, expected);
  for (const auto& [name, how] : cuts.items()) {
    const std::string value = how.is_string() ? how.get<std::string>() : how.dump();
    if (!how.is_string() || !valid_split(value))
      throw std::runtime_error(
          where + ": metadata \"tandem_tp_split\" gives tensor '" + name + "' the split " +
          (how.is_string() ? shown(value) : value) +
          ", expected \"cols\" or \"rows/<parts>\" with <parts> a positive integer" + fix);
    out.split[name] = value;
  }
  return out;
}

// --- An optimizer file's record -------------------------------------------------------------

std::string optimizer_record_json(const OptimizerRecord& record) {
  json out{{"tp_rank", record.tp_rank}, {"tp_size", record.tp_size}, {"splits", record.splits}};
  if (!record.names.empty()) out["names"] = record.names;
  return out.dump();
}

OptimizerRecord read_optimizer_record(const std::string& text, const std::string& where) {
  auto refuse = [&](const std::string& what) {
    throw std::runtime_error(where + ": its \"" + std::string(kOptimizerRecordKey) +
                             "\" record " + what + kAlteredFileFix);
  };
  const auto doc =
      parse_file_json(text, [&](const std::string& what) { refuse("is not JSON (" + what + ")"); });
  if (!doc.is_object()) refuse("is not an object");
  OptimizerRecord out;
  auto count = [&](const char* key, int fallback, int lo, int hi) {
    if (!doc.contains(key)) return fallback;
    const auto& v = doc[key];
    if (!v.is_number_integer() || v.get<long long>() < lo || v.get<long long>() > hi)
      refuse("has \"" + std::string(key) + "\" " + v.dump() + ", expected an integer from " +
             std::to_string(lo) + " to " + std::to_string(hi));
    return v.get<int>();
  };
  out.tp_size = count("tp_size", 1, 1, static_cast<int>(kMaxTpSize));
  out.tp_rank = count("tp_rank", 0, 0, out.tp_size - 1);
  // A list of lists of strings.
  auto table = [&](const char* key) {
    std::vector<std::vector<std::string>> t;
    if (!doc.contains(key)) return t;
    const auto& v = doc[key];
    bool ok = v.is_array();
    for (size_t i = 0; ok && i < v.size(); ++i) {
      ok = v[i].is_array();
      std::vector<std::string> row;
      for (size_t j = 0; ok && j < v[i].size(); ++j) {
        ok = v[i][j].is_string();
        if (ok) row.push_back(v[i][j].get<std::string>());
      }
      t.push_back(std::move(row));
    }
    if (!ok) refuse("has \"" + std::string(key) + "\" that is not a list of lists of strings");
    return t;
  };
  out.names = table("names");
  out.splits = table("splits");
  if (!out.names.empty()) {
    bool same = out.names.size() == out.splits.size();
    for (size_t g = 0; same && g < out.names.size(); ++g)
      same = out.names[g].size() == out.splits[g].size();
    if (!same) refuse("has \"names\" and \"splits\" of different shapes (one split per name)");
  }
  for (const auto& row : out.splits)
    for (const auto& how : row)
      if (!how.empty() && !valid_split(how))
        refuse("gives the split " + shown(how) + ", expected \"\", \"cols\" or \"rows/<parts>\"");
  return out;
}

}  // namespace tandem::checkpoint::layout
