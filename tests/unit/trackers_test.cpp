// Trackers: each file format read back by an independent reader (JSON lines, CSV, TensorBoard
// records with both CRCs checked and the protobufs decoded by hand here).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tandem/track/trackers.h"
#include "../common/temp_dir.h"

namespace fs = std::filesystem;
using tandem::testing::TempDir;
using tandem::track::make_trackers;

namespace {

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out(1);
  for (char c : s) {
    if (c == sep) out.emplace_back();
    else out.back() += c;
  }
  return out;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string line; std::getline(ss, line);) out.push_back(line);
  return out;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// --- an independent TensorBoard reader ------------------------------------------------------

// Bit-at-a-time CRC32C (not the library's table): an independent check of its checksums.
uint32_t crc32c_bitwise(const std::string& data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : data) {
    crc ^= byte;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

uint64_t le(const std::string& s, size_t off, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[off + i]);
  return v;
}

// One protobuf field: a varint / fixed value, or the bytes of a length-delimited one.
struct Field {
  int wire = 0;
  uint64_t number = 0;  // varint, fixed32 or fixed64 bits
  std::string bytes;
};
using Message = std::multimap<uint32_t, Field>;

uint64_t read_varint(const std::string& s, size_t& pos) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    if (pos >= s.size() || shift > 63) throw std::runtime_error("bad varint");
    auto b = static_cast<unsigned char>(s[pos++]);
    v |= static_cast<uint64_t>(b & 0x7F) << shift;
    if (!(b & 0x80)) return v;
  }
}

Message decode(const std::string& s) {
  Message m;
  size_t pos = 0;
  while (pos < s.size()) {
    uint64_t key = read_varint(s, pos);
    Field f;
    f.wire = static_cast<int>(key & 7);
    switch (f.wire) {
      case 0: f.number = read_varint(s, pos); break;
      case 1: f.number = le(s, pos, 8); pos += 8; break;
      case 5: f.number = le(s, pos, 4); pos += 4; break;
      case 2: {
        uint64_t len = read_varint(s, pos);
        if (pos + len > s.size()) throw std::runtime_error("field past the end");
        f.bytes = s.substr(pos, len);
        pos += len;
        break;
      }
      default: throw std::runtime_error("unexpected wire type " + std::to_string(f.wire));
    }
    if (pos > s.size()) throw std::runtime_error("field past the end");
    m.emplace(static_cast<uint32_t>(key >> 3), f);
  }
  return m;
}

const Field& one(const Message& m, uint32_t field) {
  auto [a, b] = m.equal_range(field);
  if (a == b || std::next(a) != b) throw std::runtime_error("expected exactly one field " + std::to_string(field));
  return a->second;
}

double as_double(const Field& f) {
  double d;
  std::memcpy(&d, &f.number, 8);
  return d;
}

float as_float(const Field& f) {
  uint32_t bits = static_cast<uint32_t>(f.number);
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

// Splits an event file into records, checking lengths and both masked CRCs.
std::vector<std::string> read_records(const std::string& file) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < file.size()) {
    EXPECT_LE(pos + 12, file.size()) << "truncated record header";
    std::string len_bytes = file.substr(pos, 8);
    uint64_t len = le(file, pos, 8);
    EXPECT_EQ(le(file, pos + 8, 4), masked(crc32c_bitwise(len_bytes))) << "length CRC";
    EXPECT_LE(pos + 12 + len + 4, file.size()) << "truncated record";
    std::string data = file.substr(pos + 12, len);
    EXPECT_EQ(le(file, pos + 12 + len, 4), masked(crc32c_bitwise(data))) << "data CRC";
    out.push_back(data);
    pos += 12 + len + 4;
  }
  return out;
}

}  // namespace

TEST(TensorBoardReader, Crc32cKnownAnswer) {
  EXPECT_EQ(crc32c_bitwise("123456789"), 0xE3069283u);  // the standard CRC-32C check value
  EXPECT_EQ(crc32c_bitwise(std::string(32, '\0')), 0x8A9136AAu);  // RFC 3720 B.4
}

TEST(Trackers, JsonlLinesAndHparamsFile) {
  TempDir dir;
  double before = now_s();
  {
    auto set = make_trackers({"jsonl"}, dir.str(), "proj");
    ASSERT_EQ(set.size(), 1u);
    set.store_init_configuration({{"lr", 3e-4}, {"batch_size", 32}, {"model", "gpt"}, {"amp", true}});
    set.log({{"loss", 1.5}, {"acc", 0.25}}, 1);
    set.log({{"loss", 1.25}, {"bad", std::nan("")}}, 2);
  }  // destroyed: finished
  double after = now_s();
  auto lines = lines_of(read_file(dir.path / "proj" / "metrics.jsonl"));
  ASSERT_EQ(lines.size(), 2u);
  auto a = nlohmann::json::parse(lines[0]);
  auto b = nlohmann::json::parse(lines[1]);
  EXPECT_EQ(a["step"], 1);
  EXPECT_EQ(a["values"]["loss"], 1.5);
  EXPECT_EQ(a["values"]["acc"], 0.25);
  EXPECT_GE(a["wall_time"].get<double>(), before - 1);
  EXPECT_LE(a["wall_time"].get<double>(), after + 1);
  EXPECT_EQ(b["step"], 2);
  EXPECT_EQ(b["values"]["loss"], 1.25);
  EXPECT_TRUE(b["values"]["bad"].is_null());
  auto h = nlohmann::json::parse(read_file(dir.path / "proj" / "hparams.json"));
  EXPECT_EQ(h["lr"], 3e-4);
  EXPECT_TRUE(h["batch_size"].is_number_integer());
  EXPECT_EQ(h["batch_size"], 32);
  EXPECT_EQ(h["model"], "gpt");
  EXPECT_EQ(h["amp"], true);

  // A resumed run appends.
  {
    auto set = make_trackers({"jsonl"}, dir.str(), "proj");
    set.log({{"loss", 1.0}}, 3);
  }
  EXPECT_EQ(lines_of(read_file(dir.path / "proj" / "metrics.jsonl")).size(), 3u);
}

TEST(Trackers, CsvHeaderFromFirstKeysWidenedByNewOnes) {
  TempDir dir;
  auto set = make_trackers({"csv"}, dir.str(), "proj");
  set.store_init_configuration({{"lr", 0.001}, {"note", "a,b"}});
  set.log({{"loss", 1.5}, {"acc", 0.25}}, 1);
  set.log({{"loss", 1.25}}, 2);                      // acc missing: empty cell
  set.log({{"loss", 1.0}, {"grad_norm", 3.5}}, 3);  // new key: a column on the right
  set.finish();
  auto rows = lines_of(read_file(dir.path / "proj" / "metrics.csv"));
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_EQ(rows[0], "step,wall_time,acc,loss,grad_norm");
  std::vector<std::vector<std::string>> expect = {
      {"1", "", "0.25", "1.5", ""}, {"2", "", "", "1.25", ""}, {"3", "", "", "1", "3.5"}};
  for (size_t r = 0; r < expect.size(); ++r) {
    auto cells = split(rows[r + 1], ',');
    ASSERT_EQ(cells.size(), 5u) << rows[r + 1];
    EXPECT_GT(std::stod(cells[1]), 1e9) << "wall_time in Unix seconds";
    cells[1] = "";
    EXPECT_EQ(cells, expect[r]);
  }
  EXPECT_EQ(read_file(dir.path / "proj" / "hparams.csv"), "name,value\nlr,0.001\nnote,\"a,b\"\n");

  // A resumed run continues with the columns already in the file.
  tandem::track::CsvTracker again((dir.path / "proj").string());
  EXPECT_EQ(again.columns(), (std::vector<std::string>{"step", "wall_time", "acc", "loss", "grad_norm"}));
  again.log({{"loss", 0.5}}, 4);
  again.finish();
  rows = lines_of(read_file(dir.path / "proj" / "metrics.csv"));
  ASSERT_EQ(rows.size(), 5u);
  auto cells = split(rows[4], ',');
  ASSERT_EQ(cells.size(), 5u);
  EXPECT_EQ(cells[0], "4");
  EXPECT_EQ(cells[3], "0.5");
  EXPECT_EQ(cells[4], "");
  EXPECT_THROW(again.log({{"loss", 0.1}}, 5), std::logic_error);
}

TEST(Trackers, TensorBoardRecordsDecodeIndependently) {
  TempDir dir;
  double before = now_s();
  std::string path;
  {
    auto set = make_trackers({"tensorboard"}, dir.str(), "proj");
    auto* tb = dynamic_cast<tandem::track::TensorBoardTracker*>(set.get("tensorboard"));
    ASSERT_NE(tb, nullptr);
    path = tb->path();
    set.store_init_configuration({{"lr", 3e-4}, {"batch_size", 32}});
    set.log({{"loss", 1.5}, {"acc", 0.25}}, 7);
    set.log({{"loss", 1.25}}, 8);
    set.log({{"loss", -2.0}}, -1);  // negative steps are 10-byte varints
  }
  double after = now_s();
  auto name = fs::path(path).filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  EXPECT_EQ(fs::path(path).parent_path(), dir.path / "proj");

  auto records = read_records(read_file(path));
  ASSERT_EQ(records.size(), 1u + 1u + 3u + 1u);

  // The file-version event.
  auto first = decode(records[0]);
  EXPECT_EQ(one(first, 3).bytes, "brain.Event:2");
  double wall = as_double(one(first, 1));
  EXPECT_GE(wall, before - 1);
  EXPECT_LE(wall, after + 1);

  // The hparams text summary: Value{tag, metadata{plugin_data{plugin_name "text"}}, tensor}.
  auto hp = decode(records[1]);
  auto hp_value = decode(one(decode(one(hp, 5).bytes), 1).bytes);
  EXPECT_EQ(one(hp_value, 1).bytes, "hparams");
  auto plugin = decode(one(decode(one(hp_value, 9).bytes), 1).bytes);
  EXPECT_EQ(one(plugin, 1).bytes, "text");
  auto tensor = decode(one(hp_value, 8).bytes);
  EXPECT_EQ(one(tensor, 1).number, 7u);  // DT_STRING
  auto dim = decode(one(decode(one(tensor, 2).bytes), 2).bytes);
  EXPECT_EQ(one(dim, 1).number, 1u);
  std::string text = one(tensor, 8).bytes;
  EXPECT_NE(text.find("| lr | 0.0003 |"), std::string::npos) << text;
  EXPECT_NE(text.find("| batch_size | 32 |"), std::string::npos) << text;

  // Scalars: one event per value, in key order within a log call.
  struct Scalar {
    int64_t step;
    std::string tag;
    float value;
  };
  std::vector<Scalar> expect = {{7, "acc", 0.25f}, {7, "loss", 1.5f}, {8, "loss", 1.25f},
                                {-1, "loss", -2.0f}};
  for (size_t i = 0; i < expect.size(); ++i) {
    auto ev = decode(records[2 + i]);
    EXPECT_EQ(static_cast<int64_t>(one(ev, 2).number), expect[i].step);
    EXPECT_EQ(one(ev, 1).wire, 1);
    auto summary = decode(one(ev, 5).bytes);
    auto value = decode(one(summary, 1).bytes);
    EXPECT_EQ(one(value, 1).bytes, expect[i].tag);
    EXPECT_EQ(one(value, 2).wire, 5);
    EXPECT_EQ(as_float(one(value, 2)), expect[i].value);
  }
}

TEST(Trackers, AllNonMainAndBadNames) {
  TempDir dir;
  {
    auto set = make_trackers({"all"}, dir.str(), "run");
    EXPECT_EQ(set.size(), 3u);
    EXPECT_NE(set.get("jsonl"), nullptr);
    EXPECT_NE(set.get("csv"), nullptr);
    EXPECT_NE(set.get("tensorboard"), nullptr);
    set.log({{"x", 1}}, 1);
  }
  EXPECT_TRUE(fs::exists(dir.path / "run" / "metrics.jsonl"));
  EXPECT_TRUE(fs::exists(dir.path / "run" / "metrics.csv"));

  auto none = make_trackers({"all"}, dir.str(), "other", /*is_main_process=*/false);
  EXPECT_TRUE(none.empty());
  none.log({{"x", 1}}, 1);  // a no-op
  EXPECT_FALSE(fs::exists(dir.path / "other"));

  try {
    make_trackers({"jsonl", "wandb"}, dir.str(), "run");
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("'wandb'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("tensorboard"), std::string::npos) << msg;
  }
  EXPECT_THROW(make_trackers({"csv"}, "", "run"), std::invalid_argument);
}

TEST(Trackers, OwnTrackerJoinsASet) {
  struct Counting : tandem::track::Tracker {
    int* logs;
    int* finishes;
    Counting(int* l, int* f) : logs(l), finishes(f) {}
    std::string name() const override { return "counting"; }
    void store_init_configuration(const tandem::track::Hparams&) override {}
    void log(const std::map<std::string, double>&, int64_t) override { ++*logs; }
    void finish() override { ++*finishes; }
  };
  int logs = 0, finishes = 0;
  {
    tandem::track::TrackerSet set;
    set.add(std::make_unique<Counting>(&logs, &finishes));
    set.log({{"a", 1}}, 1);
    set.finish();
    set.finish();
  }
  EXPECT_EQ(logs, 1);
  EXPECT_EQ(finishes, 1);
}
