// tandem's version and LibTorch's (`tandem env` reports them: config::environment_report).
#pragma once

#include <string>

namespace tandem {

/// tandem's version, "major.minor.patch".
extern const char* const kVersion;

/// LibTorch's version as built against ("1.13.0", "2.5.1", ...).
std::string torch_version();

}  // namespace tandem
