// `tandem doctor DIR`: the flight recorder dumps of a job's ranks read together (Note [Flight
// recorder] in tandem/comm/flight_recorder.h).
#pragma once

#include <string>

namespace tandem::track {

/// What `tandem doctor DIR` prints: reads DIR/rank*.json (dumps of one job) and says, group by
/// group, which ranks are behind (their last collective is older than the others'), on which
/// collective the others wait, and the first sequence number at which ranks called different
/// collectives or sizes; throws std::runtime_error naming DIR when it holds no dump or an
/// unreadable one.
std::string diagnose_flight_dumps(const std::string& dir);

}  // namespace tandem::track
