// ProcessGroup: the c10d process group of a job (Gloo for CPU tensors, NCCL for CUDA tensors),
// its rendezvous through a TCPStore hosted by rank 0, and subgroups over lists of ranks.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/state.h"

namespace tandem {

/// Reduction applied by reduce / allreduce. kMean is a sum divided by the group size.
enum class ReduceOp { kSum, kMean, kMax, kMin };

/// Options of ProcessGroup::create.
///
/// Example:
///   auto pg = tandem::ProcessGroup::create(state,
///       tandem::ProcessGroupOptions().timeout(std::chrono::seconds(20)));
struct ProcessGroupOptions {
  /// How long the rendezvous and each collective may wait for the other ranks.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
  /// "auto" (Gloo, plus NCCL when CUDA tensors are used and LibTorch has NCCL), "gloo", "nccl".
  TORCH_ARG(std::string, backend) = "auto";
  /// Gloo worker threads (c10d's default is 2).
  TORCH_ARG(int, gloo_threads) = 2;
};

class ProcessGroup;

/// An asynchronous collective (or point-to-point transfer) in flight. wait() rethrows a failure
/// with the operation's name.
class Work {
 public:
  struct Impl;
  Work() = default;
  explicit Work(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  /// Blocks until the operation completed; throws std::runtime_error on failure.
  void wait();
  /// True when there is nothing (left) to wait for.
  bool completed() const;

 private:
  friend class ProcessGroup;
  std::shared_ptr<Impl> impl_;
};

/// The ranks of a job (or of a subgroup of it), able to run collectives together.
/// A group of size 1 needs no network and takes a fast path in every collective.
/// Elements per rank when `numel` elements are split into `world` equal, padded chunks: at
/// least 1, so that no rank's chunk is empty (the rule of reduce_scatter and of ZeRO shards).
int64_t padded_chunk_numel(int64_t numel, int world);

class ProcessGroup {
 public:
  struct Impl;

  /// Joins the job described by `state`: rank 0 hosts a TCPStore at master_addr:master_port,
  /// every rank connects, waits for all world_size ranks, then builds the Gloo group (and NCCL
  /// when asked). World size 1 returns a group that needs no network.
  static std::shared_ptr<ProcessGroup> create(const ProcessState& state,
                                              const ProcessGroupOptions& options = {});
  /// A group with this process alone.
  static std::shared_ptr<ProcessGroup> single();

  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const;
  int size() const;
  /// The global rank of this group's rank `group_rank`.
  int global_rank(int group_rank) const;
  /// "[rank r/w]" in the global numbering, for error messages.
  std::string prefix() const;
  std::chrono::milliseconds timeout() const;

  /// A new group over `ranks` (global ranks, ascending, no duplicates). Every rank of this
  /// group must call it, in the same order; ranks not in the list get nullptr.
  std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks);

  /// In-place allreduce of tensors of one device type, asynchronous. kMean divides after the
  /// sum when the work is waited on.
  Work allreduce_async(std::vector<at::Tensor> tensors, ReduceOp op, std::string what = "allreduce");
  void allreduce(at::Tensor& tensor, ReduceOp op);
  /// In-place broadcast from group rank `root`.
  void broadcast(at::Tensor& tensor, int root = 0);
  /// Every rank's tensor (same shape and dtype on every rank), in rank order.
  std::vector<at::Tensor> allgather(const at::Tensor& tensor);
  /// Returns when every rank of the group has reached it.
  void barrier();

  /// Point-to-point: sends `tensors` (one message each, in order) to group rank `dst`, where a
  /// recv_async from this rank with the same `tag` (>= 0) and the same shapes and dtypes receives
  /// them (a message larger than the receiving tensor aborts the receiving process inside Gloo,
  /// so agree on shapes first, as Pipeline does with its one-off shape message). Messages between two ranks with one tag arrive in the order sent. The tensors must not
  /// change until the work was waited on. wait() may not return before the receiver has posted
  /// its receive (Gloo moves a message once the receiver is ready): order the sends and receives
  /// of a program so that no two ranks wait on each other. A peer that exits or stays silent
  /// longer than the group's timeout makes wait() throw an error naming the peer's global rank,
  /// the operation and `what`. Empty tensors are not sent (nor expected).
  ///
  /// Example:
  ///   if (pg->rank() == 0) pg->send({x}, 1, /*tag=*/7);
  ///   else pg->recv({x}, 0, /*tag=*/7);
  Work send_async(std::vector<at::Tensor> tensors, int dst, int tag, std::string what = "send");
  /// Receives into `tensors` (their shapes and dtypes are what is expected) from group rank `src`
  /// what it sends with `tag`; their contents are defined once the work was waited on.
  Work recv_async(std::vector<at::Tensor> tensors, int src, int tag, std::string what = "recv");
  /// send_async(...).wait().
  void send(std::vector<at::Tensor> tensors, int dst, int tag, std::string what = "send");
  /// recv_async(...).wait().
  void recv(std::vector<at::Tensor> tensors, int src, int tag, std::string what = "recv");

  /// How reduce_scatter moves the bytes. kAlltoall: every rank sends each peer only the chunk
  /// it owns and sums what it receives ((n-1)/n of the tensor out and in: the optimal bytes).
  /// kAllreduceSlice: an allreduce of the whole tensor, then this rank's chunk (twice the bytes,
  /// and bitwise the chunk of what an allreduce gives, so sharded training can equal DDP exactly).
  enum class ReduceScatterAlgorithm { kAlltoall, kAllreduceSlice };

  /// Reduce-scatter of the flat tensor `input` (same numel and dtype on every rank): group rank
  /// r receives chunk r of the elementwise reduction into `output`, where the chunks are
  /// shard_numel(input.numel()) elements each; the last chunks are padded (never empty: Gloo
  /// aborts on empty messages), and the padding of `output` is zero-filled reduced padding.
  /// kSum and kMean. `output` must hold shard_numel(input.numel()) elements.
  void reduce_scatter(const at::Tensor& input, at::Tensor& output, ReduceOp op,
                      ReduceScatterAlgorithm algorithm = ReduceScatterAlgorithm::kAlltoall);
  /// reduce_scatter() started asynchronously: `output` holds this rank's chunk once the returned
  /// work was waited on (the local part of the algorithm runs in wait()). `input` may be reused
  /// only after that.
  Work reduce_scatter_async(const at::Tensor& input, at::Tensor output, ReduceOp op,
                            ReduceScatterAlgorithm algorithm = ReduceScatterAlgorithm::kAlltoall);
  /// All-gather into one flat tensor: `output` (size() x shard.numel() elements) gets every
  /// rank's `shard` in rank order.
  void all_gather_into(const at::Tensor& shard, at::Tensor& output);
  /// all_gather_into() started asynchronously: `output` holds every rank's shard once the
  /// returned work was waited on (LibTorch 1.13's list form copies into it in wait()).
  Work all_gather_into_async(const at::Tensor& shard, at::Tensor output);
  /// All-to-all of rows whose counts differ per pair of ranks (a mixture of experts' dropless
  /// dispatch, and its way back): `input`'s first `send_rows[0]` rows go to group rank 0, the
  /// next `send_rows[1]` to rank 1, and so on (their sum is input.size(0)); the result holds
  /// what every rank sent this one, in rank order, with input's trailing shape and dtype (the
  /// same on every rank). The counts are exchanged first (one allgather), and each rank's count
  /// from every peer is written to `recv_rows` when given. Empty parts travel as nothing.
  /// Every rank of the group calls it, in the same order; the transfers use tag
  /// kAllToAllTag, which point-to-point users of the group leave to it.
  ///
  /// Example (2 ranks; rank 0 sends 1 row to itself and 2 to rank 1):
  ///   auto got = pg->all_to_all_v(rows, {1, 2});  // rank 1's got: 2 rows from 0, then its own
  at::Tensor all_to_all_v(const at::Tensor& input, const std::vector<int64_t>& send_rows,
                          std::vector<int64_t>* recv_rows = nullptr);
  /// all_to_all_v with the counts already known on both sides (`recv_rows[r]`: what rank r
  /// sends this one), as the way back of a dispatch is: no exchange of counts.
  at::Tensor all_to_all_v(const at::Tensor& input, const std::vector<int64_t>& send_rows,
                          const std::vector<int64_t>& recv_rows);
  /// The point-to-point tag all_to_all_v uses.
  static constexpr int kAllToAllTag = 1 << 30;
  /// Elements per rank when `numel` elements are split into size() equal, padded chunks: at
  /// least 1, so that no rank's chunk is empty.
  int64_t shard_numel(int64_t numel) const;

  /// Internals for tandem's own engines (src/); not part of the public API.
  Impl& impl() { return *impl_; }

 private:
  friend struct ProcessGroupFactory;
  explicit ProcessGroup(std::unique_ptr<Impl> impl);
  /// Throws unless `peer` is another rank of this group and `tag` >= 0.
  void check_peer(int peer, int tag, const char* op) const;
  std::unique_ptr<Impl> impl_;
};

/// The free TCP port the OS hands out on `host` right now (used when none is given).
int find_free_port(const std::string& host = "127.0.0.1");

/// Why `host` (an address or a host name) does not resolve to an address this machine can
/// connect to: the resolver's message (getaddrinfo), or "" when it resolves. c10d's TCPStore
/// retries a name that does not resolve until its timeout (30 minutes by default), so the
/// launcher and ProcessGroup::create ask first and fail within seconds instead.
std::string host_resolution_error(const std::string& host);

/// Whether this LibTorch lets rank 0's rendezvous store listen on 127.0.0.1 only, which tandem
/// then does for every job whose MASTER_ADDR is a loopback address (LibTorch >= 2.4; 1.13's
/// store listens on every interface). Note [Loopback rendezvous].
bool rendezvous_store_can_listen_on_loopback();

/// ProcessGroups of more than one rank alive in this process (tandem::launch::launch refuses to
/// fork while there are any).
int live_process_groups();

}  // namespace tandem
