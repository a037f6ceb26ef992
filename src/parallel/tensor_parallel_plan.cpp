// Tensor parallel: vocab-parallel cross entropy, plans (matching and applying them to a model),
// and the per-rank RNG stream for dropout.
#include <ATen/CPUGeneratorImpl.h>
#include "tandem/error.h"
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <set>

#include "parallel/detail/tp_shard.h"
#include "tandem/comm/process_group.h"
#include "tandem/parallel/tensor_parallel.h"

#include "tandem/nn/module.h"
#include "nn/detail/replace_child.h"

namespace tandem::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Megatron's vocab-parallel cross entropy, one loss per target (0 where ignored). The softmax
// is formed from the globally reduced maximum and sum, so the gradient needs no communication.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& target, c10::IValue group_value,
                            int64_t ignore_index) {
    auto group = detail::unwrap_group(group_value);
    const int64_t local = logits.size(-1);
    const int64_t start = local * group->rank();
    auto max = std::get<0>(logits.max(-1)).contiguous();
    group->allreduce(max, ReduceOp::kMax);
    auto shifted = logits - max.unsqueeze(-1);
    auto local_target = target - start;
    auto here = (local_target >= 0).logical_and(local_target < local);
    auto index = local_target.masked_fill(here.logical_not(), 0);
    auto predicted =
        shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(here.logical_not(), 0.0)
            .contiguous();
    group->allreduce(predicted, ReduceOp::kSum);
    auto exp = shifted.exp();
    auto sum = exp.sum(-1).contiguous();
    group->allreduce(sum, ReduceOp::kSum);
    auto valid = target != ignore_index;
    auto loss = (sum.log() - predicted).masked_fill(valid.logical_not(), 0.0);
    exp.div_(sum.unsqueeze(-1));  // the softmax over every rank's classes, on this rank's part
    ctx->saved_data["softmax"] = exp;
    ctx->saved_data["index"] = index;
    ctx->saved_data["here"] = here;
    ctx->saved_data["valid"] = valid;
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto grad = ctx->saved_data["softmax"].toTensor().clone();
    auto index = ctx->saved_data["index"].toTensor();
    auto here = ctx->saved_data["here"].toTensor();
    auto valid = ctx->saved_data["valid"].toTensor();
    grad.scatter_add_(-1, index.unsqueeze(-1), here.to(grad.scalar_type()).neg().unsqueeze(-1));
    grad.mul_((g[0] * valid.to(g[0].scalar_type())).unsqueeze(-1));
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Glob match where '*' is any run of characters other than '.'.
bool glob(const char* p, const char* s) {
  if (*p == '\0') return *s == '\0';
  if (*p == '*') {
    for (const char* t = s;; ++t) {
      if (glob(p + 1, t)) return true;
      if (*t == '\0' || *t == '.') return false;
    }
  }
  return *p == *s && glob(p + 1, s + 1);
}

std::string style_name(ParallelStyle s) {
  switch (s) {
    case ParallelStyle::kColwise: return "colwise";
    case ParallelStyle::kRowwise: return "rowwise";
    case ParallelStyle::kVocab: return "vocab";
    case ParallelStyle::kSequenceParallel: return "sequence_parallel";
    case ParallelStyle::kRankRandom: return "rank_random";
  }
  return "?";
}

at::Tensor param(torch::nn::Module& m, const std::string& name) {
  auto params = m.named_parameters(/*recurse=*/false);
  auto* p = params.find(name);
  return p ? *p : at::Tensor();
}

// Note [Dense tensors after parallelize]: each split parameter becomes a new tensor, this
// rank's shard, which the tensor-parallel layer holds (and any planned module tied to it). The
// dense tensor object stays with the replaced module, which a typed member of the user's module
// (`torch::nn::Linear up`) may still hold and call: it then shares the shard's memory (the dense
// data is freed) and refuses any gradient, so a model that still calls `up(x)` instead of the
// planned layer (parallel::planned_child) fails at its first backward, naming the module and the
// fix, instead of training each rank's half-layer without a collective. A module tied to a
// split tensor but not planned itself is refused the same way.
struct ShardBook {
  std::map<c10::TensorImpl*, at::Tensor> shard_of;  // dense tensor -> its shard
  std::map<c10::TensorImpl*, std::string> split;    // shard -> how it was split ("rows/3", "cols")
  std::set<c10::TensorImpl*> summed;  // replicated parameters of sequence-parallel modules

  // This rank's shard of `dense`, as a new tensor; a tensor already sharded the same way (a tied
  // parameter) gives the same shard.
  at::Tensor adopt(at::Tensor dense, const std::string& how, const ProcessGroup& g,
                   const std::string& path, const std::string& tensor, const std::string& what,
                   int64_t parts) {
    if (summed.count(dense.unsafeGetTensorImpl()))
      throw ::tandem::Refused(g.prefix() + " parallelize_module: " + path +
                                  " shares a parameter with a sequence-parallel module, which "
                                  "keeps it replicated; its plan entry would split it as " + how +
                                  "; untie the parameter or plan both modules alike");
    auto it = shard_of.find(dense.unsafeGetTensorImpl());
    if (it != shard_of.end()) {
      const auto& had = split.at(it->second.unsafeGetTensorImpl());
      if (had != how)
        throw ::tandem::Refused(g.prefix() + " parallelize_module: " + path +
                                    " shares a parameter with a module sharded as " + had +
                                    ", but its plan entry splits it as " + how +
                                    "; tied parameters must be split the same way");
      return it->second;
    }
    at::Tensor shard;
    {
      torch::NoGradGuard no_grad;
      shard = how == "cols" ? detail::shard_cols(dense, g.rank(), g.size())
                            : detail::shard_rows(dense, g.rank(), g.size(), parts);
    }
    shard = shard.detach();
    shard.set_requires_grad(dense.requires_grad());
    dense.set_data(shard);  // the dense data is freed; the replaced module sees the shard
    if (dense.grad().defined()) dense.mutable_grad() = at::Tensor();
    if (dense.requires_grad()) {
      const std::string message =
          g.prefix() + " tensor parallel: a gradient reached the original tensor of " + path +
          "." + tensor +
          ", which the plan replaced by a " + what +
          ": the model still computes with the module the plan replaced, usually through a "
          "typed member (`up(x)` on a `torch::nn::Linear up`), which gives only this rank's "
          "shard without the collective. Declare the member with tandem's hookable holder "
          "(`tandem::nn::Linear up;`, tandem/nn/module.h), whose calls go to the planned layer, "
          "or call the planned layer: `if (auto tp = tandem::parallel::planned_child(*this, "
          "\"name\")) return tp->forward(x);` (see docs/model_parallel.md, \"Modules with "
          "typed members\"); a module tied to a split parameter must be planned too";
      dense.register_hook([message](const at::Tensor&) -> at::Tensor {
        throw std::runtime_error(message);
      });
    }
    shard_of[dense.unsafeGetTensorImpl()] = shard;
    split[shard.unsafeGetTensorImpl()] = how;
    return shard;
  }
  bool sharded(const at::Tensor& t) const {
    return split.count(t.unsafeGetTensorImpl()) > 0 || shard_of.count(t.unsafeGetTensorImpl()) > 0;
  }
};

using tandem::nn::detail::replace_child;

// Note [Sequence-parallel parameter gradients]: a per-token module on sequence shards sees only
// this rank's positions, so the gradient of each of its (replicated) parameters is a partial
// sum; the dense gradient is the sum over the tp group. The hook runs before the gradient is
// accumulated into .grad (and before data parallel's accumulator hooks read it), once per
// backward, so gradient accumulation and a dp all-reduce see the summed gradient.
void sum_gradients_over(const at::Tensor& parameter, std::shared_ptr<ProcessGroup> tp) {
  parameter.register_hook([tp](const at::Tensor& grad) {
    if (!grad.defined()) return grad;
    auto sum = grad.clone(at::MemoryFormat::Contiguous);
    tp->allreduce(sum, ReduceOp::kSum);
    return sum;
  });
}

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& target,
                                        std::shared_ptr<ProcessGroup> group,
                                        const VocabParallelCrossEntropyOptions& options) {
  if (!group)
    throw ::tandem::Refused("vocab_parallel_cross_entropy: the process group is null");
  const auto& r = options.reduction();
  if (r != "mean" && r != "sum" && r != "none")
    throw ::tandem::Refused(group->prefix() + " vocab_parallel_cross_entropy: reduction '" +
                                r + "'; expected mean, sum or none");
  auto expected = local_logits.sizes().vec();
  expected.pop_back();
  if (target.sizes().vec() != expected)
    throw ::tandem::Refused(group->prefix() + " vocab_parallel_cross_entropy: targets of shape " +
                                c10::str(target.sizes()) + " for logits of shape " +
                                c10::str(local_logits.sizes()) + "; expected " +
                                c10::str(at::IntArrayRef(expected)));
  auto loss = VocabParallelCrossEntropy::apply(local_logits, target, detail::wrap_group(group),
                                               options.ignore_index());
  if (r == "none") return loss;
  if (r == "sum") return loss.sum();
  const auto count = (target != options.ignore_index()).sum().clamp_min(1);
  return loss.sum() / count.to(loss.scalar_type());
}

// --- Plans ------------------------------------------------------------------------------------

TensorParallelPlan& TensorParallelPlan::add(PlanEntry entry) {
  entries.push_back(std::move(entry));
  return *this;
}

TensorParallelPlan& TensorParallelPlan::colwise(const std::string& pattern, int64_t parts,
                                                bool gather_output) {
  PlanEntry e;
  e.pattern = pattern;
  e.style = ParallelStyle::kColwise;
  e.parts = parts;
  e.gather_output = gather_output;
  return add(e);
}

TensorParallelPlan& TensorParallelPlan::rowwise(const std::string& pattern, bool input_is_parallel) {
  PlanEntry e;
  e.pattern = pattern;
  e.style = ParallelStyle::kRowwise;
  e.input_is_parallel = input_is_parallel;
  return add(e);
}

TensorParallelPlan& TensorParallelPlan::vocab(const std::string& pattern) {
  PlanEntry e;
  e.pattern = pattern;
  e.style = ParallelStyle::kVocab;
  return add(e);
}

TensorParallelPlan& TensorParallelPlan::colwise_from_sequence(const std::string& pattern,
                                                              int64_t parts) {
  colwise(pattern, parts);
  entries.back().sequence_parallel = true;
  return *this;
}

TensorParallelPlan& TensorParallelPlan::rowwise_to_sequence(const std::string& pattern) {
  rowwise(pattern);
  entries.back().sequence_parallel = true;
  return *this;
}

TensorParallelPlan& TensorParallelPlan::rank_random(const std::string& pattern, uint64_t seed) {
  PlanEntry e;
  e.pattern = pattern;
  e.style = ParallelStyle::kRankRandom;
  e.seed = seed;
  return add(e);
}

TensorParallelPlan& TensorParallelPlan::sequence_parallel(const std::string& pattern) {
  PlanEntry e;
  e.pattern = pattern;
  e.style = ParallelStyle::kSequenceParallel;
  return add(e);
}

TensorParallelPlan& TensorParallelPlan::sum_gradients(const std::string& pattern) {
  return sequence_parallel(pattern);  // the same treatment: replicated, gradients summed over tp
}

bool plan_pattern_matches(const std::string& pattern, const std::string& path) {
  return glob(pattern.c_str(), path.c_str());
}

std::vector<std::vector<std::string>> match_plan(const TensorParallelPlan& plan,
                                                 const std::vector<std::string>& module_paths) {
  std::vector<std::vector<std::string>> out(plan.entries.size());
  std::map<std::string, std::string> claimed;
  std::vector<std::string> unmatched;
  for (size_t i = 0; i < plan.entries.size(); ++i) {
    const auto& e = plan.entries[i];
    if (e.parts < 1)
      throw ::tandem::Refused("tensor-parallel plan entry '" + e.pattern + "': parts " +
                                  std::to_string(e.parts) + "; expected 1 or more");
    for (const auto& p : module_paths) {
      if (!plan_pattern_matches(e.pattern, p)) continue;
      auto [it, fresh] = claimed.emplace(p, e.pattern);
      if (!fresh)
        throw ::tandem::Refused("tensor-parallel plan: module " + p + " is matched by '" +
                                    it->second + "' and by '" + e.pattern +
                                    "'; make the patterns disjoint");
      out[i].push_back(p);
    }
    if (out[i].empty()) unmatched.push_back("'" + e.pattern + "' (" + style_name(e.style) + ")");
  }
  if (!unmatched.empty()) {
    std::string names, some;
    for (const auto& u : unmatched) names += (names.empty() ? "" : ", ") + u;
    for (size_t i = 0; i < module_paths.size() && i < 12; ++i)
      some += (some.empty() ? "" : ", ") + module_paths[i];
    if (module_paths.size() > 12) some += ", ...";
    throw ::tandem::Refused("tensor-parallel plan entr" +
                                std::string(unmatched.size() == 1 ? "y " : "ies ") + names +
                                " match no module of the model; paths are named as "
                                "named_modules() names them (" + some +
                                "), with * for any characters within one component");
  }
  return out;
}

void parallelize_module(torch::nn::Module& model, std::shared_ptr<ProcessGroup> tp,
                        const TensorParallelPlan& plan) {
  if (!tp)
    throw ::tandem::Refused("parallelize_module: the tensor-parallel group is null (this "
                                "rank is not in it); pass this rank's group, e.g. mesh[\"tp\"]");
  auto named = model.named_modules(/*name_prefix=*/"", /*include_self=*/false);
  std::vector<std::string> paths;
  for (const auto& item : named) paths.push_back(item.key());
  const auto matches = match_plan(plan, paths);
  ShardBook book;
  std::map<uint64_t, std::shared_ptr<TensorParallelRng>> streams;  // kRankRandom, by seed
  const int n = tp->size();
  for (size_t i = 0; i < plan.entries.size(); ++i) {
    const auto& e = plan.entries[i];
    for (const auto& path : matches[i]) {
      const auto dot = path.rfind('.');
      torch::nn::Module& parent =
          dot == std::string::npos ? model : *named[path.substr(0, dot)];
      const std::string name = dot == std::string::npos ? path : path.substr(dot + 1);
      auto& child = *named[path];
      auto w = param(child, "weight"), b = param(child, "bias");
      auto refuse = [&](const std::string& why) {
        throw ::tandem::Refused(tp->prefix() + " parallelize_module: " + path + " (" +
                                    child.name() + ", plan entry '" + e.pattern + "', " +
                                    style_name(e.style) + "): " + why);
      };
      if (e.style == ParallelStyle::kSequenceParallel) {
        if (dynamic_cast<TensorParallelModule*>(&child))
          refuse("expected a module with replicated parameters (a norm), found a "
                 "tensor-parallel layer; plan it once, as colwise/rowwise or as sequence_parallel");
        for (const auto& p : child.named_parameters(/*recurse=*/true)) {
          if (book.sharded(p.value()))
            refuse("its parameter " + p.key() + " is split by another plan entry (a tied "
                   "parameter); a sequence-parallel module keeps its parameters replicated");
          if (!book.summed.insert(p.value().unsafeGetTensorImpl()).second) continue;
          if (n > 1 && p.value().requires_grad()) sum_gradients_over(p.value(), tp);
        }
        continue;
      }
      if (e.style == ParallelStyle::kRankRandom) {
        // Note [Per-rank random streams on hooks]: the module's forward draws from this tp
        // rank's stream (one TensorParallelRng per seed, shared by the entries with that seed);
        // activation checkpointing recomputes it with the same draws (the stream is a
        // RandomStream).
        auto* h = tandem::nn::hookable(child);
        if (!h)
          refuse("a module whose random numbers differ per rank must be hookable: declare it "
                 "with tandem's holder (tandem::nn::Dropout, or TANDEM_MODULE(Name) for your "
                 "own module; tandem/nn/module.h)");
        auto& rng = streams[e.seed];
        if (!rng) rng = std::make_shared<TensorParallelRng>(e.seed, tp->rank());
        h->hooks().add("tensor-parallel rank stream", tandem::nn::order::kRandom,
                       [rng](const std::vector<at::Tensor>& in, const tandem::nn::TensorFunction& next) {
                         auto scope = rng->scope();
                         return next(in);
                       });
        continue;
      }
      if (!w.defined() || w.dim() != 2)
        refuse("expected a module with a 2-D parameter 'weight' (a Linear or an Embedding)");
      // The dense sizes (a tensor tied to a module sharded before is already a shard).
      const int64_t rows = book.sharded(w) && e.style != ParallelStyle::kRowwise ? w.size(0) * n
                                                                                 : w.size(0);
      const int64_t cols = book.sharded(w) && e.style == ParallelStyle::kRowwise ? w.size(1) * n
                                                                                 : w.size(1);
      const std::string rows_how = "rows/" + std::to_string(e.parts);
      std::shared_ptr<torch::nn::Module> replacement;
      torch::nn::AnyModule any;
      if (e.style == ParallelStyle::kColwise) {
        detail::check_divisible(*tp, rows, e.parts, path + ".weight rows (out_features)");
        auto o = ColumnParallelLinearOptions(cols, rows)
                     .parts(e.parts)
                     .gather_output(e.gather_output)
                     .sequence_parallel(e.sequence_parallel);
        const std::string what = "ColumnParallelLinear (" + rows_how + ")";
        auto ws = book.adopt(w, rows_how, *tp, path, "weight", what, e.parts);
        auto bs = b.defined() ? book.adopt(b, rows_how, *tp, path, "bias", what, e.parts)
                              : at::Tensor();
        auto layer = std::make_shared<ColumnParallelLinearImpl>(o, tp, ws, bs);
        replacement = layer;
        any = torch::nn::AnyModule(layer);
      } else if (e.style == ParallelStyle::kRowwise) {
        detail::check_divisible(*tp, cols, 1, path + ".weight columns (in_features)");
        auto o = RowParallelLinearOptions(cols, rows)
                     .input_is_parallel(e.input_is_parallel)
                     .sequence_parallel(e.sequence_parallel);
        auto ws = book.adopt(w, "cols", *tp, path, "weight", "RowParallelLinear (cols)", 1);
        auto layer =
            std::make_shared<RowParallelLinearImpl>(o, tp, ws, b.defined() ? b : at::Tensor());
        replacement = layer;
        any = torch::nn::AnyModule(layer);
      } else {
        if (e.sequence_parallel)
          refuse("sequence_parallel applies to colwise and rowwise entries; a vocab-parallel "
                 "embedding's output is replicated (scatter it with scatter_to_sequence_region)");
        if (b.defined()) refuse("an embedding has no bias; this module has one");
        detail::check_divisible(*tp, rows, 1, path + ".weight rows (num_embeddings)");
        auto ws = book.adopt(w, "rows/1", *tp, path, "weight", "VocabParallelEmbedding", 1);
        auto layer = std::make_shared<VocabParallelEmbeddingImpl>(rows, tp, ws);
        replacement = layer;
        any = torch::nn::AnyModule(layer);
      }
      replace_child(parent, name, replacement, any);
      // Note [Planned typed members held by torch::nn holders]: now only `named` holds the
      // replaced module, unless a typed member of the parent (or another holder) does: a
      // torch::nn holder's calls cannot be redirected, and the model would compute with this
      // rank's shard (usually dying in its own reshape first), so it is refused here, before
      // any step, unless the plan says the model calls its planned children through
      // planned_child.
      // `named` holds one reference per path the module is registered under.
      long in_named = 0;
      for (const auto& item : named)
        if (item.value().get() == &child) ++in_named;
      if (n > 1 && !tandem::nn::hookable(child) && !plan.calls_planned_children &&
          named[path].use_count() > in_named) {
        std::string type = child.name(), holder = type;
        const std::string torch_ns = "torch::nn::";
        if (holder.rfind(torch_ns, 0) == 0) {
          holder = holder.substr(torch_ns.size());
          if (holder.size() > 4 && holder.compare(holder.size() - 4, 4, "Impl") == 0)
            holder.resize(holder.size() - 4);
        }
        refuse("the plan replaced it, but a member of its parent still holds the " + type +
               " (a typed `torch::nn::" + holder + " " + name + ";` called as `" + name +
               "(x)`), which would compute with this rank's shard and no collective. Declare "
               "the member with tandem's hookable holder, `tandem::nn::" + holder + " " + name +
               ";` (tandem/nn/module.h: one change per holder), whose calls go to the planned "
               "layer; or call the planned layer, `if (auto tp = "
               "tandem::parallel::planned_child(*this, \"" + name + "\")) return "
               "tp->forward(x);`, and say so with plan.through_planned_child(). Code that "
               "derives sizes from the full width (a head count) must follow the split: take "
               "them from the layer's output (`x.size(-1) / head_dim` heads on this rank), as "
               "docs/model_parallel.md shows");
      }
      // Note [Planned typed members]: a hookable module (tandem::nn::Linear, Embedding) that
      // the parent also holds as a typed member has its calls redirected to the planned layer,
      // so `up(x)` and `up->forward(x)` compute the tensor-parallel layer.
      if (auto* h = tandem::nn::hookable(child)) {
        auto layer = std::dynamic_pointer_cast<TensorParallelModule>(replacement);
        h->hooks().redirect(
            replacement,
            [layer, path](const std::vector<at::Tensor>& in) {
              TANDEM_CHECK(in.size() == 1, "tensor parallel: ", path, " was called with ",
                          in.size(), " tensors; its planned layer takes one");
              return std::vector<at::Tensor>{layer->forward(in[0])};
            },
            "tensor parallel " + replacement->name());
      }
    }
  }
}

std::map<std::string, std::string> tensor_parallel_splits(torch::nn::Module& model) {
  std::map<const c10::TensorImpl*, std::string> how;
  for (const auto& item : model.named_modules()) {
    auto* m = item.value().get();
    if (auto* t = dynamic_cast<TensorParallelModule*>(m))  // Note [Adapters on tensor-parallel layers]
      for (const auto& [impl, h] : t->marked_splits()) how[impl] = h;
    if (auto* c = dynamic_cast<ColumnParallelLinearImpl*>(m)) {
      const auto rows = "rows/" + std::to_string(c->options.parts());
      how[c->weight.unsafeGetTensorImpl()] = rows;
      if (c->bias.defined()) how[c->bias.unsafeGetTensorImpl()] = rows;
    } else if (auto* r = dynamic_cast<RowParallelLinearImpl*>(m)) {
      how[r->weight.unsafeGetTensorImpl()] = "cols";
    } else if (auto* v = dynamic_cast<VocabParallelEmbeddingImpl*>(m)) {
      how[v->weight.unsafeGetTensorImpl()] = "rows/1";
    }
  }
  std::map<std::string, std::string> out;
  for (const auto& p : model.named_parameters()) {
    auto it = how.find(p.value().unsafeGetTensorImpl());
    if (it != how.end()) out[p.key()] = it->second;
  }
  return out;
}

std::shared_ptr<TensorParallelModule> planned_child(torch::nn::Module& parent,
                                                    const std::string& name) {
  auto children = parent.named_children();
  auto* child = children.find(name);
  return child ? std::dynamic_pointer_cast<TensorParallelModule>(*child) : nullptr;
}

// --- RNG --------------------------------------------------------------------------------------

namespace {

constexpr uint64_t kTensorParallelSeedOffset = 2718;  // Megatron's

bool cuda_generator_available() { return at::hasCUDA(); }

// The current CUDA device's default generator (Context::defaultGenerator exists in 1.13 and 2.x).
at::Generator cuda_generator() { return at::globalContext().defaultGenerator(c10::Device(c10::kCUDA)); }

// The state of `gen` seeded with `seed`, leaving `gen` as it was.
at::Tensor seeded_state(at::Generator gen, uint64_t seed) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto saved = gen.get_state();
  gen.set_current_seed(seed);
  auto state = gen.get_state();
  gen.set_state(saved);
  return state;
}

// Puts `state` into `gen` and returns what it held.
at::Tensor swap_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto old = gen.get_state();
  gen.set_state(state);
  return old;
}

}  // namespace

TensorParallelRng::TensorParallelRng(uint64_t seed, int tp_rank) : seed_(seed) {
  const uint64_t s = seed + kTensorParallelSeedOffset + static_cast<uint64_t>(tp_rank);
  cpu_state_ = seeded_state(at::detail::getDefaultCPUGenerator(), s);
  if (cuda_generator_available()) cuda_state_ = seeded_state(cuda_generator(), s);
  register_random_stream(this);
}

TensorParallelRng::~TensorParallelRng() { unregister_random_stream(this); }

void TensorParallelRng::set_stream_state(const std::vector<at::Tensor>& state) {
  TANDEM_CHECK(state.size() == 2, "TensorParallelRng::set_stream_state: expected the CPU and CUDA "
              "states (2 tensors), got ", state.size());
  cpu_state_ = state[0];
  cuda_state_ = state[1];
}

TensorParallelRng::Scope::Scope(TensorParallelRng& rng) : rng_(rng) {
  saved_cpu_ = swap_state(at::detail::getDefaultCPUGenerator(), rng_.cpu_state_);
  if (rng_.cuda_state_.defined()) saved_cuda_ = swap_state(cuda_generator(), rng_.cuda_state_);
}

TensorParallelRng::Scope::~Scope() {
  rng_.cpu_state_ = swap_state(at::detail::getDefaultCPUGenerator(), saved_cpu_);
  if (saved_cuda_.defined()) rng_.cuda_state_ = swap_state(cuda_generator(), saved_cuda_);
}

}  // namespace tandem::parallel
