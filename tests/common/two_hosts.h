// Two machines in one test: network namespaces joined by a veth pair (10.231.0.1 and
// 10.231.0.2, hosts that exist only inside the test), and the bytes that cross between them.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "subprocess.h"

namespace tandem::testing {

/// Two machines' launchers: machine 1's first, machine 0's `delay_s` later (so that machine 1's
/// ranks wait for rank 0's store), each with `timeout_s`; both results once both ended.
inline std::pair<RunResult, RunResult> run_two_machines(const std::vector<std::string>& m0,
                                                        const std::vector<std::string>& m1,
                                                        double delay_s, int test_timeout_s,
                                                        int timeout_s) {
  const std::map<std::string, std::string> env{
      {"TANDEM_TEST_TIMEOUT_S", std::to_string(test_timeout_s)},
      {"TANDEM_CONFIG_HOME", "/nonexistent"}};
  RunResult r1;
  std::thread first([&] { r1 = run_command(m1, env, timeout_s); });
  std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int>(delay_s * 1000)));
  RunResult r0 = run_command(m0, env, timeout_s);
  first.join();
  return {r0, r1};
}

inline int sh(const std::string& cmd, std::string* out = nullptr) {
  auto r = run_command({"/bin/sh", "-c", cmd}, {}, 30);
  if (out) *out = r.output;
  return r.exit_code;
}

// Two network namespaces joined by a veth pair; removed in every case (the namespaces take
// their veth ends with them).
class TwoHosts {
 public:
  TwoHosts() {
    const std::string id = std::to_string(getpid() % 1000000);
    ns_ = {"tandem-m0-" + id, "tandem-m1-" + id};
    veth_ = {"tdv0-" + id, "tdv1-" + id};
  }
  ~TwoHosts() {
    for (const auto& n : ns_) sh("ip netns del " + n + " 2>/dev/null");
    sh("ip link del " + veth_[0] + " 2>/dev/null");
  }
  // "" on success, else what failed.
  std::string setup() {
    std::string out;
    if (sh("ip netns add " + ns_[0], &out) != 0) return "ip netns add: " + out;
    created_ = true;
    const std::vector<std::string> steps = {
        "ip netns add " + ns_[1],
        "ip link add " + veth_[0] + " type veth peer name " + veth_[1],
        "ip link set " + veth_[0] + " netns " + ns_[0],
        "ip link set " + veth_[1] + " netns " + ns_[1],
        "ip -n " + ns_[0] + " addr add 10.231.0.1/24 dev " + veth_[0],
        "ip -n " + ns_[1] + " addr add 10.231.0.2/24 dev " + veth_[1],
        "ip -n " + ns_[0] + " link set lo up",
        "ip -n " + ns_[1] + " link set lo up",
        "ip -n " + ns_[0] + " link set " + veth_[0] + " up",
        "ip -n " + ns_[1] + " link set " + veth_[1] + " up",
    };
    for (const auto& s : steps)
      if (sh(s, &out) != 0) return s + ": " + out;
    return "";
  }
  bool created() const { return created_; }
  std::vector<std::string> in(int host, const std::vector<std::string>& argv) const {
    std::vector<std::string> out{"ip", "netns", "exec", ns_[static_cast<size_t>(host)]};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }

 private:
  std::vector<std::string> ns_, veth_;
  bool created_ = false;
};

}  // namespace tandem::testing
