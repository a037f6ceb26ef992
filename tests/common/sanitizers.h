// Whether this test was built with AddressSanitizer: where its quarantine keeps freed memory
// resident (and its shadow memory adds an eighth), a test holds tensor bytes to their figures but
// not resident memory. TANDEM_TEST_ASAN is 1 there (for code that exists only under ASan), 0
// elsewhere.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define TANDEM_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TANDEM_TEST_ASAN 1
#endif
#endif
#ifndef TANDEM_TEST_ASAN
#define TANDEM_TEST_ASAN 0
#endif

namespace tandem::testing {

inline constexpr bool kAsan = TANDEM_TEST_ASAN == 1;

}  // namespace tandem::testing
