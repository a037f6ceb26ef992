// Real multi-process runs through `tandem launch` over Gloo on 127.0.0.1.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "../common/launch.h"
#include "../common/temp_dir.h"

using tandem::testing::count_of;
using tandem::testing::free_port;
using tandem::testing::launch;
using tandem::testing::launch_command;
using tandem::testing::LaunchOptions;
using tandem::testing::run_command;

namespace {

const std::string kCli = TANDEM_CLI;
const std::string kWorker = COLLECTIVES_WORKER;

// The launcher's own thread count, two seconds' grace for the others when one rank fails.
const auto kLaunch = LaunchOptions().threads_per_process(0).flags({"--grace_period", "2"});

}  // namespace

// Note [Rendezvous generations]: world groups built one after another (two Accelerators in a
// row), rank 0 lagging so that the others meet its previous store: every group connects and
// reduces right. Before, a fast rank found the previous rendezvous complete and Gloo's
// previous addresses ("Connection refused").
TEST(Launch, WorldGroupsBuiltOneAfterAnotherConnect) {
  auto r = launch(3, kWorker, {"recreate"}, kLaunch);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "recreate OK on rank"), 3) << r.output;
}

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, EveryCollectiveOnEveryRank) {
  const int n = GetParam();
  auto r = launch(n, kWorker, {"all"}, kLaunch);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "collectives OK"), n) << r.output;
  EXPECT_EQ(count_of(r.output, "FAILED"), 0) << r.output;
  for (int k = 0; k < n; ++k)
    EXPECT_NE(r.output.find("[rank " + std::to_string(k) + "] collectives OK on rank " +
                            std::to_string(k) + " of " + std::to_string(n)),
              std::string::npos)
        << r.output;
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives, ::testing::Values(1, 2, 3, 4));

TEST(Launch, LinesOfTwoRanksNeverInterleave) {
  auto r = launch(3, kWorker, {"spam"}, kLaunch);
  ASSERT_EQ(r.exit_code, 0) << r.output.substr(0, 2000);
  std::regex line_re(R"(\[rank (\d)\] spam (\d) (\d+) ([a-c]+) end)");
  std::istringstream is(r.output);
  std::string line;
  int spam_lines = 0;
  while (std::getline(is, line)) {
    if (line.find("spam") == std::string::npos) continue;
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, line_re)) << "mangled line: " << line;
    EXPECT_EQ(m[1], m[2]) << line;
    EXPECT_EQ(m[4].str().find_first_not_of(m[4].str()[0]), std::string::npos) << line;
    ++spam_lines;
  }
  EXPECT_EQ(spam_lines, 3 * 2000);
}

TEST(Launch, KilledRankStopsTheJobAndIsNamed) {
  auto r = launch(3, kWorker, {"die"},
                  LaunchOptions(kLaunch).env({{"TANDEM_TEST_TIMEOUT_S", "60"}}).timeout_s(90));
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.output;
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("killed by signal 9 (SIGKILL)"), std::string::npos) << r.output;
  // The job ended because the launcher stopped it, long before the 60 s collective timeout.
  EXPECT_LT(r.seconds, 45) << r.output;
}

TEST(Launch, ExitCodeOfTheFailingRankIsReturned) {
  auto r = launch(3, kWorker, {"exit3"}, LaunchOptions(kLaunch).timeout_s(90));
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("rank 2 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 3"), std::string::npos) << r.output;
}

TEST(Launch, PortInUseGivesAClearError) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  auto argv = launch_command(2, kWorker, {"all"}, kLaunch);
  argv.insert(argv.begin() + 2, {"--main_process_port", std::to_string(port)});
  auto r = run_command(argv, {{"TANDEM_TEST_TIMEOUT_S", "10"}}, 90);
  close(fd);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("cannot host the rendezvous store at 127.0.0.1:" + std::to_string(port)),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("--main_process_port"), std::string::npos) << r.output;
  // A port the user chose is not the launcher's to replace.
  EXPECT_EQ(r.output.find("starting the ranks again"), std::string::npos) << r.output;
}

// Note [Free ports]: a port the launcher found free and another program took before rank 0
// listened on it is replaced: rank 0 says so in TANDEM_ERROR_FILE, and the launcher starts the
// ranks again on another port, without counting a restart. Here rank 0 (a shell) says it on its
// first run; a real rank 0 says it when hosting the store fails with "Address already in use"
// (RankZeroSaysWhenItsPortWasTaken).
TEST(Launch, APortTakenBeforeRankZeroListensIsReplaced) {
  tandem::testing::TempDir dir;
  const std::string ports = dir.str() + "/ports", once = dir.str() + "/once";
  auto r = run_command(
      {kCli, "launch", "--num_processes", "2", "--cpu", "/bin/sh", "-c",
       "if [ \"$RANK\" = 0 ]; then echo $MASTER_PORT >> " + ports + "; if [ ! -e " + once +
           " ]; then touch " + once + "; echo port-taken > \"$TANDEM_ERROR_FILE\"; exit 1; fi; fi"},
      {}, 60);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output,
                     "was taken by another program before rank 0 listened on it; "
                     "starting the ranks again on port "),
            1)
      << r.output;
  std::ifstream in(ports);
  std::vector<std::string> seen;
  for (std::string line; std::getline(in, line);) seen.push_back(line);
  ASSERT_EQ(seen.size(), 2u) << r.output;
  EXPECT_NE(seen[0], seen[1]);
  EXPECT_NE(r.output.find("port " + seen[0] + ", which was free"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("again on port " + seen[1]), std::string::npos) << r.output;
}

TEST(Launch, RankZeroSaysWhenItsPortWasTaken) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  tandem::testing::TempDir dir;
  const std::string error_file = dir.str() + "/rank0.error";
  auto r = run_command({kWorker, "all"},
                       {{"RANK", "0"},
                        {"WORLD_SIZE", "2"},
                        {"MASTER_ADDR", "127.0.0.1"},
                        {"MASTER_PORT", std::to_string(ntohs(addr.sin_port))},
                        {"TANDEM_ERROR_FILE", error_file},
                        {"TANDEM_TEST_TIMEOUT_S", "10"}},
                       60);
  close(fd);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("cannot host the rendezvous store"), std::string::npos) << r.output;
  std::ifstream in(error_file);
  std::string word;
  in >> word;
  EXPECT_EQ(word, "port-taken") << r.output;
}

// Note [Loopback rendezvous]: a job on one machine (MASTER_ADDR 127.0.0.1) hosts its store on
// 127.0.0.1 only where LibTorch allows it; LibTorch 1.13 cannot, and its store listens on every
// interface (documented in docs/launching.md, "Security").
TEST(Launch, RendezvousStoreListensOnLoopbackWhereLibTorchCan) {
  auto r = launch(2, kWorker, {"listen"}, LaunchOptions(kLaunch).timeout_s(90));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const bool capable = r.output.find("loopback capable 1") != std::string::npos;
  ASSERT_TRUE(capable || r.output.find("loopback capable 0") != std::string::npos) << r.output;
  ASSERT_NE(r.output.find("store listens on "), std::string::npos) << r.output;
  const bool on_any = r.output.find("store listens on 00000000\n") != std::string::npos ||
                      r.output.find("store listens on 00000000000000000000000000000000\n") !=
                          std::string::npos;
  const bool on_loopback = r.output.find("store listens on 0100007F\n") != std::string::npos;
  if (capable) {
    EXPECT_TRUE(on_loopback && !on_any) << r.output;
  } else {
    EXPECT_TRUE(on_any) << r.output;
  }
}

TEST(Launch, RendezvousTimeoutSaysHowManyRanksCame) {
  // Rank 0 of a world of 3 alone: it must give up, naming 2 missing ranks.
  auto r = run_command({kWorker, "all"},
                       {{"RANK", "0"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "127.0.0.1"},
                        {"MASTER_PORT", std::to_string(free_port())}, {"TANDEM_TEST_TIMEOUT_S", "2"}},
                       60);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("waited 2 s for 2 of 3 ranks at 127.0.0.1:"), std::string::npos)
      << r.output;
}

// --enable_cpu_affinity: every rank runs on its own cores (read back from /proc/self/status).
TEST(Launch, CpuAffinityBindsEachRank) {
  auto r = run_command({kCli, "launch", "--num_processes", "2", "--cpu", "--enable_cpu_affinity",
                        "--num_cpu_threads_per_process", "1", "/bin/sh", "-c",
                        "grep Cpus_allowed_list /proc/self/status; echo omp=$OMP_NUM_THREADS"},
                       {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::regex line(R"(\[rank (\d)\] Cpus_allowed_list:\s*(\d+)\n)");
  std::set<std::string> cores;
  for (std::sregex_iterator it(r.output.begin(), r.output.end(), line), end; it != end; ++it)
    cores.insert((*it)[2]);
  EXPECT_EQ(cores.size(), 2u) << r.output;  // one core each, not the same one
  EXPECT_EQ(count_of(r.output, "omp=1"), 2) << r.output;
}

TEST(Launch, SigtermReachesEveryRank) {
  char tmpl[] = "/tmp/tandem-sig-XXXXXX";
  std::string dir = mkdtemp(tmpl);
  std::thread killer([&] {
    // Wait for both ranks to write their pid, then signal the launcher (the harness's child).
    for (int i = 0; i < 300; ++i) {
      std::ifstream a(dir + "/pid0"), b(dir + "/pid1");
      if (a && b) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    system(("pkill -TERM -f 'tandem launch .*sleep " + dir + "'").c_str());
  });
  auto r = launch(2, kWorker, {"sleep", dir}, LaunchOptions(kLaunch).timeout_s(60));
  killer.join();
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.output;
  EXPECT_NE(r.output.find("forwarding it to every rank"), std::string::npos) << r.output;
  for (int k = 0; k < 2; ++k) {
    std::ifstream f(dir + "/pid" + std::to_string(k));
    int pid = 0;
    f >> pid;
    ASSERT_GT(pid, 0);
    EXPECT_NE(kill(pid, 0), 0) << "rank " << k << " still alive";
  }
}

// Note [Fork start]: ranks forked from one start of the program get what exec'd ranks get: the
// same environment (but for the launch's own port and files), a process group of their own, the
// launcher as their parent, their own two output streams, and no TANDEM_FORK_SERVER.
TEST(Launch, ForkStartGivesEachRankWhatExecGives) {
  std::map<std::string, std::map<int, std::set<std::string>>> env;  // by start method and rank
  for (const std::string method : {"exec", "fork"}) {
    auto r = launch(3, kWorker, {"whoami"}, LaunchOptions(kLaunch).start_method(method));
    ASSERT_EQ(r.exit_code, 0) << method << "\n" << r.output;
    for (int k = 0; k < 3; ++k) {
      const std::string s = std::to_string(k);
      EXPECT_NE(r.output.find("[rank " + s + "] whoami " + s + " own_group=1 parent_is_launcher=1"),
                std::string::npos)
          << method << "\n"
          << r.output;
      EXPECT_NE(r.output.find("[rank " + s + "] whoami-stderr " + s), std::string::npos)
          << method << "\n"
          << r.output;
    }
    std::regex var(R"(\[rank (\d)\] whoami-env (\d) ([^=\n]+)=([^\n]*))");
    for (std::sregex_iterator it(r.output.begin(), r.output.end(), var), end; it != end; ++it) {
      ASSERT_EQ((*it)[1], (*it)[2]) << it->str();
      const std::string key = (*it)[3];
      // The launch's own port and files differ from one launch to the next.
      const bool own =
          key == "MASTER_PORT" || key == "TANDEM_ERROR_FILE" || key == "TANDEM_HEARTBEAT_FILE";
      env[method][std::stoi((*it)[1])].insert(own ? key : key + "=" + (*it)[4].str());
    }
  }
  ASSERT_EQ(env["exec"].size(), 3u);
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(env["exec"][k], env["fork"][k]) << "rank " << k;
    EXPECT_TRUE(env["fork"][k].count("RANK=" + std::to_string(k))) << k;
    for (const auto& v : env["fork"][k])
      EXPECT_EQ(v.rfind("TANDEM_FORK_SERVER", 0), std::string::npos);
  }
}

// Note [Fork start]: a program that has no fork server (no libtandem, a script) is refused
// before anything runs, naming --start_method exec; so is a start method that does not exist.
TEST(Launch, ForkStartRefusesAProgramWithoutItsServer) {
  auto fork = [&](const std::string& program) {
    return run_command(
        {kCli, "launch", "--num_processes", "2", "--cpu", "--start_method", "fork", program}, {},
        60);
  };
  auto r = fork("/bin/true");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("/bin/true does not link libtandem"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--start_method exec"), std::string::npos) << r.output;
  tandem::testing::TempDir dir;
  const std::string script = dir.str() + "/train.sh";
  std::ofstream(script) << "#!/bin/sh\necho started > " << dir.str() << "/ran\n";
  ASSERT_EQ(chmod(script.c_str(), 0755), 0);
  r = fork(script);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(script + " is a script"), std::string::npos) << r.output;
  EXPECT_FALSE(std::ifstream(dir.str() + "/ran")) << "the refused script ran";
  r = run_command({kCli, "launch", "--cpu", "--start_method", "spawn", "/bin/true"}, {}, 60);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--start_method=spawn: expected exec"), std::string::npos) << r.output;
}

// Note [Fork start]: forked ranks become the launcher's children, and die with it as exec'd ones
// do (the death signal is armed once the launcher is their parent).
TEST(Launch, ForkedRanksDieWithTheLauncher) {
  tandem::testing::TempDir dir;
  std::thread killer([&] {
    for (int i = 0; i < 600; ++i) {
      std::ifstream a(dir.str() + "/pid0"), b(dir.str() + "/pid1");
      if (a && b) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    system(("pkill -KILL -f 'tandem launch .*sleep " + dir.str() + "'").c_str());
  });
  auto r = launch(2, kWorker, {"sleep", dir.str()}, LaunchOptions(kLaunch).timeout_s(90));
  killer.join();
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.output;
  for (int k = 0; k < 2; ++k) {
    std::ifstream f(dir.str() + "/pid" + std::to_string(k));
    int pid = 0;
    f >> pid;
    ASSERT_GT(pid, 0) << r.output;
    bool gone = false;
    for (int i = 0; i < 100 && !gone; ++i) {
      gone = kill(pid, 0) != 0;
      if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_TRUE(gone) << "rank " << k << " (pid " << pid << ") outlived its launcher";
  }
}

// An address that does not resolve is an error within seconds, naming the host and the flag,
// from the launcher and from a rank started by another launcher (torchrun, mpirun) alike;
// c10d's store would retry it every second until its timeout.
TEST(Launch, UnresolvableAddressFailsFastNamingTheHost) {
  auto r = run_command({kCli, "launch", "--num_processes", "2", "--cpu", "--main_process_ip",
                        "no.such.host.invalid", kWorker, "all"},
                       {{"TANDEM_TEST_TIMEOUT_S", "120"}}, 150);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--main_process_ip no.such.host.invalid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("does not resolve"), std::string::npos) << r.output;
  EXPECT_EQ(count_of(r.output, "[rank "), 0) << r.output;  // no rank was started
  EXPECT_LT(r.seconds, 30) << r.output;

  r = run_command({kWorker, "all"},
                  {{"RANK", "1"},
                   {"WORLD_SIZE", "2"},
                   {"MASTER_ADDR", "no.such.host.invalid"},
                   {"MASTER_PORT", std::to_string(free_port())},
                   {"TANDEM_TEST_TIMEOUT_S", "120"}},
                  150);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("MASTER_ADDR 'no.such.host.invalid' does not resolve"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("--main_process_ip"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;
}

// Note [Signals between fork and exec]: the launcher's own stopping of the other ranks, after a
// rank failed, is never reported as a signal the launcher received. Ranks that fail at once
// (a program that does not exist) are stopped while others are still between fork and exec,
// which is where the launcher's handler used to run in the child.
TEST(Launch, StoppingTheRanksIsNotAReceivedSignal) {
  for (int attempt = 0; attempt < 8; ++attempt) {
    auto r = run_command({kCli, "launch", "--num_processes", "16", "--cpu", "--grace_period", "1",
                          "/nonexistent/program"},
                         {}, 60);
    ASSERT_FALSE(r.timed_out) << r.output;
    EXPECT_EQ(r.exit_code, 127) << r.output;
    EXPECT_EQ(count_of(r.output, "received signal"), 0) << r.output;
    EXPECT_EQ(count_of(r.output, "stopping the other ranks"), 1) << r.output;
  }
}

// Note [Secondary failures]: a rank killed by SIGPIPE wrote to a socket whose peer had gone; the
// rank that failed first is named and its exit code is the job's. Rank 0 dies of SIGPIPE at
// once, rank 1 exits with code 3 a moment later.
TEST(Launch, ARankKilledBySigpipeIsNotNamedAsTheCause) {
  auto r = run_command({kCli, "launch", "--num_processes", "2", "--cpu", "/bin/sh", "-c",
                        "if [ \"$RANK\" = 0 ]; then kill -PIPE $$; else sleep 0.3; exit 3; fi"},
                       {}, 60);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("rank 0 (pid"), std::string::npos) << r.output;
}

// Each message carries the CLI's prefix once.
TEST(Launch, MessagesCarryTheirPrefixOnce) {
  for (std::vector<std::string> argv :
       {std::vector<std::string>{kCli, "launch"},
        {kCli, "launch", "--cpu", "--max_restarts", "-1", "/bin/true"},
        {kCli, "launch", "--cpu", "--env", "RANK=5", "/bin/true"},
        {kCli, "launch", "--cpu", "--log_dir", "/nonexistent/dir", "/bin/true"}}) {
    auto r = run_command(argv, {}, 60);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(count_of(r.output, "tandem launch:"), 1) << r.output;
    EXPECT_EQ(count_of(r.output, "tandem launch: tandem launch"), 0) << r.output;
  }
  auto r = run_command({kCli, "launch", "--cpu", "--env", "RANK=5", "/bin/true"}, {}, 60);
  EXPECT_NE(r.output.find("--env RANK=5: tandem launch sets RANK for every rank itself"),
            std::string::npos)
      << r.output;
  r = run_command({kCli, "launch", "--cpu", "--max_restarts", "-1", "/bin/true"}, {}, 60);
  EXPECT_NE(r.output.find("--max_restarts=-1 must be at least 0"), std::string::npos) << r.output;
}

// Note [Threads per rank]: one process under the launcher runs the intra-op threads LibTorch
// takes in a program started by hand (`tandem env` is one: "LibTorch threads: intra-op N"),
// within the launcher's cores, shown by --dry_run and received by the program; the wait policy
// is left to OpenMP. The user's OMP_NUM_THREADS and OMP_WAIT_POLICY, and the flag, win.
TEST(Launch, OneProcessGetsTheThreadsOfAProgramStartedByHand) {
  const std::vector<std::string> clean{"/usr/bin/env",    "-u", "OMP_NUM_THREADS", "-u",
                                       "OMP_WAIT_POLICY", "-u", "GOMP_SPINCOUNT"};
  auto with = [&](std::vector<std::string> tail) {
    std::vector<std::string> argv = clean;
    argv.insert(argv.end(), tail.begin(), tail.end());
    return argv;
  };
  auto env = run_command(with({kCli, "env"}), {}, 60);
  ASSERT_EQ(env.exit_code, 0) << env.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(env.output, m, std::regex(R"(LibTorch threads: intra-op (\d+))")))
      << env.output;
  const int by_hand = std::stoi(m[1]);
  ASSERT_TRUE(std::regex_search(env.output, m, std::regex(R"(CPU cores: (\d+) usable)")))
      << env.output;
  const std::string want = std::to_string(std::max(1, std::min(by_hand, std::stoi(m[1]))));
  const std::vector<std::string> echo{"/bin/sh", "-c",
                                      "echo omp=$OMP_NUM_THREADS wait=$OMP_WAIT_POLICY."};
  std::vector<std::string> launch1{kCli, "launch", "--num_processes", "1", "--cpu"};
  auto dry = launch1;
  dry.push_back("--dry_run");
  dry.insert(dry.end(), echo.begin(), echo.end());
  auto r = run_command(with(dry), {}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "OMP_NUM_THREADS=" + want + "\n"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "TANDEM_NUM_CPU_THREADS=" + want + "\n"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "OMP_WAIT_POLICY="), 0) << r.output;
  auto run = launch1;
  run.insert(run.end(), echo.begin(), echo.end());
  r = run_command(with(run), {}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "omp=" + want + " wait=."), 1) << r.output;
  // The user's settings reach the program as they are.
  r = run_command(run, {{"OMP_NUM_THREADS", "3"}, {"OMP_WAIT_POLICY", "PASSIVE"}}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "omp=3 wait=PASSIVE."), 1) << r.output;
  auto flag = launch1;
  flag.insert(flag.end(), {"--num_cpu_threads_per_process", "2"});
  flag.insert(flag.end(), echo.begin(), echo.end());
  r = run_command(flag, {{"OMP_NUM_THREADS", "3"}}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "omp=2 wait="), 1) << r.output;
}

// Note [A launcher without LibTorch]: bin/tandem starts and watches the ranks without mapping
// LibTorch, gives them the environment the full command line gives, and hands every other
// command to it.
TEST(Launch, TheLauncherMapsNoLibTorchAndPlansAsTheFullCommandLine) {
  auto r = run_command({kCli, "launch", "--num_processes", "2", "--cpu", "/bin/sh", "-c",
                        "echo maps=$(grep -c -E 'libtorch|libc10_cuda' /proc/$PPID/maps)"},
                       {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "maps=0"), 2) << r.output;

  // The ranks' plan (argv and environment) from either executable: the same but for the port.
  const std::string full = kCli.substr(0, kCli.rfind('/')) + "/../libexec/tandem/tandem";
  auto plan = [](const std::string& cli) {
    auto p = run_command({cli, "launch", "--num_processes", "2", "--cpu", "--dry_run",
                          "--main_process_port", "29511", "/bin/true"},
                         {}, 60);
    EXPECT_EQ(p.exit_code, 0) << p.output;
    return p.output;
  };
  const auto from_front = plan(kCli), from_full = plan(full);
  EXPECT_NE(from_front.find("OMP_NUM_THREADS"), std::string::npos) << from_front;
  EXPECT_EQ(from_front, from_full);

  // Every other command runs in the full command line, with its exit code and output.
  auto env = run_command({kCli, "env"}, {}, 60);
  EXPECT_EQ(env.exit_code, 0) << env.output;
  EXPECT_NE(env.output.find("LibTorch version"), std::string::npos) << env.output;
  auto bad = run_command({kCli, "merge-weights"}, {}, 60);
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.output.find("checkpoint_directory"), std::string::npos) << bad.output;
}

TEST(Launch, AFrontWithoutTheFullCommandLineSaysWhereItLooked) {
  char tmpl[] = "/tmp/tandem-front-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  ASSERT_EQ(std::system(("mkdir -p " + dir + "/bin && cp " + kCli + " " + dir + "/bin/").c_str()),
            0);
  auto r = run_command({dir + "/bin/tandem", "env"}, {}, 60);
  EXPECT_EQ(r.exit_code, 127) << r.output;
  EXPECT_NE(r.output.find(dir + "/bin/../libexec/tandem/tandem"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("reinstall tandem"), std::string::npos) << r.output;
  // launch and config need nothing else.
  auto l = run_command({dir + "/bin/tandem", "launch", "--num_processes", "1", "--cpu", "/bin/sh",
                        "-c", "echo ran"},
                       {}, 60);
  EXPECT_EQ(l.exit_code, 0) << l.output;
  EXPECT_EQ(count_of(l.output, "[rank 0] ran\n"), 1) << l.output;
  std::system(("rm -rf " + dir).c_str());
}
