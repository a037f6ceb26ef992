// visible_cuda_devices (resolve.h): asks LibTorch, so it lives apart from the launcher's other
// code, which does not need LibTorch at run time (Note [A launcher without LibTorch]).
#include "tandem/launch/resolve.h"

#include <torch/cuda.h>

namespace tandem::launch {

int visible_cuda_devices() {
  return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
}

}  // namespace tandem::launch
