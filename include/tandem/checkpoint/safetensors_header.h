// The safetensors header without LibTorch: dtypes, the validating header parser, the layout and
// the encoder that the writer uses. Kept free of torch so that the fuzz target builds in seconds.
//
// Format (https://github.com/huggingface/safetensors): an 8-byte little-endian u64 N, then N
// bytes of UTF-8 JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, ...} with an
// optional "__metadata__" object of string -> string, padded with trailing spaces; then the data
// section: every tensor's bytes, little-endian, row-major, offsets relative to its start.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::checkpoint {

/// A file that breaks the safetensors format. The message names the file, the tensor, what
/// was expected and what was found.
class SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The element types of the safetensors format that tandem knows.
enum class Dtype { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool, kF8_E4M3, kF8_E5M2 };

/// Every Dtype, in declaration order.
const std::vector<Dtype>& all_dtypes();
/// The format's spelling: "F32", "BF16", "BOOL", "F8_E4M3", ...
std::string_view dtype_name(Dtype dtype);
/// The Dtype spelled `name` (case-sensitive, as in the format), or nullopt.
std::optional<Dtype> dtype_from_name(std::string_view name);
/// Bytes per element.
std::size_t dtype_size(Dtype dtype);

/// Free-form string -> string metadata ("__metadata__" in the header).
using SafetensorsMetadata = std::map<std::string, std::string>;

/// One tensor's entry in the header. `begin`/`end` are byte offsets into the data section.
struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;

  uint64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

/// A validated header.
struct SafetensorsHeader {
  /// N, the length of the JSON header including its padding.
  uint64_t header_size = 0;
  /// Size of the data section (file size - 8 - N).
  uint64_t data_size = 0;
  /// Entries by name.
  std::map<std::string, TensorInfo> tensors;
  SafetensorsMetadata metadata;

  /// Offset of the data section from the start of the file.
  uint64_t data_offset() const { return 8 + header_size; }
};

/// Largest header accepted (the reference implementation's bound).
constexpr uint64_t kMaxSafetensorsHeaderSize = 100'000'000;

/// Parses and validates the header of a safetensors file of `file_size` bytes whose first bytes
/// are `prefix` (the length, then at least the N header bytes; the whole file is fine). Nothing is
/// trusted before it is checked: the size bound, the JSON, every entry's fields and types, known
/// dtypes, non-negative shapes, offsets inside the data section, byte counts that match
/// shape x dtype size (overflow checked), tensors that tile the data section exactly with
/// neither gaps nor overlaps, no duplicate keys. Throws SafetensorsError whose message starts
/// with "safetensors file '<source>'" and names the offending tensor.
SafetensorsHeader parse_safetensors_header(std::string_view prefix, uint64_t file_size,
                                           const std::string& source);

/// Reads and validates the header of the safetensors file at `path` (only its first 8 + N
/// bytes), with parse_safetensors_header against the file's real size. Throws SafetensorsError
/// naming the file when it cannot be read or breaks the format.
SafetensorsHeader read_safetensors_header(const std::string& path);

/// A validated sharded-checkpoint index (`model.safetensors.index.json`, as transformers and
/// tandem write it): {"metadata": {...}, "weight_map": {tensor name: shard file name}}.
struct SafetensorsIndex {
  /// Tensor name -> shard file name (a plain name in the index's directory).
  std::map<std::string, std::string> weight_map;
  /// The distinct shard file names, sorted.
  std::vector<std::string> files;
  /// "metadata"."total_size" when present (bytes of all tensors), else nullopt.
  std::optional<uint64_t> total_size;
};

/// Parses and validates an index's text: a JSON object with a "weight_map" object whose values
/// are plain file names (no directories, not "." or ".."), an optional "metadata" object whose
/// "total_size", when given, is a non-negative integer. Throws SafetensorsError whose message
/// starts with "safetensors index '<source>'" and says what was expected and found.
SafetensorsIndex parse_safetensors_index(std::string_view text, const std::string& source);

/// Reads `path` and parse_safetensors_index()es it (SafetensorsError when unreadable).
SafetensorsIndex read_safetensors_index(const std::string& path);

/// Orders entries as tandem writes them and assigns their data offsets: by element size,
/// largest first, then by name. The reference writer orders by dtype (largest alignment first)
/// then name; ordering within one element size by name alone keeps every tensor aligned to its
/// element size in the file (the data section starts at a multiple of 8) and is simpler to
/// reproduce. Checks for empty, duplicate and reserved ("__metadata__") names and for byte
/// counts that overflow. Throws std::invalid_argument naming the tensor.
std::vector<TensorInfo> plan_safetensors_layout(std::vector<TensorInfo> entries);

/// The first 8 + N bytes of a file holding `entries` (in data order, offsets set, as from
/// plan_safetensors_layout): the length, then compact JSON with "__metadata__" first (omitted
/// when empty, keys sorted), then each tensor as {"dtype","shape","data_offsets"} in data order,
/// padded with spaces to a multiple of 8 bytes as the reference writer does.
std::string encode_safetensors_header(const std::vector<TensorInfo>& entries,
                                      const SafetensorsMetadata& metadata);

}  // namespace tandem::checkpoint
