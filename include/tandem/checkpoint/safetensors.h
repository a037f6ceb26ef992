// Hugging Face's safetensors format for LibTorch tensors: a writer (save_safetensors) and a
// memory-mapped, validating reader (SafetensorsFile). No pickle, no torch::load.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <string>
#include <utility>
#include <vector>

#include "tandem/checkpoint/safetensors_header.h"

namespace tandem::checkpoint {

/// Tensors with their names, in the caller's order.
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// Whether this LibTorch has a scalar type for `dtype` (F8_* need LibTorch >= 2.1).
bool dtype_supported(Dtype dtype);
/// The LibTorch scalar type of `dtype`. Throws std::invalid_argument when this LibTorch has none.
c10::ScalarType to_scalar_type(Dtype dtype);
/// The safetensors dtype of `type`. Throws std::invalid_argument for types the format lacks
/// (complex, quantized, unsigned wider than 8 bits).
Dtype dtype_of(c10::ScalarType type);

/// Writes `tensors` to `path` (created or truncated) in the safetensors format and fsyncs it.
/// Each tensor is made contiguous and copied to the CPU one at a time, so memory stays near one
/// tensor beyond what the caller holds. Layout: see plan_safetensors_layout (element size, then
/// name); names must be unique, valid UTF-8 and not "__metadata__". Tensors that share storage
/// are each written in full (the format has no shared storage). The file is written in place:
/// callers that need atomicity write into a temporary directory and rename it.
/// Throws std::invalid_argument for bad input and std::runtime_error (with errno text) on I/O.
///
/// Example:
///   tandem::checkpoint::save_safetensors("w.safetensors", {{"weight", w}, {"bias", b}},
///                                        {{"format", "pt"}});
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const SafetensorsMetadata& metadata = {});

/// The bytes save_safetensors would write, in memory (for tests and small payloads).
std::string serialize_safetensors(const NamedTensors& tensors,
                                  const SafetensorsMetadata& metadata = {});

/// A safetensors file, memory-mapped read-only and validated as a whole on opening (see
/// parse_safetensors_header); tensors are copied out of the map on demand. Movable, not
/// copyable; the map is released by the destructor. The file must not be truncated while open
/// (reading a page that vanished raises SIGBUS, as for any mapped file).
///
/// Example:
///   tandem::checkpoint::SafetensorsFile f("model.safetensors");
///   for (const auto& name : f.names()) std::cout << name << " " << f.tensor(name).sizes();
class SafetensorsFile {
 public:
  /// Opens and validates `path`. Throws SafetensorsError for a malformed file and
  /// std::runtime_error when it cannot be opened or mapped.
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  /// Tensor names, sorted.
  std::vector<std::string> names() const;
  std::size_t size() const { return header_.tensors.size(); }
  bool contains(const std::string& name) const { return header_.tensors.count(name) > 0; }
  /// dtype, shape and data offsets of `name`. Throws std::invalid_argument for an unknown name.
  const TensorInfo& info(const std::string& name) const;
  /// The whole validated header.
  const SafetensorsHeader& header() const { return header_; }
  /// The "__metadata__" object (empty when absent).
  const SafetensorsMetadata& metadata() const { return header_.metadata; }

  /// A new CPU tensor holding `name`'s values (owned: it outlives this object). Throws
  /// std::invalid_argument for an unknown name and std::runtime_error for a dtype this LibTorch
  /// cannot represent (F8 before LibTorch 2.1).
  at::Tensor tensor(const std::string& name) const;
  /// Copies `name`'s values into `dst` (same shape; any device; the dtype is converted as by
  /// Tensor::copy_). When `dst` is a contiguous CPU tensor of the same dtype the bytes are read
  /// from the file straight into its storage (pread: one copy out of the page cache, no page
  /// faults on a mapping, nothing resident beyond `dst`). Throws std::invalid_argument when the
  /// shapes differ, std::runtime_error when reading fails.
  void read_into(const std::string& name, at::Tensor& dst) const;
  /// Copies elements [begin, begin + dst.numel()) of `name`, flattened in row-major order, into
  /// `dst` (any shape with that many elements): only those bytes are read (a ZeRO-3 rank's
  /// shard of a parameter). Conversions as read_into. Throws std::invalid_argument when the range
  /// is not inside the tensor.
  void read_range_into(const std::string& name, int64_t begin, at::Tensor& dst) const;

 private:
  void read_elements(const std::string& name, int64_t begin, at::Tensor& dst) const;
  c10::ScalarType scalar_type_of(const std::string& name, const TensorInfo& info) const;
  const void* data_of(const TensorInfo& info) const;
  void close_file() noexcept;

  std::string path_;
  int fd_ = -1;  // kept open for read_into's pread
  void* map_ = nullptr;
  std::size_t map_size_ = 0;
  SafetensorsHeader header_;
};

}  // namespace tandem::checkpoint
