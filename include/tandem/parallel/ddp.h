// Data parallel: gradients reduced in buckets while backward runs, as PyTorch's c10d Reducer.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tandem/comm/process_group.h"
#include "tandem/parallel/comm_hook.h"

namespace torch::nn {
class Module;
}
namespace torch::autograd {
struct Node;
}

namespace tandem::parallel {

/// Options of GradientReducer.
///
/// Example:
///   auto reducer = std::make_unique<tandem::parallel::GradientReducer>(
///       model->named_parameters().pairs(), pg,
///       tandem::parallel::ReducerOptions().bucket_cap_mb(25).find_unused_parameters(true));
struct ReducerOptions {
  /// Size cap of every bucket but the first, in MiB (PyTorch: 25).
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Size cap of the first bucket, in MiB (PyTorch: 1), so that communication starts early.
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  /// Parameters that get no gradient in a backward still complete their bucket (as zeros);
  /// a parameter that no rank used keeps its .grad untouched.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// How each bucket is reduced (comm_hook.h); null: allreduce_hook().
  TORCH_ARG(std::shared_ptr<CommHook>, comm_hook) = nullptr;
  /// Gradients live in the buckets: after the first synchronised backward every .grad is a
  /// view into its bucket, so gradients are neither copied in nor out (PyTorch's
  /// gradient_as_bucket_view). Parameters whose bucket travels in another dtype (bf16 on Gloo)
  /// keep their own .grad. With find_unused_parameters, a parameter no rank used gets zeros.
  TORCH_ARG(bool, gradient_as_bucket_view) = false;

  // ---- for sharded strategies (parallel/zero.h) ----
  /// One key per entry of the named parameters given to the reducer: parameters with
  /// different keys never share a bucket (e.g. an optimizer's parameter groups). Empty: one key.
  TORCH_ARG(std::vector<int>, groups) = {};
  /// Each bucket's buffer is padded with zeros to a multiple of this many elements (the world
  /// size, so that a bucket splits into equal chunks, one per rank).
  TORCH_ARG(int64_t, bucket_multiple) = 1;
  /// false: the reduced buckets are not written back into .grad; the hook consumes them (a
  /// reduce-scatter into a gradient shard).
  TORCH_ARG(bool, write_back) = true;
  /// A gradient is dropped from .grad once it was copied into its bucket, a bucket's buffer
  /// exists only from its first gradient until its hook finished, and one bucket is in flight
  /// while the next fills: full gradients never accumulate (ZeRO-2). Needs write_back(false).
  TORCH_ARG(bool, release_gradients) = false;
  /// Explicit buckets, in launch order, as indices into the named parameters given (which must
  /// then all need gradients and be distinct, each in exactly one bucket). Empty: by size.
  TORCH_ARG(std::vector<std::vector<size_t>>, buckets) = {};
  /// Note [Hybrid sharding]: the ranks the gradients are averaged over when they are more than
  /// the reducer's group (its replicas too): each gradient is divided by this group's size and
  /// the unused-parameter map spans it; the hook reduces across the replicas itself. Null: the
  /// reducer's group.
  TORCH_ARG(std::shared_ptr<ProcessGroup>, average_over) = nullptr;
  /// Note [Expert parallel]: each gradient is divided by this many ranks instead of the
  /// averaging group's size, and summed over the reducer's group: an expert's gradients, which
  /// already sum what its ep group sent it, are summed over its replicas and divided by the whole
  /// data-parallel size. 0: the averaging group's size.
  TORCH_ARG(int, divide_by) = 0;
  /// Which model the parameters belong to, as refusals that list parameter names say it
  /// ("model 2 (Generator)"); empty: the names alone (one prepared model).
  TORCH_ARG(std::string, model_label) = "";
};

/// When each bucket's allreduce started and ended in the last synchronised backward, and when
/// backward itself ended (all on std::chrono::steady_clock).
struct ReductionTimeline {
  using TimePoint = std::chrono::steady_clock::time_point;
  std::vector<TimePoint> bucket_started;
  std::vector<TimePoint> bucket_finished;
  std::vector<int64_t> bucket_bytes;
  TimePoint backward_ended{};
};

/// Averages the gradients of a set of parameters across the ranks of a process group.
///
/// A post-hook on each parameter's gradient accumulator copies the fresh gradient into its
/// bucket's flat buffer; when every gradient of a bucket is in, an asynchronous allreduce of the
/// bucket starts while backward goes on (buckets are launched strictly in order, so every rank
/// issues the same sequence of collectives). At the end of backward (an autograd engine
/// callback) the reducer waits for the buckets and writes the averages back into `.grad`.
/// Parameters that share one tensor (tied weights) are reduced once.
class GradientReducer {
 public:
  GradientReducer(const std::vector<std::pair<std::string, at::Tensor>>& named_parameters,
                  std::shared_ptr<ProcessGroup> pg, ReducerOptions options = {});
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  /// false: backward leaves gradients local (accumulation micro-steps, no_sync).
  void set_sync(bool sync);
  bool sync() const { return sync_; }

  /// Completes the reduction of a backward whose hooks did not all fire (unused parameters,
  /// or no parameter at all). Called by Accelerator::backward after autograd returns; does
  /// nothing when the engine callback already finished the step.
  void after_backward();
  /// Note [Unused parameters known before backward]: with find_unused_parameters, the
  /// parameters the coming backward cannot reach (`reached` false: no path from the loss to
  /// them in its autograd graph) are ready now, with zeros, as PyTorch's DDP marks them in
  /// prepare_for_backward, so that every bucket launches in the backward's own order on every
  /// rank. Otherwise a bucket holding one (an expert no token of this rank chose) would wait for
  /// the end of backward here and not elsewhere, and a strategy that gathers during backward
  /// (ZeRO-3) would issue its collectives in another order than its peers: a hang. Called by
  /// Accelerator::backward; nothing to do outside a synchronised backward.
  void prepare_for_backward(const std::function<bool(const at::Tensor&)>& reached);
  /// Note [Unused parameters in a recompute]: the same for the parameters of a checkpointed
  /// region whose forward just ran again inside the backward: those of `region` that `reached`
  /// says the recomputed graph does not reach are ready now, with zeros (the region hid them
  /// from prepare_for_backward). Called from the recompute, before its nested backward.
  void prepare_region_for_backward(const std::vector<at::Tensor>& region,
                                   const std::function<bool(const at::Tensor&)>& reached);
  /// Note [Replaced parameter storage]: a parameter whose storage was replaced after the reducer
  /// was built (torch::load into the prepared model, set_data) has a new gradient accumulator;
  /// the hooks move to it. Returns the names of the parameters that moved. Called by
  /// Accelerator::backward.
  std::vector<std::string> follow_replaced_accumulators();
  /// Whether a backward that reaches none of these parameters on this rank is fine (nothing is
  /// reduced, nothing said), as PyTorch's DDP leaves a model its backward did not reach: the
  /// strategies allow it once a second model or optimizer is prepared (a GAN's discriminator
  /// loss leaves its generator alone). Otherwise such a backward is an error naming them.
  void allow_untouched_backward(bool allow) { untouched_ok_ = allow; }

  /// Buckets as indices into parameter_names(), in launch order.
  const std::vector<std::vector<size_t>>& buckets() const { return buckets_; }
  /// The distinct parameters, by their first name, in registration order.
  const std::vector<std::string>& parameter_names() const { return names_; }
  /// The timeline of the last synchronised backward.
  ReductionTimeline last_timeline() const;
  /// Number of synchronised backward passes completed.
  int64_t reductions() const { return reductions_; }
  /// The hook that reduces the buckets.
  const CommHook& comm_hook() const { return *hook_; }
  /// Whether parameter `index`'s .grad is (to be) a view into its bucket.
  bool gradient_is_bucket_view(size_t index) const { return view_[index] != 0; }
  /// The distinct parameters, in the order of parameter_names().
  const std::vector<at::Tensor>& parameters() const { return params_; }
  /// Where parameter `index` lies: its bucket and its offset there (elements).
  size_t bucket_of(size_t index) const { return bucket_of_[index]; }
  int64_t offset_in_bucket(size_t index) const { return offset_of_[index]; }
  /// Elements of bucket `b`'s buffer, padding included (a multiple of bucket_multiple).
  int64_t bucket_numel(size_t b) const { return bucket_numel_[b]; }
  /// The dtype bucket `b` travels in.
  at::ScalarType bucket_dtype(size_t b) const { return bucket_dtype_[b]; }

 private:
  struct Bucket;
  void on_gradient_ready(size_t index);
  void launch_ready_buckets();  // caller holds mu_
  void copy_into_bucket(at::Tensor& slot, const at::Tensor& grad);
  // Parameter i gets no gradient in this backward: ready now, with zeros (never completes its
  // bucket: the callers leave that to a reached parameter's hook or to the end of backward).
  void mark_unreached(size_t i);
  void ensure_buffer(Bucket& b);
  void finish_bucket(size_t b);  // waits for bucket b's hook, then writes back or releases
  void finalize();

  std::shared_ptr<ProcessGroup> pg_;
  ReducerOptions options_;
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  std::vector<std::vector<size_t>> buckets_;
  std::vector<std::unique_ptr<Bucket>> bucket_state_;
  std::vector<size_t> bucket_of_;   // param -> bucket
  std::vector<int64_t> offset_of_;  // param -> offset in its bucket (elements)
  std::vector<int64_t> bucket_numel_;  // bucket -> padded numel
  std::vector<at::ScalarType> bucket_dtype_;
  at::Tensor used_anywhere_;  // find_unused_parameters: per parameter, ranks that used it
  std::vector<char> ready_;
  std::vector<char> unreached_;  // Note [Unused parameters known before backward]
  std::vector<char> view_;  // param -> .grad is a view into its bucket
  std::shared_ptr<CommHook> hook_;
  std::shared_ptr<ProcessGroup> average_pg_;  // ReducerOptions::average_over, or pg_
  int divisor_ = 1;  // ReducerOptions::divide_by, or average_pg_'s size
  // Note [Division on the way in]: 1 / world size as a wrapped scalar (made once, not per
  // gradient); undefined when the hook divides itself or the world is one process.
  at::Tensor inv_world_;
  std::vector<std::string> twice_;
  size_t next_bucket_ = 0;
  size_t next_finish_ = 0;  // buckets before it are finished (release_gradients)
  bool callback_queued_ = false;
  bool finalized_since_check_ = false;  // finalize ran since the last after_backward()
  bool sync_ = true;
  bool untouched_ok_ = false;
  int64_t reductions_ = 0;
  ReductionTimeline timeline_;
  mutable std::mutex mu_;
};

/// Overwrites every rank's parameters and/or buffers with rank 0's (flattened by dtype, one
/// broadcast each). Tied parameters are sent once.
/// `only`, when given, picks the tensors to send (Note [Expert parallel]: the experts a rank
/// holds go over their replicas, every other tensor over dp).
void broadcast_module_state(torch::nn::Module& module, ProcessGroup& pg, bool parameters,
                            bool buffers,
                            const std::function<bool(const at::Tensor&)>& only = nullptr);

}  // namespace tandem::parallel
