// How context parallel moves keys and values (parallelism_config cp_comm_strategy): a name
// table the launcher checks without LibTorch (Note [A launcher without LibTorch]).
#pragma once

#include <string>

namespace tandem::parallel {

/// How the keys and values reach every rank of the cp group (Accelerate's cp_comm_strategy).
/// kRing: passed around the ring with send/recv, each block's attention computed while the
/// next block travels (PyTorch's "alltoall" rotation); kAllgather: gathered at once, then the
/// same block-wise attention (the gradients of the keys and values summed back by one
/// reduce-scatter); kUlysses: DeepSpeed's Ulysses, one all-to-all swapping the sequence split
/// for a split of the attention heads, dense attention of those heads over the whole sequence,
/// and one all-to-all back (the heads must divide by cp_size).
enum class ContextParallelComm { kRing, kAllgather, kUlysses };
/// "ring"/"alltoall" -> kRing, "allgather" -> kAllgather, "ulysses" -> kUlysses; anything else
/// throws tandem::Refused
/// naming `origin` and the names there are.
ContextParallelComm context_parallel_comm_from_name(const std::string& name,
                                                    const std::string& origin);
std::string to_string(ContextParallelComm comm);

}  // namespace tandem::parallel
