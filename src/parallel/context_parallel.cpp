// Context parallel (context_parallel.h): the load-balanced split of sequences and ring attention.
#include "tandem/parallel/context_parallel.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "tandem/comm/process_group.h"
#include "tandem/error.h"

// Note [Context parallel]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A "cp" mesh dimension (between dp_shard and tp, torchtitan's order) splits every sequence of
// a batch over its ranks; the ranks of one cp group read the same samples (loaders shard over
// "dp", which leaves cp out) and hold the same parameters, so gradients are averaged and
// weights broadcast over dp x cp ("dp_cp") and ZeRO shards over dp_shard x cp ("dp_shard_cp"),
// as torchtitan flattens dp_shard_cp for FSDP. A run without cp has neither group (nor a "cp"
// dimension), so its mesh and the layout its checkpoints record are what they were.
//
// The split: a causal sequence of length T is cut into 2n chunks of T / (2n) and rank r holds
// chunks r and 2n - 1 - r, so every rank has as many (query, key) pairs under the causal mask
// as every other. Each rank keeps the global positions of its tokens (positions()) for RoPE and
// for the mask.
//
// Attention (ContextParallel::attention): the rank's queries against each rank's block of keys
// and values in turn, merged by the online softmax (flash attention's running maximum, here the
// running log-sum-exp per query): out = sum_j exp(lse_j - lse) out_j. Ring: the block moves to
// the next rank (send to r + 1, receive from r - 1) while the current one is computed, so
// after n steps every query has seen every key. Causal, an off-diagonal block is half masked,
// and only its other half is computed (part_of). Backward recomputes each block's probabilities
// from the saved lse (P = exp(S - lse)), with D = rowsum(dO * O): dV_j = P^T dO,
// dS = P (dO V_j^T - D), dQ += dS K_j / sqrt(d), dK_j = dS^T Q / sqrt(d); the gradients of a
// block travel around the ring with it and reach its owner after n steps. Allgather: every block gathered first, the
// blocks' key and value gradients summed to their owners by one reduce-scatter. Grouped-query
// heads travel unexpanded (the KV heads), expanded for each block's product and summed back.
//
// Ulysses (cp_comm_strategy: ulysses, DeepSpeed's): one all-to-all swaps the split, from this
// rank's chunks of every head to every token of H / n heads (head group j to rank j), the
// tokens put back in sequence order (rank j's chunks j and 2n-1-j from their positions); the
// attention of those heads over the whole sequence is then dense (float32, masked by position,
// autograd's own backward); a second all-to-all swaps the output back. The backward of each
// all-to-all is the other. The heads must divide: H by n, and KV by n (or the KV heads are
// expanded to H first, when n does not divide them). Each rank holds the whole sequence's
// scores for its heads (H / n of [T, T]) where the ring holds [T / n, T / n] blocks: Ulysses
// moves 4 activations' worth per layer once, the ring passes n - 1 key/value blocks.
//
// The loss (LlamaForCausalLM::loss under cp): the labels are shifted over the whole sequence
// before the split (position t predicts label t + 1, the last position none), so no pair crosses
// a chunk boundary; rank r's sum s_r of token losses is scaled to cp s_r / N (N the labelled
// tokens of the whole batch): averaged over cp by the gradient all-reduce, that is the whole
// batch's mean, transformers' loss. Its value is the whole batch's loss on every cp rank.
// A model's whole output (unshard, LlamaForCausalLM::forward) is gathered from every rank and
// its gradient to a rank is cp times its part: every cp rank computes the same loss of the
// whole output, and the average over cp divides by cp again.

namespace tandem::parallel {
namespace {

constexpr int kBlockTag = 1;     // keys and values moving around the ring
constexpr int kGradientTag = 2;  // their gradients, after them

// The global positions of rank j's tokens when the local length is `local` (two chunks).
at::Tensor positions_of(int j, int n, int64_t local, c10::Device device) {
  const int64_t c = local / 2;
  auto o = torch::TensorOptions().dtype(torch::kLong).device(device);
  return torch::cat({torch::arange(j * c, (j + 1) * c, o),
                     torch::arange((2 * n - 1 - j) * c, (2 * n - j) * c, o)});
}

// [L, S]: true where query i may not attend to key j.
at::Tensor masked_of(const at::Tensor& qpos, const at::Tensor& kpos, bool causal,
                     std::optional<int64_t> window) {
  auto back = qpos.unsqueeze(1) - kpos.unsqueeze(0);  // how far back key j lies from query i
  auto masked = torch::zeros(back.sizes(), back.options().dtype(torch::kBool));
  if (causal) masked = masked.logical_or(back < 0);
  if (window) masked = masked.logical_or(back >= *window);
  return masked;
}

// Grouped-query attention: the KV heads expanded to the query heads, and gradients summed back.
at::Tensor expand_heads(const at::Tensor& t, int64_t H) {
  const auto KV = t.size(1);
  if (KV == H) return t;
  return t.unsqueeze(2).expand({t.size(0), KV, H / KV, t.size(2), t.size(3)})
      .reshape({t.size(0), H, t.size(2), t.size(3)});
}
at::Tensor sum_heads(const at::Tensor& t, int64_t KV) {
  const auto H = t.size(1);
  if (KV == H) return t;
  return t.view({t.size(0), KV, H / KV, t.size(2), t.size(3)}).sum(2);
}

at::Tensor safe(const at::Tensor& lse) {  // -inf (a query that saw no key yet) as 0
  return torch::where(torch::isinf(lse), torch::zeros_like(lse), lse);
}

// The blocks of keys and values from every rank, in the order this rank computes them
// (rank r - s at step s), as a generator over steps: ring or all at once.
// Two ranks send to and receive from the same peer: NCCL runs a pair's operations on one stream
// in the order posted, so both posting their sends first would each wait for the other's
// receive once a block outgrows NCCL's buffers. The odd rank receives first (Gloo matches by
// tag and needs no order; more than two ranks send and receive over different pairs).
bool receives_first(int rank, int n) { return n == 2 && rank % 2 == 1; }

class Blocks {
 public:
  Blocks(const ContextParallel& cp, std::vector<at::Tensor> mine)
      : cp_(cp), n_(cp.size()), r_(cp.rank()) {
    if (cp.comm() == ContextParallelComm::kAllgather && n_ > 1) {
      for (const auto& t : mine) {
        auto parts = cp.group()->allgather(t);
        gathered_.push_back(std::move(parts));
      }
    }
    current_ = std::move(mine);
  }
  // The block of step s (start its successor's transfer first, on the ring).
  const std::vector<at::Tensor>& at_step(int s) {
    if (!gathered_.empty()) {
      current_.clear();
      const int src = ((r_ - s) % n_ + n_) % n_;
      for (auto& parts : gathered_) current_.push_back(parts[static_cast<size_t>(src)]);
      return current_;
    }
    if (s > 0) {  // the transfer started at step s - 1
      for (auto& w : works_) w.wait();
      works_.clear();
      current_ = std::move(next_);
    }
    if (s + 1 < n_) {  // send this block on while it is computed
      const int to = (r_ + 1) % n_, from = (r_ - 1 + n_) % n_;
      next_.clear();
      for (const auto& t : current_) next_.push_back(at::empty_like(t));
      auto send = [&] {
        works_.push_back(cp_.group()->send_async(current_, to, kBlockTag, "context parallel keys/values"));
      };
      auto recv = [&] {
        works_.push_back(cp_.group()->recv_async(next_, from, kBlockTag, "context parallel keys/values"));
      };
      if (receives_first(r_, n_)) {
        recv();
        send();
      } else {
        send();
        recv();
      }
    }
    return current_;
  }

 private:
  const ContextParallel& cp_;
  int n_, r_;
  std::vector<at::Tensor> current_, next_;
  std::vector<Work> works_;
  std::vector<std::vector<at::Tensor>> gathered_;
};

// The part of a block that the causal mask leaves: rank r's queries (chunks r and 2n-1-r)
// against rank src's keys (chunks src and 2n-1-src). From an earlier rank (src < r) every query
// sees the keys' first chunk and none of their second; from a later one only the queries'
// second chunk sees any key, and sees them all; from itself, both halves under the mask. So an
// off-diagonal block costs half a block's products, as Megatron's load-balanced ring computes it.
struct Part {
  int64_t q0, qn, k0, kn;
};
Part part_of(int r, int src, int64_t L, bool causal) {
  if (!causal || src == r) return {0, L, 0, L};
  if (src < r) return {0, L, 0, L / 2};
  return {L / 2, L / 2, 0, L};
}

// One step's scores: this rank's queries (float32, with their positions) against rank src's
// keys, narrowed to the part the mask leaves, scaled and masked; forward and backward alike.
struct Block {
  Part part;
  at::Tensor qs, kb, vb, scores;
};
Block block_of(const at::Tensor& qf, const at::Tensor& qpos, const std::vector<at::Tensor>& kv,
               int r, int src, int n, double scale, bool causal, std::optional<int64_t> window) {
  const auto H = qf.size(1), L = qf.size(2);
  Block b;
  b.part = part_of(r, src, L, causal);
  const auto& p = b.part;
  auto kpos = positions_of(src, n, L, qf.device()).narrow(0, p.k0, p.kn);
  b.kb = expand_heads(kv[0].narrow(2, p.k0, p.kn).to(torch::kFloat), H);
  b.vb = expand_heads(kv[1].narrow(2, p.k0, p.kn).to(torch::kFloat), H);
  b.qs = qf.narrow(2, p.q0, p.qn);
  b.scores = (torch::matmul(b.qs, b.kb.transpose(-2, -1)) * scale)
                 .masked_fill(masked_of(qpos.narrow(0, p.q0, p.qn), kpos, causal, window),
                              -std::numeric_limits<float>::infinity());
  return b;
}

std::optional<int64_t> window_of(int64_t window_or_none) {
  return window_or_none >= 0 ? std::optional<int64_t>(window_or_none) : std::nullopt;
}

class RingAttention : public torch::autograd::Function<RingAttention> {
 public:
  // `window` < 0: none. The ContextParallel outlives the graph (its model holds it).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const ContextParallel* group,
                            bool causal, int64_t window_or_none) {
    const auto& cp = *group;
    const auto window = window_of(window_or_none);
    const int n = cp.size(), r = cp.rank();
    const auto H = q.size(1), L = q.size(2), D = q.size(3);
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    auto qf = q.to(torch::kFloat);
    auto qpos = positions_of(r, n, L, q.device());
    auto out = torch::zeros(qf.sizes(), qf.options());
    auto lse = torch::full({q.size(0), H, L}, -std::numeric_limits<float>::infinity(), qf.options());
    Blocks blocks(cp, {k.contiguous(), v.contiguous()});
    for (int s = 0; s < n; ++s) {
      const auto& kv = blocks.at_step(s);
      const int src = ((r - s) % n + n) % n;
      const auto b = block_of(qf, qpos, kv, r, src, n, scale, causal, window);
      const auto& part = b.part;
      auto block_lse = torch::logsumexp(b.scores, -1);
      auto block_out = torch::matmul(torch::exp(b.scores - safe(block_lse).unsqueeze(-1)), b.vb);
      auto rows_lse = lse.narrow(2, part.q0, part.qn), rows_out = out.narrow(2, part.q0, part.qn);
      auto most = torch::maximum(rows_lse, block_lse);
      auto merged = safe(most) + torch::log(torch::exp(rows_lse - safe(most)) +
                                            torch::exp(block_lse - safe(most)));
      rows_out.copy_(rows_out * torch::exp(rows_lse - safe(merged)).unsqueeze(-1) +
                     block_out * torch::exp(block_lse - safe(merged)).unsqueeze(-1));
      rows_lse.copy_(merged);
    }
    ctx->saved_data["cp"] = reinterpret_cast<int64_t>(group);
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window"] = window_or_none;
    ctx->save_for_backward({q, k, v, out, lse});
    return out.to(q.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& cp = *reinterpret_cast<const ContextParallel*>(ctx->saved_data["cp"].toInt());
    const bool causal = ctx->saved_data["causal"].toBool();
    const auto window_or_none = ctx->saved_data["window"].toInt();
    const auto window = window_of(window_or_none);
    const int n = cp.size(), r = cp.rank();
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const auto KV = k.size(1), L = q.size(2), D = q.size(3);
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    auto qf = q.to(torch::kFloat);
    auto dout = grads[0].to(torch::kFloat);
    auto delta = (dout * out).sum(-1, true);  // [B, H, L, 1]
    auto qpos = positions_of(r, n, L, q.device());
    auto dq = torch::zeros(qf.sizes(), qf.options());
    const bool gathered = cp.comm() == ContextParallelComm::kAllgather && n > 1;
    Blocks blocks(cp, {k.contiguous(), v.contiguous()});
    // The gradients of the block in hand: on the ring they arrive with it (after it: the
    // previous rank computes them first); gathered, one pair per rank, summed at the end.
    auto fresh = [&] {
      return std::vector<at::Tensor>{torch::zeros(k.sizes(), qf.options()),
                                     torch::zeros(v.sizes(), qf.options())};
    };
    std::vector<at::Tensor> acc = fresh();
    std::vector<std::vector<at::Tensor>> per_rank(gathered ? static_cast<size_t>(n) : 0);
    const int to = (r + 1) % n, from = (r - 1 + n) % n;
    for (int s = 0; s < n; ++s) {
      const auto& kv = blocks.at_step(s);
      const int src = ((r - s) % n + n) % n;
      if (gathered) acc = fresh();
      {
        const auto b = block_of(qf, qpos, kv, r, src, n, scale, causal, window);
        const auto& part = b.part;
        auto douts = dout.narrow(2, part.q0, part.qn);
        auto p = torch::exp(b.scores - safe(lse.narrow(2, part.q0, part.qn)).unsqueeze(-1));
        auto dv = torch::matmul(p.transpose(-2, -1), douts);
        auto dp = torch::matmul(douts, b.vb.transpose(-2, -1));
        auto ds = p * (dp - delta.narrow(2, part.q0, part.qn));
        dq.narrow(2, part.q0, part.qn).add_(torch::matmul(ds, b.kb), scale);
        auto dk = torch::matmul(ds.transpose(-2, -1), b.qs) * scale;
        acc[0].narrow(2, part.k0, part.kn).add_(sum_heads(dk, KV));
        acc[1].narrow(2, part.k0, part.kn).add_(sum_heads(dv, KV));
      }
      if (gathered) {
        per_rank[static_cast<size_t>(src)] = acc;
      } else if (n > 1) {  // hand the gradients on with the block (the owner gets them at s = n - 1)
        std::vector<at::Tensor> next = fresh();
        if (receives_first(r, n)) {
          cp.group()->recv(next, from, kGradientTag, "context parallel gradients");
          cp.group()->send(acc, to, kGradientTag, "context parallel gradients");
        } else {
          auto sent = cp.group()->send_async(acc, to, kGradientTag, "context parallel gradients");
          cp.group()->recv(next, from, kGradientTag, "context parallel gradients");
          sent.wait();
        }
        acc = std::move(next);
      }
    }
    if (gathered) {  // every rank's share of each block's gradients, summed at its owner
      for (int f = 0; f < 2; ++f) {
        std::vector<at::Tensor> flat;
        for (auto& g : per_rank) flat.push_back(g[static_cast<size_t>(f)].reshape({-1}));
        auto input = torch::cat(flat);
        auto mine = torch::empty({cp.group()->shard_numel(input.numel())}, input.options());
        cp.group()->reduce_scatter(input, mine, ReduceOp::kSum);
        acc[static_cast<size_t>(f)] = mine.narrow(0, 0, k.numel()).view(k.sizes());
      }
    }
    return {dq.to(q.scalar_type()), acc[0].to(k.scalar_type()), acc[1].to(v.scalar_type()),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class Unshard : public torch::autograd::Function<Unshard> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& local,
                            int64_t dim, const ContextParallel* cp) {
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["cp"] = reinterpret_cast<int64_t>(cp);
    const int n = cp->size();
    auto parts = cp->group()->allgather(local.contiguous());
    const auto c = local.size(dim) / 2;
    std::vector<at::Tensor> chunks(static_cast<size_t>(2 * n));
    for (int j = 0; j < n; ++j) {
      chunks[static_cast<size_t>(j)] = parts[static_cast<size_t>(j)].narrow(dim, 0, c);
      chunks[static_cast<size_t>(2 * n - 1 - j)] = parts[static_cast<size_t>(j)].narrow(dim, c, c);
    }
    return torch::cat(chunks, dim);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto dim = ctx->saved_data["dim"].toInt();
    const auto* cp = reinterpret_cast<const ContextParallel*>(ctx->saved_data["cp"].toInt());
    return {cp->shard(grads[0], dim) * static_cast<double>(cp->size()), at::Tensor(),
            at::Tensor()};
  }
};

// Ulysses (Note [Context parallel]): [B, Hx, L, D], this rank's chunks of every head, to
// [B, Hx / n, T, D], every token of head group `rank` in sequence order; and back.
at::Tensor sequence_order(int n, int64_t L, c10::Device device) {  // rank-order index -> position
  std::vector<at::Tensor> parts;
  for (int j = 0; j < n; ++j) parts.push_back(positions_of(j, n, L, device));
  return torch::cat(parts);
}
at::Tensor to_heads(const at::Tensor& x, const ContextParallel& cp) {
  const int n = cp.size();
  const auto B = x.size(0), Hx = x.size(1), L = x.size(2), D = x.size(3);
  auto rows = x.reshape({B, n, Hx / n, L, D}).transpose(0, 1).contiguous().view({n, -1});
  const std::vector<int64_t> one(static_cast<size_t>(n), 1);
  auto got = cp.group()->all_to_all_v(rows, one, one);  // row j: rank j's chunks of my heads
  auto by_rank =
      got.view({n, B, Hx / n, L, D}).permute({1, 2, 0, 3, 4}).reshape({B, Hx / n, n * L, D});
  auto order = sequence_order(n, L, x.device());
  return torch::empty_like(by_rank).index_copy_(2, order, by_rank);
}
at::Tensor to_sequence(const at::Tensor& y, const ContextParallel& cp) {
  const int n = cp.size();
  const auto B = y.size(0), Hg = y.size(1), T = y.size(2), D = y.size(3), L = T / n;
  auto by_rank = y.index_select(2, sequence_order(n, L, y.device()));
  auto rows = by_rank.view({B, Hg, n, L, D}).permute({2, 0, 1, 3, 4}).contiguous().view({n, -1});
  const std::vector<int64_t> one(static_cast<size_t>(n), 1);
  auto got = cp.group()->all_to_all_v(rows, one, one);  // row j: my chunks of head group j
  return got.view({n, B, Hg, L, D}).transpose(0, 1).reshape({B, n * Hg, L, D});
}

// The swap as an autograd function: each direction's backward is the other (a permutation).
template <bool kToHeads>
class SwapSplit : public torch::autograd::Function<SwapSplit<kToHeads>> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const ContextParallel* cp) {
    ctx->saved_data["cp"] = reinterpret_cast<int64_t>(cp);
    return kToHeads ? to_heads(x, *cp) : to_sequence(x, *cp);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* cp = reinterpret_cast<const ContextParallel*>(ctx->saved_data["cp"].toInt());
    auto g = grads[0].contiguous();
    return {kToHeads ? to_sequence(g, *cp) : to_heads(g, *cp), at::Tensor()};
  }
};
using ToHeads = SwapSplit<true>;
using ToSequence = SwapSplit<false>;

}  // namespace

ContextParallel::ContextParallel(std::shared_ptr<ProcessGroup> group, ContextParallelComm comm)
    : group_(std::move(group)), comm_(comm) {
  if (!group_) group_ = ProcessGroup::single();
  size_ = group_->size();
  rank_ = group_->rank();
}

at::Tensor ContextParallel::shard(const at::Tensor& x, int64_t dim) const {
  if (dim < 0) dim += x.dim();
  TANDEM_CHECK(dim >= 0 && dim < x.dim(), "ContextParallel::shard: dimension ", dim,
               " of a tensor of ", x.dim(), " dimensions");
  if (size_ == 1) return x;
  const auto T = x.size(dim);
  if (T % (2 * size_) != 0)
    throw ::tandem::Refused(group_->prefix() + " context parallel: a sequence of " +
                            std::to_string(T) + " tokens cannot be split over cp_size " +
                            std::to_string(size_) + ": each rank holds 2 equal chunks, so the "
                            "length must be a multiple of 2 x cp_size = " +
                            std::to_string(2 * size_) + "; pad the sequences (labels -100) or "
                            "choose another --seq_len or --cp_size");
  const auto c = T / (2 * size_);
  return torch::cat({x.narrow(dim, rank_ * c, c), x.narrow(dim, (2 * size_ - 1 - rank_) * c, c)},
                    dim);
}

at::Tensor ContextParallel::positions(int64_t length, c10::Device device) const {
  if (size_ == 1)
    return torch::arange(length, torch::TensorOptions().dtype(torch::kLong).device(device));
  TANDEM_CHECK(length % (2 * size_) == 0, "ContextParallel::positions: length ", length,
               " is not a multiple of 2 x cp_size ", 2 * size_);
  return positions_of(rank_, size_, length / size_, device);
}

at::Tensor ContextParallel::unshard(const at::Tensor& local, int64_t dim) const {
  if (dim < 0) dim += local.dim();
  if (size_ == 1) return local;
  return Unshard::apply(local, dim, this);
}

at::Tensor ContextParallel::attention(const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, bool causal,
                                      std::optional<int64_t> window) const {
  TANDEM_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() &&
                   q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3) &&
                   k.size(1) > 0 && q.size(1) % k.size(1) == 0,
               "ContextParallel::attention: q [B, H, L, D] and k, v [B, KV, L, D] with H a "
               "multiple of KV expected, got ", q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  TANDEM_CHECK(q.size(2) % 2 == 0, "ContextParallel::attention: the local length ", q.size(2),
               " is not two chunks (shard() gives an even one)");
  if (comm_ == ContextParallelComm::kUlysses && size_ > 1)
    return ulysses_attention(q, k, v, causal, window);
  return RingAttention::apply(q, k, v, this, causal, window ? *window : int64_t{-1});
}

at::Tensor ContextParallel::ulysses_attention(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, bool causal,
                                              std::optional<int64_t> window) const {
  const auto H = q.size(1), KV = k.size(1), L = q.size(2), D = q.size(3);
  if (H % size_ != 0)
    throw ::tandem::Refused(group_->prefix() + " context parallel: cp_comm_strategy ulysses " +
                            "splits the attention heads over the cp ranks, and " +
                            std::to_string(H) + " heads do not divide by cp_size " +
                            std::to_string(size_) + "; choose a cp_size that divides them, or " +
                            "cp_comm_strategy alltoall (the ring) or allgather, which have no " +
                            "such rule");
  // Grouped-query heads travel unexpanded when the KV heads divide too (head group j of the
  // queries uses KV head group j); otherwise they are expanded to H first.
  const bool expand = KV % size_ != 0;
  auto kx = expand ? expand_heads(k, H) : k, vx = expand ? expand_heads(v, H) : v;
  auto qh = ToHeads::apply(q.contiguous(), this).to(torch::kFloat);
  auto kh = expand_heads(ToHeads::apply(kx.contiguous(), this).to(torch::kFloat), H / size_);
  auto vh = expand_heads(ToHeads::apply(vx.contiguous(), this).to(torch::kFloat), H / size_);
  const auto T = L * size_;
  auto pos = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(q.device()));
  auto scores = (torch::matmul(qh, kh.transpose(-2, -1)) / std::sqrt(static_cast<double>(D)))
                    .masked_fill(masked_of(pos, pos, causal, window),
                                 -std::numeric_limits<float>::infinity());
  auto out = torch::matmul(torch::softmax(scores, -1), vh);
  return ToSequence::apply(out.to(q.scalar_type()).contiguous(), this);
}

}  // namespace tandem::parallel
