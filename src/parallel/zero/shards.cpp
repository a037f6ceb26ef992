// Shard offsets of a flat buffer over a group, and the pieces of a reshard (zero.h).
#include "tandem/parallel/zero.h"

#include <algorithm>

#include "tandem/comm/process_group.h"

namespace tandem::parallel {

ShardInfo shard_of(int64_t numel, int world, int rank) {
  const int64_t chunk = padded_chunk_numel(numel, world);
  return {chunk * rank, chunk};
}

std::vector<ReshardPiece> reshard_pieces(int64_t numel, int saved_world, int world, int rank) {
  std::vector<ReshardPiece> out;
  const ShardInfo mine = shard_of(numel, world, rank);
  const int64_t begin = mine.offset, end = std::min(numel, mine.offset + mine.numel);
  const int64_t old_chunk = shard_of(numel, saved_world, 0).numel;
  for (int64_t at = begin; at < end;) {
    const int src = static_cast<int>(at / old_chunk);
    const int64_t src_off = at - src * old_chunk;
    const int64_t len = std::min(end - at, old_chunk - src_off);
    out.push_back({src, src_off, at - begin, len});
    at += len;
  }
  return out;
}

}  // namespace tandem::parallel
