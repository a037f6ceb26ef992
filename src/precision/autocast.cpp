// AutocastGuard (see autocast.h).
#include "tandem/precision/autocast.h"

#include <ATen/autocast_mode.h>

#include "../compat/autocast.h"

namespace tandem::precision {

AutocastGuard::AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, bool enabled)
    : active_(true), device_(device) {
  previous_enabled_ = compat::autocast_enabled(device);
  previous_dtype_ = compat::autocast_dtype(device);
  // A disabling guard keeps the dtype: only the flag matters there, and a dtype the device's
  // autocast refuses (fp16 on a 1.13 CPU) must not throw just to turn autocast off.
  if (enabled) compat::set_autocast_dtype(device, dtype);
  compat::set_autocast_enabled(device, enabled);
  at::autocast::increment_nesting();
}

AutocastGuard::AutocastGuard(AutocastGuard&& other) noexcept
    : active_(other.active_),
      device_(other.device_),
      previous_enabled_(other.previous_enabled_),
      previous_dtype_(other.previous_dtype_) {
  other.active_ = false;
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  // As torch.autocast.__exit__: the cache of casted weights lives for the outermost region.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  compat::set_autocast_enabled(device_, previous_enabled_);
  compat::set_autocast_dtype(device_, previous_dtype_);
}

bool AutocastGuard::is_enabled(c10::DeviceType device) { return compat::autocast_enabled(device); }

c10::ScalarType AutocastGuard::dtype(c10::DeviceType device) {
  return compat::autocast_dtype(device);
}

}  // namespace tandem::precision
