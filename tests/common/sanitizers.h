// Whether this test was built with AddressSanitizer: where its quarantine keeps freed memory
// resident (and its shadow memory adds an eighth), a test holds tensor bytes to their figures but
// not resident memory. TANDEM_ASAN (src/detail/sanitizers.h) is 1 there, for code that exists only
// under ASan.
#pragma once

#include "../../src/detail/sanitizers.h"

namespace tandem::testing {

inline constexpr bool kAsan = TANDEM_ASAN == 1;

}  // namespace tandem::testing
