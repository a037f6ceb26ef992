// Module hooks (see module.h, Note [Forward hooks]).
#include "tandem/nn/module.h"
#include "../detail/names.h"
#include "tandem/error.h"

#include <algorithm>
#include <stdexcept>

namespace tandem::nn {

void ForwardHooks::add(const std::string& name, int order, ForwardWrapper wrapper) {
  remove(name);
  Entry e{name, order, std::move(wrapper)};
  auto at = std::upper_bound(entries_.begin(), entries_.end(), order,
                             [](int o, const Entry& x) { return o < x.order; });
  entries_.insert(at, std::move(e));
}

bool ForwardHooks::remove(const std::string& name) {
  auto it = std::find_if(entries_.begin(), entries_.end(),
                         [&](const Entry& e) { return e.name == name; });
  if (it == entries_.end()) return false;
  entries_.erase(it);
  return true;
}

bool ForwardHooks::contains(const std::string& name) const {
  return std::any_of(entries_.begin(), entries_.end(),
                     [&](const Entry& e) { return e.name == name; });
}

void ForwardHooks::redirect(std::shared_ptr<torch::nn::Module> module, TensorFunction call,
                            const std::string& what) {
  redirect_ = std::move(module);
  redirect_call_ = std::move(call);
  redirect_what_ = what;
}

std::vector<std::string> ForwardHooks::names() const {
  std::vector<std::string> out;
  for (const auto& e : entries_) out.push_back(e.name);
  if (redirect_call_) out.push_back("redirect: " + redirect_what_);
  return out;
}

std::vector<at::Tensor> ForwardHooks::run(const std::vector<at::Tensor>& inputs,
                                          const TensorFunction& forward) const {
  // Each link owns its wrapper and the rest of the chain: a wrapper may keep `next` for later
  // (activation checkpointing runs it again in the backward).
  TensorFunction chain = redirect_call_ ? redirect_call_ : forward;
  for (size_t i = entries_.size(); i-- > 0;) {
    auto wrapper = entries_[i].wrapper;
    chain = [wrapper, inner = std::move(chain)](const std::vector<at::Tensor>& in) {
      return wrapper(in, inner);
    };
  }
  return chain(inputs);
}

namespace detail {

void refuse_released_parameters(const torch::nn::Module& m, const std::string& name,
                                const char* what) {
  std::vector<std::string> released;
  for (const auto& item : m.named_parameters(/*recurse=*/true)) {
    const auto& p = item.value();
    if (!p.defined() || p.numel() == 0 || !p.has_storage()) continue;
    int64_t extent = p.storage_offset() + 1;  // the last element's index in the storage, + 1
    for (int64_t d = 0; d < p.dim(); ++d) extent += (p.size(d) - 1) * p.stride(d);
    if (p.storage().nbytes() < static_cast<size_t>(extent) * p.element_size())
      released.push_back(item.key());
  }
  if (released.empty()) return;
  const std::string names = ::tandem::detail::first_names(released, 5);
  const bool save = std::string(what) == "torch::save";
  throw ::tandem::Refused(
      std::string(what) + " of " + name + ": its parameters " + names +
      " hold no values here; ZeRO-3 keeps each rank's shard of them and gathers them only for "
      "the forward and backward that use them, so " +
      (save ? "the file would hold none of the weights"
            : "the values read would leave the shards the optimizer steps") +
      ". " +
      (save ? "Save the whole model with acc.save_model(model, dir) (safetensors) or take it "
              "with acc.get_state_dict(model); every rank calls either. acc.save_state(dir) "
              "saves the training state to resume from"
            : "Load with acc.load_model(model, dir) or acc.load_state(dir) after "
              "acc.prepare, or torch::load before it") +
      " (or train with --zero_stage 2, which keeps whole parameters on every rank).");
}

}  // namespace detail

Hookable::Hookable() {
  if (auto* s = detail::BuildScope::current()) s->ended(this);
}

Hookable::~Hookable() {
  if (auto* s = detail::BuildScope::current()) s->forget(this);
}

namespace detail {
namespace {
thread_local BuildScope* open_scope = nullptr;
}

BuildScope::BuildScope(int unit_depth, OnBuilt on_built)
    : unit_depth_(unit_depth), on_built_(std::move(on_built)), outer_(open_scope) {
  open_scope = this;
}

BuildScope::~BuildScope() { open_scope = outer_; }

BuildScope* BuildScope::current() { return open_scope; }

void BuildScope::finish() { flush(); }

void BuildScope::started(const void* mark) {
  flush();
  marks_.push_back(mark);
}

void BuildScope::aborted(const void* mark) {
  if (!marks_.empty() && marks_.back() == mark) marks_.pop_back();
}

void BuildScope::ended(Hookable* module) {
  if (!marks_.empty()) marks_.pop_back();
  // What ended before this module's end (its members among them) is complete now; this module
  // is complete once its own constructor returns, so it waits for the next event.
  flush();
  if (unit_depth_ == kEveryModule || static_cast<int>(marks_.size()) == unit_depth_)
    pending_.push_back(module);
}

void BuildScope::forget(Hookable* module) {
  pending_.erase(std::remove(pending_.begin(), pending_.end(), module), pending_.end());
}

void BuildScope::report_unit(torch::nn::Module& module) {
  flush();
  on_built_(module, true);
}

void BuildScope::flush() {
  if (flushing_ || pending_.empty()) return;
  flushing_ = true;  // what on_built builds or destroys does not re-enter
  auto ready = std::move(pending_);
  pending_.clear();
  try {
    for (auto* h : ready)
      if (auto* m = dynamic_cast<torch::nn::Module*>(h)) on_built_(*m, false);
  } catch (...) {
    flushing_ = false;
    throw;
  }
  flushing_ = false;
}

}  // namespace detail

void Hookable::register_forward_pre_hook(const std::string& name,
                                         std::function<void(const std::vector<at::Tensor>&)> pre) {
  hooks().add(name, order::kUser,
              [pre = std::move(pre)](const std::vector<at::Tensor>& in, const TensorFunction& next) {
                pre(in);
                return next(in);
              });
}

void Hookable::register_forward_hook(
    const std::string& name,
    std::function<void(const std::vector<at::Tensor>&, std::vector<at::Tensor>&)> post) {
  hooks().add(name, order::kUser,
              [post = std::move(post)](const std::vector<at::Tensor>& in, const TensorFunction& next) {
                auto out = next(in);
                post(in, out);
                return out;
              });
}

namespace detail {

std::string trim_type_name(std::string n) {
  if (auto lt = n.find('<'); lt != std::string::npos) n = n.substr(0, lt);
  if (auto colon = n.rfind("::"); colon != std::string::npos) n = n.substr(colon + 2);
  if (n.size() > 4 && n.compare(n.size() - 4, 4, "Impl") == 0) n.resize(n.size() - 4);
  return n;
}

}  // namespace detail

std::string module_type_name(const torch::nn::Module& module) {
  if (auto* h = dynamic_cast<const Hookable*>(&module)) return h->type_name();
  return detail::trim_type_name(module.name());
}

std::vector<std::pair<std::string, std::vector<std::string>>> describe_hooks(
    torch::nn::Module& model) {
  std::vector<std::pair<std::string, std::vector<std::string>>> out;
  for (const auto& item : model.named_modules()) {
    auto* h = dynamic_cast<Hookable*>(item.value().get());
    if (h && h->has_hooks()) out.emplace_back(item.key(), h->hooks_if_any()->names());
  }
  return out;
}

namespace detail {
void refuse_hooked_call(const std::string& type, const char* why) {
  throw ::tandem::Refused("tandem::nn hooks on " + type + ": " + why);
}
}  // namespace detail

}  // namespace tandem::nn
