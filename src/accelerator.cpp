// The Accelerator (see accelerator.h).
#include "tandem/accelerator.h"
#include "detail/names.h"
#include "tandem/error.h"
#include "tandem/nn/module.h"

#include <torch/torch.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <set>
#include <stdexcept>
#include <unordered_set>

#include "tandem/checkpoint/optimizer_state.h"
#include "tandem/checkpoint/training_state.h"
#include "tandem/comm/flight_recorder.h"
#include "tandem/comm/replicas.h"
#include "tandem/config/run_config.h"
#include "tandem/host_allocator.h"
#include "tandem/parallel/activation_checkpoint.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/parallel/expert_parallel.h"
#include "tandem/parallel/tensor_parallel.h"
#include "tandem/runtime.h"

namespace tandem {
namespace {

// The entries of `plan` that match modules of this pipeline stage. Every entry must match on at
// least one stage (counted over `pp`, so every rank agrees and refuses together).
parallel::TensorParallelPlan stage_plan(const parallel::TensorParallelPlan& plan,
                                        torch::nn::Module& stage, ProcessGroup& pp) {
  std::vector<std::string> paths;
  for (const auto& item : stage.named_modules("", /*include_self=*/false))
    paths.push_back(item.key());
  parallel::TensorParallelPlan mine;
  std::vector<int64_t> here;  // this stage's matches per entry
  for (const auto& e : plan.entries) {
    here.push_back(std::count_if(paths.begin(), paths.end(), [&](const std::string& p) {
      return parallel::plan_pattern_matches(e.pattern, p);
    }));
    if (here.back() > 0) mine.add(e);
  }
  auto counts = at::tensor(here, at::kLong);
  pp.allreduce(counts, ReduceOp::kSum);
  std::string unmatched;
  for (size_t i = 0; i < plan.entries.size(); ++i)
    if (counts[static_cast<int64_t>(i)].item<int64_t>() == 0)
      unmatched += (unmatched.empty() ? "'" : ", '") + plan.entries[i].pattern + "'";
  if (!unmatched.empty())
    throw ::tandem::Refused(
        pp.prefix() + " prepare_pipeline: the tensor-parallel plan entr" +
        (unmatched.find(',') == std::string::npos ? "y " : "ies ") + unmatched +
        " match no module of any pipeline stage; stage modules are named by their index in the "
        "Sequential (\"3.attn.qkv\"): write patterns such as \"*.attn.qkv\"");
  return mine;
}

}  // namespace

// Note [The environment is read in one place]: every setting is resolved here, once, from the
// options over one snapshot of the environment; the parts below are built from the result.
Accelerator::Accelerator(AcceleratorOptions options)
    : options_(std::move(options)),
      config_(config::resolve_run_config(options_, current_environment())) {
  const config::RunConfig& run = config_;
  state_ = run.process;
  distributed_type_ = run.distributed_type;
  if (run.debug && state_.rank == 0) std::cerr << config::describe(run);
  device_ = select_device(state_, run.cpu);
  // Note [Resident memory and large blocks]: before the model is built, so that its weights
  // and everything after come from it.
  if (run.host_allocator) {
    HostAllocatorOptions host;
    host.cache_bytes = static_cast<size_t>(run.host_cache_mb * (1 << 20));
    install_host_allocator(host);
  } else if (host_allocator_installed()) {  // an earlier Accelerator of this process: hand over
    HostAllocatorOptions host;
    host.threshold = SIZE_MAX;
    host.cache_bytes = 0;
    install_host_allocator(host);
  }
  // The profile counts from here: before the model, after the allocator it serves from.
  if (!run.profile.empty())
    profile_ = std::make_unique<track::RunProfile>(run.profile, state_.rank, state_.world_size);
  accumulation_steps_ = run.gradient_accumulation_steps;
  if (run.num_threads) torch::set_num_threads(*run.num_threads);
  // Refuses impossible modes before joining the job.
  make_precision_ = [options = precision::MixedPrecisionOptions()
                                 .mode(run.mixed_precision)
                                 .master_weights(options_.master_weights())
                                 .downcast_bf16(run.downcast_bf16)
                                 .loss_scaling(options_.loss_scaling())
                                 .grad_scaler(options_.grad_scaler())
                                 .fp8(run.fp8),
                     type = device_.type(), prefix = state_.prefix()] {
    return std::make_unique<precision::MixedPrecision>(options, type, prefix);
  };
  precision_ = make_precision_();
  // Said once per job, by the main process: the slowest mistake a CPU run can make.
  if (state_.rank == 0 && device_.is_cpu()) {
    const auto runtime = cpu_runtime();
    for (const auto& w : {reference_blas_warning(runtime), blas_kernels_warning(runtime)})
      if (!w.empty()) std::cerr << w << std::endl;
  }
  const comm::MeshShape& shape = run.mesh_shape;  // resolved against the world
  // Every layout tandem cannot run (Note [Pipelines and ZeRO], dp sizes no strategy honours)
  // was refused by resolve_run_config, before the process group is built.
  pg_ = ProcessGroup::create(state_, ProcessGroupOptions().timeout(options_.timeout()));
  // Note [A topology always built]: every run, sizes of 1 included; its groups say where each
  // kind of work runs.
  topology_ = std::make_unique<parallel::Topology>(pg_, shape, state_.local_world_size);
  context_parallel_ = std::make_shared<parallel::ContextParallel>(
      topology_->context_parallel(),
      parallel::context_parallel_comm_from_name(run.cp_comm, "cp_comm_strategy"));
  expert_parallel_ = make_expert_parallel(run);
  topology_->set_ep(expert_parallel_->size());
  activation_checkpointing_ = run.activation_checkpointing;
  parallel::StrategyContext ctx;
  ctx.pg = topology_->replicas();  // Note [Context parallel]: dp x cp
  ctx.shard_pg = topology_->sharding();
  ctx.replicate_pg = topology_->group("dp_replicate");
  ctx.device = device_;
  ctx.master_weights = precision_->policy().master_weights;
  ctx.reducer = parallel::ReducerOptions()
                    .bucket_cap_mb(run.bucket_cap_mb)
                    .first_bucket_cap_mb(run.first_bucket_cap_mb)
                    .find_unused_parameters(options_.find_unused_parameters())
                    .comm_hook(parallel::comm_hook_from_name(run.comm_hook))
                    .gradient_as_bucket_view(run.gradient_as_bucket_view);
  make_strategy_ = [type = distributed_type_, sharding = run.sharding, ctx] {
    return parallel::make_strategy(type, sharding, ctx);
  };
  strategy_ = make_strategy_();
  recorder_ = std::make_unique<track::RunRecorder>(
      track::RunRecorderOptions()
          .rank(state_.rank)
          .main_process(is_main_process())
          .log_with(options_.log_with())
          .logging_dir(options_.logging_dir().empty()
                           ? (std::filesystem::path(options_.project_dir()) / "logs").string()
                           : options_.logging_dir())
          .timeline_dir(run.timeline_dir),
      loader_state_.get());
  strategy_->record_comm_spans(recorder_->timeline().enabled());
  if (options_.seed()) set_seed(*options_.seed());
  TANDEM_CHECK(options_.checkpoint_every_steps() >= 0 && options_.checkpoint_every_minutes() >= 0,
              state_.prefix(), " AcceleratorOptions: checkpoint_every_steps (",
              options_.checkpoint_every_steps(), ") and checkpoint_every_minutes (",
              options_.checkpoint_every_minutes(), ") must be at least 0 (0: no periodic checkpoints)");
  TANDEM_CHECK((options_.checkpoint_every_steps() == 0 && options_.checkpoint_every_minutes() == 0) ||
                  options_.automatic_checkpoint_naming(),
              state_.prefix(), " AcceleratorOptions: periodic checkpoints are written as "
              "project_dir/checkpoints/checkpoint_<n>, and automatic_checkpoint_naming is false: "
              "set it to true, or call save_state(dir) yourself");
  if (options_.auto_resume()) {
    auto_resume_pending_ = true;
    loader_state_->before_first_pass = [this] { auto_resume(); };
  }
  if (!state_.replica_store.empty()) start_replicas();  // Note [Replica recovery]
  // Note [Flight recorder]: a failed collective, or SIGUSR2, writes
  // project_dir/flight/rank<r>.json.
  {
    auto& flight = comm::FlightRecorder::instance();
    flight.set_dump_path((std::filesystem::path(options_.project_dir()) / "flight").string(),
                         state_.rank, state_.world_size);
    if (state_.world_size > 1) flight.dump_on_signal(SIGUSR2);
    // Note [Heartbeat]: from here until the Accelerator ends, the launcher watches this rank.
    if (!state_.heartbeat_file.empty())
      flight.beat_to(state_.heartbeat_file, state_.heartbeat_interval_s);
  }
  if (config_.checkpoint_on_preemption)
    preemption_ = std::make_unique<preemption::Watch>(
        std::vector<int>{SIGTERM, config_.preemption_signal});
  // A log always says what ran.
  if (is_main_process()) std::cerr << layout_line() << std::endl;
}

std::string Accelerator::layout_line() const {
  std::ostringstream os;
  os << "tandem: " << state_.world_size << (state_.world_size == 1 ? " process" : " processes")
     << " on " << device_.str() << "; strategy " << strategy_->name();
  if (config_.sharding && config_.sharding->stage() > 0)
    os << " (ZeRO stage " << config_.sharding->stage()
       << (topology_->dp_replicate() > 1
               ? ", hybrid: shards over dp_shard " + std::to_string(topology_->dp_shard()) +
                     ", replicas over dp_replicate " + std::to_string(topology_->dp_replicate())
               : std::string())
       << ")";
  os << "; mesh " << topology_->summary();
  if (expert_parallel_ && expert_parallel_->size() > 1)
    os << " (experts over ep " << expert_parallel_->size()
       << (topology_->cp() > 1 ? " within dp x cp)" : " within dp)");
  os << "; precision " << precision_->policy().name() << "; gradient accumulation "
     << accumulation_steps_ << "; activation checkpointing "
     << (activation_checkpointing_ ? "on" : "off");
  return os.str();
}

// Note [Layouts that must take effect]: with tp (or pp) above 1 every rank holds the whole model
// until the program splits it; trained like that, each rank computes the dense model and the
// layout flag changes nothing (or, under pp, the clipping norm adds every stage's copy). The
// first backward or optimizer step refuses such a run, on every rank alike, naming the flag and
// the call that is missing. A model split by parallel::parallelize_module directly counts too.
void Accelerator::check_model_split(const char* where) {
  if (split_checked_) return;
  const int tp = topology_->tp(), pp = topology_->pp();
  if (tp > 1 && !tp_applied_) {
    for (const auto& m : models_)
      if (!parallel::tensor_parallel_splits(*m).empty()) tp_applied_ = true;
  }
  auto refuse = [&](const std::string& dim, int size, const std::string& missing,
                    const std::string& call) {
    throw ::tandem::Refused(state_.prefix() + " " + where + ": this run has " + dim + " " +
                                std::to_string(size) + " (tandem launch --" + dim +
                                ", parallelism_config " + dim +
                                ", or AcceleratorOptions().parallelism), but " + missing +
                                ": every rank would train the whole model. Call " + call +
                                ", or run without --" + dim);
  };
  if (tp > 1 && !tp_applied_)
    refuse("tp_size", tp, "the model was never split",
           "acc.parallelize(model, plan) before prepare(model) (or prepare_pipeline with a plan)");
  if (pp > 1 && !pipeline_prepared_)
    refuse("pp_size", pp, "no pipeline was prepared",
           "acc.prepare_pipeline(model, loss, options) on the model as a torch::nn::Sequential");
  split_checked_ = true;
}

Accelerator::~Accelerator() {
  // Note [Accelerator lifetime]: prepared loaders and optimizers may outlive the Accelerator.
  // They reach it only through self_ (cleared here) and the loaders' shared LoaderState (whose
  // callback holds the timeline by shared_ptr, never the Accelerator), so that a late use is a
  // clear error or a no-op, never a use of freed memory.
  *self_ = nullptr;
  // Note [Asynchronous checkpoints]: the process does not end before a save in flight is on
  // disk (a failure is said on stderr: a destructor throws nothing).
  if (pending_save_) {
    try {
      wait_for_checkpoint();
    } catch (const std::exception& e) {
      std::cerr << e.what() << std::endl;
    }
  }
  if (!state_.heartbeat_file.empty()) comm::FlightRecorder::instance().stop_beating();
  if (profile_) {
    try {
      profile_->write();
    } catch (const std::exception& e) {
      std::cerr << state_.prefix() << " " << e.what() << std::endl;
    }
  }
  try {
    end_training();  // finishes trackers and writes the timeline, if the user did not
  } catch (const std::exception& e) {
    std::cerr << state_.prefix() << " could not finish the trackers or the timeline: " << e.what()
              << std::endl;
  }
}

void Accelerator::profile_parameters(const torch::nn::Module& model) {
  if (!profile_) return;
  const std::string prefix = models_.size() > 1 ? "model_" + std::to_string(models_.size() - 1) + "." : "";
  // A tied tensor (an embedding and its head) is listed under each module holding it: once here.
  std::set<const void*> seen;
  for (const auto& p : model.named_parameters())
    if (seen.insert(p.value().unsafeGetTensorImpl()).second)
      profile_->add_parameter(prefix + p.key(), p.value().numel(),
                              static_cast<int64_t>(p.value().numel() * p.value().element_size()));
}

void Accelerator::end_training() {
  wait_for_checkpoint();
  recorder_->finish();
}

void Accelerator::free_memory() {
  TANDEM_CHECK(no_sync_depth_ == 0, state_.prefix(),
              " free_memory: called inside no_sync() or accumulate(); leave the scope first");
  wait_for_checkpoint();
  staging_buffers_.reset();  // the host copies of asynchronous saves
  // Note [Accelerator lifetime]: what was prepared before reaches this Accelerator no more; a
  // kept optimizer steps as a plain LibTorch optimizer.
  *self_ = nullptr;
  self_ = std::make_shared<Accelerator*>(this);
  models_.clear();
  optimizers_.clear();
  schedulers_.clear();
  loaders_.clear();
  trainable_at_prepare_.clear();
  scheduler_steps_.clear();
  checkpoint_names_.clear();
  strategy_ = make_strategy_();
  strategy_->record_comm_spans(recorder_->timeline().enabled());
  precision_ = make_precision_();
  tp_applied_ = pipeline_prepared_ = split_checked_ = false;
  topology_->set_pp_virtual_stages(1);
  micro_step_ = 0;
  optimizer_steps_ = 0;
  stepped_in_boundary_.clear();
  unsynced_backwards_ = 0;
  sync_gradients_ = true;
  trim_host_cache();
}

// Note [The transform order]: every path that readies a model for the run applies the same
// steps, in this one order, each where it applies:
//   1. the device;
//   2. tensor parallel: the plan splits the dense layers (prepare_pipeline's plan; a program's
//      acc.parallelize(model, plan) runs 1-2 itself, before prepare);
//   3. precision: the weights' dtype, fp8 modules;
//   4. activation checkpointing: wrappers around the blocks, whose modules are final by now;
//   5. rank 0's weights and buffers, broadcast over the data-parallel group;
//   6. the strategy: ZeRO-3 units and shards, data-parallel hooks, over the weights as they
//      will train.
// prepare runs 1 and 3-6 on the model; build's sharded construction 1, 3, 5 and 6 on each block
// as it is built (tensor parallel is refused there, and prepare checkpoints the blocks);
// prepare_pipeline 1-5 on its stage (a pipeline reduces its stage's gradients itself).
struct Accelerator::Transforms {
  const parallel::TensorParallelPlan* tp_plan = nullptr;  // 2, when it has entries
  bool checkpoint_blocks = false;                          // 4: the model's blocks
  torch::nn::Sequential* checkpoint_entries = nullptr;     // 4: a pipeline stage's entries
  std::function<void(torch::nn::Module&)> strategy;        // 6
};

void Accelerator::apply_transforms(torch::nn::Module& model, const Transforms& t) {
  model.to(device_);
  if (t.tp_plan && !t.tp_plan->entries.empty()) {
    parallel::parallelize_module(model, topology_->group("tp"), *t.tp_plan);
    tp_applied_ = true;
  }
  precision_->cast_model(model);
  if (activation_checkpointing_) {
    // The model's blocks (Sequential entries, TANDEM_MODULE types, or the classes of
    // fsdp_transformer_layer_cls_to_wrap); under ZeRO-3 the same blocks are units.
    if (t.checkpoint_entries)
      parallel::checkpoint_sequential_entries(*t.checkpoint_entries);
    else if (t.checkpoint_blocks)
      parallel::checkpoint_model_blocks(
          model, config_.sharding ? config_.sharding->transformer_layer_cls_to_wrap()
                                  : std::vector<std::string>{});
  }
  if (const auto held = parallel::held_experts(model)) {
    // Note [Expert parallel]: an expert's replicas start from their first one's copy; every
    // other tensor from rank 0's.
    auto expert = [&held](const at::Tensor& t) { return held.contains(t); };
    parallel::broadcast_module_state(model, *topology_->replicas(), true, true,
                                     [&](const at::Tensor& t) { return !expert(t); });
    parallel::broadcast_module_state(model, *held.ep->replicas(), true, false, expert);
  } else {
    parallel::broadcast_module_state(model, *topology_->replicas(), true, true);
  }
  if (t.strategy) t.strategy(model);
}

// Note [Expert parallel]: ep consecutive data-parallel ranks (dp x cp with context parallel) per
// ep group, the ranks with one ep coordinate a replica group; the layouts it does not compose with
// yet refused by name.
std::shared_ptr<parallel::ExpertParallel> Accelerator::make_expert_parallel(
    const config::RunConfig& run) {
  const int ep = run.ep_size;
  if (ep <= 1) return std::make_shared<parallel::ExpertParallel>(nullptr, nullptr, 1);
  auto refuse = [&](const std::string& what) {
    throw ::tandem::Refused(state_.prefix() + " expert parallel (ep_size " + std::to_string(ep) +
                            ") " + what);
  };
  // Under tp every tp rank holds its experts whole (their input is whole): ep groups are carved
  // from the dp ranks of each tp coordinate, and under a pipeline from those of each stage (Note
  // [Expert parallel beside a pipeline]).
  // Under ZeRO the experts stay whole (reduced over their replicas) and the rest is sharded over
  // dp; hybrid sharding's two levels and optimizer state on disk do not know the experts yet.
  if (run.sharding && run.sharding->stage() > 0 && topology_->dp_replicate() > 1)
    refuse("does not combine with hybrid sharding (dp_replicate " +
           std::to_string(topology_->dp_replicate()) + " x dp_shard " +
           std::to_string(topology_->dp_shard()) + ") in tandem yet; shard over every "
           "data-parallel rank (FULL_SHARD, or DeepSpeed's ZeRO) or run plain data parallel");
  if (run.sharding && !run.sharding->nvme_path().empty())
    refuse("does not combine with optimizer state on disk (" + run.sharding->origin() +
           ", nvme_path " + run.sharding->nvme_path() + ") in tandem yet; keep the optimizer "
           "state in memory");
  // With context parallel, from dp x cp (as torchtitan): a token is routed wherever its chunk is.
  auto dp = topology_->replicas();
  const int n = dp->size();
  const std::string ranks = topology_->cp() > 1 ? " data- x context-parallel ranks"
                                                : " data-parallel ranks";
  if (n % ep != 0)
    refuse("does not divide the " + std::to_string(n) + ranks + ": the ep groups are carved "
           "from them; give an ep_size that divides " + std::to_string(n));
  // Every rank of dp builds every group, in the same order (ProcessGroup::new_subgroup).
  std::shared_ptr<ProcessGroup> group, replicas;
  for (int g = 0; g < n / ep; ++g) {
    std::vector<int> ranks;
    for (int j = 0; j < ep; ++j) ranks.push_back(dp->global_rank(g * ep + j));
    std::sort(ranks.begin(), ranks.end());
    if (auto sub = dp->new_subgroup(ranks)) group = sub;
  }
  for (int j = 0; j < ep; ++j) {
    std::vector<int> ranks;
    for (int g = 0; g < n / ep; ++g) ranks.push_back(dp->global_rank(g * ep + j));
    std::sort(ranks.begin(), ranks.end());
    if (ranks.size() == 1) {
      if (ranks[0] == state_.rank) replicas = ProcessGroup::single();
      continue;
    }
    if (auto sub = dp->new_subgroup(ranks)) replicas = sub;
  }
  return std::make_shared<parallel::ExpertParallel>(group, replicas, n);
}

std::shared_ptr<torch::nn::Module> Accelerator::prepare_model(
    std::shared_ptr<torch::nn::Module> model) {
  TANDEM_CHECK(model, state_.prefix(), " prepare: the model is null");
  for (const auto& m : models_)
    TANDEM_CHECK(m.get() != model.get(), state_.prefix(),
                " prepare: this model was already prepared; prepare each model once");
  // Note [Context parallel]: the model splits its sequences itself, or cannot run under cp.
  if (context_parallel_->size() > 1) {
    auto* splits = dynamic_cast<parallel::ContextParallelModel*>(model.get());
    if (!splits)
      throw ::tandem::Refused(
          state_.prefix() + " prepare: this run has cp_size " +
          std::to_string(context_parallel_->size()) +
          " (tandem launch --cp_size, or parallelism_config cp_size), but the model (" +
          model->name() + ") does not split its sequences over the context-parallel ranks: "
          "every rank would compute whole sequences. Use a model that implements "
          "tandem::parallel::ContextParallelModel (tandem::models::LlamaForCausalLM does), or "
          "run without --cp_size");
    splits->set_context_parallel(context_parallel_);
  }
  // Note [Expert parallel]: the model keeps its experts before the strategy sees its parameters.
  if (expert_parallel_->size() > 1) {
    auto* experts = dynamic_cast<parallel::ExpertParallelModel*>(model.get());
    if (!experts)
      throw ::tandem::Refused(
          state_.prefix() + " prepare: this run has ep_size " +
          std::to_string(expert_parallel_->size()) +
          " (tandem launch --ep_size, or parallelism_config ep_size), but the model (" +
          model->name() + ") does not split its experts over the expert-parallel ranks. Use a "
          "model that implements tandem::parallel::ExpertParallelModel "
          "(tandem::models::LlamaForCausalLM does), or run without --ep_size");
    experts->set_expert_parallel(expert_parallel_);
  }
  Transforms steps;
  steps.checkpoint_blocks = true;
  steps.strategy = [this, &model](torch::nn::Module&) { strategy_->prepare_model(model); };
  apply_transforms(*model, steps);
  models_.push_back(model);
  for (const auto& p : model->parameters())
    if (p.requires_grad()) trainable_at_prepare_.insert(p.unsafeGetTensorImpl());
  profile_parameters(*model);
  trim_host_cache();  // the flattening's sizes do not come again
  return model;
}

std::shared_ptr<nn::detail::BuildScope> Accelerator::begin_build(bool root_hookable) {
  auto* sharding = strategy_->parameter_sharding();
  if (!sharding) return nullptr;
  TANDEM_CHECK(topology_->tp() == 1, state_.prefix(),
              " build: this run is tensor parallel (tp_size ", topology_->tp(),
              "), and parallelize splits the dense layers, which a model sharded while it is "
              "built no longer has; construct the model directly (GPT(cfg) instead of "
              "acc.build(...)) and parallelize it before prepare");
  // Note [Sharded construction]: the outermost hookable modules under the model are the
  // candidates (the model itself when hookable is not: prepare's policy never makes the root a
  // unit); each is brought to where prepare would bring it, then sharded.
  auto on_built = [this, sharding](torch::nn::Module& m, bool explicit_unit) {
    if (!sharding->unit_at_construction(m, explicit_unit)) return;
    Transforms steps;
    steps.strategy = [sharding](torch::nn::Module& unit) { sharding->shard_built(unit); };
    apply_transforms(m, steps);
    trim_host_cache();  // the dense block's memory goes back now, before the next is built
  };
  return std::make_shared<nn::detail::BuildScope>(root_hookable ? 1 : 0, on_built);
}

void Accelerator::end_build(const std::shared_ptr<nn::detail::BuildScope>& scope) {
  if (!scope) return;
  scope->finish();
  trim_host_cache();
}

void Accelerator::parallelize(torch::nn::Module& model, const parallel::TensorParallelPlan& plan) {
  TANDEM_CHECK(topology_->tp() > 1, state_.prefix(),
              " parallelize: this run has no tensor-parallel dimension; set tp_size (tandem launch "
              "--tp_size, parallelism_config_tp_size, or AcceleratorOptions().parallelism)");
  model.to(device_);
  parallel::parallelize_module(model, topology_->group("tp"), plan);
  tp_applied_ = true;
}

std::shared_ptr<parallel::Pipeline> Accelerator::prepare_pipeline(
    torch::nn::Sequential model, parallel::Pipeline::Loss loss, parallel::PipelineOptions options) {
  return prepare_pipeline(std::move(model), std::move(loss), options, parallel::TensorParallelPlan());
}

std::shared_ptr<parallel::Pipeline> Accelerator::prepare_pipeline(
    torch::nn::Sequential model, parallel::Pipeline::Loss loss, parallel::PipelineOptions options,
    const parallel::TensorParallelPlan& plan) {
  TANDEM_CHECK(topology_->pp() > 1, state_.prefix(),
              " prepare_pipeline: this run has no pipeline dimension; set pp_size (tandem launch "
              "--pp_size, parallelism_config pp_size, or AcceleratorOptions().parallelism)");
  // Note [Pipelines and ZeRO]: a run with both is refused by resolve_run_config.
  // The pipeline's micro-batches are its accumulation: Pipeline::step neither divides its loss
  // by gradient_accumulation_steps nor defers its data-parallel reduction.
  if (accumulation_steps_ != 1)
    throw ::tandem::Refused(
        state_.prefix() + " prepare_pipeline: gradient_accumulation_steps is " +
        std::to_string(accumulation_steps_) +
        " (--gradient_accumulation_steps, or AcceleratorOptions()), but a pipeline step does not "
        "accumulate across calls; give the pipeline more micro-batches instead "
        "(PipelineOptions().microbatches, over a larger batch) and leave "
        "gradient_accumulation_steps at 1");
  // The schedule and the stages per rank: the program's PipelineOptions, else the run's
  // (--pp_schedule, --pp_virtual_stages); both set and different is refused.
  if (options.schedule() && !config_.pp_schedule.empty() &&
      parallel::to_string(*options.schedule()) != config_.pp_schedule)
    throw ::tandem::Refused(state_.prefix() + " prepare_pipeline: the program asks for the " +
                            parallel::to_string(*options.schedule()) +
                            " schedule (PipelineOptions().schedule) and the run for " +
                            config_.pp_schedule + " (--pp_schedule, parallelism_config "
                            "pp_schedule): drop one of the two");
  if (options.virtual_stages() && config_.pp_virtual_stages > 0 &&
      *options.virtual_stages() != config_.pp_virtual_stages)
    throw ::tandem::Refused(state_.prefix() + " prepare_pipeline: the program asks for " +
                            std::to_string(*options.virtual_stages()) +
                            " stages per rank (PipelineOptions().virtual_stages) and the run for " +
                            std::to_string(config_.pp_virtual_stages) +
                            " (--pp_virtual_stages, parallelism_config pp_virtual_stages): drop "
                            "one of the two");
  if (!options.schedule() && !config_.pp_schedule.empty())
    options.schedule(parallel::schedule_from_name(config_.pp_schedule, "pp_schedule"));
  if (!options.virtual_stages() && config_.pp_virtual_stages > 0)
    options.virtual_stages(config_.pp_virtual_stages);
  // Note [Input and weight gradients]: a checkpointed region refuses backward with inputs= (its
  // recompute accumulates into every .grad), so the zero-bubble split cannot run through one.
  if (options.schedule() == parallel::ScheduleKind::kZeroBubble && activation_checkpointing_)
    throw ::tandem::Refused(
        state_.prefix() + " prepare_pipeline: the zero-bubble schedule computes input and weight "
        "gradients apart (backward with inputs=), which activation checkpointing's "
        "recomputation cannot serve (--activation_checkpointing, or AcceleratorOptions()"
        ".activation_checkpointing); use the 1f1b or interleaved_1f1b schedule with it, or turn "
        "activation checkpointing off");
  // The refusals above come before any group is used: every rank refuses alike, none waits.
  auto pp = topology_->group("pp");
  auto dp = topology_->replicas();
  const int v = options.virtual_stages().value_or(1), p = pp->size(), r = pp->rank();
  topology_->set_pp_virtual_stages(v);
  // Note [Interleaved stages]: with v stages per rank the model is split into p v stages of
  // consecutive entries (split_sequential's balance), and rank r holds stages r, r + p, ...,
  // r + (v - 1) p (looped placement, as Megatron and torchtitan place them). The rank's stage
  // module is one Sequential of all their entries under the whole model's names (one module for
  // the optimizer, the gradient reduction and checkpoints, which find each parameter by name);
  // each stage's forward runs its own entries, taken from that Sequential after the transforms
  // (activation checkpointing replaces entries).
  torch::nn::Sequential stage;
  std::vector<size_t> chunk_sizes;
  if (v == 1) {
    stage = parallel::split_sequential(model, p, r);
    chunk_sizes.push_back(stage->size());
  } else {
    const int64_t n = static_cast<int64_t>(model->size()), S = static_cast<int64_t>(p) * v;
    TANDEM_CHECK(n >= S, state_.prefix(), " prepare_pipeline: ", n, " entries of the model for ",
                 p, " ranks x ", v, " stages per rank = ", S,
                 " stages: every stage needs at least one entry; use fewer virtual stages "
                 "(--pp_virtual_stages) or split the model into more entries");
    for (int c = 0; c < v; ++c) {
      auto part = parallel::split_sequential(model, static_cast<int>(S), c * p + r);
      const auto named = part->named_children();
      for (size_t i = 0; i < named.size(); ++i)
        stage->push_back(named[i].key(), *(part->begin() + static_cast<std::ptrdiff_t>(i)));
      chunk_sizes.push_back(part->size());
    }
  }
  TANDEM_CHECK(plan.entries.empty() || topology_->tp() > 1, state_.prefix(),
              " prepare_pipeline: a tensor-parallel plan was given, but this run has no "
              "tensor-parallel dimension; set tp_size (tandem launch --tp_size, "
              "parallelism_config_tp_size, or AcceleratorOptions().parallelism), or pass no plan");
  // Every rank of pp agrees on the plan's entries before any stage is split (stage_plan counts
  // the matches over pp).
  const auto mine = plan.entries.empty() ? plan : stage_plan(plan, *stage, *pp);
  // Hands the run's group to every layer of the stage that is a `Layer`; every rank refuses
  // alike (the stages count their layers together) a model with none, naming `what`.
  auto hand_to_layers = [&](auto give, const std::string& what) {
    int64_t layers = 0;
    for (const auto& m : stage->modules(/*include_self=*/false))
      if (give(*m)) ++layers;
    auto count = at::full({1}, layers, at::kLong);
    pp->allreduce(count, ReduceOp::kSum);
    if (count.item<int64_t>() == 0)
      throw ::tandem::Refused(state_.prefix() + " prepare_pipeline: this run has " + what);
  };
  // Note [Expert parallel beside a pipeline]: the ranks of an ep group hold the same stage and
  // run the same schedule, so their sparse layers' all-to-alls meet micro-batch by micro-batch,
  // forward and backward (under the zero-bubble schedule the weight pass runs the backward of
  // the all-to-alls it goes through once more, on every rank of the group alike). Every mixture
  // layer of the stage keeps its experts before anything sees its parameters.
  if (expert_parallel_->size() > 1)
    hand_to_layers(
        [this](torch::nn::Module& m) {
          auto* layer = dynamic_cast<parallel::ExpertParallelLayer*>(&m);
          if (layer) layer->keep_experts(expert_parallel_);
          return layer != nullptr;
        },
        "ep_size " + std::to_string(expert_parallel_->size()) +
            " (tandem launch --ep_size, or parallelism_config ep_size), but no stage of the model "
            "holds a layer that splits its experts (tandem::parallel::ExpertParallelLayer, as "
            "tandem::models::LlamaSparseMoe); run without --ep_size");
  // Note [Context parallel beside a pipeline]: the ranks of a cp group hold the same stage and
  // run the same schedule, so their ring attention meets micro-batch by micro-batch; every
  // attention layer of the stage takes the run's ContextParallel, and the program feeds the
  // pipeline this rank's chunks (ContextParallel::shard) and a loss of its chunks (as
  // models::context_parallel_causal_lm_loss). The stage's gradients are averaged over the
  // replicas, which are dp x cp, as without a pipeline.
  if (context_parallel_->size() > 1)
    hand_to_layers(
        [this](torch::nn::Module& m) {
          auto* layer = dynamic_cast<parallel::ContextParallelLayer*>(&m);
          if (layer) layer->set_layer_context_parallel(context_parallel_);
          return layer != nullptr;
        },
        "cp_size " + std::to_string(context_parallel_->size()) +
            " (tandem launch --cp_size, or parallelism_config cp_size), but no stage of the model "
            "holds an attention layer that splits its sequences (tandem::parallel::"
            "ContextParallelLayer, as tandem::models::LlamaAttention); run without --cp_size");
  Transforms steps;
  steps.tp_plan = &mine;
  steps.checkpoint_entries = &stage;
  apply_transforms(*stage, steps);
  pipeline_prepared_ = true;
  models_.push_back(stage.ptr());  // saved and loaded per rank (Note [Model-parallel checkpoints])
  // Note [Trainable parameters are fixed at prepare]: a pipeline reduces whatever gradients its
  // stage has at each step, so any of its parameters may start or stop training later.
  for (const auto& p : stage->parameters()) trainable_at_prepare_.insert(p.unsafeGetTensorImpl());
  if (options.checkpoint_names()) checkpoint_names_[stage.ptr().get()] = options.checkpoint_names();
  options.checkpoint_names(nullptr);  // read here (the Pipeline refuses them)
  profile_parameters(*stage.ptr());
  auto replicas = dp->size() > 1 ? dp : nullptr;
  if (v == 1)
    return std::make_shared<parallel::Pipeline>(stage, pp, std::move(loss), options, replicas);
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  std::vector<parallel::Pipeline::Forward> forwards;
  const auto named = stage->named_children();
  size_t at = 0;
  for (size_t size : chunk_sizes) {
    torch::nn::Sequential chunk;
    for (size_t i = at; i < at + size; ++i)
      chunk->push_back(named[i].key(), *(stage->begin() + static_cast<std::ptrdiff_t>(i)));
    at += size;
    modules.push_back(chunk.ptr());
    forwards.push_back([chunk](const at::Tensor& x) mutable { return chunk->forward(x); });
  }
  return std::make_shared<parallel::Pipeline>(stage.ptr(), std::move(modules),
                                              std::move(forwards), pp, std::move(loss), options,
                                              replicas);
}

AcceleratedOptimizer Accelerator::prepare(std::shared_ptr<torch::optim::Optimizer> optimizer) {
  TANDEM_CHECK(optimizer, state_.prefix(), " prepare: the optimizer is null");
  // Note [Tied parameters in optimizers]: LibTorch's Module::parameters() lists a tensor once
  // per module holding it (a tied embedding and head: twice), where PyTorch's yields it once; an
  // optimizer over such a list steps the tied tensor twice per step (Adam: two updates from one
  // state). Each tensor keeps its first place, as PyTorch's parameters() orders them.
  {
    std::set<const c10::TensorImpl*> seen;
    int64_t dropped = 0;
    for (auto& group : optimizer->param_groups()) {
      auto& params = group.params();
      const auto before = params.size();
      params.erase(std::remove_if(params.begin(), params.end(),
                                  [&seen](const at::Tensor& p) {
                                    return !seen.insert(p.unsafeGetTensorImpl()).second;
                                  }),
                   params.end());
      dropped += static_cast<int64_t>(before - params.size());
    }
    if (dropped > 0 && is_main_process())
      std::cerr << state_.prefix() << " prepare: the optimizer listed " << dropped
                << (dropped == 1 ? " tensor" : " tensors")
                << " more than once (tied weights: Module::parameters() lists a shared tensor "
                   "once per module that holds it); each is stepped once, as in PyTorch"
                << std::endl;
  }
  // LBFGS reads every parameter's whole gradient, several times per step: ZeRO's are shards.
  if (dynamic_cast<torch::optim::LBFGS*>(optimizer.get()) && strategy_->name() != "ddp")
    throw ::tandem::Refused(
        state_.prefix() + " prepare: torch::optim::LBFGS under " + strategy_->name() +
        ": LBFGS reads every parameter's whole gradient and re-evaluates the loss several times "
        "per step, and under ZeRO each rank holds only its shards of the gradients and of the "
        "optimizer; run it under data parallel (without --use_deepspeed / --use_fsdp, or "
        "--zero_stage 0), or use another optimizer");
  // Note [Trainable parameters are fixed at prepare]: ZeRO-1/2 build their units from the
  // parameters that train when the optimizer is prepared.
  if (strategy_->name() == "zero-1" || strategy_->name() == "zero-2")
    for (const auto& m : models_)
      for (const auto& p : m->parameters())
        if (p.requires_grad()) trainable_at_prepare_.insert(p.unsafeGetTensorImpl());
  optimizers_.push_back(optimizer);
  // A sharding strategy makes the optimizer step its shards (fp32 ones for master weights).
  precision_->register_optimizer(*optimizer, strategy_->prepare_optimizer(*optimizer));
  trim_host_cache();
  return AcceleratedOptimizer(std::move(optimizer), self_);
}

std::shared_ptr<torch::optim::LRScheduler> Accelerator::prepare_scheduler(
    std::shared_ptr<torch::optim::LRScheduler> scheduler) {
  TANDEM_CHECK(scheduler, state_.prefix(), " prepare_scheduler: the scheduler is null");
  schedulers_.push_back(scheduler);
  return scheduler;
}

data::detail::Placement Accelerator::placement(const data::DataLoaderOptions& o) {
  data::detail::Placement p;
  p.rank = topology_->data_parallel()->rank();
  p.world = topology_->data_parallel()->size();
  if (replicas_) p.replicas = replica_shard();
  p.device = device_;
  p.even_batches = o.even_batches().value_or(options_.even_batches());
  p.split_batches = o.split_batches().value_or(options_.split_batches());
  // Note [True-half inputs]: under the -true modes the weights are half, and a float batch would
  // stop at the first matmul ("mat1 and mat2 must have the same dtype").
  const auto param_dtype = precision_->policy().param_dtype;
  if (param_dtype != at::kFloat && o.cast_floating_inputs().value_or(options_.cast_floating_inputs()))
    p.floating_dtype = param_dtype;
  return p;
}

void Accelerator::auto_resume() {
  if (!auto_resume_pending_) return;
  auto_resume_pending_ = false;
  loader_state_->before_first_pass = nullptr;
  const auto latest = latest_checkpoint();
  if (latest.empty()) return;  // a first start
  if (is_main_process())
    std::cerr << state_.prefix() << " auto_resume: loading " << latest << std::endl;
  load_state(latest);
}

// Note [Unused parameters known before backward]: the parameters the loss's autograd graph
// reaches (its AccumulateGrad nodes), as PyTorch's DDP finds them from the forward's outputs;
// the reducers mark the others ready before the backward starts. A recomputing node
// (activation checkpointing) hides the parameters it will reach, so then nothing is marked
// before the backward, and each checkpointed module's recompute marks its own (Note [Unused
// parameters in a recompute]); the others are learned at the end of backward.
namespace {
// The leaves (AccumulateGrad nodes) the graph of `roots` reaches; false when it meets a
// recomputing node (activation checkpointing), which hides the parameters it will reach.
bool reached_leaves(const std::vector<at::Tensor>& roots,
                    std::unordered_set<const void*>& reached) {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& r : roots)
    if (r.grad_fn()) stack.push_back(r.grad_fn().get());
  bool whole = true;
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (!node || !seen.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      reached.insert(acc->variable.unsafeGetTensorImpl());
      continue;
    }
    if (node->name().find("Checkpoint") != std::string::npos) whole = false;
    for (const auto& edge : node->next_edges())
      if (edge.function) stack.push_back(edge.function.get());
  }
  return whole;
}

// Returns the leaves the loss's graph reaches outside the checkpointed regions.
std::unordered_set<const void*> prepare_unused_parameters(parallel::Strategy& strategy,
                                                          const at::Tensor& loss) {
  std::unordered_set<const void*> reached;
  if (!loss.requires_grad() || !loss.grad_fn()) return reached;
  if (!reached_leaves({loss}, reached)) return reached;  // Note [Unused parameters in a recompute]
  strategy.prepare_for_backward(
      [&reached](const at::Tensor& p) { return reached.count(p.unsafeGetTensorImpl()) > 0; });
  return reached;
}

// Note [Unused parameters in a recompute]: while a backward runs, each checkpointed region's
// recompute tells the reducers which of its parameters its new graph reaches.
class RegionObserverScope {
 public:
  // `outside`: what the loss's graph reaches outside the regions (a region's parameter used
  // there too, a tied weight, gets its gradient from there).
  RegionObserverScope(parallel::Strategy& strategy, bool active,
                      std::unordered_set<const void*> outside)
      : active_(active) {
    if (!active_) return;
    auto out = std::make_shared<const std::unordered_set<const void*>>(std::move(outside));
    previous_ = parallel::set_recompute_observer(
        [&strategy, out](const std::vector<at::Tensor>& outputs,
                         const std::vector<at::Tensor>& params) {
          std::unordered_set<const void*> reached;
          // A region nested in this one hides its parameters from this walk: mark nothing (its
          // own recompute marks its parameters).
          if (!reached_leaves(outputs, reached)) return;
          strategy.prepare_region_for_backward(params, [&](const at::Tensor& p) {
            return reached.count(p.unsafeGetTensorImpl()) > 0 ||
                   out->count(p.unsafeGetTensorImpl()) > 0;
          });
        });
  }
  ~RegionObserverScope() {
    if (active_) parallel::set_recompute_observer(std::move(previous_));
  }
  RegionObserverScope(const RegionObserverScope&) = delete;
  RegionObserverScope& operator=(const RegionObserverScope&) = delete;

 private:
  bool active_;
  parallel::RecomputeObserver previous_;
};
}  // namespace

void Accelerator::backward(const at::Tensor& loss) {
  TANDEM_CHECK(loss.defined(), state_.prefix(), " backward: the loss is undefined");
  if (auto_resume_pending_) {
    auto_resume_pending_ = false;
    const auto latest = latest_checkpoint();
    TANDEM_CHECK(latest.empty(), state_.prefix(), " auto_resume: the first backward came before "
                "any prepared loader's first batch, so ", latest, " was not loaded and this "
                "step would train from the initial weights; call acc.load_state() before the "
                "loop (or iterate a loader from acc.prepare_data_loader)");
  }
  check_model_split("backward");
  // Note [Replaced parameter storage]: the reducers' hooks follow a parameter torch::load (or
  // set_data) gave new storage. Under ZeRO a parameter is a view of its unit's flat storage
  // (or a shard), which such a load leaves behind: refused, with the calls that load in place.
  for (const auto* r : strategy_->reducers()) {
    const auto moved = const_cast<parallel::GradientReducer*>(r)->follow_replaced_accumulators();
    if (moved.empty() || (strategy_->name() == "ddp" && !precision_->has_master_weights()))
      continue;
    throw ::tandem::Refused(
        state_.prefix() + " backward: the storage of " + ::tandem::detail::first_names(moved, 10) +
        " was replaced after acc.prepare(model) (torch::load into the prepared model, or "
        "set_data); " +
        (strategy_->name() == "ddp"
             ? std::string("the optimizer steps fp32 masters of these half weights, which the "
                           "next step would copy back over what was loaded")
             : "under " + strategy_->name() +
                   " every parameter is a view of its unit's flat "
                   "storage, which that leaves behind") +
        ". Load weights in place: acc.load_state, acc.load_model, or "
        "tandem::checkpoint::load_model before acc.prepare(model)");
  }
  auto l = precision_->loss_for_backward(loss, accumulation_steps_);
  const auto begin = track::Timeline::Clock::now();
  const bool synchronised = sync_gradients_ && no_sync_depth_ == 0;
  if (!synchronised) ++unsynced_backwards_;
  // Only a synchronised backward reduces; expert-parallel reducers find unused experts whatever
  // the options say.
  const bool find_unused =
      synchronised && (options_.find_unused_parameters() || expert_parallel_->size() > 1);
  std::unordered_set<const void*> outside;
  if (find_unused) outside = prepare_unused_parameters(*strategy_, l);
  try {
    RegionObserverScope regions(*strategy_, find_unused, std::move(outside));
    auto no_autocast = autocast(false);
    l.backward();
  } catch (const c10::Error& e) {
    // Note [Buffers written around autograd]: tandem's own writes into a prepared model
    // between a forward and its backward (buffer broadcasts after optimizer steps, ZeRO's
    // gathers and updates into flat storage) do not count as in-place modifications, so when
    // autograd finds one, the program made it; say where to look.
    const std::string what = e.what();
    if (what.find("modified by an inplace operation") == std::string::npos) throw;
    TANDEM_CHECK(false,
        state_.prefix() + " backward: " + what.substr(0, what.find("\nException raised from")) +
        "\n(tandem writes buffers and sharded parameters around autograd's version counters, so "
        "the modification is the program's: usually an optimizer step or an in-place op on "
        "a tensor between its forward and this backward, e.g. stepping one model's optimizer "
        "before the backward of a loss that still goes through its weights; step after the "
        "backward, or recompute the forward)");
  }
  strategy_->after_backward();
  recorder_->record_backward(begin, track::Timeline::Clock::now(), strategy_->reducers());
  // ZeRO-3's all-gathers since the last backward, its forward's included (Note [Prefetching
  // units]): on a track of their own, and the computation's waits for them on its own.
  for (const auto& span : strategy_->take_comm_spans())
    recorder_->timeline().record(span.name, span.wait ? "wait" : "comm", span.start, span.end,
                                 span.wait ? -1 : 2);
}

Accelerator::AccumulateScope Accelerator::accumulate() {
  ++micro_step_;
  sync_gradients_ = micro_step_ % accumulation_steps_ == 0 || loader_state_->end_of_dataloader;
  if (sync_gradients_) micro_step_ = 0;
  if (no_sync_depth_ == 0) strategy_->set_sync(sync_gradients_);
  return AccumulateScope(this, autocast());
}

Accelerator::NoSyncScope::NoSyncScope(Accelerator* acc) : acc_(acc) {
  if (acc_->no_sync_depth_++ == 0) acc_->strategy_->set_sync(false);
}

Accelerator::NoSyncScope::~NoSyncScope() {
  if (acc_ && --acc_->no_sync_depth_ == 0) acc_->strategy_->set_sync(acc_->sync_gradients_);
}

Accelerator::NoSyncScope Accelerator::no_sync() { return NoSyncScope(this); }

Accelerator::FullParamsScope::FullParamsScope(Accelerator* acc) : acc_(acc) {
  if (auto* sharding = acc_->strategy_->parameter_sharding()) sharding->gather_units();
}

Accelerator::FullParamsScope::~FullParamsScope() {
  if (!acc_) return;
  if (auto* sharding = acc_->strategy_->parameter_sharding()) sharding->release_units();
}

Accelerator::FullParamsScope Accelerator::summon_full_params() { return FullParamsScope(this); }

double Accelerator::clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                                    double norm_type) {
  if (!sync_gradients_) return 0.0;
  unscale_gradients();
  auto no_autocast = autocast(false);
  // Note [Clipping under model parallel]: the whole model's norm, across the topology.
  return parallel::clip_grad_norm(*topology_, *strategy_, precision_->grads_to_clip(parameters),
                                  models_, max_norm, norm_type);
}

void Accelerator::clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value) {
  if (!sync_gradients_) return;
  unscale_gradients();
  auto no_autocast = autocast(false);
  if (strategy_->clip_grad_value(clip_value)) return;
  torch::nn::utils::clip_grad_value_(precision_->grads_to_clip(parameters), clip_value);
}

at::Tensor Accelerator::gather_for_metrics(const at::Tensor& tensor) {
  auto t = tensor;
  const auto& st = *loader_state_;
  if (t.dim() > 0 && st.valid_rows >= 0 && st.valid_rows < st.batch_rows &&
      t.size(0) == st.batch_rows)
    t = t.narrow(0, 0, st.valid_rows);
  return precision_->metric_result(comm::gather(*topology_->metrics(), precision_->metric_input(t)));
}

std::tuple<int64_t, int64_t, int64_t> Accelerator::split_range(int64_t rows,
                                                               bool apply_padding) const {
  // Accelerate's split: ranks in order, the first rows % ranks one row more.
  const auto& group = *topology_->metrics();
  const int64_t n = group.size(), r = group.rank();
  const int64_t base = rows / n, extra = rows % n;
  const int64_t begin = r * base + std::min(r, extra);
  const int64_t end = begin + base + (r < extra ? 1 : 0);
  return {begin, end, apply_padding ? base + (extra > 0 ? 1 : 0) : end - begin};
}

at::Tensor Accelerator::split_between_processes(const at::Tensor& inputs,
                                                bool apply_padding) const {
  TANDEM_CHECK(inputs.dim() > 0, state_.prefix(),
              " split_between_processes: expected a tensor with a first dimension to split, "
              "found a scalar; pass a tensor of shape [n, ...]");
  const auto [begin, end, padded] = split_range(inputs.size(0), apply_padding);
  auto mine = inputs.narrow(0, begin, end - begin);
  if (padded > end - begin && end > begin) {
    std::vector<at::Tensor> parts{mine};
    for (int64_t k = end - begin; k < padded; ++k) parts.push_back(mine.narrow(0, end - begin - 1, 1));
    mine = at::cat(parts);
  }
  return mine;
}

at::Tensor Accelerator::reduce(const at::Tensor& tensor, ReduceOp op) {
  return precision_->metric_result(
      comm::reduce(*topology_->metrics(), precision_->metric_input(tensor), op));
}

void Accelerator::unscale_gradients() {
  if (sync_gradients_) precision_->unscale_gradients(pg_.get());
}

void Accelerator::set_seed(uint64_t seed, bool device_specific) {
  if (device_specific) seed += static_cast<uint64_t>(state_.rank);
  torch::manual_seed(seed);
  if (torch::cuda::is_available()) torch::cuda::manual_seed_all(seed);
}

void Accelerator::clip_before_step(torch::optim::Optimizer& optimizer) {
  const double max_norm = config_.gradient_clipping.value_or(0.0);
  if (max_norm <= 0) return;
  std::vector<at::Tensor> params;
  for (const auto& g : optimizer.param_groups())
    params.insert(params.end(), g.params().begin(), g.params().end());
  clip_grad_norm_(params, max_norm);
}

// Note [Trainable parameters are fixed at prepare]: data parallel's buckets, ZeRO's shards and a
// pipeline's gradient sync are built over the parameters that required gradients when their
// model was prepared, as PyTorch's DDP and FSDP are. A parameter that requires gradients only
// later would train on each rank alone (data parallel: the replicas drift apart) or not at all
// (ZeRO: no shard of the optimizer holds it), without a word; the optimizer step refuses it,
// naming it. One process under data parallel reduces nothing and trains it as LibTorch does.
void Accelerator::check_trainable_parameters(const char* where) const {
  if (strategy_->name() == "ddp" && topology_->replicas()->size() == 1) return;
  int64_t count = 0;
  for (const auto& m : models_)
    for (const auto& p : m->parameters())
      count += p.requires_grad() && !trainable_at_prepare_.count(p.unsafeGetTensorImpl());
  if (count == 0) return;
  std::vector<std::string> made_trainable;
  for (const auto& m : models_)
    for (const auto& p : m->named_parameters())
      if (p.value().requires_grad() &&
          !trainable_at_prepare_.count(p.value().unsafeGetTensorImpl()))
        made_trainable.push_back(p.key());
  const std::string names = ::tandem::detail::first_names(made_trainable, 10);
  throw ::tandem::Refused(
      state_.prefix() + " " + where + ": these parameters require gradients now but did not "
      "when acc.prepare(model) ran: " + names + ". " + strategy_->name() + " over " +
      std::to_string(topology_->replicas()->size()) + " replicas reduces (and shards) the "
      "parameters that trained when the model was prepared, so these would train on each rank "
      "alone or not at all. Make them require gradients before acc.prepare(model); while they "
      "should not train, give their parameter group a learning rate of 0 (or leave them out of "
      "the loss with AcceleratorOptions().find_unused_parameters(true))");
}

void Accelerator::after_optimizer_step(const torch::optim::Optimizer& optimizer) {
  // One boundary however many optimizers step in it (a GAN's two); an optimizer that steps
  // again begins the next.
  if (stepped_in_boundary_.empty() ||
      std::find(stepped_in_boundary_.begin(), stepped_in_boundary_.end(), &optimizer) !=
          stepped_in_boundary_.end()) {
    ++optimizer_steps_;
    stepped_in_boundary_.clear();
    // Note [Schedulers step with the optimizer]: a LibTorch scheduler counts its own step()
    // calls; stepped on every micro-batch under accumulation, its schedule runs that many times
    // faster than the optimizer's steps (Accelerate's prepared scheduler skips the micro-steps;
    // a LibTorch scheduler's step cannot be intercepted). Said once, with the fix.
    for (const auto& s : schedulers_) {
      const unsigned now = checkpoint::scheduler_step_count(*s);
      auto [it, fresh] = scheduler_steps_.try_emplace(s.get(), now);
      const unsigned steps = now >= it->second ? now - it->second : 0;  // 0: a load set it back
      it->second = now;
      if (fresh || accumulation_steps_ <= 1 || steps <= 1 || scheduler_warned_) continue;
      scheduler_warned_ = true;
      if (is_main_process())
        std::cerr << state_.prefix() << " a prepared learning-rate scheduler stepped " << steps
                  << " times in one optimizer step under gradient_accumulation_steps "
                  << accumulation_steps_ << ": stepped on every micro-batch, its schedule runs "
                  << steps << " times faster than the optimizer's steps. Step it only when "
                     "acc.sync_gradients() is true (as Accelerate's prepared scheduler does)"
                  << std::endl;
    }
  }
  stepped_in_boundary_.push_back(&optimizer);
  if (options_.broadcast_buffers())
    for (auto& m : models_)
      parallel::broadcast_module_state(*m, *topology_->replicas(), false, true);
  // Periodic checkpoints, once every optimizer of the step has stepped (the last prepared one).
  // Note [Checkpoints inside the optimizer step]: taken here, inside the step.
  if (optimizers_.empty() || optimizers_.back().get() != &optimizer) return;
  if (profile_) profile_->step();
  stop_if_preempted();
  bool due = options_.checkpoint_every_steps() > 0 &&
             optimizer_steps_ % options_.checkpoint_every_steps() == 0;
  if (!due && options_.checkpoint_every_minutes() > 0) {
    // Rank 0's clock decides, so that every rank saves at the same step.
    const double minutes = std::chrono::duration<double, std::ratio<60>>(
                               std::chrono::steady_clock::now() - last_checkpoint_)
                               .count();
    auto flag = at::full({1}, minutes >= options_.checkpoint_every_minutes() ? 1 : 0, at::kInt);
    pg_->broadcast(flag, 0);
    due = flag.item<int>() == 1;
  }
  if (!due) return;
  save_inside_step(SaveOptions().async(options_.checkpoint_async()));
  last_checkpoint_ = std::chrono::steady_clock::now();
}

// Note [Checkpoints inside the optimizer step] (src/accelerator_state.cpp).
std::string Accelerator::save_inside_step(const SaveOptions& options) {
  saving_inside_step_ = true;
  try {
    auto dir = save_state(options);
    saving_inside_step_ = false;
    return dir;
  } catch (...) {
    saving_inside_step_ = false;
    throw;
  }
}

// Note [Preemption]: every rank learns at the same step boundary whether any rank was signalled
// (the launcher forwards a signal to all, but each receives it in its own step), so that they
// save and stop together.
void Accelerator::stop_if_preempted() {
  if (!preemption_) return;
  int signal = preemption::Watch::received();
  if (state_.world_size > 1) {
    auto flag = at::full({1}, signal, at::kInt);
    pg_->allreduce(flag, ReduceOp::kMax);
    signal = flag.item<int>();
  }
  if (signal == 0) return;
  const auto step = optimizer_steps_;
  if (is_main_process())
    std::cerr << state_.prefix() << " preempted (" << preemption::signal_name(signal)
              << ") at step " << step << ": saving a checkpoint" << std::endl;
  const auto dir = save_inside_step(SaveOptions());
  if (is_main_process())
    std::cerr << state_.prefix() << " preempted at step " << step << ": saved " << dir
              << "; exiting with code " << preemption::kExitCode
              << " (auto_resume continues from it)" << std::endl;
  try {
    if (profile_) profile_->write();
    end_training();
  } catch (const std::exception& e) {
    std::cerr << state_.prefix() << " could not finish the trackers or the timeline: " << e.what()
              << std::endl;
  }
  wait_for_everyone();
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  // The checkpoint is complete on every rank; the program's own code after the step is not
  // run (as a SIGTERM's default would not run it either).
  ::_exit(preemption::kExitCode);
}

Accelerator::MainProcessFirst::MainProcessFirst(Accelerator* acc) : acc_(acc) {
  if (!acc_->is_main_process()) acc_->wait_for_everyone();
}

Accelerator::MainProcessFirst::~MainProcessFirst() {
  if (acc_->is_main_process()) acc_->wait_for_everyone();
}

Accelerator* AcceleratedOptimizer::owner() const {
  if (!owner_) return nullptr;
  TANDEM_CHECK(*owner_ != nullptr,
              "AcceleratedOptimizer: the Accelerator that prepared this optimizer was destroyed; "
              "keep the Accelerator alive for as long as its prepared optimizers are used (or step "
              "the plain optimizer through optimizer())");
  return *owner_;
}

void AcceleratedOptimizer::step() {
  Accelerator* acc = owner();
  if (acc) acc->check_model_split("optimizer step");
  skipped_ = acc && !acc->sync_gradients();
  if (skipped_) return;
  if (acc) acc->unsynced_backwards_ = 0;  // the boundary's step (even one skipped for overflow)
  if (acc && acc->replicas_) acc->average_over_replicas(*optimizer_);  // Note [Replica recovery]
  if (acc && acc->sync_gradients() && !acc->precision_->before_step(acc->pg_.get())) {  // inf/NaN on some rank: every rank skips
    skipped_ = true;
    // Note [Schedulers step with the optimizer]: the boundary happened; a scheduler stepped on
    // it is not stepping on micro-batches.
    for (const auto& sched : acc->schedulers_)
      acc->scheduler_steps_[sched.get()] = checkpoint::scheduler_step_count(*sched);
    return;
  }
  if (acc) acc->check_trainable_parameters("optimizer step");
  if (acc) acc->clip_before_step(*optimizer_);
  {
    auto span = acc ? acc->timeline().scope("optimizer step", "compute") : track::Timeline::Scope();
    auto no_autocast = acc ? acc->autocast(false) : precision::AutocastGuard();
    if (acc)
      acc->strategy_->step(*optimizer_);
    else
      optimizer_->step();
  }
  if (acc) {
    acc->precision_->after_step(*optimizer_);
    acc->strategy_->after_step(*optimizer_);
    acc->after_optimizer_step(*optimizer_);
  }
}

at::Tensor AcceleratedOptimizer::step(const torch::optim::Optimizer::LossClosure& closure) {
  Accelerator* acc = owner();
  if (!acc) return optimizer_->step(closure);
  acc->check_model_split("optimizer step");
  if (acc->replicas_) acc->refuse_under_replicas("optimizer step(closure)");
  if (acc->strategy_->name() != "ddp")
    throw ::tandem::Refused(acc->state_.prefix() + " optimizer step(closure) under " +
                            acc->strategy_->name() + ": an optimizer that evaluates the loss "
                            "itself reads whole gradients, and under ZeRO each rank holds "
                            "shards; run it under data parallel, or call step() after "
                            "acc.backward(loss)");
  // The closure's gradients would reach the update scaled (fp16) or in half precision beside
  // fp32 masters: the unscale and the copy up happen between a backward and step(), and here
  // the backward runs inside the step.
  if (acc->precision_->scaler() || acc->precision_->has_master_weights())
    throw ::tandem::Refused(acc->state_.prefix() + " optimizer step(closure) under mixed "
                            "precision " + acc->config_.mixed_precision + ": the closure's "
                            "backward runs inside the step, where the loss scale or the fp32 "
                            "masters cannot be applied; use bf16 autocast (--mixed_precision "
                            "bf16) or no mixed precision with it");
  if (acc->config_.gradient_clipping)
    throw ::tandem::Refused(acc->state_.prefix() + " optimizer step(closure) with gradient "
                            "clipping (gradient_clipping in the config): the closure's backward "
                            "runs inside the step, before which the clipping would act; clip "
                            "inside the closure with acc.clip_grad_norm_, or drop the setting");
  skipped_ = !acc->sync_gradients();
  if (skipped_) return at::Tensor();
  acc->unsynced_backwards_ = 0;
  acc->check_trainable_parameters("optimizer step");
  // The optimizer decides from the loss how often it evaluates it (LBFGS: its tolerance on the
  // loss's change, its line search): every rank gets the loss averaged over the ranks, so that
  // every rank evaluates it as often, and their backwards' collectives meet.
  auto averaged = [acc, &closure] { return acc->reduce(closure().detach()); };
  at::Tensor loss;
  {
    auto span = acc->timeline().scope("optimizer step", "compute");
    loss = optimizer_->step(averaged);
  }
  acc->precision_->after_step(*optimizer_);
  acc->strategy_->after_step(*optimizer_);
  acc->after_optimizer_step(*optimizer_);
  return loss;
}

void AcceleratedOptimizer::zero_grad() {
  Accelerator* acc = owner();
  if (acc && !acc->sync_gradients()) return;
  if (acc && acc->unsynced_backwards_ > 0) {
    // Inside an accumulation window (the zero_grad() of a loop that clears before its forward,
    // inside accumulate()): the micro-steps before this one would be lost.
    const std::string message =
        acc->state_.prefix() + " zero_grad: this call clears the gradients of " +
        std::to_string(acc->unsynced_backwards_) + " earlier micro-step" +
        (acc->unsynced_backwards_ == 1 ? "" : "s") + " of the accumulation window "
        "(gradient_accumulation_steps " + std::to_string(acc->accumulation_steps_) +
        "), so the step uses only this micro-step's gradients. Call zero_grad() after "
        "step(), not before the forward (the README's loop)";
    acc->unsynced_backwards_ = 0;
    if (acc->options_.strict_zero_grad()) throw std::runtime_error(message);
    if (!acc->zero_grad_warned_)
      std::cerr << message
                << "; said once (AcceleratorOptions().strict_zero_grad(true) makes it an error)"
                << std::endl;
    acc->zero_grad_warned_ = true;
  }
  optimizer_->zero_grad();
  if (acc) {
    acc->precision_->zero_grad(*optimizer_);
    acc->strategy_->zero_grad(*optimizer_);
  }
}

}  // namespace tandem
