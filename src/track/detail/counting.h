// The counting allocator's base, for the host allocator to sit below it (host_allocator.h).
#pragma once

#include <c10/core/Allocator.h>

namespace tandem::track::detail {

/// The allocator the counting allocator forwards to; nullptr when it is not installed.
c10::Allocator* counting_allocator_base();
/// Makes the counting allocator forward to `base` (nothing when it is not installed).
void set_counting_allocator_base(c10::Allocator* base);

}  // namespace tandem::track::detail
