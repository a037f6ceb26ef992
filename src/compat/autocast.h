// Autocast state per device type, across LibTorch versions: 1.13..2.3 have one function per
// device (set_cpu_enabled, set_autocast_gpu_dtype, ...); 2.4 added the device-type overloads
// (set_autocast_enabled(DeviceType, bool), set_autocast_dtype(DeviceType, dtype)) and
// deprecated the old ones.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define TANDEM_AUTOCAST_BY_DEVICE_TYPE 1
#else
#define TANDEM_AUTOCAST_BY_DEVICE_TYPE 0
#endif

namespace tandem::compat {

inline bool autocast_enabled(c10::DeviceType d) {
#if TANDEM_AUTOCAST_BY_DEVICE_TYPE
  return at::autocast::is_autocast_enabled(d);
#else
  return d == c10::kCUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}

inline void set_autocast_enabled(c10::DeviceType d, bool enabled) {
#if TANDEM_AUTOCAST_BY_DEVICE_TYPE
  at::autocast::set_autocast_enabled(d, enabled);
#else
  if (d == c10::kCUDA)
    at::autocast::set_enabled(enabled);
  else
    at::autocast::set_cpu_enabled(enabled);
#endif
}

inline c10::ScalarType autocast_dtype(c10::DeviceType d) {
#if TANDEM_AUTOCAST_BY_DEVICE_TYPE
  return at::autocast::get_autocast_dtype(d);
#else
  return d == c10::kCUDA ? at::autocast::get_autocast_gpu_dtype()
                         : at::autocast::get_autocast_cpu_dtype();
#endif
}

inline void set_autocast_dtype(c10::DeviceType d, c10::ScalarType dtype) {
#if TANDEM_AUTOCAST_BY_DEVICE_TYPE
  at::autocast::set_autocast_dtype(d, dtype);
#else
  if (d == c10::kCUDA)
    at::autocast::set_autocast_gpu_dtype(dtype);
  else
    at::autocast::set_autocast_cpu_dtype(dtype);
#endif
}

}  // namespace tandem::compat
