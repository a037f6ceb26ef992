// Context parallel's communication names (cp_comm.h).
#include "tandem/parallel/cp_comm.h"

#include "tandem/error.h"

namespace tandem::parallel {

ContextParallelComm context_parallel_comm_from_name(const std::string& name,
                                                    const std::string& origin) {
  if (name == "ring" || name == "alltoall" || name.empty()) return ContextParallelComm::kRing;
  if (name == "allgather") return ContextParallelComm::kAllgather;
  throw ::tandem::Refused(origin + ": cp_comm_strategy '" + name +
                          "' is not one tandem runs; use alltoall (keys and values passed around "
                          "the ring; also called ring) or allgather (gathered at once)");
}

std::string to_string(ContextParallelComm comm) {
  return comm == ContextParallelComm::kAllgather ? "allgather" : "alltoall";
}

}  // namespace tandem::parallel
