// Reading the process's place in the job from the environment of each supported launcher.
#include "tandem/state.h"
#include "tandem/error.h"
#include "tandem/config/run_env.h"


#include <cctype>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <stdexcept>

#include <unistd.h>  // environ

namespace tandem {
namespace {

std::optional<std::string> get(const EnvMap& env, const std::string& key) {
  auto it = env.find(key);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

// Parses a non-negative integer; the error names the variable and the value.
// A number of seconds above 0 in variable `name`; `origin` says where it comes from.
double parse_seconds(const std::string& name, const std::string& value, const char* origin) {
  double seconds = 0;
  try {
    size_t pos = 0;
    seconds = std::stod(value, &pos);
    if (pos != value.size()) seconds = 0;
  } catch (const std::exception&) {
    seconds = 0;
  }
  if (!(seconds > 0))
    throw ::tandem::Refused(name + "='" + value + "' is not a number of seconds above 0 (" +
                            origin + ")");
  return seconds;
}

int parse_int(const std::string& name, const std::string& value) {
  size_t pos = 0;
  long v = 0;
  bool ok = !value.empty();
  for (char c : value) ok = ok && std::isdigit(static_cast<unsigned char>(c));
  if (ok) {
    try {
      v = std::stol(value, &pos);
    } catch (const std::exception&) {
      ok = false;
    }
  }
  if (!ok || pos != value.size() || v > 1000000000L) {
    throw ::tandem::Refused(name + "='" + value +
                                "' is not a valid non-negative integer; set " + name +
                                " to a number such as 0 or 4");
  }
  return static_cast<int>(v);
}

int int_or(const EnvMap& env, const std::string& key, int fallback) {
  auto v = get(env, key);
  return v ? parse_int(key, *v) : fallback;
}

struct Names {
  const char* rank;
  const char* world;
  const char* local_rank;
  const char* local_world;
  const char* node;
};

void check_consistent(const ProcessState& s, const Names& n) {
  auto fail = [](const std::string& msg) { throw ::tandem::Refused(msg); };
  if (s.world_size < 1)
    fail(std::string(n.world) + "=" + std::to_string(s.world_size) + " must be at least 1");
  if (s.rank >= s.world_size)
    fail(std::string(n.rank) + "=" + std::to_string(s.rank) + " is not below " + n.world + "=" +
         std::to_string(s.world_size) + "; ranks run from 0 to world size - 1");
  if (s.local_world_size < 1)
    fail(std::string(n.local_world) + "=" + std::to_string(s.local_world_size) +
         " must be at least 1");
  if (s.local_rank >= s.local_world_size)
    fail(std::string(n.local_rank) + "=" + std::to_string(s.local_rank) + " is not below " +
         n.local_world + "=" + std::to_string(s.local_world_size));
  if (s.local_world_size > s.world_size)
    fail(std::string(n.local_world) + "=" + std::to_string(s.local_world_size) +
         " is larger than " + n.world + "=" + std::to_string(s.world_size));
}

void read_master(ProcessState& s, const EnvMap& env, const std::string& how,
                 std::optional<std::string> fallback_addr) {
  auto addr = get(env, "MASTER_ADDR");
  auto port = get(env, "MASTER_PORT");
  if (!addr) addr = fallback_addr;
  if (s.world_size > 1 && (!addr || !port)) {
    std::string missing = !addr && !port ? "MASTER_ADDR and MASTER_PORT"
                                         : (!addr ? "MASTER_ADDR" : "MASTER_PORT");
    throw ::tandem::Refused(
        "started by " + how + " with " + std::to_string(s.world_size) +
        " processes but " + missing + " is not set: export " + missing +
        " (the address of the host of rank 0 and a free TCP port on it, e.g. MASTER_PORT=29500) "
        "in the job script so that every rank can meet at rank 0");
  }
  if (addr) s.master_addr = *addr;
  if (port) {
    s.master_port = parse_int("MASTER_PORT", *port);
    if (s.master_port < 1 || s.master_port > 65535)
      throw ::tandem::Refused("MASTER_PORT=" + *port + " is not a TCP port (1-65535)");
  }
}

}  // namespace

std::string to_string(LauncherKind kind) {
  switch (kind) {
    case LauncherKind::kNone: return "none";
    case LauncherKind::kTandem: return "tandem";
    case LauncherKind::kTorchrun: return "torchrun";
    case LauncherKind::kOpenMPI: return "Open MPI";
    case LauncherKind::kMPICH: return "MPICH";
    case LauncherKind::kSlurm: return "SLURM";
  }
  return "unknown";
}

EnvMap current_environment() {
  EnvMap env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

namespace {

ProcessState from_launcher_env(const EnvMap& env);

}  // namespace

ProcessState ProcessState::from_env(const EnvMap& env) {
  ProcessState s = from_launcher_env(env);
  // Note [The environment is read in one place]: the process's own facts, whatever launched it.
  if (auto v = get(env, config::var::kErrorFile)) s.error_file = *v;
  if (auto v = get(env, config::var::kHeartbeatFile)) s.heartbeat_file = *v;
  if (auto v = get(env, config::var::kHeartbeatIntervalS))
    s.heartbeat_interval_s = parse_seconds(config::var::kHeartbeatIntervalS, *v,
                                           "the launcher sets it from --heartbeat_timeout_s; "
                                           "leave it unset");
  if (auto v = get(env, config::var::kLocalAddr)) s.local_addr = *v;
  if (auto v = get(env, "GLOO_SOCKET_IFNAME")) s.socket_ifname = *v;
  if (auto v = get(env, config::var::kReplicaStore)) {
    const auto colon = v->rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == v->size())
      throw ::tandem::Refused(std::string(config::var::kReplicaStore) + "='" + *v +
                              "' is not host:port (tandem launch --fault_tolerant_replicas sets "
                              "it; leave it unset)");
    parse_int(config::var::kReplicaStore, v->substr(colon + 1));
    s.replica_store = *v;
    const auto n = get(env, config::var::kReplicas);
    s.replicas = n ? parse_int(config::var::kReplicas, *n) : 0;
    if (s.replicas < 1)
      throw ::tandem::Refused(std::string(config::var::kReplicas) + " must be at least 1 beside " +
                              config::var::kReplicaStore + " (tandem launch sets both)");
  }
  if (auto v = get(env, config::var::kReplicaTimeoutS))
    s.replica_timeout_s =
        parse_seconds(config::var::kReplicaTimeoutS, *v, "tandem launch --replica_timeout_s");
  if (s.launcher == LauncherKind::kTorchrun) {
    if (auto v = get(env, "TORCHELASTIC_USE_AGENT_STORE"); v && *v == "True") {
      const auto attempt = get(env, "TORCHELASTIC_RESTART_COUNT");
      s.agent_store_prefix =
          "/worker/attempt_" +
          std::to_string(attempt ? parse_int("TORCHELASTIC_RESTART_COUNT", *attempt) : 0);
    }
  }
  return s;
}

namespace {

ProcessState from_launcher_env(const EnvMap& env) {
  ProcessState s;
  if (get(env, "RANK") || get(env, "WORLD_SIZE")) {
    // tandem launch, torchrun and Kubernetes PyTorchJob all speak torchrun's variables.
    s.launcher = get(env, config::var::kLauncher) ? LauncherKind::kTandem : LauncherKind::kTorchrun;
    Names n{"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"};
    if (!get(env, "WORLD_SIZE"))
      throw ::tandem::Refused("RANK is set but WORLD_SIZE is not: set WORLD_SIZE too");
    s.world_size = parse_int("WORLD_SIZE", *get(env, "WORLD_SIZE"));
    s.rank = int_or(env, "RANK", 0);
    s.local_rank = int_or(env, "LOCAL_RANK", s.rank);
    // A PyTorchJob sets no LOCAL_WORLD_SIZE: then each pod is one process.
    s.local_world_size = int_or(env, "LOCAL_WORLD_SIZE", get(env, "LOCAL_RANK") ? s.world_size : 1);
    if (!get(env, "LOCAL_WORLD_SIZE") && !get(env, "LOCAL_RANK")) s.local_rank = 0;
    s.node_rank = int_or(env, "GROUP_RANK", int_or(env, "NODE_RANK", 0));
    check_consistent(s, n);
    read_master(s, env, to_string(s.launcher), std::nullopt);
    return s;
  }
  if (get(env, "OMPI_COMM_WORLD_RANK") || get(env, "OMPI_COMM_WORLD_SIZE")) {
    s.launcher = LauncherKind::kOpenMPI;
    Names n{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK"};
    s.rank = int_or(env, n.rank, 0);
    s.world_size = int_or(env, n.world, 1);
    s.local_rank = int_or(env, n.local_rank, 0);
    s.local_world_size = int_or(env, n.local_world, 1);
    s.node_rank = int_or(env, n.node, s.local_world_size > 0 ? s.rank / s.local_world_size : 0);
    check_consistent(s, n);
    read_master(s, env, "mpirun (Open MPI)", std::nullopt);
    return s;
  }
  if (get(env, "PMI_RANK") || get(env, "PMI_SIZE")) {
    s.launcher = LauncherKind::kMPICH;
    Names n{"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMI_NODE_RANK"};
    s.rank = int_or(env, n.rank, 0);
    s.world_size = int_or(env, n.world, 1);
    s.local_rank = int_or(env, n.local_rank, 0);
    s.local_world_size = int_or(env, n.local_world, get(env, n.local_rank) ? s.world_size : 1);
    s.node_rank = 0;
    check_consistent(s, n);
    read_master(s, env, "mpirun (MPICH / Intel MPI)", std::nullopt);
    return s;
  }
  if (get(env, "SLURM_PROCID") && get(env, "SLURM_NTASKS")) {
    s.launcher = LauncherKind::kSlurm;
    Names n{"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
            "SLURM_NODEID"};
    s.rank = int_or(env, n.rank, 0);
    s.world_size = int_or(env, n.world, 1);
    s.local_rank = int_or(env, n.local_rank, 0);
    // SLURM_NTASKS_PER_NODE may read "4" or "4(x2)"; the per-node count is what precedes '('.
    if (auto per_node = get(env, "SLURM_NTASKS_PER_NODE")) {
      s.local_world_size = parse_int(n.local_world, per_node->substr(0, per_node->find('(')));
    } else if (auto nnodes = get(env, "SLURM_NNODES")) {
      int nodes = std::max(1, parse_int("SLURM_NNODES", *nnodes));
      s.local_world_size = (s.world_size + nodes - 1) / nodes;
    } else {
      s.local_world_size = s.world_size;
    }
    s.node_rank = int_or(env, n.node, 0);
    check_consistent(s, n);
    std::optional<std::string> first_host;
    if (auto list = get(env, "SLURM_JOB_NODELIST")) {
      auto hosts = expand_slurm_nodelist(*list);
      if (!hosts.empty()) first_host = hosts.front();
    } else if (auto list2 = get(env, "SLURM_NODELIST")) {
      auto hosts = expand_slurm_nodelist(*list2);
      if (!hosts.empty()) first_host = hosts.front();
    }
    read_master(s, env, "SLURM (srun)", first_host);
    return s;
  }
  return s;  // not launched: one process
}

}  // namespace

ProcessState ProcessState::from_environment() { return from_env(current_environment()); }

std::string ProcessState::prefix() const {
  return "[rank " + std::to_string(rank) + "/" + std::to_string(world_size) + "]";
}

// SLURM's compact host list: comma-separated items, each a prefix with optional bracketed
// ranges ("gpu[01-03,07]"), possibly followed by a suffix and further bracket groups.
std::vector<std::string> expand_slurm_nodelist(const std::string& nodelist) {
  auto bad = [&](const std::string& why) {
    return ::tandem::Refused("SLURM_JOB_NODELIST='" + nodelist + "' is malformed: " + why);
  };
  // Split at top-level commas (not inside brackets).
  std::vector<std::string> items;
  std::string cur;
  int depth = 0;
  for (char c : nodelist) {
    if (c == '[') ++depth;
    if (c == ']') {
      if (--depth < 0) throw bad("unbalanced ']'");
    }
    if (c == ',' && depth == 0) {
      if (!cur.empty()) items.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (depth != 0) throw bad("unbalanced '['");
  if (!cur.empty()) items.push_back(cur);

  std::vector<std::string> hosts;
  for (const auto& item : items) {
    std::vector<std::string> partial{""};
    size_t i = 0;
    while (i < item.size()) {
      if (item[i] != '[') {
        size_t j = item.find('[', i);
        std::string lit = item.substr(i, j == std::string::npos ? std::string::npos : j - i);
        for (auto& p : partial) p += lit;
        i = j == std::string::npos ? item.size() : j;
        continue;
      }
      size_t close = item.find(']', i);
      std::string ranges = item.substr(i + 1, close - i - 1);
      if (ranges.empty()) throw bad("empty brackets");
      std::vector<std::string> expanded;
      std::stringstream ss(ranges);
      std::string r;
      while (std::getline(ss, r, ',')) {
        auto dash = r.find('-');
        std::string lo = r.substr(0, dash);
        std::string hi = dash == std::string::npos ? lo : r.substr(dash + 1);
        auto digits = [](const std::string& x) {
          if (x.empty() || x.size() > 9) return false;
          for (char c : x)
            if (!std::isdigit(static_cast<unsigned char>(c))) return false;
          return true;
        };
        if (!digits(lo) || !digits(hi)) throw bad("range '" + r + "' is not numeric");
        long a = std::stol(lo), b = std::stol(hi);
        if (b < a) throw bad("range '" + r + "' runs backwards");
        if (b - a > 100000) throw bad("range '" + r + "' is too large");
        size_t width = lo.size();
        for (long v = a; v <= b; ++v) {
          std::string num = std::to_string(v);
          if (num.size() < width) num = std::string(width - num.size(), '0') + num;
          expanded.push_back(num);
        }
      }
      std::vector<std::string> next;
      for (const auto& p : partial)
        for (const auto& e : expanded) next.push_back(p + e);
      partial.swap(next);
      i = close + 1;
    }
    for (auto& p : partial) hosts.push_back(p);
  }
  return hosts;
}

}  // namespace tandem
