// The pipeline schedules' names (no LibTorch: the launcher checks them too).
#include "tandem/parallel/schedule_kind.h"

#include <cctype>

#include "tandem/error.h"

namespace tandem::parallel {

std::string to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe: return "GPipe";
    case ScheduleKind::k1F1B: return "1F1B";
    case ScheduleKind::kInterleaved1F1B: return "Interleaved1F1B";
    case ScheduleKind::kZeroBubble: return "ZeroBubble";
  }
  return "?";
}

ScheduleKind schedule_from_name(const std::string& name, const std::string& what) {
  std::string n;
  for (char ch : name)
    if (ch != '_' && ch != '-') n += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (n == "gpipe") return ScheduleKind::kGPipe;
  if (n == "1f1b") return ScheduleKind::k1F1B;
  if (n == "interleaved1f1b") return ScheduleKind::kInterleaved1F1B;
  if (n == "zerobubble" || n == "zb" || n == "zbh1") return ScheduleKind::kZeroBubble;
  throw ::tandem::Refused(what + ": unknown pipeline schedule '" + name +
                          "'; expected gpipe, 1f1b, interleaved_1f1b or zero_bubble (tandem has "
                          "no ZBV or DualPipeV schedule)");
}

}  // namespace tandem::parallel
