// Context parallel: every sequence of a batch split over the ranks of a "cp" mesh dimension,
// attention computed by passing keys and values around them (ring attention), so that no rank
// holds a whole sequence's activations (Note [Context parallel]).
//
// Example (what LlamaForCausalLM does under --cp_size, through ContextParallelModel):
//   auto cp = acc.context_parallel();               // the run's, owned by the Accelerator
//   auto local = cp->shard(ids, 1);                 // this rank's 2 chunks of every sequence
//   auto pos = cp->positions(ids.size(1), device);  // their positions, for RoPE
//   auto y = cp->attention(q, k, v, /*causal=*/true, std::nullopt);
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "tandem/parallel/cp_comm.h"

namespace tandem {
class ProcessGroup;
}

namespace tandem::parallel {

/// A context-parallel group and what runs over it: the load-balanced split of sequences (rank r
/// of n holds chunks r and 2n-1-r of 2n equal chunks, as torchtitan and Megatron split causal
/// sequences so that every rank does the same attention work), their positions, and attention
/// over the whole sequence from every rank's chunks.
class ContextParallel {
 public:
  explicit ContextParallel(std::shared_ptr<ProcessGroup> group,
                           ContextParallelComm comm = ContextParallelComm::kRing);
  int size() const { return size_; }
  int rank() const { return rank_; }
  ContextParallelComm comm() const { return comm_; }
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }

  /// This rank's part of `x` along `dim` (whose length must be a multiple of 2 size(); throws
  /// tandem::Refused naming the length and the fix otherwise): chunks rank and 2 size - 1 - rank,
  /// in that order. Differentiable (a narrow and a cat).
  at::Tensor shard(const at::Tensor& x, int64_t dim) const;
  /// The positions 0 .. length - 1 of the tokens shard() keeps, int64 [length / size()].
  at::Tensor positions(int64_t length, c10::Device device) const;
  /// The whole tensor along `dim` from every rank's shard() part, in sequence order. Its
  /// gradient to this rank is size() times its own part's (Note [Context parallel]: every cp rank
  /// computes the same function of the whole tensor, and the gradients are averaged over cp).
  at::Tensor unshard(const at::Tensor& local, int64_t dim) const;

  /// Scaled dot-product attention of this rank's queries over every rank's keys and values:
  /// q [B, H, L, D], k and v [B, KV, L, D] (H a multiple of KV: grouped-query attention), L
  /// this rank's shard() of the sequence, scaled by 1/sqrt(D). Under kUlysses the heads are
  /// swapped with the sequence instead (H, and KV or else the expanded heads, split over the
  /// ranks: refused with tandem::Refused when size() does not divide H). `causal`: a query
  /// attends to the positions up to its own; `window`: and to fewer than `window` positions back
  /// (Mistral's sliding window). Returns [B, H, L, D]; differentiable in q, k and v, with the
  /// backward passing the keys' and values' gradients around the group. Accumulates in float32.
  /// The graph refers to this object: it must outlive the backward (the Accelerator's and a
  /// model's shared_ptr keep it).
  at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                       std::optional<int64_t> window) const;

 private:
  at::Tensor ulysses_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               bool causal, std::optional<int64_t> window) const;
  std::shared_ptr<ProcessGroup> group_;
  ContextParallelComm comm_;
  int size_ = 1;
  int rank_ = 0;
};

/// A model that splits its sequences over a context-parallel group implements this
/// (tandem::models::LlamaForCausalLM does). Under cp_size above 1, Accelerator::prepare hands it
/// the run's ContextParallel; a model that does not implement it is refused there, since every
/// cp rank would otherwise compute the whole sequence.
class ContextParallelModel {
 public:
  virtual ~ContextParallelModel() = default;
  /// From now on the model takes whole sequences and computes its part of each over `cp`
  /// (nullptr: back to the whole sequence on this rank).
  virtual void set_context_parallel(std::shared_ptr<const ContextParallel> cp) = 0;
};

/// An attention layer that computes its part of each sequence over a cp group itself
/// (tandem::models::LlamaAttention does). A pipeline stage is a Sequential of a model's entries,
/// not the model: Accelerator::prepare_pipeline hands the run's ContextParallel to every such
/// layer of its stage, and the program feeds the pipeline this rank's chunks of each sequence
/// (ContextParallel::shard) and computes the loss of its chunks (Note [Context parallel beside a
/// pipeline]).
class ContextParallelLayer {
 public:
  virtual ~ContextParallelLayer() = default;
  /// From now on the layer takes this rank's chunks and attends over `cp`.
  virtual void set_layer_context_parallel(std::shared_ptr<const ContextParallel> cp) = 0;
};

}  // namespace tandem::parallel
