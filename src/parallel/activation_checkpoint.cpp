// Activation checkpointing: the checkpoint autograd function, the Checkpointed module holder and
// the in-place wrapping of Sequential entries (see activation_checkpoint.h).
#include "tandem/parallel/activation_checkpoint.h"
#include "../detail/names.h"
#include "tandem/error.h"

#include "tandem/nn/module.h"

#include <torch/torch.h>
#include <torch/csrc/autograd/engine.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>

#include "../compat/autocast.h"
#include "detail/adopt.h"
#include "tandem/precision/autocast.h"

namespace tandem::parallel {
namespace {

// Note [Callbacks in a recompute] (activation_checkpoint.h): recomputes running on this thread,
// and the final callbacks queued inside them, to be queued on the outer graph task.
thread_local int t_recompute_depth = 0;
thread_local int t_recompute_forwards = 0;  // recomputed forwards running (in_checkpoint_recompute)
thread_local std::vector<std::function<void()>> t_deferred_callbacks;

// Note [Unused parameters in a recompute]: one per process (a recompute may run on an autograd
// device thread), set around a backward by Accelerator::backward.
std::mutex g_observer_mutex;
RecomputeObserver g_recompute_observer;

// The random streams registered besides the default generators (register_random_stream).
std::mutex g_streams_mutex;
std::set<RandomStream*>& registered_streams() {
  static std::set<RandomStream*> streams;
  return streams;
}

// The random number generators a region may draw from: the CPU one, every CUDA device's, and the
// registered streams.
struct RngState {
  at::Tensor cpu;
  std::vector<at::Tensor> cuda;
  std::map<RandomStream*, std::vector<at::Tensor>> streams;
};

std::vector<at::Generator> generators() {
  std::vector<at::Generator> g{at::detail::getDefaultCPUGenerator()};
  if (at::hasCUDA()) {
    const int n = at::detail::getCUDAHooks().getNumGPUs();
    for (int i = 0; i < n; ++i)
      g.push_back(at::globalContext().defaultGenerator(
          c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i))));
  }
  return g;
}

RngState capture_rng() {
  RngState s;
  auto gens = generators();
  for (size_t i = 0; i < gens.size(); ++i) {
    std::lock_guard<std::mutex> lock(gens[i].mutex());
    (i == 0 ? s.cpu : s.cuda.emplace_back()) = gens[i].get_state();
  }
  std::lock_guard<std::mutex> lock(g_streams_mutex);
  for (auto* stream : registered_streams()) s.streams[stream] = stream->stream_state();
  return s;
}

void restore_rng(const RngState& s) {
  auto gens = generators();
  for (size_t i = 0; i < gens.size(); ++i) {
    const at::Tensor& state = i == 0 ? s.cpu : (i - 1 < s.cuda.size() ? s.cuda[i - 1] : at::Tensor());
    if (!state.defined()) continue;
    std::lock_guard<std::mutex> lock(gens[i].mutex());
    gens[i].set_state(state);
  }
  std::lock_guard<std::mutex> lock(g_streams_mutex);
  for (const auto& [stream, state] : s.streams)  // a stream destroyed since is skipped
    if (registered_streams().count(stream)) stream->set_stream_state(state);
}

// Sets the generators to `s` for a scope, then puts back what they were.
class RngFork {
 public:
  explicit RngFork(const RngState* s) : active_(s != nullptr) {
    if (!active_) return;
    saved_ = capture_rng();
    restore_rng(*s);
  }
  ~RngFork() {
    if (active_) restore_rng(saved_);
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  bool active_;
  RngState saved_;
};

struct AutocastState {
  bool cpu_enabled = false;
  c10::ScalarType cpu_dtype = c10::kBFloat16;
  bool cuda_enabled = false;
  c10::ScalarType cuda_dtype = c10::kHalf;
};

AutocastState capture_autocast() {
  AutocastState a;
  a.cpu_enabled = compat::autocast_enabled(c10::kCPU);
  a.cpu_dtype = compat::autocast_dtype(c10::kCPU);
  a.cuda_enabled = compat::autocast_enabled(c10::kCUDA);
  a.cuda_dtype = compat::autocast_dtype(c10::kCUDA);
  return a;
}

// Note [No cast cache in a checkpointed region]: autocast caches the low-precision copies of
// fp32 leaf weights for the rest of the region. A copy cast during the run without gradients
// carries no backward, and a later use of the same weight in the region would take it from the
// cache and lose its gradient; the regions run with the cache off. A weight used once in a region
// gives bitwise the gradient of the run without checkpointing; one used twice (or inside and
// outside the region) gets its contributions summed after the cast instead of before, so its
// gradient can differ in the last bits of the low-precision type (as in PyTorch's checkpoint).
class NoCastCache {
 public:
  NoCastCache() : previous_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~NoCastCache() { at::autocast::set_autocast_cache_enabled(previous_); }
  NoCastCache(const NoCastCache&) = delete;
  NoCastCache& operator=(const NoCastCache&) = delete;

 private:
  bool previous_;
};

// The nested backward of a recompute: callbacks queued inside it wait for the outer graph task.
class RecomputeScope {
 public:
  RecomputeScope() { ++t_recompute_depth; }
  ~RecomputeScope() {
    --t_recompute_depth;
    auto pending = std::move(t_deferred_callbacks);
    t_deferred_callbacks.clear();
    for (auto& cb : pending) {
      try {
        queue_backward_callback(std::move(cb));
      } catch (...) {
        // No graph task to queue on (cannot happen inside a node's backward); nothing to run.
      }
    }
  }
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;
};

// What the backward needs of the forward: the function, the random number and autocast state
// before the first run, and which inputs required gradients.
struct CheckpointState : torch::CustomClassHolder {
  CheckpointFunction fn;
  bool preserve_rng = true;
  RngState rng;
  AutocastState autocast;
  std::vector<char> requires_grad;  // per real input (not the extra one, see checkpoint())
  // The checkpointed module's parameters (Note [Unused parameters in a recompute]); empty for
  // a function of the program's own. A state with parameters is pending (g_pending_regions)
  // from its forward until its recompute or its graph's end.
  std::vector<at::Tensor> parameters;
  ~CheckpointState() override;
};

// Note [Unused parameters in a recompute]: the regions with parameters whose recompute has not
// run yet. A parameter another pending region holds (a block applied twice, a tied weight) may
// still get its gradient there, so a recompute does not call it unused.
std::mutex g_regions_mutex;
std::set<const CheckpointState*> g_pending_regions;

CheckpointState::~CheckpointState() {
  if (parameters.empty()) return;
  std::lock_guard<std::mutex> lock(g_regions_mutex);
  g_pending_regions.erase(this);
}

// This region's parameters that no other pending region holds; it stops being pending.
std::vector<at::Tensor> parameters_of_recompute(const CheckpointState& state) {
  std::lock_guard<std::mutex> lock(g_regions_mutex);
  g_pending_regions.erase(&state);
  std::set<const void*> elsewhere;
  for (const auto* other : g_pending_regions)
    for (const auto& t : other->parameters) elsewhere.insert(t.unsafeGetTensorImpl());
  std::vector<at::Tensor> out;
  for (const auto& t : state.parameters)
    if (!elsewhere.count(t.unsafeGetTensorImpl())) out.push_back(t);
  return out;
}

struct CheckpointNode : public torch::autograd::Function<CheckpointNode> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<CheckpointState> state,
                                                at::TensorList inputs) {
    // Outputs without a gradient stay without one (no zeros made for them).
    ctx->set_materialize_grads(false);
    const size_t n = state->requires_grad.size();
    std::vector<at::Tensor> real(inputs.begin(), inputs.begin() + static_cast<std::ptrdiff_t>(n));
    ctx->save_for_backward(real);
    ctx->saved_data["state"] = at::IValue::make_capsule(state);
    ctx->saved_data["num_inputs"] = static_cast<int64_t>(inputs.size());
    NoCastCache no_cache;
    return state->fn(real);  // autograd's apply runs this with gradients disabled
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TANDEM_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
                "a checkpointed region met torch::autograd::grad (or backward with inputs=): "
                "its recompute accumulates gradients into .grad, so call "
                "torch::autograd::backward / tensor.backward() instead");
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(
        ctx->saved_data["state"].toCapsule());
    auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> detached(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      if (!saved[i].defined()) continue;
      detached[i] = saved[i].detach();
      if (state->requires_grad[i]) detached[i].requires_grad_(true);
    }
    std::vector<at::Tensor> outputs;
    {
      RngFork rng(state->preserve_rng ? &state->rng : nullptr);
      const auto& a = state->autocast;
      precision::AutocastGuard cpu(c10::kCPU, a.cpu_dtype, a.cpu_enabled);
      precision::AutocastGuard cuda(c10::kCUDA, a.cuda_dtype, a.cuda_enabled);
      NoCastCache no_cache;
      torch::AutoGradMode grad_mode(true);
      ++t_recompute_forwards;
      try {
        outputs = state->fn(detached);
      } catch (...) {
        --t_recompute_forwards;
        throw;
      }
      --t_recompute_forwards;
    }
    std::vector<at::Tensor> roots, root_grads;
    for (size_t i = 0; i < outputs.size() && i < grads.size(); ++i) {
      if (!outputs[i].defined() || !outputs[i].requires_grad() || !grads[i].defined()) continue;
      roots.push_back(outputs[i]);
      root_grads.push_back(grads[i]);
    }
    if (!roots.empty()) {
      if (!state->parameters.empty()) {
        const auto mine = parameters_of_recompute(*state);
        RecomputeObserver observer;
        {
          std::lock_guard<std::mutex> lock(g_observer_mutex);
          observer = g_recompute_observer;
        }
        if (observer && !mine.empty()) observer(roots, mine);
      }
      RecomputeScope scope;
      torch::autograd::backward(roots, root_grads);
    }
    // One gradient per forward argument: none for the state, one per input (none for the extra
    // input that only makes the outputs differentiable).
    torch::autograd::variable_list result{at::Tensor()};
    for (size_t i = 0; i < detached.size(); ++i)
      result.push_back(state->requires_grad[i] && detached[i].defined() ? detached[i].grad()
                                                                        : at::Tensor());
    const size_t total = ctx->saved_data["num_inputs"].toInt();
    while (result.size() < total + 1) result.emplace_back();
    return result;
  }
};


}  // namespace

void queue_backward_callback(std::function<void()> callback) {
  if (t_recompute_depth > 0) {
    t_deferred_callbacks.push_back(std::move(callback));
    return;
  }
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

int checkpoint_recompute_depth() { return t_recompute_depth; }
bool in_checkpoint_recompute() { return t_recompute_depth > 0 || t_recompute_forwards > 0; }

namespace {
std::vector<at::Tensor> checkpoint_region(CheckpointFunction fn, std::vector<at::Tensor> inputs,
                                          CheckpointOptions options,
                                          std::vector<at::Tensor> parameters) {
  TANDEM_CHECK(fn, "checkpoint: the function is empty");
  if (!at::GradMode::is_enabled()) return fn(inputs);
  auto state = c10::make_intrusive<CheckpointState>();
  state->parameters = std::move(parameters);
  if (!state->parameters.empty()) {
    std::lock_guard<std::mutex> lock(g_regions_mutex);
    g_pending_regions.insert(state.get());
  }
  state->fn = std::move(fn);
  state->preserve_rng = options.preserve_rng_state();
  bool any = false;
  for (const auto& t : inputs) {
    const bool rg = t.defined() && t.requires_grad();
    state->requires_grad.push_back(rg ? 1 : 0);
    any = any || rg;
  }
  if (state->preserve_rng) state->rng = capture_rng();
  state->autocast = capture_autocast();
  // No input needs a gradient (the first block of a model): an extra input that does makes the
  // outputs differentiable, so that the backward reaches the region and the parameters inside
  // it get their gradients.
  if (!any) inputs.push_back(at::empty({0}).requires_grad_(true));
  return CheckpointNode::apply(state, at::TensorList(inputs));
}
}  // namespace

std::vector<at::Tensor> checkpoint(CheckpointFunction fn, std::vector<at::Tensor> inputs,
                                   CheckpointOptions options) {
  return checkpoint_region(std::move(fn), std::move(inputs), options, {});
}

RecomputeObserver set_recompute_observer(RecomputeObserver observer) {
  std::lock_guard<std::mutex> lock(g_observer_mutex);
  std::swap(observer, g_recompute_observer);
  return observer;
}

at::Tensor checkpoint(std::function<at::Tensor(const at::Tensor&)> fn, at::Tensor input,
                      CheckpointOptions options) {
  TANDEM_CHECK(fn, "checkpoint: the function is empty");
  auto outs = checkpoint(
      [fn = std::move(fn)](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{fn(in[0])};
      },
      {std::move(input)}, options);
  return outs[0];
}

// ---- Checkpointed ----

void CheckpointedImpl::adopt() { detail::adopt_members(*this, *inner_.ptr()); }

torch::Tensor CheckpointedImpl::forward(torch::Tensor input) {
  auto inner = std::make_shared<torch::nn::AnyModule>(inner_);
  return checkpoint_region(
      [inner](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{inner->forward<torch::Tensor>(torch::Tensor(in[0]))};
      },
      {std::move(input)}, options_, inner_.ptr()->parameters())[0];
}

// ---- wrapping in place ----

namespace {

std::shared_ptr<CheckpointedImpl> wrap_entry(torch::nn::SequentialImpl& seq, size_t index,
                                             const std::string& name, CheckpointOptions options) {
  auto& any = *(seq.begin() + static_cast<std::ptrdiff_t>(index));
  Checkpointed wrapper(any, options);
  any = torch::nn::AnyModule(wrapper);
  seq.replace_module(name, wrapper.ptr());
  return wrapper.ptr();
}

std::vector<std::string> entry_names(torch::nn::SequentialImpl& seq) {
  std::vector<std::string> names;
  for (const auto& kv : seq.named_children()) names.push_back(kv.key());
  TANDEM_CHECK(names.size() == seq.size(), "activation checkpointing: a Sequential has ",
              seq.size(), " entries but ", names.size(),
              " registered children; register nothing on a Sequential besides its entries");
  return names;
}

void hook_checkpoint(torch::nn::Module& m, const std::string& path, CheckpointOptions options);
bool is_checkpointed(torch::nn::Module& m);

// One walk over a model, for apply_activation_checkpointing and checkpoint_model_blocks: a
// module `wanted` names is checkpointed where a wrapper reaches it (a Sequential entry by a
// Checkpointed wrapper, a hookable module by a hook); one it names but no wrapper reaches is
// recorded, and the others are walked into. A checkpointed module is never walked into.
struct Walk {
  std::function<bool(const std::string& path, torch::nn::Module&, bool entry)> wanted;
  CheckpointOptions options;
  std::vector<std::shared_ptr<CheckpointedImpl>> made;  // the Sequential entries' wrappers
  int hooked = 0;                                       // hookable modules checkpointed
  std::set<std::string> found;                          // the classes checkpointed
  std::vector<std::pair<std::string, std::string>> unreachable;  // {path, Type} it could not
};

void walk(torch::nn::Module& m, const std::string& prefix, Walk& w) {
  if (is_checkpointed(m)) return;
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&m)) {
    const auto names = entry_names(*seq);
    for (size_t i = 0; i < names.size(); ++i) {
      auto ptr = (seq->begin() + static_cast<std::ptrdiff_t>(i))->ptr();
      if (is_checkpointed(*ptr)) continue;
      const std::string name = prefix + names[i];
      if (w.wanted(name, *ptr, true)) {
        w.found.insert(tandem::nn::module_type_name(*ptr));
        w.made.push_back(wrap_entry(*seq, i, names[i], w.options));
      } else {
        walk(*ptr, name + ".", w);
      }
    }
    return;
  }
  for (const auto& kv : m.named_children()) {
    const std::string name = prefix + kv.key();
    auto& child = *kv.value();
    if (is_checkpointed(child)) continue;
    if (!w.wanted(name, child, false)) {
      walk(child, name + ".", w);
      continue;
    }
    w.found.insert(tandem::nn::module_type_name(child));
    if (tandem::nn::hookable(child)) {
      hook_checkpoint(child, name, w.options);
      ++w.hooked;
    } else {
      w.unreachable.emplace_back(name, tandem::nn::module_type_name(child));
    }
  }
}

// Note [Checkpointing on hooks]: a hookable module (a TANDEM_MODULE type) is checkpointed by a
// forward hook at order::kCheckpoint, outside a ZeRO-3 unit's hook, so that the recompute
// gathers the unit again; the wrapper keeps the rest of the chain and checkpoint() runs it again
// in the backward with the same arguments (the tensor ones detached, the others as held).
void hook_checkpoint(torch::nn::Module& m, const std::string& path, CheckpointOptions options) {
  auto* h = tandem::nn::hookable(m);
  if (!h->tensor_forward())
    throw ::tandem::Refused(
        "activation checkpointing: " + path + " (" + h->type_name() +
        ") returns something other than tensors, which a recompute cannot hand to the "
        "backward; return a Tensor, a std::tuple of Tensors or a std::vector<Tensor>");
  h->hooks().add("activation checkpoint", tandem::nn::order::kCheckpoint,
                 [options, &m](const std::vector<at::Tensor>& in,
                               const tandem::nn::TensorFunction& next) {
                   return checkpoint_region(next, in, options, m.parameters());
                 });
}

bool is_checkpointed(torch::nn::Module& m) {
  if (dynamic_cast<CheckpointedImpl*>(&m)) return true;
  auto* h = tandem::nn::hookable(m);
  return h && h->hooks_if_any() && h->hooks_if_any()->contains("activation checkpoint");
}

}  // namespace

void register_random_stream(RandomStream* stream) {
  TANDEM_CHECK(stream, "register_random_stream: the stream is null");
  std::lock_guard<std::mutex> lock(g_streams_mutex);
  registered_streams().insert(stream);
}

void unregister_random_stream(RandomStream* stream) {
  std::lock_guard<std::mutex> lock(g_streams_mutex);
  registered_streams().erase(stream);
}

std::vector<std::shared_ptr<CheckpointedImpl>> checkpoint_sequential_entries(
    torch::nn::SequentialImpl& sequential, CheckpointOptions options) {
  std::vector<std::shared_ptr<CheckpointedImpl>> made;
  const auto names = entry_names(sequential);
  for (size_t i = 0; i < names.size(); ++i) {
    auto ptr = (sequential.begin() + static_cast<std::ptrdiff_t>(i))->ptr();
    if (dynamic_cast<CheckpointedImpl*>(ptr.get())) continue;
    made.push_back(wrap_entry(sequential, i, names[i], options));
  }
  return made;
}

std::vector<std::shared_ptr<CheckpointedImpl>> checkpoint_sequential_entries(
    torch::nn::Sequential& sequential, CheckpointOptions options) {
  return checkpoint_sequential_entries(*sequential, options);
}

std::vector<std::shared_ptr<CheckpointedImpl>> apply_activation_checkpointing(
    torch::nn::Module& model, const CheckpointPredicate& predicate, CheckpointOptions options) {
  TANDEM_CHECK(predicate, "apply_activation_checkpointing: the predicate is empty");
  Walk w;
  w.wanted = [&](const std::string& path, torch::nn::Module& m, bool) { return predicate(path, m); };
  w.options = options;
  walk(model, "", w);
  const auto& unreachable = w.unreachable;
  if (!unreachable.empty()) {
    std::vector<std::string> paths;
    for (const auto& u : unreachable) paths.push_back(u.first);
    const std::string names = ::tandem::detail::first_names(paths, 8);
    throw ::tandem::Refused(
        "apply_activation_checkpointing: the predicate matches " + names +
        ", which " + (unreachable.size() == 1 ? "is" : "are") +
        " neither an entry of a Sequential nor hookable, so " +
        (unreachable.size() == 1 ? "it" : "they") +
        " cannot be checkpointed from outside (a parent calls it through its own member). "
        "Declare its type with "
        "TANDEM_MODULE(Name) instead of TORCH_MODULE(Name) (tandem/nn/module.h), wrap it where "
        "it is built (register_module(\"h0\", tandem::parallel::Checkpointed(Block(...)))), or "
        "hold it in a torch::nn::Sequential");
  }
  return w.made;
}

int checkpoint_model_blocks(torch::nn::Module& model, const std::vector<std::string>& classes,
                            CheckpointOptions options) {
  if (classes.empty())
    if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&model))
      return static_cast<int>(checkpoint_sequential_entries(*seq, options).size());
  // Note [Tied weights are not blocks]: a module whose parameter is also used outside it (the
  // GPT head tied to the token embedding) gets that gradient in two backward passes when it is
  // checkpointed (its own recomputation, then the rest): data parallel would see the
  // parameter ready twice in one step. The default rule leaves such modules to the plain
  // backward and walks into them; it checkpoints the blocks that own what they use.
  std::map<const void*, int> uses;
  for (const auto& sub : model.modules(/*include_self=*/true))
    for (const auto& p : sub->named_parameters(/*recurse=*/false)) ++uses[p.value().unsafeGetTensorImpl()];
  auto shares_outside = [&](torch::nn::Module& m) {
    std::map<const void*, int> inside;
    for (const auto& sub : m.modules(/*include_self=*/true))
      for (const auto& p : sub->named_parameters(/*recurse=*/false)) ++inside[p.value().unsafeGetTensorImpl()];
    for (const auto& [impl, n] : inside)
      if (uses[impl] > n) return true;
    return false;
  };
  Walk w;
  w.options = options;
  w.wanted = [&](const std::string&, torch::nn::Module& m, bool entry) {
    if (!classes.empty())
      return std::find(classes.begin(), classes.end(), tandem::nn::module_type_name(m)) !=
             classes.end();
    if (shares_outside(m)) return false;
    if (entry) return true;
    auto* h = tandem::nn::hookable(m);
    return h != nullptr && !h->standard_layer();
  };
  walk(model, "", w);
  const auto& unreachable = w.unreachable;
  const auto& found = w.found;
  const int count = static_cast<int>(w.made.size()) + w.hooked;
  if (!unreachable.empty())
    throw ::tandem::Refused(
        "activation checkpointing: " + unreachable.front().first + " (" +
        unreachable.front().second + ")" +
        " is of a class fsdp_transformer_layer_cls_to_wrap names, but its parent calls it "
        "directly, where no wrapper reaches it; declare its type with TANDEM_MODULE(Name) instead "
        "of TORCH_MODULE(Name) (tandem/nn/module.h), or hold it in a torch::nn::Sequential");
  std::string missing;
  for (const auto& c : classes)
    if (!found.count(c)) missing += (missing.empty() ? "" : ", ") + c;
  if (!missing.empty())
    throw ::tandem::Refused("activation checkpointing: fsdp_transformer_layer_cls_to_wrap "
                                "names " + missing + ", which is no module of the model; name "
                                "the class of its blocks as declared (TANDEM_MODULE(Block) is "
                                "\"Block\")");
  if (count == 0)
    throw ::tandem::Refused(
        "activation checkpointing was asked for (fsdp_config.fsdp_activation_checkpointing, tandem "
        "launch --activation_checkpointing, or AcceleratorOptions().activation_checkpointing), but "
        "the model has no block it can reach: no Sequential entry and no module declared with "
        "TANDEM_MODULE (tandem/nn/module.h). Declare the blocks' type with TANDEM_MODULE(Block) "
        "instead of TORCH_MODULE(Block), or hold them in a torch::nn::Sequential");
  return count;
}

}  // namespace tandem::parallel
