// Pipeline schedules (GPipe, 1F1B, interleaved 1F1B, zero bubble) as per-rank action lists, and a
// simulator that runs them.
#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "tandem/error.h"
#include "tandem/parallel/pipeline.h"

namespace tandem::parallel {

// Note [Pipeline schedules]
// A schedule is first an order of computations per rank, over the micro-batches j and the rank's
// chunks c (its stages c p + r of S = p v; v = 1 but for interleaved 1F1B):
//   GPipe: F0 F1 ... F(m-1) B0 B1 ... B(m-1).
//   1F1B:  w = min(p - 1 - s, m) warm-up forwards F0..F(w-1), then F(w+i) B(i) for each
//          remaining forward, then the remaining backwards. Stage s holds at most w + 1 = p - s
//          micro-batches whose backward has not run.
//   Interleaved 1F1B (Megatron's, as PyTorch's ScheduleInterleaved1F1B orders it): m v
//          forwards, the k-th on chunk (k / p) mod v, so micro-batches go round the chunks in
//          groups of p; backwards likewise from the last chunk down; w = min((v - 1) p + 2 (p -
//          1 - r), m v) warm-up forwards, then one forward and one backward in turn, then the
//          remaining backwards. m must be a multiple of p.
//   Zero bubble: each backward split into I (the stage input's gradient, which the stage before
//          waits for) and W (the parameters' gradients, which nobody waits for). Built by running
//          the ranks in unit time steps, each taking, when free, the first of: the next I whose
//          gradient has arrived, the next F whose activation has arrived if the stage holds fewer
//          than p - s micro-batches (1F1B's bound: activations live until W), the oldest
//          deferred W. The W's fill the cool-down's gaps, so the bubble loses (p - 1) W's:
//          2 (p - 1) units against 1F1B's 3 (p - 1) with F = I = W = 1.
// Each computation starts as early as its dependencies allow, a forward, I and W taking one time
// step and a whole backward two: F(g, j) after F(g - 1, j), the backward (or I) of (g, j) after
// that of (g + 1, j) (on the last stage after F(S - 1, j)), W(g, j) after I(g, j), and each
// after the rank's previous computation. This gives every computation a start time t. A
// transfer (the activation after F(g, j) to stage g + 1, the gradient after the backward or I of
// (g, j) to g - 1) is an event at the producer's last time step, after its computations.
//
// The one global order: sort every event by (time, computations before transfers, rank, ...).
// Each rank's action list is this order restricted to the events it takes part in: its
// computations, and the transfers it sends or receives (one event, two actions). A consumer
// starts after its producer's end, so every receive comes before the computation that needs it.
//
// Why no two ranks wait on each other (even when every send is rendezvous, i.e. waits for the
// matching receive): take the first event E of the global order that has not happened. Every
// earlier event has, so every rank that takes part in E has done all of its earlier actions,
// which are earlier events, and stands at E: a computation runs, and both ends of a transfer are
// at its send and its receive, so it completes. By induction, every event happens. Buffered
// sends only let a sender go on sooner, which cannot block anyone either.
//
// With F = 1 and B = 2, GPipe and 1F1B take 3 (m + p - 1) steps, each stage computing 3m: the
// bubble, the idle share, is (p - 1) / (m + p - 1); 1F1B only bounds the activations held (p -
// s micro-batches instead of m). Interleaved: 3 (v m + p - 1) steps of stages 1/v as long, the
// bubble (p - 1) / (v m + p - 1). Zero bubble: 3 m + 2 (p - 1) steps.

namespace {

using Kind = PipelineAction::Kind;

int duration(Kind k) { return k == Kind::kBackward ? 2 : 1; }
bool is_compute(Kind k) {
  return k == Kind::kForward || k == Kind::kBackward || k == Kind::kBackwardInput ||
         k == Kind::kBackwardWeight;
}

// Rank r's zero-bubble order (Note [Pipeline schedules]), by running every rank in unit steps.
std::vector<std::vector<PipelineAction>> zero_bubble_order(int p, int m) {
  std::vector<std::vector<PipelineAction>> order(static_cast<size_t>(p));
  // Finish times of F, I per (stage, micro-batch); -1: not run.
  std::vector<std::vector<int64_t>> f_end(p, std::vector<int64_t>(m, -1)), i_end = f_end;
  std::vector<int> nf(p, 0), ni(p, 0), nw(p, 0);
  // Every step some rank makes progress (the chain of I's and F's always has a ready head), so
  // 3 m p + p steps bound the run; more means a bug here, not a long schedule.
  for (int64_t t = 0;; ++t) {
    if (t > 3 * static_cast<int64_t>(m) * p + p)
      throw std::logic_error("pipeline_schedule: the zero-bubble order of " + std::to_string(p) +
                             " stages and " + std::to_string(m) + " micro-batches does not end");
    bool all_done = true;
    for (int s = 0; s < p; ++s) {
      if (nw[s] < m) all_done = false;
      auto ready = [t](int64_t end) { return end >= 0 && end <= t; };
      if (ni[s] < nf[s] && ready(s == p - 1 ? f_end[s][ni[s]] : i_end[s + 1][ni[s]])) {
        order[s].push_back({Kind::kBackwardInput, ni[s]});
        i_end[s][ni[s]++] = t + 1;
      } else if (nf[s] < m && nf[s] - nw[s] < p - s && (s == 0 || ready(f_end[s - 1][nf[s]]))) {
        order[s].push_back({Kind::kForward, nf[s]});
        f_end[s][nf[s]++] = t + 1;
      } else if (nw[s] < ni[s]) {
        order[s].push_back({Kind::kBackwardWeight, nw[s]++});
      }
    }
    if (all_done) break;
  }
  return order;
}

std::vector<std::vector<PipelineAction>> compute_order(ScheduleKind kind, int p, int m, int v) {
  if (kind == ScheduleKind::kZeroBubble) return zero_bubble_order(p, m);
  std::vector<std::vector<PipelineAction>> order(static_cast<size_t>(p));
  for (int s = 0; s < p; ++s) {
    auto& o = order[static_cast<size_t>(s)];
    if (kind == ScheduleKind::kGPipe) {
      for (int j = 0; j < m; ++j) o.push_back({Kind::kForward, j});
      for (int j = 0; j < m; ++j) o.push_back({Kind::kBackward, j});
    } else if (kind == ScheduleKind::k1F1B) {
      const int warmup = std::min(p - 1 - s, m);
      for (int j = 0; j < warmup; ++j) o.push_back({Kind::kForward, j});
      for (int i = 0; i < m - warmup; ++i) {
        o.push_back({Kind::kForward, warmup + i});
        o.push_back({Kind::kBackward, i});
      }
      for (int j = m - warmup; j < m; ++j) o.push_back({Kind::kBackward, j});
    } else {  // interleaved
      const int total = m * v, warmup = std::min((v - 1) * p + 2 * (p - 1 - s), total);
      std::vector<int> next_f(static_cast<size_t>(v), 0), next_b = next_f;
      auto forward = [&](int k) {
        const int c = (k / p) % v;
        o.push_back({Kind::kForward, next_f[c]++, c});
      };
      auto backward = [&](int k) {
        const int c = v - 1 - (k / p) % v;
        o.push_back({Kind::kBackward, next_b[c]++, c});
      };
      for (int k = 0; k < warmup; ++k) forward(k);
      for (int k = 0; k < total - warmup; ++k) {
        forward(warmup + k);
        backward(k);
      }
      for (int k = total - warmup; k < total; ++k) backward(k);
    }
  }
  return order;
}

}  // namespace

std::string to_string(const PipelineAction& a) {
  static const char* names[] = {"F", "B", "sendA", "recvA", "sendG", "recvG", "I", "W"};
  return names[a.kind] + std::to_string(a.microbatch) +
         (a.chunk > 0 ? "." + std::to_string(a.chunk) : std::string());
}

std::vector<std::vector<PipelineAction>> pipeline_schedule(ScheduleKind kind, int p, int m, int v) {
  if (p < 1)
    throw ::tandem::Refused("pipeline_schedule: " + std::to_string(p) +
                                " stages; a pipeline needs at least 1");
  if (m < p)
    throw ::tandem::Refused(
        "pipeline_schedule: " + std::to_string(m) + " micro-batches for " + std::to_string(p) +
        " stages: use at least " + std::to_string(p) + " micro-batches (as many as stages), else "
        "the pipeline is mostly idle");
  if (v < 1)
    throw ::tandem::Refused("pipeline_schedule: " + std::to_string(v) +
                            " virtual stages per rank; use 1 or more (pp_virtual_stages)");
  if (v > 1 && p < 2)
    throw ::tandem::Refused("pipeline_schedule: " + std::to_string(v) +
                            " virtual stages on one rank would send to itself; interleaving "
                            "needs at least 2 ranks (or use pp_virtual_stages 1)");
  if (v > 1 && kind != ScheduleKind::kInterleaved1F1B)
    throw ::tandem::Refused("pipeline_schedule: " + std::to_string(v) +
                            " virtual stages per rank with the " + to_string(kind) +
                            " schedule, which runs one stage per rank: use the interleaved_1f1b "
                            "schedule (--pp_schedule), or pp_virtual_stages 1");
  if (kind == ScheduleKind::kInterleaved1F1B && m % p != 0)
    throw ::tandem::Refused("pipeline_schedule: the interleaved 1F1B schedule sends micro-batches "
                            "round the ranks in groups of " + std::to_string(p) + ", and " +
                            std::to_string(m) + " micro-batches are not a multiple of " +
                            std::to_string(p) + ": use " + std::to_string((m / p + 1) * p) +
                            " (or " + std::to_string(m / p * p) + ") micro-batches");
  const int S = p * v;
  const auto order = compute_order(kind, p, m, v);

  // Start times per (kind, global stage, micro-batch), known once their dependencies are.
  std::map<std::tuple<int, int, int>, int64_t> start;
  auto end_of = [&](Kind k, int g, int j) -> int64_t {
    auto it = start.find({k, g, j});
    return it == start.end() ? -1 : it->second + duration(k);
  };
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::vector<int64_t> clock(static_cast<size_t>(p), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      const auto& o = order[r];
      while (next[r] < o.size()) {
        const auto& a = o[next[r]];
        const int j = a.microbatch, g = a.chunk * p + r;
        int64_t ready;
        if (a.kind == Kind::kForward) {
          ready = g == 0 ? 0 : end_of(Kind::kForward, g - 1, j);
        } else if (a.kind == Kind::kBackwardWeight) {
          ready = end_of(Kind::kBackwardInput, g, j);
        } else if (g == S - 1) {
          ready = end_of(Kind::kForward, g, j);
        } else {
          ready = std::max(end_of(Kind::kBackward, g + 1, j), end_of(Kind::kBackwardInput, g + 1, j));
        }
        if (ready < 0) break;
        const int64_t t = std::max(ready, clock[r]);
        start[{a.kind, g, j}] = t;
        clock[r] = t + duration(a.kind);
        ++next[r];
        progress = true;
      }
    }
  }
  for (int r = 0; r < p; ++r)
    if (next[r] != order[r].size())
      throw std::logic_error("pipeline_schedule: the computation order of rank " +
                             std::to_string(r) + " cannot run");

  // The global order: (time, phase 0 = computation / 1 = transfer, rank, chunk, kind, batch).
  struct Event {
    int64_t time;
    int phase, rank, chunk, kind, microbatch;
    bool operator<(const Event& o) const {
      return std::tie(time, phase, rank, chunk, kind, microbatch) <
             std::tie(o.time, o.phase, o.rank, o.chunk, o.kind, o.microbatch);
    }
  };
  std::vector<Event> events;
  for (const auto& [key, t] : start) {
    const auto [k, g, j] = key;
    const int r = g % p, c = g / p;
    const auto kind = static_cast<Kind>(k);
    events.push_back({t, 0, r, c, k, j});
    // The transfer's time is its producer's last step: phase 1 places it after every
    // computation starting then and before any starting one step later.
    const int64_t last = t + duration(kind) - 1;
    if (kind == Kind::kForward && g < S - 1) events.push_back({last, 1, r, c, Kind::kSendActivation, j});
    if ((kind == Kind::kBackward || kind == Kind::kBackwardInput) && g > 0)
      events.push_back({last, 1, r, c, Kind::kSendGradient, j});
  }
  std::sort(events.begin(), events.end());
  std::vector<std::vector<PipelineAction>> actions(static_cast<size_t>(p));
  for (const auto& e : events) {
    const auto kind = static_cast<Kind>(e.kind);
    actions[e.rank].push_back({kind, e.microbatch, e.chunk});
    const int g = e.chunk * p + e.rank;
    if (kind == Kind::kSendActivation)
      actions[(g + 1) % p].push_back({Kind::kRecvActivation, e.microbatch, (g + 1) / p});
    if (kind == Kind::kSendGradient)
      actions[(g - 1) % p].push_back({Kind::kRecvGradient, e.microbatch, (g - 1) / p});
  }
  return actions;
}

ScheduleSimulation simulate_schedule(const std::vector<std::vector<PipelineAction>>& actions,
                                     int v) {
  ScheduleSimulation r;
  const int p = static_cast<int>(actions.size());
  if (p == 0 || v < 1) {
    r.error = p == 0 ? "no stages" : "virtual_stages below 1";
    return r;
  }
  int m = 0;
  for (const auto& list : actions)
    for (const auto& a : list) {
      m = std::max(m, a.microbatch + 1);
      v = std::max(v, a.chunk + 1);
    }
  const int S = p * v;
  std::vector<size_t> pc(p, 0);
  std::vector<int64_t> clock(p, 0);
  r.busy.assign(p, 0);
  r.max_in_flight.assign(p, 0);
  // Per global stage and micro-batch: forward, backward (or I), W done; activation / gradient
  // received.
  std::vector<std::vector<char>> fwd(S, std::vector<char>(m, 0)), bwd = fwd, wgt = fwd, act = fwd,
                                 grad = fwd;
  std::vector<char> split(S, 0);  // the stage's backwards are split into I and W
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
        if (a.chunk < 0 || a.chunk >= v) return fail(s, a, "a chunk this rank does not hold");
        const int g = a.chunk * p + s;
        if (a.kind == Kind::kForward) {
          if (fwd[g][j]) return fail(s, a, "a second forward of the micro-batch");
          if (g > 0 && !act[g][j]) return fail(s, a, "its activation was not received");
          fwd[g][j] = 1;
          r.max_in_flight[s] = std::max(r.max_in_flight[s], ++in_flight[s]);
        } else if (a.kind == Kind::kBackward || a.kind == Kind::kBackwardInput) {
          if (bwd[g][j]) return fail(s, a, "a second backward of the micro-batch");
          if (!fwd[g][j]) return fail(s, a, "before its forward");
          if (g < S - 1 && !grad[g][j]) return fail(s, a, "its gradient was not received");
          bwd[g][j] = 1;
          if (a.kind == Kind::kBackward) {
            wgt[g][j] = 1;
            --in_flight[s];
          } else {
            split[g] = 1;
          }
        } else if (a.kind == Kind::kBackwardWeight) {
          if (wgt[g][j]) return fail(s, a, "a second weight gradient of the micro-batch");
          if (!bwd[g][j]) return fail(s, a, "before its input gradient");
          wgt[g][j] = 1;
          --in_flight[s];
        } else if (a.kind == Kind::kSendActivation || a.kind == Kind::kSendGradient) {
          const bool activation = a.kind == Kind::kSendActivation;
          const int h = activation ? g + 1 : g - 1;  // the peer's global stage
          if (h < 0 || h >= S) return fail(s, a, "there is no stage to send it to");
          if (activation ? !fwd[g][j] : !bwd[g][j])
            return fail(s, a, activation ? "sent before its forward" : "sent before its backward");
          // Rendezvous: the send completes with the peer's matching receive, when both are there.
          const int q = h % p;
          const PipelineAction want{activation ? Kind::kRecvActivation : Kind::kRecvGradient, j,
                                    h / p};
          if (pc[q] >= actions[q].size() || !(actions[q][pc[q]] == want)) break;
          // The data is there when the sender made it; the sender goes on at once (a buffered
          // send's timing, as Gloo's and NCCL's sends of activations are in practice).
          clock[q] = std::max(clock[q], clock[s]);
          (activation ? act : grad)[h][j] = 1;
          ++pc[q];
        } else {
          const bool activation = a.kind == Kind::kRecvActivation;
          const int h = activation ? g - 1 : g + 1;
          if (h < 0 || h >= S) return fail(s, a, "there is no stage to receive it from");
          break;  // completed by the sender's turn
        }
        if (is_compute(a.kind)) {
          clock[s] += duration(a.kind);
          r.busy[s] += duration(a.kind);
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
  for (int g = 0; g < S; ++g)
    for (int j = 0; j < m; ++j)
      if (!fwd[g][j] || !bwd[g][j] || !wgt[g][j]) {
        const std::string which = !fwd[g][j]   ? "forward"
                                  : !bwd[g][j] ? (split[g] ? "input gradient" : "backward")
                                               : "weight gradient";
        r.error = "stage " + std::to_string(g % p) +
                  (v > 1 ? " (chunk " + std::to_string(g / p) + ")" : std::string()) +
                  " never runs the " + which + " of micro-batch " + std::to_string(j);
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
