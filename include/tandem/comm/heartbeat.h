// Note [Heartbeat]: with `tandem launch --heartbeat_timeout_s T`, every rank's Accelerator
// starts a thread that rewrites a small file (TANDEM_HEARTBEAT_FILE, in the launcher's own
// folder) every TANDEM_HEARTBEAT_INTERVAL_S seconds: when it was written, and from the flight
// recorder (Note [Flight recorder]) the newest collective, the oldest one still pending and how
// long ago the rank last began or ended one. The launcher reads the files while it watches the
// ranks, without LibTorch, and ends the job (or restarts it under --max_restarts) when
//   - a rank's file is older than T: the process no longer runs (SIGSTOP, a stuck driver, a
//     machine swapping itself to death); it is named with its last collective;
//   - a rank has waited in a collective for longer than T while beginning or ending no other:
//     a hang; the ranks that are not in that collective are named, with where they are.
// Before it stops the job it sends every rank SIGUSR2, so that each recorder that still runs
// writes its dump for `tandem doctor`. A rank writes no file before its Accelerator exists and
// removes it when the Accelerator ends, so loading and a program's work after training are never
// taken for a hang; a rank that computes without collectives for longer than T is not one
// either (it waits in none).
#pragma once

#include <optional>
#include <string>

namespace tandem::comm {

/// What one heartbeat file says.
struct HeartbeatReport {
  double wall_s = 0;           ///< when it was written: seconds since the epoch (system clock)
  int pid = 0;
  std::string flight_dir;      ///< where the rank's flight recorder dumps ("" : nowhere)
  std::string last;            ///< the newest collective, described ("" : none yet)
  std::string pending;         ///< the oldest collective still pending ("" : none)
  double pending_age_s = -1;   ///< how long it had been pending at wall_s
  double activity_age_s = -1;  ///< since the rank last began or ended a collective, at wall_s
};

/// The file's text: one "key value" line per field.
std::string format_heartbeat(const HeartbeatReport& report);
/// Reads it back; nullopt when the text is not a whole heartbeat (a file being replaced).
std::optional<HeartbeatReport> parse_heartbeat(const std::string& text);
}  // namespace tandem::comm
