// Module hooks for LibTorch. LibTorch has no forward hooks and a module's forward is not
// virtual, so a transform that must act around a module's forward (tensor parallel, ZeRO-3
// units, activation checkpointing, per-rank random streams; offload and device maps alike)
// could only reach modules it could replace: Sequential entries and registered children. A
// module that calls its members directly (`up(x)`, `block->forward(x)`) escaped them.
//
// TANDEM_MODULE(Block) declares the holder `Block` as TORCH_MODULE(Block) does, over
// `tandem::nn::Hooked<BlockImpl>`: a BlockImpl whose forward runs the module's forward hooks
// first. Both ways of calling it run them: `block(x)` (the holder's call) and
// `block->forward(x)` (the holder's arrow gives the Hooked type, whose forward hides
// BlockImpl's). tandem::nn::Linear, Embedding, LayerNorm and Dropout are the standard layers,
// hookable. With no hook set the call is BlockImpl::forward after one pointer test.
//
// Note [Forward hooks]: a module's hooks are wrappers, each with a name and an order; the call
// runs the wrappers from the smallest order (outermost) to the largest, then the forward, or
// the module a transform redirected the call to (tensor parallel puts its layer there). A
// wrapper sees the call's tensors: the forward's tensor arguments in order (other arguments
// are held by value and passed as they were), and its result as a list of tensors (a Tensor, a
// std::tuple of Tensors, or a std::vector<Tensor>). It may run the rest of the chain (`next`)
// once (a gather before, a release after), not at all (a redirect), or again later (activation
// checkpointing keeps `next` and runs it in the backward: `next` owns what it needs). A forward
// that returns anything else cannot be seen by hooks: a hooked call of it is refused, naming the
// module and what to return instead. Tensors inside other arguments (a std::vector<Tensor>, a
// struct) are not seen: a transform that must see them refuses such a forward when applied.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Type.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace tandem::nn {

/// A module's forward seen through its tensors.
using TensorFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
/// A forward hook: the call's tensor inputs and the rest of the chain; returns the outputs.
using ForwardWrapper =
    std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs,
                                          const TensorFunction& next)>;

/// Where tandem's own wrappers sit (smaller: outside). A user's pre- and post-forward hooks
/// (register_forward_pre_hook, register_forward_hook) sit at kUser, outside all of them.
namespace order {
constexpr int kUser = 0;
constexpr int kCheckpoint = 100;  ///< activation checkpointing: recomputes everything inside
constexpr int kShard = 200;       ///< a ZeRO-3 unit: gathers before, frees after
constexpr int kAdapter = 250;     ///< a LoRA adapter adds to the layer's own call (peft/lora.h)
constexpr int kOffload = 300;     ///< parameters brought to the device for the call
constexpr int kRandom = 400;      ///< a random stream swapped in for the call
}  // namespace order

/// The hooks of one module (Note [Forward hooks]).
class ForwardHooks {
 public:
  /// Adds `wrapper` as `name`; a wrapper of that name already there is replaced.
  void add(const std::string& name, int order, ForwardWrapper wrapper);
  /// Removes the wrapper `name`; false when there is none.
  bool remove(const std::string& name);
  bool contains(const std::string& name) const;
  /// Calls go to `call` (the forward of `module`, which a transform put in this one's place)
  /// instead of this module's own forward. `what` names it for describe().
  void redirect(std::shared_ptr<torch::nn::Module> module, TensorFunction call,
                const std::string& what);
  /// The module calls are redirected to, or nullptr.
  std::shared_ptr<torch::nn::Module> redirected_to() const { return redirect_; }
  bool empty() const { return entries_.empty() && !redirect_call_; }
  /// The wrappers' names, outermost first, then "redirect: <what>" when redirected.
  std::vector<std::string> names() const;
  /// Runs the chain over `inputs`, ending in `forward` (or the redirect).
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs,
                              const TensorFunction& forward) const;

 private:
  struct Entry {
    std::string name;
    int order;
    ForwardWrapper wrapper;
  };
  std::vector<Entry> entries_;  // by order, then by when they were added
  std::shared_ptr<torch::nn::Module> redirect_;
  TensorFunction redirect_call_;
  std::string redirect_what_;
};

namespace detail {
class BuildScope;
}

/// What every hookable module is, besides its torch::nn::Module implementation.
class Hookable {
 public:
  /// Runs once the module's own constructor is done (Hookable is the last base of Hooked): a
  /// BuildScope on this thread hears of the module (Note [Sharded construction]).
  Hookable();
  virtual ~Hookable();
  /// The module's hooks (made on first use).
  ForwardHooks& hooks() {
    if (!hooks_) hooks_ = std::make_unique<ForwardHooks>();
    return *hooks_;
  }
  /// The hooks, or nullptr when none was ever set.
  const ForwardHooks* hooks_if_any() const { return hooks_.get(); }
  bool has_hooks() const { return hooks_ && !hooks_->empty(); }
  /// The declared type: "Block" for TANDEM_MODULE(Block), "Linear" for tandem::nn::Linear.
  virtual std::string type_name() const = 0;
  /// Whether hooks can see the forward's result: a Tensor, a std::tuple of Tensors or a
  /// std::vector<Tensor> (Note [Forward hooks]; arguments other than tensors are held).
  virtual bool tensor_forward() const = 0;
  /// Whether this is one of tandem's hookable standard layers (Linear, Embedding, ...), not a
  /// module a user declared with TANDEM_MODULE.
  virtual bool standard_layer() const { return false; }
  /// The module itself.
  torch::nn::Module& module() { return dynamic_cast<torch::nn::Module&>(*this); }

  /// PyTorch's register_forward_pre_hook / register_forward_hook, as named wrappers at
  /// order::kUser: `pre` sees the inputs before the call, `post` the inputs and the outputs
  /// after it (it may change the outputs in place).
  void register_forward_pre_hook(const std::string& name,
                                 std::function<void(const std::vector<at::Tensor>&)> pre);
  void register_forward_hook(
      const std::string& name,
      std::function<void(const std::vector<at::Tensor>&, std::vector<at::Tensor>&)> post);

 protected:
  std::unique_ptr<ForwardHooks> hooks_;
};

namespace detail {

/// Note [Sharded construction]: while a BuildScope is open on a thread (Accelerator::build
/// opens one under ZeRO-3), every hookable module's construction is seen: BuildMark, the first
/// base of Hooked, marks its start; Hookable, the last, its end. A module that ends at depth
/// `unit_depth` (the number of hookable modules still under construction around it) is a
/// candidate unit; it is handed to `on_built` as soon as it is complete, that is at the next
/// construction that starts or ends, or when the scope finishes: so a model's blocks are
/// sharded one by one while the model is built, and no rank ever holds more than one dense
/// block. A Sharded wrapper reports itself directly (report_unit). The scope only reports;
/// what to do with a module is `on_built`'s.
class BuildScope {
 public:
  using OnBuilt = std::function<void(torch::nn::Module&, bool explicit_unit)>;
  /// unit_depth kEveryModule: every hookable module is a candidate, at any depth (what
  /// init_empty_weights releases).
  static constexpr int kEveryModule = -1;
  BuildScope(int unit_depth, OnBuilt on_built);
  ~BuildScope();
  BuildScope(const BuildScope&) = delete;
  BuildScope& operator=(const BuildScope&) = delete;
  /// Hands over the modules still pending; call when the model is built (before it is used).
  void finish();
  /// The scope open on this thread, or nullptr.
  static BuildScope* current();

  // Called by BuildMark, Hookable and ShardedImpl.
  void started(const void* mark);
  void aborted(const void* mark);
  void ended(Hookable* module);
  void forget(Hookable* module);
  void report_unit(torch::nn::Module& module);

 private:
  void flush();
  int unit_depth_;
  OnBuilt on_built_;
  std::vector<const void*> marks_;  // constructions under way, innermost last
  std::vector<Hookable*> pending_;  // candidates not yet complete when they ended
  BuildScope* outer_;
  bool flushing_ = false;
};

/// The first base of every Hooked module: tells the open BuildScope a construction starts.
class BuildMark {
 public:
  BuildMark() {
    if (auto* s = BuildScope::current()) s->started(this);
  }
  ~BuildMark() {
    if (auto* s = BuildScope::current()) s->aborted(this);  // a constructor that threw
  }
};

}  // namespace detail

/// `module` as a Hookable, or nullptr when it was not declared hookable.
inline Hookable* hookable(torch::nn::Module& module) { return dynamic_cast<Hookable*>(&module); }
/// The declared type of any module: type_name() for a hookable one, else its class name
/// without namespace and without the "Impl" suffix ("torch::nn::LinearImpl" -> "Linear").
std::string module_type_name(const torch::nn::Module& module);
/// Every module of `model` that has hooks, by its qualified name, with the hooks' names
/// (outermost first): what the transforms did to the model.
std::vector<std::pair<std::string, std::vector<std::string>>> describe_hooks(
    torch::nn::Module& model);

namespace detail {

[[noreturn]] void refuse_hooked_call(const std::string& type, const char* why);

template <class T>
constexpr bool is_tensor_v = std::is_same_v<std::decay_t<T>, at::Tensor>;

template <class R>
struct Result {
  static constexpr bool ok = false;
};
template <>
struct Result<at::Tensor> {
  static constexpr bool ok = true;
  static std::vector<at::Tensor> to(at::Tensor r) { return {std::move(r)}; }
  static at::Tensor from(std::vector<at::Tensor> v) { return std::move(v.at(0)); }
};
template <>
struct Result<std::vector<at::Tensor>> {
  static constexpr bool ok = true;
  static std::vector<at::Tensor> to(std::vector<at::Tensor> r) { return r; }
  static std::vector<at::Tensor> from(std::vector<at::Tensor> v) { return v; }
};
template <class... T>
struct Result<std::tuple<T...>> {
  static constexpr bool ok = (is_tensor_v<T> && ...);
  static std::vector<at::Tensor> to(std::tuple<T...> r) {
    return std::apply([](auto&&... t) { return std::vector<at::Tensor>{at::Tensor(t)...}; }, r);
  }
  static std::tuple<T...> from(std::vector<at::Tensor> v) {
    return from(std::move(v), std::index_sequence_for<T...>{});
  }
  template <size_t... I>
  static std::tuple<T...> from(std::vector<at::Tensor> v, std::index_sequence<I...>) {
    return std::tuple<T...>(std::move(v.at(I))...);
  }
};

// Where argument I's tensor sits among the tensor arguments (-1: not a tensor).
template <class... A>
constexpr std::array<int, sizeof...(A) + 1> tensor_slots() {
  constexpr bool is[] = {is_tensor_v<A>..., false};
  std::array<int, sizeof...(A) + 1> out{};
  int k = 0;
  for (size_t i = 0; i < sizeof...(A); ++i) out[i] = is[i] ? k++ : -1;
  return out;
}

// Calls Impl's forward with the held arguments, the tensor ones taken from `tensors`.
template <class Impl, class R, class... D>
struct Caller {
  template <size_t I>
  static decltype(auto) argument(std::tuple<D...>& held, const std::vector<at::Tensor>& tensors) {
    constexpr auto slots = tensor_slots<D...>();
    if constexpr (is_tensor_v<std::tuple_element_t<I, std::tuple<D...>>>)
      return at::Tensor(tensors.at(static_cast<size_t>(slots[I])));
    else
      return static_cast<std::tuple_element_t<I, std::tuple<D...>>&>(std::get<I>(held));
  }
  template <size_t... I>
  static std::vector<at::Tensor> call(Impl& self, std::tuple<D...>& held,
                                      const std::vector<at::Tensor>& tensors,
                                      std::index_sequence<I...>) {
    return Result<R>::to(self.Impl::forward(argument<I>(held, tensors)...));
  }
  template <size_t... I>
  static std::vector<at::Tensor> tensors_of(const std::tuple<D...>& held,
                                            std::index_sequence<I...>) {
    std::vector<at::Tensor> out;
    (
        [&] {
          if constexpr (is_tensor_v<std::tuple_element_t<I, std::tuple<D...>>>)
            out.push_back(std::get<I>(held));
        }(),
        ...);
    return out;
  }
};

// The hooked call: the arguments held by value, the forward seen through its tensors.
template <class Impl, class R, class Self, class... A>
R hooked_call(Self& self, const ForwardHooks& hooks, A&&... a) {
  if constexpr (!Result<R>::ok) {
    refuse_hooked_call(self.type_name(),
                       "its forward returns something other than a Tensor, a std::tuple of "
                       "Tensors or a std::vector<Tensor>; return tensors (and keep other results "
                       "as members) to let hooks act on it");
  } else {
    using C = Caller<Impl, R, std::decay_t<A>...>;
    auto held = std::make_shared<std::tuple<std::decay_t<A>...>>(std::forward<A>(a)...);
    auto inputs = C::tensors_of(*held, std::index_sequence_for<A...>{});
    Impl& impl = self;
    TensorFunction call = [&impl, held](const std::vector<at::Tensor>& in) {
      return C::call(impl, *held, in, std::index_sequence_for<A...>{});
    };
    return Result<R>::from(hooks.run(inputs, call));
  }
}

template <class F>
struct MemberSignature {
  using type = void;
};
template <class C, class R, class... A>
struct MemberSignature<R (C::*)(A...)> {
  using type = R(A...);
};
template <class C, class R, class... A>
struct MemberSignature<R (C::*)(A...) const> {
  using type = R(A...);
};
template <class Impl, class = void>
struct ForwardSignature {
  using type = void;  // overloaded or a template: the forward forwards any arguments
};
template <class Impl>
struct ForwardSignature<Impl, std::void_t<decltype(&Impl::forward)>> {
  using type = typename MemberSignature<decltype(&Impl::forward)>::type;
};

/// "ns::BlockImpl<T>" -> "Block": the class name as a user declares it (module_type_name's rule).
std::string trim_type_name(std::string demangled);

template <class Impl>
std::string declared_name() {
  return trim_type_name(c10::demangle(typeid(Impl).name()));
}

/// A layer type of tandem's own that counts as a standard layer declares
/// `static constexpr bool kStandardLayer = true;` (tandem::nn::RMSNorm).
template <class Impl, class = void>
struct declares_standard_layer : std::false_type {};
template <class Impl>
struct declares_standard_layer<Impl, std::void_t<decltype(Impl::kStandardLayer)>>
    : std::bool_constant<Impl::kStandardLayer> {};

template <class Impl>
constexpr bool standard_layer_v =
    std::is_same_v<Impl, torch::nn::LinearImpl> || std::is_same_v<Impl, torch::nn::EmbeddingImpl> ||
    std::is_same_v<Impl, torch::nn::LayerNormImpl> || std::is_same_v<Impl, torch::nn::DropoutImpl> ||
    declares_standard_layer<Impl>::value;

/// Note [Saving a sharded model]: between uses, ZeRO-3 gives back the storage of a unit's
/// parameters (Note [Freeing a unit]); each keeps its sizes over a storage of no bytes. LibTorch's
/// torch::save(model, path) would write such a parameter as it is, a file without its values,
/// found out only when torch::load fails on it; torch::load would take it out of its unit. The
/// modules ZeRO-3 releases are tandem's (Hooked and Sharded), whose save and load call this
/// first: it throws tandem::Refused naming the parameters and the calls that save and load a
/// sharded model, when any parameter of `m` (or of a module inside it) has such a storage.
/// `what`: "torch::save" or "torch::load"; `name`: the module's, for the message.
void refuse_released_parameters(const torch::nn::Module& m, const std::string& name,
                                const char* what);

/// Whether Impl's own save / load of an archive can be called (a program's `save(path)` helper
/// hides Module's): Hooked calls Impl's where it can, Module's otherwise.
template <class Impl, class = void>
struct saves_archives : std::false_type {};
template <class Impl>
struct saves_archives<Impl, std::void_t<decltype(std::declval<const Impl&>().Impl::save(
                                std::declval<torch::serialize::OutputArchive&>()))>>
    : std::true_type {};
template <class Impl, class = void>
struct loads_archives : std::false_type {};
template <class Impl>
struct loads_archives<Impl, std::void_t<decltype(std::declval<Impl&>().Impl::load(
                                std::declval<torch::serialize::InputArchive&>()))>>
    : std::true_type {};

/// Impl whose save and load (torch::save, torch::load) refuse a module ZeRO-3 released, then run
/// Impl's own where it has one, Module's otherwise: Hooked's base.
template <class Impl>
class Archived : public Impl {
 public:
  using Impl::Impl;
  using Impl::load;  // a program's own overloads stay callable
  using Impl::save;
  void save(torch::serialize::OutputArchive& archive) const override {
    refuse_released_parameters(*this, declared_name<Impl>(), "torch::save");
    if constexpr (saves_archives<Impl>::value)
      Impl::save(archive);
    else
      torch::nn::Module::save(archive);
  }
  void load(torch::serialize::InputArchive& archive) override {
    refuse_released_parameters(*this, declared_name<Impl>(), "torch::load");
    if constexpr (loads_archives<Impl>::value)
      Impl::load(archive);
    else
      torch::nn::Module::load(archive);
  }
};

}  // namespace detail

/// `Impl` whose forward runs the module's hooks (Note [Forward hooks]). When Impl has one
/// forward, Hooked's has its signature (so that Sequential and AnyModule take it; default
/// arguments come through FORWARD_HAS_DEFAULT_ARGS, as for Impl); otherwise it forwards any
/// arguments.
template <class Impl, class Signature = typename detail::ForwardSignature<Impl>::type>
class Hooked;

template <class Impl, class R, class... A>
class Hooked<Impl, R(A...)>
    : private detail::BuildMark, public detail::Archived<Impl>, public Hookable {
 public:
  using detail::Archived<Impl>::Archived;
  R forward(A... a) {
    if (!hooks_ || hooks_->empty()) return Impl::forward(std::forward<A>(a)...);
    return detail::hooked_call<Impl, R>(*this, *hooks_, std::forward<A>(a)...);
  }
  std::string type_name() const override { return detail::declared_name<Impl>(); }
  bool tensor_forward() const override { return detail::Result<R>::ok; }
  bool standard_layer() const override { return detail::standard_layer_v<Impl>; }
  void pretty_print(std::ostream& stream) const override {
    if constexpr (std::is_same_v<decltype(&Impl::pretty_print),
                                 void (torch::nn::Module::*)(std::ostream&) const>)
      stream << type_name();
    else
      Impl::pretty_print(stream);
  }
};

template <class Impl>
class Hooked<Impl, void>
    : private detail::BuildMark, public detail::Archived<Impl>, public Hookable {
 public:
  using detail::Archived<Impl>::Archived;
  template <class... B>
  decltype(auto) forward(B&&... b) {
    using R = decltype(std::declval<Impl&>().forward(std::forward<B>(b)...));
    if (!hooks_ || hooks_->empty()) return Impl::forward(std::forward<B>(b)...);
    return detail::hooked_call<Impl, R>(*this, *hooks_, std::forward<B>(b)...);
  }
  std::string type_name() const override { return detail::declared_name<Impl>(); }
  bool tensor_forward() const override { return true; }  // checked per call
  void pretty_print(std::ostream& stream) const override { stream << type_name(); }
};

/// Hookable standard layers: declare `tandem::nn::Linear up;` where a model had
/// `torch::nn::Linear up;` (the options and members are torch::nn's).
#define TANDEM_MODULE_IMPL(Name, ImplType)                                              \
  class Name : public ::torch::nn::ModuleHolder<::tandem::nn::Hooked<ImplType>> {       \
   public:                                                                             \
    using ::torch::nn::ModuleHolder<::tandem::nn::Hooked<ImplType>>::ModuleHolder;      \
    using Impl = ::tandem::nn::Hooked<ImplType>;                                        \
  }

/// TORCH_MODULE(Name) with hooks: the holder `Name` of `Hooked<NameImpl>`.
#define TANDEM_MODULE(Name) TANDEM_MODULE_IMPL(Name, Name##Impl)

TANDEM_MODULE_IMPL(Linear, torch::nn::LinearImpl);
TANDEM_MODULE_IMPL(Embedding, torch::nn::EmbeddingImpl);
TANDEM_MODULE_IMPL(LayerNorm, torch::nn::LayerNormImpl);
TANDEM_MODULE_IMPL(Dropout, torch::nn::DropoutImpl);

}  // namespace tandem::nn
