// The Accelerator's options: plain data, below the run configuration that resolves them over
// the launcher's environment (config/run_config.h) and the Accelerator that runs them.
#pragma once

#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tandem/comm/mesh.h"
#include "tandem/parallel/sharding_options.h"
#include "tandem/precision/fp8.h"
#include "tandem/precision/grad_scaler.h"

namespace tandem {

/// Options of the Accelerator. Unset options come from the launcher's environment (TANDEM_*
/// variables written by `tandem launch`), so that a plain `Accelerator()` follows the launcher.
///
/// Example:
///   tandem::Accelerator acc(tandem::AcceleratorOptions()
///                               .seed(42)
///                               .gradient_accumulation_steps(4)
///                               .find_unused_parameters(true));
struct AcceleratorOptions {
  /// Seeds LibTorch's generators (set_seed) at construction.
  TORCH_ARG(std::optional<uint64_t>, seed) = std::nullopt;
  /// Run on the CPU even when GPUs are visible (env TANDEM_USE_CPU).
  TORCH_ARG(std::optional<bool>, cpu) = std::nullopt;
  /// Micro-steps per optimizer step (env TANDEM_GRADIENT_ACCUMULATION_STEPS; default 1).
  TORCH_ARG(std::optional<int>, gradient_accumulation_steps) = std::nullopt;
  /// The loaders' batch size is global and split across ranks.
  TORCH_ARG(bool, split_batches) = false;
  /// Every rank gets the same number of batches (padding with samples from the start).
  TORCH_ARG(bool, even_batches) = true;
  /// Gradient bucket size cap in MiB; the first bucket is capped at first_bucket_cap_mb.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  /// Allow parameters without gradient in a backward (their buckets still complete).
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// How gradient buckets travel: "none" (fp32 allreduce), "fp16" or "bf16" compression
  /// (parallel/comm_hook.h; env TANDEM_DDP_COMM_HOOK, config key ddp_comm_hook). Default none.
  TORCH_ARG(std::optional<std::string>, comm_hook) = std::nullopt;
  /// Gradients live in the buckets, no copy in or out (env TANDEM_GRADIENT_AS_BUCKET_VIEW,
  /// config key gradient_as_bucket_view). Default off, as in PyTorch.
  TORCH_ARG(std::optional<bool>, gradient_as_bucket_view) = std::nullopt;
  /// Sharded data parallel (ZeRO stages 1-3; docs/sharding.md). Unset: from the launcher's
  /// environment (distributed_type DEEPSPEED with deepspeed_config, or FSDP with fsdp_config),
  /// else plain data parallel.
  TORCH_ARG(std::optional<parallel::ShardingOptions>, sharding) = std::nullopt;
  /// Clip the gradients' total norm to this before every optimizer step (DeepSpeed's
  /// gradient_clipping; env TANDEM_GRADIENT_CLIPPING). Unset or 0: only when the user calls
  /// clip_grad_norm_.
  TORCH_ARG(std::optional<double>, gradient_clipping) = std::nullopt;
  /// The parallel layout (Accelerate's parallelism_config sizes dp_replicate, dp_shard, tp, and
  /// tandem's pp; docs/model_parallel.md). Unset: from the launcher's environment
  /// (TANDEM_TP_SIZE, TANDEM_PP_SIZE, ...), else plain data parallel over every process. Every
  /// run builds its parallel::Topology from it; data parallel (gradients, loaders, metrics) runs
  /// over its "dp" group, ZeRO over "dp_shard".
  TORCH_ARG(std::optional<comm::MeshShape>, parallelism) = std::nullopt;
  /// Wrap the entries of every Sequential in a prepared model (and of a pipeline stage) in
  /// parallel::Checkpointed, so that their activations are recomputed in backward (Accelerate's
  /// fsdp_activation_checkpointing; env TANDEM_ACTIVATION_CHECKPOINTING). Default off.
  TORCH_ARG(std::optional<bool>, activation_checkpointing) = std::nullopt;
  /// Re-broadcast buffers (e.g. BatchNorm statistics) from rank 0 after every optimizer step,
  /// so that every forward starts from rank 0's buffers, as PyTorch's DDP broadcasts them before
  /// each forward. The values are written around autograd's version counters (Note [Buffers
  /// written around autograd]): a backward still pending over a saved buffer (a GAN's generator
  /// after its discriminator stepped) is not refused.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// A prepared optimizer's zero_grad() that discards gradients accumulated by earlier
  /// micro-steps of the same accumulation window (a zero_grad() before the forward, inside
  /// `accumulate()`) is an error instead of a warning. Either way the gradients are cleared as
  /// asked; the README's loop shows where the call belongs (after step()).
  TORCH_ARG(bool, strict_zero_grad) = false;
  /// no, bf16, fp16, bf16-true, fp16-true or fp8 (env TANDEM_MIXED_PRECISION, set by
  /// `tandem launch --mixed_precision`; default no). See docs/mixed_precision.md.
  TORCH_ARG(std::optional<std::string>, mixed_precision) = std::nullopt;
  /// -true modes: the optimizer steps fp32 master copies of the half weights (default: on for
  /// fp16-true, off for bf16-true).
  TORCH_ARG(std::optional<bool>, master_weights) = std::nullopt;
  /// bf16 modes: reduce() and gather_for_metrics() hand fp32 results back as bf16 (env
  /// TANDEM_DOWNCAST_BF16).
  TORCH_ARG(std::optional<bool>, downcast_bf16) = std::nullopt;
  /// bf16-true / fp16-true: prepared loaders cast the floating-point tensors of each batch to
  /// the half dtype of the weights (integer tensors untouched); a loader's own
  /// DataLoaderOptions::cast_floating_inputs overrides this.
  TORCH_ARG(bool, cast_floating_inputs) = true;
  /// Dynamic loss scaling: unset: on for fp16 and fp16-true only; true: on in any mode.
  TORCH_ARG(std::optional<bool>, loss_scaling) = std::nullopt;
  /// The loss scaler of fp16 and fp16-true.
  TORCH_ARG(precision::GradScalerOptions, grad_scaler) = {};
  /// The fp8 recipe (unset: from TANDEM_FP8_* or the defaults).
  TORCH_ARG(std::optional<precision::Fp8Options>, fp8) = std::nullopt;
  /// Rendezvous and collective timeout (PyTorch's default: 30 minutes).
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
  /// Where save_state() puts checkpoints/checkpoint_<n> (Accelerate's ProjectConfiguration).
  TORCH_ARG(std::string, project_dir) = ".";
  /// save_state() without a directory writes project_dir/checkpoints/checkpoint_<n>.
  TORCH_ARG(bool, automatic_checkpoint_naming) = true;
  /// Keep at most this many automatically named checkpoints (oldest removed); 0 keeps all.
  TORCH_ARG(int, total_limit) = 0;
  /// Periodic checkpoints: save_state() (project_dir/checkpoints/checkpoint_<n>, total_limit)
  /// after every N-th optimizer step of the last prepared optimizer; 0: none. Taken inside that
  /// optimizer step (Note [Checkpoints inside the optimizer step]): the prepared schedulers are
  /// stepped once more on load (as the loop steps them after the optimizer); objects the loop
  /// changes after optimizer.step() are saved as they were before the change.
  TORCH_ARG(int64_t, checkpoint_every_steps) = 0;
  /// Periodic checkpoints by time: save_state() after the first optimizer step at least this
  /// many minutes after the last one (or the start); rank 0's clock decides for every rank.
  /// 0: none.
  TORCH_ARG(double, checkpoint_every_minutes) = 0;
  /// The periodic checkpoints are asynchronous (Note [Asynchronous checkpoints]): the state is
  /// copied to host memory at the step and written by a background thread while training goes
  /// on (Accelerator::save_state(SaveOptions().async(true)) for one save).
  TORCH_ARG(bool, checkpoint_async) = false;
  /// Resume from the latest complete checkpoint under project_dir/checkpoints, when there is
  /// one, as the first batch of a prepared loader is asked for (models, optimizers and loaders
  /// are prepared by then): an elastic restart (tandem launch --max_restarts --min_processes)
  /// continues where the lost run's last checkpoint was, on the new world size
  /// (Accelerator::resumed() says what was loaded). A loop without a prepared loader calls
  /// load_state() itself: its first backward with a checkpoint present and nothing loaded is
  /// an error saying so.
  TORCH_ARG(bool, auto_resume) = false;
  /// Note [Preemption]: on SIGTERM (or tandem launch --preemption_signal), every rank finishes
  /// its optimizer step, a checkpoint is saved (project_dir/checkpoints/checkpoint_<n>) and the
  /// process exits with preemption::kExitCode (75) after saying "preempted at step k". Unset: on
  /// when the program checkpoints periodically or sets auto_resume (which continues from it);
  /// false: a signal ends the process as it would without tandem.
  TORCH_ARG(std::optional<bool>, checkpoint_on_preemption) = std::nullopt;
  /// Trackers started by init_trackers: any of "jsonl", "csv", "tensorboard", or "all".
  TORCH_ARG(std::vector<std::string>, log_with) = std::vector<std::string>{"all"};
  /// Where init_trackers writes (<logging_dir>/<project_name>/); empty: project_dir/logs.
  TORCH_ARG(std::string, logging_dir) = "";
  /// Per-rank Chrome-trace timeline written here (env TANDEM_TIMELINE); empty: none.
  TORCH_ARG(std::string, timeline_dir) = "";
  /// Large CPU blocks from tandem's host allocator, which the operating system sees freed
  /// (host_allocator.h, Note [Resident memory and large blocks]; env TANDEM_HOST_ALLOCATOR).
  /// Unset: on (in a build with AddressSanitizer too, where it poisons the pages around each
  /// block and the freed blocks it keeps, so ASan still reports an access past a tensor's end or
  /// to a freed tensor). false: malloc serves every block (e.g. under an LD_PRELOADed jemalloc).
  TORCH_ARG(std::optional<bool>, host_allocator) = std::nullopt;
  /// MB of freed large blocks the host allocator keeps for reuse (env TANDEM_HOST_CACHE_MB;
  /// default 32): what a step asks for again costs no page faults; resident memory is the live
  /// tensors plus at most this.
  TORCH_ARG(std::optional<double>, host_cache_mb) = std::nullopt;
};

}  // namespace tandem
