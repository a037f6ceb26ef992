// GradientReducer: bucketed gradient allreduce overlapped with backward (see ddp.h).
#include "tandem/parallel/ddp.h"
#include "../detail/names.h"
#include "tandem/error.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>

#include <map>
#include <set>
#include <sstream>
#include <unordered_set>

#include "../compat/autograd_hooks.h"
#include "../compat/c10d.h"
#include "detail/flat_alias.h"
#include "tandem/parallel/activation_checkpoint.h"
#include "tandem/parallel/buckets.h"

namespace tandem::parallel {
namespace {

// Buckets hold gradients in the dtype collectives can sum (compat::gloo_sum_dtype: fp32 for bf16
// on LibTorch 1.13's Gloo, whose fp32 sums are also more accurate); copy_ converts on the way in
// and out.
at::ScalarType wire_dtype(const at::Tensor& t) {
  return compat::gloo_sum_dtype(t.scalar_type(), t.device().type());
}


}  // namespace

struct GradientReducer::Bucket {
  GradBucket grad_bucket;  // the flat gradients (buffer) and parameter indices the hook sees
  size_t pending = 0;      // gradients not yet in
  Work work;
  bool launched = false;
  at::Tensor& flat() { return grad_bucket.buffer; }
  const std::vector<size_t>& members() const { return grad_bucket.parameter_indices; }
};

GradientReducer::GradientReducer(
    const std::vector<std::pair<std::string, at::Tensor>>& named_parameters,
    std::shared_ptr<ProcessGroup> pg, ReducerOptions options)
    : pg_(std::move(pg)), options_(options),
      hook_(options.comm_hook() ? options.comm_hook() : allreduce_hook()),
      average_pg_(options.average_over() ? options.average_over() : pg_),
      divisor_(options.divide_by() > 0 ? options.divide_by() : average_pg_->size()),
      inv_world_(hook_->reducer_divides() && divisor_ > 1
                     ? at::native::wrapped_scalar_tensor(1.0 / divisor_)
                     : at::Tensor()) {
  TANDEM_CHECK(options_.divide_by() == 0 || hook_->reducer_divides() ||
                   hook_->divides_by_bucket_divisor(),
               pg_->prefix(), " ReducerOptions::divide_by needs a hook that lets the reducer "
               "divide (the default allreduce) or divides by GradBucket::divisor (the compression "
               "hooks); ", hook_->name(), " does neither");
  TANDEM_CHECK(options_.groups().empty() || options_.groups().size() == named_parameters.size(),
              pg_->prefix(), " ReducerOptions::groups has ", options_.groups().size(),
              " keys for ", named_parameters.size(), " parameters");
  TANDEM_CHECK(!options_.release_gradients() ||
                  (!options_.write_back() && !options_.gradient_as_bucket_view()),
              pg_->prefix(), " ReducerOptions::release_gradients needs write_back(false) and no "
              "gradient_as_bucket_view");
  TANDEM_CHECK(options_.bucket_multiple() >= 1, pg_->prefix(),
              " ReducerOptions::bucket_multiple must be at least 1");
  // Distinct parameters that need gradients, in registration order (tied ones once).
  std::unordered_set<const void*> seen;
  std::vector<int> user_group;
  for (size_t k = 0; k < named_parameters.size(); ++k) {
    const auto& [name, p] = named_parameters[k];
    if (!p.requires_grad()) continue;
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    names_.push_back(name);
    params_.push_back(p);
    user_group.push_back(options_.groups().empty() ? 0 : options_.groups()[k]);
  }
  std::vector<BucketParam> sizes;
  std::map<std::tuple<int, int, int>, int> groups;  // (key, dtype, device) -> group
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    auto key = std::make_tuple(user_group[i], static_cast<int>(p.scalar_type()),
                               static_cast<int>(p.device().type()) * 1000 + p.device().index());
    auto it = groups.emplace(key, static_cast<int>(groups.size())).first;
    sizes.push_back({p.numel() * static_cast<int64_t>(p.element_size()), it->second});
  }
  const auto mib = [](double mb) { return static_cast<int64_t>(mb * 1024.0 * 1024.0); };
  if (options_.buckets().empty()) {
    buckets_ = assign_buckets(sizes, mib(options_.bucket_cap_mb()), mib(options_.first_bucket_cap_mb()));
  } else {
    TANDEM_CHECK(params_.size() == named_parameters.size(), pg_->prefix(),
                " ReducerOptions::buckets needs distinct parameters that all need gradients");
    std::vector<int> seen_in(params_.size(), 0);
    for (const auto& b : options_.buckets()) {
      TANDEM_CHECK(!b.empty(), pg_->prefix(), " ReducerOptions::buckets has an empty bucket");
      for (size_t i : b) {
        TANDEM_CHECK(i < params_.size() && seen_in[i]++ == 0, pg_->prefix(),
                    " ReducerOptions::buckets: parameter index ", i, " is out of range or repeated");
        TANDEM_CHECK(sizes[i].group == sizes[b.front()].group, pg_->prefix(),
                    " ReducerOptions::buckets: a bucket mixes groups, dtypes or devices");
      }
    }
    for (size_t i = 0; i < params_.size(); ++i)
      TANDEM_CHECK(seen_in[i] == 1, pg_->prefix(), " ReducerOptions::buckets misses parameter ",
                  names_[i]);
    buckets_ = options_.buckets();
  }
  bucket_of_.assign(params_.size(), 0);
  offset_of_.assign(params_.size(), 0);
  const int64_t multiple = options_.bucket_multiple();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    auto st = std::make_unique<Bucket>();
    st->grad_bucket.parameter_indices = buckets_[b];
    int64_t numel = 0;
    for (size_t i : st->members()) {
      bucket_of_[i] = b;
      offset_of_[i] = numel;
      numel += params_[i].numel();
    }
    // Padded to equal chunks, none of them empty (Gloo aborts on empty messages).
    if (multiple > 1) numel = std::max(multiple, (numel + multiple - 1) / multiple * multiple);
    const auto& first = params_[st->members().front()];
    bucket_numel_.push_back(numel);
    bucket_dtype_.push_back(wire_dtype(first));
    if (!options_.release_gradients())
      st->grad_bucket.buffer =
          at::zeros({numel}, first.options().dtype(wire_dtype(first)).requires_grad(false));
    st->pending = st->members().size();
    st->grad_bucket.index = b;
    st->grad_bucket.divisor = divisor_;
    st->grad_bucket.is_last = b + 1 == buckets_.size();
    bucket_state_.push_back(std::move(st));
  }
  ready_.assign(params_.size(), 0);
  view_.assign(params_.size(), 0);
  if (options_.gradient_as_bucket_view())
    for (size_t i = 0; i < params_.size(); ++i)
      view_[i] = bucket_dtype_[bucket_of_[i]] == params_[i].scalar_type();
  timeline_.bucket_started.resize(buckets_.size());
  timeline_.bucket_finished.resize(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b)
    timeline_.bucket_bytes.push_back(bucket_numel_[b] *
                                     static_cast<int64_t>(c10::elementSize(bucket_dtype_[b])));
  // Hooks on the gradient accumulators: they run after .grad was written.
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    TANDEM_CHECK(acc, pg_->prefix(), " parameter ", names_[i],
                " is not a leaf tensor: data parallel needs leaf parameters");
    hook_keys_.push_back(compat::add_post_hook(*acc, [this, i] { on_gradient_ready(i); }));
    accumulators_.push_back(std::move(acc));
  }
}

// Note [Replaced parameter storage]: LibTorch's torch::load(module, path) reads each parameter
// with Tensor::set_, which leaves the parameter the same tensor but gives it a new gradient
// accumulator: the hooks on the old one never run again, and every later backward would find
// every parameter without its gradient. Before each backward the hooks follow the accumulator.
std::vector<std::string> GradientReducer::follow_replaced_accumulators() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> moved;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto now = torch::autograd::impl::grad_accumulator(params_[i]);
    if (!now || now.get() == accumulators_[i].get()) continue;
    compat::remove_post_hook(*accumulators_[i], hook_keys_[i]);
    hook_keys_[i] = compat::add_post_hook(*now, [this, i] { on_gradient_ready(i); });
    accumulators_[i] = std::move(now);
    moved.push_back(names_[i]);
  }
  return moved;
}

GradientReducer::~GradientReducer() {
  for (size_t i = 0; i < accumulators_.size(); ++i)
    compat::remove_post_hook(*accumulators_[i], hook_keys_[i]);
  // Never leave a collective in flight behind us.
  for (auto& b : bucket_state_) {
    try {
      if (b->launched) b->work.wait();
    } catch (...) {
    }
  }
}

void GradientReducer::set_sync(bool sync) {
  std::lock_guard<std::mutex> lock(mu_);
  sync_ = sync;
}

void GradientReducer::on_gradient_ready(size_t i) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!sync_) return;
  if (!callback_queued_) {
    // Finish the reduction when the whole backward pass is done, even if the user called
    // loss.backward() directly (the outer backward's end: Note [Callbacks in a recompute]).
    callback_queued_ = true;
    queue_backward_callback([this] { finalize(); });
  }
  if (ready_[i]) {
    // Note [Unused parameters known before backward]: the loss's graph showed no path to it.
    twice_.push_back(i < unreached_.size() && unreached_[i]
                         ? names_[i] + " (which the loss's autograd graph did not reach before "
                                       "backward: a custom autograd function that uses it "
                                       "outside the graph; run without find_unused_parameters)"
                         : names_[i]);
    return;
  }
  ready_[i] = 1;
  Bucket& b = *bucket_state_[bucket_of_[i]];
  // Note [Two buckets at a time]: with release_gradients (ZeRO 2 and 3) a bucket's buffer is
  // made when its first gradient arrives; the reductions in flight finish first, so that one
  // bucket's buffer and one collective's (its alltoall receive buffer) are all there is, not a
  // third bucket filling beside them. The reduction overlapped the backward up to this gradient;
  // the memory a stage 2 or 3 saves is what it is for.
  if (options_.release_gradients() && !b.flat().defined() && !used_anywhere_.defined())
    while (next_finish_ < next_bucket_) finish_bucket(next_finish_++);
  ensure_buffer(b);
  auto& grad = params_[i].mutable_grad();
  if (view_[i]) {
    // Note [Gradients as bucket views]: after the first step autograd accumulates straight into
    // the bucket (zero_grad zeroes the views in place); a .grad that is not the view (the first
    // backward, or one set to none) is copied in once and replaced by the view.
    auto view = detail::flat_alias(b.flat(), offset_of_[i], params_[i].sizes());
    if (!grad.defined()) {
      view.zero_();
      grad = view;
    } else if (grad.data_ptr() != view.data_ptr()) {
      copy_into_bucket(view, grad);
      grad = view;
    } else if (inv_world_.defined()) {
      view.mul_(inv_world_);
    }
  } else {
    auto slot = b.flat().narrow(0, offset_of_[i], params_[i].numel());
    if (grad.defined())
      copy_into_bucket(slot, grad.reshape({-1}));
    else
      slot.zero_();
    if (options_.release_gradients()) grad.reset();  // the bucket holds it now
  }
  if (--b.pending == 0) launch_ready_buckets();
}

void GradientReducer::ensure_buffer(Bucket& b) {
  if (b.flat().defined()) return;
  const auto& first = params_[b.members().front()];
  b.grad_bucket.buffer = at::zeros({bucket_numel_[b.grad_bucket.index]},
                                   first.options().dtype(bucket_dtype_[b.grad_bucket.index])
                                       .requires_grad(false));
}

// Note [Division on the way in]: with the default hook the mean's division is fused into the
// copy that brings a gradient into its bucket (slot = grad * (1 / world size), c10d's
// copy_grad_to_bucket), and a gradient that already is the bucket's view is multiplied in place
// by the same reciprocal; the bucket is then summed. One pass over the gradients fewer than
// summing and dividing after, the arithmetic of PyTorch's DDP (so results agree bitwise for any
// world size), and the same bits with and without gradient_as_bucket_view (PyTorch divides
// views by the world size instead, which can differ in the last bit when it is not a power of 2).
void GradientReducer::copy_into_bucket(at::Tensor& slot, const at::Tensor& grad) {
  if (!inv_world_.defined()) {
    slot.copy_(grad);
  } else if (slot.scalar_type() == grad.scalar_type()) {
    at::mul_out(slot, grad, inv_world_);
  } else {
    // bf16 gradients in an fp32 bucket: divide in fp32, not in the gradient's dtype.
    slot.copy_(grad);
    slot.div_(static_cast<double>(divisor_));
  }
}

void GradientReducer::launch_ready_buckets() {
  while (next_bucket_ < bucket_state_.size() && bucket_state_[next_bucket_]->pending == 0) {
    Bucket& b = *bucket_state_[next_bucket_];
    timeline_.bucket_started[next_bucket_] = std::chrono::steady_clock::now();
    b.work = hook_->start(*pg_, b.grad_bucket);
    b.launched = true;
    ++next_bucket_;
    // release_gradients: one bucket in flight while the next fills, so that their buffers do not
    // add up to the full gradients (the next bucket's gradients still overlap the reduction).
    if (options_.release_gradients() && !used_anywhere_.defined())
      while (next_bucket_ - next_finish_ > 1) finish_bucket(next_finish_++);
  }
}

void GradientReducer::finish_bucket(size_t b) {
  Bucket& bs = *bucket_state_[b];
  bs.grad_bucket.all_unused = used_anywhere_.defined();
  if (used_anywhere_.defined())
    for (size_t i : bs.members())
      if (used_anywhere_[i].item<int>() != 0) bs.grad_bucket.all_unused = false;
  hook_->finish(bs.grad_bucket, bs.work);
  bs.work = Work();  // a finished collective keeps nothing alive (its buffers, a hook's scratch)
  timeline_.bucket_finished[b] = std::chrono::steady_clock::now();
  if (options_.write_back()) {
    for (size_t i : bs.members()) {
      if (used_anywhere_.defined() && used_anywhere_[i].item<int>() == 0) continue;
      auto slot = bs.flat().narrow(0, offset_of_[i], params_[i].numel()).view(params_[i].sizes());
      auto& g = params_[i].mutable_grad();
      if (view_[i] && g.defined() && g.data_ptr() == slot.data_ptr()) continue;  // in place
      if (view_[i]) {
        g = detail::flat_alias(bs.flat(), offset_of_[i], params_[i].sizes());
      } else if (g.defined()) {
        g.copy_(slot);
      } else {
        g = slot.to(params_[i].scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      }
    }
  }
  if (options_.release_gradients()) bs.grad_bucket.buffer = at::Tensor();
}

void GradientReducer::after_backward() {
  bool pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // No hook fired at all in this backward (and so no engine callback finished it).
    // With find_unused_parameters every rank completes the reduction (zeros for what it did
    // not reach), so that a rank whose branch skipped the model still joins the collectives.
    pending = sync_ && !callback_queued_ && !finalized_since_check_ &&
              (!untouched_ok_ || options_.find_unused_parameters());
    finalized_since_check_ = false;
  }
  if (pending) finalize();
}

void GradientReducer::prepare_for_backward(
    const std::function<bool(const at::Tensor&)>& reached) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!sync_ || !options_.find_unused_parameters() || callback_queued_) return;
  if (unreached_.size() != params_.size()) unreached_.assign(params_.size(), 0);
  // A bucket none of whose parameters the backward reaches waits for the end of backward as
  // before: only then does the unused map say whether some other rank used them (if none did,
  // the optimizer leaves them alone, as data parallel leaves an unused .grad).
  std::vector<char> reached_in_bucket(bucket_state_.size(), 0);
  std::vector<char> is_reached(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i)
    if (ready_[i] || reached(params_[i])) {
      is_reached[i] = 1;
      reached_in_bucket[bucket_of_[i]] = 1;
    }
  // Never to 0: a reached parameter's hook completes the bucket.
  for (size_t i = 0; i < params_.size(); ++i)
    if (!is_reached[i] && reached_in_bucket[bucket_of_[i]]) mark_unreached(i);
}

void GradientReducer::mark_unreached(size_t i) {
  ready_[i] = 1;
  unreached_[i] = 1;
  // A bucket made when its first gradient arrives starts as zeros (Note [Two buckets at a
  // time]); one made already gets this slot zeroed.
  Bucket& b = *bucket_state_[bucket_of_[i]];
  if (b.flat().defined()) b.flat().narrow(0, offset_of_[i], params_[i].numel()).zero_();
  --b.pending;
}

// Note [Unused parameters in a recompute]: a checkpointed region hides its parameters from the
// graph prepare_for_backward walks (its forward runs again inside the backward), so a rank
// whose tokens chose no expert of a checkpointed block learned that only at the end of backward,
// and its unit's reduction waited there while a peer's went at the block's end: under ZeRO-3,
// whose gathers run during backward, the ranks issued their collectives in different orders and
// hung. The recompute says which of its module's parameters its new graph reaches before its
// nested backward starts, and the others are ready now, on every rank at the same point.
void GradientReducer::prepare_region_for_backward(
    const std::vector<at::Tensor>& region, const std::function<bool(const at::Tensor&)>& reached) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!sync_ || !options_.find_unused_parameters()) return;
  if (unreached_.size() != params_.size()) unreached_.assign(params_.size(), 0);
  std::unordered_set<const void*> in_region;
  for (const auto& t : region) in_region.insert(t.unsafeGetTensorImpl());
  std::vector<size_t> unused;
  std::vector<size_t> per_bucket(bucket_state_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (ready_[i] || !in_region.count(params_[i].unsafeGetTensorImpl()) || reached(params_[i]))
      continue;
    unused.push_back(i);
    ++per_bucket[bucket_of_[i]];
  }
  for (size_t i : unused) {
    Bucket& b = *bucket_state_[bucket_of_[i]];
    // As prepare_for_backward: never to 0. A bucket none of whose parameters the region reaches
    // waits for the end of backward, where the unused map says whether any rank used them.
    if (per_bucket[bucket_of_[i]] >= b.pending) continue;
    if (!callback_queued_) {  // the backward's end finishes the reduction (on_gradient_ready's)
      callback_queued_ = true;
      queue_backward_callback([this] { finalize(); });
    }
    mark_unreached(i);
  }
}

void GradientReducer::finalize() {
  std::unique_lock<std::mutex> lock(mu_);
  timeline_.backward_ended = std::chrono::steady_clock::now();
  callback_queued_ = false;
  finalized_since_check_ = true;
  auto reset = [&] {
    for (auto& b : bucket_state_) {
      b->pending = b->members().size();
      b->launched = false;
      b->work = Work();
      if (options_.release_gradients()) b->grad_bucket.buffer = at::Tensor();
    }
    std::fill(ready_.begin(), ready_.end(), 0);
    std::fill(unreached_.begin(), unreached_.end(), 0);
    next_bucket_ = 0;
    next_finish_ = 0;
    used_anywhere_ = at::Tensor();
    twice_.clear();
  };
  auto wait_launched = [&] {
    for (auto& b : bucket_state_)
      if (b->launched) b->work.wait();
  };
  std::vector<size_t> unused;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!ready_[i]) unused.push_back(i);

  if (!twice_.empty()) {
    std::string names;
    for (const auto& n : twice_) names += (names.empty() ? "" : ", ") + n;
    wait_launched();
    reset();
    throw std::runtime_error(
        pg_->prefix() + " parameters" +
        (options_.model_label().empty() ? "" : " of " + options_.model_label()) +
        " got their gradient twice in one synchronised backward (" +
        names + "): call backward once per step, or wrap all but the last micro-step in "
        "accelerator.no_sync(model) / accelerator.accumulate(model)");
  }
  if (!unused.empty() && !options_.find_unused_parameters()) {
    std::vector<std::string> unused_names;
    for (size_t i : unused) unused_names.push_back(names_[i]);
    const std::string names = ::tandem::detail::first_names(unused_names, 20);
    // A parameter frozen after prepare (requires_grad false now) is not unused by the model:
    // the reducer was built with it; say so, and the fix that fits.
    std::vector<std::string> frozen_names;
    for (size_t i : unused)
      if (!params_[i].requires_grad()) frozen_names.push_back(names_[i]);
    const size_t frozen_count = frozen_names.size();
    const std::string frozen = ::tandem::detail::first_names(frozen_names, 20);
    wait_launched();
    reset();
    if (frozen_count > 0)
      throw ::tandem::Refused(
          pg_->prefix() + " these parameters" +
          (options_.model_label().empty() ? "" : " of " + options_.model_label()) +
          " were frozen (requires_grad false) after acc.prepare(model): " + frozen +
          ". Data parallel reduces the parameters that trained when the model was prepared, "
          "every step; freeze them before acc.prepare(model), or pass "
          "AcceleratorOptions().find_unused_parameters(true) to let them go without gradients");
    throw std::runtime_error(
        pg_->prefix() + " these parameters" +
        (options_.model_label().empty() ? "" : " of " + options_.model_label()) +
        " received no gradient in this backward: " + names +
        ". If parts of the model are unused in some steps, pass "
        "AcceleratorOptions().find_unused_parameters(true); otherwise make sure every parameter "
        "takes part in the loss (or set requires_grad(false) on the ones that should not train).");
  }
  // find_unused_parameters: complete the buckets with zeros, and learn which parameters no rank
  // used, so that their .grad stays as it was (as PyTorch's DDP does).
  if (options_.find_unused_parameters()) {
    auto used = at::zeros({static_cast<int64_t>(params_.size())}, at::kInt);
    for (size_t i = 0; i < params_.size(); ++i)
      used[i] = ready_[i] && !(i < unreached_.size() && unreached_[i]) ? 1 : 0;
    for (size_t i : unused) {
      ready_[i] = 1;
      Bucket& b = *bucket_state_[bucket_of_[i]];
      ensure_buffer(b);
      b.flat().narrow(0, offset_of_[i], params_[i].numel()).zero_();
      --b.pending;
    }
    used_anywhere_ = used;  // set first: no bucket is finished early from here on
    launch_ready_buckets();
    average_pg_->allreduce_async({used_anywhere_}, ReduceOp::kSum, "unused-parameter map allreduce")
        .wait();
  }
  // Wait for every bucket and write the averages back.
  try {
    for (size_t b = next_finish_; b < bucket_state_.size(); ++b) finish_bucket(b);
  } catch (...) {
    reset();
    throw;
  }
  ++reductions_;
  reset();
}

ReductionTimeline GradientReducer::last_timeline() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timeline_;
}

void broadcast_module_state(torch::nn::Module& module, ProcessGroup& pg, bool parameters,
                            bool buffers, const std::function<bool(const at::Tensor&)>& only) {
  if (pg.size() == 1) return;
  std::vector<at::Tensor> tensors;
  std::unordered_set<const void*> seen;
  // A tensor whose storage was released (a unit sharded while it was built, Note [Sharded
  // construction]) holds no values to send: its unit was broadcast before it was cut.
  auto add = [&](const at::Tensor& t) {
    if (t.defined() && !(t.numel() > 0 && t.storage().nbytes() == 0) && (!only || only(t)) &&
        seen.insert(t.unsafeGetTensorImpl()).second)
      tensors.push_back(t);
  };
  if (parameters)
    for (auto& p : module.parameters()) add(p);
  if (buffers)
    for (auto& b : module.buffers()) add(b);
  // Note [Buffers written around autograd]: after an optimizer step (parameters false) the
  // buffers are written through an alias of their memory with a version counter of its own, so
  // that a backward still pending over a saved buffer is not refused (a GAN's generator forward,
  // its discriminator's step, then the generator's backward: BatchNorm saves its running
  // statistics). PyTorch's DDP broadcasts before the next forward instead, where no backward is
  // pending; every forward here starts from the same values as there (rank 0's after its last
  // step), and a train-mode BatchNorm's backward does not read the running statistics it saved.
  // At prepare (parameters true) nothing is pending and the writes count as usual.
  auto writable = [parameters](const at::Tensor& t) -> at::Tensor {
    if (parameters || !t.is_contiguous()) return t.detach();
    return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options());
  };
  // Note [Bounded broadcasts]: small tensors travel together, in flat chunks of at most
  // kChunkBytes per (dtype, device), and a large contiguous tensor that Gloo carries as it is
  // travels in place. A flat copy of the whole model (what one broadcast per dtype needs) would
  // be a second model in every rank's resident memory at `prepare`.
  constexpr int64_t kChunkBytes = int64_t{16} << 20;
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> groups;
  for (auto& t : tensors) groups[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(t);
  at::NoGradGuard no_grad;
  auto send = [&pg, &writable](const std::vector<at::Tensor>& ts) {
    if (ts.empty()) return;
    std::vector<at::Tensor> flat_parts;
    for (auto& t : ts) flat_parts.push_back(t.detach().reshape({-1}));
    auto flat = at::cat(flat_parts);
    flat = flat.to(wire_dtype(flat));
    pg.broadcast(flat, 0);
    int64_t off = 0;
    for (auto& t : ts) {
      writable(t).copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  };
  for (auto& [key, ts] : groups) {
    std::vector<at::Tensor> chunk;
    int64_t chunk_bytes = 0;
    for (auto& t : ts) {
      const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
      if (bytes >= kChunkBytes / 4 && t.is_contiguous() && wire_dtype(t) == t.scalar_type()) {
        auto in_place = writable(t);
        pg.broadcast(in_place, 0);
        continue;
      }
      if (chunk_bytes + bytes > kChunkBytes) {
        send(chunk);
        chunk.clear();
        chunk_bytes = 0;
      }
      chunk.push_back(t);
      chunk_bytes += bytes;
    }
    send(chunk);
  }
}

}  // namespace tandem::parallel
