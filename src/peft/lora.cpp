// LoRA adapters, PEFT's files, merging (tandem/peft/lora.h).
#include "tandem/peft/lora.h"

#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <cstring>

#include "tandem/checkpoint/model_io.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/comm/process_group.h"
#include "tandem/error.h"
#include "tandem/nn/module.h"
#include "tandem/parallel/full_state.h"
#include "tandem/parallel/tensor_parallel.h"

namespace tandem::peft {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const char* kAdapterFile = "adapter_model.safetensors";
const char* kAdapterConfig = "adapter_config.json";
const std::string kPrefix = "base_model.model.";
bool targeted(const std::string& path, const std::vector<std::string>& targets) {
  for (const auto& t : targets)
    if (path == t || (path.size() > t.size() && path.compare(path.size() - t.size(), t.size(), t) == 0 &&
                      path[path.size() - t.size() - 1] == '.'))
      return true;
  return false;
}

bool is_adapter_name(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw Refused("cannot read " + path.string());
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw Refused(path.string() + ": not JSON (" + e.what() + ")");
  }
}

// Note [LoRA under tensor parallel]: apply_lora after Accelerator::parallelize finds the
// column- and row-parallel layers at the targets and gives each an adapter that splits as its
// layer does (Note [Adapters on tensor-parallel layers]), as Megatron's and NeMo's LoRA do:
//   column-parallel (q/k/v, gate/up): y_r = W_r x + s B_r copy(A x): A [r, in] whole on every
//     rank, B split by rows like W; copy_to_region on A x sums the partial gradients of A x over
//     the group, so every rank's A gets the whole gradient;
//   row-parallel (o, down): y = reduce(W_r x_r) + s B reduce(A_r x_r): A split by columns like
//     W, B [out, r] whole; the reduction moves r numbers per token, not out.
// A and B are made dense in the dense layer's order (the same random numbers as apply_lora on
// the dense model) and cut, so the adapters start equal to the dense run's; get_state_dict joins
// them under the dense names (mark_split). Not under sequence parallel (refused).
std::vector<at::Tensor*> adapt_tensor_parallel(parallel::TensorParallelModule& m,
                                               const std::string& path, const LoraOptions& options,
                                               const at::Tensor& weight) {
  auto* column = dynamic_cast<parallel::ColumnParallelLinearImpl*>(&m);
  auto* row = dynamic_cast<parallel::RowParallelLinearImpl*>(&m);
  if (!column && !row)
    throw Refused("LoRA: " + path + " (" + m.name() + ") is a tensor-parallel layer that takes "
                  "no adapter; name only linear layers in target_modules");
  if (m.sequence_parallel())
    throw Refused("LoRA: " + path + " is sequence parallel, whose layers see part of the "
                  "sequence; adapters are not placed there yet: use a tensor-parallel plan "
                  "without sequence parallel");
  const auto group = m.group();
  const int rank = group->rank(), size = group->size();
  const int64_t in = column ? column->options.in_features() : row->options.in_features();
  const int64_t out = column ? column->options.out_features() : row->options.out_features();
  const int64_t r = options.r();
  torch::nn::Linear a(torch::nn::LinearOptions(in, r).bias(false));  // as the dense apply_lora
  torch::nn::Linear b(torch::nn::LinearOptions(r, out).bias(false));
  b->weight.zero_();
  const std::string how = column ? "rows/" + std::to_string(column->options.parts()) : "cols";
  at::Tensor& split = column ? b->weight : a->weight;
  split.set_data(parallel::cut_tensor_parallel_shard(split, how, rank, size).contiguous());
  a->to(weight.device(), weight.scalar_type());
  b->to(weight.device(), weight.scalar_type());
  m.register_module("lora_A", a);
  m.register_module("lora_B", b);
  m.mark_split(split, how);
  const double scale = options.scale(), p = options.dropout();
  auto* module = &m;
  const bool is_column = column != nullptr;
  m.add_adapter("lora", [a = a.ptr(), b = b.ptr(), group, p, scale, module,
                         is_column](const at::Tensor& input) {
    auto x = input;
    if (p > 0 && module->is_training()) x = torch::dropout(x, p, true);
    auto h = a->forward(x.to(a->weight.scalar_type()));
    h = is_column ? parallel::copy_to_region(h, group) : parallel::reduce_from_region(h, group);
    return b->forward(h) * scale;
  });
  return {&a->weight, &b->weight};
}

}  // namespace

double LoraOptions::scale() const {
  return use_rslora() ? alpha() / std::sqrt(static_cast<double>(r())) : alpha() / static_cast<double>(r());
}

std::vector<at::Tensor> apply_lora(torch::nn::Module& model, const LoraOptions& options) {
  if (options.r() <= 0) throw Refused("LoRA: r is " + std::to_string(options.r()) + "; it must be positive");
  if (options.dropout() < 0 || options.dropout() >= 1)
    throw Refused("LoRA: dropout " + std::to_string(options.dropout()) + ": expected [0, 1)");
  if (options.target_modules().empty())
    throw Refused("LoRA: target_modules is empty; name the layers that get adapters (q_proj, v_proj, ...)");
  torch::NoGradGuard no_grad;
  for (auto& p : model.parameters()) p.requires_grad_(false);
  std::vector<at::Tensor> trainable;
  std::set<std::string> matched;
  const double scale = options.scale(), p = options.dropout();
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const auto& path = item.key();
    if (!targeted(path, options.target_modules())) continue;
    if (is_adapter_name(path + ".")) continue;
    auto& m = *item.value();
    for (const auto& t : options.target_modules())
      if (targeted(path, {t})) matched.insert(t);
    const auto own = m.named_parameters(/*recurse=*/false);  // find() points into it
    const auto* weight = own.find("weight");
    if (!weight || weight->dim() != 2)
      throw Refused("LoRA: " + path + " (" + m.name() + ") is a target but not a linear layer "
                    "(a 2-D weight [out, in]); name only linear layers in target_modules");
    if (m.named_children().contains("lora_A"))
      throw Refused("LoRA: " + path + " already has an adapter; apply_lora once");
    if (auto* tp = dynamic_cast<parallel::TensorParallelModule*>(&m)) {
      for (auto* t : adapt_tensor_parallel(*tp, path, options, *weight)) {
        t->requires_grad_(true);
        trainable.push_back(*t);
      }
      continue;
    }
    auto* h = tandem::nn::hookable(m);
    if (!h)
      throw Refused("LoRA: " + path + " (" + m.name() + ") cannot be reached by a forward hook; "
                    "declare it as tandem::nn::Linear (tandem/nn/module.h)");
    const auto out = weight->size(0), in = weight->size(1);
    torch::nn::Linear a(torch::nn::LinearOptions(in, options.r()).bias(false));  // Kaiming-uniform, a = sqrt(5)
    torch::nn::Linear b(torch::nn::LinearOptions(options.r(), out).bias(false));
    b->weight.zero_();
    a->to(weight->device(), weight->scalar_type());
    b->to(weight->device(), weight->scalar_type());
    m.register_module("lora_A", a);
    m.register_module("lora_B", b);
    for (auto* t : {&a->weight, &b->weight}) {
      t->requires_grad_(true);
      trainable.push_back(*t);
    }
    auto* module = &m;
    h->hooks().add(
        "lora", tandem::nn::order::kAdapter,  // inside a ZeRO-3 gather, outside offload
        [a = a.ptr(), b = b.ptr(), p, scale, module, path](
            const std::vector<at::Tensor>& inputs, const tandem::nn::TensorFunction& next) {
          auto outs = next(inputs);
          auto x = inputs.at(0);
          if (p > 0 && module->is_training()) x = torch::dropout(x, p, true);
          auto delta = b->forward(a->forward(x.to(a->weight.scalar_type())));
          if (delta.size(-1) != outs.at(0).size(-1))
            throw Refused("LoRA: " + path + " gives " + std::to_string(outs[0].size(-1)) +
                          " outputs and its adapter " + std::to_string(delta.size(-1)) +
                          ": the layer was split by tensor parallel after its adapter was added; "
                          "apply_lora after acc.parallelize (Note [LoRA under tensor parallel])");
          outs[0] = outs[0] + (delta * scale).to(outs[0].scalar_type());
          return outs;
        });
  }
  for (const auto& t : options.target_modules())
    if (!matched.count(t))
      throw Refused("LoRA: target_modules names '" + t + "', which matches no module of the "
                    "model; modules are named as named_modules() names them "
                    "(model.layers.0.self_attn.q_proj matches q_proj)");
  return trainable;
}

void save_adapter(const std::vector<std::pair<std::string, at::Tensor>>& state,
                  const LoraOptions& options, const std::string& dir) {
  checkpoint::NamedTensors tensors;
  for (const auto& [name, t] : state)
    if (is_adapter_name(name)) tensors.emplace_back(kPrefix + name, t.detach().to(at::kCPU).contiguous());
  if (tensors.empty())
    throw Refused("save_adapter: the state has no adapter (no name with .lora_A. or .lora_B.); "
                  "call apply_lora before training and pass the model's whole state");
  fs::create_directories(dir);
  checkpoint::save_safetensors((fs::path(dir) / kAdapterFile).string(), tensors, {{"format", "pt"}});
  json c{{"peft_type", "LORA"},
         {"task_type", "CAUSAL_LM"},
         {"r", options.r()},
         {"lora_alpha", options.alpha()},
         {"lora_dropout", options.dropout()},
         {"target_modules", options.target_modules()},
         {"use_rslora", options.use_rslora()},
         {"bias", "none"},
         {"fan_in_fan_out", false},
         {"init_lora_weights", true},
         {"inference_mode", true},
         {"modules_to_save", nullptr},
         {"use_dora", false},
         {"base_model_name_or_path",
          options.base_model_name_or_path().empty() ? json() : json(options.base_model_name_or_path())}};
  std::ofstream f(fs::path(dir) / kAdapterConfig);
  f << c.dump(2) << "\n";
  if (!f) throw std::runtime_error("save_adapter: cannot write " + dir + "/" + kAdapterConfig);
}

LoraOptions read_adapter_config(const std::string& dir) {
  const auto path = fs::path(dir) / kAdapterConfig;
  const auto j = read_json(path);
  auto refuse = [&](const std::string& key, const std::string& why) {
    throw Refused(path.string() + ": " + key + " " + why +
                  "; tandem computes plain LoRA adapters on linear layers");
  };
  if (j.value("peft_type", std::string("LORA")) != "LORA")
    refuse("peft_type", "is '" + j.value("peft_type", std::string()) + "', not LORA");
  auto set = [&](const char* key) {
    return j.contains(key) && !j[key].is_null() && !(j[key].is_object() && j[key].empty()) &&
           !(j[key].is_array() && j[key].empty()) && !(j[key].is_boolean() && !j[key].get<bool>());
  };
  for (const char* key : {"use_dora", "modules_to_save", "fan_in_fan_out", "layers_to_transform",
                          "rank_pattern", "alpha_pattern", "layer_replication", "lora_bias",
                          "target_parameters", "trainable_token_indices", "use_qalora",
                          "exclude_modules", "alora_invocation_tokens", "use_bdlora"})
    if (set(key)) refuse(key, "is set (" + j[key].dump() + ")");
  if (j.value("bias", std::string("none")) != "none") refuse("bias", "is not \"none\"");
  LoraOptions o;
  if (!j.contains("r") || !j["r"].is_number_integer()) refuse("r", "is missing or not an integer");
  o.r(j["r"].get<int64_t>());
  o.alpha(j.value("lora_alpha", 8.0));
  o.dropout(j.value("lora_dropout", 0.0));
  o.use_rslora(j.value("use_rslora", false));
  if (!j.contains("target_modules") || !j["target_modules"].is_array())
    refuse("target_modules", "is not a list of module names (a regular expression is not "
                             "computed)");
  o.target_modules(j["target_modules"].get<std::vector<std::string>>());
  if (j.contains("base_model_name_or_path") && j["base_model_name_or_path"].is_string())
    o.base_model_name_or_path(j["base_model_name_or_path"].get<std::string>());
  return o;
}

void load_adapter(torch::nn::Module& model, const std::string& dir) {
  checkpoint::SafetensorsFile file((fs::path(dir) / kAdapterFile).string());
  std::map<std::string, at::Tensor> mine;
  for (const auto& p : model.named_parameters())
    if (is_adapter_name(p.key())) mine[p.key()] = p.value();
  const auto splits = parallel::tensor_parallel_splits(model);
  std::map<std::string, std::shared_ptr<torch::nn::Module>> modules;
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    modules[item.key()] = item.value();
  std::set<std::string> seen;
  for (const auto& stored : file.names()) {
    if (stored.rfind(kPrefix, 0) != 0)
      throw Refused(file.path() + ": " + stored + " is not under PEFT's " + kPrefix);
    auto name = stored.substr(kPrefix.size());
    // PEFT names an adapter "default" in memory and leaves the name out of its files.
    for (const char* part : {".lora_A.default.", ".lora_B.default."}) {
      auto at = name.find(part);
      if (at != std::string::npos) name.replace(at, std::strlen(part), std::string(part).substr(0, 8));
    }
    auto it = mine.find(name);
    if (it == mine.end())
      throw Refused(file.path() + ": " + stored + " is an adapter the model does not have; apply "
                    "the adapter's own settings (read_adapter_config) first");
    auto t = file.tensor(stored);
    // Note [LoRA under tensor parallel]: a split adapter takes its rank's shard of the file's.
    if (auto sp = splits.find(name); sp != splits.end() && t.sizes() != it->second.sizes()) {
      const auto owner = name.substr(0, name.rfind(".lora_"));
      auto* tp = dynamic_cast<parallel::TensorParallelModule*>(modules.at(owner).get());
      if (tp) t = parallel::cut_tensor_parallel_shard(t, sp->second, tp->group()->rank(), tp->group()->size());
    }
    if (t.sizes() != it->second.sizes())
      throw Refused(file.path() + ": " + stored + " has shape " + c10::str(t.sizes()) +
                    ", the model's adapter " + c10::str(it->second.sizes()));
    torch::NoGradGuard no_grad;
    it->second.copy_(t);
    seen.insert(name);
  }
  for (const auto& [name, t] : mine)
    if (!seen.count(name))
      throw Refused(file.path() + " has no " + kPrefix + name + "; the adapter was made for "
                    "other target_modules");
}

void merge_adapter_files(const std::string& base_dir, const std::string& adapter_dir,
                         const std::string& out_dir) {
  const auto options = read_adapter_config(adapter_dir);
  checkpoint::SafetensorsFile adapter((fs::path(adapter_dir) / kAdapterFile).string());
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> pairs;  // base weight name -> (A, B)
  for (const auto& stored : adapter.names()) {
    auto name = stored.rfind(kPrefix, 0) == 0 ? stored.substr(kPrefix.size()) : stored;
    for (const char* part : {".lora_A.", ".lora_B."}) {
      const auto at = name.find(part);
      if (at == std::string::npos) continue;
      const auto base = name.substr(0, at) + ".weight";
      (std::string(part) == ".lora_A." ? pairs[base].first : pairs[base].second) =
          adapter.tensor(stored).to(at::kFloat);
    }
  }
  if (pairs.empty()) throw Refused(adapter.path() + ": no lora_A/lora_B tensors");
  // The base: every tensor, the adapted ones merged.
  std::vector<std::string> files;
  if (fs::exists(fs::path(base_dir) / "model.safetensors")) {
    files.push_back((fs::path(base_dir) / "model.safetensors").string());
  } else {
    const auto index = read_json(fs::path(base_dir) / "model.safetensors.index.json");
    std::set<std::string> names;
    for (const auto& [k, v] : index.at("weight_map").items()) names.insert(v.get<std::string>());
    for (const auto& n : names) files.push_back((fs::path(base_dir) / n).string());
  }
  checkpoint::NamedTensors merged;
  std::set<std::string> done;
  for (const auto& f : files) {
    checkpoint::SafetensorsFile file(f);
    for (const auto& name : file.names()) {
      auto t = file.tensor(name);
      auto it = pairs.find(name);
      if (it != pairs.end()) {
        const auto& [a, b] = it->second;
        if (!a.defined() || !b.defined())
          throw Refused(adapter.path() + ": " + name + " has only one of lora_A and lora_B");
        if (b.size(0) != t.size(0) || a.size(1) != t.size(1) || a.size(0) != b.size(1))
          throw Refused(adapter.path() + ": the adapter of " + name + " (A " + c10::str(a.sizes()) +
                        ", B " + c10::str(b.sizes()) + ") does not fit its weight " +
                        c10::str(t.sizes()));
        t = (t.to(at::kFloat) + options.scale() * torch::matmul(b, a)).to(t.scalar_type());
        done.insert(name);
      }
      merged.emplace_back(name, t);
    }
  }
  for (const auto& [name, ab] : pairs)
    if (!done.count(name))
      throw Refused(adapter.path() + " adapts " + name + ", which " + base_dir + " does not hold");
  fs::create_directories(out_dir);
  checkpoint::save_model_tensors(merged, out_dir, "5GB");
  fs::copy_file(fs::path(base_dir) / "config.json", fs::path(out_dir) / "config.json",
                fs::copy_options::overwrite_existing);
}

}  // namespace tandem::peft
