// Empty weights, dispatch and disk offload (tandem/inference/dispatch.h).
#include "tandem/inference/dispatch.h"
#include "tandem/error.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <future>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "tandem/checkpoint/model_io.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/host_allocator.h"
#include "tandem/inference/quantize.h"

namespace tandem::inference {

namespace {

namespace fs = std::filesystem;

// A tensor of `t`'s shape and dtype whose storage has no bytes (on the CPU).
at::Tensor placeholder(const at::Tensor& t) {
  at::Tensor e = at::empty({0}, t.options().device(at::kCPU));
  e.unsafeGetTensorImpl()->set_sizes_contiguous(t.sizes());
  return e;
}

void release(const at::Tensor& t) {
  if (!t.defined() || is_empty_weight(t)) return;
  at::NoGradGuard no_grad;
  const_cast<at::Tensor&>(t).set_data(placeholder(t));
}

std::string mb(uint64_t bytes) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(1) << static_cast<double>(bytes) / 1e6 << " MB";
  return o.str();
}

uint64_t bytes_of(const at::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

}  // namespace

bool is_empty_weight(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return false;
  const auto need = static_cast<uint64_t>(t.storage_offset() + t.numel()) * t.element_size();
  return t.storage().nbytes() < need;
}

void release_weights(torch::nn::Module& model) {
  for (const auto& p : model.parameters()) release(p);
  for (const auto& b : model.buffers()) release(b);
}

namespace detail {

EmptyWeightsScope::EmptyWeightsScope()
    : scope_(tandem::nn::detail::BuildScope::kEveryModule,
             [](torch::nn::Module& m, bool) { release_weights(m); }) {}

void EmptyWeightsScope::finish(torch::nn::Module& model) {
  scope_.finish();
  release_weights(model);
}

}  // namespace detail

// Note [Disk offload]: a module on disk holds empty weights between its forwards. Its hook (at
// order::kOffload, inside activation checkpointing and ZeRO-3's) makes sure the weights are in
// (waiting for a read ahead, or reading now), moves the inputs to the execution device, starts
// reading the next module on disk (the one that ran after it last time: the order is learned
// from the calls, so the first pass reads nothing ahead, and the last module's next is the
// first of the next pass), runs the forward and gives the weights back.
// Two modules on disk that share a tensor (a tied head) each read it for their forward. At most two offloaded modules are in
// memory at once, this one and the next: infer_device_map reserves the largest module on the
// execution device and the CPU for them. Reads are pread into fresh tensors (the page cache, not
// a mapping: nothing of the file counts as the process's resident memory), and large blocks come
// from the host allocator (tandem/host_allocator.h), so what is given back leaves the process.
struct DispatchedModel::Impl {
  enum class Kind { kOnDevice, kCpuOffload, kDisk };
  struct Weight {
    std::string name;
    at::Tensor tensor;   // the model's own (same TensorImpl)
    std::string file;    // disk: where it is read from
    at::Tensor host;     // cpu offload: the CPU copy
  };
  struct Placed {
    std::string name;
    std::string place;
    Kind kind = Kind::kOnDevice;
    at::Device exec{at::kCPU};
    torch::nn::Module* module = nullptr;
    std::vector<Weight> weights;
    uint64_t bytes = 0;
    int next_disk = -1;
    std::vector<QuantizedLinearImpl*> quantized;  // their kernel caches go with the weights
    std::future<std::vector<at::Tensor>> reading;
    bool read_ahead = false;
  };
  DeviceMap map;
  std::string main;
  std::vector<Placed> placed;
  std::map<std::string, std::unique_ptr<checkpoint::SafetensorsFile>> files;
  std::string source;  // what disk modules read from, for summary()
  bool prefetch = true;
  int last_disk = -1;  // the disk module that ran last: its successor is learned from the calls
  DispatchStats stats;
  std::vector<std::pair<tandem::nn::Hookable*, std::string>> hooks;

  std::vector<at::Tensor> read(const Placed& p) const {
    std::vector<at::Tensor> out;
    out.reserve(p.weights.size());
    for (const auto& w : p.weights) {
      at::Tensor dst = at::empty(w.tensor.sizes(), w.tensor.options().device(at::kCPU));
      files.at(w.file)->read_into(w.name, dst);
      out.push_back(p.exec.is_cpu() ? dst : dst.to(p.exec));
    }
    return out;
  }

  void start_read(int i) {
    auto& p = placed[static_cast<size_t>(i)];
    if (p.reading.valid() || !is_empty_weight(p.weights.front().tensor)) return;
    p.reading = std::async(std::launch::async, [this, i] { return read(placed[size_t(i)]); });
    p.read_ahead = true;
  }

  void bring_in(Placed& p) {
    at::NoGradGuard no_grad;
    if (p.kind == Kind::kCpuOffload) {
      for (auto& w : p.weights) w.tensor.set_data(w.host.to(p.exec, /*non_blocking=*/true));
      return;
    }
    if (!is_empty_weight(p.weights.front().tensor)) return;
    std::vector<at::Tensor> data;
    const auto begin = std::chrono::steady_clock::now();
    if (p.reading.valid()) {
      data = p.reading.get();
      if (p.read_ahead) ++stats.loads_read_ahead;
    } else {
      data = read(p);
    }
    stats.seconds_waited +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    ++stats.loads;
    stats.bytes_read += static_cast<int64_t>(p.bytes);
    for (size_t k = 0; k < data.size(); ++k) p.weights[k].tensor.set_data(data[k]);
    p.read_ahead = false;
  }

  void give_back(Placed& p) {
    at::NoGradGuard no_grad;
    for (auto& w : p.weights) {
      if (p.kind == Kind::kCpuOffload)
        w.tensor.set_data(w.host);
      else
        release(w.tensor);
    }
    for (auto* q : p.quantized) q->drop_cache();
  }

  ~Impl() {
    for (auto& p : placed)
      if (p.reading.valid()) p.reading.wait();
    for (auto& [h, name] : hooks) h->hooks().remove(name);
  }
};

namespace {

std::vector<at::Tensor> to_device(const std::vector<at::Tensor>& in, const at::Device& d) {
  std::vector<at::Tensor> out;
  out.reserve(in.size());
  for (const auto& t : in) out.push_back(t.defined() && t.device() != d ? t.to(d) : t);
  return out;
}

// Which placement each tensor of `model` belongs to: the placement with the longest module name
// that is a prefix of the tensor's (module "" holds everything).
struct Assignment {
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> tensors;  // per placement
  // Tensors a disk placement reads for its forward though another one holds them (tied weights
  // of two modules on disk), per placement.
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> borrowed;
};

bool under(const std::string& name, const std::string& module) {
  return module.empty() ||
         (name.size() > module.size() && name.compare(0, module.size(), module) == 0 &&
          name[module.size()] == '.');
}

Assignment assign(torch::nn::Module& model, const DeviceMap& map) {
  Assignment a;
  a.tensors.resize(map.size());
  a.borrowed.resize(map.size());
  std::set<std::string> modules;
  for (const auto& item : model.named_modules()) modules.insert(item.key());
  std::set<std::string> seen_places;
  for (const auto& p : map) {
    if (!modules.count(p.module))
      throw ::tandem::Refused("dispatch: the device map places '" + p.module +
                                  "', which the model does not have (its modules are named as "
                                  "named_modules() gives them, e.g. 'transformer.h.0')");
    if (!seen_places.insert(p.module).second)
      throw ::tandem::Refused("dispatch: the device map places '" + p.module + "' twice");
    if (p.device != "cpu" && p.device != "disk" && p.device.rfind("cuda:", 0) != 0)
      throw ::tandem::Refused("dispatch: '" + p.module + "' is placed on '" + p.device +
                                  "'; places are cpu, cuda:<index> and disk");
  }
  std::unordered_map<const c10::TensorImpl*, size_t> where;
  std::unordered_map<const c10::TensorImpl*, std::string> first_name;
  std::vector<std::string> uncovered;
  auto take = [&](const std::string& name, const at::Tensor& t) {
    if (!t.defined()) return;
    long best = -1;
    for (size_t i = 0; i < map.size(); ++i)
      if (under(name, map[i].module) &&
          (best < 0 || map[i].module.size() > map[static_cast<size_t>(best)].module.size()))
        best = static_cast<long>(i);
    if (best < 0) {
      uncovered.push_back(name);
      return;
    }
    auto [it, fresh] = where.emplace(t.unsafeGetTensorImpl(), static_cast<size_t>(best));
    if (!fresh) {
      if (map[it->second].device != map[size_t(best)].device)
        throw ::tandem::Refused(
            "dispatch: '" + name + "' is one tensor with a tensor of '" + map[it->second].module +
            "' (tied weights), but the device map puts them on " + map[it->second].device +
            " and " + map[size_t(best)].device + "; place both modules on one device");
      if (map[it->second].device == "disk" && it->second != size_t(best))
        a.borrowed[size_t(best)].emplace_back(first_name.at(t.unsafeGetTensorImpl()), t);
      return;
    }
    first_name[t.unsafeGetTensorImpl()] = name;
    a.tensors[static_cast<size_t>(best)].emplace_back(name, t);
  };
  for (const auto& p : model.named_parameters()) take(p.key(), p.value());
  for (const auto& b : model.named_buffers()) take(b.key(), b.value());
  if (!uncovered.empty()) {
    std::string list;
    for (size_t i = 0; i < uncovered.size() && i < 5; ++i) list += (i ? ", " : "") + uncovered[i];
    throw ::tandem::Refused("dispatch: " + std::to_string(uncovered.size()) +
                                " tensors are under no placement of the device map (" + list +
                                (uncovered.size() > 5 ? ", ..." : "") +
                                "); place their modules, or the model as \"\"");
  }
  return a;
}

std::string main_device_of(const DeviceMap& map, const std::string& asked) {
  if (!asked.empty()) return asked;
  for (const auto& p : map)
    if (p.device.rfind("cuda:", 0) == 0) return p.device;
  return "cpu";
}

}  // namespace

DispatchedModel::DispatchedModel() : impl_(std::make_unique<Impl>()) {}
DispatchedModel::~DispatchedModel() = default;
const DeviceMap& DispatchedModel::device_map() const { return impl_->map; }
std::string DispatchedModel::main_device() const { return impl_->main; }
DispatchStats DispatchedModel::stats() const { return impl_->stats; }

std::map<std::string, uint64_t> DispatchedModel::bytes_by_place() const {
  std::map<std::string, uint64_t> out;
  for (const auto& p : impl_->placed) out[p.place] += p.bytes;
  return out;
}

uint64_t DispatchedModel::largest_offloaded_bytes() const {
  uint64_t out = 0;
  for (const auto& p : impl_->placed)
    if (p.kind != Impl::Kind::kOnDevice) out = std::max(out, p.bytes);
  return out;
}

std::string DispatchedModel::summary() const {
  std::map<std::string, std::vector<std::string>> by_place;
  for (const auto& p : impl_->placed) by_place[p.place].push_back(p.name);
  const auto bytes = bytes_by_place();
  std::ostringstream out;
  bool first = true;
  for (const auto& [place, names] : by_place) {
    out << (first ? "" : "; ") << place << " " << mb(bytes.at(place)) << " ("
        << fold_module_names(names);
    if (place == "disk")
      out << ": read from " << impl_->source << (impl_->prefetch ? ", one module ahead" : "");
    out << ")";
    first = false;
  }
  return out.str();
}

std::unique_ptr<DispatchedModel> dispatch(torch::nn::Module& model, const DeviceMap& map,
                                          const DispatchOptions& options) {
  auto result = std::make_unique<DispatchedModel>();
  auto& impl = *result->impl_;
  impl.map = map;
  impl.main = main_device_of(map, options.main_device());
  impl.prefetch = options.prefetch();
  const at::Device main(impl.main);
  Assignment a = assign(model, map);
  std::map<std::string, torch::nn::Module*> modules;
  for (const auto& item : model.named_modules()) modules[item.key()] = item.value().get();

  std::set<std::string> execs;
  for (const auto& p : map) execs.insert(p.device == "disk" || p.device == "cpu" ? impl.main : p.device);
  const bool many_devices = execs.size() > 1 || impl.main != "cpu";

  // Where disk modules read from: the checkpoint's files, else offload_dir.
  std::map<std::string, std::string> in_checkpoint;
  bool any_disk = false;
  for (const auto& p : map) any_disk = any_disk || p.device == "disk";
  if (any_disk && !options.checkpoint().empty())
    in_checkpoint = checkpoint::checkpoint_tensor_files(options.checkpoint());
  if (any_disk && !host_allocator_installed()) install_host_allocator();

  at::NoGradGuard no_grad;
  for (size_t i = 0; i < map.size(); ++i) {
    DispatchedModel::Impl::Placed p;
    p.name = map[i].module;
    p.place = map[i].device;
    p.module = modules.at(p.name);
    const bool disk = p.place == "disk";
    const bool offload_cpu = p.place == "cpu" && !main.is_cpu();
    p.kind = disk ? DispatchedModel::Impl::Kind::kDisk
                  : offload_cpu ? DispatchedModel::Impl::Kind::kCpuOffload
                                : DispatchedModel::Impl::Kind::kOnDevice;
    p.exec = disk || offload_cpu ? main : at::Device(p.place);
    auto* h = tandem::nn::hookable(*p.module);
    const bool needs_hook = disk || offload_cpu || many_devices;
    if (needs_hook && !h && !a.tensors[i].empty())
      throw ::tandem::Refused(
          "dispatch: '" + p.name + "' (" + tandem::nn::module_type_name(*p.module) +
          ") is placed on " + p.place +
          ", which needs a hook around its forward, but it is not hookable; declare it with "
          "TANDEM_MODULE (tandem/nn/module.h) or place its hookable children instead");
    std::vector<std::pair<std::string, at::Tensor>> to_write;
    auto weights = a.tensors[i];
    weights.insert(weights.end(), a.borrowed[i].begin(), a.borrowed[i].end());
    for (size_t k = 0; k < weights.size(); ++k) {
      const auto& name = weights[k].first;
      const auto& t = weights[k].second;
      DispatchedModel::Impl::Weight w{name, t, "", {}};
      if (k < a.tensors[i].size()) p.bytes += bytes_of(t);
      if (disk) {
        auto f = in_checkpoint.find(name);
        if (f != in_checkpoint.end()) {
          w.file = f->second;
        } else {
          if (is_empty_weight(t))
            throw ::tandem::Refused(
                "dispatch: '" + name + "' is placed on disk, has no values and is not in the "
                "checkpoint" + (options.checkpoint().empty() ? std::string(" (none was given)")
                                                             : " '" + options.checkpoint() + "'") +
                "; load it first or give DispatchOptions().checkpoint");
          if (options.offload_dir().empty())
            throw ::tandem::Refused(
                "dispatch: '" + name + "' is placed on disk and is not in a checkpoint file; "
                "give an offload_dir (--offload_dir) to write it to");
          to_write.emplace_back(name, t.to(at::kCPU));
        }
      } else if (offload_cpu) {
        if (is_empty_weight(t))
          throw ::tandem::Refused("dispatch: '" + name + "' has no values; load it first");
        w.host = t.device().is_cpu() ? t.detach() : t.detach().to(at::kCPU);
        t.set_data(w.host);
      } else {
        if (is_empty_weight(t))
          throw ::tandem::Refused("dispatch: '" + name + "' (placed on " + p.place +
                                      ") has no values; load_checkpoint_and_dispatch loads "
                                      "them");
        if (t.device() != p.exec) t.set_data(t.to(p.exec));
      }
      p.weights.push_back(std::move(w));
    }
    if (!to_write.empty()) {
      fs::create_directories(options.offload_dir());
      auto file = (fs::path(options.offload_dir()) / (p.name.empty() ? "model" : p.name)).string() +
                  ".safetensors";
      checkpoint::save_safetensors(file, to_write);
      for (auto& w : p.weights)
        if (w.file.empty()) w.file = file;
    }
    if (disk) {
      for (const auto& m : p.module->modules())
        if (auto* q = dynamic_cast<QuantizedLinearImpl*>(m.get())) p.quantized.push_back(q);
      for (auto& w : p.weights) {
        if (!impl.files.count(w.file))
          impl.files[w.file] = std::make_unique<checkpoint::SafetensorsFile>(w.file);
        release(w.tensor);
      }
    }
    impl.placed.push_back(std::move(p));
  }
  std::set<std::string> shown;
  for (const auto& [file, _] : impl.files) {
    const bool written = !options.offload_dir().empty() && file.rfind(options.offload_dir(), 0) == 0;
    const auto what = written ? options.offload_dir() : fs::path(file).filename().string();
    if (shown.insert(what).second) impl.source += (impl.source.empty() ? "" : ", ") + what;
  }

  auto* self = &impl;
  for (size_t i = 0; i < impl.placed.size(); ++i) {
    auto& p = impl.placed[i];
    auto* h = tandem::nn::hookable(*p.module);
    if (!h) continue;
    const bool plain = p.kind == DispatchedModel::Impl::Kind::kOnDevice;
    if (plain && !many_devices) continue;
    const std::string hook_name = "device map: " + p.place;
    const int index = static_cast<int>(i);
    h->hooks().add(
        hook_name, tandem::nn::order::kOffload,
        [self, index](const std::vector<at::Tensor>& inputs, const tandem::nn::TensorFunction& next) {
          auto& q = self->placed[size_t(index)];
          if (q.kind == DispatchedModel::Impl::Kind::kOnDevice) return next(to_device(inputs, q.exec));
          if (q.weights.empty()) return next(to_device(inputs, q.exec));
          if (self->last_disk >= 0 && self->last_disk != index)
            self->placed[size_t(self->last_disk)].next_disk = index;
          self->last_disk = index;
          self->bring_in(q);
          if (self->prefetch && q.next_disk >= 0 && q.next_disk != index) self->start_read(q.next_disk);
          auto out = next(to_device(inputs, q.exec));
          self->give_back(q);
          if (self->prefetch && q.next_disk == index) self->start_read(index);
          return out;
        });
    impl.hooks.emplace_back(h, hook_name);
  }
  return result;
}

std::unique_ptr<DispatchedModel> load_checkpoint_and_dispatch(torch::nn::Module& model,
                                                              const std::string& checkpoint,
                                                              const DeviceMap& map,
                                                              DispatchOptions options) {
  options.checkpoint(checkpoint);
  Assignment a = assign(model, map);
  std::unordered_map<const c10::TensorImpl*, bool> on_disk;
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < map.size(); ++i) {
      const bool disk = map[i].device == "disk";
      const bool cpu_offload = map[i].device == "cpu" && !at::Device(main_device_of(map, options.main_device())).is_cpu();
      for (auto& [name, t] : a.tensors[i]) {
        on_disk[t.unsafeGetTensorImpl()] = disk;
        if (disk) continue;
        // Each tensor gets its bytes where it will live, then the checkpoint is read into it.
        const at::Device d = cpu_offload ? at::Device(at::kCPU) : at::Device(map[i].device);
        if (is_empty_weight(t) || t.device() != d)
          t.set_data(at::empty(t.sizes(), t.options().device(d)));
      }
    }
  }
  checkpoint::load_model(model, checkpoint,
                         checkpoint::LoadOptions().allow_dtype_cast(options.allow_dtype_cast()),
                         [&](const at::Tensor& t) -> std::optional<std::vector<checkpoint::TensorSlice>> {
                           auto it = on_disk.find(t.unsafeGetTensorImpl());
                           if (it != on_disk.end() && it->second)
                             return std::vector<checkpoint::TensorSlice>{};
                           return std::nullopt;
                         });
  return dispatch(model, map, options);
}

}  // namespace tandem::inference
