// Accelerator: the user's single entry point. It reads where the process stands in the job,
// builds the process group, prepares models, optimizers and loaders for data parallel
// training, and offers backward, gradient accumulation, clipping and collectives.
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <tuple>
#include <vector>

#include "tandem/comm/collectives.h"
#include "tandem/comm/process_group.h"
#include "tandem/data/loader.h"
#include "tandem/optimizer.h"
#include "tandem/parallel/ddp.h"
#include "tandem/state.h"

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
  /// Re-broadcast buffers (e.g. BatchNorm statistics) from rank 0 after every optimizer step.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Rendezvous and collective timeout (PyTorch's default: 30 minutes).
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
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
  int gradient_accumulation_steps() const { return accumulation_steps_; }

  // ---- prepare --------------------------------------------------------------------------------
  /// Moves the model to the device, broadcasts rank 0's parameters and buffers, and installs
  /// the gradient hooks of data parallel training. Returns the same module.
  std::shared_ptr<torch::nn::Module> prepare_model(std::shared_ptr<torch::nn::Module> model);
  template <class Impl>
  torch::nn::ModuleHolder<Impl> prepare(torch::nn::ModuleHolder<Impl> model) {
    prepare_model(model.ptr());
    return model;
  }
  template <class Impl, std::enable_if_t<std::is_base_of_v<torch::nn::Module, Impl>, int> = 0>
  std::shared_ptr<Impl> prepare(std::shared_ptr<Impl> model) {
    prepare_model(model);
    return model;
  }
  /// Wraps an optimizer (create it over the prepared model's parameters).
  AcceleratedOptimizer prepare(std::shared_ptr<torch::optim::Optimizer> optimizer);
  template <class M, class O>
  std::tuple<M, AcceleratedOptimizer> prepare(M model, std::shared_ptr<O> optimizer) {
    auto m = prepare(std::move(model));
    return {m, prepare(std::shared_ptr<torch::optim::Optimizer>(std::move(optimizer)))};
  }

  /// This rank's loader over a map-style data set (a distributed sampler is inserted).
  template <class Dataset>
  std::shared_ptr<data::DataLoader<Dataset>> prepare_data_loader(
      Dataset dataset, data::DataLoaderOptions options = {},
      typename data::DataLoader<Dataset>::CollateFn collate = nullptr) {
    return std::make_shared<data::DataLoader<Dataset>>(std::move(dataset), options,
                                                       placement(options), loader_state_,
                                                       std::move(collate));
  }
  /// This rank's loader over a stream of examples (see data::StreamLoader).
  template <class Example>
  std::shared_ptr<data::StreamLoader<Example>> prepare_stream_loader(
      std::function<std::function<std::optional<Example>()>()> make_stream,
      data::DataLoaderOptions options = {}) {
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
    explicit AccumulateScope(Accelerator* acc) : acc_(acc) {}
    AccumulateScope(AccumulateScope&& o) noexcept : acc_(o.acc_) { o.acc_ = nullptr; }
    ~AccumulateScope() = default;

   private:
    Accelerator* acc_;
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

  /// Clips the (reduced) gradients' total norm to max_norm; returns the total norm before
  /// clipping. Does nothing off a synchronisation boundary (returns 0).
  double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                         double norm_type = 2.0);
  /// Clamps every (reduced) gradient into [-clip_value, clip_value].
  void clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value);

  // ---- collectives ----------------------------------------------------------------------------
  at::Tensor gather(const at::Tensor& tensor) { return comm::gather(*pg_, tensor); }
  /// gather(), dropping the rows that even-batches padding duplicated in the last batch, so
  /// that each sample of the data set is counted exactly once.
  at::Tensor gather_for_metrics(const at::Tensor& tensor);
  at::Tensor reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kMean) {
    return comm::reduce(*pg_, tensor, op);
  }
  at::Tensor pad_across_processes(const at::Tensor& tensor, int64_t dim = 0, double pad_value = 0,
                                  bool pad_first = false) {
    return comm::pad_across_processes(*pg_, tensor, dim, pad_value, pad_first);
  }
  void wait_for_everyone() { comm::wait_for_everyone(*pg_); }

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

  /// The reducers of the prepared models (for timelines and tests).
  const std::vector<std::unique_ptr<parallel::GradientReducer>>& reducers() const {
    return reducers_;
  }
  /// The shared state of the prepared loaders.
  const data::LoaderState& loader_state() const { return *loader_state_; }
  /// Number of optimizer steps taken (on boundaries).
  int64_t step() const { return optimizer_steps_; }

 private:
  friend class AcceleratedOptimizer;
  data::detail::Placement placement(const data::DataLoaderOptions& o) const;
  void after_optimizer_step();

  AcceleratorOptions options_;
  ProcessState state_;
  c10::Device device_ = c10::Device(c10::kCPU);
  std::shared_ptr<ProcessGroup> pg_;
  int accumulation_steps_ = 1;
  int64_t micro_step_ = 0;
  bool sync_gradients_ = true;
  int no_sync_depth_ = 0;
  int64_t optimizer_steps_ = 0;
  std::shared_ptr<data::LoaderState> loader_state_ = std::make_shared<data::LoaderState>();
  std::vector<std::shared_ptr<torch::nn::Module>> models_;
  std::vector<std::unique_ptr<parallel::GradientReducer>> reducers_;
};

}  // namespace tandem
