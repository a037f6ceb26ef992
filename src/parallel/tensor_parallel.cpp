// Tensor parallel: the communication regions as autograd functions, and the parallel layers.
#include "tandem/parallel/tensor_parallel.h"
#include "tandem/error.h"

#include <torch/torch.h>

#include <cmath>

#include "parallel/detail/tp_shard.h"
#include "tandem/comm/process_group.h"

namespace tandem::parallel {
namespace detail {

// Note [Process group in an autograd context]: ctx->saved_data holds IValues; a ProcessGroup
// travels as a capsule (an IValue around a CustomClassHolder that owns a shared_ptr), which keeps
// the group alive until backward has run, without registering a TorchScript class.
struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(std::shared_ptr<ProcessGroup> g) : group(std::move(g)) {}
  std::shared_ptr<ProcessGroup> group;
};

c10::IValue wrap_group(std::shared_ptr<ProcessGroup> group) {
  return c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(std::move(group)));
}

std::shared_ptr<ProcessGroup> unwrap_group(const c10::IValue& value) {
  auto holder = value.toCapsule();
  return static_cast<GroupCapsule*>(holder.get())->group;
}

void check_divisible(const ProcessGroup& group, int64_t size, int64_t parts, const std::string& what) {
  const int64_t n = group.size();
  if (size % (n * parts) != 0) {
    const int64_t below = size / (n * parts) * (n * parts);
    const int64_t above = below + n * parts;
    throw ::tandem::Refused(
        group.prefix() + " tensor parallel: " + what + " has size " + std::to_string(size) +
        ", which does not split evenly over " + std::to_string(n) + " ranks" +
        (parts > 1 ? " in each of its " + std::to_string(parts) + " fused parts" : "") +
        "; uneven shards are not supported: use a size divisible by " +
        std::to_string(n * parts) + " (e.g. " + (below > 0 ? std::to_string(below) + " or " : "") +
        std::to_string(above) + ") or another tensor-parallel size");
  }
}

at::Tensor shard_rows(const at::Tensor& dense, int rank, int n, int64_t parts) {
  auto sizes = dense.sizes().vec();
  const int64_t rows = sizes[0];
  std::vector<int64_t> blocked{parts, n, rows / (parts * n)};
  blocked.insert(blocked.end(), sizes.begin() + 1, sizes.end());
  auto local = sizes;
  local[0] = rows / n;
  return dense.detach().reshape(blocked).select(1, rank).reshape(local).clone();
}

at::Tensor shard_cols(const at::Tensor& dense, int rank, int n) {
  return dense.detach().chunk(n, 1)[static_cast<size_t>(rank)].clone(at::MemoryFormat::Contiguous);
}

}  // namespace detail

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using detail::unwrap_group;
using detail::wrap_group;

at::Tensor all_reduced(const at::Tensor& t, ProcessGroup& group) {
  auto out = t.clone(at::MemoryFormat::Contiguous);
  group.allreduce(out, ReduceOp::kSum);
  return out;
}

at::Tensor gathered_last(const at::Tensor& t, ProcessGroup& group) {
  auto parts = group.allgather(t.contiguous());
  return at::cat(parts, -1);
}

at::Tensor my_part_last(const at::Tensor& t, ProcessGroup& group) {
  detail::check_divisible(group, t.size(-1), 1, "the last dimension");
  return t.chunk(group.size(), -1)[static_cast<size_t>(group.rank())].contiguous();
}

// All-gather along `dim`: the dimension goes first, so that rank order is memory order.
at::Tensor gathered_along(const at::Tensor& t, ProcessGroup& group, int64_t dim) {
  auto front = t.transpose(0, dim).contiguous();
  auto sizes = front.sizes().vec();
  auto out = at::empty({group.size() * front.numel()}, front.options());
  group.all_gather_into(front, out);
  sizes[0] *= group.size();
  return out.view(sizes).transpose(0, dim).contiguous();
}

void check_sequence_divisible(const ProcessGroup& group, int64_t positions) {
  if (positions % group.size() != 0)
    throw ::tandem::Refused(
        group.prefix() + " sequence parallel: the sequence dimension has " +
        std::to_string(positions) + " positions, not divisible by the " +
        std::to_string(group.size()) +
        " tensor-parallel ranks (uneven shards would pad the last rank's positions); use a "
        "sequence length divisible by " +
        std::to_string(group.size()));
}

// This rank's block of `dim` (rank r keeps block r).
at::Tensor my_part_along(const at::Tensor& t, ProcessGroup& group, int64_t dim) {
  check_sequence_divisible(group, t.size(dim));
  return t.chunk(group.size(), dim)[static_cast<size_t>(group.rank())].contiguous();
}

// Reduce-scatter (sum) along `dim`: rank r keeps block r of the summed dimension.
at::Tensor reduce_scattered_along(const at::Tensor& t, ProcessGroup& group, int64_t dim) {
  auto front = t.transpose(0, dim).contiguous();
  auto sizes = front.sizes().vec();
  check_sequence_divisible(group, sizes[0]);
  sizes[0] /= group.size();
  auto out = at::empty({front.numel() / group.size()}, front.options());
  group.reduce_scatter(front.reshape({-1}), out, ReduceOp::kSum);
  return out.view(sizes).transpose(0, dim).contiguous();
}

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue group) {
    ctx->saved_data["group"] = std::move(group);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_reduced(g[0], *unwrap_group(ctx->saved_data["group"])), at::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, c10::IValue group) {
    return all_reduced(x, *unwrap_group(group));
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue group) {
    auto out = gathered_last(x, *unwrap_group(group));
    ctx->saved_data["group"] = std::move(group);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {my_part_last(g[0], *unwrap_group(ctx->saved_data["group"])), at::Tensor()};
  }
};

struct ScatterToRegion : torch::autograd::Function<ScatterToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue group) {
    auto out = my_part_last(x, *unwrap_group(group));
    ctx->saved_data["group"] = std::move(group);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {gathered_last(g[0], *unwrap_group(ctx->saved_data["group"])), at::Tensor()};
  }
};

// The sequence-parallel regions: `Forward` along `dim` forward, its conjugate `Backward` on the
// gradient.
using AlongFn = at::Tensor (*)(const at::Tensor&, ProcessGroup&, int64_t);

template <AlongFn Forward, AlongFn Backward>
struct SequenceRegion : torch::autograd::Function<SequenceRegion<Forward, Backward>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue group,
                            int64_t dim) {
    auto out = Forward(x, *unwrap_group(group), dim);
    ctx->saved_data["group"] = std::move(group);
    ctx->saved_data["dim"] = dim;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {Backward(g[0], *unwrap_group(ctx->saved_data["group"]), ctx->saved_data["dim"].toInt()),
            at::Tensor(), at::Tensor()};
  }
};

using GatherFromSequence = SequenceRegion<gathered_along, reduce_scattered_along>;
using ReduceScatterToSequence = SequenceRegion<reduce_scattered_along, gathered_along>;
using ScatterToSequence = SequenceRegion<my_part_along, gathered_along>;

int64_t normalized_dim(const at::Tensor& t, int64_t dim) {
  const int64_t nd = t.dim();
  TANDEM_CHECK(dim >= -nd && dim < nd, "sequence parallel: dimension ", dim,
              " does not exist in a tensor of ", nd, " dimensions");
  return dim < 0 ? dim + nd : dim;
}

void check_group(const std::shared_ptr<ProcessGroup>& group, const char* what) {
  if (!group)
    throw ::tandem::Refused(std::string(what) +
                                ": the process group is null (this rank is not in it); pass "
                                "the rank's own tensor-parallel group, e.g. mesh[\"tp\"]");
}

void check_shape(const ProcessGroup& g, const at::Tensor& t, std::vector<int64_t> expected,
                 const std::string& what) {
  if (!t.defined() || t.sizes().vec() != expected)
    throw ::tandem::Refused(g.prefix() + " " + what + ": expected a tensor of shape " +
                                c10::str(at::IntArrayRef(expected)) + ", got " +
                                (t.defined() ? c10::str(t.sizes()) : std::string("none")));
}

}  // namespace

at::Tensor copy_to_region(const at::Tensor& input, std::shared_ptr<ProcessGroup> group) {
  check_group(group, "copy_to_region");
  if (group->size() == 1) return input;
  return CopyToRegion::apply(input, wrap_group(std::move(group)));
}

at::Tensor reduce_from_region(const at::Tensor& input, std::shared_ptr<ProcessGroup> group) {
  check_group(group, "reduce_from_region");
  if (group->size() == 1) return input;
  return ReduceFromRegion::apply(input, wrap_group(std::move(group)));
}

at::Tensor gather_from_region(const at::Tensor& input, std::shared_ptr<ProcessGroup> group) {
  check_group(group, "gather_from_region");
  if (group->size() == 1) return input;
  return GatherFromRegion::apply(input, wrap_group(std::move(group)));
}

at::Tensor scatter_to_region(const at::Tensor& input, std::shared_ptr<ProcessGroup> group) {
  check_group(group, "scatter_to_region");
  if (group->size() == 1) return input;
  return ScatterToRegion::apply(input, wrap_group(std::move(group)));
}

at::Tensor gather_from_sequence_region(const at::Tensor& input, std::shared_ptr<ProcessGroup> group,
                                       int64_t dim) {
  check_group(group, "gather_from_sequence_region");
  if (group->size() == 1) return input;
  return GatherFromSequence::apply(input, wrap_group(std::move(group)), normalized_dim(input, dim));
}

at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& input,
                                             std::shared_ptr<ProcessGroup> group, int64_t dim) {
  check_group(group, "reduce_scatter_to_sequence_region");
  if (group->size() == 1) return input;
  return ReduceScatterToSequence::apply(input, wrap_group(std::move(group)),
                                        normalized_dim(input, dim));
}

at::Tensor scatter_to_sequence_region(const at::Tensor& input, std::shared_ptr<ProcessGroup> group,
                                      int64_t dim) {
  check_group(group, "scatter_to_sequence_region");
  if (group->size() == 1) return input;
  return ScatterToSequence::apply(input, wrap_group(std::move(group)), normalized_dim(input, dim));
}

TensorParallelModule::TensorParallelModule(std::shared_ptr<ProcessGroup> group)
    : group_(std::move(group)) {
  check_group(group_, "tensor-parallel layer");
}

void TensorParallelModule::add_adapter(const std::string& name,
                                       std::function<at::Tensor(const at::Tensor&)> adapter) {
  TANDEM_CHECK(takes_adapters(), group_->prefix(), " ", this->name(), ": adapter '", name,
               "' on a layer that takes none; adapters go on column- and row-parallel linear "
               "layers");
  TANDEM_CHECK(!sequence_parallel(), group_->prefix(), " ", this->name(), ": adapter '", name,
               "' under sequence parallel, whose layers see part of the sequence; adapt the "
               "layers of a plan without sequence parallel");
  TANDEM_CHECK(!has_adapter(name), group_->prefix(), " ", this->name(), " already has adapter '",
               name, "'");
  adapters_.emplace_back(name, std::move(adapter));
}

bool TensorParallelModule::has_adapter(const std::string& name) const {
  for (const auto& a : adapters_)
    if (a.first == name) return true;
  return false;
}

void TensorParallelModule::mark_split(const at::Tensor& t, const std::string& how) {
  TANDEM_CHECK(how == "cols" || how.rfind("rows/", 0) == 0, "mark_split: '", how,
               "' is neither \"cols\" nor \"rows/<parts>\"");
  marked_[t.unsafeGetTensorImpl()] = how;
}

at::Tensor TensorParallelModule::with_adapters(const at::Tensor& input, at::Tensor output) const {
  for (const auto& a : adapters_) output = output + a.second(input).to(output.scalar_type());
  return output;
}

// --- ColumnParallelLinear ---------------------------------------------------------------------

ColumnParallelLinearImpl::ColumnParallelLinearImpl(ColumnParallelLinearOptions o,
                                                   std::shared_ptr<ProcessGroup> group)
    : TensorParallelModule(std::move(group)), options(std::move(o)) {
  detail::check_divisible(*group_, options.out_features(), options.parts(),
                          "ColumnParallelLinear out_features");
  const int64_t local = options.out_features() / group_->size();
  const double bound = 1.0 / std::sqrt(static_cast<double>(options.in_features()));
  weight = register_parameter("weight",
                              torch::empty({local, options.in_features()}).uniform_(-bound, bound));
  if (options.bias())
    bias = register_parameter("bias", torch::empty({local}).uniform_(-bound, bound));
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(ColumnParallelLinearOptions o,
                                                   std::shared_ptr<ProcessGroup> group,
                                                   at::Tensor w, at::Tensor b)
    : TensorParallelModule(std::move(group)), options(std::move(o)) {
  detail::check_divisible(*group_, options.out_features(), options.parts(),
                          "ColumnParallelLinear out_features");
  const int64_t local = options.out_features() / group_->size();
  check_shape(*group_, w, {local, options.in_features()}, "ColumnParallelLinear weight shard");
  weight = register_parameter("weight", std::move(w));
  options.bias(b.defined());
  if (b.defined()) {
    check_shape(*group_, b, {local}, "ColumnParallelLinear bias shard");
    bias = register_parameter("bias", std::move(b));
  }
}

void ColumnParallelLinearImpl::load_dense(const at::Tensor& w, const at::Tensor& b) {
  check_shape(*group_, w, {options.out_features(), options.in_features()},
              "ColumnParallelLinear::load_dense weight");
  torch::NoGradGuard no_grad;
  weight.copy_(detail::shard_rows(w, group_->rank(), group_->size(), options.parts()));
  if (bias.defined()) {
    check_shape(*group_, b, {options.out_features()}, "ColumnParallelLinear::load_dense bias");
    bias.copy_(detail::shard_rows(b, group_->rank(), group_->size(), options.parts()));
  }
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  auto x = options.sequence_parallel() ? gather_from_sequence_region(input, group_)
                                       : copy_to_region(input, group_);
  auto y = with_adapters(input, at::linear(x, weight, bias));
  if (!options.gather_output() || group_->size() == 1) return y;
  y = gather_from_region(y, group_);
  if (options.parts() == 1) return y;
  // Gathered as [rank][part][block]; the dense layer's order is [part][rank][block].
  auto sizes = y.sizes().vec();
  auto blocked = sizes;
  blocked.back() = options.parts();
  blocked.insert(blocked.end() - 1, group_->size());
  blocked.push_back(options.out_features() / (options.parts() * group_->size()));
  const int64_t nd = static_cast<int64_t>(blocked.size());
  return y.view(blocked).transpose(nd - 3, nd - 2).reshape(sizes);
}

// --- RowParallelLinear ------------------------------------------------------------------------

RowParallelLinearImpl::RowParallelLinearImpl(RowParallelLinearOptions o,
                                             std::shared_ptr<ProcessGroup> group)
    : TensorParallelModule(std::move(group)), options(std::move(o)) {
  detail::check_divisible(*group_, options.in_features(), 1, "RowParallelLinear in_features");
  const double bound = 1.0 / std::sqrt(static_cast<double>(options.in_features()));
  weight = register_parameter(
      "weight", torch::empty({options.out_features(), options.in_features() / group_->size()})
                    .uniform_(-bound, bound));
  if (options.bias())
    bias = register_parameter("bias", torch::empty({options.out_features()}).uniform_(-bound, bound));
}

RowParallelLinearImpl::RowParallelLinearImpl(RowParallelLinearOptions o,
                                             std::shared_ptr<ProcessGroup> group, at::Tensor w,
                                             at::Tensor b)
    : TensorParallelModule(std::move(group)), options(std::move(o)) {
  detail::check_divisible(*group_, options.in_features(), 1, "RowParallelLinear in_features");
  check_shape(*group_, w, {options.out_features(), options.in_features() / group_->size()},
              "RowParallelLinear weight shard");
  weight = register_parameter("weight", std::move(w));
  options.bias(b.defined());
  if (b.defined()) {
    check_shape(*group_, b, {options.out_features()}, "RowParallelLinear bias");
    bias = register_parameter("bias", std::move(b));
  }
}

void RowParallelLinearImpl::load_dense(const at::Tensor& w, const at::Tensor& b) {
  check_shape(*group_, w, {options.out_features(), options.in_features()},
              "RowParallelLinear::load_dense weight");
  torch::NoGradGuard no_grad;
  weight.copy_(detail::shard_cols(w, group_->rank(), group_->size()));
  if (bias.defined()) {
    check_shape(*group_, b, {options.out_features()}, "RowParallelLinear::load_dense bias");
    bias.copy_(b);
  }
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  auto x = options.input_is_parallel() ? input : scatter_to_region(input, group_);
  if (options.sequence_parallel()) {
    // The bias of this rank's positions: its gradient, summed over them, is summed over the
    // group by copy_to_region, so every rank's (replicated) bias gets the dense gradient.
    auto y = reduce_scatter_to_sequence_region(at::linear(x, weight), group_);
    return bias.defined() ? y + copy_to_region(bias, group_) : y;
  }
  auto y = with_adapters(x, reduce_from_region(at::linear(x, weight), group_));
  return bias.defined() ? y + bias : y;
}

// --- VocabParallelEmbedding -------------------------------------------------------------------

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t num_embeddings,
                                                       int64_t embedding_dim,
                                                       std::shared_ptr<ProcessGroup> group)
    : TensorParallelModule(std::move(group)), num_embeddings_(num_embeddings) {
  detail::check_divisible(*group_, num_embeddings, 1, "VocabParallelEmbedding num_embeddings");
  const int64_t local = num_embeddings / group_->size();
  start_ = local * group_->rank();
  end_ = start_ + local;
  weight = register_parameter("weight", torch::randn({local, embedding_dim}));  // as Embedding
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t num_embeddings,
                                                       std::shared_ptr<ProcessGroup> group,
                                                       at::Tensor w)
    : TensorParallelModule(std::move(group)), num_embeddings_(num_embeddings) {
  detail::check_divisible(*group_, num_embeddings, 1, "VocabParallelEmbedding num_embeddings");
  const int64_t local = num_embeddings / group_->size();
  start_ = local * group_->rank();
  end_ = start_ + local;
  if (!w.defined() || w.dim() != 2 || w.size(0) != local)
    throw ::tandem::Refused(group_->prefix() + " VocabParallelEmbedding: expected a [" +
                                std::to_string(local) + ", dim] shard of the table, got " +
                                (w.defined() ? c10::str(w.sizes()) : std::string("none")));
  weight = register_parameter("weight", std::move(w));
}

void VocabParallelEmbeddingImpl::load_dense(const at::Tensor& w, const at::Tensor&) {
  check_shape(*group_, w, {num_embeddings_, weight.size(1)},
              "VocabParallelEmbedding::load_dense weight");
  torch::NoGradGuard no_grad;
  weight.copy_(detail::shard_rows(w, group_->rank(), group_->size(), 1));
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& input) {
  if (group_->size() == 1) return at::embedding(weight, input);
  auto outside = (input < start_).logical_or(input >= end_);
  auto local = (input - start_).masked_fill(outside, 0);
  auto e = at::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0.0);
  return reduce_from_region(e, group_);
}

}  // namespace tandem::parallel
