// The replicas' quorum: Note [Replica recovery] (replicas.h).
#include "tandem/comm/replicas.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "../compat/c10d.h"
#include "detail/process_group_impl.h"
#include "detail/replicas_store.h"
#include "tandem/error.h"

namespace tandem::comm {

namespace {

constexpr char kRoot[] = "tandem/ft/";

std::vector<uint8_t> bytes(const std::string& s) {
  return {s.begin(), s.end()};
}
std::string text(const std::vector<uint8_t>& b) {
  return {b.begin(), b.end()};
}

// A generation's record: "<uid>,<uid>,...|<queued joiners taken in>".
struct Record {
  std::vector<int64_t> members;
  int64_t consumed = 0;
};

std::string format(const Record& r) {
  std::ostringstream os;
  for (size_t k = 0; k < r.members.size(); ++k) os << (k ? "," : "") << r.members[k];
  os << "|" << r.consumed;
  return os.str();
}

Record parse(const std::string& s) {
  Record r;
  const auto bar = s.find('|');
  std::istringstream in(s.substr(0, bar));
  for (std::string m; std::getline(in, m, ',');)
    if (!m.empty()) r.members.push_back(std::stoll(m));
  r.consumed = bar == std::string::npos ? 0 : std::stoll(s.substr(bar + 1));
  return r;
}

std::string generation_key(int64_t g) {
  return std::string(kRoot) + "gen/" + std::to_string(g);
}

void pause_briefly() {
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
}

}  // namespace

struct Replicas::Impl {
  c10::intrusive_ptr<::c10d::Store> store;
  std::chrono::milliseconds timeout{30000};

  int64_t counter(const std::string& key) { return store->add(kRoot + key, 0); }
  bool has(const std::string& key) { return store->check({kRoot + key}); }
  // The uid of the k-th process that queued.
  int64_t queued_uid(int64_t k) {
    return std::stoll(text(store->get(kRoot + std::string("join/") + std::to_string(k))));
  }
};

Replicas::Replicas(const ProcessState& state) : impl_(std::make_unique<Impl>()), state_(state) {
  const auto colon = state.replica_store.rfind(':');
  const std::string host = state.replica_store.substr(0, colon);
  impl_->timeout = std::chrono::milliseconds(static_cast<int64_t>(state.replica_timeout_s * 1000));
  // The Gloo device listens where the other machines reach it (Note [Gloo address]): this
  // process's own world is itself, on loopback.
  state_.master_addr = host;
  ::c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(std::stoi(state.replica_store.substr(colon + 1)));
  so.isServer = false;
  so.waitWorkers = false;
  so.timeout = std::max(impl_->timeout, std::chrono::milliseconds(60000));
  try {
    impl_->store = compat::make_tcp_store(host, so, false);
  } catch (const std::exception& e) {
    throw std::runtime_error(
        "cannot reach the replicas' store at " + state.replica_store +
        " (machine 0's launcher hosts it on --main_process_port + 1): " + e.what() +
        ". Start machine 0's launcher, or check --main_process_ip; when machine 0 is lost the "
        "job ends");
  }
  uid_ = impl_->store->add(std::string(kRoot) + "uids", 1) - 1;
  const int64_t queued = impl_->store->add(std::string(kRoot) + "joins", 1) - 1;
  impl_->store->set(std::string(kRoot) + "join/" + std::to_string(queued),
                    bytes(std::to_string(uid_)));
}

Replicas::~Replicas() {
  try {
    impl_->store->set(std::string(kRoot) + "left/" + std::to_string(uid_), bytes("1"));
  } catch (const std::exception&) {
    // machine 0's launcher is gone: nobody waits for this mark
  }
}

std::string Replicas::prefix() const {
  return "[replica " + std::to_string(uid_) + "]";
}

void Replicas::join() {
  if (joined()) return;
  auto& st = *impl_->store;
  const auto started = std::chrono::steady_clock::now();
  const auto first_deadline = started + std::max(impl_->timeout, std::chrono::milliseconds(60000));
  int64_t g = 0;
  for (;;) {
    // Look for the newest generation, from the last one seen.
    while (impl_->has("gen/" + std::to_string(g))) {
      const std::string value = text(st.get(generation_key(g)));
      const auto record = parse(value);
      if (std::find(record.members.begin(), record.members.end(), uid_) != record.members.end()) {
        enter(g, value);
        return;
      }
      ++g;
    }
    if (g == 0) {
      // The job's first quorum: the first R processes that queued.
      const int64_t queued = impl_->counter("joins");
      if (queued >= state_.replicas) {
        Record r;
        for (int64_t k = 0; k < state_.replicas; ++k) r.members.push_back(impl_->queued_uid(k));
        r.consumed = state_.replicas;
        st.compareSet(generation_key(0), {}, bytes(format(r)));
        continue;
      }
      if (std::chrono::steady_clock::now() > first_deadline)
        throw std::runtime_error(
            prefix() + " " + std::to_string(queued) + " of " + std::to_string(state_.replicas) +
            " replicas came to the replicas' store at " + state_.replica_store + " within " +
            std::to_string(
                std::chrono::duration_cast<std::chrono::seconds>(first_deadline - started)
                    .count()) +
            " s: start every machine's launcher (--num_machines)");
    } else {
      // A running job: wait for its next step boundary, unless it has ended.
      if (detail::every_replica_left(st))
        throw std::runtime_error(prefix() +
                                 " the job's replicas finished before this one could "
                                 "join them; nothing to do");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void Replicas::enter(int64_t generation, const std::string& text_record) {
  const auto record = parse(text_record);
  generation_ = generation;
  members_ = record.members;
  consumed_joins_ = record.consumed;
  index_ = static_cast<int>(std::find(members_.begin(), members_.end(), uid_) - members_.begin());
  calls_ = 0;
  admit_pending_ = false;
  group_.reset();
  const std::string name = "replicas/g" + std::to_string(generation);
  auto store = c10::make_intrusive<::c10d::PrefixStore>(
      std::string(kRoot) + "g" + std::to_string(generation) + "/pg/", impl_->store);
  if (members_.size() > 1) {
    try {
      group_ = ProcessGroupFactory::on_store(state_, store, name, index_, size(),
                                             ProcessGroupOptions().timeout(impl_->timeout));
    } catch (const std::exception& e) {
      // A member died before its group was connected: the quorum forms again without it.
      reform(false, std::string("the group of ") + std::to_string(size()) +
                        " replicas did not connect (" + e.what() + ")");
      return;
    }
  }
  std::cerr << prefix() << " quorum generation " << generation << ": " << size()
            << " replica(s), this one is member " << index_ << std::endl;
  if (on_new_) on_new_(group_.get(), 0);
}

int Replicas::sum(at::Tensor& flat) {
  TANDEM_CHECK(joined(), prefix(), " sum before join()");
  auto& st = *impl_->store;
  for (;;) {
    const double queued = static_cast<double>(impl_->counter("joins") - consumed_joins_);
    if (size() == 1) {
      if (queued > 0) admit_pending_ = true;
      ++calls_;
      return 1;
    }
    auto buf = at::cat({flat.reshape({-1}), at::full({1}, queued, flat.options())});
    std::string failure;
    try {
      group_->allreduce(buf, ReduceOp::kSum);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    const std::string call = std::string(kRoot) + "g" + std::to_string(generation_) + "/c" +
                             std::to_string(calls_++) + "/";
    if (failure.empty())
      st.add(call + "ok", 1);
    else
      st.set(call + "fail", bytes(failure));
    // Vote: every member's sum worked, or one failed (or never said, within the timeout).
    const auto deadline = std::chrono::steady_clock::now() + impl_->timeout;
    std::string vote;
    for (;;) {
      if (st.check({call + "fail"})) {
        vote = "abort";
        break;
      }
      if (st.add(call + "ok", 0) >= size()) {
        vote = "commit";
        break;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        vote = "abort";
        break;
      }
      pause_briefly();
    }
    const std::string decided = text(st.compareSet(call + "decision", {}, bytes(vote)));
    if (decided == "commit") {
      flat.copy_(buf.narrow(0, 0, flat.numel()).view_as(flat));
      if (buf[buf.numel() - 1].item<double>() > 0) admit_pending_ = true;
      return size();
    }
    std::string why = "a replica is lost (";
    if (!failure.empty())
      why += "this one's " + failure + ")";
    else if (st.check({call + "fail"}))
      why += "another's " + text(st.get(call + "fail")) + ")";
    else
      why += "one did not vote within --replica_timeout_s)";
    group_.reset();  // closes its sockets: members still waiting in it fail now
    reform(false, why);
  }
}

bool Replicas::admit_at_boundary() {
  if (!admit_pending_) return false;
  reform(true, "replicas asked to join");
  return true;
}

void Replicas::reform(bool admit, const std::string& why) {
  auto& st = *impl_->store;
  const int64_t next = generation_ + 1;
  const std::string here = std::string(kRoot) + "g" + std::to_string(next) + "/here/";
  st.set(here + std::to_string(uid_), bytes("1"));
  // Wait for the other members: all of them at a boundary; after a failure, those that come
  // within kSettleSeconds.
  const auto deadline =
      std::chrono::steady_clock::now() +
      (admit ? impl_->timeout
             : std::chrono::milliseconds(static_cast<int64_t>(kSettleSeconds * 1000)));
  std::vector<int64_t> came;
  while (!impl_->has("gen/" + std::to_string(next))) {
    came.clear();
    for (int64_t m : members_)
      if (st.check({here + std::to_string(m)})) came.push_back(m);
    if (came.size() == members_.size() || std::chrono::steady_clock::now() > deadline) {
      Record r;
      r.members = came;
      r.consumed = consumed_joins_;
      if (admit) {
        const int64_t queued = impl_->counter("joins");
        for (int64_t k = consumed_joins_; k < queued; ++k)
          r.members.push_back(impl_->queued_uid(k));
        r.consumed = queued;
      }
      st.compareSet(generation_key(next), {}, bytes(format(r)));
      break;
    }
    pause_briefly();
  }
  const std::string value = text(st.get(generation_key(next)));
  const auto record = parse(value);
  if (std::find(record.members.begin(), record.members.end(), uid_) == record.members.end())
    throw std::runtime_error(prefix() + " the other replicas formed quorum generation " +
                             std::to_string(next) + " without this one (it came more than " +
                             std::to_string(kSettleSeconds) + " s after them); it stops here");
  const int before = size();
  std::cerr << prefix() << " " << why.substr(0, why.find('\n')) << ": " << record.members.size()
            << " replica(s) go on (were " << before << ")" << std::endl;
  enter(next, value);
}

namespace detail {

bool every_replica_left(::c10d::Store& store) {
  int64_t g = 0;
  while (store.check({generation_key(g)})) ++g;
  if (g == 0) return true;
  const auto last = parse(text(store.get(generation_key(g - 1))));
  return std::all_of(last.members.begin(), last.members.end(), [&](int64_t m) {
    return store.check({std::string(kRoot) + "left/" + std::to_string(m)});
  });
}

}  // namespace detail

}  // namespace tandem::comm
