// What machine 0's launcher reads of the replicas' store (Note [Replica recovery]).
#pragma once

#include "../../compat/c10d.h"

namespace tandem::comm::detail {

/// Whether every member of the newest quorum has finished (true when no quorum formed).
bool every_replica_left(::c10d::Store& store);

}  // namespace tandem::comm::detail
