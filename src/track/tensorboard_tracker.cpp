// TensorBoardTracker: event files in TensorFlow's record format, with hand-encoded protobufs.
//
// The messages used (field numbers from tensorboard/compat/proto/{event,summary,tensor}.proto):
//   Event    { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary  { repeated Value value = 1; }
//   Value    { string tag = 1; float simple_value = 2; TensorProto tensor = 8;
//              SummaryMetadata metadata = 9; }
//   SummaryMetadata { PluginData plugin_data = 1; }   PluginData { string plugin_name = 1; }
//   TensorProto { DataType dtype = 1 (DT_STRING = 7); TensorShapeProto tensor_shape = 2;
//                 repeated bytes string_val = 8; }
//   TensorShapeProto { repeated Dim dim = 2; }   Dim { int64 size = 1; }
// A record is: uint64 length, uint32 masked CRC32C(length bytes), data, uint32 masked
// CRC32C(data), all little-endian.
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "tandem/track/trackers.h"
#include "track/detail/crc32c.h"
#include "track/detail/files.h"
#include "track/detail/protobuf.h"

namespace tandem::track {

using detail::ProtoWriter;

struct TensorBoardTracker::File {
  FILE* f = nullptr;
  ~File() {
    if (f) std::fclose(f);
  }
};

namespace {

constexpr int kDtString = 7;

std::string little_endian(uint64_t v, int bytes) {
  std::string out;
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((v >> (8 * i)) & 0xFF);
  return out;
}

std::string markdown_cell(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|') out += '\\';
    out += (c == '\n' ? ' ' : c);
  }
  return out;
}

ProtoWriter summary_event(int64_t step, const ProtoWriter& value) {
  ProtoWriter summary;
  summary.message_field(1, value);
  ProtoWriter event;
  event.double_field(1, detail::unix_time_now()).int64_field(2, step).message_field(5, summary);
  return event;
}

}  // namespace

TensorBoardTracker::TensorBoardTracker(const std::string& run_dir) {
  detail::ensure_directory(run_dir, "TensorBoardTracker");
  auto base = (std::filesystem::path(run_dir) /
               ("events.out.tfevents." + std::to_string(static_cast<int64_t>(detail::unix_time_now())) +
                "." + detail::host_name()))
                  .string();
  file_ = std::make_unique<File>();
  // Two trackers started in the same second on one host would share a name: number the later.
  for (int n = 0; n < 1000 && !file_->f; ++n) {
    path_ = n == 0 ? base : base + "." + std::to_string(n);
    file_->f = std::fopen(path_.c_str(), "wbx");
    if (!file_->f && errno != EEXIST) break;
  }
  if (!file_->f) {
    throw std::runtime_error("TensorBoardTracker: expected to create '" + path_ +
                             "', but could not (" + std::strerror(errno) +
                             "); check the logging folder's permissions");
  }
  ProtoWriter first;
  first.double_field(1, detail::unix_time_now()).bytes_field(3, "brain.Event:2");
  write_record(first.data());
  std::fflush(file_->f);
}

TensorBoardTracker::~TensorBoardTracker() { finish(); }

void TensorBoardTracker::write_record(const std::string& data) {
  std::string header = little_endian(data.size(), 8);
  std::string rec = header;
  rec += little_endian(detail::mask_crc(detail::crc32c(header.data(), header.size())), 4);
  rec += data;
  rec += little_endian(detail::mask_crc(detail::crc32c(data.data(), data.size())), 4);
  if (std::fwrite(rec.data(), 1, rec.size(), file_->f) != rec.size()) {
    throw std::runtime_error("TensorBoardTracker: could not write to '" + path_ +
                             "' (disk full?); free space or choose another logging folder");
  }
}

void TensorBoardTracker::store_init_configuration(const Hparams& hparams) {
  if (!file_) {
    throw std::logic_error("TensorBoardTracker: expected an open tracker, but finish() was "
                           "called; store the configuration before finish()");
  }
  std::string table = "| name | value |\n| --- | --- |\n";
  for (const auto& [k, v] : hparams) {
    table += "| " + markdown_cell(k) + " | " + markdown_cell(v.to_string()) + " |\n";
  }
  ProtoWriter plugin_data, metadata, dim, shape, tensor, value;
  plugin_data.bytes_field(1, "text");
  metadata.message_field(1, plugin_data);
  dim.int64_field(1, 1);
  shape.message_field(2, dim);
  tensor.varint_field(1, kDtString).message_field(2, shape).bytes_field(8, table);
  value.bytes_field(1, "hparams").message_field(9, metadata).message_field(8, tensor);
  write_record(summary_event(0, value).data());
  std::fflush(file_->f);
}

void TensorBoardTracker::log(const std::map<std::string, double>& values, int64_t step) {
  if (!file_) {
    throw std::logic_error("TensorBoardTracker::log: expected an open tracker, but finish() was "
                           "called; log before finish()");
  }
  for (const auto& [tag, v] : values) {
    ProtoWriter value;
    value.bytes_field(1, tag).float_field(2, static_cast<float>(v));
    write_record(summary_event(step, value).data());
  }
  if (std::fflush(file_->f) != 0) {
    throw std::runtime_error("TensorBoardTracker: could not write to '" + path_ + "' (disk full?)");
  }
}

void TensorBoardTracker::finish() { file_.reset(); }

}  // namespace tandem::track
