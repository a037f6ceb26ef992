// Device maps for big-model inference, as Accelerate's infer_auto_device_map computes them: which
// module runs where (a CUDA device, the CPU, or "disk": weights kept in their file and read just
// before the module's forward), from the modules' sizes and a memory budget per device.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace tandem::inference {

/// One placement: `module` (a qualified name as named_modules gives it; "" is the whole model)
/// and where it goes: "cuda:<i>", "cpu" or "disk".
struct Placement {
  std::string module;
  std::string device;
  bool operator==(const Placement& o) const { return module == o.module && device == o.device; }
};
/// Placements in the model's order; every parameter and buffer is under exactly one of them.
using DeviceMap = std::vector<Placement>;

/// Bytes per device: {"cuda:0": ..., "cpu": ...}. A device left out gets none.
using MaxMemory = std::map<std::string, uint64_t>;

/// "64MB" (the CPU's budget) or "cuda:0=2GB,cuda:1=2GB,cpu=8GB" (sizes as parse_size reads them:
/// KB/MB/GB powers of 1000, KiB/MiB/GiB powers of 1024). Throws std::invalid_argument naming the
/// entry and the form expected.
MaxMemory parse_max_memory(const std::string& text);
/// What this machine has: each CUDA device's free memory and the CPU's available memory
/// (MemAvailable), as Accelerate's get_max_memory.
MaxMemory machine_max_memory();

/// A module as the planner sees it: its qualified name, the bytes of the tensors directly under
/// it that no earlier entry holds (tied tensors are counted once, where they first appear), its
/// children (indices into the list), whether it may be split into them, and the entries it shares
/// a tensor with (tied weights: kept on one device).
struct ModuleSize {
  std::string name;
  uint64_t own_bytes = 0;    // parameters and buffers directly on this module
  uint64_t total_bytes = 0;  // own + all descendants
  std::vector<size_t> children;
  bool splittable = true;
  std::vector<size_t> tied;  // other entries holding one of this module's tensors
  /// Whether dispatch can hook its forward (TANDEM_MODULE): one that cannot is split into its
  /// children rather than offloaded whole (a ModuleList of blocks).
  bool hookable = true;
};

/// Options of infer_device_map.
///
/// Example:
///   auto map = tandem::inference::infer_device_map(*model,
///       tandem::inference::DeviceMapOptions().max_memory({{"cpu", 64'000'000}}));
struct DeviceMapOptions {
  /// Budget per device; empty: machine_max_memory().
  TORCH_ARG(MaxMemory, max_memory);
  /// Accelerate's policies: "auto" and "balanced" spread the model evenly over the CUDA devices,
  /// "balanced_low_0" leaves the first CUDA device as little as it needs (it holds generate()'s
  /// outputs), "sequential" fills each device before the next. With no CUDA device all four
  /// fill the CPU, then disk.
  TORCH_ARG(std::string, policy) = "auto";
  /// Module types (as module_type_name gives them: "Block", "GPT2Block") never split between
  /// devices. Empty: every module declared with TANDEM_MODULE whose children are modules of
  /// their own (the model's blocks) and is not the model itself.
  TORCH_ARG(std::vector<std::string>, no_split_module_types);
};

/// The device map of `model` for `options` (Note [Device map policy] in device_map.cpp). The
/// model may be built with init_empty_weights: sizes come from the tensors' shapes.
DeviceMap infer_device_map(torch::nn::Module& model, const DeviceMapOptions& options = {});

/// The planning step on plain data (for tests): `modules` in the model's order, the root first;
/// `devices` in the order to fill (CUDA devices, then "cpu"; "disk" is implicit), each with its
/// budget in `budget`. Throws std::runtime_error when the model does not fit and "disk" is not
/// allowed (`allow_disk` false).
DeviceMap plan_device_map(const std::vector<ModuleSize>& modules,
                          const std::vector<std::string>& devices, const MaxMemory& budget,
                          bool allow_disk = true);

/// Accelerate's get_balanced_memory: the per-CUDA-device budgets that spread `model_bytes` evenly
/// (each device's share plus the largest unsplittable module, never above what it has);
/// `low_zero` gives the first device only the largest module. Other devices keep their budget.
MaxMemory balanced_memory(const MaxMemory& max_memory, uint64_t model_bytes,
                          uint64_t largest_module_bytes, bool low_zero);

/// "transformer.wte: cpu, transformer.h.0-3: cpu, transformer.h.4-11: disk, ..." (runs of
/// numbered siblings on one device folded).
std::string describe_device_map(const DeviceMap& map);
/// The names with runs of numbered siblings folded: "h.0-3, ln_f".
std::string fold_module_names(const std::vector<std::string>& names);

}  // namespace tandem::inference
