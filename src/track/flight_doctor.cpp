// `tandem doctor`: every rank's flight recorder dump read together (Note [Flight recorder] in
// tandem/comm/flight_recorder.h).
#include "tandem/track/flight_doctor.h"
#include "../detail/read_file.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "../checkpoint/detail/json_depth.h"
#include "tandem/comm/flight_recorder.h"

namespace tandem::track {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using comm::FlightRecord;

}  // namespace

namespace {

struct Dump {
  int rank = 0;
  int world = 0;
  std::string reason;
  std::map<std::string, std::vector<int>> groups;
  std::vector<FlightRecord> records;
};

std::string describe(const FlightRecord& r) {
  return "#" + std::to_string(r.seq) + " " + r.op + " (" + std::to_string(r.numel) + " x " +
         r.dtype + ", " + r.state + ")";
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i)
    s += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
  return (ranks.size() == 1 ? "rank " : "ranks ") + s;
}

Dump read_dump(const fs::path& file) {
  auto fail = [&](const std::string& what) {
    throw std::runtime_error("tandem doctor: " + file.string() + ": " + what +
                             " (expected a flight recorder dump, rank<r>.json)");
  };
  const auto read = ::tandem::detail::read_file(file.string());
  if (!read) fail("cannot be read");
  const std::string& text = *read;
  if (auto deep = checkpoint::detail::json_depth_problem(text); !deep.empty()) fail(deep);
  Dump d;
  try {
    const auto doc = json::parse(text);
    d.rank = doc.at("rank").get<int>();
    d.world = doc.at("world").get<int>();
    d.reason = doc.value("reason", "");
    d.groups = doc.at("groups").get<std::map<std::string, std::vector<int>>>();
    for (const auto& c : doc.at("collectives")) {
      FlightRecord r;
      r.seq = c.at("seq").get<int64_t>();
      r.group = c.at("group").get<std::string>();
      r.op = c.at("op").get<std::string>();
      r.numel = c.at("numel").get<int64_t>();
      r.dtype = c.at("dtype").get<std::string>();
      r.start_s = c.at("start_s").get<double>();
      r.end_s = c.at("end_s").get<double>();
      r.state = c.at("state").get<std::string>();
      d.records.push_back(std::move(r));
    }
  } catch (const json::exception& e) {
    fail(e.what());
  }
  return d;
}

}  // namespace

std::string diagnose_flight_dumps(const std::string& dir) {
  if (!fs::is_directory(dir))
    throw std::runtime_error("tandem doctor: " + dir + " is not a directory (expected the "
                             "flight folder of a job: project_dir/flight)");
  std::map<int, Dump> dumps;
  for (const auto& e : fs::directory_iterator(dir)) {
    const auto name = e.path().filename().string();
    if (name.rfind("rank", 0) != 0 || e.path().extension() != ".json") continue;
    auto d = read_dump(e.path());
    dumps[d.rank] = std::move(d);
  }
  if (dumps.empty())
    throw std::runtime_error("tandem doctor: " + dir + " holds no rank<r>.json: a rank writes "
                             "its flight recorder there when a collective fails, or on SIGUSR2");
  std::ostringstream out;
  const int world = dumps.begin()->second.world;
  std::vector<int> missing;
  for (int r = 0; r < world; ++r)
    if (!dumps.count(r)) missing.push_back(r);
  out << "tandem doctor: " << dumps.size() << " of " << world << " ranks' flight records in "
      << dir << "\n";
  for (const auto& [rank, d] : dumps)
    out << "  rank " << rank << ": " << d.reason << "; " << d.records.size() << " collectives\n";
  if (!missing.empty())
    out << "no dump from " << rank_list(missing)
        << ": it wrote none (killed, or stopped before its collective failed); send it SIGUSR2 "
           "while it runs\n";

  std::map<std::string, std::vector<int>> groups;
  for (const auto& [rank, d] : dumps)
    for (const auto& [g, ranks] : d.groups) groups[g] = ranks;
  bool found = false;
  for (const auto& [group, members] : groups) {
    // Each member's records of this group, by sequence number, and its last.
    std::map<int, std::map<int64_t, const FlightRecord*>> by_rank;
    for (int m : members) {
      auto it = dumps.find(m);
      if (it == dumps.end()) continue;
      auto& mine = by_rank[m];
      for (const auto& r : it->second.records)
        if (r.group == group) mine[r.seq] = &r;
    }
    if (by_rank.size() < 2) continue;
    // The first sequence number at which the ranks that reached it disagree.
    std::set<int64_t> seqs;
    for (const auto& [m, recs] : by_rank)
      for (const auto& [s, r] : recs) seqs.insert(s);
    for (int64_t s : seqs) {
      std::map<std::string, std::vector<int>> kinds;  // "op numel dtype" -> ranks
      for (const auto& [m, recs] : by_rank) {
        auto it = recs.find(s);
        if (it == recs.end()) continue;
        const auto& r = *it->second;
        kinds[r.op + " (" + std::to_string(r.numel) + " x " + r.dtype + ")"].push_back(m);
      }
      if (kinds.size() < 2) continue;
      found = true;
      out << "group " << group << ", collective #" << s
          << ": the ranks called different collectives:";
      for (const auto& [k, ranks] : kinds) out << " " << rank_list(ranks) << " " << k << ";";
      out << " the program takes another path on some ranks (a collective inside a condition, "
             "or tensors of other sizes)\n";
      break;
    }
    // Ranks behind: their last collective is older than the others' last.
    int64_t newest = 0;
    std::map<int, int64_t> last;
    for (const auto& [m, recs] : by_rank) {
      last[m] = recs.empty() ? 0 : recs.rbegin()->first;
      newest = std::max(newest, last[m]);
    }
    std::vector<int> behind, ahead;
    for (const auto& [m, l] : last) (l < newest ? behind : ahead).push_back(m);
    if (behind.empty()) continue;
    found = true;
    const auto& waiting = *by_rank[ahead.front()].rbegin()->second;
    for (int m : behind) {
      const auto& recs = by_rank[m];
      out << "group " << group << ": rank " << m << " is behind: its last collective is "
          << (recs.empty() ? std::string("none") : describe(*recs.rbegin()->second)) << ", while "
          << rank_list(ahead) << " reached " << describe(waiting)
          << "; rank " << m << " never issued that one: it is stuck or slow before it (look at "
          << "its stack: gdb -p, py-spy), or took another path\n";
    }
  }
  if (!found)
    out << "every group's ranks reached the same collective with the same operation and size: "
           "no rank is behind (a hang inside the collective itself: the network, or a rank that "
           "wrote no dump)\n";
  return out.str();
}

}  // namespace tandem::track
