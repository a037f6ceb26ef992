// Pipeline schedules (GPipe, 1F1B) as per-stage action lists, and a simulator that runs them.
#include <algorithm>
#include "tandem/error.h"
#include <map>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "tandem/parallel/pipeline.h"

namespace tandem::parallel {

// Note [Pipeline schedules]
// A schedule is first an order of computations per stage:
//   GPipe: F0 F1 ... F(m-1) B0 B1 ... B(m-1).
//   1F1B:  w = min(p - 1 - s, m) warm-up forwards F0..F(w-1), then F(w+i) B(i) for each
//          remaining forward, then the remaining backwards. Stage s holds at most w + 1 = p - s
//          micro-batches whose backward has not run.
// Each computation starts as early as its dependencies allow, with forwards and backwards of one
// time step: F(s, j) after F(s - 1, j), B(s, j) after B(s + 1, j) (on the last stage after
// F(p - 1, j)), and after the stage's previous computation. This gives every computation a start
// time t. A transfer (the activation after F(s, j) to s + 1, the gradient after B(s, j) to s - 1)
// is an event at the end of its producer, t + 1.
//
// The one global order: sort every event by (time, computations before transfers, stage, ...).
// Each stage's action list is this order restricted to the events it takes part in: its
// computations, and the transfers it sends or receives (one event, two actions). A consumer
// starts at t + 1 or later, so every receive comes before the computation that needs it.
//
// Why no two ranks wait on each other (even when every send is rendezvous, i.e. waits for the
// matching receive): take the first event E of the global order that has not happened. Every
// earlier event has, so every rank that takes part in E has done all of its earlier actions,
// which are earlier events, and stands at E: a computation runs, and both ends of a transfer are
// at its send and its receive, so it completes. By induction, every event happens. Buffered
// sends only let a sender go on sooner, which cannot block anyone either.
//
// With unit-time forwards and backwards both schedules take 2 (m + p - 1) time steps, in which
// each stage computes 2m: the bubble, the idle share, is (p - 1) / (m + p - 1). 1F1B does not
// shrink the bubble; it bounds the activations held (p - s micro-batches instead of m).

namespace {

using Kind = PipelineAction::Kind;

std::vector<std::vector<PipelineAction>> compute_order(ScheduleKind kind, int p, int m) {
  std::vector<std::vector<PipelineAction>> order(static_cast<size_t>(p));
  for (int s = 0; s < p; ++s) {
    auto& o = order[static_cast<size_t>(s)];
    if (kind == ScheduleKind::kGPipe) {
      for (int j = 0; j < m; ++j) o.push_back({Kind::kForward, j});
      for (int j = 0; j < m; ++j) o.push_back({Kind::kBackward, j});
    } else {
      const int warmup = std::min(p - 1 - s, m);
      for (int j = 0; j < warmup; ++j) o.push_back({Kind::kForward, j});
      for (int i = 0; i < m - warmup; ++i) {
        o.push_back({Kind::kForward, warmup + i});
        o.push_back({Kind::kBackward, i});
      }
      for (int j = m - warmup; j < m; ++j) o.push_back({Kind::kBackward, j});
    }
  }
  return order;
}

}  // namespace

std::string to_string(const PipelineAction& a) {
  static const char* names[] = {"F", "B", "sendA", "recvA", "sendG", "recvG"};
  return names[a.kind] + std::to_string(a.microbatch);
}

std::string to_string(ScheduleKind kind) { return kind == ScheduleKind::kGPipe ? "GPipe" : "1F1B"; }

std::vector<std::vector<PipelineAction>> pipeline_schedule(ScheduleKind kind, int p, int m) {
  if (p < 1)
    throw ::tandem::Refused("pipeline_schedule: " + std::to_string(p) +
                                " stages; a pipeline needs at least 1");
  if (m < p)
    throw ::tandem::Refused(
        "pipeline_schedule: " + std::to_string(m) + " micro-batches for " + std::to_string(p) +
        " stages: use at least " + std::to_string(p) + " micro-batches (as many as stages), else "
        "the pipeline is mostly idle");
  const auto order = compute_order(kind, p, m);

  // Start times: forward (s, j) and backward (s, j) become known once their dependencies are.
  std::vector<std::vector<int64_t>> fstart(p, std::vector<int64_t>(m, -1)), bstart = fstart;
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::vector<int64_t> clock(static_cast<size_t>(p), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      const auto& o = order[s];
      while (next[s] < o.size()) {
        const auto& a = o[next[s]];
        const int j = a.microbatch;
        int64_t ready;
        if (a.kind == Kind::kForward)
          ready = s == 0 ? 0 : fstart[s - 1][j] < 0 ? -1 : fstart[s - 1][j] + 1;
        else
          ready = s == p - 1 ? (fstart[s][j] < 0 ? -1 : fstart[s][j] + 1)
                             : (bstart[s + 1][j] < 0 ? -1 : bstart[s + 1][j] + 1);
        if (ready < 0) break;
        const int64_t t = std::max(ready, clock[s]);
        (a.kind == Kind::kForward ? fstart : bstart)[s][j] = t;
        clock[s] = t + 1;
        ++next[s];
        progress = true;
      }
    }
  }
  for (int s = 0; s < p; ++s)
    if (next[s] != order[s].size())
      throw std::logic_error("pipeline_schedule: the computation order of stage " +
                             std::to_string(s) + " cannot run");

  // The global order: (time, phase 0 = computation / 1 = transfer, stage, kind, micro-batch).
  struct Event {
    int64_t time;
    int phase, stage, kind, microbatch;
    bool operator<(const Event& o) const {
      return std::tie(time, phase, stage, kind, microbatch) <
             std::tie(o.time, o.phase, o.stage, o.kind, o.microbatch);
    }
  };
  std::vector<Event> events;
  for (int s = 0; s < p; ++s)
    for (int j = 0; j < m; ++j) {
      events.push_back({fstart[s][j], 0, s, Kind::kForward, j});
      events.push_back({bstart[s][j], 0, s, Kind::kBackward, j});
      // The transfer's time is its producer's start: phase 1 places it after every computation
      // starting then and before any starting one step later, when the producer has finished.
      if (s < p - 1) events.push_back({fstart[s][j], 1, s, Kind::kSendActivation, j});
      if (s > 0) events.push_back({bstart[s][j], 1, s, Kind::kSendGradient, j});
    }
  std::sort(events.begin(), events.end());
  std::vector<std::vector<PipelineAction>> actions(static_cast<size_t>(p));
  for (const auto& e : events) {
    const auto kind = static_cast<Kind>(e.kind);
    actions[e.stage].push_back({kind, e.microbatch});
    if (kind == Kind::kSendActivation) actions[e.stage + 1].push_back({Kind::kRecvActivation, e.microbatch});
    if (kind == Kind::kSendGradient) actions[e.stage - 1].push_back({Kind::kRecvGradient, e.microbatch});
  }
  return actions;
}

ScheduleSimulation simulate_schedule(const std::vector<std::vector<PipelineAction>>& actions) {
  ScheduleSimulation r;
  const int p = static_cast<int>(actions.size());
  if (p == 0) {
    r.error = "no stages";
    return r;
  }
  int m = 0;
  for (const auto& list : actions)
    for (const auto& a : list) m = std::max(m, a.microbatch + 1);
  std::vector<size_t> pc(p, 0);
  std::vector<int64_t> clock(p, 0);
  r.busy.assign(p, 0);
  r.max_in_flight.assign(p, 0);
  // Per stage and micro-batch: forward done, backward done, activation / gradient received.
  std::vector<std::vector<char>> fwd(p, std::vector<char>(m, 0)), bwd = fwd, act = fwd, grad = fwd;
  std::vector<int> in_flight(p, 0);
  auto fail = [&](int s, const PipelineAction& a, const std::string& why) {
    r.error = "stage " + std::to_string(s) + ", action " + std::to_string(pc[s]) + " (" +
              to_string(a) + "): " + why;
    return r;
  };
  for (;;) {
    bool progress = false, done = true;
    for (int s = 0; s < p; ++s) {
      while (pc[s] < actions[s].size()) {
        done = false;
        const auto& a = actions[s][pc[s]];
        const int j = a.microbatch;
        if (j < 0) return fail(s, a, "negative micro-batch");
        if (a.kind == Kind::kForward) {
          if (fwd[s][j]) return fail(s, a, "a second forward of the micro-batch");
          if (s > 0 && !act[s][j]) return fail(s, a, "its activation was not received");
          fwd[s][j] = 1;
          r.max_in_flight[s] = std::max(r.max_in_flight[s], ++in_flight[s]);
        } else if (a.kind == Kind::kBackward) {
          if (bwd[s][j]) return fail(s, a, "a second backward of the micro-batch");
          if (!fwd[s][j]) return fail(s, a, "before its forward");
          if (s < p - 1 && !grad[s][j]) return fail(s, a, "its gradient was not received");
          bwd[s][j] = 1;
          --in_flight[s];
        } else if (a.kind == Kind::kSendActivation || a.kind == Kind::kSendGradient) {
          const bool activation = a.kind == Kind::kSendActivation;
          const int q = activation ? s + 1 : s - 1;
          if (q < 0 || q >= p) return fail(s, a, "there is no stage to send it to");
          if (activation ? !fwd[s][j] : !bwd[s][j])
            return fail(s, a, activation ? "sent before its forward" : "sent before its backward");
          // Rendezvous: the send completes with the peer's matching receive, when both are there.
          const PipelineAction want{activation ? Kind::kRecvActivation : Kind::kRecvGradient, j};
          if (pc[q] >= actions[q].size() || !(actions[q][pc[q]] == want)) break;
          const int64_t t = std::max(clock[s], clock[q]);
          clock[s] = clock[q] = t;
          (activation ? act : grad)[q][j] = 1;
          ++pc[q];
        } else {
          const bool activation = a.kind == Kind::kRecvActivation;
          const int q = activation ? s - 1 : s + 1;
          if (q < 0 || q >= p) return fail(s, a, "there is no stage to receive it from");
          break;  // completed by the sender's turn
        }
        if (a.kind == Kind::kForward || a.kind == Kind::kBackward) {
          ++clock[s];
          ++r.busy[s];
        }
        ++pc[s];
        progress = true;
      }
      if (pc[s] < actions[s].size()) done = false;
    }
    if (done) break;
    if (!progress) {
      r.deadlock = true;
      std::ostringstream os;
      os << "deadlock: every stage waits:";
      for (int s = 0; s < p; ++s)
        os << " stage " << s << " at "
           << (pc[s] < actions[s].size() ? to_string(actions[s][pc[s]]) : std::string("end"))
           << (s + 1 < p ? ";" : "");
      r.error = os.str();
      return r;
    }
  }
  for (int s = 0; s < p; ++s)
    for (int j = 0; j < m; ++j)
      if (!fwd[s][j] || !bwd[s][j]) {
        r.error = "stage " + std::to_string(s) + " never runs the " +
                  (fwd[s][j] ? "backward" : "forward") + " of micro-batch " + std::to_string(j);
        return r;
      }
  r.time_steps = *std::max_element(clock.begin(), clock.end());
  int64_t busy = 0;
  for (auto b : r.busy) busy += b;
  r.bubble_fraction =
      r.time_steps == 0 ? 0.0 : 1.0 - static_cast<double>(busy) / (static_cast<double>(p) * r.time_steps);
  return r;
}

}  // namespace tandem::parallel
