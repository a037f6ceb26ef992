// Collectives for user code: gather, gather_object, broadcast_object, reduce, broadcast,
// pad_across_processes, wait_for_everyone. Each takes a fast path on a group of one process.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "tandem/comm/process_group.h"

namespace tandem::comm {

/// Every rank's tensor concatenated on dim 0, in rank order, on every rank. Sizes along dim 0
/// may differ between ranks; the other dims and the dtype must agree.
at::Tensor gather(ProcessGroup& pg, const at::Tensor& tensor);

/// Every rank's byte string, in rank order, on every rank.
std::vector<std::string> gather_object(ProcessGroup& pg, const std::string& bytes);

/// Rank `root`'s byte string, on every rank (`bytes` is ignored elsewhere).
std::string broadcast_object(ProcessGroup& pg, const std::string& bytes, int root = 0);

/// The reduction (sum, mean, max, min) of `tensor` over ranks, as a new tensor on every rank.
at::Tensor reduce(ProcessGroup& pg, const at::Tensor& tensor, ReduceOp op = ReduceOp::kMean);

/// Overwrites `tensor` with rank `root`'s (same shape and dtype everywhere).
void broadcast(ProcessGroup& pg, at::Tensor& tensor, int root = 0);

/// Pads `tensor` along `dim` with `pad_value` to the largest size of that dim across ranks, at
/// the end (or at the start with pad_first), so that tensors of uneven sizes can be gathered.
at::Tensor pad_across_processes(ProcessGroup& pg, const at::Tensor& tensor, int64_t dim = 0,
                                double pad_value = 0.0, bool pad_first = false);

/// Returns when every rank has reached it (a barrier that fails instead of hanging).
void wait_for_everyone(ProcessGroup& pg);

}  // namespace tandem::comm
