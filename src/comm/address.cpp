// The free port and host-name checks of process_group.h: sockets only, no LibTorch, so that the
// launcher links them (Note [A launcher without LibTorch]).
#include "tandem/comm/process_group.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>

namespace tandem {

namespace {

// Binds `port` on `host` (0: any free one) and returns the port bound, or -1.
int try_bind(const std::string& host, int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("find_free_port: socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) addr.sin_addr.s_addr = INADDR_ANY;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int bound = ntohs(addr.sin_port);
  ::close(fd);
  return bound;
}

}  // namespace

// Note [Free ports]: a port is free when checked and bound by rank 0 a moment later; in between,
// any outgoing connection on the machine may take it, because the OS hands out the same
// ephemeral range (ip_local_port_range) both to bind(port 0) and to connect(). Picking below that
// range leaves another job choosing the same random port in the same instant, or another
// program binding it: then rank 0 writes "port-taken" into TANDEM_ERROR_FILE, and the launcher
// that chose the port starts the ranks again on another (launch/launcher.cpp); a port the user
// chose (--main_process_port, MASTER_PORT) is refused, naming it.
std::string host_resolution_error(const std::string& host) {
  if (host.empty()) return "the address is empty";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  // A temporary failure (EAI_AGAIN: no DNS server answered) may pass: one more try.
  if (rc == EAI_AGAIN) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  }
  if (rc == 0) {
    ::freeaddrinfo(res);
    return "";
  }
  return rc == EAI_SYSTEM ? std::string(std::strerror(errno)) : std::string(::gai_strerror(rc));
}

int find_free_port(const std::string& host) {
  int low = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) range >> low;
  const int first = 20000;
  if (low - first > 1000) {
    std::random_device rd;
    std::mt19937 gen(rd());
    std::uniform_int_distribution<int> pick(first, low - 1);
    for (int attempt = 0; attempt < 64; ++attempt)
      if (int port = try_bind(host, pick(gen)); port > 0) return port;
  }
  const int port = try_bind(host, 0);
  if (port < 0) throw std::runtime_error("find_free_port: cannot bind on " + host);
  return port;
}

}  // namespace tandem
