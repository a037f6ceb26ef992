// Reading a whole file (or its tail from an offset) into a string, in blocks. Shared by the
// library's source files, the launcher's included (no LibTorch here).
#pragma once

#include <fstream>
#include <optional>
#include <string>

namespace tandem::detail {

/// The bytes of `path` from byte `from` to its end; nullopt when it cannot be opened or a read
/// fails. An empty file (or an offset at its end) gives "". Unlike `stream << in.rdbuf()`, which
/// sets the failbit of `stream` on an empty file and then silently drops whatever follows, this
/// leaves nothing to guard.
inline std::optional<std::string> read_file(const std::string& path, std::streamoff from = 0) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  if (from > 0 && !in.seekg(from)) return std::nullopt;
  std::string out;
  char block[1 << 16];
  while (in.read(block, sizeof block) || in.gcount() > 0)
    out.append(block, static_cast<size_t>(in.gcount()));
  if (in.bad()) return std::nullopt;
  return out;
}

}  // namespace tandem::detail
