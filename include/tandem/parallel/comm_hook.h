// Communication hooks: how one gradient bucket is reduced across ranks, as PyTorch's DDP
// register_comm_hook / GradBucket. The reducer fixes the bucketing and the order of launches;
// the hook decides what travels (full precision, fp16, bf16) and how.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "tandem/comm/process_group.h"

namespace tandem::parallel {

/// One bucket handed to a hook: its gradients flattened into `buffer` (contiguous, in the
/// reducer's wire dtype: fp32 for bf16 parameters on Gloo, the parameters' dtype otherwise).
/// After finish() the buffer must hold the average over the ranks.
struct GradBucket {
  size_t index = 0;                        ///< launch order, the same on every rank
  at::Tensor buffer;                       ///< flat gradients in, averages out
  std::vector<size_t> parameter_indices;  ///< into GradientReducer::parameter_names()
  bool is_last = false;
  /// find_unused_parameters: no rank used any parameter of this bucket in this backward (its
  /// buffer holds zeros); a hook that consumes buckets may leave their gradients alone.
  bool all_unused = false;
  /// What the mean divides the sum over the ranks by: the group's size, except where the reducer
  /// averages over another count (ReducerOptions::divide_by: an expert's gradients summed over
  /// its replicas and divided by the data-parallel size, Note [Expert parallel]).
  int64_t divisor = 1;
};

/// A bucket reduction. start() issues the collective(s) and returns at once (backward goes on);
/// finish() waits for them and leaves the average in bucket.buffer. Every rank calls start() for
/// the same buckets in the same order, and only from the thread that runs backward.
///
/// Example (what allreduce_hook does):
///   struct MyHook : tandem::parallel::CommHook {
///     tandem::Work start(tandem::ProcessGroup& pg, tandem::parallel::GradBucket& b) override {
///       return pg.allreduce_async({b.buffer}, tandem::ReduceOp::kMean, "my allreduce");
///     }
///     void finish(tandem::parallel::GradBucket&, tandem::Work& w) override { w.wait(); }
///     std::string name() const override { return "mine"; }
///   };
class CommHook {
 public:
  virtual ~CommHook() = default;
  virtual Work start(ProcessGroup& pg, GradBucket& bucket) = 0;
  virtual void finish(GradBucket& bucket, Work& work) = 0;
  virtual std::string name() const = 0;
  /// true: the reducer divides each gradient by the world size as it enters the bucket (fused
  /// with the copy, as c10d's reducer does for its default hook), so start() receives the
  /// gradients already divided and finish() leaves their sum. false: the bucket holds the
  /// gradients as they are and the hook divides itself.
  virtual bool reducer_divides() const { return false; }
  /// true: a hook that divides itself divides by bucket.divisor (the compression hooks do), so
  /// that a reducer with ReducerOptions::divide_by can use it. false (the default): it is refused
  /// there, since it would divide by the group's size.
  virtual bool divides_by_bucket_divisor() const { return false; }
};

/// The default, as PyTorch's DDP: each gradient is divided by the world size as the reducer
/// copies it into the bucket (reducer_divides()), and the bucket is summed across ranks.
std::shared_ptr<CommHook> allreduce_hook();

/// Gradient compression (PyTorch's fp16_compress_hook / bf16_compress_hook): each rank's
/// gradients are divided by the world size (the bucket's divisor) and rounded to fp16 (bf16),
/// summed across ranks in that dtype, and written back into the fp32 bucket. Half the bytes of an fp32 allreduce, and
/// the result equals the allreduce of the rounded gradients. Where the backend cannot sum the
/// dtype (Gloo has no bf16 sum before LibTorch 2.1), the rounded values are summed as fp32:
/// the same rounding of each rank's contribution, without the bandwidth saving
/// (compress_hook_wire_dtype says which).
std::shared_ptr<CommHook> fp16_compress_hook();
std::shared_ptr<CommHook> bf16_compress_hook();

/// The dtype a compression hook of `dtype` (kHalf or kBFloat16) sends for tensors on `device`
/// in this build: `dtype` itself, or kFloat where the backend cannot reduce it.
at::ScalarType compress_hook_wire_dtype(at::ScalarType dtype, c10::DeviceType device);

/// The hook named "none"/"allreduce", "fp16" or "bf16" (AcceleratorOptions::comm_hook, config
/// key ddp_comm_hook). Throws std::invalid_argument naming the accepted names.
std::shared_ptr<CommHook> comm_hook_from_name(const std::string& name);

}  // namespace tandem::parallel
