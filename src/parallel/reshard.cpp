// Note [Resharding a checkpoint]: a checkpoint saved on one layout loads on another (dp, ZeRO
// 1-3, tp, pp and their meshes, at any world size the new layout allows). Every file says how
// its tensors were cut: a model.mp<r> file its tp rank and each tensor's split (Note
// [Tensor-parallel shards in checkpoints]); an optimizer file the dense names of its parameters,
// their splits and its tp rank ("tandem"); a ZeRO shard file its units (names, shapes, offsets)
// and its place in the sharding group ("zero"). SavedTensors indexes those pieces by dense name;
// a tensor is read when it is asked for, its tp shards joined into the dense tensor (one
// parameter's worth of memory), and the loading rank cuts its own part out of it
// (cut_for_rank, then the ZeRO chunk). Nothing holds the whole model: memory stays near the
// largest parameter beyond the rank's own state. The bytes are read with pread ranges, so a
// ZeRO chunk costs its own bytes only.
#include "detail/reshard.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <nlohmann/json.hpp>

#include <set>
#include <stdexcept>

#include "detail/tp_shard.h"
#include "tandem/checkpoint/layout.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/checkpoint/training_state.h"
#include "tandem/parallel/full_state.h"
#include "tandem/parallel/zero.h"

namespace tandem::parallel::detail {
namespace {

using json = nlohmann::json;
namespace layout = checkpoint::layout;

// Elements [file_begin, file_begin + length) of tensor `tensor` in `file` are elements
// [local_begin, ...) of one tp rank's tensor, flattened.
struct Range {
  std::string file, tensor;
  int64_t file_begin = 0, local_begin = 0, length = 0;
};

// One tp rank's tensor of a dense one: its shape and where its elements are.
struct Shard {
  std::vector<int64_t> shape;
  std::vector<Range> ranges;
};

// A dense tensor: its tp shards (one when it is not split) and how it was cut.
struct Pieces {
  std::string how;  // "" whole
  int tp_size = 1;
  std::map<int, Shard> shards;  // by tp rank
};

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

}  // namespace

std::map<const void*, std::string> qualified_parameter_names(
    const std::vector<std::shared_ptr<torch::nn::Module>>& models) {
  std::map<const void*, std::string> out;
  for (size_t m = 0; m < models.size(); ++m)
    for (const auto& kv : models[m]->named_parameters())
      out.emplace(kv.value().unsafeGetTensorImpl(),
                  (models.size() > 1 ? "model" + std::to_string(m) + "." : "") + kv.key());
  return out;
}

at::Tensor cut_for_rank(const at::Tensor& dense, const std::string& how, int rank, int size) {
  if (how.empty() || size == 1) return dense;
  if (how == "cols") return shard_cols(dense, rank, size);
  return shard_rows(dense, rank, size, layout::split_parts(how));
}

struct SavedTensors::Impl {
  const checkpoint::StateReader& r;
  std::vector<std::map<std::string, Pieces>> models;
  struct Optimizer {
    std::string json;  // type and param_groups
    std::map<std::string, std::map<std::string, Pieces>> fields;  // name -> field -> pieces
    std::map<std::string, int64_t> steps;
    std::map<std::string, Pieces> masters;
  };
  std::vector<Optimizer> optimizers;

  explicit Impl(const checkpoint::StateReader& reader) : r(reader) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error(r.prefix() + " load_state: " + r.dir() + ": " + what);
  }

  // Adds tp rank `tp_rank`'s shard of a dense tensor (the first copy of each rank wins: the
  // data-parallel replicas wrote the same one).
  static void add(Pieces& p, const std::string& how, int tp_rank, int tp_size, Shard shard) {
    if (how.empty()) {  // replicated: any rank's copy is the dense tensor
      tp_rank = 0;
      tp_size = 1;
    }
    if (p.shards.empty()) {
      p.how = how;
      p.tp_size = tp_size;
    }
    p.shards.emplace(tp_rank, std::move(shard));
  }

  Shard whole(const std::string& file, const std::string& tensor) const {
    const auto& info = r.tensors(file).info(tensor);
    Shard s;
    s.shape = info.shape;
    s.ranges.push_back({file, tensor, 0, 0, numel_of(info.shape)});
    return s;
  }

  void index_models(size_t count) {
    models.resize(count);
    for (size_t m = 0; m < count; ++m) {
      const auto dense = layout::model_file(m);
      if (r.has(dense)) {
        for (const auto& n : r.tensors(dense).names()) add(models[m][n], "", 0, 1, whole(dense, n));
        continue;
      }
      for (int k = 0; k < r.saved_world_size(); ++k) {
        const auto file = layout::model_part_file(m, k);
        if (!r.has(file)) continue;
        const auto& f = r.tensors(file);
        const auto cut = layout::read_tp_cut(f.metadata(), r.where() + r.dir() + "/" + file,
                                             layout::kAlteredFileFix);
        const int tp_rank = cut.size ? cut.rank : 0, tp_size = cut.size ? cut.size : 1;
        for (const auto& n : f.names()) {
          auto how = cut.split.find(n);
          add(models[m][n], how == cut.split.end() ? "" : how->second, tp_rank, tp_size,
              whole(file, n));
        }
      }
    }
  }

  // A whole optimizer file (optimizer.json or optimizer.mp<r>.json): its "tandem" part names
  // every parameter.
  void index_whole_optimizer(Optimizer& o, const std::string& stem, const std::string& masters) {
    const auto file = stem + layout::kJson;
    auto doc = json::parse(r.read_bytes(file));
    if (!doc.is_object() || !doc.contains(layout::kOptimizerRecordKey))
      fail(file + " does not name its parameters (a checkpoint of an earlier tandem): it "
           "resumes only on the layout that saved it");
    const auto t = layout::read_optimizer_record(doc[layout::kOptimizerRecordKey].dump(),
                                                 r.where() + r.dir() + "/" + file);
    if (o.json.empty()) o.json = doc.dump();
    const bool has_masters = !masters.empty() && r.has(masters);
    const json& state = doc.value("state", json::object());
    for (size_t g = 0; g < t.names.size(); ++g)
      for (size_t i = 0; i < t.names[g].size(); ++i) {
        const auto& name = t.names[g][i];
        const auto& how = t.splits[g][i];
        const auto key = "g" + std::to_string(g) + ".p" + std::to_string(i);
        if (has_masters && r.tensors(masters).contains(key))
          add(o.masters[name], how, t.tp_rank, t.tp_size, whole(masters, key));
        if (!state.contains(key)) continue;
        const auto& entry = state[key];
        if (entry.contains("step")) o.steps.emplace(name, entry["step"].get<int64_t>());
        for (const auto& f : entry["tensors"]) {
          const auto field = f.get<std::string>();
          add(o.fields[name][field], how, t.tp_rank, t.tp_size,
              whole(stem + layout::kTensors, key + "." + field));
        }
      }
  }

  // The ZeRO shard files of one sharding group (same tp rank), by their rank in it.
  void index_zero_group(Optimizer& o, const std::map<int, std::pair<std::string, json>>& files) {
    const auto& first = files.begin()->second.second;
    const int world = first["zero"]["world"].get<int>();
    if (static_cast<int>(files.size()) != world)
      fail("the sharded optimizer state of " + std::to_string(world) + " ranks has " +
           std::to_string(files.size()) + " files for one of its groups: files are missing");
    const auto t = first.contains(layout::kOptimizerRecordKey)
                       ? layout::read_optimizer_record(first[layout::kOptimizerRecordKey].dump(),
                                                       r.where() + r.dir() + "/" +
                                                           files.begin()->second.first +
                                                           layout::kJson)
                       : layout::OptimizerRecord{};
    const int tp_rank = t.tp_rank, tp_size = t.tp_size;
    const auto& units = first["zero"]["units"];
    for (size_t k = 0; k < units.size(); ++k) {
      const auto& unit = units[k];
      const auto key = unit["key"].get<std::string>();
      const int64_t numel = unit["numel"].get<int64_t>();
      const auto names = unit["names"].get<std::vector<std::string>>();
      if (!unit.contains("shapes"))
        fail("its sharded optimizer state does not record its parameters' shapes (a checkpoint "
             "of an earlier tandem): it resumes only on a layout with the same mesh");
      const auto shapes = unit["shapes"].get<std::vector<std::vector<int64_t>>>();
      std::vector<std::string> splits(names.size());  // none recorded: whole
      if (!t.splits.empty()) {
        if (k >= t.splits.size() || t.splits[k].size() != names.size())
          fail(files.begin()->second.first + layout::kJson + ": its \"" +
               layout::kOptimizerRecordKey + "\" record does not give unit " + std::to_string(k) +
               " one split for each of its " + std::to_string(names.size()) + " parameters" +
               layout::kAlteredFileFix);
        splits = t.splits[k];
      }
      const json& entry = first["state"].contains(key) ? first["state"][key] : json();
      std::vector<std::string> fields;
      if (!entry.is_null())
        for (const auto& f : entry["tensors"]) fields.push_back(f.get<std::string>());
      const bool masters = unit.value("param", false);
      int64_t offset = 0;
      for (size_t j = 0; j < names.size(); ++j) {
        const int64_t n = numel_of(shapes[j]);
        auto shard_of_field = [&](const std::string& tensor) {
          Shard s;
          s.shape = shapes[j];
          for (const auto& [q, file] : files) {
            const ShardInfo chunk = shard_of(numel, world, q);
            const int64_t begin = std::max(offset, chunk.offset);
            const int64_t end = std::min(offset + n, chunk.offset + chunk.numel);
            if (begin < end)
              s.ranges.push_back({file.first + ".safetensors", tensor, begin - chunk.offset,
                                  begin - offset, end - begin});
          }
          return s;
        };
        for (const auto& f : fields)
          add(o.fields[names[j]][f], splits[j], tp_rank, tp_size, shard_of_field(key + "." + f));
        if (masters) add(o.masters[names[j]], splits[j], tp_rank, tp_size, shard_of_field(key + ".param"));
        if (!entry.is_null() && entry.contains("step"))
          o.steps.emplace(names[j], entry["step"].get<int64_t>());
        offset += n;
      }
    }
    // Note [Expert-parallel checkpoints]: each rank's experts, whole, by name (the replicas of
    // an expert hold the same state: the first copy serves).
    for (const auto& [q, file] : files) {
      const auto& doc = file.second;
      for (const auto& e : doc["zero"].value("experts", json::array())) {
        const auto key = e.at("key").get<std::string>();
        const auto name = e.at("name").get<std::string>();
        if (!doc["state"].contains(key)) continue;
        const auto& entry = doc["state"][key];
        if (entry.contains("step")) o.steps.emplace(name, entry["step"].get<int64_t>());
        for (const auto& f : entry["tensors"])
          add(o.fields[name][f.get<std::string>()], "", 0, 1,
              whole(file.first + layout::kTensors, key + "." + f.get<std::string>()));
      }
    }
    if (o.json.empty()) {
      auto doc = first;
      doc.erase("zero");
      o.json = doc.dump();
    }
  }

  void index_optimizers(size_t count) {
    optimizers.resize(count);
    for (size_t i = 0; i < count; ++i) {
      auto& o = optimizers[i];
      const auto stem = layout::optimizer_stem(i);
      if (r.has(stem + layout::kJson)) {
        index_whole_optimizer(o, stem, layout::master_weights_file(i));
        continue;
      }
      std::map<int, std::map<int, std::pair<std::string, json>>> zero_groups;  // tp rank -> rank
      for (int k = 0; k < r.saved_world_size(); ++k) {
        const auto mp = layout::optimizer_part_stem(i, k);
        if (r.has(mp + layout::kJson)) {
          index_whole_optimizer(o, mp, layout::master_weights_part_file(i, k));
          continue;
        }
        const auto shard = layout::optimizer_shard_stem(i, k);
        if (!r.has(shard + layout::kJson)) continue;
        auto doc = json::parse(r.read_bytes(shard + layout::kJson));
        const int tp_rank =
            doc.contains(layout::kOptimizerRecordKey)
                ? layout::read_optimizer_record(doc[layout::kOptimizerRecordKey].dump(),
                                                r.where() + r.dir() + "/" + shard + layout::kJson)
                      .tp_rank
                : 0;
        zero_groups[tp_rank].emplace(doc["zero"]["rank"].get<int>(), std::make_pair(shard, doc));
      }
      for (const auto& [tp_rank, files] : zero_groups) index_zero_group(o, files);
      if (o.json.empty())
        fail("it holds no state for optimizer " + std::to_string(i) + " (" + stem +
             ".*): the run that saved it had fewer optimizers");
    }
  }

  at::Tensor dense(const Pieces& p, const std::string& what) const {
    std::vector<at::Tensor> shards;
    for (int k = 0; k < p.tp_size; ++k) {
      auto it = p.shards.find(k);
      if (it == p.shards.end())
        fail(what + ": tensor-parallel shard " + std::to_string(k) + " of " +
             std::to_string(p.tp_size) + " is missing");
      const auto& s = it->second;
      const auto dtype = checkpoint::to_scalar_type(
          r.tensors(s.ranges.front().file).info(s.ranges.front().tensor).dtype);
      auto local = at::empty(s.shape, at::TensorOptions().dtype(dtype));
      auto flat = local.view({-1});
      int64_t covered = 0;
      for (const auto& range : s.ranges) {
        auto dst = flat.narrow(0, range.local_begin, range.length);
        r.tensors(range.file).read_range_into(range.tensor, range.file_begin, dst);
        covered += range.length;
      }
      if (covered != local.numel())
        fail(what + ": its saved pieces cover " + std::to_string(covered) + " of " +
             std::to_string(local.numel()) + " elements");
      shards.push_back(local);
    }
    return p.tp_size == 1 ? shards.front() : join_tensor_parallel_shards(shards, p.how);
  }
};

SavedTensors::SavedTensors(const checkpoint::StateReader& r, size_t models, size_t optimizers)
    : impl_(std::make_unique<Impl>(r)) {
  impl_->index_models(models);
  try {
    impl_->index_optimizers(optimizers);
  } catch (const nlohmann::json::exception& e) {
    // A record of an optimizer file that is not what tandem wrote (a key missing, a value of
    // another type): named, never a bare JSON error.
    impl_->fail(std::string("its optimizer files' records are not what save_state() wrote (") +
                e.what() + ")" + layout::kAlteredFileFix);
  }
}

SavedTensors::~SavedTensors() = default;

at::Tensor SavedTensors::model_tensor(size_t m, const std::string& name) const {
  const auto& index = impl_->models.at(m);
  auto it = index.find(name);
  if (it == index.end()) return {};
  return impl_->dense(it->second, "model tensor " + name);
}

std::string SavedTensors::optimizer_json(size_t o) const { return impl_->optimizers.at(o).json; }

std::vector<std::string> SavedTensors::fields(size_t o, const std::string& name) const {
  std::vector<std::string> out;
  const auto& f = impl_->optimizers.at(o).fields;
  auto it = f.find(name);
  if (it != f.end())
    for (const auto& [field, p] : it->second) out.push_back(field);
  return out;
}

at::Tensor SavedTensors::field(size_t o, const std::string& name, const std::string& field) const {
  return impl_->dense(impl_->optimizers.at(o).fields.at(name).at(field),
                      "optimizer state " + name + "." + field);
}

std::optional<int64_t> SavedTensors::step(size_t o, const std::string& name) const {
  const auto& s = impl_->optimizers.at(o).steps;
  auto it = s.find(name);
  if (it == s.end()) return std::nullopt;
  return it->second;
}

at::Tensor SavedTensors::master(size_t o, const std::string& name) const {
  const auto& m = impl_->optimizers.at(o).masters;
  auto it = m.find(name);
  if (it == m.end()) return {};
  return impl_->dense(it->second, "master weight " + name);
}

bool SavedTensors::has_master(size_t o, const std::string& name) const {
  return impl_->optimizers.at(o).masters.count(name) > 0;
}

}  // namespace tandem::parallel::detail
