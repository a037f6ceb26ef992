// The pipeline schedules by name, apart from the pipeline itself (no LibTorch headers), for the
// configuration that reads them from the launcher and config files.
#pragma once

#include <string>

namespace tandem::parallel {

/// The order in which a stage runs its micro-batches' forwards and backwards.
///   kGPipe: every forward, then every backward (a stage holds all m micro-batches' activations).
///   k1F1B:  p - 1 - stage forwards, then one forward and one backward in turn, then the
///           remaining backwards (stage s holds at most p - s micro-batches' activations).
///   kInterleaved1F1B: each rank holds v stages of the model (virtual stages, looped: rank r has
///           stages r, r + p, ..., r + (v - 1) p of p v) and runs Megatron's interleaved order
///           (m a multiple of p): the bubble shrinks by v, (p - 1) / (v m + p - 1).
///   kZeroBubble: 1F1B's order with each backward split into its input gradient (I, sent
///           upstream at once) and its weight gradient (W, deferred into what would be idle
///           time), holding no more micro-batches per stage than 1F1B.
/// Idle shares with a forward, an input gradient and a weight gradient of one unit each (a whole
/// backward two): GPipe and 1F1B (p - 1) / (m + p - 1), interleaved (p - 1) / (v m + p - 1) (its
/// stages each 1/v of the work), zero bubble 2 (p - 1) / (3 m + 2 (p - 1)).
enum class ScheduleKind { kGPipe, k1F1B, kInterleaved1F1B, kZeroBubble };

/// "GPipe", "1F1B", "Interleaved1F1B", "ZeroBubble" (as torchtitan spells its schedules).
std::string to_string(ScheduleKind kind);
/// The schedule of a name: gpipe, 1f1b, interleaved_1f1b (or interleaved1f1b), zero_bubble (or
/// zb, zerobubble, zbh1), in any case. Throws tandem::Refused naming `what` and the choices.
ScheduleKind schedule_from_name(const std::string& name, const std::string& what);

}  // namespace tandem::parallel
