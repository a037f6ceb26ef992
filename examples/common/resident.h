// The examples' last line about memory: what the operating system saw of each rank, its peak
// resident memory over the whole run (VmHWM: construction, prepare and loading included).
#pragma once

#include <cstdio>
#include <string>

#include "tandem/tandem.h"

namespace examples {

// "peak resident memory per rank: rank 0 1.23 GB, rank 1 ..." (every rank takes part).
inline void print_peak_resident(tandem::Accelerator& acc) {
  const auto peaks = tandem::comm::gather_object(
      *acc.topology().barrier(), std::to_string(tandem::track::resident_memory().peak_bytes));
  std::string line;
  for (size_t r = 0; r < peaks.size(); ++r) {
    char gb[32];
    std::snprintf(gb, sizeof gb, "%.2f", std::stod(peaks[r]) / 1e9);
    line += (r ? ", " : "") + std::string("rank ") + std::to_string(r) + " " + gb + " GB";
  }
  acc.print("peak resident memory per rank:", line);
}

}  // namespace examples
