// Accelerator: the user's single entry point, with Accelerate's names. A facade over parts that
// do the work: the run configuration (config::RunConfig, resolved once from the options and the
// environment), the topology (parallel::Topology: every degree and its groups), the strategy
// (data parallel or a ZeRO stage, chosen from the distributed type), precision, the loaders and
// the recorder. It prepares models, optimizers and loaders, and offers backward, gradient
// accumulation, clipping, collectives and checkpoints assembled from the parts' own files.
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <chrono>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>
#include <vector>

#include "tandem/accelerator_options.h"
#include "tandem/comm/collectives.h"
#include "tandem/comm/mesh.h"
#include "tandem/comm/process_group.h"
#include "tandem/config/run_config.h"
#include "tandem/data/loader.h"
#include "tandem/optimizer.h"
#include "tandem/parallel/ddp.h"
#include "tandem/parallel/pipeline.h"
#include "tandem/parallel/strategy.h"
#include "tandem/parallel/topology.h"
#include "tandem/precision/autocast.h"
#include "tandem/precision/fp8.h"
#include "tandem/precision/grad_scaler.h"
#include "tandem/precision/mixed_precision.h"
#include "tandem/precision/policy.h"
#include "tandem/preemption.h"
#include "tandem/state.h"
#include "tandem/track/run_profile.h"
#include "tandem/track/run_recorder.h"
#include "tandem/track/timeline.h"
#include "tandem/track/trackers.h"

namespace tandem::nn {
class Hookable;
namespace detail {
class BuildScope;
}
}  // namespace tandem::nn

namespace tandem {
namespace comm {
class Replicas;
}

namespace parallel {
struct TensorParallelPlan;
class ContextParallel;
class ExpertParallel;
}
namespace checkpoint {
struct StatePart;
class StateReader;
class PendingSave;
struct StagingBuffers;
}

namespace detail {
// A torch::nn::ModuleHolder<Impl>, or a type derived from one (what TORCH_MODULE declares).
template <class T, class = void>
struct is_module_holder : std::false_type {};
template <class T>
struct is_module_holder<T, std::void_t<typename T::ContainedType>>
    : std::is_base_of<torch::nn::ModuleHolder<typename T::ContainedType>, T> {};
template <class T>
inline constexpr bool is_module_holder_v = is_module_holder<T>::value;
template <class T>
struct is_shared_ptr : std::false_type {};
template <class T>
struct is_shared_ptr<std::shared_ptr<T>> : std::true_type {};
template <class T>
inline constexpr bool is_shared_ptr_v = is_shared_ptr<T>::value;
}  // namespace detail

/// What Accelerator::load_state restored.
struct LoadedState {
  std::string dir;
  /// The optimizer steps of the saved run (Accelerator::step() after the load).
  int64_t step = 0;
  /// The saving run's layout, "dp 2 x tp 2 (4 processes, ddp)", and whether it differs from
  /// this run's (then every model and optimizer tensor was joined and cut again).
  std::string saved_layout;
  bool resharded = false;
  /// The loaders resumed at their saved epoch and sample (false: they start their epoch again,
  /// said on stderr: another data-parallel size whose batches do not meet the saved sample).
  bool loaders = true;
  /// Every rank's random generators were restored (false on another world size: they are per
  /// rank).
  bool random_states = true;
};

/// How Accelerator::save_state saves.
struct SaveOptions {
  /// Where; empty: project_dir/checkpoints/checkpoint_<n> (automatic_checkpoint_naming).
  TORCH_ARG(std::string, dir) = "";
  /// Note [Asynchronous checkpoints]: copy the state to host memory now and write it from a
  /// background thread while training goes on; save_state returns once the copy is made. The
  /// checkpoint appears (atomically, complete) when the write ends; the next save, load_state,
  /// end_training and the Accelerator's end wait for it (wait_for_checkpoint waits on demand).
  TORCH_ARG(bool, async) = false;
};

/// The Accelerator. One per process; it owns the process group and the engines it creates.
///
/// Example:
///   tandem::Accelerator acc;
///   auto model = acc.prepare(Net());
///   auto opt = acc.prepare(std::make_shared<torch::optim::SGD>(model->parameters(), 0.1));
///   auto loader = acc.prepare_data_loader(dataset, tandem::data::DataLoaderOptions().batch_size(64));
///   for (auto& batch : *loader) {
///     auto scope = acc.accumulate();
///     auto loss = torch::nll_loss(model->forward(batch.data), batch.target);
///     acc.backward(loss);
///     opt.step();
///     opt.zero_grad();
///   }
class Accelerator {
 public:
  explicit Accelerator(AcceleratorOptions options = {});
  ~Accelerator();
  Accelerator(const Accelerator&) = delete;
  Accelerator& operator=(const Accelerator&) = delete;

  // ---- where we are ---------------------------------------------------------------------------
  const ProcessState& state() const { return state_; }
  int num_processes() const { return state_.world_size; }
  int process_index() const { return state_.rank; }
  int local_process_index() const { return state_.local_rank; }
  bool is_main_process() const { return state_.rank == 0; }
  bool is_local_main_process() const { return state_.local_rank == 0; }
  c10::Device device() const { return device_; }
  ProcessGroup& process_group() { return *pg_; }
  /// The run's layout and its groups (Note [A topology always built]): every run has one, a
  /// plain data-parallel run too (pp 1 x dp W x tp 1).
  const parallel::Topology& topology() const { return *topology_; }
  /// The topology's device mesh (never null): `(*acc.mesh())["tp"]`, `mesh()->size("pp")`.
  const comm::DeviceMesh* mesh() const { return &topology_->mesh(); }
  /// The group that data parallel runs over (the topology's "dp": every rank without tensor or
  /// pipeline parallel). Gradients are averaged, loaders sharded and metrics gathered over it.
  ProcessGroup& data_parallel_group() { return *topology_->data_parallel(); }
  /// Note [Context parallel]: the run's context-parallel group and its split of sequences
  /// (of size 1 without --cp_size). prepare hands it to a parallel::ContextParallelModel; a
  /// model of one's own can split its batches and attention with it.
  std::shared_ptr<const parallel::ContextParallel> context_parallel() const {
    return context_parallel_;
  }
  /// Note [Expert parallel]: the run's expert-parallel group (size 1 without --ep_size), which
  /// prepare hands a model that implements parallel::ExpertParallelModel.
  std::shared_ptr<const parallel::ExpertParallel> expert_parallel() const {
    return expert_parallel_;
  }
  int gradient_accumulation_steps() const { return accumulation_steps_; }

  // ---- build -----------------------------------------------------------------------------------
  /// Builds a model with `make` (a function returning it: `[&] { return GPT(cfg); }`). Under
  /// ZeRO-3 the model's units are sharded while it is built (Note [Sharded construction],
  /// DeepSpeed's zero.Init): each block, once its constructor is done, is moved to the device,
  /// cast, given rank 0's values and cut down to this rank's chunk, so that no rank ever holds
  /// the dense model. The units are the Sharded wrappers and the hookable modules
  /// (TANDEM_MODULE types) the auto-wrap policy picks, as prepare picks them; the weights are
  /// those of a dense construction with the same seed. Until prepare(model) and
  /// prepare(optimizer), a built unit's parameters have no storage: initialise each block in
  /// its own constructor, not by a pass over the whole model afterwards. Under any other
  /// strategy `make()` and nothing more. Refused with tensor parallel (which splits the dense
  /// layers).
  template <class F>
  auto build(F&& make) -> decltype(make()) {
    using Built = std::decay_t<decltype(make())>;
    auto scope = begin_build(root_is_hookable<Built>());
    auto model = make();
    end_build(scope);
    return model;
  }

  // ---- prepare --------------------------------------------------------------------------------
  /// Moves the model to the device, broadcasts rank 0's parameters and buffers, and installs
  /// the gradient hooks of data parallel training. Returns the same module.
  std::shared_ptr<torch::nn::Module> prepare_model(std::shared_ptr<torch::nn::Module> model);
  /// prepare_model() for a module holder (a TORCH_MODULE type such as `MLP`, or a plain
  /// `ModuleHolder<Impl>`): returns the holder's own type, so `m = acc.prepare(m);` compiles.
  template <class Holder, std::enable_if_t<detail::is_module_holder_v<Holder>, int> = 0>
  Holder prepare(Holder model) {
    prepare_model(model.ptr());
    return model;
  }
  /// A module held by value (`Net model; acc.prepare(model);`) is refused when the program is
  /// compiled, with the fix: LibTorch itself needs a module in a shared_ptr for
  /// `named_modules()`, `clone()` and its children, and the Accelerator keeps the model alive
  /// while it trains. `auto model = std::make_shared<Net>();` (and `model->forward(x)`), or a
  /// TORCH_MODULE holder, changes no other line of the model.
  template <class M, std::enable_if_t<std::is_base_of_v<torch::nn::Module, std::decay_t<M>> &&
                                          !detail::is_module_holder_v<std::decay_t<M>>,
                                      int> = 0>
  void prepare(M&& /*model*/) {
    static_assert(!std::is_base_of_v<torch::nn::Module, std::decay_t<M>>,
                  "tandem: prepare() takes a module in a std::shared_ptr or a TORCH_MODULE "
                  "holder, not a module held by value: declare `auto model = "
                  "std::make_shared<Net>();` (LibTorch's named_modules() and clone() need the "
                  "shared_ptr too), then `model = acc.prepare(model);`");
  }
  /// prepare_model() for a `shared_ptr<Impl>`; returns the same pointer type.
  template <class Impl, std::enable_if_t<std::is_base_of_v<torch::nn::Module, Impl>, int> = 0>
  std::shared_ptr<Impl> prepare(std::shared_ptr<Impl> model) {
    prepare_model(model);
    return model;
  }
  /// Splits a model's layers over mesh["tp"] by a tensor-parallel plan (parallel::
  /// parallelize_module, loading each rank's shard of the dense weights). Call it before
  /// prepare(model), on every rank, with the same dense model (same seed).
  void parallelize(torch::nn::Module& model, const parallel::TensorParallelPlan& plan);
  /// This rank's pipeline stage of `model` (consecutive entries, parallel::split_sequential)
  /// over mesh["pp"], on the device, with the gradients of each step averaged over mesh["dp"].
  /// Create the optimizer over `pipeline->module()->parameters()`, prepare it, and call
  /// `pipeline->step(input, target)` once per batch.
  std::shared_ptr<parallel::Pipeline> prepare_pipeline(torch::nn::Sequential model,
                                                       parallel::Pipeline::Loss loss,
                                                       parallel::PipelineOptions options = {});
  /// As above on a mesh with a tensor-parallel dimension too (pp x tp, and dp): the stage's
  /// layers are split over mesh["tp"] by `plan` before anything else (parallel::
  /// parallelize_module). A stage holds only some of the model's layers, so an entry applies
  /// where it matches, and must match on at least one stage (else every rank refuses the plan,
  /// naming the entry). `loss` receives the last stage's output as the plan leaves it (logits
  /// split by vocabulary after a column-parallel head: parallel::vocab_parallel_cross_entropy).
  std::shared_ptr<parallel::Pipeline> prepare_pipeline(torch::nn::Sequential model,
                                                       parallel::Pipeline::Loss loss,
                                                       parallel::PipelineOptions options,
                                                       const parallel::TensorParallelPlan& plan);
  /// Wraps an optimizer (create it over the prepared model's parameters).
  AcceleratedOptimizer prepare(std::shared_ptr<torch::optim::Optimizer> optimizer);
  /// Registers a learning-rate scheduler so that save_state/load_state keep its step count.
  std::shared_ptr<torch::optim::LRScheduler> prepare_scheduler(
      std::shared_ptr<torch::optim::LRScheduler> scheduler);
  /// The model and its optimizer at once: `std::tie(model, opt) = acc.prepare(model, adamw);`
  /// returns the model's own type (holder or shared_ptr) and the wrapped optimizer.
  template <class M, class O,
            std::enable_if_t<std::is_base_of_v<torch::optim::Optimizer, O>, int> = 0>
  std::tuple<M, AcceleratedOptimizer> prepare(M model, std::shared_ptr<O> optimizer) {
    M m = prepare(std::move(model));
    return {std::move(m), prepare(std::shared_ptr<torch::optim::Optimizer>(std::move(optimizer)))};
  }

  /// This rank's loader over a map-style data set (a distributed sampler is inserted).
  template <class Dataset>
  std::shared_ptr<data::DataLoader<Dataset>> prepare_data_loader(
      Dataset dataset, data::DataLoaderOptions options = {},
      typename data::DataLoader<Dataset>::CollateFn collate = nullptr) {
    auto loader = std::make_shared<data::DataLoader<Dataset>>(
        std::move(dataset), options, placement(options), loader_state_, std::move(collate));
    loaders_.push_back(loader);
    return loader;
  }
  /// This rank's loader over a stream of examples (see data::StreamLoader).
  template <class Example>
  std::shared_ptr<data::StreamLoader<Example>> prepare_stream_loader(
      std::function<std::function<std::optional<Example>()>()> make_stream,
      data::DataLoaderOptions options = {}) {
    if (replicas_) refuse_under_replicas("prepare_stream_loader");
    return std::make_shared<data::StreamLoader<Example>>(std::move(make_stream), options,
                                                         placement(options), loader_state_);
  }

  // ---- training -------------------------------------------------------------------------------
  /// Runs backward on `loss` (divided by gradient_accumulation_steps); on a synchronising
  /// micro-step returns when every gradient bucket is reduced and written back into .grad.
  void backward(const at::Tensor& loss);

  /// RAII scope of one micro-step of gradient accumulation: communication only on the
  /// boundary (every gradient_accumulation_steps micro-steps, and at the end of a loader).
  class AccumulateScope {
   public:
    explicit AccumulateScope(Accelerator* acc, precision::AutocastGuard autocast = {})
        : acc_(acc), autocast_(std::move(autocast)) {}
    AccumulateScope(AccumulateScope&& o) noexcept
        : acc_(o.acc_), autocast_(std::move(o.autocast_)) {
      o.acc_ = nullptr;
    }
    ~AccumulateScope() = default;

   private:
    Accelerator* acc_;
    precision::AutocastGuard autocast_;  // the mixed-precision mode's autocast, for the scope
  };
  AccumulateScope accumulate();
  template <class M>
  AccumulateScope accumulate(const M& /*model*/) {
    return accumulate();
  }
  /// Whether this micro-step synchronises gradients (optimizer steps happen only then).
  bool sync_gradients() const { return sync_gradients_; }

  /// RAII scope in which backward keeps gradients local (no communication).
  class NoSyncScope {
   public:
    explicit NoSyncScope(Accelerator* acc);
    NoSyncScope(NoSyncScope&& o) noexcept : acc_(o.acc_) { o.acc_ = nullptr; }
    ~NoSyncScope();

   private:
    Accelerator* acc_;
  };
  NoSyncScope no_sync();
  template <class M>
  NoSyncScope no_sync(const M& /*model*/) {
    return no_sync();
  }

  /// RAII scope in which every parameter of the prepared models is whole on every rank (FSDP's
  /// summon_full_params): under ZeRO-3 a unit's parameters have no storage between its uses, so
  /// reading them (model->parameters(), a norm, an EMA copy) needs this scope; elsewhere it does
  /// nothing. Every rank of the data-parallel group enters it together (stage 3 all-gathers).
  /// Read-only: the optimizer's shards stay the truth, and changes made in the scope are lost.
  ///
  /// Example:
  ///   { auto full = acc.summon_full_params(); std::cout << model->fc->weight.norm(); }
  class FullParamsScope {
   public:
    explicit FullParamsScope(Accelerator* acc);
    FullParamsScope(FullParamsScope&& o) noexcept : acc_(o.acc_) { o.acc_ = nullptr; }
    ~FullParamsScope();

   private:
    Accelerator* acc_;
  };
  FullParamsScope summon_full_params();

  /// Clips the (reduced) gradients' total norm to max_norm; returns the total norm before
  /// clipping. Does nothing off a synchronisation boundary (returns 0). Under fp16 the
  /// gradients are unscaled first (unscale_gradients), so the norm is that of the true
  /// gradients; with master weights the fp32 masters' gradients are clipped. On a mesh the norm
  /// is the whole model's: tensor-parallel shards summed over mesh["tp"], and every pipeline
  /// stage's parameters over mesh["pp"] (pass each rank's own parameters).
  double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                         double norm_type = 2.0);
  /// Clamps every (reduced) gradient into [-clip_value, clip_value].
  void clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value);

  // ---- mixed precision (the MixedPrecision component) ------------------------------------------
  /// The validated precision policy of this run.
  const precision::PrecisionPolicy& precision_policy() const { return precision_->policy(); }
  /// The mode's name: no, bf16, fp16, bf16-true, fp16-true, fp8.
  std::string mixed_precision() const { return precision_->policy().name(); }
  /// The precision component (policy, loss scaler, master weights).
  precision::MixedPrecision& precision() { return *precision_; }
  /// An autocast region for this mode on this device (nothing under no and the -true modes);
  /// autocast(false) turns autocast off inside an enclosing region, for numerically sensitive
  /// code. accumulate() opens one for its scope too; backward(), optimizer steps and clipping
  /// always run with autocast off.
  ///
  /// Example:
  ///   torch::NoGradGuard no_grad;
  ///   auto ac = acc.autocast();
  ///   auto logits = model->forward(x);
  precision::AutocastGuard autocast(bool enabled = true) { return precision_->autocast(enabled); }
  /// The loss scaler (fp16 and fp16-true), nullptr otherwise.
  precision::GradScaler* scaler() { return precision_->scaler(); }
  /// Divides the gradients by the loss scale once per synchronisation boundary (and, with
  /// master weights, copies them up into the fp32 masters first); checks them for inf/NaN on
  /// every rank together. Optimizer steps and clipping call it; calling it again before the
  /// next backward does nothing.
  void unscale_gradients();
  /// Whether the last optimizer step was skipped because some rank's gradients held inf/NaN.
  bool optimizer_step_was_skipped() const { return precision_->step_was_skipped(); }
  /// The fp32 master copy of a prepared optimizer's parameter `p` (a -true mode with master
  /// weights), or an undefined tensor.
  at::Tensor master_parameter(const at::Tensor& p) const { return precision_->master_parameter(p); }

  // ---- collectives ----------------------------------------------------------------------------
  // Note [Collectives on a mesh]: the metric collectives (gather, gather_for_metrics, reduce,
  // pad_across_processes) run over the topology's metrics() group, its data-parallel ranks: the
  // ranks of one tensor-parallel group hold the same (replicated) values, and the data-parallel
  // ranks hold different samples, so each sample counts once and `reduce(x, kSum)` on dp 2 x
  // tp 2 equals dp 2's. Without tensor or pipeline parallel that group is every process, as in
  // Accelerate. Under a pipeline, each stage's group is its data-parallel peers (a loss exists
  // on the last stage). wait_for_everyone runs over barrier(): every process.
  /// Every data-parallel rank's `tensor`, concatenated along dim 0 in rank order.
  at::Tensor gather(const at::Tensor& tensor) { return comm::gather(*topology_->metrics(), tensor); }
  /// gather(), dropping the rows that even-batches padding duplicated in the last batch, so
  /// that each sample of the data set is counted exactly once.
  at::Tensor gather_for_metrics(const at::Tensor& tensor);
  /// Reduces across the data-parallel ranks. Under mixed precision a bf16/fp16 tensor is reduced
  /// in fp32 and returned in fp32 (bf16 with downcast_bf16).
  at::Tensor reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kMean);
  /// Pads `tensor` along `dim` to the largest size among the data-parallel ranks.
  at::Tensor pad_across_processes(const at::Tensor& tensor, int64_t dim = 0, double pad_value = 0,
                                  bool pad_first = false) {
    return comm::pad_across_processes(*topology_->metrics(), tensor, dim, pad_value, pad_first);
  }
  /// Waits for every process.
  void wait_for_everyone() { comm::wait_for_everyone(*topology_->barrier()); }
  /// This data-parallel rank's part of `inputs` along dim 0 (Accelerate's
  /// split_between_processes): contiguous parts in rank order, the first `rows % ranks` ranks
  /// one row more. With apply_padding every rank gets as many rows as the first, the short ones
  /// repeating their last row (gather_for_metrics does not drop those: slice the gathered result
  /// to the input's rows). Ranks of one tensor- or pipeline-parallel group get the same part.
  at::Tensor split_between_processes(const at::Tensor& inputs, bool apply_padding = false) const;
  /// The same for a list (a prompt list, file names): this rank's elements.
  template <class T>
  std::vector<T> split_between_processes(const std::vector<T>& inputs,
                                         bool apply_padding = false) const {
    const auto [begin, end, padded] =
        split_range(static_cast<int64_t>(inputs.size()), apply_padding);
    std::vector<T> out(inputs.begin() + begin, inputs.begin() + end);
    while (static_cast<int64_t>(out.size()) < padded && !out.empty()) out.push_back(out.back());
    return out;
  }

  // ---- helpers --------------------------------------------------------------------------------
  /// Seeds LibTorch's CPU (and CUDA) generators; device_specific adds the process index.
  void set_seed(uint64_t seed, bool device_specific = false);
  /// Prints on the main process only (one line, space-separated).
  template <class... Args>
  void print(const Args&... args) {
    if (!is_main_process()) return;
    std::ostringstream os;
    ((os << args << ' '), ...);
    std::string s = os.str();
    if (!s.empty()) s.pop_back();
    std::cout << s << std::endl;
  }
  /// RAII scope: the main process runs the body first, then the others (e.g. to download or
  /// preprocess once and let the others read the result).
  class MainProcessFirst {
   public:
    explicit MainProcessFirst(Accelerator* acc);
    ~MainProcessFirst();

   private:
    Accelerator* acc_;
  };
  MainProcessFirst main_process_first() { return MainProcessFirst(this); }

  // ---- checkpoints ----------------------------------------------------------------------------
  /// Saves everything needed to continue exactly: models, optimizers, schedulers, the loss
  /// scaler, step counters, the loaders' positions, every rank's RNG states and registered
  /// objects. Atomic: written to a temporary directory, fsync'd, checksummed in manifest.json,
  /// then renamed into place; it completes on every rank or on none. Without `dir`, writes
  /// project_dir/checkpoints/checkpoint_<n> and keeps at most total_limit of them. Returns the
  /// directory written.
  std::string save_state(const std::string& dir = "");
  /// save_state with options: SaveOptions().async(true) returns once the state is copied to
  /// host memory and writes it in the background (Note [Asynchronous checkpoints]); a save
  /// still in flight is waited for first. Returns the directory it writes.
  std::string save_state(const SaveOptions& options);
  /// Waits until an asynchronous save in flight is on disk; throws, on every rank, what made it
  /// fail (then no checkpoint was renamed into place). Returns at once when none is in flight.
  void wait_for_checkpoint();
  /// Whether an asynchronous save is still being written.
  bool checkpoint_in_flight() const;
  /// Restores a save_state() directory (verifying every checksum first); without `dir`, the
  /// latest complete checkpoint under project_dir/checkpoints. Prepared loaders resume at the
  /// saved sample of the saved epoch. A checkpoint saved on another layout (data-parallel size,
  /// ZeRO stage, tp, pp) is resharded (docs/checkpoints.md). Returns what it restored.
  LoadedState load_state(const std::string& dir = "");
  /// What the last load_state (or auto_resume) restored; dir is empty when nothing was loaded.
  const LoadedState& resumed() const { return loaded_; }
  /// The latest complete checkpoint under project_dir/checkpoints, or "" when there is none.
  std::string latest_checkpoint() const;
  /// Adds an object to save_state/load_state: `save` returns its state as bytes, `load`
  /// restores them. Saved by the main process; loaded on every rank.
  void register_for_checkpointing(const std::string& name, std::function<std::string()> save,
                                  std::function<void(const std::string&)> load);
  /// An object with `std::string state_dict() const` and `void load_state_dict(const std::string&)`.
  template <class T>
  void register_for_checkpointing(const std::string& name, T& object) {
    register_for_checkpointing(
        name, [&object] { return object.state_dict(); },
        [&object](const std::string& s) { object.load_state_dict(s); });
  }
  /// The model's parameters and buffers by name, whole, on the main process (Accelerate's
  /// get_state_dict): under ZeRO-3 they are gathered unit by unit, and every rank must call it
  /// (the other ranks get an empty list). A ZeRO-3 model's parameters are released between its
  /// uses: read them through this, not through model->parameters().
  /// On a mesh the tensor-parallel shards are joined into the dense tensors and every pipeline
  /// stage's tensors are gathered, so the main process gets the whole model under its dense
  /// names (pass each rank's own module: its stage, parallelized); every rank must call it.
  std::vector<std::pair<std::string, at::Tensor>> get_state_dict(torch::nn::Module& model);
  /// Loads weights (a .safetensors file, an index, or a directory holding either: transformers'
  /// layout, or what save_model wrote) into a prepared model, as checkpoint::load_model does,
  /// with its checks and report. Under ZeRO-3 each rank reads only the byte ranges of its own
  /// shards (Note [Loading into shards]): no rank ever holds the whole model. Call it after
  /// prepare(model) (before prepare(optimizer) when a -true precision keeps fp32 masters).
  checkpoint::LoadReport load_model(torch::nn::Module& model, const std::string& path,
                                    const checkpoint::LoadOptions& options = {});
  /// Writes the model's weights as safetensors (sharded past max_shard_size, with an index) from
  /// the main process; every rank returns when the files are complete.
  void save_model(const torch::nn::Module& model, const std::string& dir,
                  const std::string& max_shard_size = "10GB");

  // ---- tracking (the RunRecorder component) ----------------------------------------------------
  /// Starts the trackers of options.log_with on the main process and records the
  /// hyper-parameters; other ranks do nothing.
  void init_trackers(const std::string& project_name, const track::Hparams& config = {}) {
    recorder_->init_trackers(project_name, config);
  }
  /// Logs scalar values at a step (main process only).
  /// Under fault-tolerant replicas the values get "replicas": how many took part in the step.
  void log(const std::map<std::string, double>& values, int64_t step) {
    if (!replicas_) return recorder_->log(values, step);
    auto with = values;
    with.emplace("replicas", static_cast<double>(replicas()));
    recorder_->log(with, step);
  }
  /// Waits for an asynchronous save in flight, finishes the trackers and writes the timeline.
  void end_training();
  /// Releases every prepared model, optimizer, scheduler and loader, and starts the strategy
  /// and the precision state over, as Accelerate's free_memory() / clear(): what a loop that
  /// trains a new model per trial (tandem::trials::Study) calls between trials. The step count
  /// starts again at 0; trackers, registered objects and the process group stay. Objects
  /// prepared before are LibTorch's own again (an optimizer kept steps plainly). Collective in
  /// effect: every rank calls it at the same point.
  void free_memory();
  /// The per-rank timeline (disabled unless timeline_dir or TANDEM_TIMELINE is set).
  track::Timeline& timeline() { return recorder_->timeline(); }
  /// The tracking component (trackers and timeline).
  track::RunRecorder& recorder() { return *recorder_; }

  /// The gradient reducers of the strategy (for timelines and tests).
  std::vector<const parallel::GradientReducer*> reducers() const { return strategy_->reducers(); }
  /// The strategy of this run (data parallel, or a ZeRO stage).
  const parallel::Strategy& strategy() const { return *strategy_; }
  /// The distributed type this run was started with.
  parallel::DistributedType distributed_type() const { return distributed_type_; }
  /// Every setting of this run, resolved once from the options and the environment.
  const config::RunConfig& run_config() const { return config_; }
  /// The shared state of the prepared loaders.
  const data::LoaderState& loader_state() const { return *loader_state_; }
  /// Optimizer-step boundaries so far: one per training step however many optimizers step in
  /// it (a GAN's discriminator and generator steps count once), counted as the first of them
  /// steps; an optimizer that steps again starts the next boundary. Steps skipped off the
  /// accumulation boundary or for fp16 overflow do not count.
  int64_t step() const { return optimizer_steps_; }
  /// Note [Replica recovery]: how many replicas (machines) the last optimizer step averaged
  /// over under `tandem launch --fault_tolerant_replicas` (the quorum of now before the first);
  /// 1 otherwise.
  int replicas() const;

 private:
  friend class AcceleratedOptimizer;
  template <class T>
  static constexpr bool root_is_hookable() {
    if constexpr (detail::is_module_holder_v<T>)
      return std::is_base_of_v<nn::Hookable, typename T::ContainedType>;
    else if constexpr (detail::is_shared_ptr_v<T>)
      return std::is_base_of_v<nn::Hookable, typename T::element_type>;
    else
      return false;
  }
  std::shared_ptr<nn::detail::BuildScope> begin_build(bool root_hookable);
  void end_build(const std::shared_ptr<nn::detail::BuildScope>& scope);
  // Note [The transform order]: prepare, build and prepare_pipeline ready a model through it.
  struct Transforms;
  void apply_transforms(torch::nn::Module& model, const Transforms& steps);
  data::detail::Placement placement(const data::DataLoaderOptions& o);  // a new loader's
  void after_optimizer_step(const torch::optim::Optimizer& optimizer);
  void profile_parameters(const torch::nn::Module& model);  // TANDEM_PROFILE
  void auto_resume();  // AcceleratorOptions::auto_resume, once
  void clip_before_step(torch::optim::Optimizer& optimizer);  // gradient_clipping
  // The parts of a checkpoint, in the order every rank saves and loads them
  // (src/accelerator_state.cpp).
  std::vector<checkpoint::StatePart> checkpoint_parts();
  // Note [Layouts that must take effect]: a run whose layout asks for tensor or pipeline
  // parallel refuses its first backward/step until the model was split.
  void check_model_split(const char* where);
  // The line the main process prints at construction: strategy, mesh, precision, accumulation.
  std::string layout_line() const;
  // split_between_processes: [begin, end) of this data-parallel rank and the padded length.
  std::tuple<int64_t, int64_t, int64_t> split_range(int64_t rows, bool apply_padding) const;

  // What the program asked for, as given; what the run does is config_ (resolved once, read-only).
  const AcceleratorOptions options_;
  const config::RunConfig config_;  // Note [The environment is read in one place]
  // Cell the prepared optimizers reach this Accelerator through; null once it is destroyed
  // (Note [Accelerator lifetime]).
  std::shared_ptr<Accelerator*> self_ = std::make_shared<Accelerator*>(this);
  ProcessState state_;
  c10::Device device_ = c10::Device(c10::kCPU);
  std::shared_ptr<ProcessGroup> pg_;
  std::unique_ptr<parallel::Topology> topology_;  // Note [A topology always built]
  std::shared_ptr<parallel::ContextParallel> context_parallel_;  // Note [Context parallel]
  std::shared_ptr<parallel::ExpertParallel> expert_parallel_;    // Note [Expert parallel]
  std::shared_ptr<parallel::ExpertParallel> make_expert_parallel(const config::RunConfig& run);
  bool tp_applied_ = false;                 // parallelize() or prepare_pipeline(plan) ran
  bool pipeline_prepared_ = false;          // prepare_pipeline() ran
  bool split_checked_ = false;              // check_model_split() passed once
  bool activation_checkpointing_ = false;
  int accumulation_steps_ = 1;
  int64_t micro_step_ = 0;
  bool sync_gradients_ = true;
  int no_sync_depth_ = 0;
  int64_t optimizer_steps_ = 0;
  // Optimizers that stepped since the last boundary began (step() counts boundaries).
  std::vector<const torch::optim::Optimizer*> stepped_in_boundary_;
  // backward() calls off the synchronisation boundary since the gradients were last cleared or
  // stepped: a zero_grad() that clears them discards micro-steps (strict_zero_grad).
  int64_t unsynced_backwards_ = 0;
  bool zero_grad_warned_ = false;
  LoadedState loaded_;  // what the last load_state restored
  bool auto_resume_pending_ = false;  // AcceleratorOptions::auto_resume, not yet done
  std::chrono::steady_clock::time_point last_checkpoint_ = std::chrono::steady_clock::now();
  std::shared_ptr<data::LoaderState> loader_state_ = std::make_shared<data::LoaderState>();
  std::vector<std::shared_ptr<torch::nn::Module>> models_;
  // Note [Pipeline checkpoint names]: a stage's PipelineOptions::checkpoint_names, by module.
  std::map<const torch::nn::Module*, std::function<std::string(const std::string&)>>
      checkpoint_names_;
  // Note [Trainable parameters are fixed at prepare]: the parameters that required gradients
  // when their model was prepared.
  std::set<const void*> trainable_at_prepare_;
  void check_trainable_parameters(const char* where) const;
  // Note [Schedulers step with the optimizer]: each prepared scheduler's step count at the last
  // optimizer step; whether the main process said it steps on micro-batches.
  std::map<const torch::optim::LRScheduler*, unsigned> scheduler_steps_;
  bool scheduler_warned_ = false;
  std::vector<std::shared_ptr<torch::optim::Optimizer>> optimizers_;
  std::vector<std::shared_ptr<torch::optim::LRScheduler>> schedulers_;
  std::vector<std::weak_ptr<data::ResumableLoader>> loaders_;
  struct Registered {
    std::string name;
    std::function<std::string()> save;
    std::function<void(const std::string&)> load;
  };
  std::vector<Registered> registered_;
  int64_t checkpoints_saved_ = 0;  // numbering of automatic checkpoint_<n>
  // Note [Checkpoints inside the optimizer step]: a periodic or preemption save is running.
  bool saving_inside_step_ = false;
  std::string save_inside_step(const SaveOptions& options);
  // Note [Asynchronous checkpoints]: the save being written, and the group its manifest and
  // rename use (made at the first asynchronous save, over every rank).
  std::unique_ptr<checkpoint::PendingSave> pending_save_;
  std::shared_ptr<ProcessGroup> checkpoint_pg_;
  std::shared_ptr<checkpoint::StagingBuffers> staging_buffers_;  // kept between async saves
  parallel::DistributedType distributed_type_ = parallel::DistributedType::kNo;
  std::unique_ptr<parallel::Strategy> strategy_;
  std::unique_ptr<precision::MixedPrecision> precision_;
  // How strategy_ and precision_ were made, for free_memory().
  std::function<std::unique_ptr<parallel::Strategy>()> make_strategy_;
  std::function<std::unique_ptr<precision::MixedPrecision>()> make_precision_;
  std::unique_ptr<track::RunRecorder> recorder_;
  std::unique_ptr<track::RunProfile> profile_;  // TANDEM_PROFILE
  // Note [Preemption]: the signals watched while checkpoint_on_preemption is on.
  std::unique_ptr<preemption::Watch> preemption_;
  // At the end of a step: when any rank was signalled, save, say so and exit on every rank.
  void stop_if_preempted();
  // Note [Replica recovery]: this process's membership of the replicas' quorum, the shard its
  // loaders take, the loader epoch and sample of the last batch drawn (-1: none yet), whether it
  // is joining (then it takes the loader position too), the replicas of the last step.
  std::unique_ptr<comm::Replicas> replicas_;
  std::vector<std::weak_ptr<data::detail::ReplicaShard>> replica_shards_;  // one per loader
  std::shared_ptr<data::detail::ReplicaShard> replica_shard_;   // the first loader's (training)
  std::shared_ptr<data::detail::ReplicaShard> replica_shard();  // a new loader's
  std::pair<int64_t, int64_t> replica_boundary_{-1, 0};
  bool replica_joining_ = false;
  int replicas_in_step_ = 0;
  void start_replicas();  // in the constructor, when launched as a replica
  void join_replicas();   // as the first pass of a loader begins
  void exchange_state(ProcessGroup* group, int root);
  void average_over_replicas(torch::optim::Optimizer& optimizer);
  [[noreturn]] void refuse_under_replicas(const std::string& what) const;
};

}  // namespace tandem
