// The NCCL backend, compiled only when LibTorch was built with CUDA and NCCL.
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "detail/process_group_impl.h"

namespace tandem {

c10::intrusive_ptr<compat::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                      int rank, int size,
                                                      std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(
      c10::make_intrusive<c10d::PrefixStore>("nccl", store), rank, size, opts);
}

}  // namespace tandem
