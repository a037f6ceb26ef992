// Two machines, each with its own `tandem launch`: on loopback, and as two network namespaces
// joined by a veth pair (10.231.0.1 and 10.231.0.2, hosts that exist only inside this test).
// Machine 1 starts first: the ranks wait for rank 0's store until their timeout.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../common/subprocess.h"
#include "../common/two_hosts.h"

using tandem::testing::count_of;
using tandem::testing::free_port;
using tandem::testing::RunResult;
using tandem::testing::TwoHosts;

namespace {

const std::string kCli = TANDEM_CLI;
const std::string kWorker = COLLECTIVES_WORKER;

std::vector<std::string> machine(int rank, const std::string& ip, int port,
                                 std::vector<std::string> extra = {}) {
  std::vector<std::string> argv{kCli,
                                "launch",
                                "--num_machines",
                                "2",
                                "--machine_rank",
                                std::to_string(rank),
                                "--main_process_ip",
                                ip,
                                "--main_process_port",
                                std::to_string(port),
                                "--num_processes",
                                "4",
                                "--cpu",
                                "--grace_period",
                                "2"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.push_back(kWorker);
  argv.push_back("all");
  return argv;
}

// Runs machine 1 first, then machine 0 after `delay_s`; both must finish.
std::pair<RunResult, RunResult> run_two(const std::vector<std::string>& m0,
                                        const std::vector<std::string>& m1, double delay_s) {
  return tandem::testing::run_two_machines(m0, m1, delay_s, 30, 120);
}

void expect_ranks_ok(const RunResult& r, std::vector<int> ranks) {
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int k : ranks)
    EXPECT_NE(r.output.find("[rank " + std::to_string(k) + "] collectives OK on rank " +
                            std::to_string(k) + " of 4"),
              std::string::npos)
        << r.output;
  EXPECT_EQ(count_of(r.output, "collectives OK"), 2) << r.output;
}

}  // namespace

TEST(MultiMachine, TwoLaunchersOnLoopbackMachineOneFirst) {
  const int port = free_port();
  auto [r0, r1] = run_two(machine(0, "127.0.0.1", port), machine(1, "127.0.0.1", port), 2.0);
  expect_ranks_ok(r0, {0, 1});
  expect_ranks_ok(r1, {2, 3});
}

TEST(MultiMachine, TwoNetworkNamespacesWithC10dRendezvous) {
  if (geteuid() != 0) GTEST_SKIP() << "creating network namespaces needs root (ip netns add)";
  TwoHosts hosts;
  std::string why = hosts.setup();
  if (!hosts.created())
    GTEST_SKIP() << "network namespaces are not permitted here, so two machines cannot be "
                    "simulated ("
                 << why << ")";
  ASSERT_EQ(why, "") << "setting up the two hosts failed";
  // Machine 1 (10.231.0.2) starts 3 s before machine 0 hosts the store.
  auto m0 = hosts.in(0, machine(0, "10.231.0.1", 29500, {"--rdzv_backend", "c10d"}));
  auto m1 = hosts.in(1, machine(1, "10.231.0.1", 29500, {"--rdzv_backend", "c10d", "--debug"}));
  auto [r0, r1] = run_two(m0, m1, 3.0);
  expect_ranks_ok(r0, {0, 1});
  expect_ranks_ok(r1, {2, 3});
  // The launcher found the address that routes to machine 0, for Gloo to listen on.
  EXPECT_NE(r1.output.find("TANDEM_LOCAL_ADDR=10.231.0.2"), std::string::npos) << r1.output;
}
