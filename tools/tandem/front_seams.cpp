// bin/tandem's answers to what the launcher's code asks of LibTorch (Note [A launcher without
// LibTorch]); libtandem's are launch/devices.cpp and launch/machine_rendezvous.cpp.
#include <stdexcept>

#include "full_cli.h"
#include "tandem/launch/machine_rendezvous.h"
#include "tandem/launch/resolve.h"

namespace tandem::launch {

int visible_cuda_devices() {
#ifdef TANDEM_WITH_CUDA
  cli::needs_libtorch();  // LibTorch counts them
#endif
  return 0;  // a LibTorch without CUDA sees none
}

// LaunchCommand::run hands a launch with --min_machines or --fault_tolerant_replicas to the
// full command line first.
struct MachineRendezvous::Impl {};
MachineRendezvous::MachineRendezvous(const LaunchOptions& options) : options_(options) {
  throw std::logic_error("the machines' rendezvous needs LibTorch: run through needs_libtorch()");
}
MachineRendezvous::~MachineRendezvous() = default;
std::vector<int> MachineRendezvous::join(int) { return {}; }
bool MachineRendezvous::wait_for_replicas(double) {
  return true;
}

}  // namespace tandem::launch
