// A rank of the collectives test: runs every collective and checks its result on this rank.
// Modes: "all" (default) checks everything; "die" makes rank 1 SIGKILL itself in the middle of a
// collective loop; "hold" keeps a port busy (for the port-in-use test is done by the harness);
// "whoami" prints how the rank was started (Note [Fork start]).
#include <signal.h>
#include <unistd.h>

#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "tandem/comm/collectives.h"
#include "tandem/comm/process_group.h"

namespace {

int failures = 0;
std::string who;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << who << " FAILED: " << what << std::endl;
    ++failures;
  }
}

bool same(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.to(torch::kDouble).equal(b.to(torch::kDouble));
}

// Note [Fork start]: what a rank sees of how it was started, printed before it meets the others:
// its environment (one line per variable, "whoami-env <rank> KEY=VALUE"), whether it leads its
// own process group, whether its parent is the launcher, and one line on each output stream.
int whoami() {
  const char* rank = std::getenv("RANK");
  const std::string r = rank ? rank : "?";
  std::vector<std::string> vars;
  for (char** e = environ; *e; ++e) vars.emplace_back(*e);
  std::sort(vars.begin(), vars.end());
  for (const auto& v : vars) std::cout << "whoami-env " << r << " " << v << "\n";
  std::ifstream cmdline("/proc/" + std::to_string(::getppid()) + "/cmdline");
  std::string arg0, arg1;
  std::getline(cmdline, arg0, '\0');
  std::getline(cmdline, arg1, '\0');
  std::cout << "whoami " << r << " own_group=" << (::getpgid(0) == ::getpid())
            << " parent_is_launcher=" << (arg1 == "launch") << std::endl;
  std::cerr << "whoami-stderr " << r << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "all";
  if (mode == "whoami") return whoami();
  auto state = tandem::ProcessState::from_environment();
  who = state.prefix();
  const char* t_env = std::getenv("TANDEM_TEST_TIMEOUT_S");
  auto pg = tandem::ProcessGroup::create(
      state, tandem::ProcessGroupOptions().timeout(std::chrono::seconds(t_env ? std::atoi(t_env) : 20)));
  const int r = pg->rank(), w = pg->size();
  namespace comm = tandem::comm;

  if (mode == "recreate") {
    // Note [Rendezvous generations]: world groups built one after another in one process, with
    // rank 0 lagging each time, so that the other ranks reach the next rendezvous while rank 0's
    // previous store still serves.
    const auto options = tandem::ProcessGroupOptions().timeout(std::chrono::seconds(20));
    for (int i = 0; i < 5; ++i) {
      auto t = torch::full({4}, static_cast<float>(r + i));
      pg->allreduce(t, tandem::ReduceOp::kSum);
      check(same(t, torch::full({4}, static_cast<float>(w * i + w * (w - 1) / 2))),
            "allreduce of group " + std::to_string(i));
      if (r == 0) usleep(300 * 1000);
      pg.reset();
      pg = tandem::ProcessGroup::create(state, options);
    }
    std::cout << "recreate " << (failures ? "FAILED" : "OK") << " on rank " << r << std::endl;
    return failures ? 1 : 0;
  }
  if (mode == "listen") {
    // Where rank 0's rendezvous store listens: the local addresses of the listening TCP sockets
    // on MASTER_PORT, from /proc/net/tcp and tcp6 (hex address:port; state 0A is LISTEN).
    if (r == 0) {
      const int port = std::atoi(std::getenv("MASTER_PORT"));
      char want[8];
      std::snprintf(want, sizeof(want), "%04X", port);
      for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
        std::ifstream in(table);
        std::string line;
        std::getline(in, line);  // header
        while (std::getline(in, line)) {
          std::istringstream ls(line);
          std::string slot, local, remote, st;
          ls >> slot >> local >> remote >> st;
          auto colon = local.rfind(':');
          if (st == "0A" && local.substr(colon + 1) == want)
            std::cout << "store listens on " << local.substr(0, colon) << std::endl;
        }
      }
      std::cout << "loopback capable " << tandem::rendezvous_store_can_listen_on_loopback()
                << std::endl;
    }
    pg->barrier();
    return 0;
  }
  if (mode == "spam") {
    // Many lines, written in pieces, to check that the launcher never interleaves two ranks.
    for (int i = 0; i < 2000; ++i) {
      std::string line = "spam " + std::to_string(r) + " " + std::to_string(i) + " " +
                         std::string(static_cast<size_t>(50 + (i * 7) % 100), 'a' + r) + " end";
      std::cout << line.substr(0, 10) << std::flush << line.substr(10) << "\n";
    }
    std::cout << std::flush;
    return 0;
  }
  if (mode == "exit3") {
    if (r == 2) return 3;
    pg->barrier();  // blocks until the launcher stops this rank
    return 0;
  }
  if (mode == "sleep") {
    std::string dir = argc > 2 ? argv[2] : "/tmp";
    FILE* f = std::fopen((dir + "/pid" + std::to_string(r)).c_str(), "w");
    std::fprintf(f, "%d\n", static_cast<int>(::getpid()));
    std::fclose(f);
    std::cout << "sleeping" << std::endl;
    ::sleep(120);
    return 0;
  }
  if (mode == "die") {
    for (int i = 0;; ++i) {
      if (r == 1 && i == 50) ::kill(::getpid(), SIGKILL);
      auto t = torch::ones({1000});
      pg->allreduce(t, tandem::ReduceOp::kSum);
    }
  }

  // gather: rank r contributes r + 1 rows filled with r.
  auto mine = torch::full({r + 1, 2}, static_cast<float>(r));
  auto g = comm::gather(*pg, mine);
  std::vector<torch::Tensor> expect_parts;
  for (int k = 0; k < w; ++k) expect_parts.push_back(torch::full({k + 1, 2}, static_cast<float>(k)));
  check(same(g, torch::cat(expect_parts)), "gather");
  std::cout << "gather rows " << g.size(0) << " sum " << g.sum().item<float>() << std::endl;

  // gather_object / broadcast_object.
  auto objs = comm::gather_object(*pg, "rank" + std::to_string(r) + std::string(r, 'x'));
  check(static_cast<int>(objs.size()) == w, "gather_object size");
  for (int k = 0; k < w && k < static_cast<int>(objs.size()); ++k)
    check(objs[k] == "rank" + std::to_string(k) + std::string(k, 'x'), "gather_object " + objs[k]);
  auto b = comm::broadcast_object(*pg, r == w - 1 ? std::string("from-last") : std::string("no"),
                                  w - 1);
  check(b == "from-last", "broadcast_object: " + b);
  std::cout << "gather_object " << objs.size() << " broadcast_object " << b << std::endl;

  // reduce: sum, mean, max, min of [r, 2r].
  auto t = torch::tensor({static_cast<double>(r), 2.0 * r});
  double sum = w * (w - 1) / 2.0;
  check(same(comm::reduce(*pg, t, tandem::ReduceOp::kSum), torch::tensor({sum, 2 * sum})),
        "reduce sum");
  check(torch::allclose(comm::reduce(*pg, t, tandem::ReduceOp::kMean),
                        torch::tensor({sum / w, 2 * sum / w})),
        "reduce mean");
  check(same(comm::reduce(*pg, t, tandem::ReduceOp::kMax),
              torch::tensor({w - 1.0, 2.0 * (w - 1)})),
        "reduce max");
  check(same(comm::reduce(*pg, t, tandem::ReduceOp::kMin), torch::tensor({0.0, 0.0})),
        "reduce min");
  check(same(t, torch::tensor({static_cast<double>(r), 2.0 * r})), "reduce leaves its input");
  std::cout << "reduce sum " << sum << std::endl;

  // broadcast from rank 0.
  auto bt = r == 0 ? torch::arange(6).reshape({2, 3}) : torch::zeros({2, 3}, torch::kLong);
  comm::broadcast(*pg, bt, 0);
  check(same(bt, torch::arange(6).reshape({2, 3})), "broadcast");

  // pad_across_processes with uneven sizes, at the end and at the start.
  auto u = torch::ones({2, r + 1});
  auto padded = comm::pad_across_processes(*pg, u, 1, -1.0);
  check(padded.size(1) == w && padded.size(0) == 2, "pad size");
  check(padded.narrow(1, 0, r + 1).eq(1).all().item<bool>(), "pad keeps values");
  if (r + 1 < w) check(padded.narrow(1, r + 1, w - r - 1).eq(-1).all().item<bool>(), "pad values");
  auto first = comm::pad_across_processes(*pg, torch::ones({r + 1}), 0, 0.0, true);
  check(first.size(0) == w && first.narrow(0, w - r - 1, r + 1).eq(1).all().item<bool>() &&
            first.sum().item<float>() == r + 1,
        "pad_first");
  auto all_padded = comm::gather(*pg, padded.unsqueeze(0));
  check(all_padded.size(0) == w && all_padded.eq(1).sum().item<int64_t>() == 2 * sum + 2 * w,
        "gather after pad");
  std::cout << "pad_across_processes width " << padded.size(1) << std::endl;

  // reduce_scatter (both algorithms, sum and mean, uneven and tiny sizes, bf16) and
  // all_gather_into: each rank checks its chunk against the full reduction it computes itself.
  using Algo = tandem::ProcessGroup::ReduceScatterAlgorithm;
  for (int64_t numel : {int64_t{1}, int64_t{3}, int64_t{7 * 15}, int64_t{101}}) {
    const int64_t chunk = pg->shard_numel(numel);
    check(chunk >= 1 && chunk * w >= numel && (chunk - 1) * w < std::max<int64_t>(numel, 1),
          "shard_numel " + std::to_string(numel));
    auto input_of = [&](int k) { return torch::arange(numel, torch::kFloat) * (k + 1) + k; };
    auto total = torch::zeros({chunk * w});
    for (int k = 0; k < w; ++k) total.narrow(0, 0, numel).add_(input_of(k));
    auto want = total.narrow(0, static_cast<int64_t>(r) * chunk, chunk);
    for (auto algo : {Algo::kAlltoall, Algo::kAllreduceSlice}) {
      const std::string name = std::string(algo == Algo::kAlltoall ? "alltoall" : "allreduce") +
                               " numel " + std::to_string(numel);
      auto out = torch::full({chunk}, -7.0f);
      pg->reduce_scatter(input_of(r), out, tandem::ReduceOp::kSum, algo);
      check(same(out, want), "reduce_scatter sum " + name);
      pg->reduce_scatter(input_of(r), out, tandem::ReduceOp::kMean, algo);
      check(torch::allclose(out, want / w), "reduce_scatter mean " + name);
      auto half = torch::empty({chunk}, torch::kBFloat16);
      pg->reduce_scatter(input_of(r).to(torch::kBFloat16), half, tandem::ReduceOp::kSum, algo);
      check(torch::allclose(half.to(torch::kFloat), want, 0.02, 0.5), "reduce_scatter bf16 " + name);
    }
    // The allreduce algorithm gives bitwise the chunk of an allreduce (what DDP sees); the
    // alltoall one agrees to rounding.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + r);
    auto noisy = torch::randn({numel}, gen);
    auto reduced = noisy.clone();
    pg->allreduce(reduced, tandem::ReduceOp::kSum);
    auto padded = torch::zeros({chunk * w});
    padded.narrow(0, 0, numel).copy_(reduced);
    auto slice = torch::empty({chunk}), a2a = torch::empty({chunk});
    pg->reduce_scatter(noisy, slice, tandem::ReduceOp::kSum, Algo::kAllreduceSlice);
    pg->reduce_scatter(noisy, a2a, tandem::ReduceOp::kSum, Algo::kAlltoall);
    auto mine = padded.narrow(0, static_cast<int64_t>(r) * chunk, chunk);
    check(torch::equal(slice, mine), "reduce_scatter allreduce algorithm is bitwise an allreduce");
    check(torch::allclose(a2a, mine, 1e-6, 1e-6), "reduce_scatter alltoall agrees to rounding");
    // all_gather_into: every rank's shard, in rank order.
    auto shard = torch::full({chunk}, static_cast<float>(r)) + torch::arange(chunk, torch::kFloat);
    auto gathered = torch::empty({chunk * w});
    pg->all_gather_into(shard, gathered);
    for (int k = 0; k < w; ++k)
      check(same(gathered.narrow(0, k * chunk, chunk),
                 torch::full({chunk}, static_cast<float>(k)) + torch::arange(chunk, torch::kFloat)),
            "all_gather_into block " + std::to_string(k));
  }
  try {
    auto wrong = torch::empty({100});
    pg->reduce_scatter(torch::ones({8}), wrong, tandem::ReduceOp::kSum);
    check(false, "reduce_scatter accepted a wrongly sized output");
  } catch (const std::exception& e) {
    check(std::string(e.what()).find("shard_numel") != std::string::npos,
          std::string("reduce_scatter size error names the fix: ") + e.what());
  }
  std::cout << "reduce_scatter and all_gather_into checked" << std::endl;

  // all_to_all_v: rank r sends rank q (r + q) % 3 rows of [100 r + q, q - r] (none for some
  // pairs, rank 0 none to itself), then sends every row back with the counts known (the way
  // back of a dispatch); an exchange where nobody sends anything; counts that do not add up.
  {
    std::vector<int64_t> send;
    std::vector<torch::Tensor> parts;
    for (int q = 0; q < w; ++q) {
      send.push_back((r + q) % 3);
      parts.push_back(torch::tensor({100.0f * r + q, static_cast<float>(q - r)})
                          .repeat({(r + q) % 3, 1}));
    }
    const auto rows = torch::cat(parts);
    std::vector<int64_t> counts;
    auto got = pg->all_to_all_v(rows, send, &counts);
    std::vector<torch::Tensor> want;
    bool counts_ok = static_cast<int>(counts.size()) == w;
    for (int k = 0; k < w; ++k) {
      if (counts_ok) counts_ok = counts[static_cast<size_t>(k)] == (k + r) % 3;
      want.push_back(torch::tensor({100.0f * k + r, static_cast<float>(r - k)})
                         .repeat({(k + r) % 3, 1}));
    }
    check(counts_ok, "all_to_all_v receive counts");
    check(same(got, torch::cat(want)), "all_to_all_v rows");
    auto back = pg->all_to_all_v(got, counts, send);
    check(same(back, rows), "all_to_all_v back with known counts");
    auto ids = pg->all_to_all_v(torch::arange(rows.size(0)), send);
    check(ids.scalar_type() == torch::kLong && ids.size(0) == got.size(0), "all_to_all_v int64");
    auto nothing = pg->all_to_all_v(torch::empty({0, 3}), std::vector<int64_t>(w, 0));
    check(nothing.size(0) == 0 && nothing.size(1) == 3, "all_to_all_v of nothing");
    try {
      pg->all_to_all_v(rows, std::vector<int64_t>(w, 100));
      check(false, "all_to_all_v accepted counts that do not add up to the rows");
    } catch (const std::exception& e) {
      check(std::string(e.what()).find("add up to") != std::string::npos,
            std::string("all_to_all_v count error: ") + e.what());
    }
    std::cout << "all_to_all_v received " << got.size(0) << " rows" << std::endl;
  }

  // Subgroup of the even ranks.
  std::vector<int> evens;
  for (int k = 0; k < w; k += 2) evens.push_back(k);
  auto sub = pg->new_subgroup(evens);
  check((r % 2 == 0) == (sub != nullptr), "subgroup membership");
  if (sub) {
    auto s = comm::reduce(*sub, torch::tensor({static_cast<float>(r)}), tandem::ReduceOp::kSum);
    float expect = 0;
    for (int k : evens) expect += k;
    check(s.item<float>() == expect, "subgroup reduce");
    check(sub->size() == static_cast<int>(evens.size()) && sub->rank() == r / 2, "subgroup rank");
  }

  comm::wait_for_everyone(*pg);
  std::cout << (failures == 0 ? "collectives OK" : "collectives FAILED") << " on rank " << r
            << " of " << w << std::endl;
  return failures == 0 ? 0 : 1;
}
