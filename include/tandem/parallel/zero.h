// ZeRO stages 1-3: the optimizer state, at stage 2 also the gradients, at stage 3 also the
// parameters, split across the ranks. The layout is pure logic here; the strategy itself is made
// by make_strategy (strategy.h).
//
// Note [ZeRO units]: a unit is one gradient bucket of one optimizer parameter group (the data
// parallel reducer's bucketing, in the same order; at stage 3, the parameters of one Sharded
// module of one group instead): its parameters flattened into one buffer, padded with zeros to a
// multiple of the world size W. Rank r owns chunk r of every unit (ShardInfo). The parameters
// become views into their unit's buffer, so that all-gathering the updated chunks into the
// buffer updates every parameter in place; the optimizer steps one tensor per unit, this rank's
// chunk (itself a view of the buffer, or an fp32 / host copy of it for master weights, offload
// and stage 3, whose buffers exist only while their module runs). The unit boundaries do not
// depend on W, so a checkpoint's shards can be cut again for any other number of ranks
// (reshard_pieces).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace tandem::parallel {

/// Where a rank's chunk of a unit lies: elements [offset, offset + numel) of the padded unit.
struct ShardInfo {
  int64_t offset = 0;
  int64_t numel = 0;
};

/// Rank `rank` of `world`'s chunk of a unit of `numel` elements: the unit padded to a multiple
/// of `world` (at least `world` elements, so that no chunk is empty), split in equal chunks.
ShardInfo shard_of(int64_t numel, int world, int rank);

/// A piece of a resharded chunk: `length` elements at `source_offset` of the chunk that rank
/// `source_rank` of the saving run held go to `target_offset` of the new chunk.
struct ReshardPiece {
  int source_rank = 0;
  int64_t source_offset = 0;
  int64_t target_offset = 0;
  int64_t length = 0;
};

/// The pieces that make rank `rank` of `world`'s chunk of a `numel`-element unit from the
/// chunks of a run of `saved_world` ranks, in order. Only real elements are listed: what the
/// pieces do not cover is padding (zero).
std::vector<ReshardPiece> reshard_pieces(int64_t numel, int saved_world, int world, int rank);

}  // namespace tandem::parallel
