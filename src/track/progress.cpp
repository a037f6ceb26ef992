// ProgressBar: formatting and the decision of when to draw.
#include "tandem/track/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>

namespace tandem::track {
namespace {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<int64_t>(std::llround(seconds));
  char buf[64];
  if (s < 60) {
    std::snprintf(buf, sizeof(buf), "%llds", static_cast<long long>(s));
  } else if (s < 3600) {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm%02llds", static_cast<long long>(s / 3600),
                  static_cast<long long>((s / 60) % 60), static_cast<long long>(s % 60));
  }
  return buf;
}

// "35.2 it/s" for fast loops, "2.50 s/it" for slow ones (a rate of 0.4 it/s reads badly).
std::string format_rate(double rate) {
  char buf[64];
  if (!std::isfinite(rate) || rate <= 0) return "? it/s";
  if (rate >= 1) {
    std::snprintf(buf, sizeof(buf), rate >= 100 ? "%.0f it/s" : "%.1f it/s", rate);
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f s/it", 1.0 / rate);
  }
  return buf;
}

std::string format_loss(double loss) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.4g", loss);
  return buf;
}

}  // namespace

ProgressBar::ProgressBar(ProgressOptions options)
    : options_(std::move(options)), uncaught_at_start_(std::uncaught_exceptions()) {
  active_ = options_.enabled() && options_.is_main_process();
  if (!active_) return;
  terminal_ = options_.terminal().has_value() ? *options_.terminal() : ::isatty(options_.fd()) == 1;
  start_ = now();
  last_draw_ = start_;
  step_ = options_.initial();
}

ProgressBar::~ProgressBar() {
  if (!active_ || closed_) return;
  if (std::uncaught_exceptions() > uncaught_at_start_) {
    // The loop ended by an exception: whatever the step count, this run did not finish.
    closed_ = true;
    emit(status(!terminal_, true, true) + "\n");
    return;
  }
  close();
}

double ProgressBar::now() const {
  if (options_.clock()) return options_.clock()();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void ProgressBar::update(int64_t step, std::optional<double> loss) {
  if (!active_ || closed_) return;
  step_ = step;
  if (loss) loss_ = loss;
  double t = now();
  bool last = options_.total() > 0 && step >= options_.total();
  if (terminal_) {
    if (drawn_ && !last && t - last_draw_ < options_.min_interval_s()) return;
    emit(status(false, false));
  } else {
    if (t - last_draw_ < options_.plain_interval_s()) return;
    emit(status(true, false) + "\n");
  }
  drawn_ = true;
  last_draw_ = t;
}

void ProgressBar::close() {
  if (!active_ || closed_) return;
  closed_ = true;
  emit(status(!terminal_, true) + "\n");
}

// plain: "train: step 120/1000 (12%) 35.2 it/s eta 25s loss 1.234"
// terminal: "\rtrain: 120/1000  12% [###.......] 35.2 it/s eta 25s loss 1.234"
// final: "eta ..." becomes "done in 28s" ("failed after 28s" when an exception ended the loop).
std::string ProgressBar::status(bool plain, bool final, bool failed) const {
  double elapsed = now() - start_;
  int64_t done = step_ - options_.initial();
  double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0.0;
  int64_t total = options_.total();
  std::string s;
  if (!options_.description().empty()) s += options_.description() + ": ";
  char buf[128];
  if (plain) {
    s += "step " + std::to_string(step_);
    if (total > 0) {
      int64_t pct = std::min<int64_t>(100, std::max<int64_t>(0, step_ * 100 / total));
      std::snprintf(buf, sizeof(buf), "/%lld (%lld%%)", static_cast<long long>(total),
                    static_cast<long long>(pct));
      s += buf;
    }
  } else {
    s += std::to_string(step_);
    if (total > 0) {
      double frac = std::clamp(static_cast<double>(step_) / static_cast<double>(total), 0.0, 1.0);
      std::snprintf(buf, sizeof(buf), "/%lld %3d%% ", static_cast<long long>(total),
                    static_cast<int>(frac * 100));
      s += buf;
      int width = std::max(1, options_.bar_width());
      int filled = static_cast<int>(frac * width);
      s += "[" + std::string(filled, '#') + std::string(width - filled, '.') + "]";
    }
  }
  s += " " + format_rate(rate);
  if (final && failed) {
    s += " failed after " + format_duration(elapsed);
  } else if (final) {
    s += " done in " + format_duration(elapsed);
  } else if (total > 0 && rate > 0) {
    s += " eta " + format_duration(static_cast<double>(std::max<int64_t>(0, total - step_)) / rate);
  }
  if (loss_) s += " loss " + format_loss(*loss_);
  return s;
}

void ProgressBar::emit(const std::string& text) {
  std::string out = text;
  if (terminal_) {
    // Pad over the tail of a longer previous line instead of relying on ANSI escapes.
    size_t len = text.size() - (!text.empty() && text.back() == '\n' ? 1 : 0);
    std::string body = text.substr(0, len);
    if (len < last_width_) body += std::string(last_width_ - len, ' ');
    last_width_ = len;
    out = "\r" + body + text.substr(len);
  }
  size_t off = 0;
  while (off < out.size()) {
    ssize_t n = ::write(options_.fd(), out.data() + off, out.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // a closed stderr must not stop training
    }
    off += static_cast<size_t>(n);
  }
}

}  // namespace tandem::track
