// Whether this test was built with AddressSanitizer: where its quarantine keeps freed memory
// resident (and its shadow memory adds an eighth), a test holds tensor bytes to their figures but
// not resident memory.
#pragma once

namespace tandem::testing {

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAsan = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAsan = true;
#else
inline constexpr bool kAsan = false;
#endif
#else
inline constexpr bool kAsan = false;
#endif

}  // namespace tandem::testing
