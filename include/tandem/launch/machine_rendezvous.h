// The launchers of an elastic job on several machines agree, before every attempt, on the
// machines that take part (Note [Elastic machines] in machine_rendezvous.cpp).
#pragma once

#include <memory>
#include <vector>

#include "tandem/launch/launcher.h"

namespace tandem::launch {

class MachineRendezvous {
 public:
  /// Machine 0 hosts the store on main_process_port + 1; the others connect to it. Throws
  /// std::runtime_error naming the address when that fails.
  explicit MachineRendezvous(const LaunchOptions& options);
  ~MachineRendezvous();
  /// The machine ranks (as launched) that take part in attempt `attempt`, in order: this
  /// machine's index among them is its machine rank for the attempt. Throws when fewer than
  /// min_machines joined within rdzv_timeout_s, or machine 0's store is gone.
  std::vector<int> join(int attempt);
  /// Note [Replica recovery]: on machine 0, which hosts the replicas' store, waits until every
  /// member of the newest quorum has finished (or up to `timeout_s`), so that the store outlives
  /// their last step. Returns whether they all finished.
  bool wait_for_replicas(double timeout_s);

 private:
  struct Impl;
  LaunchOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::launch
