// Pipeline: runs this rank's stage of a pipeline schedule over point-to-point messages, and
// splits a Sequential into stages.
#include "tandem/parallel/pipeline.h"
#include "tandem/error.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <utility>

#include "../compat/c10d.h"
#include "tandem/comm/process_group.h"
#include "tandem/parallel/expert_parallel.h"

namespace tandem::parallel {
namespace {

using Kind = PipelineAction::Kind;

// Tags: with S = p v stages, micro-batch j's activation from stage g to g + 1 travels with tag
// 2 (j S + g), the gradient back from g + 1 to g with 2 (j S + g) + 1; the one-off shape message
// of boundary g with kShapeTag + g.
int activation_tag(int j, int S, int g) { return 2 * (j * S + g); }
int gradient_tag(int j, int S, int g) { return 2 * (j * S + g) + 1; }
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
    : Pipeline(module, std::vector<std::shared_ptr<torch::nn::Module>>{module},
               std::vector<Forward>{std::move(forward)}, std::move(pp), std::move(loss), options,
               std::move(dp)) {}

Pipeline::Pipeline(std::shared_ptr<torch::nn::Module> module,
                   std::vector<std::shared_ptr<torch::nn::Module>> chunk_modules,
                   std::vector<Forward> chunks, std::shared_ptr<ProcessGroup> pp, Loss loss,
                   PipelineOptions options, std::shared_ptr<ProcessGroup> dp)
    : module_(std::move(module)),
      chunk_modules_(std::move(chunk_modules)),
      forwards_(std::move(chunks)),
      pp_(std::move(pp)),
      dp_(std::move(dp)),
      loss_(std::move(loss)),
      options_(options) {
  if (!pp_) throw ::tandem::Refused("Pipeline: no pipeline process group given");
  const std::string where = pp_->prefix() + " Pipeline (stage " + std::to_string(pp_->rank()) +
                            " of " + std::to_string(pp_->size()) + "): ";
  const int v = static_cast<int>(forwards_.size());
  if (!module_ || v == 0 || chunk_modules_.size() != forwards_.size())
    throw ::tandem::Refused(where + "no stage module or forward given (or not one module per "
                                    "forward)");
  for (int c = 0; c < v; ++c)
    if (!forwards_[c] || !chunk_modules_[c])
      throw ::tandem::Refused(where + "chunk " + std::to_string(c) + " has no module or forward");
  if (options_.virtual_stages() && *options_.virtual_stages() != v)
    throw ::tandem::Refused(where + "PipelineOptions().virtual_stages(" +
                            std::to_string(*options_.virtual_stages()) + ") with " +
                            std::to_string(v) + " stage forwards on this rank: give one forward "
                            "per virtual stage, or leave virtual_stages unset");
  // Note [Pipeline checkpoint names]: the names are the Accelerator's checkpoints'; a Pipeline
  // built here writes none (prepare_pipeline reads them and hands the rest of the options on).
  if (options_.checkpoint_names())
    throw ::tandem::Refused(where + "PipelineOptions().checkpoint_names is read by "
                                    "Accelerator::prepare_pipeline, whose checkpoints use them; a "
                                    "Pipeline built directly writes no checkpoint: build it with "
                                    "acc.prepare_pipeline, or leave checkpoint_names unset");
  kind_ = options_.schedule().value_or(v > 1 ? ScheduleKind::kInterleaved1F1B
                                             : ScheduleKind::k1F1B);
  if (is_last() && !loss_)
    throw ::tandem::Refused(where + "the last stage needs a loss function");
  try {
    actions_ = pipeline_schedule(kind_, pp_->size(), options_.microbatches(), v)
                   .at(static_cast<size_t>(pp_->rank()));
  } catch (const std::invalid_argument& e) {
    throw ::tandem::Refused(where + e.what());
  }
  recv_shape_.resize(static_cast<size_t>(v));
  send_shape_.resize(static_cast<size_t>(v));
  recv_dtype_.assign(static_cast<size_t>(v), -1);
  send_dtype_.assign(static_cast<size_t>(v), -1);
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

// Note [Input and weight gradients]: a zero-bubble schedule runs each micro-batch's backward in
// two parts. I: torch::autograd::backward of the stage's output (the loss on the last stage) with
// inputs = the stage's input alone, keeping the graph: the engine runs only the nodes on the way
// to the input, and each computes only the input-side gradients (a Linear's g W, not its g^T x).
// W, later: backward with inputs = the chunk's parameters (each once), which frees the graph.
// Both accumulate into .grad through the leaves' AccumulateGrad nodes, as backward() does: the
// same sums in micro-batch order (the same bits), the parameters' hooks run (a sequence-parallel
// norm's gradient sum over tp: LibTorch 1.13 runs no leaf hooks under torch::autograd::grad), a
// tensor two modules share gets its gradient once, and no .grad aliases another's. Nodes between the output and a parameter that are not on the input's way run
// once, in W; those on both ways (an activation's derivative) run in both. The first stage has
// no input gradient: its I does nothing and its W does the whole backward. A checkpointed
// region refuses backward with inputs= (its recompute would accumulate into every .grad), so a stage
// with one fails in its first I, naming the fix; prepare_pipeline refuses the pair up front.
double Pipeline::step(const at::Tensor& input, const at::Tensor& target) {
  const int r = stage(), p = stages(), m = options_.microbatches(), v = virtual_stages();
  const int S = p * v;
  std::vector<at::Tensor> inputs, targets;
  if (is_first()) {
    check_microbatches(input, "input");
    inputs = input.split(input.size(0) / m);
  }
  if (is_last()) {
    check_microbatches(target, "target");
    targets = target.split(target.size(0) / m);
  }
  // Per chunk and micro-batch: the received activation (a leaf whose .grad goes back), the
  // chunk's output (on the model's last stage the scaled loss), the gradient received for it.
  using Slots = std::vector<std::vector<at::Tensor>>;
  Slots in(v, std::vector<at::Tensor>(m)), out = in, grad = in;
  double loss_sum = 0;
  auto options = at::TensorOptions().dtype(at::kFloat);
  for (const auto& prm : module_->parameters()) {
    options = options.device(prm.device());
    break;
  }
  // The inputs of each chunk's weight-gradient passes, found at its first W of the step: each
  // tensor once (Module::parameters() lists a shared one per holder).
  std::vector<std::optional<std::vector<at::Tensor>>> weights_of(v);
  auto weight_inputs = [&](int c) -> const std::vector<at::Tensor>& {
    auto& w = weights_of[c];
    if (!w) {
      w.emplace();
      std::set<const c10::TensorImpl*> seen;
      for (const auto& prm : chunk_modules_[c]->parameters())
        if (prm.requires_grad() && seen.insert(prm.unsafeGetTensorImpl()).second)
          w->push_back(prm);
    }
    return *w;
  };
  const std::string mb = " of micro-batch ";
  using Clock = std::chrono::steady_clock;
  const auto step_start = Clock::now();
  double compute_s = 0;
  // Note [Sends in flight]: Gloo's send completes only once the peer has posted its receive
  // (a rendezvous), so a blocking send would idle this rank while the peer computes. Sends are
  // started and waited for at the end of the schedule (the tensors kept alive until then), as
  // PyTorch's pipelining does with isend; the schedule's order is deadlock-free with buffered
  // sends too (Note [Pipeline schedules]).
  std::vector<std::pair<Work, at::Tensor>> sends;  // each with the tensor it reads
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  auto describe_mb = [&](int j, int g) {
    return mb + std::to_string(j) + (v > 1 ? " (stage " + std::to_string(g) + ")" : "");
  };
  // Note [Receives posted ahead]: for the same reason, a receive posted only when the schedule
  // reaches it waits for the whole transfer, while one posted earlier lets the data move during
  // the computations before it. Once the first step taught every shape, the next kRecvWindow
  // receives of the list are posted ahead (into their buffers) and waited for where the list
  // has them: under Gloo each transfer matches by tag on its own, the waits keep the schedule's
  // order, so nothing new can wait in a cycle, and at most kRecvWindow buffers are held early.
  // Not on a GPU: NCCL runs a pair's sends and receives in the order they were posted, so a
  // receive posted ahead of this rank's own send would wait for the peer, which waits for that
  // send. (Sends in flight keep the list's order there, as blocking ones did.)
  constexpr size_t kRecvWindow = 2;
  bool shapes_known = options.device().is_cpu();
  for (int c = 0; c < v; ++c) {
    const int g = c * p + r;
    if ((g > 0 && recv_dtype_[c] < 0) || (g < S - 1 && send_dtype_[c] < 0)) shapes_known = false;
  }
  // Starts the receive of a kRecvActivation or kRecvGradient into a new buffer: an activation
  // as the previous stage announced it, a gradient as this chunk's output was sent (its send
  // precedes its gradient's receive in every list).
  auto start_recv = [&](const PipelineAction& b) {
    const int cb = b.chunk, gb = cb * p + r;
    const bool activation = b.kind == Kind::kRecvActivation;
    auto buf = at::empty(activation ? recv_shape_[cb] : send_shape_[cb],
                         options.dtype(static_cast<at::ScalarType>(
                             activation ? recv_dtype_[cb] : send_dtype_[cb])));
    auto w = activation ? pp_->recv_async({buf}, prev, activation_tag(b.microbatch, S, gb - 1),
                                          "recv of the activation" + describe_mb(b.microbatch, gb))
                        : pp_->recv_async({buf}, next, gradient_tag(b.microbatch, S, gb),
                                          "recv of the gradient" + describe_mb(b.microbatch, gb));
    return std::make_pair(std::move(w), buf);
  };
  std::map<size_t, std::pair<Work, at::Tensor>> posted;
  size_t next_post = 0;
  auto post_ahead = [&](size_t from) {
    if (!shapes_known) return;
    for (next_post = std::max(next_post, from);
         posted.size() < kRecvWindow && next_post < actions_.size(); ++next_post) {
      const auto kind = actions_[next_post].kind;
      if (kind == Kind::kRecvActivation || kind == Kind::kRecvGradient)
        posted.emplace(next_post, start_recv(actions_[next_post]));
    }
  };
  // Receives action i (a posted receive, or one started now) and returns its buffer.
  auto receive = [&](size_t i) {
    auto it = posted.find(i);
    auto transfer = it == posted.end() ? start_recv(actions_[i]) : std::move(it->second);
    if (it != posted.end()) posted.erase(it);
    transfer.first.wait();
    return transfer.second;
  };
  // The gradient a backward starts from: implicit (ones) for the loss, else the one received.
  auto seed = [&](int c, int j, int g) {
    return g == S - 1 ? std::vector<at::Tensor>{} : std::vector<at::Tensor>{grad[c][j]};
  };
  post_ahead(0);
  for (size_t i = 0; i < actions_.size(); ++i) {
    const auto& a = actions_[i];
    const int j = a.microbatch, c = a.chunk, g = c * p + r;
    const bool compute = a.kind == Kind::kForward || a.kind == Kind::kBackward ||
                         a.kind == Kind::kBackwardInput || a.kind == Kind::kBackwardWeight;
    const auto action_start = compute ? Clock::now() : Clock::time_point();
    const std::string which = describe_mb(j, g);
    switch (a.kind) {
      case Kind::kRecvActivation: {
        auto& shape = recv_shape_[c];
        if (recv_dtype_[c] < 0) {  // the first step (a 0-dim activation has an empty shape)
          auto meta = at::empty({2 + kMaxDims}, at::kLong);
          pp_->recv({meta}, prev, kShapeTag + g - 1, "recv of the activation shape");
          recv_dtype_[c] = meta[0].item<int64_t>();
          const int64_t dims = meta[1].item<int64_t>();
          for (int64_t d = 0; d < dims; ++d) shape.push_back(meta[2 + d].item<int64_t>());
        }
        auto buf = receive(i);
        in[c][j] = at::isFloatingType(buf.scalar_type()) ? buf.requires_grad_(true) : buf;
        break;
      }
      case Kind::kForward: {
        auto y = forwards_[c](g == 0 ? inputs[j] : in[c][j]);
        if (g == S - 1) {
          auto loss = loss_(y, targets[j]) / m;
          loss_sum += loss.detach().item<double>();
          out[c][j] = loss;
        } else {
          out[c][j] = y;
        }
        break;
      }
      case Kind::kSendActivation: {
        const auto& y = out[c][j];
        const auto dtype = static_cast<int64_t>(y.scalar_type());
        if (send_dtype_[c] < 0) {
          if (y.dim() > kMaxDims)
            throw ::tandem::Refused(pp_->prefix() + " Pipeline: stage " + std::to_string(g) +
                                        "'s output has " + std::to_string(y.dim()) +
                                        " dimensions; at most " + std::to_string(kMaxDims) +
                                        " travel between stages: reshape it");
          auto meta = at::full({2 + kMaxDims}, -1, at::kLong);
          meta[0] = dtype;
          meta[1] = y.dim();
          for (int64_t d = 0; d < y.dim(); ++d) meta[2 + d] = y.size(d);
          pp_->send({meta}, next, kShapeTag + g, "send of the activation shape");
          send_dtype_[c] = dtype;
          send_shape_[c] = y.sizes().vec();
        } else if (dtype != send_dtype_[c] || y.sizes().vec() != send_shape_[c]) {
          throw ::tandem::Refused(
              pp_->prefix() + " Pipeline::step: stage " + std::to_string(g) + "'s output" + which +
              " is " + describe(dtype, y.sizes().vec()) + ", but the first step's was " +
              describe(send_dtype_[c], send_shape_[c]) +
              ": the next stage receives into buffers of the first shape. Keep the batch size "
              "and sample shape fixed (pad or drop the last batch), or build a new Pipeline");
        }
        auto data = y.detach();
        sends.emplace_back(
            pp_->send_async({data}, next, activation_tag(j, S, g), "send of the activation" + which),
            data);
        break;
      }
      case Kind::kRecvGradient: {
        grad[c][j] = receive(i);
        break;
      }
      case Kind::kBackward: {
        if (out[c][j].requires_grad()) {
          if (g == S - 1)
            out[c][j].backward();
          else
            out[c][j].backward(grad[c][j]);
        }
        out[c][j] = at::Tensor();
        grad[c][j] = at::Tensor();
        break;
      }
      case Kind::kBackwardInput: {  // Note [Input and weight gradients]
        auto& x = in[c][j];
        if (g > 0 && x.defined() && x.requires_grad() && out[c][j].requires_grad())
          torch::autograd::backward({out[c][j]}, seed(c, j, g), /*retain_graph=*/true,
                                    /*create_graph=*/false, /*inputs=*/{x});
        break;
      }
      case Kind::kBackwardWeight: {
        const auto& params = weight_inputs(c);
        if (!params.empty() && out[c][j].requires_grad())
          torch::autograd::backward({out[c][j]}, seed(c, j, g), /*retain_graph=*/false,
                                    /*create_graph=*/false, /*inputs=*/params);
        out[c][j] = at::Tensor();
        grad[c][j] = at::Tensor();
        break;
      }
      case Kind::kSendGradient: {
        auto gx = in[c][j].grad();
        if (!gx.defined()) gx = at::zeros_like(in[c][j]);  // the stage ignored its input
        sends.emplace_back(
            pp_->send_async({gx}, prev, gradient_tag(j, S, g - 1), "send of the gradient" + which),
            gx);
        in[c][j] = at::Tensor();
        break;
      }
    }
    if (compute) compute_s += std::chrono::duration<double>(Clock::now() - action_start).count();
    post_ahead(i + 1);
    // Sends that completed release their tensors (the rest wait below).
    sends.erase(std::remove_if(sends.begin(), sends.end(),
                               [](const auto& s) { return s.first.completed(); }),
                sends.end());
  }
  for (auto& s : sends) s.first.wait();
  times_.schedule_s = std::chrono::duration<double>(Clock::now() - step_start).count();
  times_.compute_s = compute_s;
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
//
// Note [Expert parallel beside a pipeline]: the experts a stage holds under ep are reduced over
// their replicas only (the stage's data-parallel ranks with the same ep coordinate), their sum
// divided by the whole data-parallel size, as ExpertParallel says; the rest as above.
void Pipeline::reduce_gradients() {
  if (!dp_ || dp_->size() == 1) return;
  const auto held = held_experts(*module_);
  std::vector<at::Tensor> rest, experts;
  for (auto& p : module_->parameters()) (held.contains(p) ? experts : rest).push_back(p);
  reduce_gradients(rest, *dp_, 1.0, "pipeline gradient allreduce (data parallel)");
  if (held)
    reduce_gradients(experts, *held.ep->replicas(), held.ep->data_parallel_size(),
                     "pipeline expert gradient allreduce (expert replicas)");
}

void Pipeline::reduce_gradients(std::vector<at::Tensor>& params, ProcessGroup& group,
                                double divide_sum_by, const std::string& what) {
  auto used = at::zeros({static_cast<int64_t>(params.size())}, at::kInt);
  auto* flag = used.data_ptr<int32_t>();
  for (size_t i = 0; i < params.size(); ++i) flag[i] = params[i].grad().defined() ? 1 : 0;
  if (group.size() > 1) group.allreduce(used, ReduceOp::kSum);
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
    if (divide_sum_by == 1.0) {
      group.allreduce_async({wire}, ReduceOp::kMean, what).wait();
    } else {
      if (group.size() > 1) group.allreduce_async({wire}, ReduceOp::kSum, what).wait();
      wire.div_(divide_sum_by);
    }
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
