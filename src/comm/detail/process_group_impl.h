// Internals of ProcessGroup shared by tandem's engines (the DDP reducer, sharded strategies).
#pragma once

#include <functional>

#include "../../compat/c10d.h"
#include "tandem/comm/process_group.h"

namespace tandem {

struct ProcessGroup::Impl {
  int rank = 0;
  int size = 1;
  std::vector<int> global_ranks;  // group rank -> global rank
  ProcessState state;              // of the whole job
  ProcessGroupOptions options;
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<::gloo::transport::Device> gloo_device;
  c10::intrusive_ptr<compat::Backend> gloo;  // CPU tensors (and objects)
  c10::intrusive_ptr<compat::Backend> nccl;  // CUDA tensors, created on first use
  int subgroup_counter = 0;
  std::string store_prefix;
  /// Note [Replica recovery]: a failure of this group is the replicas' quorum's to handle: no
  /// flight-recorder dump, no word to the launcher.
  bool failures_expected = false;

  /// The backend for tensors on `device`.
  compat::Backend& backend_for(const at::Tensor& t);
  using Works = std::vector<c10::intrusive_ptr<compat::Work>>;
  using Start = std::function<Works()>;
  /// Records the operation in the flight recorder (Note [Flight recorder]), described by
  /// `described` (or the first of `out`), then issues it with `start` (one c10d work, or several
  /// waited on in order), and wraps them so that a failure names the operation and the rank.
  Work issue(std::string what, std::vector<at::Tensor> out, double divide_by,
             const at::Tensor& described, const Start& start);
  std::string prefix() const;
  /// The group's name in the flight recorder: "world", "sub0", "sub0/sub1", ...
  std::string flight_group() const {
    return store_prefix.empty() ? "world" : store_prefix.substr(0, store_prefix.size() - 1);
  }
};

struct Work::Impl {
  /// A work dropped without wait() is no longer pending in the flight recorder (Note
  /// [Heartbeat]: a rank waits in nothing that nobody waits for).
  ~Impl();
  c10::intrusive_ptr<compat::Work> work;
  /// Further parts of the operation, waited on after `work` (a send of several tensors).
  std::vector<c10::intrusive_ptr<compat::Work>> more;
  std::string what;
  std::string prefix;
  /// ProcessState::error_file of the group (Note [Secondary failures]).
  std::string error_file;
  bool failures_expected = false;  // ProcessGroup::Impl::failures_expected
  std::vector<at::Tensor> tensors;
  double divide_by = 1.0;
  /// Runs once after a successful wait (e.g. reduce_scatter's local sum); may be empty.
  std::function<void()> then;
  bool done = false;
  /// Its flight recorder entry (0: none).
  uint64_t flight = 0;
};

/// Note [Replica recovery]: a Gloo group of `size` processes over `store` (its keys under it),
/// this one `rank` among them, named `name` in the flight recorder; no failure of it is told to
/// the launcher (a lost replica is the quorum's to handle).
struct ProcessGroupFactory {
  static std::shared_ptr<ProcessGroup> on_store(const ProcessState& state,
                                                c10::intrusive_ptr<c10d::Store> store,
                                                const std::string& name, int rank, int size,
                                                const ProcessGroupOptions& options);
};

#if defined(TANDEM_WITH_NCCL)
/// Defined in nccl.cpp, compiled only when LibTorch has NCCL.
c10::intrusive_ptr<compat::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                      int rank, int size,
                                                      std::chrono::milliseconds timeout);
#endif

}  // namespace tandem
