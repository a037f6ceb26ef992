// Version strings.
#include "tandem/version.h"

#include <torch/version.h>

namespace tandem {

const char* const kVersion = TANDEM_VERSION_STRING;

std::string torch_version() { return TORCH_VERSION; }

}  // namespace tandem
