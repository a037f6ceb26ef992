// A study's picture: scatter panels drawn into an RGB buffer, labelled with a 3x5 pixel font,
// written as PNG (zlib stored blocks: no compression library needed; the files stay small).
#include "tandem/trials/plot.h"
#include "tandem/error.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <stdexcept>

namespace tandem::trials {
namespace {

uint32_t crc32(const uint8_t* data, size_t n, uint32_t crc = 0) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

void put32(std::string& s, uint32_t v) {
  for (int k = 3; k >= 0; --k) s.push_back(static_cast<char>((v >> (8 * k)) & 0xFF));
}

void chunk(std::string& png, const char* type, const std::string& data) {
  put32(png, static_cast<uint32_t>(data.size()));
  std::string body = std::string(type, 4) + data;
  png += body;
  put32(png, crc32(reinterpret_cast<const uint8_t*>(body.data()), body.size()));
}

// 3x5 glyphs, rows top to bottom, 3 bits each (MSB left).
uint16_t glyph(char ch) {
  static const std::pair<char, uint16_t> font[] = {
      {'0', 0x7B6F}, {'1', 0x2C97}, {'2', 0x73E7}, {'3', 0x73CF}, {'4', 0x5BC9}, {'5', 0x79CF}, {'6', 0x79EF}, {'7', 0x7249}, {'8', 0x7BEF}, {'9', 0x7BCF}, {'A', 0x2BED}, {'B', 0x6BAE}, {'C', 0x3923}, {'D', 0x6B6E}, {'E', 0x79A7}, {'F', 0x79A4}, {'G', 0x396B}, {'H', 0x5BED}, {'I', 0x7497}, {'J', 0x126A}, {'K', 0x5BAD}, {'L', 0x4927}, {'M', 0x5FED}, {'N', 0x6B6D}, {'O', 0x2B6A}, {'P', 0x6BA4}, {'Q', 0x2B73}, {'R', 0x6BAD}, {'S', 0x388E}, {'T', 0x7492}, {'U', 0x5B6F}, {'V', 0x5B6A}, {'W', 0x5BFD}, {'X', 0x5AAD}, {'Y', 0x5A92}, {'Z', 0x72A7}, {'.', 0x0002}, {'-', 0x01C0}, {'_', 0x0007}, {'+', 0x05D0}, {':', 0x0410}, {'(', 0x1491}, {')', 0x4494}, {'/', 0x12A4}, {'=', 0x0E38}, {'*', 0x0AA8}
  };
  if (ch >= 'a' && ch <= 'z') ch = static_cast<char>(ch - 'a' + 'A');
  for (const auto& [c, g] : font)
    if (c == ch) return g;
  return 0;
}

struct Canvas {
  int w, h;
  std::vector<uint8_t> px;
  Canvas(int w_, int h_) : w(w_), h(h_), px(static_cast<size_t>(w_ * h_ * 3), 255) {}
  void set(int x, int y, std::array<uint8_t, 3> c) {
    if (x < 0 || y < 0 || x >= w || y >= h) return;
    auto* p = &px[static_cast<size_t>((y * w + x) * 3)];
    p[0] = c[0], p[1] = c[1], p[2] = c[2];
  }
  void line(int x0, int y0, int x1, int y1, std::array<uint8_t, 3> c) {
    const int n = std::max(std::abs(x1 - x0), std::abs(y1 - y0)) + 1;
    for (int i = 0; i <= n; ++i)
      set(x0 + (x1 - x0) * i / n, y0 + (y1 - y0) * i / n, c);
  }
  void dot(int x, int y, std::array<uint8_t, 3> c) {
    for (int dy = -3; dy <= 3; ++dy)
      for (int dx = -3; dx <= 3; ++dx)
        if (dx * dx + dy * dy <= 9) set(x + dx, y + dy, c);
  }
  // Text at 2x scale: 8 pixels per character.
  void text(int x, int y, const std::string& s, std::array<uint8_t, 3> c = {40, 40, 40}) {
    for (char ch : s) {
      const uint16_t g = glyph(ch);
      for (int row = 0; row < 5; ++row)
        for (int col = 0; col < 3; ++col)
          if (g & (1 << (14 - row * 3 - col)))
            for (int k = 0; k < 4; ++k) set(x + col * 2 + k % 2, y + row * 2 + k / 2, c);
      x += 8;
    }
  }
};

std::string fmt(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g", v);
  return b;
}

}  // namespace

std::string encode_png(int width, int height, const std::vector<uint8_t>& rgb) {
  if (width <= 0 || height <= 0 || rgb.size() != static_cast<size_t>(width) * height * 3)
    throw ::tandem::Refused("encode_png: the buffer does not hold width x height RGB pixels");
  std::string png("\x89PNG\r\n\x1a\n", 8);
  std::string ihdr;
  put32(ihdr, static_cast<uint32_t>(width));
  put32(ihdr, static_cast<uint32_t>(height));
  ihdr += std::string("\x08\x02\x00\x00\x00", 5);  // 8 bits, RGB, deflate, no filter, no interlace
  chunk(png, "IHDR", ihdr);
  std::string raw;
  const size_t row = static_cast<size_t>(width) * 3;
  for (int y = 0; y < height; ++y) {
    raw.push_back('\0');  // filter: none
    raw.append(reinterpret_cast<const char*>(&rgb[static_cast<size_t>(y) * row]), row);
  }
  std::string z("\x78\x01", 2);
  for (size_t at = 0; at < raw.size() || at == 0;) {
    const size_t n = std::min<size_t>(65535, raw.size() - at);
    const bool last = at + n >= raw.size();
    z.push_back(last ? '\x01' : '\x00');
    z.push_back(static_cast<char>(n & 0xFF));
    z.push_back(static_cast<char>(n >> 8));
    z.push_back(static_cast<char>(~n & 0xFF));
    z.push_back(static_cast<char>((~n >> 8) & 0xFF));
    z.append(raw, at, n);
    at += n;
    if (last) break;
  }
  uint32_t a = 1, b = 0;
  for (unsigned char ch : raw) a = (a + ch) % 65521, b = (b + a) % 65521;
  put32(z, (b << 16) | a);
  chunk(png, "IDAT", z);
  chunk(png, "IEND", "");
  return png;
}

void write_study_plot(const std::string& path, const std::vector<TrialRecord>& trials,
                      const std::vector<ParamSpec>& space, Direction direction,
                      const std::string& metric) {
  constexpr int kW = 360, kH = 260, kLeft = 56, kRight = 12, kTop = 28, kBottom = 36;
  const int panels = 1 + static_cast<int>(space.size());
  const int cols = std::min(panels, 3), rows = (panels + cols - 1) / cols;
  Canvas cv(cols * kW, rows * kH);
  std::vector<const TrialRecord*> shown;
  double lo = INFINITY, hi = -INFINITY;
  for (const auto& t : trials)
    if (t.state != TrialState::kFailed && t.value && std::isfinite(*t.value)) {
      shown.push_back(&t);
      lo = std::min(lo, *t.value), hi = std::max(hi, *t.value);
    }
  if (shown.empty()) lo = 0, hi = 1;
  if (hi - lo < 1e-12) lo -= 0.5, hi += 0.5;
  const std::array<uint8_t, 3> blue{31, 119, 180}, orange{255, 127, 14}, red{214, 39, 40},
      grey{160, 160, 160};

  for (int p = 0; p < panels; ++p) {
    const int ox = (p % cols) * kW, oy = (p / cols) * kH;
    const int x0 = ox + kLeft, x1 = ox + kW - kRight, y0 = oy + kTop, y1 = oy + kH - kBottom;
    cv.line(x0, y1, x1, y1, grey);
    cv.line(x0, y0, x0, y1, grey);
    cv.text(ox + 6, y0 - 2, fmt(hi));
    cv.text(ox + 6, y1 - 10, fmt(lo));
    auto ypix = [&](double v) { return y1 - static_cast<int>(std::lround((v - lo) / (hi - lo) * (y1 - y0 - 8))) - 4; };
    if (p == 0) {
      cv.text(ox + 6, oy + 6, metric + " per trial  (blue complete, orange pruned, red best)");
      int n = 0;
      for (const auto& t : trials) n = std::max(n, t.number + 1);
      n = std::max(n, 2);
      auto xpix = [&](int k) { return x0 + 6 + k * (x1 - x0 - 12) / (n - 1); };
      cv.text(x0, y1 + 8, "0");
      cv.text(x1 - 8 * static_cast<int>(std::to_string(n - 1).size()), y1 + 8, std::to_string(n - 1));
      cv.text(x0 + (x1 - x0) / 2 - 20, y1 + 20, "trial");
      std::vector<const TrialRecord*> order = shown;
      std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->number < b->number; });
      double best = NAN;
      int px = -1, py = -1;
      for (auto* t : order) {
        if (t->state == TrialState::kComplete &&
            (std::isnan(best) || (direction == Direction::kMinimize ? *t->value < best : *t->value > best)))
          best = *t->value;
        cv.dot(xpix(t->number), ypix(*t->value), t->state == TrialState::kComplete ? blue : orange);
        if (!std::isnan(best)) {
          const int x = xpix(t->number), y = ypix(best);
          if (px >= 0) cv.line(px, py, x, py, red), cv.line(x, py, x, y, red);
          px = x, py = y;
        }
      }
      continue;
    }
    const auto& s = space[static_cast<size_t>(p - 1)];
    cv.text(ox + 6, oy + 6, metric + " against " + s.name +
                                (s.type == ParamType::kLogUniform ? " (log axis)" : ""));
    double a = 0, b = 1;
    if (s.type == ParamType::kCategorical) {
      a = -0.5, b = static_cast<double>(s.choices.size()) - 0.5;
      for (size_t k = 0; k < s.choices.size(); ++k) {
        const int x = x0 + static_cast<int>((static_cast<double>(k) - a) / (b - a) * (x1 - x0));
        cv.text(x - 4 * static_cast<int>(std::min<size_t>(s.choices[k].size(), 8)), y1 + 8,
                s.choices[k].substr(0, 8));
      }
    } else {
      a = s.type == ParamType::kLogUniform ? std::log(s.low) : s.low;
      b = s.type == ParamType::kLogUniform ? std::log(s.high) : s.high;
      if (s.type == ParamType::kInt) a -= 0.5, b += 0.5;
      cv.text(x0, y1 + 8, fmt(s.low));
      cv.text(x1 - 8 * static_cast<int>(fmt(s.high).size()), y1 + 8, fmt(s.high));
    }
    cv.text(x0 + (x1 - x0) / 2 - 4 * static_cast<int>(s.name.size()), y1 + 20, s.name);
    for (auto* t : shown) {
      if (!t->params.count(s.name)) continue;
      double v;
      try {
        v = internal_value(s, t->params.at(s.name));
      } catch (const std::exception&) {
        continue;
      }
      const int x = x0 + static_cast<int>(std::lround((v - a) / (b - a) * (x1 - x0)));
      cv.dot(x, ypix(*t->value), t->state == TrialState::kComplete ? blue : orange);
    }
  }
  const std::string png = encode_png(cv.w, cv.h, cv.px);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(png.data(), static_cast<std::streamsize>(png.size()));
    if (!out) throw std::runtime_error("cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error("cannot write " + path);
}

}  // namespace tandem::trials
