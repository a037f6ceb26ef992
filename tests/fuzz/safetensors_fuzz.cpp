// libFuzzer target: the safetensors header parser on arbitrary bytes taken as a whole file, and
// the index parser on the same bytes taken as an index's text.
// A malformed input must end in SafetensorsError, never in a crash, an out-of-range read (ASan)
// or another exception; an accepted header must satisfy the invariants that readers rely on,
// and re-encoding it must give a header that parses to the same entries.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/checkpoint/safetensors_header.h"

using namespace tandem::checkpoint;

namespace {

void check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

namespace {

void fuzz_index(std::string_view text) {
  SafetensorsIndex index;
  try {
    index = parse_safetensors_index(text, "fuzz-index");
  } catch (const SafetensorsError&) {
    return;
  }
  for (const auto& [name, file] : index.weight_map) {
    check(!file.empty() && file != "." && file != ".." && file.find('/') == std::string::npos);
    check(std::binary_search(index.files.begin(), index.files.end(), file));
  }
  check(index.files.size() <= index.weight_map.size());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  fuzz_index(bytes);
  SafetensorsHeader h;
  try {
    h = parse_safetensors_header(bytes, size, "fuzz-input");
  } catch (const SafetensorsError&) {
    return 0;
  }
  // Invariants of an accepted header.
  check(8 + h.header_size + h.data_size == size);
  check(h.header_size <= kMaxSafetensorsHeaderSize);
  uint64_t covered = 0;
  for (const auto& [name, info] : h.tensors) {
    check(info.begin <= info.end && info.end <= h.data_size);
    check(info.numel() * dtype_size(info.dtype) == info.nbytes());
    covered += info.nbytes();
  }
  check(covered == h.data_size);

  // Re-encode what was accepted (names and metadata are valid UTF-8: they came from JSON).
  std::vector<TensorInfo> entries;
  for (const auto& [name, info] : h.tensors) entries.push_back(info);
  std::sort(entries.begin(), entries.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
  });
  std::string again = encode_safetensors_header(entries, h.metadata);
  check(again.size() % 8 == 0);
  again.append(bytes.substr(8 + h.header_size));
  SafetensorsHeader h2 = parse_safetensors_header(again, again.size(), "fuzz-reencoded");
  check(h2.tensors.size() == h.tensors.size() && h2.metadata == h.metadata);
  for (const auto& [name, info] : h.tensors) {
    const TensorInfo& b = h2.tensors.at(name);
    check(b.dtype == info.dtype && b.shape == info.shape && b.begin == info.begin &&
          b.end == info.end);
  }
  return 0;
}
