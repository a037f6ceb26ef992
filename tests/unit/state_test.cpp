// ProcessState: every launcher's variables, SLURM node lists, and each bad value.
#include <gtest/gtest.h>
#include <signal.h>

#include "tandem/preemption.h"
#include "tandem/state.h"

using tandem::EnvMap;
using tandem::LauncherKind;
using tandem::ProcessState;

namespace {

std::string error_of(const EnvMap& env) {
  try {
    ProcessState::from_env(env);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ProcessState, NoVariablesMeansOneProcess) {
  auto s = ProcessState::from_env({});
  EXPECT_EQ(s.world_size, 1);
  EXPECT_EQ(s.rank, 0);
  EXPECT_FALSE(s.distributed());
  EXPECT_EQ(s.launcher, LauncherKind::kNone);
}

TEST(ProcessState, Torchrun) {
  auto s = ProcessState::from_env({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                                   {"LOCAL_WORLD_SIZE", "4"}, {"GROUP_RANK", "1"},
                                   {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(s.launcher, LauncherKind::kTorchrun);
  EXPECT_EQ(s.rank, 5);
  EXPECT_EQ(s.world_size, 8);
  EXPECT_EQ(s.local_rank, 1);
  EXPECT_EQ(s.local_world_size, 4);
  EXPECT_EQ(s.node_rank, 1);
  EXPECT_EQ(s.master_addr, "10.0.0.1");
  EXPECT_EQ(s.master_port, 1234);
}

TEST(ProcessState, TorchrunsAgentHostsTheStore) {
  // torchrun's agent hosts the store; its workers connect as clients, keys under the attempt.
  EnvMap env{{"RANK", "0"},         {"WORLD_SIZE", "2"},       {"MASTER_ADDR", "127.0.0.1"},
             {"MASTER_PORT", "29400"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
             {"TORCHELASTIC_RESTART_COUNT", "2"}};
  EXPECT_EQ(ProcessState::from_env(env).agent_store_prefix, "/worker/attempt_2");
  env.erase("TORCHELASTIC_RESTART_COUNT");
  EXPECT_EQ(ProcessState::from_env(env).agent_store_prefix, "/worker/attempt_0");
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  EXPECT_EQ(ProcessState::from_env(env).agent_store_prefix, "");
  // tandem launch: rank 0 hosts the store, whatever the environment says.
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  env["TANDEM_LAUNCHER"] = "1";
  EXPECT_EQ(ProcessState::from_env(env).agent_store_prefix, "");
}

TEST(ProcessState, TandemLauncher) {
  auto s = ProcessState::from_env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"},
                                   {"LOCAL_WORLD_SIZE", "2"}, {"TANDEM_LAUNCHER", "1"},
                                   {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(s.launcher, LauncherKind::kTandem);
  EXPECT_EQ(s.rank, 1);
}

TEST(ProcessState, KubernetesPyTorchJobHasNoLocalVariables) {
  // A PyTorchJob pod: one process per pod, RANK/WORLD_SIZE/MASTER_* only.
  auto s = ProcessState::from_env({{"RANK", "3"}, {"WORLD_SIZE", "4"},
                                   {"MASTER_ADDR", "job-master-0"}, {"MASTER_PORT", "23456"}});
  EXPECT_EQ(s.rank, 3);
  EXPECT_EQ(s.local_rank, 0);
  EXPECT_EQ(s.local_world_size, 1);
  EXPECT_EQ(s.master_addr, "job-master-0");
}

TEST(ProcessState, OpenMPI) {
  auto s = ProcessState::from_env(
      {{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
       {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(s.launcher, LauncherKind::kOpenMPI);
  EXPECT_EQ(s.rank, 3);
  EXPECT_EQ(s.world_size, 4);
  EXPECT_EQ(s.local_rank, 1);
  EXPECT_EQ(s.local_world_size, 2);
  EXPECT_EQ(s.node_rank, 1);
}

TEST(ProcessState, MPICH) {
  auto s = ProcessState::from_env({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}, {"MPI_LOCALRANKID", "2"},
                                   {"MPI_LOCALNRANKS", "3"}, {"MASTER_ADDR", "h"},
                                   {"MASTER_PORT", "1"}});
  EXPECT_EQ(s.launcher, LauncherKind::kMPICH);
  EXPECT_EQ(s.rank, 2);
  EXPECT_EQ(s.world_size, 3);
  EXPECT_EQ(s.local_rank, 2);
}

TEST(ProcessState, SlurmTakesMasterFromNodeList) {
  auto s = ProcessState::from_env({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"},
                                   {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "1"},
                                   {"SLURM_NTASKS_PER_NODE", "4(x2)"},
                                   {"SLURM_JOB_NODELIST", "gpu[07-08]"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(s.launcher, LauncherKind::kSlurm);
  EXPECT_EQ(s.rank, 5);
  EXPECT_EQ(s.world_size, 8);
  EXPECT_EQ(s.local_rank, 1);
  EXPECT_EQ(s.local_world_size, 4);
  EXPECT_EQ(s.node_rank, 1);
  EXPECT_EQ(s.master_addr, "gpu07");
}

TEST(ProcessState, MpiOrSlurmWithoutMasterNamesTheVariable) {
  auto e = error_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_NE(e.find("MASTER_ADDR and MASTER_PORT"), std::string::npos) << e;
  e = error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "a,b"}});
  EXPECT_NE(e.find("MASTER_PORT"), std::string::npos) << e;
  EXPECT_EQ(e.find("MASTER_ADDR"), std::string::npos) << e;  // derived from the node list
}

TEST(ProcessState, BadValuesNameVariableAndValue) {
  auto base = EnvMap{{"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}};
  auto with = [&](EnvMap extra) {
    for (auto& kv : base) extra.insert(kv);
    return error_of(extra);
  };
  auto e = with({{"RANK", "4"}, {"WORLD_SIZE", "4"}});
  EXPECT_NE(e.find("RANK=4"), std::string::npos) << e;
  e = with({{"RANK", "-1"}, {"WORLD_SIZE", "4"}});
  EXPECT_NE(e.find("RANK='-1'"), std::string::npos) << e;
  e = with({{"RANK", "0"}, {"WORLD_SIZE", "two"}});
  EXPECT_NE(e.find("WORLD_SIZE='two'"), std::string::npos) << e;
  e = with({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}});
  EXPECT_NE(e.find("LOCAL_RANK=2"), std::string::npos) << e;
  e = with({{"RANK", "0"}, {"WORLD_SIZE", "0"}});
  EXPECT_NE(e.find("WORLD_SIZE=0"), std::string::npos) << e;
  e = with({{"OMPI_COMM_WORLD_RANK", "x"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_NE(e.find("OMPI_COMM_WORLD_RANK='x'"), std::string::npos) << e;
  e = error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}});
  EXPECT_NE(e.find("MASTER_PORT=70000"), std::string::npos) << e;
  e = with({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "2"}});
  EXPECT_NE(e.find("SLURM_PROCID=3"), std::string::npos) << e;
}

TEST(SlurmNodeList, Expands) {
  using V = std::vector<std::string>;
  EXPECT_EQ(tandem::expand_slurm_nodelist("node1"), V({"node1"}));
  EXPECT_EQ(tandem::expand_slurm_nodelist("gpu[01-03,07],cpu5"),
            V({"gpu01", "gpu02", "gpu03", "gpu07", "cpu5"}));
  EXPECT_EQ(tandem::expand_slurm_nodelist("a[8-10]"), V({"a8", "a9", "a10"}));
  EXPECT_EQ(tandem::expand_slurm_nodelist("r[1-2]n[3,5]"), V({"r1n3", "r1n5", "r2n3", "r2n5"}));
  EXPECT_EQ(tandem::expand_slurm_nodelist("x-y[001-002].z,w"), V({"x-y001.z", "x-y002.z", "w"}));
}

TEST(SlurmNodeList, RejectsMalformed) {
  for (const char* bad : {"gpu[01-03", "gpu]", "gpu[]", "gpu[a-b]", "gpu[5-3]"}) {
    EXPECT_THROW(tandem::expand_slurm_nodelist(bad), std::invalid_argument) << bad;
  }
}

// Note [Preemption]: signal names as a cluster's documentation writes them, and a Watch that
// records the first signal instead of ending the process, then puts the handler back.
TEST(Preemption, SignalNamesAndTheWatch) {
  using tandem::preemption::signal_from_name;
  EXPECT_EQ(signal_from_name("USR1", "f"), SIGUSR1);
  EXPECT_EQ(signal_from_name("sigusr2", "f"), SIGUSR2);
  EXPECT_EQ(signal_from_name("15", "f"), SIGTERM);
  EXPECT_EQ(tandem::preemption::signal_name(SIGUSR1), "SIGUSR1");
  for (const char* bad : {"KILL", "STOP", "9", "", "USR3"}) {
    try {
      signal_from_name(bad, "--preemption_signal");
      ADD_FAILURE() << bad << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--preemption_signal=" + std::string(bad) +
                                           ": expected a signal a process can catch"),
                std::string::npos)
          << e.what();
    }
  }
  struct sigaction before {};
  ::sigaction(SIGUSR1, nullptr, &before);
  {
    tandem::preemption::Watch watch({SIGTERM, SIGUSR1});
    EXPECT_EQ(tandem::preemption::Watch::received(), 0);
    {
      tandem::preemption::Watch second({SIGTERM});  // shares the first one's record
      ::raise(SIGUSR1);
    }
    EXPECT_EQ(tandem::preemption::Watch::received(), SIGUSR1);
    ::raise(SIGTERM);  // a second one is ignored: the process lives on
    EXPECT_EQ(tandem::preemption::Watch::received(), SIGUSR1);
  }
  struct sigaction after {};
  ::sigaction(SIGUSR1, nullptr, &after);
  EXPECT_EQ(after.sa_handler, before.sa_handler);
}
