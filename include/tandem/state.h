// ProcessState: who this process is in the job (rank, world, node, master), read from whatever
// started it: tandem launch, torchrun / Kubernetes PyTorchJob, Open MPI, MPICH / Intel MPI, SLURM.
#pragma once

#include <c10/core/Device.h>

#include <map>
#include <string>
#include <vector>

namespace tandem {

/// Which launcher's variables described this process.
enum class LauncherKind { kNone, kTandem, kTorchrun, kOpenMPI, kMPICH, kSlurm };

/// Human-readable name of a launcher kind ("tandem", "torchrun", "Open MPI", ...).
std::string to_string(LauncherKind kind);

/// A snapshot of environment variables, so that parsing is a pure function (and testable).
using EnvMap = std::map<std::string, std::string>;

/// The current process's environment as an EnvMap.
EnvMap current_environment();

/// Rank, world size and rendezvous address of this process.
///
/// Example:
///   auto st = tandem::ProcessState::from_environment();
///   if (st.is_main_process()) std::cout << "world " << st.world_size << "\n";
struct ProcessState {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  LauncherKind launcher = LauncherKind::kNone;
  /// What the launcher tells this process about its transport and its failures (empty: unset):
  /// the file a collective that failed because of a peer writes "peer" into (TANDEM_ERROR_FILE;
  /// Note [Secondary failures]), the address Gloo listens on in a job of several machines
  /// (TANDEM_LOCAL_ADDR), and the network interface Gloo uses (GLOO_SOCKET_IFNAME, which wins).
  std::string error_file;
  /// Note [Heartbeat]: the file the Accelerator's heartbeat rewrites every heartbeat_interval_s
  /// seconds (TANDEM_HEARTBEAT_FILE, TANDEM_HEARTBEAT_INTERVAL_S; empty: no heartbeat).
  std::string heartbeat_file;
  double heartbeat_interval_s = 1.0;
  std::string local_addr;
  std::string socket_ifname;
  /// Note [Replica recovery]: under `tandem launch --fault_tolerant_replicas`, the store of the
  /// replicas' quorum ("host:port", TANDEM_REPLICA_STORE; empty: not a replica), the replicas
  /// the job starts with (TANDEM_REPLICAS) and the seconds a replica's sum or vote may take
  /// (TANDEM_REPLICA_TIMEOUT_S).
  std::string replica_store;
  int replicas = 0;
  double replica_timeout_s = 30;
  /// Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the agent already hosts the store at
  /// MASTER_ADDR:MASTER_PORT and every rank, rank 0 included, connects to it as a client, its
  /// keys under this prefix ("/worker/attempt_<TORCHELASTIC_RESTART_COUNT>", as PyTorch's
  /// env:// rendezvous does), so that a restarted worker group meets none of the last one's
  /// keys. Empty: rank 0 hosts the store.
  std::string agent_store_prefix;

  /// Reads the state from a given environment. Throws std::invalid_argument naming the
  /// variable and its value when a value is malformed or inconsistent.
  static ProcessState from_env(const EnvMap& env);
  /// Reads the state from this process's environment.
  static ProcessState from_environment();

  bool distributed() const { return world_size > 1; }
  bool is_main_process() const { return rank == 0; }
  bool is_local_main_process() const { return local_rank == 0; }
  /// "[rank r/w]", the prefix of every error message.
  std::string prefix() const;
};

/// Expands a SLURM node list in its compact form ("gpu[01-03,07],cpu5") into host names,
/// keeping zero padding. Throws std::invalid_argument on malformed input.
std::vector<std::string> expand_slurm_nodelist(const std::string& nodelist);

/// The device this process should use: CPU when `force_cpu`, when LibTorch has no CUDA or no GPU
/// is visible; otherwise cuda:<local rank> among the devices CUDA_VISIBLE_DEVICES leaves visible.
c10::Device select_device(const ProcessState& state, bool force_cpu);

}  // namespace tandem
