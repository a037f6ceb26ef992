// Programs started without `tandem launch`: the variables that srun, mpirun and a Kubernetes
// PyTorchJob set (as docs/launching.md shows them) are enough for a job of two ranks; torchrun
// runs a tandem program directly when it is installed.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "../common/subprocess.h"

using tandem::testing::count_of;
using tandem::testing::free_port;
using tandem::testing::run_command;
using tandem::testing::RunResult;

namespace {

const std::string kWorker = COLLECTIVES_WORKER;
using Env = std::map<std::string, std::string>;

// Starts the worker once per rank with the environment `env_of(rank)` and checks both ranks.
void run_ranks(const std::function<Env(int)>& env_of) {
  std::vector<RunResult> results(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      Env env = env_of(r);
      env["TANDEM_TEST_TIMEOUT_S"] = "20";
      results[static_cast<size_t>(r)] = run_command({kWorker, "all"}, env, 60);
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) {
    const auto& res = results[static_cast<size_t>(r)];
    ASSERT_FALSE(res.timed_out) << res.output;
    EXPECT_EQ(res.exit_code, 0) << res.output;
    EXPECT_NE(res.output.find("collectives OK on rank " + std::to_string(r) + " of 2"),
              std::string::npos)
        << res.output;
  }
}

}  // namespace

TEST(ExternalLaunchers, SlurmSrunVariables) {
  const std::string port = std::to_string(free_port());
  run_ranks([&](int r) {
    return Env{{"SLURM_PROCID", std::to_string(r)},
               {"SLURM_NTASKS", "2"},
               {"SLURM_LOCALID", std::to_string(r)},
               {"SLURM_NTASKS_PER_NODE", "2"},
               {"SLURM_NODEID", "0"},
               {"SLURM_JOB_NODELIST", "localhost"},
               {"MASTER_PORT", port}};  // MASTER_ADDR: the first host of the node list
  });
}

TEST(ExternalLaunchers, OpenMpiMpirunVariables) {
  const std::string port = std::to_string(free_port());
  run_ranks([&](int r) {
    return Env{{"OMPI_COMM_WORLD_RANK", std::to_string(r)},
               {"OMPI_COMM_WORLD_SIZE", "2"},
               {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r)},
               {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
               {"MASTER_ADDR", "127.0.0.1"},
               {"MASTER_PORT", port}};
  });
}

TEST(ExternalLaunchers, KubernetesPyTorchJobVariables) {
  // One process per pod: the operator sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT only.
  const std::string port = std::to_string(free_port());
  run_ranks([&](int r) {
    return Env{{"RANK", std::to_string(r)},
               {"WORLD_SIZE", "2"},
               {"MASTER_ADDR", "127.0.0.1"},
               {"MASTER_PORT", port}};
  });
}

TEST(ExternalLaunchers, Torchrun) {
  // The test environment's torchrun (beside TANDEM_PYTHON, PyTorch 2.x) must run; without one,
  // torchrun on PATH where it works (Debian 12's, PyTorch 1.13 on Python 3.11, fails before
  // starting any worker).
  std::string torchrun = "torchrun";
  const std::string configured = TANDEM_TEST_PYTHON;
  if (!configured.empty()) {
    torchrun = (std::filesystem::path(configured).parent_path() / "torchrun").string();
    ASSERT_EQ(access(torchrun.c_str(), X_OK), 0)
        << torchrun << " is missing: the environment of scripts/install-torch2.sh has torchrun";
  } else {
    if (system("command -v torchrun >/dev/null 2>&1") != 0)
      GTEST_SKIP() << "torchrun is not installed (configure with -DTANDEM_PYTHON=...)";
    auto probe = run_command(
        {torchrun, "--standalone", "--nproc_per_node", "1", "--no_python", "true"}, {}, 60);
    if (probe.exit_code != 0)
      GTEST_SKIP() << "torchrun does not run on this machine (it fails on `true` too): "
                   << probe.output.substr(probe.output.size() > 300 ? probe.output.size() - 300
                                                                    : 0);
  }
  auto r = run_command(
      {torchrun, "--standalone", "--nproc_per_node", "2", "--no_python", kWorker, "all"},
      {{"TANDEM_TEST_TIMEOUT_S", "20"}, {"PYTHONNOUSERSITE", "1"}}, 120);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "collectives OK"), 2) << r.output;
}
