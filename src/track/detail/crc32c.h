// CRC32C (Castagnoli), the checksum of TensorFlow's record format, and its "masked" form.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tandem::track::detail {

/// CRC32C of `size` bytes, continuing from `crc` (0 to start). Table-driven, one byte per step:
/// event files are small, so the slicing or SSE4.2 versions would not be measurable here.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

/// TensorFlow's masked CRC: rotate right by 15 and add a constant, so that a CRC stored inside
/// the data it covers does not make the CRC of that data degenerate.
inline uint32_t mask_crc(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

}  // namespace tandem::track::detail
