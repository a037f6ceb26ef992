// Pipeline parallel: a model split into consecutive stages, one (or v, interleaved) per rank of a
// pipeline group; micro-batches flow forward and their gradients backward over point-to-point
// messages in the order a schedule (GPipe, 1F1B, interleaved 1F1B or zero bubble) gives.
// Note [Pipeline schedules] in pipeline_schedule.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/parallel/schedule_kind.h"

namespace tandem {
class ProcessGroup;
}

namespace tandem::parallel {

/// One step of a rank's work. Transfers are between neighbouring stages of the whole pipeline:
/// activations go to the next stage (on rank + 1, or from the last rank to rank 0's next chunk),
/// gradients to the previous one. `chunk` is the rank's local stage (0 to v - 1; always 0
/// without virtual stages): for a transfer, the chunk that sends or receives it on this rank.
struct PipelineAction {
  enum Kind {
    kForward,
    kBackward,
    kSendActivation,
    kRecvActivation,
    kSendGradient,
    kRecvGradient,
    kBackwardInput,   // zero bubble: the gradient of the stage's input only
    kBackwardWeight,  // zero bubble: the gradients of the stage's parameters
  };
  Kind kind;
  int microbatch;
  int chunk = 0;
  bool operator==(const PipelineAction& o) const {
    return kind == o.kind && microbatch == o.microbatch && chunk == o.chunk;
  }
};

/// "F3", "B3", "I3", "W3", "sendA3", "recvA3", "sendG3", "recvG3"; chunk c > 0 as "F3.c".
std::string to_string(const PipelineAction& action);


/// Every rank's actions (index = rank in the pipeline group) for `microbatches` micro-batches
/// over `ranks` ranks holding `virtual_stages` stages each. Derived from one global order of
/// events, so that blocking (even rendezvous) sends and receives never wait on each other in a
/// cycle. Throws tandem::Refused for ranks < 1, microbatches < ranks (the pipeline would be idle
/// most of the time: use at least `ranks` micro-batches), virtual_stages < 1, virtual stages
/// with a schedule other than kInterleaved1F1B, or an interleaved schedule whose micro-batches
/// are not a multiple of the ranks.
std::vector<std::vector<PipelineAction>> pipeline_schedule(ScheduleKind kind, int ranks,
                                                           int microbatches,
                                                           int virtual_stages = 1);

/// What running a schedule gives, from simulate_schedule().
struct ScheduleSimulation {
  bool deadlock = false;
  /// Why the schedule cannot run (a deadlock, a micro-batch used before it arrived, ...); empty
  /// when it runs.
  std::string error;
  /// Time steps until the last rank finished (a forward, an input gradient and a weight
  /// gradient take 1 each, a whole backward 2).
  int64_t time_steps = 0;
  /// Time steps each rank computed.
  std::vector<int64_t> busy;
  /// Most micro-batches (over the rank's chunks) whose forward ran but whose backward (or
  /// weight gradient) did not, per rank.
  std::vector<int> max_in_flight;
  /// Idle share of stages x time_steps: 1 - sum(busy) / (stages * time_steps).
  double bubble_fraction = 0;
};

/// Runs every rank's action list as the runtime does. Order: a send and its receive (same
/// direction, micro-batch and stage) complete together, when both ranks stand at them
/// (rendezvous: a send waits for its receive, and a receive for its send; a schedule that runs
/// like this also runs with buffered sends). Time: computations take their time steps, and the
/// receiver of a transfer can start on it once its sender made it, the sender going on at once.
/// Checks that every stage runs each micro-batch's forward and backward (or input and weight
/// gradients) once, in a valid order, on data that arrived. `virtual_stages`: the chunks per
/// rank (at least those the lists name).
ScheduleSimulation simulate_schedule(const std::vector<std::vector<PipelineAction>>& actions,
                                     int virtual_stages = 1);

/// Options of a Pipeline.
///
/// Example:
///   auto pipe = tandem::parallel::Pipeline(stage_module, pp_group, loss_fn,
///       tandem::parallel::PipelineOptions().schedule(ScheduleKind::k1F1B).microbatches(8));
struct PipelineOptions {
  /// Unset: the run's pp_schedule (tandem launch --pp_schedule), else 1F1B (kInterleaved1F1B
  /// when virtual stages are set).
  TORCH_ARG(std::optional<ScheduleKind>, schedule) = std::nullopt;
  /// Micro-batches per step: at least the number of stages; they must divide the batch.
  TORCH_ARG(int, microbatches) = 4;
  /// Stages per rank (interleaved 1F1B); unset: the run's pp_virtual_stages, else 1.
  TORCH_ARG(std::optional<int>, virtual_stages) = std::nullopt;
  /// Note [Pipeline checkpoint names]: the name each tensor of the stage takes in the run's
  /// checkpoints (Accelerator::save_state, get_state_dict and save_model), from its path in the
  /// Sequential ("3.mlp.up_proj.weight") to the model's own ("model.layers.2.mlp.up_proj.weight",
  /// models::llama_name_of_sequential). With it a pipeline's checkpoint resumes on a layout
  /// without the pipeline, where the model is not a Sequential, and theirs under the pipeline.
  /// Unset: the Sequential's paths. Read by Accelerator::prepare_pipeline.
  TORCH_ARG(std::function<std::string(const std::string&)>, checkpoint_names) = nullptr;
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
  /// A rank's v stages (virtual stages, Note [Interleaved stages]): `module` holds all their
  /// parameters (for the optimizer, the gradient reduction and checkpoints); `chunks[c]` is the
  /// forward of the model's stage c * p + rank and `chunk_modules[c]` its module. The schedule
  /// defaults to kInterleaved1F1B when v > 1; options.virtual_stages, when set, must be v.
  Pipeline(std::shared_ptr<torch::nn::Module> module,
           std::vector<std::shared_ptr<torch::nn::Module>> chunk_modules,
           std::vector<Forward> chunks, std::shared_ptr<ProcessGroup> pp, Loss loss,
           PipelineOptions options = {}, std::shared_ptr<ProcessGroup> dp = nullptr);

  /// One training step's forwards and backwards; `input` is used on the first stage, `target`
  /// on the last (other stages may pass undefined tensors). Returns the mean loss over the
  /// micro-batches (and over the data-parallel group), on every rank. After it threw, transfers
  /// may still be in flight: do not step this Pipeline again.
  double step(const at::Tensor& input, const at::Tensor& target);

  /// This rank in the pipeline group; with virtual stages it holds stages rank, rank + p, ...
  int stage() const;
  /// Ranks in the pipeline group (p).
  int stages() const;
  /// Stages each rank holds (v; 1 without virtual stages).
  int virtual_stages() const { return static_cast<int>(forwards_.size()); }
  ScheduleKind schedule() const { return kind_; }
  /// Rank 0 holds the model's first stage and rank p - 1 its last, with or without virtual
  /// stages: the first takes the input, the last the target.
  bool is_first() const { return stage() == 0; }
  bool is_last() const { return stage() == stages() - 1; }
  const std::vector<PipelineAction>& actions() const { return actions_; }
  std::shared_ptr<torch::nn::Module> module() const { return module_; }

  /// Where this rank's last step() went: `schedule_s` from its start to the end of its last
  /// action (before the gradient averaging and the loss broadcast), `compute_s` of it in
  /// forwards, losses and backwards (host clock: on a GPU, the time to launch them). 1 - compute_s / schedule_s is the rank's idle share: the
  /// measured bubble (with the transfers' own time), which bench/sections/55-pipeline-schedules.sh
  /// sets beside each schedule's formula.
  struct StepTimes {
    double schedule_s = 0;
    double compute_s = 0;
  };
  StepTimes last_step_times() const { return times_; }

 private:
  void check_microbatches(const at::Tensor& t, const char* what) const;
  void reduce_gradients();
  // Averages `params`' gradients over `group` (divide_sum_by 1: the mean; else the sum divided
  // by it); a parameter with no gradient on some ranks counts as zeros there.
  void reduce_gradients(std::vector<at::Tensor>& params, ProcessGroup& group,
                        double divide_sum_by, const std::string& what);

  std::shared_ptr<torch::nn::Module> module_;
  std::vector<std::shared_ptr<torch::nn::Module>> chunk_modules_;
  std::vector<Forward> forwards_;
  std::shared_ptr<ProcessGroup> pp_, dp_;
  Loss loss_;
  PipelineOptions options_;
  ScheduleKind kind_ = ScheduleKind::k1F1B;
  std::vector<PipelineAction> actions_;
  // Per chunk: the shape and dtype of the activations it receives (learnt from the previous
  // stage in the first step) and sends (fixed by the first step).
  std::vector<std::vector<int64_t>> recv_shape_, send_shape_;
  std::vector<int64_t> recv_dtype_, send_dtype_;
  StepTimes times_;
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
