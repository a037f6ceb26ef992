// The ZeRO strategy's checkpoints: optimizer shards, whole weights one unit at a time,
// resharding and loading into shards (strategy.h).
#include "strategy.h"
#include "tandem/error.h"

namespace tandem::parallel::detail::zero {

namespace {
// The optimizer-state key of each expert s holds (Note [Expert-parallel checkpoints]).
std::vector<std::string> expert_keys(const ShardedOptimizer& s) {
  const auto at = expert_index_in_group(s);
  std::vector<std::string> keys;
  for (size_t j = 0; j < s.experts.size(); ++j)
    keys.push_back(checkpoint::optimizer_param_key(static_cast<size_t>(s.experts[j].group), at[j]));
  return keys;
}
}  // namespace

// The layout travels with the state, so that another number of ranks can cut it again.
checkpoint::OptimizerState ZeroStrategy::optimizer_shard_state(
    const torch::optim::Optimizer& optimizer) const {
  const auto* s = find(optimizer);
  TANDEM_CHECK(s, "optimizer_shard_state: not a sharded optimizer");
  // Note [Optimizer state on disk]: read for the save, and let go again after it.
  std::vector<StateFields> read_back;
  if (s->disk)
    for (size_t k = 0; k < s->units.size(); ++k) {
      read_back.push_back(checkpoint::optimizer_state_tensors(
          const_cast<torch::optim::Optimizer&>(optimizer), s->units[k].shard_param));
      s->disk->load_copy(k, read_back.back());
    }
  auto st = checkpoint::optimizer_state(optimizer);
  for (size_t k = 0; k < read_back.size(); ++k)
    if (s->disk->on_disk(k))
      for (auto& [name, t] : read_back[k]) *t = at::Tensor();  // the copies live on in `st` alone
  auto doc = json::parse(st.json);
  json units = json::array();
  const auto index = index_in_group(*s);
  for (size_t k = 0; k < s->units.size(); ++k) {
    const auto& u = s->units[k];
    const auto key = checkpoint::optimizer_param_key(static_cast<size_t>(u.group), index[k]);
    json shapes = json::array();  // Note [Resharding a checkpoint]: each parameter's shape
    for (const auto& p : u.params) shapes.push_back(p.sizes().vec());
    units.push_back({{"key", key}, {"numel", u.numel}, {"names", u.names}, {"shapes", shapes},
                     {"param", !u.alias}});
    if (!u.alias) st.tensors.emplace_back(key + ".param", u.shard_param.detach().cpu());
  }
  doc["zero"] = {{"world", ctx_.pg->size()},
                 {"rank", ctx_.pg->rank()},
                 {"stage", options_.stage()},
                 {"units", units}};
  // Note [Expert-parallel checkpoints]: the experts this rank holds, whole, by name (their state
  // is among the optimizer's, under their keys).
  if (!s->experts.empty()) {
    json experts = json::array();
    const auto keys = expert_keys(*s);
    for (size_t j = 0; j < s->experts.size(); ++j)
      experts.push_back(
          {{"key", keys[j]},
           {"name", s->experts[j].name},
           {"shape", s->experts[j].param.sizes().vec()}});
    doc["zero"]["experts"] = experts;
  }
  st.json = doc.dump(2);
  return st;
}

void ZeroStrategy::load_optimizer_shards(
    torch::optim::Optimizer& optimizer,
    const std::function<std::string(int)>& json_of,
    const std::function<at::Tensor(int, const std::string&)>& tensor_of) {
  auto* s = find(optimizer);
  TANDEM_CHECK(s, "load_optimizer_shards: not a sharded optimizer");
  const auto& pg = *ctx_.pg;
  auto doc = json::parse(json_of(0));
  TANDEM_CHECK(doc.contains("zero"), pg.prefix(), " load_state: the optimizer state was not "
              "saved sharded");
  const json units = doc["zero"]["units"];  // a copy: "zero" is erased below
  // The saving run's sharding group: its world, or under hybrid sharding one replica's ranks
  // (Note [Hybrid sharding]: the first replica wrote the parts).
  const int saved_world = doc["zero"].at("world").get<int>();
  TANDEM_CHECK(units.size() == s->units.size(), pg.prefix(), " load_state: the checkpoint's "
              "sharded optimizer has ", units.size(), " units, this run's ", s->units.size(),
              ": the model or its optimizer groups differ from the saved run's");
  checkpoint::OptimizerState state;
  std::map<std::string, size_t> unit_of_key;
  for (size_t k = 0; k < s->units.size(); ++k) {
    const auto& u = s->units[k];
    const auto saved_names = units[k]["names"].get<std::vector<std::string>>();
    TANDEM_CHECK(units[k]["numel"].get<int64_t>() == u.numel && saved_names == u.names,
                pg.prefix(), " load_state: unit ", k, " of the checkpoint holds ",
                units[k]["numel"].get<int64_t>(), " elements (", saved_names.front(), ", ...), "
                "this run's ", u.numel, " (", u.names.front(), ", ...): the model differs from "
                "the saved run's");
    unit_of_key[units[k]["key"].get<std::string>()] = k;
  }
  // Note [Expert-parallel checkpoints]: each expert this rank holds, whole, from the entry that
  // names it: saved key -> this run's key (its index in its group here).
  std::map<std::string, std::string> expert_key;
  {
    std::map<std::string, std::string> saved_key;
    for (const auto& e : doc["zero"].value("experts", json::array()))
      saved_key[e.at("name").get<std::string>()] = e.at("key").get<std::string>();
    const auto keys = expert_keys(*s);
    for (size_t j = 0; j < s->experts.size(); ++j) {
      auto it = saved_key.find(s->experts[j].name);
      TANDEM_CHECK(it != saved_key.end(), pg.prefix(), " load_state: the checkpoint's sharded "
                  "optimizer holds no state for the expert ", s->experts[j].name,
                  " this rank holds: it was saved without that expert on this rank");
      expert_key[it->second] = keys[j];
    }
  }
  // Each tensor of this rank's new chunk, assembled from the saved chunks that overlap it.
  auto assemble = [&](const Unit& u, const std::string& name) {
    // A chunk that is padding only (a 3-element unit on 4 ranks) has no pieces: zeros.
    at::Tensor out = at::zeros({u.shard.numel}, u.shard_param.options().requires_grad(false));
    for (const auto& piece : reshard_pieces(u.numel, saved_world, pg.size(), pg.rank())) {
      at::Tensor src = tensor_of(piece.source_rank, name);
      out.narrow(0, piece.target_offset, piece.length)
          .copy_(src.reshape({-1}).narrow(0, piece.source_offset, piece.length));
    }
    return out;
  };
  json state_here = json::object();  // under this run's keys
  for (auto& [key, entry] : doc["state"].items()) {
    if (auto e = expert_key.find(key); e != expert_key.end()) {
      for (const auto& field : entry["tensors"]) {
        const std::string f = field.get<std::string>();
        state.tensors.emplace_back(e->second + "." + f, tensor_of(0, key + "." + f));
      }
      state_here[e->second] = entry;
      continue;
    }
    state_here[key] = entry;
    auto it = unit_of_key.find(key);
    TANDEM_CHECK(it != unit_of_key.end(), pg.prefix(), " load_state: optimizer state for ", key,
                " belongs to no unit");
    const auto& u = s->units[it->second];
    for (const auto& field : entry["tensors"]) {
      const std::string name = key + "." + field.get<std::string>();
      state.tensors.emplace_back(name, assemble(u, name));
    }
  }
  // The shapes are this run's chunks.
  for (auto& group : doc["param_groups"]) {
    for (auto& shape : group["shapes"]) shape = json::array();
  }
  const auto index = index_in_group(*s);
  for (size_t k = 0; k < s->units.size(); ++k)
    doc["param_groups"][static_cast<size_t>(s->units[k].group)]["shapes"][index[k]] =
        {s->units[k].shard.numel};
  const auto at = expert_index_in_group(*s);
  for (size_t j = 0; j < s->experts.size(); ++j)
    doc["param_groups"][static_cast<size_t>(s->experts[j].group)]["shapes"][at[j]] =
        s->experts[j].param.sizes().vec();
  doc["state"] = state_here;
  doc.erase("zero");
  state.json = doc.dump();
  checkpoint::load_optimizer_state(optimizer, state);
  if (s->disk)  // Note [Optimizer state on disk]: the loaded state goes to the file
    for (size_t k = 0; k < s->units.size(); ++k)
      s->disk->store(k, checkpoint::optimizer_state_tensors(optimizer, s->units[k].shard_param));
  // fp32 / host copies of the weights: restored exactly (the model file has them rounded).
  at::NoGradGuard no_grad;
  for (auto& [key, k] : unit_of_key) {
    auto& u = s->units[k];
    if (u.alias) continue;
    if (units[k].value("param", false))
      u.shard_param.copy_(assemble(u, key + ".param"));
    else if (u.resident)  // saved without copies: the (loaded) weights are the best there is
      u.shard_param.copy_(u.flat.narrow(0, u.shard.offset, u.shard.numel));
  }
}

// Note [Full state, one unit at a time]: every rank gathers each released unit in turn (the
// same collectives in the same order everywhere); the main process copies its parameters out
// and every rank frees it again, so no rank but the main one ever holds more than one unit
// beyond its shards.
std::vector<std::pair<std::string, at::Tensor>> ZeroStrategy::model_state(
    torch::nn::Module& model) {
  // The first replica's first rank (its replicas hold the same shards).
  const bool main = ctx_.pg->rank() == 0 && (!ctx_.replicate_pg || ctx_.replicate_pg->rank() == 0);
  std::map<const void*, at::Tensor> copies;
  std::set<const void*> in_model;
  for (const auto& p : model.parameters()) in_model.insert(p.unsafeGetTensorImpl());
  at::NoGradGuard no_grad;
  for (auto& s : sharded_)
    for (auto& u : s->units) {
      if (u.resident || !in_model.count(u.params.front().unsafeGetTensorImpl())) continue;
      gather_unit(u, *ctx_.pg);
      if (main)
        for (const auto& p : u.params)
          copies[p.unsafeGetTensorImpl()] = p.detach().to(at::kCPU, false, true);
      release_unit(u);
    }
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (!main) {  // only the main process writes models, the others the experts they hold
    for (const auto& kv : model.named_parameters())
      if (kv.value().defined() && experts_.contains(kv.value()))
        out.emplace_back(kv.key(), kv.value().detach());
    return out;
  }
  for (const auto& kv : model.named_parameters()) {
    if (!kv.value().defined()) continue;
    auto it = copies.find(kv.value().unsafeGetTensorImpl());
    out.emplace_back(kv.key(), it != copies.end() ? it->second : kv.value().detach());
  }
  for (const auto& kv : model.named_buffers())
    if (kv.value().defined()) out.emplace_back(kv.key(), kv.value().detach());
  return out;
}

// Note [Resharding a checkpoint]: the optimizer of a run saved on another layout, restored
// through load_optimizer_shards as if one rank had saved this run's units whole: each unit's
// tensors are its parameters' dense state (cut for this rank's tp coordinate) laid end to end,
// made when asked for, one unit and field at a time.
void ZeroStrategy::load_optimizer_resharded(torch::optim::Optimizer& optimizer,
                                            const ResavedOptimizer& saved) {
  auto* s = find(optimizer);
  TANDEM_CHECK(s, "load_optimizer_resharded: not a sharded optimizer");
  json doc = json::parse(saved.json);
  const auto& pg = *ctx_.pg;
  const size_t groups = optimizer.param_groups().size();
  TANDEM_CHECK(doc.contains("param_groups") && doc["param_groups"].size() == groups, pg.prefix(),
              " load_state: the checkpoint's optimizer has ",
              doc.contains("param_groups") ? doc["param_groups"].size() : 0,
              " parameter groups, this run's ", groups, ": build the optimizer as it was saved");
  json units = json::array(), state = json::object();
  const auto index = index_in_group(*s);
  std::vector<size_t> per_group(groups, 0);
  std::map<std::string, const Unit*> unit_of_key;
  for (size_t k = 0; k < s->units.size(); ++k) {
    const auto& u = s->units[k];
    ++per_group[static_cast<size_t>(u.group)];
    const auto key = checkpoint::optimizer_param_key(static_cast<size_t>(u.group), index[k]);
    unit_of_key[key] = &u;
    bool masters = !u.alias;
    for (const auto& n : u.names) masters = masters && saved.has_master(n);
    units.push_back({{"key", key}, {"numel", u.numel}, {"names", u.names}, {"param", masters}});
    const auto fields = saved.fields(u.names.front());
    if (fields.empty()) continue;
    json entry{{"tensors", fields}};
    if (auto step = saved.step(u.names.front())) entry["step"] = *step;
    state[key] = entry;
  }
  // Note [Expert-parallel checkpoints]: the experts this rank holds, whole, by name.
  json experts = json::array();
  std::map<std::string, std::string> expert_of_key;
  const auto keys = expert_keys(*s);
  for (size_t j = 0; j < s->experts.size(); ++j) {
    const auto& e = s->experts[j];
    ++per_group[static_cast<size_t>(e.group)];
    const auto& key = keys[j];
    experts.push_back({{"key", key}, {"name", e.name}});
    expert_of_key[key] = e.name;
    const auto fields = saved.fields(e.name);
    if (fields.empty()) continue;
    json entry{{"tensors", fields}};
    if (auto step = saved.step(e.name)) entry["step"] = *step;
    state[key] = entry;
  }
  for (size_t g = 0; g < groups; ++g) {
    doc["param_groups"][g]["num_params"] = per_group[g];
    doc["param_groups"][g]["shapes"] = json::array();
    for (size_t i = 0; i < per_group[g]; ++i) doc["param_groups"][g]["shapes"].push_back(json::array());
  }
  doc["state"] = state;
  doc["zero"] = {{"world", 1}, {"rank", 0}, {"stage", options_.stage()}, {"units", units},
                 {"experts", experts}};
  const std::string text = doc.dump();
  load_optimizer_shards(
      optimizer, [&](int) { return text; },
      [&](int, const std::string& name) {
        const auto dot = name.rfind('.');
        const auto key = name.substr(0, dot), field = name.substr(dot + 1);
        if (auto e = expert_of_key.find(key); e != expert_of_key.end()) {
          auto t = saved.field(e->second, field);
          TANDEM_CHECK(t.defined(), pg.prefix(), " load_state: the checkpoint has no ", field,
                      " for the expert ", e->second);
          return t;
        }
        const Unit& u = *unit_of_key.at(key);
        std::vector<at::Tensor> parts;
        for (const auto& n : u.names) {
          auto t = field == "param" ? saved.master(n) : saved.field(n, field);
          TANDEM_CHECK(t.defined(), pg.prefix(), " load_state: the checkpoint has no ", field,
                      " for ", n, ", but does for ", u.names.front(), " of the same unit");
          parts.push_back(t.reshape({-1}));
        }
        return at::cat(parts);
      });
}

// The parameters of `model` whose storage is released here (ZeRO-3 units between uses, units
// sharded as they were built): the slices of them this rank holds. The units' resident copies
// (fp32 or host shards of resident units), which follow the weights once they are loaded, go
// to `resident_copies`.
std::map<const void*, std::vector<checkpoint::TensorSlice>> ZeroStrategy::released_slices(
    torch::nn::Module& model, std::vector<Unit*>& resident_copies) {
  std::set<const void*> in_model;
  for (const auto& p : model.parameters()) in_model.insert(p.unsafeGetTensorImpl());
  for (auto& s : sharded_)
    for (auto& u : s->units) finish_gather(u);  // no all-gather writes while the file is read
  std::map<const void*, std::vector<checkpoint::TensorSlice>> slices;
  // The parameters laid end to end at `offsets`, of which this rank holds `chunk`, elements
  // [shard.offset, shard.offset + shard.numel).
  auto add_slices = [&](const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets,
                        const ShardInfo& shard, const at::Tensor& chunk) {
    for (size_t k = 0; k < params.size(); ++k) {
      auto& parts = slices[params[k].unsafeGetTensorImpl()];  // present even when empty
      const int64_t begin = std::max(offsets[k], shard.offset);
      const int64_t end = std::min(offsets[k] + params[k].numel(), shard.offset + shard.numel);
      if (begin < end)
        parts.push_back({begin - offsets[k], chunk.detach().narrow(0, begin - shard.offset, end - begin)});
    }
  };
  for (auto& s : sharded_)
    for (auto& u : s->units) {
      if (!in_model.count(u.params.front().unsafeGetTensorImpl())) continue;
      if (u.resident || u.gathered) {
        if (!u.alias) resident_copies.push_back(&u);
        continue;
      }
      add_slices(u.params, u.offsets, u.shard, u.shard_param);
    }
  // Units sharded while the model was built, before prepare(optimizer) made them its units.
  for (auto& b : built_)
    if (!b->gathered && in_model.count(b->params.front().unsafeGetTensorImpl()))
      add_slices(b->params, b->offsets, b->shard, b->chunk);
  return slices;
}

void ZeroStrategy::load_model_tensors(torch::nn::Module& model,
                                      const std::function<at::Tensor(const std::string&)>& local) {
  std::vector<Unit*> resident_copies;
  const auto slices = released_slices(model, resident_copies);
  at::NoGradGuard no_grad;
  auto load = [&](const std::string& name, at::Tensor& t) {
    auto source = local(name);
    auto it = slices.find(t.unsafeGetTensorImpl());
    if (it == slices.end()) {
      t.copy_(source);
      return;
    }
    TANDEM_CHECK(source.sizes() == t.sizes(), ctx_.pg->prefix(), " load_state: ", name,
                " has shape ", source.sizes(), " in the checkpoint, ", t.sizes(), " here");
    auto flat = source.reshape({-1});
    for (const auto& slice : it->second)
      slice.dst.copy_(flat.narrow(0, slice.begin, slice.dst.numel()));
  };
  for (auto p : model.named_parameters()) load(p.key(), p.value());
  for (auto b : model.named_buffers())
    if (b.value().defined()) load(b.key(), b.value());
  for (auto* u : resident_copies)
    u->shard_param.copy_(u->flat.narrow(0, u->shard.offset, u->shard.numel));
}

// Note [Loading into shards]: a released unit's parameters are read only where this rank's
// chunk covers them (the safetensors headers give each tensor's offsets, so each rank reads its
// byte ranges and no rank holds the whole model); resident units are loaded whole. The checks
// of load_model (names, shapes, dtypes, strict) see every parameter as it is in the model.
checkpoint::LoadReport ZeroStrategy::load_model_state(torch::nn::Module& model,
                                                      const std::string& path,
                                                      const checkpoint::LoadOptions& options) {
  std::vector<Unit*> resident_copies;
  const auto slices = released_slices(model, resident_copies);
  auto report = checkpoint::load_model(model, path, options,
                         [&](const at::Tensor& t) -> std::optional<std::vector<checkpoint::TensorSlice>> {
                           auto it = slices.find(t.unsafeGetTensorImpl());
                           if (it == slices.end()) return std::nullopt;
                           return it->second;
                         });
  // fp32 or host copies of resident units follow the loaded weights.
  at::NoGradGuard no_grad;
  for (auto* u : resident_copies)
    u->shard_param.copy_(u->flat.narrow(0, u->shard.offset, u->shard.numel));
  return report;
}

}  // namespace tandem::parallel::detail::zero
