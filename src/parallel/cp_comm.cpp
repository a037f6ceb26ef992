// Context parallel's communication names (cp_comm.h).
#include "tandem/parallel/cp_comm.h"

#include "tandem/error.h"

namespace tandem::parallel {

ContextParallelComm context_parallel_comm_from_name(const std::string& name,
                                                    const std::string& origin) {
  if (name == "ring" || name == "alltoall" || name.empty()) return ContextParallelComm::kRing;
  if (name == "allgather") return ContextParallelComm::kAllgather;
  if (name == "ulysses") return ContextParallelComm::kUlysses;
  throw ::tandem::Refused(
      origin + ": cp_comm_strategy '" + name +
      "' is not one tandem runs; use alltoall (keys and values passed around "
      "the ring; also called ring), allgather (gathered at once) or ulysses (the "
      "heads swapped with the sequence by all-to-all)");
}

std::string to_string(ContextParallelComm comm) {
  switch (comm) {
    case ContextParallelComm::kAllgather:
      return "allgather";
    case ContextParallelComm::kUlysses:
      return "ulysses";
    case ContextParallelComm::kRing:
      break;
  }
  return "alltoall";
}

}  // namespace tandem::parallel
