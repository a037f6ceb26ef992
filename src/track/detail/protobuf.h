// The few pieces of the protobuf wire format that TensorBoard event files need, written by hand
// so that tandem needs neither protobuf nor TensorFlow.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace tandem::track::detail {

/// Appends protobuf fields to a byte string. Field numbers come from TensorBoard's
/// event.proto / summary.proto / tensor.proto (see tensorboard_tracker.cpp).
class ProtoWriter {
 public:
  enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

  ProtoWriter& varint_field(uint32_t field, uint64_t v) {
    key(field, kVarint);
    varint(v);
    return *this;
  }
  /// int64 fields are varints of the two's-complement value (negative: 10 bytes).
  ProtoWriter& int64_field(uint32_t field, int64_t v) {
    return varint_field(field, static_cast<uint64_t>(v));
  }
  ProtoWriter& double_field(uint32_t field, double v) {
    key(field, kFixed64);
    uint64_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    little_endian(bits, 8);
    return *this;
  }
  ProtoWriter& float_field(uint32_t field, float v) {
    key(field, kFixed32);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    little_endian(bits, 4);
    return *this;
  }
  ProtoWriter& bytes_field(uint32_t field, const std::string& bytes) {
    key(field, kLengthDelimited);
    varint(bytes.size());
    data_ += bytes;
    return *this;
  }
  ProtoWriter& message_field(uint32_t field, const ProtoWriter& message) {
    return bytes_field(field, message.data_);
  }
  const std::string& data() const { return data_; }

 private:
  void key(uint32_t field, WireType type) { varint((static_cast<uint64_t>(field) << 3) | type); }
  void varint(uint64_t v) {
    while (v >= 0x80) {
      data_ += static_cast<char>((v & 0x7F) | 0x80);
      v >>= 7;
    }
    data_ += static_cast<char>(v);
  }
  void little_endian(uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) data_ += static_cast<char>((v >> (8 * i)) & 0xFF);
  }
  std::string data_;
};

}  // namespace tandem::track::detail
