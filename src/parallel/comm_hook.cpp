// The communication hooks of the gradient reducer (see comm_hook.h).
#include "tandem/parallel/comm_hook.h"
#include "tandem/error.h"

#include <ATen/ATen.h>

#include <map>
#include <stdexcept>

#include "../compat/c10d.h"

namespace tandem::parallel {
namespace {

class AllreduceHook : public CommHook {
 public:
  Work start(ProcessGroup& pg, GradBucket& b) override {
    return pg.allreduce_async({b.buffer}, ReduceOp::kSum,
                              "gradient allreduce (bucket " + std::to_string(b.index) + ")");
  }
  void finish(GradBucket&, Work& work) override { work.wait(); }
  std::string name() const override { return "allreduce"; }
  bool reducer_divides() const override { return true; }
};

// Note [Compression hooks]: as PyTorch's fp16/bf16_compress_hook, each rank divides by the world
// size before rounding (so that the sum cannot overflow fp16 where the mean would not), the sum
// runs in the compressed dtype, and the result is copied back up into the fp32 bucket. The
// compressed buffers are kept per bucket: no allocation per step.
class CompressHook : public CommHook {
 public:
  explicit CompressHook(at::ScalarType dtype) : dtype_(dtype) {}
  Work start(ProcessGroup& pg, GradBucket& b) override {
    const auto wire = compress_hook_wire_dtype(dtype_, b.buffer.device().type());
    at::Tensor& c = compressed_[&b];
    if (!c.defined() || c.numel() != b.buffer.numel() || c.scalar_type() != wire ||
        c.device() != b.buffer.device())
      c = at::empty({b.buffer.numel()}, b.buffer.options().dtype(wire));
    // Rounds to dtype_: by the copy itself when dtype_ travels, else explicitly before the
    // fp32 copy (the backend cannot sum dtype_: each contribution rounded, the sum fp32).
    auto scaled = b.buffer.div(static_cast<double>(b.divisor));
    c.copy_(wire == dtype_ ? scaled : scaled.to(dtype_));
    return pg.allreduce_async({c}, ReduceOp::kSum,
                              name() + " gradient allreduce (bucket " + std::to_string(b.index) + ")");
  }
  void finish(GradBucket& b, Work& work) override {
    work.wait();
    b.buffer.copy_(compressed_.at(&b));
  }
  std::string name() const override { return dtype_ == at::kHalf ? "fp16" : "bf16"; }
  bool divides_by_bucket_divisor() const override { return true; }

 private:
  at::ScalarType dtype_;
  // By bucket, not by bucket index: one hook serves every reducer of a run (each model's, and
  // the experts' beside the rest's, whose buckets are in flight together).
  std::map<const GradBucket*, at::Tensor> compressed_;
};

}  // namespace

std::shared_ptr<CommHook> allreduce_hook() { return std::make_shared<AllreduceHook>(); }
std::shared_ptr<CommHook> fp16_compress_hook() { return std::make_shared<CompressHook>(at::kHalf); }
std::shared_ptr<CommHook> bf16_compress_hook() {
  return std::make_shared<CompressHook>(at::kBFloat16);
}

at::ScalarType compress_hook_wire_dtype(at::ScalarType dtype, c10::DeviceType device) {
  return compat::gloo_sum_dtype(dtype, device);
}

std::shared_ptr<CommHook> comm_hook_from_name(const std::string& name) {
  if (name.empty() || name == "none" || name == "no" || name == "allreduce")
    return allreduce_hook();
  if (name == "fp16") return fp16_compress_hook();
  if (name == "bf16") return bf16_compress_hook();
  throw ::tandem::Refused("communication hook '" + name +
                              "' is unknown; expected none, fp16 or bf16");
}

}  // namespace tandem::parallel
