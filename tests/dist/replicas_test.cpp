// Fault-tolerant replicas (Note [Replica recovery]): three machines, each its own `tandem launch
// --fault_tolerant_replicas` with one process; machine 2's process dies after step 8 (SIGKILL,
// as a lost machine), machines 0 and 1 go on without restarting, and a new launcher for machine
// 2 joins them at a step boundary with the state of a live replica. Machine 0 runs in one network
// namespace and machines 1 and 2 in another (10.231.0.1 and 10.231.0.2) when this test may
// create them (root), else all three on loopback.
#include <gtest/gtest.h>
#include <unistd.h>

#include <regex>
#include <thread>

#include "../common/subprocess.h"
#include "../common/two_hosts.h"

using tandem::testing::count_of;
using tandem::testing::free_port;
using tandem::testing::run_command;
using tandem::testing::RunResult;
using tandem::testing::TwoHosts;

namespace {

const std::string kCli = TANDEM_CLI;
const std::string kWorker = REPLICA_WORKER;
constexpr int kSteps = 70;

std::vector<std::string> machine(int rank, const std::string& ip, int port,
                                 std::vector<std::string> worker_args) {
  std::vector<std::string> argv{kCli,
                                "launch",
                                "--num_machines",
                                "3",
                                "--machine_rank",
                                std::to_string(rank),
                                "--main_process_ip",
                                ip,
                                "--main_process_port",
                                std::to_string(port),
                                "--num_processes",
                                "3",
                                "--cpu",
                                "--fault_tolerant_replicas",
                                "--replica_timeout_s",
                                "20",
                                kWorker,
                                "--steps",
                                std::to_string(kSteps)};
  argv.insert(argv.end(), worker_args.begin(), worker_args.end());
  return argv;
}

// The "replicas <n>" of every "step <k>" line, in order, and whether the steps ran 1, 2, ... with
// none repeated or missed from the first one printed.
std::vector<int> replicas_per_step(const std::string& out, bool* consecutive) {
  std::vector<int> n;
  std::regex line(R"(step (\d+) replicas (\d+) loss (-?[0-9.]+))");
  int64_t last = -1;
  *consecutive = true;
  for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it) {
    const int64_t k = std::stoll((*it)[1]);
    if (last >= 0 && k != last + 1) *consecutive = false;
    last = k;
    n.push_back(std::stoi((*it)[2]));
  }
  return n;
}

std::string digest(const std::string& out) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex(R"(final step (\d+) digest ([0-9a-f]+))"))) return "";
  return m[1].str() + " " + m[2].str();
}

}  // namespace

TEST(Replicas, ALostMachineIsDroppedAndAReplacementJoinsEqualToItsPeers) {
  TwoHosts hosts;
  const bool namespaces = geteuid() == 0 && hosts.setup().empty();
  const std::string ip0 = namespaces ? "10.231.0.1" : "127.0.0.1";
  auto on = [&](int host, std::vector<std::string> argv) {
    return namespaces ? hosts.in(host, argv) : argv;
  };
  const int port = free_port();
  const std::map<std::string, std::string> env{{"TANDEM_CONFIG_HOME", "/nonexistent"}};
  RunResult r0, r1, lost, joined;
  std::thread m1([&] {
    r1 = run_command(on(1, machine(1, ip0, port, {"--sleep_ms", "100"})), env, 240);
  });
  std::thread m2([&] {
    lost =
        run_command(on(1, machine(2, ip0, port, {"--sleep_ms", "100", "--die_at", "8"})), env, 240);
    joined = run_command(on(1, machine(2, ip0, port, {"--sleep_ms", "100"})), env, 240);
  });
  r0 = run_command(on(0, machine(0, ip0, port, {"--sleep_ms", "100"})), env, 240);
  m1.join();
  m2.join();
  SCOPED_TRACE(namespaces ? "machines in two network namespaces" : "machines on loopback");
  const std::string all = "--- machine 0\n" + r0.output + "--- machine 1\n" + r1.output +
                          "--- machine 2 (lost)\n" + lost.output + "--- machine 2 (joined)\n" +
                          joined.output;

  // The lost machine: killed after step 8, its launcher ends with it.
  EXPECT_EQ(lost.exit_code, 137) << all;
  EXPECT_NE(lost.output.find("step 8 replicas 3"), std::string::npos) << all;
  // The survivors: no restart, every step once, 3 replicas, then 2, then 3 again.
  for (const RunResult* r : {&r0, &r1}) {
    ASSERT_FALSE(r->timed_out) << all;
    EXPECT_EQ(r->exit_code, 0) << all;
    EXPECT_EQ(r->output.find("restarting"), std::string::npos) << all;
    bool consecutive = false;
    const auto n = replicas_per_step(r->output, &consecutive);
    EXPECT_TRUE(consecutive) << all;
    ASSERT_EQ(n.size(), static_cast<size_t>(kSteps)) << all;
    EXPECT_EQ(n.front(), 3) << all;
    EXPECT_EQ(n.back(), 3) << all;
    EXPECT_NE(std::find(n.begin(), n.end(), 2), n.end()) << all;
    EXPECT_EQ(n[8], 2) << all;  // step 9, the first after the loss, on the two that remain
    EXPECT_NE(r->output.find("a replica is lost ("), std::string::npos) << all;
    EXPECT_NE(r->output.find("2 replica(s) go on (were 3)"), std::string::npos) << all;
  }
  // The replacement: joined at a step boundary after the loss, with the live replicas' state,
  // and ends bitwise equal to them (parameters and AdamW's state).
  ASSERT_FALSE(joined.timed_out) << all;
  EXPECT_EQ(joined.exit_code, 0) << all;
  std::smatch at;
  ASSERT_TRUE(std::regex_search(joined.output, at, std::regex(R"(joined at step (\d+))"))) << all;
  EXPECT_GT(std::stoi(at[1]), 8) << all;
  EXPECT_LT(std::stoi(at[1]), kSteps) << all;
  bool consecutive = false;
  const auto n = replicas_per_step(joined.output, &consecutive);
  EXPECT_TRUE(consecutive) << all;
  ASSERT_FALSE(n.empty()) << all;
  EXPECT_EQ(n.front(), 3) << all;
  EXPECT_FALSE(digest(r0.output).empty()) << all;
  EXPECT_EQ(digest(r0.output).rfind(std::to_string(kSteps) + " ", 0), 0u) << all;  // every step
  EXPECT_EQ(digest(r1.output), digest(r0.output)) << all;
  EXPECT_EQ(digest(joined.output), digest(r0.output)) << all;
}

TEST(Replicas, TheLauncherRefusesWhatReplicasCannotRun) {
  auto refused = [](std::vector<std::string> flags) {
    std::vector<std::string> argv{kCli,        "launch",
                                  "--cpu",     "--fault_tolerant_replicas",
                                  "--dry_run", "--main_process_ip",
                                  "127.0.0.1"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back(kWorker);
    return run_command(argv, {{"TANDEM_CONFIG_HOME", "/nonexistent"}}, 60);
  };
  auto one = refused({"--num_processes", "2"});
  EXPECT_NE(one.exit_code, 0) << one.output;
  EXPECT_NE(one.output.find("--fault_tolerant_replicas makes every machine one replica"),
            std::string::npos)
      << one.output;
  auto many = refused({"--num_machines", "2", "--machine_rank", "0", "--main_process_port", "29400",
                       "--num_processes", "4"});
  EXPECT_NE(many.exit_code, 0) << many.output;
  EXPECT_NE(many.output.find("give --num_processes equal to --num_machines"), std::string::npos)
      << many.output;
  auto elastic = refused({"--num_machines", "2", "--machine_rank", "0", "--main_process_port",
                          "29400", "--num_processes", "2", "--min_machines", "1"});
  EXPECT_NE(elastic.exit_code, 0) << elastic.output;
  EXPECT_NE(elastic.output.find("leave out --min_machines"), std::string::npos) << elastic.output;
  auto timeout = refused({"--num_machines", "2", "--machine_rank", "0", "--main_process_port",
                          "29400", "--num_processes", "2", "--replica_timeout_s", "0"});
  EXPECT_NE(timeout.exit_code, 0) << timeout.output;
  EXPECT_NE(timeout.output.find("--replica_timeout_s=0 must be above 0"), std::string::npos)
      << timeout.output;
}
