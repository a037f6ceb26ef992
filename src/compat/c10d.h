// The only place that knows how c10d differs between LibTorch 1.13 and 2.x.
// 1.13: ProcessGroupGloo/NCCL derive from c10d::ProcessGroup. 2.x: they derive from c10d::Backend.
// Both expose the same collective signatures (allreduce, broadcast, allgather, barrier).
#pragma once

#include <torch/version.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

namespace tandem::compat {

#if TORCH_VERSION_MAJOR >= 2
using Backend = ::c10d::Backend;
#else
using Backend = ::c10d::ProcessGroup;
#endif
using Work = ::c10d::Work;

}  // namespace tandem::compat
