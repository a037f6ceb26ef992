// The safetensors reader's validation: one crafted file per rule, each error naming the file,
// the tensor and what was expected; and truncated or corrupted files never crash.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "checkpoint_test_util.h"
#include "tandem/checkpoint/safetensors.h"

using namespace tandem::checkpoint;
using tandem_test::u64_le;

namespace {

class SafetensorsValidation : public ::testing::Test {
 protected:
  // The error of opening a file holding `bytes`; "" (and a test failure) when it opens.
  std::string error_of_bytes(const std::string& bytes) {
    std::string path = dir_.file("bad.safetensors");
    tandem_test::write_file(path, bytes);
    try {
      SafetensorsFile f(path);
    } catch (const SafetensorsError& e) {
      std::string msg = e.what();
      EXPECT_EQ(msg.rfind("safetensors file '" + path + "': ", 0), 0u) << msg;
      // The in-memory parser says the same, naming its source.
      try {
        parse_safetensors_header(bytes, bytes.size(), "buffer");
        ADD_FAILURE() << "the buffer parser accepted what the file reader rejected";
      } catch (const SafetensorsError& e2) {
        EXPECT_EQ(std::string(e2.what()).rfind("safetensors file 'buffer': ", 0), 0u);
      }
      return msg;
    }
    ADD_FAILURE() << "the file was accepted";
    return "";
  }
  // A file with this JSON header (unpadded) and these data bytes.
  std::string error_of(const std::string& json, const std::string& data = "") {
    return error_of_bytes(u64_le(json.size()) + json + data);
  }

  tandem_test::TempDir dir_;
};

const std::string kF32x2 = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";

}  // namespace

TEST_F(SafetensorsValidation, FileShorterThanTheLengthField) {
  auto msg = error_of_bytes("abc");
  EXPECT_HAS(msg, "has 3 bytes, expected at least 8");
  EXPECT_HAS(error_of_bytes(""), "has 0 bytes");
}

TEST_F(SafetensorsValidation, HeaderLargerThanTheLimit) {
  auto msg = error_of_bytes(u64_le(200'000'000) + "{}");
  EXPECT_HAS(msg, "header length is 200000000 bytes, more than the limit of 100000000");
}

TEST_F(SafetensorsValidation, HeaderLongerThanTheFile) {
  auto msg = error_of_bytes(u64_le(100) + "{}");
  EXPECT_HAS(msg, "header length is 100 bytes, but only 2 bytes follow");
  EXPECT_HAS(error_of_bytes(u64_le(~0ULL) + "{}"), "more than the limit");
}

TEST_F(SafetensorsValidation, HeaderIsNotJson) {
  EXPECT_HAS(error_of("{abc}"), "the header is not valid UTF-8 JSON");
  EXPECT_HAS(error_of(R"({"a":{"dtype":"F32"})"), "not valid UTF-8 JSON");  // unterminated
  EXPECT_HAS(error_of(std::string("{}\0\0\0\0\0\0", 8)), "NUL byte at offset 10");
  EXPECT_HAS(error_of(std::string("{}\0{\"a\":1}", 10)), "NUL byte at offset 10");
}

TEST_F(SafetensorsValidation, HeaderIsNotUtf8) {
  EXPECT_HAS(error_of("{\"\xff\xfe\":" + kF32x2 + "}", std::string(8, '\0')),
             "not valid UTF-8 JSON");
}

TEST_F(SafetensorsValidation, HeaderIsNotAnObject) {
  EXPECT_HAS(error_of("[1, 2]   "), "must start with '{' (a JSON object), found byte 0x5b");
  EXPECT_HAS(error_of("\xEF\xBB\xBF{}"), "found byte 0xef");  // a BOM
  EXPECT_HAS(error_of(""), "found an empty header");
}

TEST_F(SafetensorsValidation, EntryIsNotAnObject) {
  auto msg = error_of(R"({"w": 3})");
  EXPECT_HAS(msg, "tensor 'w': expected an object");
  EXPECT_HAS(msg, "found number 3");
}

TEST_F(SafetensorsValidation, EntryLacksAField) {
  EXPECT_HAS(error_of(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0')),
             "tensor 'w': missing \"dtype\"");
  EXPECT_HAS(error_of(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", std::string(8, '\0')),
             "tensor 'w': missing \"shape\"");
  EXPECT_HAS(error_of(R"({"w":{"dtype":"F32","shape":[2]}})", std::string(8, '\0')),
             "tensor 'w': missing \"data_offsets\"");
}

TEST_F(SafetensorsValidation, DtypeIsNotAString) {
  EXPECT_HAS(error_of(R"({"w":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})"),
             "tensor 'w': \"dtype\" must be a string, found number 4");
}

TEST_F(SafetensorsValidation, UnknownDtype) {
  auto msg = error_of(R"({"w":{"dtype":"F128","shape":[2],"data_offsets":[0,8]}})");
  EXPECT_HAS(msg, "tensor 'w': unknown dtype \"F128\"");
  EXPECT_HAS(msg, "expected one of F64, F32");
  EXPECT_HAS(error_of(R"({"w":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}})"),
             "unknown dtype \"f32\"");
}

TEST_F(SafetensorsValidation, ShapeIsNotAnArrayOfNonNegativeIntegers) {
  EXPECT_HAS(error_of(R"({"w":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})"),
             "tensor 'w': \"shape\" must be an array");
  EXPECT_HAS(error_of(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})"),
             "tensor 'w': \"shape\" must hold non-negative integers, found number -2");
  EXPECT_HAS(error_of(R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,8]}})"),
             "found number 1.5");
  EXPECT_HAS(error_of(R"({"w":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})"),
             "found string \"2\"");
  EXPECT_HAS(error_of(R"({"w":{"dtype":"F32","shape":[9223372036854775808],)"
                      R"("data_offsets":[0,8]}})"),
             "\"shape\" value 9223372036854775808 exceeds the largest allowed");
}

TEST_F(SafetensorsValidation, OffsetsAreNotAPairOfNonNegativeIntegers) {
  EXPECT_HAS(error_of(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})"),
             "tensor 'w': \"data_offsets\" must be an array [begin, end] of two integers");
  EXPECT_HAS(error_of(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8,9]}})"),
             "must be an array [begin, end]");
  EXPECT_HAS(error_of(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":{"a":1}}})"),
             "must be an array [begin, end]");
  EXPECT_HAS(error_of(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})"),
             "tensor 'w': \"data_offsets\" must hold non-negative integers, found number -8");
  EXPECT_HAS(error_of(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,1e3]}})"),
             "\"data_offsets\" must hold non-negative integers");
}

TEST_F(SafetensorsValidation, BeginAfterEnd) {
  auto msg =
      error_of(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", std::string(8, '\0'));
  EXPECT_HAS(msg, "tensor 'w': data_offsets [8, 4] begin after they end (expected begin <= end)");
}

TEST_F(SafetensorsValidation, OffsetsPastTheDataSection) {
  auto msg =
      error_of(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::string(8, '\0'));
  EXPECT_HAS(msg, "tensor 'w': data_offsets [0, 16] run past the data section of 8 bytes");
  EXPECT_HAS(error_of(R"({"w":{"dtype":"U8","shape":[0],)"
                      R"("data_offsets":[18446744073709551615,18446744073709551615]}})"),
             "run past the data section of 0 bytes");
}

TEST_F(SafetensorsValidation, ByteCountDisagreesWithShape) {
  auto msg =
      error_of(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0'));
  EXPECT_HAS(msg, "tensor 'w': shape [3] of F32 needs 12 bytes, but data_offsets [0, 8] span 8");
}

TEST_F(SafetensorsValidation, ByteCountOverflows) {
  EXPECT_HAS(error_of(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],)"
                      R"("data_offsets":[0,0]}})"),
             "tensor 'w': shape [4294967296, 4294967296] of F32 overflows a 64-bit byte count");
  // numel fits in 64 bits, numel * 8 does not.
  EXPECT_HAS(error_of(R"({"w":{"dtype":"F64","shape":[4611686018427387904],)"
                      R"("data_offsets":[0,0]}})"),
             "overflows a 64-bit byte count");
  // A zero anywhere makes an empty tensor, however large the other dims.
  std::string ok = R"({"w":{"dtype":"F64","shape":[0,9223372036854775807],)"
                   R"("data_offsets":[0,0]}})";
  std::string bytes = u64_le(ok.size()) + ok;
  EXPECT_NO_THROW(parse_safetensors_header(bytes, bytes.size(), "buffer"));
}

TEST_F(SafetensorsValidation, DataSectionDoesNotStartWithATensor) {
  auto msg =
      error_of(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", std::string(8, '\0'));
  EXPECT_HAS(msg, "tensor 'w': begins at byte 4, expected 0 (at the start of the data section)");
}

TEST_F(SafetensorsValidation, GapBetweenTensors) {
  auto msg = error_of(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                      std::string(12, '\0'));
  EXPECT_HAS(msg, "tensor 'b': begins at byte 8, expected 4 (where tensor 'a' ends): 4 bytes");
}

TEST_F(SafetensorsValidation, OverlappingTensors) {
  auto msg = error_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                      std::string(8, '\0'));
  EXPECT_HAS(msg, "tensor 'b': begins at byte 4, inside tensor 'a' which ends at byte 8");
  // The very same bytes under two names (shared storage) overlap too.
  auto same = error_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                       std::string(8, '\0'));
  EXPECT_HAS(same, "tensor 'b': begins at byte 0, inside tensor 'a'");
}

TEST_F(SafetensorsValidation, TrailingBytesAfterTheLastTensor) {
  auto msg =
      error_of(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", std::string(8, '\0'));
  EXPECT_HAS(msg, "the tensors cover 4 bytes of the data section, but it holds 8");
  EXPECT_HAS(msg, "the last tensor 'a'");
  EXPECT_HAS(error_of("{}", "xyz"), "cover 0 bytes of the data section, but it holds 3");
}

TEST_F(SafetensorsValidation, DuplicateTensorNames) {
  auto msg = error_of(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                      R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                      std::string(8, '\0'));
  EXPECT_HAS(msg, "tensor 'a' appears more than once in the header");
}

TEST_F(SafetensorsValidation, DuplicateKeysInsideAnEntry) {
  auto msg = error_of(R"({"a":{"dtype":"I8","dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                      std::string(4, '\0'));
  EXPECT_HAS(msg, "tensor 'a': key \"dtype\" appears more than once");
  auto meta = error_of(R"({"__metadata__":{"k":"1","k":"2"}})");
  EXPECT_HAS(meta, "key \"k\" appears more than once");
}

TEST_F(SafetensorsValidation, MetadataIsNotAnObjectOfStrings) {
  EXPECT_HAS(error_of(R"({"__metadata__":[1]})"),
             "\"__metadata__\" must be an object of strings, found array [1]");
  EXPECT_HAS(error_of(R"({"__metadata__":{"step":12}})"),
             "\"__metadata__\" entry 'step' must be a string, found number 12");
}

// Every prefix of a valid file is rejected cleanly, and any single corrupted byte either still
// parses or is rejected with SafetensorsError (never a crash or another exception).
TEST_F(SafetensorsValidation, TruncationsAndCorruptionsNeverCrash) {
  std::string good = serialize_safetensors(
      {{"a", at::ones({3}, at::kFloat)}, {"b", at::ones({2, 2}, at::kByte)}}, {{"k", "v"}});
  for (std::size_t n = 0; n < good.size(); ++n) {
    EXPECT_THROW(parse_safetensors_header(std::string_view(good).substr(0, n), n, "cut"),
                 SafetensorsError)
        << "prefix of " << n << " bytes";
  }
  for (std::size_t i = 0; i < good.size(); ++i) {
    for (unsigned char v : {0x00, 0x20, 0x22, 0x7b, 0x7d, 0xff}) {
      std::string bad = good;
      bad[i] = static_cast<char>(v);
      try {
        parse_safetensors_header(bad, bad.size(), "flip");
      } catch (const SafetensorsError&) {
      }
    }
  }
}

// Note [JSON depth limit]: a header nested 70,000 deep overflowed the stack inside the JSON
// library (a debug build; 300,000 deep a release build) instead of being refused. The depth is
// measured before parsing, so every such header is an error naming the file and the limit.
TEST_F(SafetensorsValidation, DeeplyNestedHeaderIsRefusedBeforeParsing) {
  for (std::size_t depth : {63, 70'000, 300'000}) {
    // {"t": {"shape": [[[...]]]}}: two levels of objects, then `depth` arrays.
    std::string json = R"({"t":{"dtype":"F32","shape":)" + std::string(depth, '[') +
                       std::string(depth, ']') + R"(,"data_offsets":[0,0]}})";
    auto msg = error_of(json);
    EXPECT_HAS(msg, "the header nests arrays and objects " + std::to_string(depth + 2) + " deep");
    EXPECT_HAS(msg, "more than the limit of 64");
    EXPECT_HAS(msg, "level 65 opens at byte 90 of the JSON");
  }
  // Exactly the limit reaches the parser, which refuses the shape for what it holds.
  std::string at_limit = R"({"t":{"dtype":"F32","shape":)" + std::string(62, '[') +
                         std::string(62, ']') + R"(,"data_offsets":[0,0]}})";
  auto msg = error_of(at_limit);
  EXPECT_HAS(msg, "\"shape\" must hold non-negative integers");
  EXPECT_EQ(msg.find("nests"), std::string::npos) << msg;
  // Deep objects count as arrays do; unbalanced closing brackets do not hide an opening run.
  EXPECT_HAS(error_of("{\"a\":" + std::string(100'000, '{')), "nests arrays and objects 100001");
  EXPECT_HAS(error_of("{}]]]]]]" + std::string(65, '[')), "nests arrays and objects 65 deep");
}

// Brackets inside strings, escaped quotes included, are text, not nesting.
TEST_F(SafetensorsValidation, BracketsInsideNamesAreNotNesting) {
  const std::string name = std::string(1000, '[') + "\"\\" + std::string(1000, '{') + "\"";
  std::string bytes = serialize_safetensors({{name, at::ones({2}, at::kFloat)}},
                                            {{"note", std::string(500, '[') + "\\\""}});
  auto h = parse_safetensors_header(bytes, bytes.size(), "names");
  ASSERT_EQ(h.tensors.count(name), 1u);
  EXPECT_EQ(h.tensors.at(name).shape, std::vector<int64_t>{2});
}

// The sharded index model.safetensors.index.json gets the same limit, in memory and on disk.
TEST_F(SafetensorsValidation, DeeplyNestedIndexIsRefusedBeforeParsing) {
  for (std::size_t depth : {70'000, 300'000}) {
    const std::string text = R"({"weight_map":{"a":"m.safetensors"},"metadata":{"x":)" +
                             std::string(depth, '[') + std::string(depth, ']') + "}}";
    std::string msg = tandem_test::message_of<SafetensorsError>(
        [&] { parse_safetensors_index(text, "idx.json"); });
    EXPECT_EQ(msg.rfind("safetensors index 'idx.json': the index nests arrays and objects " +
                            std::to_string(depth + 2) + " deep",
                        0),
              0u)
        << msg;
    EXPECT_HAS(msg, "more than the limit of 64");
    const std::string path = dir_.file("model.safetensors.index.json");
    tandem_test::write_file(path, text);
    msg = tandem_test::message_of<SafetensorsError>([&] { read_safetensors_index(path); });
    EXPECT_HAS(msg, "safetensors index '" + path + "': the index nests arrays and objects");
  }
  // Brackets in names are not nesting.
  auto idx = parse_safetensors_index(
      R"({"weight_map":{"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\"": "m.safetensors"}})",
      "names");
  EXPECT_EQ(idx.files, std::vector<std::string>{"m.safetensors"});
}
