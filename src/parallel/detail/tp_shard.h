// Tensor parallel internals shared by its two source files: the process group inside autograd
// contexts, and how a dense tensor is cut into this rank's shard.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <memory>
#include <string>

namespace tandem {
class ProcessGroup;
}

namespace tandem::parallel::detail {

/// A ProcessGroup as an IValue (a capsule that keeps it alive), for ctx->saved_data.
c10::IValue wrap_group(std::shared_ptr<ProcessGroup> group);
std::shared_ptr<ProcessGroup> unwrap_group(const c10::IValue& value);

/// Throws std::invalid_argument unless `size` splits evenly over the group in `parts` blocks.
void check_divisible(const ProcessGroup& group, int64_t size, int64_t parts, const std::string& what);

/// Rank `rank` of `n`'s rows of `dense`, seen as `parts` blocks of rows split one by one (a copy).
at::Tensor shard_rows(const at::Tensor& dense, int rank, int n, int64_t parts);
/// Rank `rank` of `n`'s columns (dimension 1) of `dense` (a copy).
at::Tensor shard_cols(const at::Tensor& dense, int rank, int n);

}  // namespace tandem::parallel::detail
