// Small file helpers shared by the trackers, the timeline and the memory estimate.
#pragma once

#include <string>

namespace tandem::track::detail {

/// Creates `dir` and its parents. Throws std::runtime_error naming `what` (the component that
/// needs it), the folder and the system's reason.
void ensure_directory(const std::string& dir, const std::string& what);

/// Seconds since the Unix epoch, with sub-second precision.
double unix_time_now();

/// The shortest %g text that reads back as the same double ("0.1", "0.0003", "1e-05", "nan").
std::string format_double(double value);

/// Writes `contents` to `path` through a temporary file and a rename, so that a reader never
/// sees half a file. Throws std::runtime_error naming `what` and the path.
void write_file_atomically(const std::string& path, const std::string& contents,
                           const std::string& what);

/// This machine's host name ("localhost" when it cannot be read).
std::string host_name();

}  // namespace tandem::track::detail
