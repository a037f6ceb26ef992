// Expert parallel (expert_parallel.h): the ep group's differentiable all-to-all.
#include "tandem/parallel/expert_parallel.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>

#include <functional>
#include <string>

#include "tandem/comm/process_group.h"
#include "tandem/error.h"

namespace tandem::parallel {
namespace {

std::vector<int64_t> counts_of(const c10::IValue& v) { return v.toIntVector(); }

// Rows to the ranks of their experts; the gradient comes back the reverse way.
class AllToAll : public torch::autograd::Function<AllToAll> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& rows,
                            std::vector<int64_t> send, std::vector<int64_t> recv,
                            const ExpertParallel* ep) {
    auto out = ep->group()->all_to_all_v(rows, send, recv);
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    ctx->saved_data["shape"] = out.sizes().vec();
    ctx->saved_data["dtype"] = static_cast<int64_t>(out.scalar_type());
    ctx->saved_data["ep"] = reinterpret_cast<int64_t>(ep);
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* ep = reinterpret_cast<const ExpertParallel*>(ctx->saved_data["ep"].toInt());
    // Every rank sends its part of the gradient back, a zero one too: the peers wait for it.
    auto g = grads[0].defined()
                 ? grads[0]
                 : at::zeros(ctx->saved_data["shape"].toIntVector(),
                             static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt()));
    return {ep->group()->all_to_all_v(g, counts_of(ctx->saved_data["recv"]),
                                      counts_of(ctx->saved_data["send"])),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

ExpertParallel::ExpertParallel(std::shared_ptr<ProcessGroup> group,
                               std::shared_ptr<ProcessGroup> replicas, int data_parallel_size)
    : group_(std::move(group)), replicas_(std::move(replicas)),
      data_parallel_size_(data_parallel_size) {
  if (!group_) group_ = ProcessGroup::single();
  if (!replicas_) replicas_ = ProcessGroup::single();
  size_ = group_->size();
  rank_ = group_->rank();
}

std::pair<int64_t, int64_t> ExpertParallel::local_experts(int64_t experts) const {
  if (experts % size_ != 0)
    throw ::tandem::Refused(group_->prefix() + " expert parallel: ep_size " +
                            std::to_string(size_) + " does not divide the layer's " +
                            std::to_string(experts) + " experts; give an ep_size that divides " +
                            "the number of experts");
  const int64_t per = experts / size_;
  return {per * rank_, per};
}

int ExpertParallel::owner(int64_t expert, int64_t experts) const {
  return static_cast<int>(expert / (experts / size_));
}

at::Tensor ExpertParallel::all_to_all(const at::Tensor& rows, const std::vector<int64_t>& send_rows,
                                      std::vector<int64_t>* recv_rows) const {
  std::vector<int64_t> recv = send_rows;
  if (size_ > 1) {
    // The counts first (no gradient), then the rows with both sides known.
    const auto all = group_->allgather(at::tensor(send_rows, at::TensorOptions().dtype(at::kLong)));
    for (int r = 0; r < size_; ++r)
      recv[static_cast<size_t>(r)] = all[static_cast<size_t>(r)][rank_].item<int64_t>();
  }
  if (recv_rows) *recv_rows = recv;
  return all_to_all(rows, send_rows, recv);
}

at::Tensor ExpertParallel::all_to_all(const at::Tensor& rows, const std::vector<int64_t>& send_rows,
                                      const std::vector<int64_t>& recv_rows) const {
  if (size_ == 1) return rows;
  return AllToAll::apply(rows, send_rows, recv_rows, this);
}

HeldExperts held_experts(torch::nn::Module& model) {
  HeldExperts out;
  if (auto* moe = dynamic_cast<ExpertParallelModel*>(&model)) {
    auto ep = moe->expert_parallel();
    if (!ep || ep->size() <= 1) return out;
    out.ep = std::move(ep);
    for (const auto& p : moe->expert_parameters()) out.tensors.insert(p.unsafeGetTensorImpl());
    return out;
  }
  // A pipeline stage: the layers it holds (Note [Expert parallel beside a pipeline]), found
  // through children() (Module::modules() needs the module in a shared_ptr, which one being
  // built is not yet).
  std::function<void(torch::nn::Module&)> visit = [&](torch::nn::Module& m) {
    if (auto* layer = dynamic_cast<ExpertParallelLayer*>(&m)) {
      if (auto ep = layer->layer_expert_parallel(); ep && ep->size() > 1) {
        out.ep = std::move(ep);
        for (const auto& p : layer->held_expert_parameters())
          out.tensors.insert(p.unsafeGetTensorImpl());
      }
    }
    for (const auto& c : m.children()) visit(*c);
  };
  visit(model);
  return out;
}

HeldExperts held_experts(const std::vector<std::shared_ptr<torch::nn::Module>>& models) {
  HeldExperts out;
  for (const auto& m : models) {
    auto one = held_experts(*m);
    if (!one) continue;
    out.ep = one.ep;  // one per run (the Accelerator's)
    out.tensors.insert(one.tensors.begin(), one.tensors.end());
  }
  return out;
}

}  // namespace tandem::parallel
