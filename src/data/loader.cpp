// Non-template parts of the prepared loaders.
#include "tandem/data/loader.h"
#include "tandem/error.h"

#include <string>

namespace tandem::data::detail {

int64_t per_rank_batch_size(const DataLoaderOptions& o, const Placement& p) {
  if (o.batch_size() < 1)
    throw ::tandem::Refused("DataLoaderOptions::batch_size is " + std::to_string(o.batch_size()) +
                                "; it must be at least 1");
  if (!p.split_batches) return o.batch_size();
  if (o.batch_size() % p.world != 0)
    throw ::tandem::Refused(
        "split_batches: the batch size " + std::to_string(o.batch_size()) +
        " is the global batch and must divide evenly over " + std::to_string(p.world) +
        " processes; choose a multiple of " + std::to_string(p.world) + " or turn split_batches off");
  return o.batch_size() / p.world;
}

}  // namespace tandem::data::detail
