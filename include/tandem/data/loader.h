// Prepared data loaders: this rank's shard of a map-style data set (through DistributedSampler)
// or of a stream, batched and collated, prefetched by a background thread, placed on the device.
#pragma once

#include <torch/arg.h>
#include <torch/data/example.h>

#include <c10/util/ArrayRef.h>

#include <ATen/ATen.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#include "tandem/data/sampler.h"

namespace tandem::data {

/// What the Accelerator needs to know about the batch a prepared loader yielded last
/// (Accelerate's GradientState): whether it is the last of the epoch, and how many of its rows
/// are real samples rather than even-batches padding.
struct LoaderState {
  bool end_of_dataloader = false;
  int64_t batch_rows = 0;       ///< rows of the last batch
  int64_t valid_rows = -1;      ///< rows that are not padding; -1 when unknown
  /// Called with the start and end of every wait for a batch (the Accelerator's timeline).
  std::function<void(std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point)>
      on_wait;
  /// Called once, as the first pass of any loader begins (the Accelerator's auto_resume).
  std::function<void()> before_first_pass;
};

/// Options of a prepared loader.
///
/// Example:
///   auto loader = accelerator.prepare_data_loader(dataset,
///       tandem::data::DataLoaderOptions().batch_size(32).shuffle(true).seed(42));
///   for (auto& batch : *loader) { ... batch.data, batch.target ... }
struct DataLoaderOptions {
  /// Samples per batch on each rank; with split_batches, the global batch split across ranks.
  TORCH_ARG(int64_t, batch_size) = 1;
  TORCH_ARG(bool, shuffle) = false;
  /// Seed of the shuffle; the order of epoch e comes from seed + e (as PyTorch's sampler).
  TORCH_ARG(uint64_t, seed) = 0;
  /// Drop the last batch when it is smaller than batch_size.
  TORCH_ARG(bool, drop_last) = false;
  /// Unset: the Accelerator's setting (default true: every rank gets the same number of
  /// batches, the shortest shards padded with samples from the start of the data set).
  TORCH_ARG(std::optional<bool>, even_batches) = std::nullopt;
  /// Unset: the Accelerator's setting.
  TORCH_ARG(std::optional<bool>, split_batches) = std::nullopt;
  /// Batches prepared ahead by a background thread; 0 loads in the calling thread.
  TORCH_ARG(int64_t, prefetch) = 2;
  /// Move batches to the Accelerator's device.
  TORCH_ARG(bool, device_placement) = true;
  /// Under bf16-true and fp16-true, cast the floating-point tensors of every batch to the
  /// mode's half dtype (integer and bool tensors, such as class labels or token ids, are left
  /// as they are), as Lightning's true-half precision converts inputs. Unset: the Accelerator's
  /// setting (AcceleratorOptions::cast_floating_inputs, default true); false keeps batches as
  /// the data set produces them. Other modes never cast.
  TORCH_ARG(std::optional<bool>, cast_floating_inputs) = std::nullopt;
};

/// Stacks examples into a batch. Specialise for your own example types, or pass a collate
/// function to prepare_data_loader.
template <class E>
struct Collate;

template <class Data, class Target>
struct Collate<torch::data::Example<Data, Target>> {
  using Batch = torch::data::Example<Data, Target>;
  static Batch apply(std::vector<torch::data::Example<Data, Target>>& items) {
    std::vector<at::Tensor> data, target;
    for (auto& e : items) {
      data.push_back(e.data);
      target.push_back(e.target);
    }
    return {at::stack(data), at::stack(target)};
  }
};

template <class Data>
struct Collate<torch::data::Example<Data, torch::data::example::NoTarget>> {
  using Batch = torch::data::Example<Data, torch::data::example::NoTarget>;
  static Batch apply(std::vector<Batch>& items) {
    std::vector<at::Tensor> data;
    for (auto& e : items) data.push_back(e.data);
    return Batch(at::stack(data));
  }
};

template <>
struct Collate<at::Tensor> {
  using Batch = at::Tensor;
  static Batch apply(std::vector<at::Tensor>& items) { return at::stack(items); }
};

/// Places a batch tensor: moved to `device` when given, and cast to `floating` when given and
/// the tensor is floating-point (one copy at most: device and dtype change together). A batch
/// type of your own gets an overload of this function next to its Collate.
inline at::Tensor to_device(const at::Tensor& t, std::optional<c10::Device> device,
                            std::optional<c10::ScalarType> floating = std::nullopt) {
  if (!t.defined()) return t;
  const bool cast = floating && t.is_floating_point();
  if (device && cast) return t.to(*device, *floating);
  if (device) return t.to(*device);
  if (cast) return t.to(*floating);
  return t;
}
template <class Data, class Target>
torch::data::Example<Data, Target> to_device(const torch::data::Example<Data, Target>& e,
                                             std::optional<c10::Device> device,
                                             std::optional<c10::ScalarType> floating = std::nullopt) {
  return {to_device(e.data, device, floating), to_device(e.target, device, floating)};
}
template <class Data>
torch::data::Example<Data, torch::data::example::NoTarget> to_device(
    const torch::data::Example<Data, torch::data::example::NoTarget>& e,
    std::optional<c10::Device> device, std::optional<c10::ScalarType> floating = std::nullopt) {
  return torch::data::Example<Data, torch::data::example::NoTarget>(
      to_device(e.data, device, floating));
}
/// Row count of a batch (first dim of its data).
inline int64_t batch_rows(const at::Tensor& t) { return t.dim() ? t.size(0) : 1; }
template <class Data, class Target>
int64_t batch_rows(const torch::data::Example<Data, Target>& e) {
  return batch_rows(e.data);
}

/// What checkpoints need from a prepared loader, whatever its data set type: its epoch and how
/// many batches of the current pass were handed out, and the means to resume from there.
class ResumableLoader {
 public:
  virtual ~ResumableLoader() = default;
  virtual int64_t epoch() const = 0;
  virtual void set_epoch(int64_t epoch) = 0;
  virtual int64_t position() const = 0;
  virtual void skip_first_batches(int64_t n) = 0;
  /// Samples every position takes off the epoch over all data-parallel ranks (the per-rank
  /// batch size times their number): position() x this is the samples the epoch consumed, so
  /// a resume on another data-parallel size continues at the next sample.
  virtual int64_t samples_per_position() const = 0;
};

namespace detail {

template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {
  using element = T;
};

template <class D, class = void>
struct has_get : std::false_type {};
template <class D>
struct has_get<D, std::void_t<decltype(std::declval<D&>().get(size_t{}))>> : std::true_type {};

template <class V>
struct VectorElement {
  using type = typename is_vector<V>::element;
};
template <class E>
struct CollatedBatch {
  using type = typename Collate<E>::Batch;
};

/// How a loader reads a data set. One with `get(size_t)` (a LibTorch Dataset, or any
/// map-style set) gives examples that the loader collates. One with only
/// `get_batch(ArrayRef<size_t>)` (LibTorch's `dataset.map(transform)`, a MapDataset) applies its
/// own transforms: per-example ones (Normalize, Lambda) before collation, and a batch transform
/// such as `Stack<>` as the collation itself; when it ends in a per-example transform, the
/// examples come back as a vector, which the loader collates.
template <class D, bool = has_get<D>::value>
struct DatasetReader {
  using Example = decltype(std::declval<D&>().get(size_t{}));
  static constexpr bool collates = false;
  using Batch = typename Collate<Example>::Batch;
  static std::vector<Example> fetch(D& d, const std::vector<size_t>& idx) {
    std::vector<Example> items;
    items.reserve(idx.size());
    for (size_t i : idx) items.push_back(d.get(i));
    return items;
  }
};
template <class D>
struct DatasetReader<D, false> {
  using Fetched = std::decay_t<decltype(std::declval<D&>().get_batch(c10::ArrayRef<size_t>()))>;
  static constexpr bool collates = !is_vector<Fetched>::value;
  using Example = typename std::conditional_t<collates, std::enable_if<true, Fetched>,
                                              VectorElement<Fetched>>::type;
  using Batch = typename std::conditional_t<collates, std::enable_if<true, Fetched>,
                                            CollatedBatch<Example>>::type;
  static Fetched fetch(D& d, const std::vector<size_t>& idx) {
    return d.get_batch(c10::ArrayRef<size_t>(idx));
  }
};

/// A bounded queue filled by a producer thread, drained by the training loop. The producer is
/// stopped and joined when the consumer lets go (breaking out of an epoch early is fine).
template <class Item>
class Prefetcher {
 public:
  Prefetcher(std::function<std::optional<Item>()> produce, size_t capacity)
      : produce_(std::move(produce)), capacity_(std::max<size_t>(1, capacity)) {
    thread_ = std::thread([this] { run(); });
  }
  ~Prefetcher() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  /// The next item, or nullopt at the end; rethrows the producer's failure.
  std::optional<Item> next() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return !queue_.empty() || done_; });
    if (!queue_.empty()) {
      Item item = std::move(queue_.front());
      queue_.pop_front();
      cv_.notify_all();
      return item;
    }
    if (error_) std::rethrow_exception(error_);
    return std::nullopt;
  }

 private:
  void run() {
    try {
      for (;;) {
        {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [this] { return stop_ || queue_.size() < capacity_; });
          if (stop_) break;
        }
        auto item = produce_();
        std::lock_guard<std::mutex> lock(mu_);
        if (!item) break;
        queue_.push_back(std::move(*item));
        cv_.notify_all();
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    cv_.notify_all();
  }

  std::function<std::optional<Item>()> produce_;
  size_t capacity_;
  std::deque<Item> queue_;
  bool stop_ = false, done_ = false;
  std::exception_ptr error_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread thread_;
};

/// Where this rank stands in the job, for loaders.
/// Note [Replica recovery]: the live quorum of fault-tolerant replicas a loader shards over.
/// Each step takes the next size x batch samples of the epoch's order (so a step's samples are
/// those DistributedSampler gives a world of that size), member `index` every size-th of them;
/// the quorum may change between two batches.
struct ReplicaShard {
  int64_t size = 1;
  int64_t index = 0;
  /// Set on the first loader prepared (the training data): runs before each of its batches is
  /// drawn, with its epoch and the samples its pass took so far: the step boundary, where a
  /// quorum admits a joining replica (and size, index change).
  std::function<void(int64_t epoch, int64_t consumed)> at_boundary;
  /// Set on the first loader when this replica joined a running job: the epoch and sample its
  /// next pass continues at (taken once).
  std::optional<std::pair<int64_t, int64_t>> start;
};

struct Placement {
  int64_t rank = 0;
  int64_t world = 1;
  /// Set under fault-tolerant replicas (then rank 0 of world 1: each replica is one process).
  std::shared_ptr<ReplicaShard> replicas;
  c10::Device device = c10::Device(c10::kCPU);
  bool even_batches = true;
  bool split_batches = false;
  /// The dtype floating-point batch tensors are cast to (the -true modes), or none.
  std::optional<c10::ScalarType> floating_dtype;
};

int64_t per_rank_batch_size(const DataLoaderOptions& o, const Placement& p);

/// Where a loader's batches go: the Accelerator's device, or nowhere (device_placement off).
inline std::optional<c10::Device> batch_device(const DataLoaderOptions& o, const Placement& p) {
  return o.device_placement() ? std::optional<c10::Device>(p.device) : std::nullopt;
}

/// One batch as produced: the collated batch and how many of its rows are real.
template <class Batch>
struct Produced {
  Batch batch;
  int64_t valid_rows;
};

/// Shared iteration logic of the loaders: an epoch is a function producing batches; the
/// iterator pulls them (through the prefetcher) and updates the LoaderState.
template <class Batch>
class EpochIterator {
 public:
  using Source = std::function<std::optional<Produced<Batch>>()>;
  EpochIterator() = default;
  EpochIterator(Source source, int64_t prefetch, std::shared_ptr<LoaderState> state,
                std::function<void()> on_end, std::function<bool(int64_t)> is_last)
      : state_(std::move(state)), on_end_(std::move(on_end)), is_last_(std::move(is_last)) {
    if (prefetch > 0) {
      prefetcher_ = std::make_shared<Prefetcher<Produced<Batch>>>(std::move(source),
                                                                   static_cast<size_t>(prefetch));
    } else {
      source_ = std::move(source);
    }
    advance();
  }
  Batch& operator*() { return current_->batch; }
  Batch* operator->() { return &current_->batch; }
  EpochIterator& operator++() {
    advance();
    return *this;
  }
  bool operator!=(const EpochIterator& other) const { return at_end() != other.at_end(); }
  bool operator==(const EpochIterator& other) const { return at_end() == other.at_end(); }

 private:
  bool at_end() const { return !current_.has_value(); }
  void advance() {
    const auto wait_begin = std::chrono::steady_clock::now();
    current_ = prefetcher_ ? prefetcher_->next() : source_();
    if (state_ && state_->on_wait) state_->on_wait(wait_begin, std::chrono::steady_clock::now());
    if (!current_) {
      if (on_end_) on_end_();
      on_end_ = nullptr;
      return;
    }
    ++index_;
    if (state_) {
      state_->batch_rows = batch_rows(current_->batch);
      state_->valid_rows = current_->valid_rows;
      state_->end_of_dataloader = is_last_ ? is_last_(index_) : false;
    }
  }
  std::shared_ptr<Prefetcher<Produced<Batch>>> prefetcher_;
  Source source_;
  std::optional<Produced<Batch>> current_;
  std::shared_ptr<LoaderState> state_;
  std::function<void()> on_end_;
  std::function<bool(int64_t)> is_last_;
  int64_t index_ = 0;
};

}  // namespace detail

/// This rank's loader over a map-style data set: anything with `size()` returning an optional
/// size and `get(size_t)` (LibTorch's datasets), or LibTorch's mapped data sets
/// (`dataset.map(Normalize<>(0.1307, 0.3081)).map(Stack<>())`, whose transforms apply as they
/// do under LibTorch's own loader: detail::DatasetReader). The order is PyTorch's
/// DistributedSampler's; each full pass advances the epoch (so the next pass reshuffles), and
/// set_epoch sets it explicitly.
template <class Dataset>
class DataLoader : public ResumableLoader {
  using Reader = detail::DatasetReader<Dataset>;

 public:
  using Example = typename Reader::Example;
  using Batch = typename Reader::Batch;
  /// Collates one batch's examples (a data set that collates itself, ending in a batch
  /// transform such as Stack, takes none).
  using CollateFn = std::function<Batch(std::vector<Example>&)>;
  using iterator = detail::EpochIterator<Batch>;

  DataLoader(Dataset dataset, DataLoaderOptions options, detail::Placement placement,
             std::shared_ptr<LoaderState> state, CollateFn collate = nullptr)
      : dataset_(std::make_shared<Dataset>(std::move(dataset))),
        options_(options),
        placement_(placement),
        state_(std::move(state)),
        collate_(std::move(collate)) {
    if constexpr (Reader::collates) {
      if (collate_)
        throw std::invalid_argument(
            "prepare_data_loader: this data set makes its own batches (it ends in a batch "
            "transform such as torch::data::transforms::Stack), so a collate function would "
            "never run; pass none, or drop the batch transform and collate in the function");
    } else {
      if (!collate_) collate_ = CollateFn(&Collate<Example>::apply);
    }
    auto n = dataset_->size();
    if (!n) throw std::invalid_argument("prepare_data_loader: the data set has no size(); use "
                                        "prepare_stream_loader for streams");
    batch_size_ = detail::per_rank_batch_size(options_, placement_);
    sampler_ = std::make_unique<DistributedSampler>(
        static_cast<int64_t>(*n), SamplerOptions()
                                      .num_replicas(placement_.world)
                                      .rank(placement_.rank)
                                      .shuffle(options_.shuffle())
                                      .seed(options_.seed())
                                      .pad(placement_.even_batches));
  }

  /// Batches of one epoch on this rank (under fault-tolerant replicas: for the quorum of now).
  int64_t size() const {
    if (placement_.replicas) {  // as a world of that size (begin_replicas)
      const int64_t n = placement_.replicas->size, all = sampler_->dataset_size();
      const int64_t per = (all + n - 1) / n;
      return options_.drop_last() ? per / batch_size_ : (per + batch_size_ - 1) / batch_size_;
    }
    int64_t n = sampler_->num_samples();
    return options_.drop_last() ? n / batch_size_ : (n + batch_size_ - 1) / batch_size_;
  }
  void set_epoch(int64_t epoch) override { sampler_->set_epoch(epoch); }
  int64_t epoch() const override { return sampler_->epoch(); }
  /// The next pass starts after `n` batches (resuming mid-epoch); applies once.
  void skip_first_batches(int64_t n) override { skip_ = n; }
  /// Batches per rank per step and the sampler, for tests and checkpoints.
  int64_t batch_size() const { return batch_size_; }
  const DistributedSampler& sampler() const { return *sampler_; }
  /// Batches handed out in the current pass (including skipped ones).
  int64_t position() const override { return *position_; }
  int64_t samples_per_position() const override { return batch_size_ * placement_.world; }

  iterator begin() {
    if (state_ && state_->before_first_pass) {  // may set this loader's epoch and position
      auto first_pass = std::move(state_->before_first_pass);
      state_->before_first_pass = nullptr;
      first_pass();
    }
    if (placement_.replicas) return begin_replicas();
    auto indices = std::make_shared<std::vector<int64_t>>(sampler_->indices());
    auto mask = std::make_shared<std::vector<bool>>(sampler_->padding_mask());
    const int64_t total = size();
    const int64_t first = std::min(skip_, total);
    skip_ = 0;
    *position_ = first;
    auto next = std::make_shared<int64_t>(first);
    auto ds = dataset_;
    auto collate = collate_;
    const int64_t bs = batch_size_;
    const auto device = detail::batch_device(options_, placement_);
    const auto floating = placement_.floating_dtype;
    auto source = [=]() -> std::optional<detail::Produced<Batch>> {
      if (*next >= total) return std::nullopt;
      const int64_t begin = *next * bs;
      const int64_t end = std::min<int64_t>(begin + bs, static_cast<int64_t>(indices->size()));
      std::vector<size_t> idx;
      int64_t valid = 0;
      for (int64_t k = begin; k < end; ++k) {
        idx.push_back(static_cast<size_t>((*indices)[static_cast<size_t>(k)]));
        if (static_cast<size_t>(k) >= mask->size() || !(*mask)[static_cast<size_t>(k)]) ++valid;
      }
      ++*next;
      return make_batch(*ds, collate, idx, valid, device, floating);
    };
    auto pos = position_;
    auto on_end = [this] { sampler_->set_epoch(sampler_->epoch() + 1); };
    auto is_last = [pos, first, total](int64_t yielded) {
      *pos = first + yielded;
      return first + yielded >= total;
    };
    return iterator(source, options_.prefetch(), state_, on_end, is_last);
  }
  iterator end() { return iterator(); }

 private:
  // The examples at `idx`, read, collated and placed; `valid` of them are not padding.
  static detail::Produced<Batch> make_batch(Dataset& ds, const CollateFn& collate,
                                            const std::vector<size_t>& idx, int64_t valid,
                                            const std::optional<c10::Device>& device,
                                            const std::optional<c10::ScalarType>& floating) {
    auto fetched = Reader::fetch(ds, idx);
    if constexpr (Reader::collates) {
      return detail::Produced<Batch>{to_device(fetched, device, floating), valid};
    } else {
      return detail::Produced<Batch>{to_device(collate(fetched), device, floating), valid};
    }
  }

  // Note [Replica recovery]: a pass over the quorum of each moment. Batches are drawn in the
  // calling thread (no prefetch), each after the step before it, so that every batch is cut
  // for the quorum its step runs with.
  iterator begin_replicas() {
    auto shard = placement_.replicas;
    int64_t first_sample = 0;
    if (shard->start) {
      sampler_->set_epoch(shard->start->first);
      first_sample = shard->start->second;
      shard->start.reset();
    }
    auto order = std::make_shared<std::vector<int64_t>>(sampler_->global_order());
    const int64_t total = static_cast<int64_t>(order->size());
    auto consumed = std::make_shared<int64_t>(first_sample);
    *position_ = 0;
    auto ds = dataset_;
    auto collate = collate_;
    const int64_t bs = batch_size_, epoch = sampler_->epoch();
    const bool drop_last = options_.drop_last();
    const auto device = detail::batch_device(options_, placement_);
    const auto floating = placement_.floating_dtype;
    // The epoch ends where DistributedSampler's world of n would end it: the samples left after
    // `consumed`, padded to a multiple of n from the start of the order (as even_batches), so that
    // every member takes as many; drop_last drops the last, short step. With a fixed quorum every
    // batch is the one a world of n gets; after a change the rest is cut for the new n.
    auto end_of = [total](int64_t consumed, int64_t n) {
      return consumed >= total ? consumed : consumed + (total - consumed + n - 1) / n * n;
    };
    auto source = [=]() -> std::optional<detail::Produced<Batch>> {
      if (shard->at_boundary) shard->at_boundary(epoch, *consumed);
      const int64_t n = shard->size, me = shard->index, end = end_of(*consumed, n);
      if (*consumed >= end || (drop_last && *consumed + n * bs > end)) return std::nullopt;
      std::vector<size_t> idx;
      int64_t valid = 0;
      for (int64_t j = 0; j < bs && *consumed + j * n + me < end; ++j) {
        const int64_t k = *consumed + j * n + me;
        idx.push_back(static_cast<size_t>((*order)[static_cast<size_t>(k % total)]));
        if (k < total) ++valid;  // beyond the data set: padding
      }
      *consumed = std::min(end, *consumed + n * bs);
      return make_batch(*ds, collate, idx, valid, device, floating);
    };
    auto pos = position_;
    auto on_end = [this] { sampler_->set_epoch(sampler_->epoch() + 1); };
    auto is_last = [pos, consumed, total, shard, bs, drop_last, end_of](int64_t yielded) {
      *pos = yielded;
      const int64_t n = shard->size;
      return *consumed >= total || (drop_last && *consumed + n * bs > end_of(*consumed, n));
    };
    return iterator(source, 0, state_, on_end, is_last);
  }

  std::shared_ptr<Dataset> dataset_;
  DataLoaderOptions options_;
  detail::Placement placement_;
  std::shared_ptr<LoaderState> state_;
  CollateFn collate_;
  std::unique_ptr<DistributedSampler> sampler_;
  int64_t batch_size_ = 1;
  int64_t skip_ = 0;
  std::shared_ptr<int64_t> position_ = std::make_shared<int64_t>(0);
};

/// This rank's loader over a stream (Accelerate's IterableDatasetShard): `make_stream()` starts
/// a pass and returns a generator of examples (nullopt at the end). Examples are read in rounds
/// of world x batch_size; rank r takes the r-th batch of each round. Every rank reads the whole
/// stream, so all stop together: the last, incomplete round is dropped with drop_last, otherwise
/// completed with examples from the start of the stream (rows that gather_for_metrics drops).
template <class Example>
class StreamLoader {
 public:
  using Batch = typename Collate<Example>::Batch;
  using Generator = std::function<std::optional<Example>()>;
  using iterator = detail::EpochIterator<Batch>;

  StreamLoader(std::function<Generator()> make_stream, DataLoaderOptions options,
               detail::Placement placement, std::shared_ptr<LoaderState> state)
      : make_stream_(std::move(make_stream)),
        options_(options),
        placement_(placement),
        state_(std::move(state)) {
    batch_size_ = detail::per_rank_batch_size(options_, placement_);
  }

  iterator begin() {
    auto gen = std::make_shared<Generator>(make_stream_());
    auto head = std::make_shared<std::vector<Example>>();  // first round, for padding
    auto finished = std::make_shared<bool>(false);
    const int64_t bs = batch_size_, world = placement_.world, rank = placement_.rank;
    const bool drop_last = options_.drop_last();
    const auto device = detail::batch_device(options_, placement_);
    const auto floating = placement_.floating_dtype;
    auto lookahead = std::make_shared<std::optional<Example>>();
    auto source = [=]() -> std::optional<detail::Produced<Batch>> {
      if (*finished) return std::nullopt;
      std::vector<Example> round;
      while (static_cast<int64_t>(round.size()) < bs * world) {
        auto e = (*gen)();
        if (!e) break;
        if (static_cast<int64_t>(head->size()) < bs * world) head->push_back(*e);
        round.push_back(std::move(*e));
      }
      const int64_t got = static_cast<int64_t>(round.size());
      if (got == 0 || (got < bs * world && drop_last)) {
        *finished = true;
        return std::nullopt;
      }
      if (got < bs * world) *finished = true;
      for (size_t k = 0; static_cast<int64_t>(round.size()) < bs * world; ++k)
        round.push_back((*head)[k % head->size()]);
      std::vector<Example> mine(round.begin() + rank * bs, round.begin() + (rank + 1) * bs);
      int64_t valid = std::clamp<int64_t>(got - rank * bs, 0, bs);
      Batch b = to_device(Collate<Example>::apply(mine), device, floating);
      return detail::Produced<Batch>{std::move(b), valid};
    };
    // The end of a stream is known only when it is reached: a batch is the last when the
    // stream ended while reading its round.
    auto is_last = [finished](int64_t) { return *finished; };
    return iterator(source, 0, state_, nullptr, is_last);
  }
  iterator end() { return iterator(); }

 private:
  std::function<Generator()> make_stream_;
  DataLoaderOptions options_;
  detail::Placement placement_;
  std::shared_ptr<LoaderState> state_;
  int64_t batch_size_ = 1;
};

}  // namespace tandem::data
