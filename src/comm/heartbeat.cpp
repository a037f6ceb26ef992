// The heartbeat file's format (Note [Heartbeat] in tandem/comm/heartbeat.h). Compiled into the
// launcher as well, which maps no LibTorch.
#include "tandem/comm/heartbeat.h"

#include <cstdio>
#include <map>
#include <sstream>

namespace tandem::comm {
namespace {

std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f", v);
  return buf;
}

bool to_double(const std::string& s, double& out) {
  try {
    size_t pos = 0;
    out = std::stod(s, &pos);
    return pos == s.size();
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

std::string format_heartbeat(const HeartbeatReport& r) {
  std::ostringstream out;
  out << "tandem-heartbeat 1\n"
      << "wall_s " << number(r.wall_s) << "\n"
      << "pid " << r.pid << "\n"
      << "pending_age_s " << number(r.pending_age_s) << "\n"
      << "activity_age_s " << number(r.activity_age_s) << "\n"
      << "flight_dir " << r.flight_dir << "\n"
      << "last " << r.last << "\n"
      << "pending " << r.pending << "\n"
      << "end\n";
  return out.str();
}

std::optional<HeartbeatReport> parse_heartbeat(const std::string& text) {
  std::istringstream in(text);
  std::map<std::string, std::string> kv;
  std::string line;
  bool ended = false;
  while (std::getline(in, line)) {
    if (line == "end") {
      ended = true;
      break;
    }
    const auto sp = line.find(' ');
    kv[line.substr(0, sp)] = sp == std::string::npos ? "" : line.substr(sp + 1);
  }
  if (!ended || kv["tandem-heartbeat"] != "1") return std::nullopt;
  HeartbeatReport r;
  double pid = 0;
  if (!to_double(kv["wall_s"], r.wall_s) || !to_double(kv["pid"], pid) ||
      !to_double(kv["pending_age_s"], r.pending_age_s) ||
      !to_double(kv["activity_age_s"], r.activity_age_s))
    return std::nullopt;
  r.pid = static_cast<int>(pid);
  r.flight_dir = kv["flight_dir"];
  r.last = kv["last"];
  r.pending = kv["pending"];
  return r;
}

}  // namespace tandem::comm
