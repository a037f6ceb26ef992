// The only place that knows how c10d differs between LibTorch 1.13 and 2.x.
// 1.13: ProcessGroupGloo/NCCL derive from c10d::ProcessGroup. 2.x: they derive from c10d::Backend.
// Both expose the same collective signatures (allreduce, broadcast, allgather, barrier).
#pragma once

#include <torch/version.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

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

// Whether Gloo can sum bfloat16 tensors. LibTorch 1.13's cannot ("Invalid scalar type"), so
// there bf16 travels as fp32; 2.x's can (seen on 2.12: an allreduce of bf16 CPU tensors over
// Gloo sums them), so bf16 buckets and the bf16 compression hook send 2 bytes per value.
#if TORCH_VERSION_MAJOR >= 2 && TORCH_VERSION_MINOR >= 1
constexpr bool kGlooSumsBFloat16 = true;
#else
constexpr bool kGlooSumsBFloat16 = false;
#endif

/// The dtype in which tensors of `dtype` on `device` are summed by a collective: `dtype`
/// itself, or fp32 for bf16 CPU tensors where Gloo cannot sum bf16 (kGlooSumsBFloat16).
inline c10::ScalarType gloo_sum_dtype(c10::ScalarType dtype, c10::DeviceType device) {
  return dtype == c10::kBFloat16 && device == c10::DeviceType::CPU && !kGlooSumsBFloat16
             ? c10::kFloat
             : dtype;
}

// Note [Loopback rendezvous]: LibTorch >= 2.4 lets the store's server take a socket the caller
// has bound and listened on (TCPStoreOptions::masterListenFd), so a job on one machine can
// listen on 127.0.0.1 only. LibTorch 1.13's TCPStore binds every interface and has no such
// option: there the store is reachable from the network for as long as the job runs (see
// docs/launching.md, "Security").
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
constexpr bool kStoreCanListenOnLoopback = true;
#else
constexpr bool kStoreCanListenOnLoopback = false;
#endif

// Note [Agent store protocol]: PyTorch 2.x's TCPStore speaks another protocol than 1.13's (a
// validation message first, renumbered queries): LibTorch 1.13's client, connected to the store of
// a PyTorch 2.x torchrun agent, has its connection reset in a background thread and the process
// ends in std::terminate (seen with torchrun of PyTorch 2.12). A 1.13 build therefore refuses the
// agent's store (ProcessGroup::create says so and names the fix) instead of connecting to it.
#if TORCH_VERSION_MAJOR >= 2
constexpr bool kStoreClientSpeaksTorchrun2 = true;
#else
constexpr bool kStoreClientSpeaksTorchrun2 = false;
#endif

/// A TCPStore; with `loopback_only` on a LibTorch that can, the server listens on 127.0.0.1
/// only. Throws std::runtime_error with the system's reason when the port cannot be bound.
inline c10::intrusive_ptr<::c10d::TCPStore> make_tcp_store(const std::string& host,
                                                           ::c10d::TCPStoreOptions opts,
                                                           bool loopback_only) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  if (opts.isServer && loopback_only) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw std::runtime_error(std::string("socket() failed: ") + std::strerror(errno));
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(opts.port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(fd, 2048) != 0) {
      const int err = errno;
      ::close(fd);
      throw std::runtime_error("cannot listen on 127.0.0.1:" + std::to_string(opts.port) + ": " +
                               std::strerror(err));
    }
    opts.masterListenFd = fd;  // the store's server owns it from here
    opts.useLibUV = false;     // the classic server takes an existing socket on every 2.x
  }
#else
  (void)loopback_only;
#endif
  return c10::make_intrusive<::c10d::TCPStore>(host, opts);
}

}  // namespace tandem::compat
