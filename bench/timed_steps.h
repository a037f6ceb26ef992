// The timing loop of the benchmarks: warm-up steps, then timed ones, with the counting
// allocator's peak reset where the timing starts (after the warm-up created optimizer state).
#pragma once

#include <chrono>
#include <functional>

#include "tandem/track/cpu_memory.h"

namespace bench {

/// Runs step(0), ..., step(warmup + steps - 1). Before step(warmup): `barrier` (when given, e.g.
/// the Accelerator's wait_for_everyone, so that every rank starts the clock together), the peak
/// of tandem's counting CPU allocator is reset, and the clock starts. After the last step:
/// `barrier` again. Returns the seconds of the timed steps.
inline double timed_steps(int warmup, int steps, const std::function<void(int)>& step,
                          const std::function<void()>& barrier = {}) {
  using Clock = std::chrono::steady_clock;
  Clock::time_point start = Clock::now();
  for (int i = 0; i < warmup + steps; ++i) {
    if (i == warmup) {
      if (barrier) barrier();
      tandem::track::reset_peak_cpu_memory();
      start = Clock::now();
    }
    step(i);
  }
  if (barrier) barrier();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace bench
