// Note [Elastic machines]: with --min_machines, the launchers of a job agree before every attempt
// on the machines that take part. Machine 0's launcher hosts a store (c10d's TCPStore) on
// main_process_port + 1 for the whole job; before attempt a, every launcher adds itself to round
// a ("tandem/machines/<a>/m<machine_rank>"). Machine 0 closes the round when every machine of
// --num_machines came, or when --rdzv_timeout passed and at least --min_machines did, and
// publishes the members; each launcher takes its index among them as its machine rank for the
// attempt, and the world is the members' processes. A machine whose launcher is gone (killed,
// powered off) never joins the next round: the job goes on without it. A late machine finds
// the round closed and stops, saying so. Machine 0 is the store: its loss ends the job.
#include "tandem/launch/machine_rendezvous.h"

#include <chrono>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "../comm/detail/replicas_store.h"
#include "../compat/c10d.h"

namespace tandem::launch {

struct MachineRendezvous::Impl {
  c10::intrusive_ptr<::c10d::TCPStore> store;
};

MachineRendezvous::MachineRendezvous(const LaunchOptions& o) : options_(o) {
  ::c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(o.main_process_port() + 1);
  so.isServer = o.machine_rank() == 0;
  if (o.fault_tolerant_replicas() && !so.isServer)
    throw std::logic_error("only machine 0's launcher holds the replicas' store");
  so.waitWorkers = false;
  // A client waits this long for machine 0's store at the first attempt, and for each round.
  so.timeout = std::chrono::milliseconds(static_cast<int64_t>((o.rdzv_timeout_s() + 60) * 1000));
  impl_ = std::make_unique<Impl>();
  try {
    impl_->store = compat::make_tcp_store(o.main_process_ip(), so, false);
  } catch (const std::exception& e) {
    throw std::runtime_error(
        std::string(o.fault_tolerant_replicas()
                        ? "the replicas' store (--fault_tolerant_replicas) on "
                        : "the machines' rendezvous (--min_machines) on ") +
        o.main_process_ip() + ":" + std::to_string(so.port) +
        " (--main_process_port + 1) failed: " + e.what() +
        (so.isServer ? "; free that port or choose another --main_process_port"
                     : "; machine 0's launcher hosts it: start it, or check the address"));
  }
}

MachineRendezvous::~MachineRendezvous() = default;

std::vector<int> MachineRendezvous::join(int attempt) {
  auto& store = *impl_->store;
  const std::string round = "tandem/machines/" + std::to_string(attempt) + "/";
  const int me = options_.machine_rank(), all = options_.num_machines();
  auto bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };
  try {
    store.set(round + "m" + std::to_string(me), bytes("1"));
    std::string members;
    if (me == 0) {
      const auto deadline = std::chrono::steady_clock::now() +
                            std::chrono::milliseconds(static_cast<int64_t>(options_.rdzv_timeout_s() * 1000));
      std::vector<int> came;
      for (;;) {
        came.clear();
        for (int m = 0; m < all; ++m)
          if (store.check({round + "m" + std::to_string(m)})) came.push_back(m);
        const int n = static_cast<int>(came.size());
        if (n == all || (std::chrono::steady_clock::now() >= deadline && n >= options_.min_machines()))
          break;
        if (std::chrono::steady_clock::now() >= deadline) {
          store.set(round + "closed", bytes(""));
          throw std::runtime_error(
              std::to_string(n) + " of " + std::to_string(all) + " machines joined within "
              "--rdzv_timeout " + std::to_string(options_.rdzv_timeout_s()) +
              " s, fewer than --min_machines " + std::to_string(options_.min_machines()));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      std::ostringstream os;
      for (size_t k = 0; k < came.size(); ++k) os << (k ? "," : "") << came[k];
      members = os.str();
      store.set(round + "closed", bytes(members));
    } else {
      auto got = store.get(round + "closed");
      members.assign(got.begin(), got.end());
    }
    std::vector<int> out;
    std::istringstream in(members);
    for (std::string m; std::getline(in, m, ',');) out.push_back(std::stoi(m));
    return out;
  } catch (const std::runtime_error&) {
    throw;
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("the machines' rendezvous for attempt ") +
                             std::to_string(attempt) + " failed (" + e.what() +
                             "): machine 0's launcher hosts it; when machine 0 is lost the job "
                             "ends");
  }
}

bool MachineRendezvous::wait_for_replicas(double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  try {
    while (!comm::detail::every_replica_left(*impl_->store)) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  } catch (const std::exception&) {
    return false;
  }
  return true;
}

}  // namespace tandem::launch
