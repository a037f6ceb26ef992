// Rendezvous through c10d's TCPStore and the Gloo (and NCCL) process groups built on it.
#include "tandem/comm/process_group.h"
#include "tandem/error.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "detail/process_group_impl.h"
#include "tandem/comm/flight_recorder.h"

namespace tandem {
namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean: return c10d::ReduceOp::SUM;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// Tells the launcher why this rank failed: one line into TANDEM_ERROR_FILE (`file`; empty: not
// launched by tandem launch). Note [Secondary failures], Note [Free ports].
void tell_launcher(const std::string& file, const std::string& line) {
  if (file.empty()) return;
  if (FILE* f = std::fopen(file.c_str(), "w")) {
    std::fprintf(f, "%s\n", line.c_str());
    std::fclose(f);
  }
}

// Note [Secondary failures]: Gloo writes to its sockets with writev(), which raises SIGPIPE
// when a peer has gone; left at its default that signal kills this rank before its collective
// can say why (and the launcher would name it instead of the rank that failed first). Ignored,
// as Python ignores it under torch.distributed, the write fails with EPIPE and the collective
// reports the lost peer. A handler the program installed is left alone.
// A child the program forks (system(), popen()) gets the default back, as Python's
// subprocess restores it.
void ignore_sigpipe() {
  struct sigaction pipe_action {};
  if (::sigaction(SIGPIPE, nullptr, &pipe_action) == 0 && pipe_action.sa_handler == SIG_DFL) {
    ::signal(SIGPIPE, SIG_IGN);
    static std::once_flag at_fork;
    std::call_once(at_fork, [] {
      ::pthread_atfork(nullptr, nullptr, [] {
        struct sigaction now {};
        if (::sigaction(SIGPIPE, nullptr, &now) == 0 && now.sa_handler == SIG_IGN)
          ::signal(SIGPIPE, SIG_DFL);
      });
    });
  }
}

std::string first_line(const std::string& s) {
  auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

// Gloo needs a device (an address to listen on) for each rank: the interface GLOO_SOCKET_IFNAME
// names; on a single machine the loopback address; else TANDEM_LOCAL_ADDR, else the address of
// this host's name (all read into ProcessState).
std::shared_ptr<::gloo::transport::Device> make_gloo_device(const ProcessState& st) {
  if (!st.socket_ifname.empty())
    return c10d::ProcessGroupGloo::createDeviceForInterface(st.socket_ifname);
  if (is_loopback(st.master_addr))
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  if (!st.local_addr.empty())
    return c10d::ProcessGroupGloo::createDeviceForHostname(st.local_addr);
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

c10::intrusive_ptr<compat::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int size,
                                              const std::shared_ptr<::gloo::transport::Device>& dev,
                                              const ProcessGroupOptions& o) {
  auto opts = c10d::ProcessGroupGloo::Options::create(o.timeout());
  opts->devices.push_back(dev);
  opts->threads = o.gloo_threads();
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  // Note [Connected on every rank]: Gloo's full mesh is connected on this rank once its own ends
  // of the pairs are; a peer may still be finishing its handshake with a third rank. A rank
  // that went on and exited at once (a program with no collective) closed a socket that peer
  // still read: "Connection closed by peer" on a healthy job. As torch.distributed's store-based
  // barrier after init, no rank returns before every rank's mesh is connected.
  store->add("connected", 1);
  const auto deadline = std::chrono::steady_clock::now() + o.timeout();
  for (int64_t n = 0; (n = store->add("connected", 0)) < size;) {
    if (std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error("the Gloo mesh was connected on " + std::to_string(n) + " of " +
                               std::to_string(size) + " ranks within the timeout");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return gloo;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Work

void Work::wait() {
  if (!impl_ || impl_->done) return;
  try {
    impl_->work->wait();
    for (auto& part : impl_->more) part->wait();
  } catch (const std::exception& e) {
    impl_->done = true;
    if (impl_->failures_expected) {
      comm::FlightRecorder::instance().end(impl_->flight, false);
      throw std::runtime_error(impl_->what + " failed: " + first_line(e.what()));
    }
    // Note [Flight recorder]: the ring as it stands when a collective fails (a timeout, a peer
    // gone), for tandem doctor.
    auto& recorder = comm::FlightRecorder::instance();
    recorder.end(impl_->flight, false);
    const auto dumped = recorder.dump(impl_->what + " failed: " + first_line(e.what()));
    // Note [Secondary failures]: tell the launcher this rank failed because of a peer.
    tell_launcher(impl_->error_file, "peer " + impl_->what);
    throw std::runtime_error(impl_->prefix + " " + impl_->what + " failed: " + first_line(e.what()) +
                             ". Another rank probably exited or stopped responding; the launcher's "
                             "output names the rank that failed first." +
                             (dumped.empty() ? std::string()
                                             : " Flight record: " + dumped +
                                                   " (tandem doctor " +
                                                   dumped.substr(0, dumped.rfind('/')) + ")."));
  }
  comm::FlightRecorder::instance().end(impl_->flight, true);
  if (impl_->divide_by != 1.0)
    for (auto& t : impl_->tensors) t.div_(impl_->divide_by);
  impl_->done = true;
  if (impl_->then) {
    auto then = std::move(impl_->then);
    impl_->then = nullptr;
    then();
  }
}

Work::Impl::~Impl() {
  if (!done) comm::FlightRecorder::instance().drop(flight);
}

bool Work::completed() const {
  if (!impl_ || impl_->done) return true;
  if (!impl_->work->isCompleted()) return false;
  return std::all_of(impl_->more.begin(), impl_->more.end(),
                     [](const auto& part) { return part->isCompleted(); });
}

// ---------------------------------------------------------------------------------------------
// ProcessGroup::Impl

compat::Backend& ProcessGroup::Impl::backend_for(const at::Tensor& t) {
  if (t.is_cuda()) {
#if defined(TANDEM_WITH_NCCL)
    if (!nccl) nccl = make_nccl_backend(store, rank, size, options.timeout());
    return *nccl;
#else
    throw std::runtime_error(prefix() + " a CUDA tensor was given to a collective, but this "
                             "LibTorch has no NCCL: move it to the CPU or use a CUDA LibTorch");
#endif
  }
  if (options.backend() == "nccl")
    throw std::runtime_error(prefix() + " a CPU tensor was given to an NCCL-only process group: "
                             "use backend \"auto\" so that CPU tensors go through Gloo");
  return *gloo;
}

Work ProcessGroup::Impl::issue(std::string what, std::vector<at::Tensor> out, double divide_by,
                               const at::Tensor& described, const Start& start) {
  auto w = std::make_shared<Work::Impl>();
  const at::Tensor& d = described.defined() ? described : out.empty() ? described : out.front();
  // Note [Flight recorder]: recorded before it is issued. Gloo runs the operation on its own
  // threads, and a peer's mismatched message aborts the process from there (an enforce in
  // pair.cc) before start() has returned: the record must already hold it then.
  auto& recorder = comm::FlightRecorder::instance();
  w->flight = recorder.begin(flight_group(), what, d.defined() ? d.numel() : 0,
                             d.defined() ? std::string(c10::toString(d.scalar_type()))
                                         : std::string("-"));
  std::vector<c10::intrusive_ptr<compat::Work>> works;
  try {
    works = start();
  } catch (...) {
    recorder.end(w->flight, false);
    throw;
  }
  TANDEM_CHECK(!works.empty(), prefix(), " ", what, ": nothing was issued");
  w->work = works.front();
  w->more.assign(works.begin() + 1, works.end());
  w->what = std::move(what);
  w->prefix = prefix();
  w->error_file = state.error_file;
  w->failures_expected = failures_expected;
  w->tensors = std::move(out);
  w->divide_by = divide_by;
  return Work(std::move(w));
}

std::string ProcessGroup::Impl::prefix() const { return state.prefix(); }

// ---------------------------------------------------------------------------------------------
// ProcessGroup

// Live groups of more than one rank, so that tandem::launch::launch can refuse to fork them.
static std::atomic<int> g_live_process_groups{0};

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  if (impl_->size > 1) ++g_live_process_groups;
  if (impl_->size > 1)
    comm::FlightRecorder::instance().add_group(impl_->flight_group(), impl_->global_ranks);
}
ProcessGroup::~ProcessGroup() {
  if (impl_ && impl_->size > 1) --g_live_process_groups;
}

int live_process_groups() { return g_live_process_groups.load(); }

std::shared_ptr<ProcessGroup> ProcessGroup::single() {
  auto impl = std::make_unique<Impl>();
  impl->global_ranks = {0};
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
}

std::shared_ptr<ProcessGroup> ProcessGroup::create(const ProcessState& st,
                                                   const ProcessGroupOptions& options) {
  if (st.world_size == 1) {
    auto pg = single();
    pg->impl_->state = st;
    pg->impl_->options = options;
    return pg;
  }
  if (options.backend() != "auto" && options.backend() != "gloo" && options.backend() != "nccl")
    throw ::tandem::Refused(st.prefix() + " unknown process group backend '" +
                                options.backend() + "': use auto, gloo or nccl");
  ignore_sigpipe();
  auto impl = std::make_unique<Impl>();
  impl->rank = st.rank;
  impl->size = st.world_size;
  impl->state = st;
  impl->options = options;
  for (int r = 0; r < st.world_size; ++r) impl->global_ranks.push_back(r);

  const std::string where = st.master_addr + ":" + std::to_string(st.master_port);
  if (auto why = host_resolution_error(st.master_addr); !why.empty())
    throw std::runtime_error(st.prefix() + " MASTER_ADDR '" + st.master_addr +
                             "' does not resolve (" + why +
                             "): expected the address or host name of rank 0's machine. Fix "
                             "MASTER_ADDR (tandem launch: --main_process_ip), e.g. its IP "
                             "address such as 10.0.0.1, or 127.0.0.1 on one machine.");
  const auto secs = std::chrono::duration_cast<std::chrono::seconds>(options.timeout()).count();
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(st.master_port);
  // Under torchrun the agent hosts the store: every rank is its client (ProcessState::
  // agent_store_prefix).
  const bool agent_store = !st.agent_store_prefix.empty();
  so.isServer = st.rank == 0 && !agent_store;
  if (agent_store && !compat::kStoreClientSpeaksTorchrun2)
    throw std::runtime_error(
        st.prefix() + " torchrun's agent hosts the rendezvous store at " + where +
        " (TORCHELASTIC_USE_AGENT_STORE=True), and this tandem is built on LibTorch " +
        TORCH_VERSION + ", whose store client does not speak PyTorch 2.x's store protocol. "
        "Launch with `tandem launch` (--nproc_per_node N becomes --num_processes N), or build "
        "tandem on LibTorch 2.x (scripts/build-torch2.sh). Note [Agent store protocol]");
  so.waitWorkers = false;
  so.timeout = options.timeout();
  // Note [Rendezvous generations]: a process may build its world group more than once (an
  // Accelerator, destroyed, then another). If rank 0 hosted a new store each time on the same
  // port, a rank faster than rank 0 could reach the previous store while it still served, find
  // the previous rendezvous complete and the previous Gloo addresses there, and fail
  // ("connect ...: Connection refused") once rank 0 closed them. So rank 0 hosts one store per
  // address for the life of the process (the one process-wide table in tandem), every creation
  // has a generation (every rank builds its world groups in the same order), and a generation's
  // keys, Gloo's and NCCL's included, live under its own prefix.
  static std::atomic<int> generations{0};
  const std::string generation = std::to_string(generations++);
  const std::string key = "tandem/rendezvous/" + generation + "/arrived";
  c10::intrusive_ptr<c10d::Store> tcp;
  {
    static std::mutex hosted_mutex;
    static auto* hosted = new std::map<std::string, c10::intrusive_ptr<c10d::Store>>();
    std::lock_guard<std::mutex> lock(hosted_mutex);
    auto it = so.isServer ? hosted->find(where) : hosted->end();
    if (it != hosted->end()) {
      tcp = it->second;
    } else {
      try {
        // Note [Loopback rendezvous]: a job on one machine never needs the store off loopback.
        tcp = compat::make_tcp_store(st.master_addr, so, is_loopback(st.master_addr));
      } catch (const std::exception& e) {
        // Note [Free ports]: the port was found free and taken before this rank listened on it;
        // the launcher that picked it starts the ranks again on another.
        if (so.isServer && std::string(e.what()).find("already in use") != std::string::npos)
          tell_launcher(st.error_file, "port-taken");
        if (so.isServer)
          throw std::runtime_error(
              st.prefix() + " cannot host the rendezvous store at " + where + ": " +
              first_line(e.what()) + ". The port is probably in use by another program or job: "
              "pick a free one with --main_process_port (or MASTER_PORT), or leave it unset so "
              "that tandem launch picks a free port.");
        throw std::runtime_error(st.prefix() + " cannot reach " +
                                 (agent_store ? "torchrun's" : "rank 0's") +
                                 " rendezvous store at " +
                                 where + " within " + std::to_string(secs) + " s: " +
                                 first_line(e.what()) +
                                 ". Check MASTER_ADDR/MASTER_PORT and that rank 0 is running.");
      }
      if (so.isServer) (*hosted)[where] = tcp;
    }
  }
  if (agent_store) tcp = c10::make_intrusive<c10d::PrefixStore>(st.agent_store_prefix, tcp);

  // Count arrivals ourselves so that a timeout can say how many ranks came.
  tcp->add(key, 1);
  auto deadline = std::chrono::steady_clock::now() + options.timeout();
  int64_t arrived = 0;
  while ((arrived = tcp->add(key, 0)) < st.world_size) {
    if (std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error(st.prefix() + " rendezvous timed out: waited " +
                               std::to_string(secs) + " s for " +
                               std::to_string(st.world_size - arrived) + " of " +
                               std::to_string(st.world_size) + " ranks at " + where + " (" +
                               std::to_string(arrived) + " arrived). Start every rank, or raise "
                               "the timeout.");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  impl->store = c10::make_intrusive<c10d::PrefixStore>("tandem/" + generation, tcp);

  try {
    impl->gloo_device = make_gloo_device(st);
    if (options.backend() != "nccl")
      impl->gloo = make_gloo(c10::make_intrusive<c10d::PrefixStore>("gloo", impl->store), st.rank,
                             st.world_size, impl->gloo_device, options);
  } catch (const std::exception& e) {
    // Note [Secondary failures]: a peer that closed its end while the mesh was connecting
    // (it exited, or failed first) is the cause; this rank's failure follows from it.
    const std::string what = e.what();
    if (what.find("closed by peer") != std::string::npos ||
        what.find("reset by peer") != std::string::npos)
      tell_launcher(st.error_file, "peer connect");
    throw std::runtime_error(st.prefix() + " could not connect the Gloo process group of " +
                             std::to_string(st.world_size) + " ranks (store at " + where + "): " +
                             first_line(e.what()));
  }
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
}

std::shared_ptr<ProcessGroup> ProcessGroupFactory::on_store(const ProcessState& state,
                                                            c10::intrusive_ptr<c10d::Store> store,
                                                            const std::string& name, int rank,
                                                            int size,
                                                            const ProcessGroupOptions& options) {
  ignore_sigpipe();
  auto impl = std::make_unique<ProcessGroup::Impl>();
  impl->rank = rank;
  impl->size = size;
  impl->state = state;
  impl->state.error_file.clear();
  impl->failures_expected = true;
  impl->options = options;
  for (int r = 0; r < size; ++r) impl->global_ranks.push_back(r);
  impl->store_prefix = name + "/";
  impl->store = std::move(store);
  if (size > 1) {
    impl->gloo_device = make_gloo_device(state);
    impl->gloo = make_gloo(c10::make_intrusive<c10d::PrefixStore>("gloo", impl->store), rank, size,
                           impl->gloo_device, options);
  }
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
}

int ProcessGroup::rank() const { return impl_->rank; }
int ProcessGroup::size() const { return impl_->size; }
int ProcessGroup::global_rank(int group_rank) const { return impl_->global_ranks.at(group_rank); }
std::string ProcessGroup::prefix() const { return impl_->prefix(); }
std::chrono::milliseconds ProcessGroup::timeout() const { return impl_->options.timeout(); }

std::shared_ptr<ProcessGroup> ProcessGroup::new_subgroup(const std::vector<int>& ranks) {
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= impl_->state.world_size || (i > 0 && ranks[i] <= ranks[i - 1]))
      throw ::tandem::Refused(prefix() + " new_subgroup needs ascending, distinct global ranks "
                                  "in [0, " + std::to_string(impl_->state.world_size) + ")");
  }
  const int id = impl_->subgroup_counter++;
  const int me = impl_->state.rank;
  auto it = std::find(ranks.begin(), ranks.end(), me);
  if (it == ranks.end()) return nullptr;
  auto impl = std::make_unique<Impl>();
  impl->rank = static_cast<int>(it - ranks.begin());
  impl->size = static_cast<int>(ranks.size());
  impl->global_ranks = ranks;
  impl->state = impl_->state;
  impl->options = impl_->options;
  if (impl->size > 1) {
    impl->store_prefix = impl_->store_prefix + "sub" + std::to_string(id) + "/";
    impl->store = c10::make_intrusive<c10d::PrefixStore>(impl->store_prefix, impl_->store);
    impl->gloo_device = impl_->gloo_device;
    impl->gloo = make_gloo(c10::make_intrusive<c10d::PrefixStore>("gloo", impl->store), impl->rank,
                           impl->size, impl->gloo_device, impl->options);
  }
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
}

Work ProcessGroup::allreduce_async(std::vector<at::Tensor> tensors, ReduceOp op, std::string what) {
  if (impl_->size == 1 || tensors.empty()) return Work();
  c10d::AllreduceOptions o;
  o.reduceOp = to_c10d(op);
  o.timeout = impl_->options.timeout();
  auto& backend = impl_->backend_for(tensors.front());
  double div = op == ReduceOp::kMean ? static_cast<double>(impl_->size) : 1.0;
  auto issued = tensors;  // c10d takes the list by reference
  return impl_->issue(std::move(what), std::move(tensors), div, at::Tensor(),
                      [&] { return Impl::Works{backend.allreduce(issued, o)}; });
}

void ProcessGroup::allreduce(at::Tensor& tensor, ReduceOp op) {
  allreduce_async({tensor}, op).wait();
}

namespace {

// Broadcasts and all-gathers only move bytes, but Gloo refuses dtypes it has no arithmetic for
// (bool; bf16 before LibTorch 2.x): those travel reinterpreted as a same-size dtype it knows.
at::Tensor as_movable(const at::Tensor& t) {
  if (t.scalar_type() == at::kBool) return t.view(at::kByte);
  if (t.scalar_type() == at::kBFloat16 && t.is_cpu()) return t.view(at::kHalf);
  return t;
}

}  // namespace

void ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  if (impl_->size == 1) return;
  std::vector<at::Tensor> ts{as_movable(tensor)};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.timeout = impl_->options.timeout();
  auto& backend = impl_->backend_for(tensor);
  impl_->issue("broadcast", {}, 1.0, tensor, [&] { return Impl::Works{backend.broadcast(ts, o)}; })
      .wait();
}

std::vector<at::Tensor> ProcessGroup::allgather(const at::Tensor& tensor) {
  if (impl_->size == 1) return {tensor.clone()};
  const auto dtype = tensor.scalar_type();
  std::vector<at::Tensor> in{as_movable(tensor.contiguous())};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < impl_->size; ++r) out[0].push_back(at::empty_like(in[0]));
  c10d::AllgatherOptions o;
  o.timeout = impl_->options.timeout();
  auto& backend = impl_->backend_for(tensor);
  impl_->issue("allgather", {}, 1.0, tensor,
               [&] { return Impl::Works{backend.allgather(out, in, o)}; })
      .wait();
  if (in[0].scalar_type() != dtype)
    for (auto& t : out[0]) t = t.view(dtype);
  return out[0];
}

int64_t ProcessGroup::shard_numel(int64_t numel) const {
  TANDEM_CHECK(numel >= 0, prefix(), " shard_numel: negative element count ", numel);
  return padded_chunk_numel(numel, impl_->size);
}

int64_t padded_chunk_numel(int64_t numel, int world) {
  return std::max<int64_t>(1, (numel + world - 1) / world);
}

// Note [Reduce-scatter on Gloo]: Gloo in LibTorch 1.13 has no reduce_scatter (and neither
// _reduce_scatter_base nor _allgather_base): the alltoall algorithm sends chunk k of the padded
// input to rank k with one alltoall_base and sums the n received chunks locally; the allreduce
// algorithm reduces everything and keeps this rank's slice. Both run on every version, so that
// results do not depend on the LibTorch. bf16 on a Gloo that cannot sum it is summed as fp32.
void ProcessGroup::reduce_scatter(const at::Tensor& input, at::Tensor& output, ReduceOp op,
                                  ReduceScatterAlgorithm algorithm) {
  reduce_scatter_async(input, output, op, algorithm).wait();
}

Work ProcessGroup::reduce_scatter_async(const at::Tensor& input, at::Tensor output, ReduceOp op,
                                        ReduceScatterAlgorithm algorithm) {
  TANDEM_CHECK(op == ReduceOp::kSum || op == ReduceOp::kMean, prefix(),
              " reduce_scatter: only sum and mean are supported");
  const int n = impl_->size;
  const int64_t chunk = shard_numel(input.numel());
  TANDEM_CHECK(output.numel() == chunk, prefix(), " reduce_scatter: the output holds ",
              output.numel(), " elements; a ", input.numel(), "-element input over ", n,
              " ranks gives each ", chunk, " (ProcessGroup::shard_numel)");
  auto flat = input.reshape({-1});
  const auto wire = compat::gloo_sum_dtype(flat.scalar_type(), flat.device().type());
  // The padded input, in the dtype that travels (no copy when it already is one).
  at::Tensor padded;
  if (flat.numel() == chunk * n && flat.scalar_type() == wire && flat.is_contiguous() &&
      algorithm == ReduceScatterAlgorithm::kAlltoall) {
    padded = flat;
  } else {
    padded = at::zeros({chunk * n}, flat.options().dtype(wire));
    padded.narrow(0, 0, flat.numel()).copy_(flat);
  }
  const double div = op == ReduceOp::kMean ? static_cast<double>(n) : 1.0;
  auto finish = [output, div](const at::Tensor& mine) mutable {
    if (div != 1.0)
      output.copy_(mine.div(div).view(output.sizes()));
    else
      output.copy_(mine.view(output.sizes()));
  };
  if (n == 1) {
    finish(padded);
    return Work();
  }
  Work work;
  if (algorithm == ReduceScatterAlgorithm::kAllreduceSlice) {
    work = allreduce_async({padded}, ReduceOp::kSum, "reduce_scatter (allreduce)");
    const int64_t start = static_cast<int64_t>(rank()) * chunk;
    work.impl_->then = [padded, start, chunk, finish]() mutable {
      finish(padded.narrow(0, start, chunk));
    };
  } else {
    at::Tensor received = at::empty_like(padded);
    c10d::AllToAllOptions o;
    o.timeout = impl_->options.timeout();
    std::vector<int64_t> splits;  // equal splits
    auto moved_in = as_movable(padded), moved_out = as_movable(received);
    auto& backend = impl_->backend_for(padded);
    work = impl_->issue(  // {padded} keeps the input alive while in flight
        "reduce_scatter (alltoall)", {padded}, 1.0, at::Tensor(), [&] {
          return Impl::Works{backend.alltoall_base(moved_out, moved_in, splits, splits, o)};
        });
    work.impl_->then = [received, n, chunk, finish]() mutable {
      // Sum the n chunks in rank order: the same order on every rank, whatever the arrival.
      auto parts = received.view({n, chunk});
      auto mine = parts[0].clone();
      for (int k = 1; k < n; ++k) mine.add_(parts[k]);
      finish(mine);
    };
  }
  return work;
}

void ProcessGroup::all_gather_into(const at::Tensor& shard, at::Tensor& output) {
  all_gather_into_async(shard, output).wait();
}

Work ProcessGroup::all_gather_into_async(const at::Tensor& shard, at::Tensor output) {
  const int n = impl_->size;
  TANDEM_CHECK(output.numel() == shard.numel() * n, prefix(), " all_gather_into: the output holds ",
              output.numel(), " elements, expected ", n, " x ", shard.numel());
  TANDEM_CHECK(shard.numel() > 0, prefix(), " all_gather_into: empty shards cannot travel over "
              "Gloo; pad them to at least one element (ProcessGroup::shard_numel)");
  if (n == 1) {
    output.view({-1}).copy_(shard.reshape({-1}));
    return Work();
  }
  // LibTorch 1.13's Gloo has no _allgather_base: the list form. Where the output is contiguous
  // and of the shard's dtype and device, its n slices are the list (the collective writes into
  // them: no second copy of the whole output beside it, a unit's worth of memory at every ZeRO-3
  // gather); otherwise parts of their own, copied in once the collective is done.
  const auto dtype = shard.scalar_type();
  std::vector<at::Tensor> in{as_movable(shard.contiguous().reshape({-1}))};
  const int64_t numel = shard.numel();
  std::vector<std::vector<at::Tensor>> out(1);
  const bool in_place = output.is_contiguous() && output.scalar_type() == dtype &&
                        output.device() == shard.device();
  if (in_place) {
    auto slices = as_movable(output.view({-1})).view({n, numel});
    for (int r = 0; r < n; ++r) out[0].push_back(slices[r]);
  } else {
    for (int r = 0; r < n; ++r) out[0].push_back(at::empty_like(in[0]));
  }
  c10d::AllgatherOptions o;
  o.timeout = impl_->options.timeout();
  auto parts = out[0];  // the same storages, filled by the collective
  auto& backend = impl_->backend_for(in[0]);
  Work work = impl_->issue("all-gather", {in[0]}, 1.0,  // {in[0]} keeps the input alive
                           at::Tensor(), [&] { return Impl::Works{backend.allgather(out, in, o)}; });
  if (in_place) return work;
  work.impl_->then = [parts, output, dtype, n, numel]() mutable {
    auto flat = output.view({n, numel});
    for (int k = 0; k < n; ++k) {
      const auto& part = parts[static_cast<size_t>(k)];
      flat[k].copy_(part.scalar_type() != dtype ? part.view(dtype) : part);
    }
  };
  return work;
}

void ProcessGroup::barrier() {
  if (impl_->size == 1) return;
  // A one-element allreduce is a barrier that Gloo and NCCL run the same way and that fails
  // (rather than hangs) when a peer is gone.
  auto t = at::zeros({1}, at::kInt);
  allreduce_async({t}, ReduceOp::kSum, "wait_for_everyone").wait();
}

// Note [Point-to-point]: Gloo's send and recv take one tensor each, so a list travels as one
// message per tensor under the same tag (Gloo keeps messages of one pair and tag in order), and
// one Work waits for all of them. Gloo's send and recv have no per-call timeout: their waits use
// the group's timeout, set on its context when the group was built, and a peer that exits closes
// the connection, which fails the wait at once. A receive into a non-contiguous tensor lands in a
// contiguous buffer first and is copied once the work completed.
Work ProcessGroup::send_async(std::vector<at::Tensor> tensors, int dst, int tag, std::string what) {
  check_peer(dst, tag, "send to");
  std::vector<at::Tensor> sent;  // keeps the bytes alive until the work is waited on
  for (const auto& t : tensors)  // Gloo aborts on empty messages; the receiver skips them too
    if (t.numel() > 0) sent.push_back(t.contiguous());
  if (sent.empty()) return Work();
  auto issued = sent;
  return impl_->issue(what + " to rank " + std::to_string(global_rank(dst)) + " (tag " +
                          std::to_string(tag) + ")",
                      std::move(sent), 1.0, at::Tensor(), [&] {
                        Impl::Works works;
                        for (auto& t : issued) {
                          std::vector<at::Tensor> one{t};
                          works.push_back(impl_->backend_for(t).send(one, dst, tag));
                        }
                        return works;
                      });
}

Work ProcessGroup::recv_async(std::vector<at::Tensor> tensors, int src, int tag, std::string what) {
  check_peer(src, tag, "recv from");
  std::vector<at::Tensor> buffers;
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(),
                               [](const at::Tensor& t) { return t.numel() == 0; }),
                tensors.end());
  for (const auto& t : tensors)
    buffers.push_back(t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous));
  if (buffers.empty()) return Work();
  auto work = impl_->issue(what + " from rank " + std::to_string(global_rank(src)) + " (tag " +
                               std::to_string(tag) + ")",
                           buffers, 1.0, at::Tensor(), [&] {
                             Impl::Works works;
                             for (auto& t : buffers) {
                               std::vector<at::Tensor> one{t};
                               works.push_back(impl_->backend_for(t).recv(one, src, tag));
                             }
                             return works;
                           });
  bool copy = false;
  for (size_t i = 0; i < tensors.size(); ++i) copy |= !tensors[i].is_same(buffers[i]);
  if (copy)
    work.impl_->then = [tensors, buffers]() mutable {
      for (size_t i = 0; i < tensors.size(); ++i)
        if (!tensors[i].is_same(buffers[i])) tensors[i].copy_(buffers[i]);
    };
  return work;
}

void ProcessGroup::send(std::vector<at::Tensor> tensors, int dst, int tag, std::string what) {
  send_async(std::move(tensors), dst, tag, std::move(what)).wait();
}

void ProcessGroup::recv(std::vector<at::Tensor> tensors, int src, int tag, std::string what) {
  recv_async(std::move(tensors), src, tag, std::move(what)).wait();
}

at::Tensor ProcessGroup::all_to_all_v(const at::Tensor& input,
                                      const std::vector<int64_t>& send_rows,
                                      std::vector<int64_t>* recv_rows) {
  if (static_cast<int>(send_rows.size()) != impl_->size)
    throw ::tandem::Refused(prefix() + " all_to_all_v: " + std::to_string(send_rows.size()) +
                            " send counts for a group of " + std::to_string(impl_->size) +
                            ": give one count per group rank");
  std::vector<int64_t> received(static_cast<size_t>(impl_->size), 0);
  if (impl_->size == 1) {
    received[0] = send_rows[0];
  } else {
    auto mine = at::tensor(send_rows, at::TensorOptions().dtype(at::kLong));
    const auto all = allgather(mine);  // all[r][q]: rows rank r sends rank q
    for (int r = 0; r < impl_->size; ++r)
      received[static_cast<size_t>(r)] = all[static_cast<size_t>(r)][impl_->rank].item<int64_t>();
  }
  if (recv_rows) *recv_rows = received;
  return all_to_all_v(input, send_rows, received);
}

at::Tensor ProcessGroup::all_to_all_v(const at::Tensor& input,
                                      const std::vector<int64_t>& send_rows,
                                      const std::vector<int64_t>& recv_rows) {
  const auto n = static_cast<size_t>(impl_->size);
  if (send_rows.size() != n || recv_rows.size() != n)
    throw ::tandem::Refused(prefix() + " all_to_all_v: " + std::to_string(send_rows.size()) +
                            " send and " + std::to_string(recv_rows.size()) +
                            " receive counts for a group of " + std::to_string(n) +
                            ": give one of each per group rank");
  if (input.dim() < 1)
    throw ::tandem::Refused(prefix() + " all_to_all_v: the input needs a first dimension of rows");
  int64_t sent = 0, total = 0;
  for (size_t r = 0; r < n; ++r) {
    if (send_rows[r] < 0 || recv_rows[r] < 0)
      throw ::tandem::Refused(prefix() + " all_to_all_v: negative row count for group rank " +
                              std::to_string(r));
    sent += send_rows[r];
    total += recv_rows[r];
  }
  if (sent != input.size(0))
    throw ::tandem::Refused(prefix() + " all_to_all_v: the send counts add up to " +
                            std::to_string(sent) + " rows, and the input has " +
                            std::to_string(input.size(0)));
  auto in = input.contiguous();
  auto shape = in.sizes().vec();
  shape[0] = total;
  auto out = at::empty(shape, in.options());
  std::vector<int64_t> send_at(n + 1, 0), recv_at(n + 1, 0);
  for (size_t r = 0; r < n; ++r) {
    send_at[r + 1] = send_at[r] + send_rows[r];
    recv_at[r + 1] = recv_at[r] + recv_rows[r];
  }
  const auto me = static_cast<size_t>(impl_->rank);
  if (send_rows[me] != recv_rows[me])
    throw ::tandem::Refused(prefix() + " all_to_all_v: this rank sends itself " +
                            std::to_string(send_rows[me]) + " rows and expects " +
                            std::to_string(recv_rows[me]));
  out.narrow(0, recv_at[me], recv_rows[me]).copy_(in.narrow(0, send_at[me], send_rows[me]));
  // Every receive and send posted before any is waited on: no two ranks wait on each other.
  std::vector<Work> works;
  for (size_t r = 0; r < n; ++r) {
    if (r == me) continue;
    works.push_back(recv_async({out.narrow(0, recv_at[r], recv_rows[r])}, static_cast<int>(r),
                               kAllToAllTag, "all_to_all_v"));
  }
  for (size_t r = 0; r < n; ++r) {
    if (r == me) continue;
    works.push_back(send_async({in.narrow(0, send_at[r], send_rows[r])}, static_cast<int>(r),
                               kAllToAllTag, "all_to_all_v"));
  }
  for (auto& w : works) w.wait();
  return out;
}

void ProcessGroup::check_peer(int peer, int tag, const char* op) const {
  if (peer < 0 || peer >= impl_->size || peer == impl_->rank)
    throw ::tandem::Refused(prefix() + " " + op + " group rank " + std::to_string(peer) +
                                ": a peer must be another rank of this group of " +
                                std::to_string(impl_->size) + " (group rank " +
                                std::to_string(impl_->rank) + " is this process)");
  if (tag < 0)
    throw ::tandem::Refused(prefix() + " " + op + " group rank " + std::to_string(peer) +
                                " with tag " + std::to_string(tag) + ": tags must be >= 0");
}

bool rendezvous_store_can_listen_on_loopback() { return compat::kStoreCanListenOnLoopback; }

}  // namespace tandem
