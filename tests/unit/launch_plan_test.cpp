// make_plan: ranks, environment, and bad options, without starting any process.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>

#include "../../src/launch/fork_start.h"
#include "tandem/comm/process_group.h"
#include "tandem/launch/launcher.h"

using tandem::launch::LaunchOptions;
using tandem::launch::make_plan;

TEST(LaunchPlan, SingleMachine) {
  auto plan = make_plan(LaunchOptions().num_processes(3).main_process_port(29555).cpu(true)
                            .num_cpu_threads_per_process(2),
                        {"prog", "--x"}, {});
  ASSERT_EQ(plan.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(plan[i].rank, i);
    EXPECT_EQ(plan[i].env.at("RANK"), std::to_string(i));
    EXPECT_EQ(plan[i].env.at("LOCAL_RANK"), std::to_string(i));
    EXPECT_EQ(plan[i].env.at("WORLD_SIZE"), "3");
    EXPECT_EQ(plan[i].env.at("MASTER_PORT"), "29555");
    EXPECT_EQ(plan[i].env.at("OMP_NUM_THREADS"), "2");
    EXPECT_EQ(plan[i].env.at("TANDEM_USE_CPU"), "1");
    EXPECT_EQ(plan[i].argv, (std::vector<std::string>{"prog", "--x"}));
  }
}

TEST(LaunchPlan, SecondMachineGetsGlobalRanks) {
  auto plan = make_plan(LaunchOptions().num_processes(2).num_machines(3).machine_rank(2)
                            .main_process_ip("10.1.1.1").main_process_port(1000),
                        {"prog"}, {});
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].rank, 4);
  EXPECT_EQ(plan[1].rank, 5);
  EXPECT_EQ(plan[1].env.at("WORLD_SIZE"), "6");
  EXPECT_EQ(plan[1].env.at("GROUP_RANK"), "2");
  EXPECT_EQ(plan[1].env.at("MASTER_ADDR"), "10.1.1.1");
}

TEST(LaunchPlan, PicksAFreePort) {
  auto plan = make_plan(LaunchOptions().num_processes(2), {"prog"}, {});
  int port = std::stoi(plan[0].env.at("MASTER_PORT"));
  EXPECT_GT(port, 0);
  EXPECT_EQ(plan[1].env.at("MASTER_PORT"), plan[0].env.at("MASTER_PORT"));
}

TEST(LaunchPlan, RejectsBadOptions) {
  EXPECT_THROW(make_plan(LaunchOptions(), {}, {}), std::invalid_argument);
  EXPECT_THROW(make_plan(LaunchOptions().num_processes(0), {"p"}, {}), std::invalid_argument);
  EXPECT_THROW(make_plan(LaunchOptions().num_machines(2).machine_rank(2).main_process_port(5),
                         {"p"}, {}),
               std::invalid_argument);
  EXPECT_THROW(make_plan(LaunchOptions().num_machines(2), {"p"}, {}), std::invalid_argument);
  EXPECT_THROW(make_plan(LaunchOptions().main_process_port(70000), {"p"}, {}),
               std::invalid_argument);
  auto error = [](const LaunchOptions& o, std::vector<std::string> command = {"p"}) {
    try {
      make_plan(o, command, {});
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto e = error(LaunchOptions().max_restarts(-1));
  EXPECT_NE(e.find("--max_restarts=-1 must be at least 0"), std::string::npos) << e;
  e = error(LaunchOptions().grace_period_s(-1));
  EXPECT_NE(e.find("--grace_period=-1 must be at least 0"), std::string::npos) << e;
  e = error(LaunchOptions().monitor_interval_s(0));
  EXPECT_NE(e.find("--monitor_interval=0 must be above 0"), std::string::npos) << e;
  EXPECT_EQ(error(LaunchOptions().max_restarts(2)), "");
  // The CLI prefixes "tandem launch: "; the message must not carry it a second time.
  e = error(LaunchOptions(), {});
  EXPECT_EQ(e.rfind("no program given", 0), 0u) << e;
}

// c10d's store retries a name that does not resolve every second for 30 minutes: the plan
// refuses it at once, naming the host and the flag.
TEST(LaunchPlan, UnresolvableMainProcessIpIsRefused) {
  auto start = std::chrono::steady_clock::now();
  std::string e;
  try {
    make_plan(LaunchOptions().num_processes(2).main_process_ip("no.such.host.invalid"), {"p"}, {});
  } catch (const std::invalid_argument& x) {
    e = x.what();
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(e.find("--main_process_ip no.such.host.invalid"), std::string::npos) << e;
  EXPECT_NE(e.find("does not resolve"), std::string::npos) << e;
  EXPECT_LT(secs, 30);  // the resolver's own timeouts, where no DNS server answers
  EXPECT_NO_THROW(make_plan(LaunchOptions().main_process_ip("localhost"), {"p"}, {}));
  EXPECT_EQ(tandem::host_resolution_error("127.0.0.1"), "");
  EXPECT_NE(tandem::host_resolution_error("no.such.host.invalid"), "");
}

// Note [Threads per rank]: each local rank gets its share of the launcher's cores, unless the
// user chose OMP_NUM_THREADS (kept as it is) or --num_cpu_threads_per_process.
TEST(LaunchPlan, ThreadsPerRank) {
  const int cores = static_cast<int>(tandem::launch::usable_cpus().size());
  ASSERT_GE(cores, 1);
  auto plan = make_plan(LaunchOptions().num_processes(2).main_process_port(1), {"p"}, {});
  const std::string share = std::to_string(tandem::launch::default_threads_per_process(cores, 2));
  EXPECT_EQ(plan[0].env.at("OMP_NUM_THREADS"), share);
  EXPECT_EQ(plan[1].env.at("TANDEM_NUM_CPU_THREADS"), share);
  EXPECT_TRUE(plan[0].cpus.empty());
  // The user's OMP_NUM_THREADS stays theirs (not overwritten) and sizes LibTorch's pool.
  plan = make_plan(LaunchOptions().num_processes(2).main_process_port(1), {"p"},
                   {{"OMP_NUM_THREADS", "3"}});
  EXPECT_EQ(plan[0].env.count("OMP_NUM_THREADS"), 0u);
  EXPECT_EQ(plan[0].env.at("TANDEM_NUM_CPU_THREADS"), "3");
  // The flag wins over the environment.
  plan = make_plan(LaunchOptions().num_processes(2).main_process_port(1).num_cpu_threads_per_process(1),
                   {"p"}, {{"OMP_NUM_THREADS", "3"}});
  EXPECT_EQ(plan[1].env.at("OMP_NUM_THREADS"), "1");
}

TEST(LaunchPlan, CpuAffinityGivesEachRankItsOwnCores) {
  const auto cpus = tandem::launch::usable_cpus();
  const int n = static_cast<int>(cpus.size());
  auto plan = make_plan(LaunchOptions().num_processes(n).main_process_port(1).cpu_affinity(true),
                        {"p"}, {});
  ASSERT_EQ(plan.size(), static_cast<size_t>(n));
  std::vector<int> seen;
  for (const auto& p : plan) {
    ASSERT_EQ(p.cpus.size(), 1u);
    seen.push_back(p.cpus[0]);
    EXPECT_EQ(p.env.at("TANDEM_CPU_AFFINITY"), std::to_string(p.cpus[0]));
  }
  EXPECT_EQ(seen, cpus);  // every core once, in order
  try {
    make_plan(LaunchOptions().num_processes(n + 1).main_process_port(1).cpu_affinity(true), {"p"},
              {});
    FAIL() << "more processes than cores cannot be bound";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--enable_cpu_affinity"), std::string::npos) << e.what();
  }
}

// Note [Preemption]: --preemption_signal reaches every rank as TANDEM_PREEMPTION_SIGNAL; a name
// that is no catchable signal, and a negative grace, are refused naming the flag.
TEST(LaunchPlan, PreemptionSignalAndGrace) {
  auto plan = make_plan(LaunchOptions().num_processes(2).preemption_signal("USR1"), {"p"}, {});
  for (const auto& p : plan) EXPECT_EQ(p.env.at("TANDEM_PREEMPTION_SIGNAL"), "USR1");
  plan = make_plan(LaunchOptions().num_processes(1), {"p"}, {});
  EXPECT_EQ(plan[0].env.count("TANDEM_PREEMPTION_SIGNAL"), 0u);
  auto error = [](const LaunchOptions& o) {
    try {
      make_plan(o, {"p"}, {});
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto e = error(LaunchOptions().preemption_signal("STOP"));
  EXPECT_NE(e.find("--preemption_signal=STOP: expected a signal a process can catch"),
            std::string::npos)
      << e;
  e = error(LaunchOptions().preemption_grace_s(-1));
  EXPECT_NE(e.find("--preemption_grace_s=-1 must be at least 0"), std::string::npos) << e;
  e = error(LaunchOptions().heartbeat_timeout_s(-1));
  EXPECT_NE(e.find("--heartbeat_timeout_s=-1 must be at least 0"), std::string::npos) << e;
}

// Note [Fork start]: the spec the launcher hands the fork server reads back as written, and a
// truncated or foreign one is not read at all.
TEST(ForkStart, SpecReadsBackAsWritten) {
  namespace fs = tandem::launch::fork_start;
  fs::Spec spec;
  spec.launcher_pid = 4242;
  spec.ranks.push_back({0, 7, 8, {}, {"RANK=0", "A=with=equals", "EMPTY="}});
  spec.ranks.push_back({1, 9, 10, {2, 3}, {"RANK=1", std::string("NL=a\nb")}});
  const std::string bytes = fs::encode(spec);
  const auto back = fs::decode(bytes);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->launcher_pid, 4242);
  ASSERT_EQ(back->ranks.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(back->ranks[i].rank, spec.ranks[i].rank);
    EXPECT_EQ(back->ranks[i].out_fd, spec.ranks[i].out_fd);
    EXPECT_EQ(back->ranks[i].err_fd, spec.ranks[i].err_fd);
    EXPECT_EQ(back->ranks[i].cpus, spec.ranks[i].cpus);
    EXPECT_EQ(back->ranks[i].env, spec.ranks[i].env);
  }
  for (size_t cut : {size_t{0}, size_t{3}, bytes.size() / 2, bytes.size() - 1})
    EXPECT_FALSE(fs::decode(bytes.substr(0, cut)).has_value()) << cut;
  EXPECT_FALSE(fs::decode(bytes + "x").has_value());
  EXPECT_FALSE(fs::decode("not a spec at all").has_value());
}

// Only the variables that say which rank a process is may differ between forked ranks; the
// program must be an executable linking libtandem (this test program does).
TEST(ForkStart, WhatMayDifferAndWhichProgramsFork) {
  namespace fs = tandem::launch::fork_start;
  for (const char* k : {"RANK", "LOCAL_RANK", "TANDEM_ERROR_FILE", "TANDEM_HEARTBEAT_FILE",
                        "TANDEM_CPU_AFFINITY", "CUDA_VISIBLE_DEVICES"})
    EXPECT_TRUE(fs::may_differ(k)) << k;
  for (const char* k : {"OMP_NUM_THREADS", "OPENBLAS_CORETYPE", "WORLD_SIZE", "ASAN_OPTIONS"})
    EXPECT_FALSE(fs::may_differ(k)) << k;
  char self[4096] = {0};
  ASSERT_GT(::readlink("/proc/self/exe", self, sizeof self - 1), 0);
  EXPECT_EQ(fs::unsupported_program(self, ""), "");
  EXPECT_NE(fs::unsupported_program("true", "/nonexistent:/bin:/usr/bin")
                .find("does not link "
                      "libtandem"),
            std::string::npos);
  EXPECT_NE(fs::unsupported_program("no-such-program-x", "/bin").find("is not on PATH"),
            std::string::npos);
  EXPECT_NE(fs::unsupported_program("/etc/hostname", "").find("is not an executable"),
            std::string::npos);
}
