// Optimizer state to and from tensors + JSON (see optimizer_state.h).
#include "tandem/checkpoint/optimizer_state.h"
#include "tandem/error.h"

#include <torch/optim.h>

#include <nlohmann/json.hpp>

#include <map>
#include <stdexcept>

#include "../compat/optimizer.h"
#include "detail/json_depth.h"

namespace tandem::checkpoint {
namespace {

using json = nlohmann::json;
namespace optim = torch::optim;

auto key_of(const at::Tensor& p) { return compat::optimizer_state_key(p); }

json betas(const std::tuple<double, double>& b) { return {std::get<0>(b), std::get<1>(b)}; }
std::tuple<double, double> betas(const json& j) { return {j.at(0).get<double>(), j.at(1).get<double>()}; }

// Generic save/load over one optimizer type.
template <class Options, class State>
struct Codec {
  using StateType = State;
  std::string name;
  std::function<json(const Options&)> to_json;
  std::function<void(Options&, const json&)> from_json;
  std::vector<std::string> fields;
  std::function<at::Tensor*(State&, const std::string&)> field;
  std::function<int64_t*(State&)> step;

  void save(const optim::Optimizer& opt, OptimizerState& out) const {
    json doc;
    doc["type"] = name;
    doc["param_groups"] = json::array();
    doc["state"] = json::object();
    const auto& groups = opt.param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      const auto& o = static_cast<const Options&>(groups[g].options());
      json group;
      group["options"] = to_json(o);
      group["num_params"] = groups[g].params().size();
      json shapes = json::array();
      for (const auto& p : groups[g].params()) shapes.push_back(p.sizes().vec());
      group["shapes"] = shapes;
      doc["param_groups"].push_back(group);
      for (size_t i = 0; i < groups[g].params().size(); ++i) {
        auto it = opt.state().find(key_of(groups[g].params()[i]));
        if (it == opt.state().end()) continue;  // no step taken for this parameter yet
        auto& st = static_cast<State&>(*it->second);
        const std::string prefix = optimizer_param_key(g, i);
        json entry = json::object();
        if (step) entry["step"] = *step(st);
        json present = json::array();
        for (const auto& f : fields) {
          at::Tensor* t = field(st, f);
          if (t && t->defined()) {
            out.tensors.emplace_back(prefix + "." + f, t->detach().cpu().contiguous());
            present.push_back(f);
          }
        }
        entry["tensors"] = present;
        doc["state"][prefix] = entry;
      }
    }
    out.json = doc.dump(2);
  }

  void load(optim::Optimizer& opt, const json& doc,
            const std::map<std::string, at::Tensor>& tensors) const {
    auto& groups = opt.param_groups();
    const auto& saved = doc.at("param_groups");
    if (saved.size() != groups.size())
      throw std::runtime_error("optimizer state has " + std::to_string(saved.size()) +
                               " parameter groups, the optimizer " + std::to_string(groups.size()));
    for (size_t g = 0; g < groups.size(); ++g) {
      const auto& sg = saved.at(g);
      if (sg.at("num_params").get<size_t>() != groups[g].params().size())
        throw std::runtime_error("optimizer group " + std::to_string(g) + " has " +
                                 std::to_string(groups[g].params().size()) +
                                 " parameters, the checkpoint " + sg.at("num_params").dump());
      for (size_t i = 0; i < groups[g].params().size(); ++i) {
        auto shape = sg.at("shapes").at(i).get<std::vector<int64_t>>();
        if (groups[g].params()[i].sizes().vec() != shape)
          throw std::runtime_error("optimizer group " + std::to_string(g) + " parameter " +
                                   std::to_string(i) + " has shape " +
                                   c10::str(groups[g].params()[i].sizes()) + ", the checkpoint " +
                                   sg.at("shapes").at(i).dump());
      }
      from_json(static_cast<Options&>(groups[g].options()), sg.at("options"));
    }
    opt.state().clear();
    for (const auto& [prefix, entry] : doc.at("state").items()) {
      auto dot = prefix.find(".p");
      size_t g = std::stoul(prefix.substr(1, dot - 1)), i = std::stoul(prefix.substr(dot + 2));
      const auto& p = groups.at(g).params().at(i);
      auto st = std::make_unique<State>();
      if (step) *step(*st) = entry.at("step").template get<int64_t>();
      for (const auto& f : entry.at("tensors")) {
        const std::string field_name = f.template get<std::string>();
        auto name = prefix + "." + field_name;
        auto it = tensors.find(name);
        if (it == tensors.end())
          throw std::runtime_error("optimizer state tensor " + name + " is missing");
        // As PyTorch's Optimizer.load_state_dict: floating state follows the parameter's dtype
        // (a bf16 run's moments stepping fp32 masters after a resume with master weights).
        const auto& saved_t = it->second;
        *field(*st, field_name) =
            saved_t.is_floating_point()
                ? saved_t.to(p.device(), p.scalar_type(), /*non_blocking=*/false, /*copy=*/true)
                : saved_t.to(p.device(), /*non_blocking=*/false, /*copy=*/true);
      }
      opt.state()[key_of(p)] = std::move(st);
    }
  }
};

template <class Options, class State>
Codec<Options, State> adam_like(const std::string& name) {
  Codec<Options, State> c;
  c.name = name;
  c.to_json = [](const Options& o) {
    return json{{"lr", o.lr()}, {"betas", betas(o.betas())}, {"eps", o.eps()},
                {"weight_decay", o.weight_decay()}, {"amsgrad", o.amsgrad()}};
  };
  c.from_json = [](Options& o, const json& j) {
    o.lr(j.at("lr")).betas(betas(j.at("betas"))).eps(j.at("eps")).weight_decay(j.at("weight_decay"))
        .amsgrad(j.at("amsgrad"));
  };
  c.fields = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  c.field = [](State& s, const std::string& f) -> at::Tensor* {
    if (f == "exp_avg") return &s.exp_avg();
    if (f == "exp_avg_sq") return &s.exp_avg_sq();
    if (f == "max_exp_avg_sq") return &s.max_exp_avg_sq();
    return nullptr;
  };
  c.step = [](State& s) { return &s.step(); };
  return c;
}

Codec<optim::SGDOptions, optim::SGDParamState> sgd_codec() {
  Codec<optim::SGDOptions, optim::SGDParamState> c;
  c.name = "SGD";
  c.to_json = [](const optim::SGDOptions& o) {
    return json{{"lr", o.lr()}, {"momentum", o.momentum()}, {"dampening", o.dampening()},
                {"weight_decay", o.weight_decay()}, {"nesterov", o.nesterov()}};
  };
  c.from_json = [](optim::SGDOptions& o, const json& j) {
    o.lr(j.at("lr")).momentum(j.at("momentum")).dampening(j.at("dampening"))
        .weight_decay(j.at("weight_decay")).nesterov(j.at("nesterov"));
  };
  c.fields = {"momentum_buffer"};
  c.field = [](optim::SGDParamState& s, const std::string&) { return &s.momentum_buffer(); };
  return c;
}

Codec<optim::AdagradOptions, optim::AdagradParamState> adagrad_codec() {
  Codec<optim::AdagradOptions, optim::AdagradParamState> c;
  c.name = "Adagrad";
  c.to_json = [](const optim::AdagradOptions& o) {
    return json{{"lr", o.lr()}, {"lr_decay", o.lr_decay()}, {"weight_decay", o.weight_decay()},
                {"initial_accumulator_value", o.initial_accumulator_value()}, {"eps", o.eps()}};
  };
  c.from_json = [](optim::AdagradOptions& o, const json& j) {
    o.lr(j.at("lr")).lr_decay(j.at("lr_decay")).weight_decay(j.at("weight_decay"))
        .initial_accumulator_value(j.at("initial_accumulator_value")).eps(j.at("eps"));
  };
  c.fields = {"sum"};
  c.field = [](optim::AdagradParamState& s, const std::string&) { return &s.sum(); };
  c.step = [](optim::AdagradParamState& s) { return &s.step(); };
  return c;
}

Codec<optim::RMSpropOptions, optim::RMSpropParamState> rmsprop_codec() {
  Codec<optim::RMSpropOptions, optim::RMSpropParamState> c;
  c.name = "RMSprop";
  c.to_json = [](const optim::RMSpropOptions& o) {
    return json{{"lr", o.lr()}, {"alpha", o.alpha()}, {"eps", o.eps()},
                {"weight_decay", o.weight_decay()}, {"momentum", o.momentum()},
                {"centered", o.centered()}};
  };
  c.from_json = [](optim::RMSpropOptions& o, const json& j) {
    o.lr(j.at("lr")).alpha(j.at("alpha")).eps(j.at("eps")).weight_decay(j.at("weight_decay"))
        .momentum(j.at("momentum")).centered(j.at("centered"));
  };
  c.fields = {"square_avg", "momentum_buffer", "grad_avg"};
  c.field = [](optim::RMSpropParamState& s, const std::string& f) -> at::Tensor* {
    if (f == "square_avg") return &s.square_avg();
    if (f == "momentum_buffer") return &s.momentum_buffer();
    return &s.grad_avg();
  };
  c.step = [](optim::RMSpropParamState& s) { return &s.step(); };
  return c;
}

[[noreturn]] void unsupported() {
  throw ::tandem::Refused(
      "save_state/load_state support LibTorch's SGD, Adam, AdamW, Adagrad and RMSprop; for another "
      "optimizer, save its state yourself through accelerator.register_for_checkpointing");
}

// Calls fn with the codec for this optimizer's dynamic type.
template <class Fn>
void with_codec(const optim::Optimizer& opt, Fn&& fn) {
  if (dynamic_cast<const optim::AdamW*>(&opt)) return fn(adam_like<optim::AdamWOptions, optim::AdamWParamState>("AdamW"));
  if (dynamic_cast<const optim::Adam*>(&opt)) return fn(adam_like<optim::AdamOptions, optim::AdamParamState>("Adam"));
  if (dynamic_cast<const optim::SGD*>(&opt)) return fn(sgd_codec());
  if (dynamic_cast<const optim::Adagrad*>(&opt)) return fn(adagrad_codec());
  if (dynamic_cast<const optim::RMSprop*>(&opt)) return fn(rmsprop_codec());
  unsupported();
}

// Reaches LRScheduler's protected step counter (a member pointer formed in a derived class).
struct SchedulerAccess : optim::LRScheduler {
  static unsigned optim::LRScheduler::*counter() { return &SchedulerAccess::step_count_; }
};

}  // namespace

OptimizerState optimizer_state(const optim::Optimizer& optimizer) {
  OptimizerState out;
  with_codec(optimizer, [&](const auto& codec) { codec.save(optimizer, out); });
  return out;
}

void load_optimizer_state(optim::Optimizer& optimizer, const OptimizerState& state) {
  // Note [JSON depth limit]: the text comes from a checkpoint file.
  if (auto deep = detail::json_depth_problem(state.json); !deep.empty())
    throw std::runtime_error("load_state: the optimizer state's JSON " + deep +
                             ": the checkpoint is damaged; use another checkpoint");
  json doc;
  try {
    doc = json::parse(state.json);
  } catch (const json::exception& e) {
    throw std::runtime_error(
        std::string("load_state: the optimizer state's JSON does not parse (") + e.what() +
        "): the checkpoint is damaged; use another checkpoint");
  }
  if (!doc.is_object() || !doc.contains("type") || !doc["type"].is_string())
    throw std::runtime_error(
        "load_state: the optimizer state's JSON has no \"type\" string "
        "(expected {\"type\": \"AdamW\", \"param_groups\": [...], ...}): "
        "the checkpoint is damaged; use another checkpoint");
  std::map<std::string, at::Tensor> tensors(state.tensors.begin(), state.tensors.end());
  with_codec(optimizer, [&](const auto& codec) {
    if (doc.at("type").get<std::string>() != codec.name)
      throw std::runtime_error("the checkpoint holds the state of a " +
                               doc.at("type").get<std::string>() + " optimizer, not of a " +
                               codec.name + ": build the same optimizer before load_state");
    codec.load(optimizer, doc, tensors);
  });
}

std::vector<std::pair<std::string, at::Tensor*>> optimizer_state_tensors(
    optim::Optimizer& optimizer, const at::Tensor& param) {
  std::vector<std::pair<std::string, at::Tensor*>> out;
  with_codec(optimizer, [&](const auto& codec) {
    auto it = optimizer.state().find(key_of(param));
    if (it == optimizer.state().end()) return;
    using State = typename std::decay_t<decltype(codec)>::StateType;
    auto& st = static_cast<State&>(*it->second);
    for (const auto& f : codec.fields)
      if (at::Tensor* t = codec.field(st, f)) out.emplace_back(f, t);
  });
  return out;
}

std::string optimizer_param_key(size_t group, size_t index) {
  return "g" + std::to_string(group) + ".p" + std::to_string(index);
}

unsigned scheduler_step_count(const optim::LRScheduler& scheduler) {
  return scheduler.*SchedulerAccess::counter();
}

void set_scheduler_step_count(optim::LRScheduler& scheduler, unsigned count) {
  scheduler.*SchedulerAccess::counter() = count;
}

}  // namespace tandem::checkpoint
