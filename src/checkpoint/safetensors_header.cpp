// The safetensors header: dtype table, validating parser, layout and encoder (no LibTorch here:
// tests/fuzz/safetensors_fuzz.cpp compiles this file on its own).
#include "tandem/checkpoint/safetensors_header.h"
#include "../detail/read_file.h"
#include "tandem/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <tuple>

#include "detail/json_depth.h"

namespace tandem::checkpoint {
namespace {

using json = nlohmann::json;

struct DtypeEntry {
  Dtype dtype;
  std::string_view name;
  std::size_t size;
};

constexpr DtypeEntry kDtypes[] = {
    {Dtype::kF64, "F64", 8},   {Dtype::kF32, "F32", 4},         {Dtype::kF16, "F16", 2},
    {Dtype::kBF16, "BF16", 2}, {Dtype::kI64, "I64", 8},         {Dtype::kI32, "I32", 4},
    {Dtype::kI16, "I16", 2},   {Dtype::kI8, "I8", 1},           {Dtype::kU8, "U8", 1},
    {Dtype::kBool, "BOOL", 1}, {Dtype::kF8_E4M3, "F8_E4M3", 1}, {Dtype::kF8_E5M2, "F8_E5M2", 1},
};

const DtypeEntry& entry_of(Dtype dtype) {
  for (const auto& e : kDtypes) {
    if (e.dtype == dtype) return e;
  }
  throw ::tandem::Refused("safetensors: unknown Dtype value " +
                              std::to_string(static_cast<int>(dtype)));
}

std::string known_dtype_list() {
  std::string s;
  for (const auto& e : kDtypes) {
    if (!s.empty()) s += ", ";
    s += e.name;
  }
  return s;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

// A JSON value as it appeared, shortened, for "found ..." in messages.
std::string found(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return std::string(v.type_name()) + " " + s;
}

constexpr const char* kCorruptFix =
    "; the file is corrupt or was written by a broken writer: re-create it from the original "
    "weights";

// Errors of one file: "safetensors file '<source>': <what>".
// N, the little-endian u64 at the start of a file (at least 8 bytes given).
uint64_t header_length(std::string_view prefix) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(prefix[i]);
  return n;
}

class Fail {
 public:
  explicit Fail(const std::string& source) : prefix_("safetensors file '" + source + "': ") {}
  [[noreturn]] void operator()(const std::string& what) const {
    throw SafetensorsError(prefix_ + what);
  }
  [[noreturn]] void tensor(const std::string& name, const std::string& what) const {
    throw SafetensorsError(prefix_ + "tensor '" + name + "': " + what);
  }

 private:
  std::string prefix_;
};

bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

// Reads a non-negative integer that fits int64 (shape dims) or uint64 (offsets).
uint64_t read_uint(const json& v, const Fail& fail, const std::string& name,
                   const std::string& field, uint64_t max) {
  if (!v.is_number_unsigned()) {
    fail.tensor(
        name, "\"" + field + "\" must hold non-negative integers, found " + found(v) + kCorruptFix);
  }
  auto x = v.get<uint64_t>();
  if (x > max) {
    fail.tensor(name, "\"" + field + "\" value " + std::to_string(x) + " exceeds the largest " +
                          "allowed (" + std::to_string(max) + ")" + kCorruptFix);
  }
  return x;
}

// Parses JSON, recording the first key that repeats within one object: nlohmann would silently
// keep the last of duplicates, and a second "weight" entry could otherwise hide the first.
json parse_rejecting_duplicates(std::string_view text, const Fail& fail) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  std::string top_key;                      // the current top-level key
  std::string duplicate;                    // message of the first duplicate, if any
  auto callback = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        if (keys.size() == 1) top_key = key;
        if (!keys.empty() && !keys.back().insert(key).second && duplicate.empty()) {
          if (keys.size() == 1) {
            duplicate = "tensor '" + key + "' appears more than once in the header";
          } else {
            duplicate = "tensor '" + top_key + "': key \"" + key + "\" appears more than once";
          }
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  json root;
  try {
    root = json::parse(text.begin(), text.end(), callback);
  } catch (const json::exception& e) {
    fail(std::string("the header is not valid UTF-8 JSON: ") + e.what() + kCorruptFix);
  }
  if (!duplicate.empty()) {
    fail(duplicate + " (expected each name once)" + kCorruptFix);
  }
  return root;
}

SafetensorsMetadata parse_metadata(const json& v, const Fail& fail) {
  if (!v.is_object()) {
    fail("\"__metadata__\" must be an object of strings, found " + found(v) + kCorruptFix);
  }
  SafetensorsMetadata out;
  for (const auto& [key, value] : v.items()) {
    if (!value.is_string()) {
      fail("\"__metadata__\" entry '" + key + "' must be a string, found " + found(value) +
           kCorruptFix);
    }
    out.emplace(key, value.get<std::string>());
  }
  return out;
}

TensorInfo parse_entry(const std::string& name, const json& v, uint64_t data_size,
                       const Fail& fail) {
  if (!v.is_object()) {
    fail.tensor(name, "expected an object {\"dtype\", \"shape\", \"data_offsets\"}, found " +
                          found(v) + kCorruptFix);
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!v.contains(field)) {
      fail.tensor(name, std::string("missing \"") + field +
                            "\" (expected \"dtype\", \"shape\" and \"data_offsets\")" +
                            kCorruptFix);
    }
  }
  TensorInfo info;
  info.name = name;

  const json& dtype = v.at("dtype");
  if (!dtype.is_string()) {
    fail.tensor(name, "\"dtype\" must be a string, found " + found(dtype) + kCorruptFix);
  }
  auto parsed = dtype_from_name(dtype.get_ref<const std::string&>());
  if (!parsed) {
    fail.tensor(name, "unknown dtype \"" + dtype.get<std::string>() + "\" (expected one of " +
                          known_dtype_list() + ")");
  }
  info.dtype = *parsed;

  const json& shape = v.at("shape");
  if (!shape.is_array()) {
    fail.tensor(name, "\"shape\" must be an array of non-negative integers, found " + found(shape) +
                          kCorruptFix);
  }
  uint64_t numel = 1;
  bool overflow = false;
  for (const auto& d : shape) {
    auto dim = read_uint(d, fail, name, "shape",
                         static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
    info.shape.push_back(static_cast<int64_t>(dim));
    overflow = overflow || !checked_mul(numel, dim, &numel);
  }

  const json& offsets = v.at("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2) {
    fail.tensor(name, "\"data_offsets\" must be an array [begin, end] of two integers, found " +
                          found(offsets) + kCorruptFix);
  }
  info.begin =
      read_uint(offsets[0], fail, name, "data_offsets", std::numeric_limits<uint64_t>::max());
  info.end =
      read_uint(offsets[1], fail, name, "data_offsets", std::numeric_limits<uint64_t>::max());
  std::string offsets_text =
      "[" + std::to_string(info.begin) + ", " + std::to_string(info.end) + "]";
  if (info.begin > info.end) {
    fail.tensor(name, "data_offsets " + offsets_text + " begin after they end (expected " +
                          "begin <= end)" + kCorruptFix);
  }
  if (info.end > data_size) {
    fail.tensor(name, "data_offsets " + offsets_text + " run past the data section of " +
                          std::to_string(data_size) + " bytes (the file is truncated or the " +
                          "offsets are wrong; re-create the file)");
  }
  uint64_t nbytes = 0;
  if (overflow || !checked_mul(numel, dtype_size(info.dtype), &nbytes)) {
    fail.tensor(name, "shape " + shape_string(info.shape) + " of " +
                          std::string(dtype_name(info.dtype)) + " overflows a 64-bit byte count" +
                          kCorruptFix);
  }
  if (nbytes != info.end - info.begin) {
    fail.tensor(name, "shape " + shape_string(info.shape) + " of " +
                          std::string(dtype_name(info.dtype)) + " needs " + std::to_string(nbytes) +
                          " bytes, but data_offsets " + offsets_text + " span " +
                          std::to_string(info.end - info.begin) + kCorruptFix);
  }
  return info;
}

// Every byte of the data section belongs to exactly one tensor.
void check_tiling(const std::map<std::string, TensorInfo>& tensors, uint64_t data_size,
                  const Fail& fail) {
  std::vector<const TensorInfo*> order;
  order.reserve(tensors.size());
  for (const auto& [_, info] : tensors) order.push_back(&info);
  std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return std::tie(a->begin, a->end, a->name) < std::tie(b->begin, b->end, b->name);
  });
  uint64_t expected = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo* t : order) {
    if (t->begin != expected) {
      std::string where = previous ? "where tensor '" + previous->name + "' ends"
                                   : std::string("at the start of the data section");
      if (t->begin > expected) {
        fail.tensor(t->name, "begins at byte " + std::to_string(t->begin) + ", expected " +
                                 std::to_string(expected) + " (" + where +
                                 "): " + std::to_string(t->begin - expected) +
                                 " bytes belong to no tensor" + kCorruptFix);
      }
      fail.tensor(t->name, "begins at byte " + std::to_string(t->begin) + ", inside tensor '" +
                               (previous ? previous->name : "") + "' which ends at byte " +
                               std::to_string(expected) +
                               " (expected tensors that do not overlap)" + kCorruptFix);
    }
    expected = t->end;
    previous = t;
  }
  if (expected != data_size) {
    fail("the tensors cover " + std::to_string(expected) + " bytes of the data section, but it " +
         "holds " + std::to_string(data_size) + " (expected the last tensor" +
         (previous ? " '" + previous->name + "'" : std::string()) +
         " to end where the file ends: trailing bytes)" + kCorruptFix);
  }
}

void put_json_string(std::string& out, const std::string& s, const std::string& what) {
  try {
    out += json(s).dump(-1, ' ', false, json::error_handler_t::strict);
  } catch (const json::exception&) {
    throw ::tandem::Refused("safetensors: " + what +
                                " is not valid UTF-8; the format stores names and metadata as "
                                "UTF-8 JSON: rename it");
  }
}

}  // namespace

const std::vector<Dtype>& all_dtypes() {
  static const std::vector<Dtype> all = [] {
    std::vector<Dtype> v;
    for (const auto& e : kDtypes) v.push_back(e.dtype);
    return v;
  }();
  return all;
}

std::string_view dtype_name(Dtype dtype) {
  return entry_of(dtype).name;
}

std::optional<Dtype> dtype_from_name(std::string_view name) {
  for (const auto& e : kDtypes) {
    if (e.name == name) return e.dtype;
  }
  return std::nullopt;
}

std::size_t dtype_size(Dtype dtype) {
  return entry_of(dtype).size;
}

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (auto d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

SafetensorsHeader parse_safetensors_header(std::string_view prefix, uint64_t file_size,
                                           const std::string& source) {
  Fail fail(source);
  if (file_size < 8) {
    fail("the file has " + std::to_string(file_size) +
         " bytes, expected at least 8 (the header length); it is not a safetensors file or it "
         "is truncated");
  }
  if (prefix.size() < 8 || prefix.size() > file_size) {
    throw ::tandem::Refused("parse_safetensors_header: " + std::to_string(prefix.size()) +
                                " bytes given for a file of " + std::to_string(file_size) +
                                " (expected at least the 8-byte length, at most the file)");
  }
  const uint64_t n = header_length(prefix);
  if (n > kMaxSafetensorsHeaderSize) {
    fail("the header length is " + std::to_string(n) + " bytes, more than the limit of " +
         std::to_string(kMaxSafetensorsHeaderSize) +
         "; it is not a safetensors file or it is "
         "corrupt");
  }
  if (n > file_size - 8) {
    fail("the header length is " + std::to_string(n) + " bytes, but only " +
         std::to_string(file_size - 8) +
         " bytes follow the length field (the file is truncated "
         "or not a safetensors file)");
  }
  if (prefix.size() - 8 < n) {
    throw ::tandem::Refused("parse_safetensors_header: the header of '" + source + "' has " +
                                std::to_string(n) + " bytes, but only " +
                                std::to_string(prefix.size() - 8) + " were given");
  }
  std::string_view text = prefix.substr(8, n);
  if (text.empty() || text.front() != '{') {
    fail("the header must start with '{' (a JSON object), found " +
         (text.empty() ? std::string("an empty header")
                       : "byte 0x" +
                             [&] {
                               std::ostringstream os;
                               os << std::hex
                                  << static_cast<int>(static_cast<unsigned char>(text[0]));
                               return os.str();
                             }()) +
         kCorruptFix);
  }
  // JSON text never holds a raw NUL, and nlohmann's lexer would take one for the end of the
  // input, silently ignoring whatever follows it.
  if (auto nul = text.find('\0'); nul != std::string_view::npos) {
    fail("the header holds a NUL byte at offset " + std::to_string(8 + nul) +
         " (expected JSON text padded with spaces)" + kCorruptFix);
  }
  // Note [JSON depth limit]: a header nests three deep; deeper text never reaches the parser.
  if (auto deep = detail::json_depth_problem(text); !deep.empty()) {
    fail("the header " + deep + " (a header nests 3 deep: {name: {\"shape\": [...]}})" +
         kCorruptFix);
  }
  json root = parse_rejecting_duplicates(text, fail);
  if (!root.is_object()) {
    fail("the header must be a JSON object, found " + found(root) + kCorruptFix);
  }

  SafetensorsHeader header;
  header.header_size = n;
  header.data_size = file_size - 8 - n;
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      header.metadata = parse_metadata(value, fail);
      continue;
    }
    header.tensors.emplace(key, parse_entry(key, value, header.data_size, fail));
  }
  check_tiling(header.tensors, header.data_size, fail);
  return header;
}

std::vector<TensorInfo> plan_safetensors_layout(std::vector<TensorInfo> entries) {
  std::set<std::string> seen;
  for (const auto& e : entries) {
    if (e.name == "__metadata__") {
      throw ::tandem::Refused(
          "safetensors: a tensor cannot be named \"__metadata__\" (the "
          "format reserves it for metadata): rename it");
    }
    if (!seen.insert(e.name).second) {
      throw ::tandem::Refused("safetensors: tensor '" + e.name +
                                  "' is given twice (expected unique names): rename one");
    }
  }
  std::stable_sort(entries.begin(), entries.end(), [](const TensorInfo& a, const TensorInfo& b) {
    auto sa = dtype_size(a.dtype), sb = dtype_size(b.dtype);
    if (sa != sb) return sa > sb;
    return a.name < b.name;
  });
  uint64_t offset = 0;
  for (auto& e : entries) {
    uint64_t numel = 1;
    bool ok = true;
    for (auto d : e.shape) {
      if (d < 0) {
        throw ::tandem::Refused("safetensors: tensor '" + e.name + "' has shape " +
                                    shape_string(e.shape) + " (expected non-negative sizes)");
      }
      ok = ok && checked_mul(numel, static_cast<uint64_t>(d), &numel);
    }
    uint64_t nbytes = 0;
    ok = ok && checked_mul(numel, dtype_size(e.dtype), &nbytes);
    ok = ok && !__builtin_add_overflow(offset, nbytes, &e.end);
    if (!ok) {
      throw ::tandem::Refused("safetensors: tensor '" + e.name + "' of shape " +
                                  shape_string(e.shape) + " overflows a 64-bit byte count");
    }
    e.begin = offset;
    offset = e.end;
  }
  return entries;
}

std::string encode_safetensors_header(const std::vector<TensorInfo>& entries,
                                      const SafetensorsMetadata& metadata) {
  std::string j = "{";
  bool first = true;
  if (!metadata.empty()) {
    j += "\"__metadata__\":{";
    for (const auto& [key, value] : metadata) {
      if (!first) j += ',';
      first = false;
      put_json_string(j, key, "metadata key '" + key + "'");
      j += ':';
      put_json_string(j, value, "the value of metadata key '" + key + "'");
    }
    j += '}';
    first = false;
  }
  for (const auto& e : entries) {
    if (!first) j += ',';
    first = false;
    put_json_string(j, e.name, "tensor name '" + e.name + "'");
    j += ":{\"dtype\":\"";
    j += dtype_name(e.dtype);
    j += "\",\"shape\":[";
    for (std::size_t i = 0; i < e.shape.size(); ++i) {
      if (i) j += ',';
      j += std::to_string(e.shape[i]);
    }
    j += "],\"data_offsets\":[" + std::to_string(e.begin) + ',' + std::to_string(e.end) + "]}";
  }
  j += '}';
  j.append((8 - j.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = j.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + j;
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in)
    throw SafetensorsError("safetensors file '" + path + "': cannot be opened (" +
                           std::strerror(errno) + "); check the path and its permissions");
  const auto end = in.tellg();
  if (end < 0) throw SafetensorsError("safetensors file '" + path + "': cannot find its size");
  const uint64_t file_size = static_cast<uint64_t>(end);
  std::string prefix(static_cast<size_t>(std::min<uint64_t>(file_size, 8)), '\0');
  in.seekg(0);
  in.read(prefix.data(), static_cast<std::streamsize>(prefix.size()));
  if (file_size >= 8) {
    uint64_t n = header_length(prefix);
    // Read no more than the file holds and the parser accepts; it reports what is wrong.
    n = std::min<uint64_t>(n, std::min<uint64_t>(file_size - 8, kMaxSafetensorsHeaderSize));
    prefix.resize(static_cast<size_t>(8 + n));
    in.read(prefix.data() + 8, static_cast<std::streamsize>(n));
  }
  if (!in) throw SafetensorsError("safetensors file '" + path + "': reading its header failed");
  return parse_safetensors_header(prefix, file_size, path);
}

SafetensorsIndex parse_safetensors_index(std::string_view text, const std::string& source) {
  const std::string where = "safetensors index '" + source + "': ";
  // Note [JSON depth limit]: an index nests two deep; deeper text never reaches the parser.
  if (auto deep = detail::json_depth_problem(text); !deep.empty())
    throw SafetensorsError(where + "the index " + deep +
                           " (an index nests 2 deep: {\"weight_map\": {name: file}}); the file "
                           "is corrupt or not a model.safetensors.index.json: re-create it");
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw SafetensorsError(where + "expected JSON, found text that does not parse (" +
                           std::string(e.what()) + ")");
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    throw SafetensorsError(where +
                           "expected an object with a \"weight_map\" object mapping tensor "
                           "names to shard files ({\"metadata\": {...}, \"weight_map\": "
                           "{name: file}}, as transformers writes); is this a "
                           "model.safetensors.index.json?");
  SafetensorsIndex out;
  if (j.contains("metadata")) {
    const auto& m = j["metadata"];
    if (!m.is_object() && !m.is_null())
      throw SafetensorsError(where + "expected \"metadata\" to be an object, found " +
                             std::string(m.type_name()));
    if (m.is_object() && m.contains("total_size")) {
      const auto& t = m["total_size"];
      if (t.is_number_unsigned())
        out.total_size = t.get<uint64_t>();
      else if (t.is_number_integer() && t.get<int64_t>() >= 0)
        out.total_size = static_cast<uint64_t>(t.get<int64_t>());
      else if (t.is_number_float() && t.get<double>() >= 0 && t.get<double>() < 1.8e19 &&
               t.get<double>() == static_cast<double>(static_cast<uint64_t>(t.get<double>())))
        out.total_size = static_cast<uint64_t>(t.get<double>());  // Python may write 1234.0
      else
        throw SafetensorsError(where + "expected metadata.total_size to be a byte count, found " +
                               t.dump());
    }
  }
  std::set<std::string> files;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string())
      throw SafetensorsError(where + "tensor '" + name + "' maps to " + file.dump() +
                             ", expected a shard file name (a string)");
    auto f = file.get<std::string>();
    if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos ||
        f.find('\\') != std::string::npos || f.find('\0') != std::string::npos)
      throw SafetensorsError(where + "tensor '" + name + "' maps to '" + f +
                             "', expected a plain file name in the index's directory");
    out.weight_map.emplace(name, f);
    files.insert(f);
  }
  out.files.assign(files.begin(), files.end());
  return out;
}

SafetensorsIndex read_safetensors_index(const std::string& path) {
  if (!std::ifstream(path, std::ios::binary))
    throw SafetensorsError("safetensors index '" + path + "': cannot be opened (" +
                           std::strerror(errno) + "); check the path");
  const auto text = ::tandem::detail::read_file(path);
  if (!text) throw SafetensorsError("safetensors index '" + path + "': reading it failed");
  return parse_safetensors_index(*text, path);
}

}  // namespace tandem::checkpoint
