// Expert parallel: the experts of every mixture-of-experts layer split over the ranks of an "ep"
// group carved from the data-parallel ranks, each token sent to the ranks of the experts it
// chose and its outputs sent back by all-to-all of variable sizes (dropless), Note [Expert
// parallel].
//
// Example (what LlamaSparseMoe does under --ep_size, through ExpertParallelModel):
//   auto ep = acc.expert_parallel();               // the run's, owned by the Accelerator
//   auto [first, count] = ep->local_experts(8);    // this rank's experts of 8
//   auto got = ep->all_to_all(rows, send_counts, &recv_counts);   // differentiable
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <set>
#include <utility>
#include <vector>

namespace tandem {
class ProcessGroup;
}
namespace torch::nn {
class Module;
}

namespace tandem::parallel {

/// An expert-parallel group and the groups its experts' gradients are reduced over.
///
/// Note [Expert parallel]: ep consecutive data-parallel ranks (of dp x cp under context
/// parallel, as torchtitan carves them: a token's chunk is routed from wherever it is) form an
/// ep group and hold the experts of each sparse layer in contiguous blocks (rank j of ep:
/// experts [j E/ep, (j+1) E/ep));
/// the data-parallel ranks with the same ep coordinate hold the same experts and form its
/// replica group. A rank routes its own tokens, sends each (token, expert) pair's hidden state to
/// the rank that holds the expert, runs its experts on what it received, and sends the outputs
/// back, where they are weighted and summed as without ep: the computation of one process,
/// spread. An expert's gradient on a rank sums what every rank of its ep group sent it, so the
/// data-parallel mean divides the sum over its replicas by the whole data-parallel size
/// (dp = ep x replicas; dp x cp with context parallel), not by the replicas alone. The router
/// and every other parameter stay replicated and are averaged over dp (x cp) as without ep.
class ExpertParallel {
 public:
  /// `group`: this rank's ep group; `replicas`: the ranks holding the same experts;
  /// `data_parallel_size`: what gradients are averaged over (ep x replicas).
  ExpertParallel(std::shared_ptr<ProcessGroup> group, std::shared_ptr<ProcessGroup> replicas,
                 int data_parallel_size);
  int size() const { return size_; }
  int rank() const { return rank_; }
  int data_parallel_size() const { return data_parallel_size_; }
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  const std::shared_ptr<ProcessGroup>& replicas() const { return replicas_; }

  /// The first of this rank's experts and how many, of a layer of `experts`. Throws
  /// tandem::Refused naming the numbers unless size() divides `experts`.
  std::pair<int64_t, int64_t> local_experts(int64_t experts) const;
  /// The ep rank that holds expert `expert` of a layer of `experts`.
  int owner(int64_t expert, int64_t experts) const;

  /// ProcessGroup::all_to_all_v over the ep group, differentiable: the gradient goes back by the
  /// reverse all-to-all. `recv_rows` (when given) gets the counts received from every ep rank.
  /// Every rank of the group calls it in the same order, and so its backward (a sparse layer
  /// runs on every rank, whatever its tokens chose).
  at::Tensor all_to_all(const at::Tensor& rows, const std::vector<int64_t>& send_rows,
                        std::vector<int64_t>* recv_rows = nullptr) const;
  /// The same with the counts known on both sides (the way back of a dispatch).
  at::Tensor all_to_all(const at::Tensor& rows, const std::vector<int64_t>& send_rows,
                        const std::vector<int64_t>& recv_rows) const;

 private:
  std::shared_ptr<ProcessGroup> group_, replicas_;
  int size_ = 1, rank_ = 0, data_parallel_size_ = 1;
};

/// A model whose mixture-of-experts layers split their experts over an ep group implements
/// this (tandem::models::LlamaForCausalLM does). Under ep_size above 1, Accelerator::prepare
/// hands it the run's ExpertParallel before the strategy sees its parameters; a model that does
/// not implement it is refused there.
class ExpertParallelModel {
 public:
  virtual ~ExpertParallelModel() = default;
  /// From now on every sparse layer keeps only this rank's experts (the others' parameters are
  /// dropped) and sends tokens to their ranks.
  virtual void set_expert_parallel(std::shared_ptr<const ExpertParallel> ep) = 0;
  /// The run's ExpertParallel (null before set_expert_parallel).
  virtual std::shared_ptr<const ExpertParallel> expert_parallel() const = 0;
  /// The parameters of the experts this rank holds: reduced over ExpertParallel::replicas(),
  /// counted over the ep group in the gradient norm, gathered over it when the model is saved.
  virtual std::vector<at::Tensor> expert_parameters() = 0;
};

/// A mixture-of-experts layer that splits its experts over an ep group itself
/// (tandem::models::LlamaSparseMoe does). A pipeline stage is a Sequential of a model's entries,
/// not the model: Accelerator::prepare_pipeline hands the run's ExpertParallel to every such
/// layer of its stage, and held_experts finds them there.
class ExpertParallelLayer {
 public:
  virtual ~ExpertParallelLayer() = default;
  /// From now on the layer keeps only this rank's experts and sends tokens to their ranks.
  virtual void keep_experts(std::shared_ptr<const ExpertParallel> ep) = 0;
  /// The ExpertParallel it was handed (null before keep_experts).
  virtual std::shared_ptr<const ExpertParallel> layer_expert_parallel() const = 0;
  /// The parameters of the experts it holds.
  virtual std::vector<at::Tensor> held_expert_parameters() = 0;
};

/// What the strategies, clipping and checkpoints ask of an expert-parallel model: the run's
/// ExpertParallel and the expert parameters this rank holds. Empty (false) when no model splits
/// its experts (none implements ExpertParallelModel nor holds an ExpertParallelLayer that was
/// handed one, or ep is 1).
struct HeldExperts {
  std::shared_ptr<const ExpertParallel> ep;
  std::set<const void*> tensors;  // TensorImpl of each held expert parameter
  explicit operator bool() const { return ep != nullptr; }
  bool contains(const at::Tensor& t) const { return tensors.count(t.unsafeGetTensorImpl()) > 0; }
};
HeldExperts held_experts(torch::nn::Module& model);
HeldExperts held_experts(const std::vector<std::shared_ptr<torch::nn::Module>>& models);

}  // namespace tandem::parallel
