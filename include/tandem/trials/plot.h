// The picture of a study: the objective of every trial in order (best so far as a line), and
// the objective against each parameter, as one PNG written without an image library.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/trials/space.h"

namespace tandem::trials {

/// Writes `path` (PNG, RGB): one panel per trial order and per parameter. Complete trials are
/// blue dots, pruned ones orange (at their last reported value), failed ones are left out;
/// log-uniform parameters get a log axis, categorical ones one column per choice.
void write_study_plot(const std::string& path, const std::vector<TrialRecord>& trials,
                      const std::vector<ParamSpec>& space, Direction direction,
                      const std::string& metric);

/// An RGB image as PNG bytes (8 bits per channel, stored deflate blocks, no filtering).
std::string encode_png(int width, int height, const std::vector<uint8_t>& rgb);

}  // namespace tandem::trials
