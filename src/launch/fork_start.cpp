// Note [Fork start] (fork_start.h): the spec the launcher hands the fork server, the checks on
// the program, and the server itself: libtandem's initializer, which forks the ranks.
#include "fork_start.h"

#include <dirent.h>
#include <elf.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "../detail/write_all.h"
#include "tandem/config/run_env.h"

namespace tandem::launch::fork_start {
namespace {

using tandem::detail::write_all;

void put_u32(std::string& out, uint32_t v) {
  out.append(reinterpret_cast<const char*>(&v), 4);
}

void put_text(std::string& out, const std::string& s) {
  put_u32(out, static_cast<uint32_t>(s.size()));
  out += s;
}

struct Reader {
  const std::string& bytes;
  size_t at = 0;
  bool ok = true;
  uint32_t u32() {
    uint32_t v = 0;
    if (at + 4 > bytes.size()) {
      ok = false;
      return 0;
    }
    std::memcpy(&v, bytes.data() + at, 4);
    at += 4;
    return v;
  }
  int i32() { return static_cast<int>(u32()); }
  std::string text() {
    const uint32_t n = u32();
    if (!ok || at + n > bytes.size()) {
      ok = false;
      return "";
    }
    std::string s = bytes.substr(at, n);
    at += n;
    return s;
  }
};

constexpr uint32_t kMagic = 0x544b4631;  // "TKF1": the spec's format

bool read_at(int fd, void* buf, size_t n, off_t off) {
  return ::pread(fd, buf, n, off) == static_cast<ssize_t>(n);
}

// The libraries `file` names as DT_NEEDED, or why they cannot be read.
std::string needed_libraries(const std::string& file, std::vector<std::string>& needed) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "cannot be read: " + std::string(std::strerror(errno));
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } close_fd{fd};
  Elf64_Ehdr eh{};
  if (!read_at(fd, &eh, sizeof eh, 0) || std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0)
    return "is not an executable (no ELF header)";
  if (eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_shentsize != sizeof(Elf64_Shdr))
    return "is not a 64-bit ELF executable";
  std::vector<Elf64_Shdr> sections(eh.e_shnum);
  if (sections.empty() || !read_at(fd, sections.data(), sections.size() * sizeof(Elf64_Shdr),
                                   static_cast<off_t>(eh.e_shoff)))
    return "has no section headers to read its libraries from";
  for (const auto& s : sections) {
    if (s.sh_type != SHT_DYNAMIC || s.sh_link >= sections.size()) continue;
    const auto& strtab = sections[s.sh_link];
    std::vector<Elf64_Dyn> dyn(s.sh_size / sizeof(Elf64_Dyn));
    std::string names(strtab.sh_size, '\0');
    if (!read_at(fd, dyn.data(), dyn.size() * sizeof(Elf64_Dyn), static_cast<off_t>(s.sh_offset)) ||
        !read_at(fd, names.data(), names.size(), static_cast<off_t>(strtab.sh_offset)))
      return "has a dynamic section that cannot be read";
    for (const auto& d : dyn)
      if (d.d_tag == DT_NEEDED && d.d_un.d_val < names.size())
        needed.emplace_back(names.c_str() + d.d_un.d_val);
    return "";
  }
  return "is statically linked";
}

[[noreturn]] void fail(int result_fd, const std::string& why) {
  write_all(result_fd, "error " + why + "\n");
  ::_exit(3);
}

// In the rank just forked: wait to be the launcher's child, take what exec would have given.
void become_rank(const Spec& spec, size_t index, int alive[2], int result_fd) {
  ::close(alive[1]);
  ::close(result_fd);
  // The server keeps the write end until it exits; then the kernel hands its children to the
  // launcher, the nearest child subreaper (a moment after the pipe closes: poll for it).
  char byte = 0;
  while (::read(alive[0], &byte, 1) < 0 && errno == EINTR) {
  }
  ::close(alive[0]);
  const auto launcher = static_cast<pid_t>(spec.launcher_pid);
  for (int i = 0; i < 10000 && ::getppid() != launcher; ++i) ::usleep(500);
  const Rank& me = spec.ranks[index];
  auto die = [&](const std::string& why) {
    write_all(me.err_fd,
              "tandem launch: rank " + std::to_string(me.rank) + " (fork start): " + why + "\n");
    ::_exit(126);
  };
  if (::getppid() != launcher)
    die("the launcher (pid " + std::to_string(launcher) +
        ") is not this process's parent after "
        "the fork server exited; is it still running?");
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(1);  // the launcher died in between
  if (!me.cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int cpu : me.cpus) CPU_SET(cpu, &set);
    if (::sched_setaffinity(0, sizeof(set), &set) != 0)
      die("cannot bind to its cores: " + std::string(std::strerror(errno)));
  }
  ::dup2(me.out_fd, 1);
  ::dup2(me.err_fd, 2);
  for (const Rank& r : spec.ranks)
    for (int fd : {r.out_fd, r.err_fd})
      if (fd > 2) ::close(fd);
  // setenv copies into storage the C library keeps track of (a putenv'd string would leak once
  // the program sets that variable again).
  ::clearenv();
  for (const auto& e : me.env) {
    const auto eq = e.find('=');
    if (eq != std::string::npos && eq > 0) ::setenv(e.substr(0, eq).c_str(), e.c_str() + eq + 1, 1);
  }
}

// The fork server, in the process the launcher started with TANDEM_FORK_SERVER. Returns in each
// rank; the server itself exits.
void serve(const char* value) {
  int spec_fd = -1, result_fd = -1;
  if (std::sscanf(value, "%d,%d", &spec_fd, &result_fd) != 2 || spec_fd < 0 || result_fd < 0) {
    std::fprintf(stderr,
                 "tandem: %s=%s: expected <spec fd>,<result fd>, as tandem launch "
                 "--start_method fork sets it\n",
                 kServerVar, value);
    ::_exit(3);
  }
  std::string bytes;
  char buf[65536];
  for (off_t off = 0;;) {
    const ssize_t n = ::pread(spec_fd, buf, sizeof buf, off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    bytes.append(buf, static_cast<size_t>(n));
    off += n;
  }
  ::close(spec_fd);
  const auto spec = decode(bytes);
  if (!spec || spec->ranks.empty()) fail(result_fd, "the launcher's spec could not be read");
  const int threads = process_threads();
  if (threads > 1)
    fail(result_fd, "the program runs " + std::to_string(threads) +
                        " threads before main() (a library it loads starts them), and a forked "
                        "process keeps only one");
  if (cuda_loaded())
    fail(result_fd,
         "the program initialized CUDA before main(), which a forked process cannot "
         "use");
  int alive[2];
  if (::pipe(alive) != 0) fail(result_fd, std::string("pipe() failed: ") + std::strerror(errno));
  std::vector<pid_t> started;
  for (size_t i = 0; i < spec->ranks.size(); ++i) {
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      become_rank(*spec, i, alive, result_fd);
      return;
    }
    if (pid < 0) {
      const int err = errno;
      for (pid_t p : started) ::kill(p, SIGKILL);
      fail(result_fd, "fork() of rank " + std::to_string(spec->ranks[i].rank) +
                          " failed: " + std::strerror(err));
    }
    started.push_back(pid);
    write_all(result_fd, "pid " + std::to_string(i) + " " + std::to_string(pid) + "\n");
  }
  ::_exit(0);
}

__attribute__((constructor)) void tandem_fork_server() {
  if (const char* value = std::getenv(kServerVar)) serve(value);
}

}  // namespace

std::string encode(const Spec& spec) {
  std::string out;
  put_u32(out, kMagic);
  put_u32(out, static_cast<uint32_t>(spec.launcher_pid));
  put_u32(out, static_cast<uint32_t>(spec.ranks.size()));
  for (const auto& r : spec.ranks) {
    put_u32(out, static_cast<uint32_t>(r.rank));
    put_u32(out, static_cast<uint32_t>(r.out_fd));
    put_u32(out, static_cast<uint32_t>(r.err_fd));
    put_u32(out, static_cast<uint32_t>(r.cpus.size()));
    for (int c : r.cpus) put_u32(out, static_cast<uint32_t>(c));
    put_u32(out, static_cast<uint32_t>(r.env.size()));
    for (const auto& e : r.env) put_text(out, e);
  }
  return out;
}

std::optional<Spec> decode(const std::string& bytes) {
  Reader in{bytes};
  if (in.u32() != kMagic || !in.ok) return std::nullopt;
  Spec spec;
  spec.launcher_pid = in.i32();
  const uint32_t n = in.u32();
  for (uint32_t i = 0; in.ok && i < n; ++i) {
    Rank r;
    r.rank = in.i32();
    r.out_fd = in.i32();
    r.err_fd = in.i32();
    const uint32_t cpus = in.u32();
    for (uint32_t k = 0; in.ok && k < cpus; ++k) r.cpus.push_back(in.i32());
    const uint32_t env = in.u32();
    for (uint32_t k = 0; in.ok && k < env; ++k) r.env.push_back(in.text());
    spec.ranks.push_back(std::move(r));
  }
  if (!in.ok || in.at != bytes.size()) return std::nullopt;
  return spec;
}

bool may_differ(const std::string& key) {
  return key == "RANK" || key == "LOCAL_RANK" || key == config::var::kErrorFile ||
         key == config::var::kHeartbeatFile || key == config::var::kCpuAffinity ||
         key == "CUDA_VISIBLE_DEVICES";
}

std::string unsupported_program(const std::string& program, const std::string& path) {
  std::string file = program;
  if (program.find('/') == std::string::npos) {
    file.clear();
    size_t start = 0;
    while (file.empty() && start <= path.size()) {
      size_t end = path.find(':', start);
      if (end == std::string::npos) end = path.size();
      const std::string dir = end > start ? path.substr(start, end - start) : ".";
      const std::string cand = dir + "/" + program;
      struct stat st {};
      if (::stat(cand.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
          ::access(cand.c_str(), X_OK) == 0)
        file = cand;
      start = end + 1;
    }
    if (file.empty()) return "'" + program + "' is not on PATH";
  }
  std::ifstream in(file, std::ios::binary);
  char head[2] = {0, 0};
  if (in.read(head, 2) && head[0] == '#' && head[1] == '!')
    return file +
           " is a script, and only an executable that links libtandem starts its ranks "
           "itself";
  std::vector<std::string> needed;
  if (auto why = needed_libraries(file, needed); !why.empty()) return file + " " + why;
  for (const auto& lib : needed)
    if (lib.rfind("libtandem.so", 0) == 0) return "";
  return file + " does not link libtandem, whose initializer starts the ranks";
}

int process_threads() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/task")) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') ++n;
    ::closedir(d);
  }
  return std::max(n, 1);
}

// The CUDA driver library is loaded on first use of the CUDA runtime, never by merely linking
// LibTorch: its presence in our mappings means CUDA was initialized. Asking the runtime instead
// (torch::cuda::is_available) would itself initialize it.
bool cuda_loaded() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find("/libcuda.so") != std::string::npos) return true;
  return false;
}

}  // namespace tandem::launch::fork_start
