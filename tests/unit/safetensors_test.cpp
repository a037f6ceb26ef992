// safetensors writer and reader: round trips for every dtype, the exact bytes written, the
// reader's API, the writer's input checks, and a reader written in Python with only json+numpy.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "checkpoint_test_util.h"
#include "tandem/checkpoint/safetensors.h"

using namespace tandem::checkpoint;
using tandem_test::message_of;
using tandem_test::TempDir;

namespace {

// Values 0, 1, 2, ... (0/1 for bool) of `type`, shaped [2, 3].
at::Tensor sample(c10::ScalarType type) {
  at::Tensor t = at::arange(6, at::kDouble).reshape({2, 3});
  if (type == at::kBool) return (t.remainder(2) == 1);
  if (type == at::kFloat || type == at::kDouble || type == at::kHalf || type == at::kBFloat16) {
    t = t * 0.5 - 1;  // negatives and fractions that every float type holds exactly
  }
  return t.to(type);
}

}  // namespace

TEST(Safetensors, DtypeNamesAndSizes) {
  EXPECT_EQ(all_dtypes().size(), 12u);
  for (Dtype d : all_dtypes()) EXPECT_EQ(dtype_from_name(dtype_name(d)), d);
  EXPECT_EQ(dtype_from_name("f32"), std::nullopt);  // the format is case-sensitive
  EXPECT_EQ(dtype_size(Dtype::kBF16), 2u);
  EXPECT_EQ(dtype_size(Dtype::kF8_E5M2), 1u);
  EXPECT_EQ(dtype_of(at::kBFloat16), Dtype::kBF16);
  EXPECT_EQ(to_scalar_type(Dtype::kBool), at::kBool);
  EXPECT_THROW(dtype_of(at::kComplexFloat), std::invalid_argument);
}

TEST(Safetensors, RoundTripEveryAvailableDtype) {
  TempDir dir;
  NamedTensors tensors;
  for (Dtype d : all_dtypes()) {
    if (!dtype_supported(d)) continue;  // F8 before LibTorch 2.1
    tensors.emplace_back(std::string("t_") + std::string(dtype_name(d)), sample(to_scalar_type(d)));
  }
  ASSERT_GE(tensors.size(), 10u);
  SafetensorsMetadata meta = {{"format", "pt"}, {"step", "12"}, {"note", "ünïcode"}};
  std::string path = dir.file("all.safetensors");
  save_safetensors(path, tensors, meta);

  SafetensorsFile f(path);
  EXPECT_EQ(f.size(), tensors.size());
  EXPECT_EQ(f.metadata(), meta);
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(f.contains(name));
    EXPECT_EQ(to_scalar_type(f.info(name).dtype), t.scalar_type());
    EXPECT_EQ(f.info(name).shape, t.sizes().vec());
    at::Tensor back = f.tensor(name);
    EXPECT_EQ(back.scalar_type(), t.scalar_type());
    EXPECT_TRUE(at::equal(back, t));
  }
}

TEST(Safetensors, ScalarsEmptyAndNonContiguousTensors) {
  TempDir dir;
  at::Tensor scalar = at::scalar_tensor(3.25, at::kFloat);
  at::Tensor empty = at::empty({0, 4}, at::kLong);
  at::Tensor transposed = at::arange(12, at::kInt).reshape({3, 4}).t();  // not contiguous
  at::Tensor sliced = at::arange(10, at::kShort).slice(0, 1, 10, 3);     // strided view
  std::string path = dir.file("shapes.safetensors");
  save_safetensors(path,
                   {{"scalar", scalar}, {"empty", empty}, {"t", transposed}, {"sliced", sliced}});
  SafetensorsFile f(path);
  EXPECT_EQ(f.info("scalar").shape, std::vector<int64_t>{});
  EXPECT_EQ(f.info("empty").shape, (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(f.info("empty").nbytes(), 0u);
  EXPECT_TRUE(at::equal(f.tensor("scalar"), scalar));
  EXPECT_TRUE(at::equal(f.tensor("empty"), empty));
  EXPECT_TRUE(at::equal(f.tensor("t"), transposed));
  EXPECT_TRUE(at::equal(f.tensor("sliced"), sliced));
}

TEST(Safetensors, EmptyFileHasAnEmptyHeader) {
  std::string bytes = serialize_safetensors({});
  EXPECT_EQ(bytes, tandem_test::u64_le(8) + "{}      ");
  TempDir dir;
  tandem_test::write_file(dir.file("e.safetensors"), bytes);
  SafetensorsFile f(dir.file("e.safetensors"));
  EXPECT_EQ(f.size(), 0u);
  EXPECT_TRUE(f.names().empty());
}

// The file written by hand from the format description: compact JSON, "__metadata__" first,
// tensors by element size (largest first) then name, each {"dtype","shape","data_offsets"},
// spaces up to a multiple of 8, then the little-endian bytes in the same order.
TEST(Safetensors, WriterIsByteExact) {
  std::string json = R"({"__metadata__":{"format":"pt"},)"
                     R"("c":{"dtype":"F64","shape":[],"data_offsets":[0,8]},)"
                     R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},)"
                     R"("d":{"dtype":"BF16","shape":[1],"data_offsets":[16,18]},)"
                     R"("a_i8":{"dtype":"I8","shape":[3],"data_offsets":[18,21]}})";
  ASSERT_EQ(json.size(), 251u);
  json += std::string(5, ' ');  // 256 = 32 * 8
  const unsigned char data[] = {
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xE0, 0x3F,  // c: 0.5 as F64
      0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0x40,  // b: 1.0f, 2.0f
      0x80, 0x3F,                                      // d: 1.0 as BF16
      0x01, 0x02, 0x03,                                // a_i8: 1, 2, 3 as I8
  };
  std::string expected = tandem_test::u64_le(256) + json +
                         std::string(reinterpret_cast<const char*>(data), sizeof(data));

  NamedTensors tensors = {
      {"b", at::tensor({1.0f, 2.0f})},
      {"a_i8", at::tensor({1, 2, 3}, at::kChar)},
      {"d", at::ones({1}, at::kBFloat16)},
      {"c", at::scalar_tensor(0.5, at::kDouble)},
  };
  EXPECT_EQ(serialize_safetensors(tensors, {{"format", "pt"}}), expected);

  TempDir dir;
  save_safetensors(dir.file("x.safetensors"), tensors, {{"format", "pt"}});
  EXPECT_EQ(tandem_test::read_file(dir.file("x.safetensors")), expected);
}

TEST(Safetensors, EveryTensorIsAlignedToItsElementSize) {
  NamedTensors tensors = {{"u8", at::ones({3}, at::kByte)},
                          {"f16", at::ones({3}, at::kHalf)},
                          {"f32", at::ones({3}, at::kFloat)},
                          {"f64", at::ones({3}, at::kDouble)},
                          {"b", at::ones({1}, at::kBool)}};
  std::string bytes = serialize_safetensors(tensors);
  SafetensorsHeader h = parse_safetensors_header(bytes, bytes.size(), "mem");
  EXPECT_EQ(h.header_size % 8, 0u);
  for (const auto& [name, info] : h.tensors) {
    EXPECT_EQ((h.data_offset() + info.begin) % dtype_size(info.dtype), 0u) << name;
  }
}

TEST(Safetensors, ReadsHeadersOfOtherWriters) {
  // Whitespace, another key order inside entries, extra keys and trailing padding are all fine.
  std::string json =
      "{ \"x\" : { \"data_offsets\": [0, 4], \"shape\": [ 2 ], \"dtype\": \"I16\", "
      "\"extra\": 1 },\n \"__metadata__\": {} }" +
      std::string(13, ' ');
  std::string bytes = tandem_test::u64_le(json.size()) + json + std::string("\x01\x00\xff\xff", 4);
  TempDir dir;
  tandem_test::write_file(dir.file("o.safetensors"), bytes);
  SafetensorsFile f(dir.file("o.safetensors"));
  EXPECT_TRUE(at::equal(f.tensor("x"), at::tensor({1, -1}, at::kShort)));
  EXPECT_TRUE(f.metadata().empty());
}

TEST(Safetensors, ReaderApi) {
  TempDir dir;
  std::string path = dir.file("r.safetensors");
  at::Tensor w = at::randn({4, 3});
  save_safetensors(path, {{"w", w}, {"a.b", at::zeros({2}, at::kLong)}});
  SafetensorsFile f(path);
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.names(), (std::vector<std::string>{"a.b", "w"}));
  EXPECT_EQ(f.info("w").dtype, Dtype::kF32);
  EXPECT_EQ(f.info("w").nbytes(), 48u);
  auto msg = message_of<std::invalid_argument>([&] { f.info("nope"); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("no tensor named 'nope'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("a.b, w"), std::string::npos) << msg;

  // A tensor owns its memory: it survives the file.
  at::Tensor kept = f.tensor("w");
  SafetensorsFile moved = std::move(f);
  EXPECT_TRUE(at::equal(moved.tensor("w"), w));
  { SafetensorsFile gone = std::move(moved); }
  EXPECT_TRUE(at::equal(kept, w));
}

TEST(Safetensors, ReadIntoCopiesConvertsAndChecksShape) {
  TempDir dir;
  std::string path = dir.file("r.safetensors");
  at::Tensor w = at::randn({4, 3});
  save_safetensors(path, {{"w", w}});
  SafetensorsFile f(path);

  at::Tensor same = at::zeros({4, 3});
  f.read_into("w", same);  // direct copy
  EXPECT_TRUE(at::equal(same, w));

  at::Tensor wider = at::zeros({4, 3}, at::kDouble);
  f.read_into("w", wider);  // converted
  EXPECT_TRUE(at::equal(wider, w.to(at::kDouble)));

  at::Tensor strided = at::zeros({3, 4}).t();  // [4, 3], not contiguous
  f.read_into("w", strided);
  EXPECT_TRUE(at::equal(strided, w));

  at::Tensor wrong = at::zeros({3, 4});
  auto msg = message_of<std::invalid_argument>([&] { f.read_into("w", wrong); });
  EXPECT_NE(msg.find("[4, 3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3, 4]"), std::string::npos) << msg;
}

TEST(Safetensors, WriterRejectsBadInput) {
  auto bad = [](const NamedTensors& t, const SafetensorsMetadata& m = {}) {
    return message_of<std::invalid_argument>([&] { serialize_safetensors(t, m); });
  };
  at::Tensor x = at::ones({2});
  EXPECT_NE(bad({{"a", x}, {"a", x}}).find("tensor 'a' is given twice"), std::string::npos);
  EXPECT_NE(bad({{"__metadata__", x}}).find("__metadata__"), std::string::npos);
  EXPECT_NE(bad({{"u", at::Tensor()}}).find("tensor 'u' is undefined"), std::string::npos);
  auto complex = bad({{"z", at::ones({2}, at::kComplexFloat)}});
  EXPECT_NE(complex.find("tensor 'z'"), std::string::npos) << complex;
  EXPECT_NE(complex.find("no safetensors equivalent"), std::string::npos) << complex;
  EXPECT_NE(bad({{"\xff\xfe", x}}).find("not valid UTF-8"), std::string::npos);
  EXPECT_NE(bad({{"ok", x}}, {{"k", "\xc3"}}).find("not valid UTF-8"), std::string::npos);

  auto io = message_of<std::runtime_error>([&] {
    save_safetensors("/nonexistent-dir/x.safetensors", {{"a", x}});
  });
  EXPECT_NE(io.find("/nonexistent-dir/x.safetensors"), std::string::npos) << io;
}

TEST(Safetensors, SharedStorageIsWrittenInFull) {
  at::Tensor base = at::arange(8, at::kFloat);
  NamedTensors tensors = {{"all", base}, {"half", base.slice(0, 4, 8)}, {"alias", base}};
  TempDir dir;
  save_safetensors(dir.file("s.safetensors"), tensors);
  SafetensorsFile f(dir.file("s.safetensors"));
  EXPECT_TRUE(at::equal(f.tensor("half"), base.slice(0, 4, 8)));
  EXPECT_TRUE(at::equal(f.tensor("alias"), base));
  EXPECT_EQ(f.header().data_size, (8u + 4u + 8u) * 4u);
}

// F8: the header always parses; the tensor materialises only where LibTorch has float8.
TEST(Safetensors, Float8) {
  std::string json = R"({"e4":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]},)"
                     R"("e5":{"dtype":"F8_E5M2","shape":[1],"data_offsets":[2,3]}})";
  TempDir dir;
  std::string path = dir.file("f8.safetensors");
  tandem_test::write_file(path, tandem_test::u64_le(json.size()) + json +
                                    std::string("\x38\x40\x3c", 3));  // 1.0, 2.0 | 1.0
  SafetensorsFile f(path);
  EXPECT_EQ(f.info("e4").dtype, Dtype::kF8_E4M3);
  EXPECT_EQ(f.info("e5").dtype, Dtype::kF8_E5M2);
  if (dtype_supported(Dtype::kF8_E4M3)) {
    EXPECT_TRUE(at::equal(f.tensor("e4").to(at::kFloat), at::tensor({1.0f, 2.0f})));
    EXPECT_TRUE(at::equal(f.tensor("e5").to(at::kFloat), at::tensor({1.0f})));
  } else {
    auto msg = message_of<std::runtime_error>([&] { f.tensor("e4"); });
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("tensor 'e4'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("F8_E4M3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("LibTorch >= 2.1"), std::string::npos) << msg;
  }
}

namespace {

// The Python interpreter with numpy: the test environment's (TANDEM_PYTHON at configure time,
// which has numpy), else /usr/bin/python3, else python3 on PATH; "" if none has numpy.
std::string python_with_numpy() {
  const std::string configured = TANDEM_TEST_PYTHON;
  if (!configured.empty()) return configured;
  for (const char* py : {"/usr/bin/python3", "python3"}) {
    std::string cmd = std::string(py) + " -c 'import numpy' >/dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return py;
  }
  return "";
}

std::string run_capture(const std::string& cmd, int* status) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  *status = ::pclose(p);
  return out;
}

}  // namespace

TEST(Safetensors, PythonNumpyReaderAgrees) {
  std::string py = python_with_numpy();
  if (py.empty()) GTEST_SKIP() << "no python3 with numpy (configure with -DTANDEM_PYTHON=...)";
  TempDir dir;
  NamedTensors tensors;
  for (Dtype d : all_dtypes()) {
    if (!dtype_supported(d)) continue;
    tensors.emplace_back(std::string(dtype_name(d)), sample(to_scalar_type(d)));
  }
  tensors.emplace_back("scalar", at::scalar_tensor(7, at::kLong));
  tensors.emplace_back("empty", at::empty({0, 2}, at::kFloat));
  std::string path = dir.file("py.safetensors");
  save_safetensors(path, tensors, {{"format", "pt"}});

  int status = -1;
  std::string out = run_capture(py + " " + TANDEM_READ_SAFETENSORS_PY + " " + path, &status);
  ASSERT_EQ(status, 0) << out;
  auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["metadata"], nlohmann::json({{"format", "pt"}}));
  ASSERT_EQ(j["tensors"].size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    const auto& e = j["tensors"][name];
    EXPECT_EQ(e["dtype"], std::string(dtype_name(dtype_of(t.scalar_type()))));
    EXPECT_EQ(e["shape"].get<std::vector<int64_t>>(), t.sizes().vec());
    at::Tensor flat = t.to(at::kDouble).reshape({-1});
    auto values = e["values"].get<std::vector<double>>();
    ASSERT_EQ(values.size(), static_cast<std::size_t>(flat.numel()));
    for (std::size_t i = 0; i < values.size(); ++i) {
      EXPECT_EQ(values[i], flat[static_cast<int64_t>(i)].item<double>()) << "element " << i;
    }
  }
}
