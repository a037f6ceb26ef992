// Pipeline: runs this rank's stage of a pipeline schedule over point-to-point messages, and
// splits a Sequential into stages.
#include "tandem/parallel/pipeline.h"
#include "tandem/error.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <utility>

#include "../compat/c10d.h"
#include "tandem/comm/process_group.h"

namespace tandem::parallel {
namespace {

using Kind = PipelineAction::Kind;

// Tags: micro-batch j's activation travels with tag 2j, its gradient with 2j + 1; the one-off
// shape message with its own tag.
int activation_tag(int j) { return 2 * j; }
int gradient_tag(int j) { return 2 * j + 1; }
constexpr int kShapeTag = 1 << 30;
// The shape message: dtype, number of dimensions, the dimensions (padded with -1).
constexpr int64_t kMaxDims = 8;

std::string describe(int64_t dtype, const std::vector<int64_t>& shape) {
  std::string s = std::string(c10::toString(static_cast<at::ScalarType>(dtype))) + " [";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

Pipeline::Pipeline(torch::nn::Sequential stage, std::shared_ptr<ProcessGroup> pp, Loss loss,
                   PipelineOptions options, std::shared_ptr<ProcessGroup> dp)
    : Pipeline(stage.ptr(), [stage](const at::Tensor& x) mutable { return stage->forward(x); },
               std::move(pp), std::move(loss), options, std::move(dp)) {}

Pipeline::Pipeline(std::shared_ptr<torch::nn::Module> module, Forward forward,
                   std::shared_ptr<ProcessGroup> pp, Loss loss, PipelineOptions options,
                   std::shared_ptr<ProcessGroup> dp)
    : module_(std::move(module)),
      forward_(std::move(forward)),
      pp_(std::move(pp)),
      dp_(std::move(dp)),
      loss_(std::move(loss)),
      options_(options) {
  if (!pp_) throw ::tandem::Refused("Pipeline: no pipeline process group given");
  const std::string where = pp_->prefix() + " Pipeline (stage " + std::to_string(pp_->rank()) +
                            " of " + std::to_string(pp_->size()) + "): ";
  if (!module_ || !forward_) throw ::tandem::Refused(where + "no stage module or forward given");
  if (is_last() && !loss_)
    throw ::tandem::Refused(where + "the last stage needs a loss function");
  try {
    actions_ = pipeline_schedule(options_.schedule(), pp_->size(), options_.microbatches())
                   .at(static_cast<size_t>(pp_->rank()));
  } catch (const std::invalid_argument& e) {
    throw ::tandem::Refused(where + e.what());
  }
}

int Pipeline::stage() const { return pp_->rank(); }
int Pipeline::stages() const { return pp_->size(); }

void Pipeline::check_microbatches(const at::Tensor& t, const char* what) const {
  const int m = options_.microbatches();
  if (!t.defined() || t.dim() == 0)
    throw ::tandem::Refused(pp_->prefix() + " Pipeline::step: stage " +
                                std::to_string(stage()) + " needs the " + what +
                                " (a batch along dim 0), found " +
                                (t.defined() ? "a 0-dim tensor" : "an undefined tensor"));
  if (t.size(0) % m != 0)
    throw ::tandem::Refused(
        pp_->prefix() + " Pipeline::step: the " + what + "'s batch of " +
        std::to_string(t.size(0)) + " rows does not split into " + std::to_string(m) +
        " micro-batches of equal size: use a batch size that " + std::to_string(m) +
        " micro-batches divide, or another number of micro-batches");
}

double Pipeline::step(const at::Tensor& input, const at::Tensor& target) {
  const int s = stage(), p = stages(), m = options_.microbatches();
  std::vector<at::Tensor> inputs, targets;
  if (is_first()) {
    check_microbatches(input, "input");
    inputs = input.split(input.size(0) / m);
  }
  if (is_last()) {
    check_microbatches(target, "target");
    targets = target.split(target.size(0) / m);
  }
  // Per micro-batch: the received activation (a leaf whose .grad goes back), the stage's output
  // (on the last stage the scaled loss), the gradient received for that output.
  std::vector<at::Tensor> in(m), out(m), grad(m);
  double loss_sum = 0;
  auto options = at::TensorOptions().dtype(at::kFloat);
  for (const auto& prm : module_->parameters()) {
    options = options.device(prm.device());
    break;
  }
  const std::string mb = " of micro-batch ";
  for (const auto& a : actions_) {
    const int j = a.microbatch;
    switch (a.kind) {
      case Kind::kRecvActivation: {
        if (recv_shape_.empty()) {
          auto meta = at::empty({2 + kMaxDims}, at::kLong);
          pp_->recv({meta}, s - 1, kShapeTag, "recv of the activation shape");
          recv_dtype_ = meta[0].item<int64_t>();
          const int64_t dims = meta[1].item<int64_t>();
          for (int64_t d = 0; d < dims; ++d) recv_shape_.push_back(meta[2 + d].item<int64_t>());
        }
        auto buf = at::empty(recv_shape_, options.dtype(static_cast<at::ScalarType>(recv_dtype_)));
        pp_->recv({buf}, s - 1, activation_tag(j), "recv of the activation" + mb + std::to_string(j));
        in[j] = at::isFloatingType(buf.scalar_type()) ? buf.requires_grad_(true) : buf;
        break;
      }
      case Kind::kForward: {
        auto y = forward_(s == 0 ? inputs[j] : in[j]);
        if (is_last()) {
          auto loss = loss_(y, targets[j]) / m;
          loss_sum += loss.detach().item<double>();
          out[j] = loss;
        } else {
          out[j] = y;
        }
        break;
      }
      case Kind::kSendActivation: {
        const auto& y = out[j];
        const auto dtype = static_cast<int64_t>(y.scalar_type());
        if (send_dtype_ < 0) {
          if (y.dim() > kMaxDims)
            throw ::tandem::Refused(pp_->prefix() + " Pipeline: stage " + std::to_string(s) +
                                        "'s output has " + std::to_string(y.dim()) +
                                        " dimensions; at most " + std::to_string(kMaxDims) +
                                        " travel between stages: reshape it");
          auto meta = at::full({2 + kMaxDims}, -1, at::kLong);
          meta[0] = dtype;
          meta[1] = y.dim();
          for (int64_t d = 0; d < y.dim(); ++d) meta[2 + d] = y.size(d);
          pp_->send({meta}, s + 1, kShapeTag, "send of the activation shape");
          send_dtype_ = dtype;
          send_shape_ = y.sizes().vec();
        } else if (dtype != send_dtype_ || y.sizes().vec() != send_shape_) {
          throw ::tandem::Refused(
              pp_->prefix() + " Pipeline::step: stage " + std::to_string(s) + "'s output" + mb +
              std::to_string(j) + " is " + describe(dtype, y.sizes().vec()) +
              ", but the first step's was " + describe(send_dtype_, send_shape_) +
              ": the next stage receives into buffers of the first shape. Keep the batch size "
              "and sample shape fixed (pad or drop the last batch), or build a new Pipeline");
        }
        pp_->send({y.detach()}, s + 1, activation_tag(j), "send of the activation" + mb + std::to_string(j));
        break;
      }
      case Kind::kRecvGradient: {
        grad[j] = at::empty(out[j].sizes(), out[j].options());
        pp_->recv({grad[j]}, s + 1, gradient_tag(j), "recv of the gradient" + mb + std::to_string(j));
        break;
      }
      case Kind::kBackward: {
        if (out[j].requires_grad()) {
          if (is_last())
            out[j].backward();
          else
            out[j].backward(grad[j]);
        }
        out[j] = at::Tensor();
        grad[j] = at::Tensor();
        break;
      }
      case Kind::kSendGradient: {
        auto g = in[j].grad();
        if (!g.defined()) g = at::zeros_like(in[j]);  // the stage ignored its input
        pp_->send({g}, s - 1, gradient_tag(j), "send of the gradient" + mb + std::to_string(j));
        in[j] = at::Tensor();
        break;
      }
    }
  }
  reduce_gradients();
  // The mean loss, from the last stage to every stage, then averaged over the replicas.
  auto loss = at::full({1}, is_last() ? loss_sum : 0.0, at::kDouble);
  pp_->broadcast(loss, p - 1);
  if (dp_ && dp_->size() > 1) dp_->allreduce(loss, ReduceOp::kMean);
  return loss.item<double>();
}

// Note [Pipeline gradient sync]: the data-parallel replicas of a stage average its gradients
// once per step, after the last backward of the schedule: one flat allreduce per dtype and
// device, never one per micro-batch. A parameter some replicas used and others did not (an
// expert no token of a replica's batch chose) has no gradient on those: it counts as zeros
// there, as under DistributedDataParallel with find_unused_parameters; one no replica used keeps
// no gradient. Which is which, one small allreduce of a flag per parameter says first.
void Pipeline::reduce_gradients() {
  if (!dp_ || dp_->size() == 1) return;
  auto params = module_->parameters();
  auto used = at::zeros({static_cast<int64_t>(params.size())}, at::kInt);
  auto* flag = used.data_ptr<int32_t>();
  for (size_t i = 0; i < params.size(); ++i) flag[i] = params[i].grad().defined() ? 1 : 0;
  dp_->allreduce(used, ReduceOp::kSum);
  flag = used.data_ptr<int32_t>();
  for (size_t i = 0; i < params.size(); ++i)
    if (flag[i] > 0 && !params[i].grad().defined())
      params[i].mutable_grad() = at::zeros_like(params[i]);
  std::map<std::pair<at::ScalarType, std::string>, std::vector<at::Tensor>> groups;
  for (auto& prm : params) {
    auto g = prm.mutable_grad();
    if (g.defined()) groups[{g.scalar_type(), g.device().str()}].push_back(g);
  }
  for (auto& [key, grads] : groups) {
    std::vector<at::Tensor> flat;
    for (auto& g : grads) flat.push_back(g.reshape({-1}));
    auto wire = at::cat(flat).to(compat::gloo_sum_dtype(key.first, grads[0].device().type()));
    dp_->allreduce_async({wire}, ReduceOp::kMean, "pipeline gradient allreduce (data parallel)").wait();
    int64_t at = 0;
    for (auto& g : grads) {
      g.copy_(wire.narrow(0, at, g.numel()).view(g.sizes()));
      at += g.numel();
    }
  }
}

torch::nn::Sequential split_sequential(const torch::nn::Sequential& model, int stages, int stage) {
  const int64_t n = static_cast<int64_t>(model->size());
  if (stages < 1 || stages > n)
    throw ::tandem::Refused("split_sequential: cannot split " + std::to_string(n) +
                                " children into " + std::to_string(stages) +
                                " stages: every stage needs at least one child (use 1 to " +
                                std::to_string(n) + " stages)");
  std::vector<int64_t> first;
  for (int s = 0; s < stages; ++s) first.push_back(s * n / stages);
  return split_sequential(model, first, stage);
}

torch::nn::Sequential split_sequential(const torch::nn::Sequential& model,
                                       const std::vector<int64_t>& first_child, int stage) {
  const int64_t n = static_cast<int64_t>(model->size());
  const int stages = static_cast<int>(first_child.size());
  bool ok = stages > 0 && first_child[0] == 0 && first_child.back() < n;
  for (int s = 1; s < stages && ok; ++s) ok = first_child[s] > first_child[s - 1];
  if (!ok) {
    std::string got;
    for (auto f : first_child) got += (got.empty() ? "" : ", ") + std::to_string(f);
    throw ::tandem::Refused("split_sequential: stage boundaries {" + got + "} for " +
                                std::to_string(n) + " children: expected each stage's first "
                                "child, starting at 0, strictly ascending, below " +
                                std::to_string(n));
  }
  if (stage < 0 || stage >= stages)
    throw ::tandem::Refused("split_sequential: stage " + std::to_string(stage) + " of " +
                                std::to_string(stages) + ": expected 0 to " +
                                std::to_string(stages - 1));
  const int64_t begin = first_child[stage], end = stage + 1 < stages ? first_child[stage + 1] : n;
  const auto names = model->named_children();
  torch::nn::Sequential out;
  for (int64_t i = begin; i < end; ++i)
    out->push_back(names[static_cast<size_t>(i)].key(), *(model->begin() + i));
  return out;
}

}  // namespace tandem::parallel
