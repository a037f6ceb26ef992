// The example GPT of the tests: its configuration (2 blocks of width 32 over a context of 16,
// small enough for 4 processes on 2 cores), and the part of each dense tensor a tp rank holds
// under the GPT's plans.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../../examples/common/gpt.h"

namespace tandem::testing {

/// What differs between the tests' GPTs. The defaults are the model-parallel tests' (every split
/// even at tp 2: 4 heads, 4 * width 128, vocabulary 64); a GPT trained on bytes of text
/// (examples::ByteWindows) needs the vocabulary of 256.
///
/// Example:
///   auto bytes = small_gpt(SmallGptOptions().vocab(256).heads(2));
class SmallGptOptions {
 public:
  SmallGptOptions& vocab(int64_t v) {
    vocab_ = v;
    return *this;
  }
  int64_t vocab() const { return vocab_; }
  SmallGptOptions& heads(int64_t v) {
    heads_ = v;
    return *this;
  }
  int64_t heads() const { return heads_; }

 private:
  int64_t vocab_ = 64;
  int64_t heads_ = 4;
};

inline examples::GPTConfig small_gpt(const SmallGptOptions& options = {}) {
  examples::GPTConfig c;
  c.vocab = options.vocab();
  c.context = 16;
  c.layers = 2;
  c.heads = options.heads();
  c.width = 32;
  return c;
}

/// Rank r of n's part of `t` along `dim`, split block by block when `t` fuses `parts` blocks
/// (q, k, v).
inline at::Tensor shard(const at::Tensor& t, int64_t dim, int r, int n, int64_t parts = 1) {
  std::vector<at::Tensor> pieces;
  for (auto& p : t.chunk(parts, dim)) pieces.push_back(p.chunk(n, dim)[static_cast<size_t>(r)]);
  return at::cat(pieces, dim);
}

/// Rank r of n's part of the dense parameter `name` under the GPT's tensor-parallel plans
/// (gpt_tensor_parallel_plan, gpt_sequential_tensor_parallel_plan), by the name alone: the
/// expectation the tests hold the split to.
inline at::Tensor gpt_shard(const std::string& name, const at::Tensor& t, int r, int n) {
  auto ends = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (ends("attn.qkv.weight") || ends("attn.qkv.bias")) return shard(t, 0, r, n, 3);
  if (ends("attn.proj.weight") || ends("fc_proj.weight")) return shard(t, 1, r, n);
  if (ends(".fc.weight") || ends(".fc.bias") || ends("wte.weight") || name == "head.weight" ||
      ends(".out.weight"))
    return shard(t, 0, r, n);
  return t;  // replicated: LayerNorms, position embedding, row-parallel biases
}

}  // namespace tandem::testing
