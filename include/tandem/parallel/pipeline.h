// Pipeline parallel: a model split into consecutive stages, one per rank of a pipeline group;
// micro-batches flow forward and their gradients backward over point-to-point messages in the
// order a schedule (GPipe or 1F1B) gives. Note [Pipeline schedules] in pipeline_schedule.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace tandem {
class ProcessGroup;
}

namespace tandem::parallel {

/// The order in which a stage runs its micro-batches' forwards and backwards.
///   kGPipe: every forward, then every backward (a stage holds all m micro-batches' activations).
///   k1F1B:  p - 1 - stage forwards, then one forward and one backward in turn, then the
///           remaining backwards (stage s holds at most p - s micro-batches' activations).
/// With forwards and backwards of equal cost both idle the same fraction of the time,
/// (p - 1) / (m + p - 1) for p stages and m micro-batches; 1F1B needs less memory.
enum class ScheduleKind { kGPipe, k1F1B };

/// One step of a stage's work. Transfers are between neighbouring stages: activations go to
/// stage + 1, gradients to stage - 1.
struct PipelineAction {
  enum Kind { kForward, kBackward, kSendActivation, kRecvActivation, kSendGradient, kRecvGradient };
  Kind kind;
  int microbatch;
  bool operator==(const PipelineAction& o) const {
    return kind == o.kind && microbatch == o.microbatch;
  }
};

/// "F3", "B3", "sendA3", "recvA3", "sendG3", "recvG3".
std::string to_string(const PipelineAction& action);
std::string to_string(ScheduleKind kind);

/// Every stage's actions (index = stage = rank in the pipeline group) for `microbatches`
/// micro-batches over `stages` stages. Derived from one global order of events, so that blocking
/// (even rendezvous) sends and receives never wait on each other in a cycle. Throws
/// std::invalid_argument for stages < 1 or microbatches < stages (the pipeline would be idle
/// most of the time: use at least `stages` micro-batches).
std::vector<std::vector<PipelineAction>> pipeline_schedule(ScheduleKind kind, int stages,
                                                           int microbatches);

/// What running a schedule gives, from simulate_schedule().
struct ScheduleSimulation {
  bool deadlock = false;
  /// Why the schedule cannot run (a deadlock, a micro-batch used before it arrived, ...); empty
  /// when it runs.
  std::string error;
  /// Time steps until the last stage finished (forward and backward take 1 each).
  int64_t time_steps = 0;
  /// Time steps each stage computed (forwards + backwards).
  std::vector<int64_t> busy;
  /// Most micro-batches whose forward ran but whose backward did not, per stage.
  std::vector<int> max_in_flight;
  /// Idle share of stages x time_steps: 1 - sum(busy) / (stages * time_steps).
  double bubble_fraction = 0;
};

/// Runs every stage's action list as the runtime does: forwards and backwards take one time
/// step, a send and its receive (same direction and micro-batch) happen together, at the later
/// of the two ranks' clocks (rendezvous: a send waits for its receive, and a receive for its
/// send; a schedule that runs like this also runs with buffered sends). Checks that every stage
/// runs each micro-batch's forward and backward once, in a valid order, on data that arrived.
ScheduleSimulation simulate_schedule(const std::vector<std::vector<PipelineAction>>& actions);

/// Options of a Pipeline.
///
/// Example:
///   auto pipe = tandem::parallel::Pipeline(stage_module, pp_group, loss_fn,
///       tandem::parallel::PipelineOptions().schedule(ScheduleKind::k1F1B).microbatches(8));
struct PipelineOptions {
  TORCH_ARG(ScheduleKind, schedule) = ScheduleKind::k1F1B;
  /// Micro-batches per step: at least the number of stages; they must divide the batch.
  TORCH_ARG(int, microbatches) = 4;
};

/// This rank's stage of a pipeline: its module, the pipeline group (group rank = stage) and,
/// optionally, a data-parallel group over which the stage's gradients are averaged once per step.
///
/// step(input, target) splits the batch into micro-batches along dim 0, runs the schedule
/// (activations to the next stage and gradients to the previous one over send/recv), computes
/// loss(output, target) / microbatches per micro-batch on the last stage, accumulates the stage's
/// parameter gradients into .grad (zero them between steps, as after backward()), averages them
/// over the data-parallel group, and returns the step's mean loss on every rank.
///
/// The shapes and dtypes of the activations a stage sends are sent once, with the first step's
/// first activation, and reused: a later step whose activations have another shape or dtype is
/// an error (raised on the stage that sends them), not handled. Keep batch size and sample shape
/// fixed, or build a new Pipeline for another shape.
///
/// Example:
///   auto stage = tandem::parallel::split_sequential(model, pp->size(), pp->rank());
///   tandem::parallel::Pipeline pipe(stage, pp,
///       [](const at::Tensor& y, const at::Tensor& t) { return torch::mse_loss(y, t); },
///       tandem::parallel::PipelineOptions().microbatches(8), dp);
///   for (...) { double loss = pipe.step(x, y); opt.step(); opt.zero_grad(); }
class Pipeline {
 public:
  using Forward = std::function<at::Tensor(const at::Tensor&)>;
  using Loss = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

  /// A stage given as a Sequential (its forward and its parameters).
  Pipeline(torch::nn::Sequential stage, std::shared_ptr<ProcessGroup> pp, Loss loss,
           PipelineOptions options = {}, std::shared_ptr<ProcessGroup> dp = nullptr);
  /// A stage given as any module (whose parameters are the stage's) and its forward.
  Pipeline(std::shared_ptr<torch::nn::Module> module, Forward forward,
           std::shared_ptr<ProcessGroup> pp, Loss loss, PipelineOptions options = {},
           std::shared_ptr<ProcessGroup> dp = nullptr);

  /// One training step's forwards and backwards; `input` is used on the first stage, `target`
  /// on the last (other stages may pass undefined tensors). Returns the mean loss over the
  /// micro-batches (and over the data-parallel group), on every rank.
  double step(const at::Tensor& input, const at::Tensor& target);

  int stage() const;
  int stages() const;
  bool is_first() const { return stage() == 0; }
  bool is_last() const { return stage() == stages() - 1; }
  const std::vector<PipelineAction>& actions() const { return actions_; }
  std::shared_ptr<torch::nn::Module> module() const { return module_; }

 private:
  void check_microbatches(const at::Tensor& t, const char* what) const;
  void reduce_gradients();

  std::shared_ptr<torch::nn::Module> module_;
  Forward forward_;
  std::shared_ptr<ProcessGroup> pp_, dp_;
  Loss loss_;
  PipelineOptions options_;
  std::vector<PipelineAction> actions_;
  // The shape and dtype of the activations this stage receives (learnt from the previous stage
  // in the first step) and sends (fixed by the first step).
  std::vector<int64_t> recv_shape_, send_shape_;
  int64_t recv_dtype_ = -1, send_dtype_ = -1;
};

/// The consecutive children of `model` that form stage `stage` of `stages`, as a new Sequential
/// that shares the same module objects (and keeps their names, so parameter names match the
/// whole model's). Balanced by number of children: stage s gets children
/// [s * n / stages, (s + 1) * n / stages). Throws when a stage would be empty.
torch::nn::Sequential split_sequential(const torch::nn::Sequential& model, int stages, int stage);

/// As above with explicit boundaries: `first_child[s]` is the index of stage s's first child
/// (first_child[0] == 0, strictly ascending, all < the number of children); stages =
/// first_child.size().
torch::nn::Sequential split_sequential(const torch::nn::Sequential& model,
                                       const std::vector<int64_t>& first_child, int stage);

}  // namespace tandem::parallel
