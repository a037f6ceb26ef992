// Whether this translation unit is compiled with AddressSanitizer: TANDEM_ASAN is 1 there, 0
// elsewhere. GCC says so with __SANITIZE_ADDRESS__, clang with __has_feature (which GCC 12 does
// not have: the two tests cannot share one #if).
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define TANDEM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TANDEM_ASAN 1
#endif
#endif
#ifndef TANDEM_ASAN
#define TANDEM_ASAN 0
#endif
