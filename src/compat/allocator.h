// c10::Allocator across versions: allocate() is const in LibTorch 1.13 and not in 2.x, and 2.x
// adds the pure virtual copy_data(). Allocators derive from compat::Allocator and define
// allocate_bytes().
#pragma once

#include <c10/core/Allocator.h>
#include <torch/version.h>

#include <cstring>

namespace tandem::compat {

class Allocator : public c10::Allocator {
 public:
  virtual c10::DataPtr allocate_bytes(size_t n) const = 0;
#if TORCH_VERSION_MAJOR >= 2
  c10::DataPtr allocate(size_t n) override { return allocate_bytes(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count) std::memcpy(dest, src, count);
  }
#else
  c10::DataPtr allocate(size_t n) const override { return allocate_bytes(n); }
#endif
};

}  // namespace tandem::compat
