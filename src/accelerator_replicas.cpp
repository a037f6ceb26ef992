// The Accelerator under fault-tolerant replicas: Note [Replica recovery] (comm/replicas.h).
// Each replica is one process (its own world of one); at every optimizer step its gradients
// are averaged over the quorum of the moment; a new quorum takes the state of its first member.
#include <torch/torch.h>

#include <iostream>
#include <sstream>

#include "tandem/accelerator.h"
#include "tandem/checkpoint/optimizer_state.h"
#include "tandem/comm/replicas.h"
#include "tandem/error.h"

namespace tandem {

void Accelerator::refuse_under_replicas(const std::string& what) const {
  throw ::tandem::Refused(
      state_.prefix() + " " + what +
      " is not supported under --fault_tolerant_replicas "
      "(Note [Replica recovery]): replicas average whole gradients at each optimizer step and "
      "shard a map-style loader over the quorum of each step. Use acc.prepare_data_loader and "
      "opt.step() after acc.backward(loss), or launch without --fault_tolerant_replicas");
}

void Accelerator::start_replicas() {
  if (state_.world_size > 1)
    throw ::tandem::Refused(state_.prefix() +
                            " under --fault_tolerant_replicas each machine is one replica of one "
                            "process, and this process is one of " +
                            std::to_string(state_.world_size) +
                            " (WORLD_SIZE): launch with --num_processes equal to --num_machines");
  if (precision_->scaler())
    throw ::tandem::Refused(
        state_.prefix() +
        " mixed precision fp16 under --fault_tolerant_replicas: its loss "
        "scale would differ between replicas that joined at different times; use bf16 or no");
  replicas_ = std::make_unique<comm::Replicas>(state_);
  replicas_->on_new_quorum([this](ProcessGroup* group, int root) {
    for (const auto& weak : replica_shards_)
      if (auto shard = weak.lock()) {
        shard->size = replicas_->size();
        shard->index = replicas_->index();
      }
    exchange_state(group, root);
  });
  auto before = std::move(loader_state_->before_first_pass);
  loader_state_->before_first_pass = [this, before] {
    if (before) before();  // auto_resume first: the quorum's first member sends what it loaded
    join_replicas();
  };
}

std::shared_ptr<data::detail::ReplicaShard> Accelerator::replica_shard() {
  auto shard = std::make_shared<data::detail::ReplicaShard>();
  shard->size = replicas_->joined() ? replicas_->size() : state_.replicas;
  shard->index = replicas_->joined() ? replicas_->index() : 0;
  if (!replica_shard_) {
    // The training data: its draws are the step boundaries. A loader may outlive the
    // Accelerator (Note [Accelerator lifetime]): it reaches it through self_.
    shard->at_boundary = [cell = self_](int64_t epoch, int64_t consumed) {
      Accelerator* acc = *cell;
      if (!acc || !acc->replicas_ || !acc->replicas_->joined()) return;
      acc->replica_boundary_ = {epoch, consumed};
      acc->replicas_->admit_at_boundary();
    };
    replica_shard_ = shard;
  }
  replica_shards_.push_back(shard);
  return shard;
}

void Accelerator::join_replicas() {
  replica_joining_ = true;
  replicas_->join();
  replica_joining_ = false;
}

int Accelerator::replicas() const {
  if (!replicas_) return 1;
  if (replicas_in_step_ > 0) return replicas_in_step_;
  return replicas_->joined() ? replicas_->size() : state_.replicas;
}

namespace {

// Broadcasts `t` (any device) from `root`; the others take the values.
void broadcast_into(ProcessGroup& g, const at::Tensor& t, int root) {
  auto cpu = t.detach().to(at::kCPU).contiguous();
  g.broadcast(cpu, root);
  if (g.rank() != root) {
    torch::NoGradGuard no_grad;
    t.detach().copy_(cpu);
  }
}

// Broadcasts bytes from `root`: its `bytes` become every member's.
std::string broadcast_bytes(ProcessGroup& g, const std::string& bytes, int root) {
  auto size = at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong);
  g.broadcast(size, root);
  auto data = at::empty({size.item<int64_t>()}, at::kByte);
  if (g.rank() == root && !bytes.empty()) std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
  if (data.numel() > 0) g.broadcast(data, root);
  return std::string(static_cast<const char*>(data.data_ptr()), static_cast<size_t>(data.numel()));
}

}  // namespace

// Every member takes the first member's training state: the models' parameters and buffers,
// the optimizers' state, the schedulers' and the Accelerator's step counts; a joining member
// also the loader epoch and sample where the others are. Random generators stay each
// replica's own.
void Accelerator::exchange_state(ProcessGroup* group, int root) {
  if (!group || group->size() == 1) return;
  auto& g = *group;
  auto head =
      at::tensor({optimizer_steps_, replica_boundary_.first, replica_boundary_.second,
                  static_cast<int64_t>(models_.size()), static_cast<int64_t>(optimizers_.size()),
                  static_cast<int64_t>(schedulers_.size())},
                 at::kLong);
  g.broadcast(head, root);
  const auto* h = head.data_ptr<int64_t>();
  if (h[3] != static_cast<int64_t>(models_.size()) ||
      h[4] != static_cast<int64_t>(optimizers_.size()) ||
      h[5] != static_cast<int64_t>(schedulers_.size()))
    throw ::tandem::Refused(
        replicas_->prefix() + " the replica this one takes its state from prepared " +
        std::to_string(h[3]) + " model(s), " + std::to_string(h[4]) + " optimizer(s) and " +
        std::to_string(h[5]) + " scheduler(s), and this one " + std::to_string(models_.size()) +
        ", " + std::to_string(optimizers_.size()) + " and " + std::to_string(schedulers_.size()) +
        ": every replica runs the same program, prepared before its loader's first pass");
  optimizer_steps_ = h[0];
  if (replica_joining_ && h[1] >= 0 && replica_shard_)
    replica_shard_->start = std::make_pair(h[1], h[2]);
  for (const auto& sched : schedulers_) {
    auto count =
        at::tensor({static_cast<int64_t>(checkpoint::scheduler_step_count(*sched))}, at::kLong);
    g.broadcast(count, root);
    checkpoint::set_scheduler_step_count(*sched, static_cast<unsigned>(count.item<int64_t>()));
    scheduler_steps_[sched.get()] = static_cast<unsigned>(count.item<int64_t>());
  }
  for (const auto& m : models_) {
    for (const auto& p : m->parameters()) broadcast_into(g, p, root);
    for (const auto& b : m->buffers()) broadcast_into(g, b, root);
  }
  for (const auto& opt : optimizers_) {
    std::string bytes;
    if (g.rank() == root) {
      torch::serialize::OutputArchive archive;
      opt->save(archive);
      std::ostringstream os;
      archive.save_to(os);
      bytes = os.str();
    }
    bytes = broadcast_bytes(g, bytes, root);
    if (g.rank() != root && replica_joining_) {
      torch::serialize::InputArchive archive;
      std::istringstream is(bytes);
      archive.load_from(is);
      opt->load(archive);
    }
  }
  if (replica_joining_ && h[1] >= 0)
    std::cerr << replicas_->prefix() << " joined at step " << optimizer_steps_ << " (epoch " << h[1]
              << ", sample " << h[2] << ")" << std::endl;
}

// The optimizer's gradients, summed over the quorum in one flat buffer and divided by the
// replicas that took part.
void Accelerator::average_over_replicas(torch::optim::Optimizer& optimizer) {
  if (!replicas_->joined())
    throw ::tandem::Refused(
        state_.prefix() +
        " optimizer step before this replica joined the others: under "
        "--fault_tolerant_replicas a replica joins as its prepared loader's first pass begins "
        "(Note [Replica recovery]); train over acc.prepare_data_loader(...)");
  std::vector<at::Tensor> params;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params())
      if (p.requires_grad()) params.push_back(p);
  at::ScalarType dtype = at::kFloat;
  for (const auto& p : params)
    if (p.scalar_type() == at::kDouble) dtype = at::kDouble;
  std::vector<at::Tensor> parts;
  for (const auto& p : params)
    parts.push_back(p.grad().defined() ? p.grad().detach().reshape({-1}).to(at::kCPU, dtype)
                                       : at::zeros({p.numel()}, at::TensorOptions().dtype(dtype)));
  auto flat = parts.empty() ? at::zeros({0}, at::TensorOptions().dtype(dtype)) : at::cat(parts);
  const int n = replicas_->sum(flat);
  replicas_in_step_ = n;
  if (n > 1) flat.div_(n);
  int64_t offset = 0;
  torch::NoGradGuard no_grad;
  for (const auto& p : params) {
    auto chunk = flat.narrow(0, offset, p.numel()).view(p.sizes());
    offset += p.numel();
    if (p.grad().defined())
      p.mutable_grad().copy_(chunk);
    else if (chunk.ne(0).any().item<bool>())
      p.mutable_grad() = chunk.to(p.options());
  }
}

}  // namespace tandem
