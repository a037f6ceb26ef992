// Note [Replica recovery]: with `tandem launch --fault_tolerant_replicas` every machine is one
// replica of the model, and the replicas average their gradients at each optimizer step over a
// process group that can lose and gain members while the job runs (torchft's idea). Machine 0's
// launcher hosts a store (c10d's TCPStore, on --main_process_port + 1) for the whole job; through
// it the replicas
//   - join: each process takes a number (uid) and queues itself; the first quorum (generation 0)
//     is the first R processes to queue (R: the launcher's --num_machines), later ones wait;
//   - agree on each step: every member sums one flat buffer of its gradients over the current
//     generation's Gloo group, then votes in the store (its sum worked, or failed); the first
//     vote written decides for every member (compareSet), and a step is applied only when every
//     member's sum worked. A process that died (killed, its machine gone) breaks the sum or never
//     votes: the step is not applied anywhere;
//   - reform: the members that are still there post themselves for the next generation, wait
//     for each other (up to kSettle after a failure), and the first to write the next
//     generation's record (members in the previous order, then the queued joiners when the
//     boundary admits them) fixes it; a new Gloo group is built under the generation's prefix,
//     and the step's sum is taken again among the survivors, from their own gradients;
//   - admit: the sum carries one extra number, the joiners each member saw queued; when it is
//     above 0 the quorum is reformed at the next step boundary (before the next batch is drawn)
//     with them, and the first member sends every member the training state (Accelerator).
// Every member of a generation counts its sums from 0, so a step's keys are
// "tandem/ft/g<G>/c<call>/..." on every member. A member that reaches a reform after its
// record was written without it stops, saying so; a joiner waits until it is admitted, or the
// job ended. Machine 0 hosts the store: its loss ends the job.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/comm/process_group.h"
#include "tandem/state.h"

namespace tandem::comm {

/// One member of the replicas' quorum (Note [Replica recovery]).
class Replicas {
 public:
  /// Connects to the store ProcessState::replica_store names and queues this process.
  explicit Replicas(const ProcessState& state);
  ~Replicas();
  Replicas(const Replicas&) = delete;
  Replicas& operator=(const Replicas&) = delete;

  /// Runs after every new quorum on every member, with its group (null when alone) and the
  /// index of the member whose state every member takes (the Accelerator's exchange_state).
  void on_new_quorum(std::function<void(ProcessGroup*, int root)> f) { on_new_ = std::move(f); }

  /// Blocks until this process is a member of a quorum: the job's first, or a running job's at
  /// its next step boundary. Calls on_new_quorum. Once.
  void join();
  bool joined() const { return generation_ >= 0; }

  /// Sums `flat` (a contiguous CPU tensor) over the quorum, agreed (Note [Replica recovery]):
  /// returns how many replicas' values it holds. A lost replica: the quorum is reformed
  /// without it, and the sum taken again from `flat` as given.
  int sum(at::Tensor& flat);

  /// At a step boundary: when some member saw a replica waiting to join, forms the next quorum
  /// with it (calls on_new_quorum). Returns whether the quorum changed.
  bool admit_at_boundary();

  int size() const { return static_cast<int>(members_.size()); }
  int index() const { return index_; }
  int64_t generation() const { return generation_; }
  int64_t uid() const { return uid_; }
  /// "[replica <uid>]", the prefix of this member's lines.
  std::string prefix() const;

  /// Seconds the survivors wait for each other after a failure before the next quorum is fixed.
  static constexpr double kSettleSeconds = 3.0;

 private:
  struct Impl;
  void reform(bool admit, const std::string& why);
  void enter(int64_t generation, const std::string& record);
  std::unique_ptr<Impl> impl_;
  ProcessState state_;
  std::function<void(ProcessGroup*, int)> on_new_;
  int64_t uid_ = -1;
  int64_t generation_ = -1;
  int64_t consumed_joins_ = 0;  // queued joiners the current generation took in
  int64_t calls_ = 0;           // sums in the current generation
  std::vector<int64_t> members_;
  int index_ = 0;
  bool admit_pending_ = false;
  std::shared_ptr<ProcessGroup> group_;
};

}  // namespace tandem::comm
