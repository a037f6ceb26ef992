// Device maps (tandem/inference/device_map.h).
#include "tandem/inference/device_map.h"
#include "tandem/error.h"

#include <torch/cuda.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "tandem/checkpoint/model_io.h"
#include "tandem/nn/module.h"
#include "inference/detail/cuda_memory.h"

namespace tandem::inference {

MaxMemory parse_max_memory(const std::string& text) {
  MaxMemory out;
  auto bad = [&](const std::string& entry, const std::string& why) {
    return ::tandem::Refused("max_memory '" + text + "': entry '" + entry + "' " + why +
                                 " (expected a size such as 64MB, or device=size entries "
                                 "separated by commas: cuda:0=2GB,cpu=8GB)");
  };
  std::stringstream in(text);
  std::string entry;
  while (std::getline(in, entry, ',')) {
    if (entry.empty()) throw bad(entry, "is empty");
    const auto eq = entry.find('=');
    std::string device = eq == std::string::npos ? "cpu" : entry.substr(0, eq);
    const std::string size = eq == std::string::npos ? entry : entry.substr(eq + 1);
    if (device != "cpu" && device.rfind("cuda:", 0) != 0)
      throw bad(entry, "names device '" + device + "'; devices are cpu and cuda:<index>");
    if (device.rfind("cuda:", 0) == 0) {
      const auto idx = device.substr(5);
      if (idx.empty() || idx.find_first_not_of("0123456789") != std::string::npos)
        throw bad(entry, "names device '" + device + "'");
    }
    try {
      out[device] = checkpoint::parse_size(size);
    } catch (const std::invalid_argument& e) {
      throw bad(entry, std::string("has no size: ") + e.what());
    }
  }
  if (out.empty()) throw bad(text, "is empty");
  return out;
}

MaxMemory machine_max_memory() {
  MaxMemory out;
  const int n = static_cast<int>(torch::cuda::device_count());
  for (int d = 0; d < n; ++d) out["cuda:" + std::to_string(d)] = detail::cuda_free_bytes(d);
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (meminfo >> key >> kb >> unit)
    if (key == "MemAvailable:") out["cpu"] = kb * 1024;
  return out;
}

MaxMemory balanced_memory(const MaxMemory& max_memory, uint64_t model_bytes,
                          uint64_t largest_module_bytes, bool low_zero) {
  std::vector<std::string> cuda;
  for (const auto& [device, bytes] : max_memory)
    if (device.rfind("cuda:", 0) == 0) cuda.push_back(device);
  std::sort(cuda.begin(), cuda.end(), [](const std::string& a, const std::string& b) {
    return std::stoi(a.substr(5)) < std::stoi(b.substr(5));
  });
  MaxMemory out = max_memory;
  const size_t sharing = low_zero ? cuda.size() - (cuda.empty() ? 0 : 1) : cuda.size();
  if (cuda.size() <= 1 && !low_zero) return out;
  if (sharing == 0) return out;
  const uint64_t per_device = model_bytes / sharing + largest_module_bytes;
  for (size_t i = 0; i < cuda.size(); ++i) {
    auto& b = out[cuda[i]];
    if (low_zero && i == 0) {
      uint64_t others = 0;
      for (size_t j = 1; j < cuda.size(); ++j) others += std::min(max_memory.at(cuda[j]), per_device);
      const uint64_t rest = model_bytes > others ? model_bytes - others : 0;
      b = std::min(b, std::max(rest, largest_module_bytes));
    } else {
      b = std::min(b, per_device);
    }
  }
  return out;
}

// Note [Device map policy]: Accelerate's infer_auto_device_map. The model's top-level modules are
// taken in order and put on the current device while they fit in its budget; one that does not
// fit is split into its children when it may be (not a no-split type, no tensors of its own),
// else the next device is taken. After the CUDA devices and the CPU comes "disk", which holds
// anything; a module dispatch cannot hook (a ModuleList) goes there as its children. When the
// model does not fit in the devices' budgets, room is kept on the first device and on the CPU
// for the largest unsplittable module not yet placed, other than the one being placed: a module
// on disk is brought there for its forward (and the next one is read ahead: Note [Disk offload]
// in dispatch.cpp). Accelerate keeps the largest of all, so that an embedding larger than any
// block would keep itself out of memory. A module and the modules it shares a tensor with (tied
// weights) are placed together.
DeviceMap plan_device_map(const std::vector<ModuleSize>& modules,
                          const std::vector<std::string>& devices, const MaxMemory& budget,
                          bool allow_disk) {
  DeviceMap map;
  if (modules.empty()) return map;
  uint64_t capacity = 0;
  for (const auto& d : devices) capacity += budget.count(d) ? budget.at(d) : 0;
  const bool offload = modules[0].total_bytes > capacity;
  std::vector<bool> placed(modules.size(), false);
  // The largest unsplittable module not yet placed, other than `except` and its descendants:
  // what may still go to disk and be brought in for its forward.
  std::function<bool(size_t, size_t)> inside = [&](size_t i, size_t root) {
    if (i == root) return true;
    for (auto c : modules[root].children)
      if (inside(i, c)) return true;
    return false;
  };
  auto largest_left = [&](const std::vector<size_t>& except) {
    uint64_t out = 0;
    for (size_t i = 0; i < modules.size(); ++i) {
      const auto& m = modules[i];
      if (placed[i] || (m.splittable && !m.children.empty())) continue;
      bool skip = false;
      for (auto e : except) skip = skip || inside(i, e);
      if (!skip) out = std::max(out, m.total_bytes);
    }
    return out;
  };
  std::function<void(size_t)> mark = [&](size_t i) {
    placed[i] = true;
    for (auto c : modules[i].children) mark(c);
  };
  std::deque<size_t> queue;
  if (modules[0].children.empty() || !modules[0].splittable)
    queue.push_back(0);
  else
    queue.assign(modules[0].children.begin(), modules[0].children.end());
  std::map<std::string, uint64_t> used;
  size_t device = 0;
  while (!queue.empty()) {
    const size_t i = queue.front();
    queue.pop_front();
    if (placed[i]) continue;
    const auto& m = modules[i];
    std::vector<size_t> together{i};
    uint64_t size = m.total_bytes;
    for (auto t : m.tied)
      if (!placed[t]) {
        together.push_back(t);
        size += modules[t].total_bytes;
      }
    for (;;) {
      if (device >= devices.size()) {
        if (allow_disk && !m.hookable && !m.children.empty()) {
          queue.insert(queue.begin(), m.children.begin(), m.children.end());
          break;
        }
        if (!allow_disk)
          throw std::runtime_error("device map: '" + m.name + "' (" + std::to_string(size) +
                                   " bytes) fits on no device; give the devices more memory "
                                   "or allow disk offload");
        for (auto t : together) {
          map.push_back({modules[t].name, "disk"});
          mark(t);
        }
        break;
      }
      const auto& d = devices[device];
      const uint64_t cap = budget.count(d) ? budget.at(d) : 0;
      const bool main_device = d == devices.front() || d == "cpu";
      const uint64_t keep = offload && main_device ? largest_left(together) : 0;
      const uint64_t room = cap > keep ? cap - keep : 0;
      if (used[d] + size <= room) {
        used[d] += size;
        for (auto t : together) {
          map.push_back({modules[t].name, d});
          mark(t);
        }
        break;
      }
      if (m.splittable && !m.children.empty()) {
        queue.insert(queue.begin(), m.children.begin(), m.children.end());
        break;
      }
      ++device;
    }
  }
  return map;
}

namespace {

uint64_t tensor_bytes(const at::Tensor& t) {
  return static_cast<uint64_t>(t.numel()) * t.element_size();
}

}  // namespace

DeviceMap infer_device_map(torch::nn::Module& model, const DeviceMapOptions& options) {
  MaxMemory budget = options.max_memory().empty() ? machine_max_memory() : options.max_memory();
  const auto& policy = options.policy();
  if (policy != "auto" && policy != "balanced" && policy != "balanced_low_0" &&
      policy != "sequential")
    throw ::tandem::Refused("device map policy '" + policy +
                                "': expected auto, balanced, balanced_low_0 or sequential");
  // Module types seen more than once: the model's repeated blocks.
  std::map<std::string, int> type_count;
  for (const auto& item : model.named_modules())
    type_count[tandem::nn::module_type_name(*item.value())]++;
  std::set<std::string> no_split(options.no_split_module_types().begin(),
                                 options.no_split_module_types().end());

  std::vector<ModuleSize> modules;
  std::unordered_set<const c10::TensorImpl*> seen;
  std::unordered_map<const c10::TensorImpl*, size_t> owner;
  std::function<size_t(const std::string&, torch::nn::Module&, bool)> visit =
      [&](const std::string& name, torch::nn::Module& m, bool root) -> size_t {
    const size_t index = modules.size();
    modules.push_back({});
    modules[index].name = name;
    std::vector<size_t> tied;
    uint64_t own = 0;
    auto take = [&](const at::Tensor& t) {
      if (!t.defined()) return;
      auto* impl = t.unsafeGetTensorImpl();
      if (seen.insert(impl).second) {
        own += tensor_bytes(t);
        owner[impl] = index;
      } else {
        tied.push_back(owner[impl]);
      }
    };
    for (const auto& p : m.named_parameters(false)) take(p.value());
    for (const auto& b : m.named_buffers(false)) take(b.value());
    uint64_t total = own;
    std::vector<size_t> children;
    for (const auto& c : m.named_children()) {
      const size_t ci = visit(name.empty() ? c.key() : name + "." + c.key(), *c.value(), false);
      children.push_back(ci);
      total += modules[ci].total_bytes;
    }
    auto& entry = modules[index];
    entry.own_bytes = own;
    entry.total_bytes = total;
    entry.children = std::move(children);
    const auto type = tandem::nn::module_type_name(m);
    const auto* h = tandem::nn::hookable(m);
    const bool repeated_block = options.no_split_module_types().empty() && !root && h &&
                                !h->standard_layer() && !entry.children.empty() &&
                                type_count[type] > 1;
    entry.hookable = h != nullptr;
    entry.splittable = !(no_split.count(type) || repeated_block || (own > 0 && !entry.children.empty()));
    for (auto t : tied) {
      entry.tied.push_back(t);
      modules[t].tied.push_back(index);
    }
    return index;
  };
  visit("", model, true);

  std::vector<std::string> devices;
  for (const auto& [device, bytes] : budget)
    if (device.rfind("cuda:", 0) == 0) devices.push_back(device);
  std::sort(devices.begin(), devices.end(), [](const std::string& a, const std::string& b) {
    return std::stoi(a.substr(5)) < std::stoi(b.substr(5));
  });
  if (policy != "sequential" && !devices.empty()) {
    uint64_t largest = 0;
    for (const auto& m : modules)
      if (!m.splittable || m.children.empty()) largest = std::max(largest, m.total_bytes);
    budget = balanced_memory(budget, modules[0].total_bytes, largest, policy == "balanced_low_0");
  }
  if (budget.count("cpu")) devices.push_back("cpu");
  return plan_device_map(modules, devices, budget, true);
}

namespace {

std::string fold_map(const DeviceMap& map, bool with_places) {
  // Folds "a.h.3", "a.h.4", ... on one device into "a.h.3-7".
  std::ostringstream out;
  size_t i = 0;
  auto split = [](const std::string& name, std::string& stem, long& number) {
    const auto dot = name.rfind('.');
    const auto tail = dot == std::string::npos ? name : name.substr(dot + 1);
    if (tail.empty() || tail.find_first_not_of("0123456789") != std::string::npos) return false;
    stem = dot == std::string::npos ? "" : name.substr(0, dot + 1);
    number = std::stol(tail);
    return true;
  };
  while (i < map.size()) {
    std::string stem;
    long first = 0;
    size_t j = i + 1;
    if (split(map[i].module, stem, first)) {
      long expect = first + 1;
      std::string s;
      long n = 0;
      while (j < map.size() && map[j].device == map[i].device && split(map[j].module, s, n) &&
             s == stem && n == expect) {
        ++j;
        ++expect;
      }
    }
    if (i) out << ", ";
    out << (map[i].module.empty() ? "(model)" : map[i].module);
    if (j > i + 1) out << "-" << (first + static_cast<long>(j - i) - 1);
    if (with_places) out << ": " << map[i].device;
    i = j;
  }
  return out.str();
}

}  // namespace

std::string fold_module_names(const std::vector<std::string>& names) {
  DeviceMap map;
  for (const auto& n : names) map.push_back({n, ""});
  return fold_map(map, false);
}

std::string describe_device_map(const DeviceMap& map) { return fold_map(map, true); }

}  // namespace tandem::inference
