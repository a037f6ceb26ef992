// The "check <name> <value>" lines that test workers print (one per rank and check): the
// largest value of each name and how many ranks printed it.
#pragma once

#include <algorithm>
#include <map>
#include <sstream>
#include <string>

namespace tandem::testing {

// "check <name> <value>" lines: the largest value of each name, and how many ranks printed it.
struct Checks {
  std::map<std::string, double> worst;
  std::map<std::string, int> count;
};

inline Checks parse_checks(const std::string& output) {
  Checks c;
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    // The launcher prefixes each rank's lines with "[rank r] ".
    if (line.rfind("[rank ", 0) == 0) line = line.substr(line.find("] ") + 2);
    if (line.rfind("check ", 0) != 0) continue;
    const auto last = line.rfind(' ');
    const std::string name = line.substr(6, last - 6);
    const double v = std::stod(line.substr(last + 1));
    c.worst[name] = std::max(c.worst.count(name) ? c.worst[name] : 0.0, v);
    ++c.count[name];
  }
  return c;
}

}  // namespace tandem::testing
