// CsvTracker: metrics.csv with a header from the first logged keys, widened when new keys come.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "../detail/read_file.h"
#include "tandem/track/trackers.h"
#include "track/detail/files.h"

namespace tandem::track {

struct CsvTracker::File {
  FILE* f = nullptr;
  ~File() {
    if (f) std::fclose(f);
  }
};

namespace {

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

// Splits the header record at the start of `text` (quotes respected); returns the fields and
// sets `end` to the offset just past its line break.
std::vector<std::string> parse_header(const std::string& text, size_t& end) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  size_t i = 0;
  for (; i < text.size(); ++i) {
    char c = text[i];
    if (quoted) {
      if (c == '"' && i + 1 < text.size() && text[i + 1] == '"') {
        fields.back() += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        fields.back() += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.emplace_back();
    } else if (c == '\n') {
      ++i;
      break;
    } else if (c != '\r') {
      fields.back() += c;
    }
  }
  end = i;
  return fields;
}

std::string read_all(const std::string& path) {
  return ::tandem::detail::read_file(path).value_or("");
}

}  // namespace

CsvTracker::CsvTracker(const std::string& run_dir)
    : run_dir_(run_dir), path_((std::filesystem::path(run_dir) / "metrics.csv").string()) {
  detail::ensure_directory(run_dir_, "CsvTracker");
  std::error_code ec;
  if (std::filesystem::exists(path_, ec) && std::filesystem::file_size(path_, ec) > 0) {
    // A resumed run: continue with the columns already there.
    std::string text = read_all(path_);
    size_t end = 0;
    auto header = parse_header(text, end);
    if (header.size() < 2 || header[0] != "step" || header[1] != "wall_time") {
      throw std::runtime_error("CsvTracker: expected '" + path_ +
                               "' to start with the header step,wall_time,..., found '" +
                               text.substr(0, std::min<size_t>(end, 80)) +
                               "'; remove the file or choose another logging folder");
    }
    columns_ = std::move(header);
    if (text.back() != '\n') {
      // The previous run died mid-row: end that row so that ours starts on a line of its own.
      std::ofstream(path_, std::ios::app | std::ios::binary) << "\n";
    }
  }
  file_ = std::make_unique<File>();
  file_->f = std::fopen(path_.c_str(), "ab");
  if (!file_->f) {
    throw std::runtime_error("CsvTracker: expected to open '" + path_ +
                             "' for appending, but could not; check the folder's permissions");
  }
}

CsvTracker::~CsvTracker() { finish(); }

void CsvTracker::store_init_configuration(const Hparams& hparams) {
  std::string out = "name,value\n";
  for (const auto& [k, v] : hparams) out += csv_field(k) + "," + csv_field(v.to_string()) + "\n";
  detail::write_file_atomically((std::filesystem::path(run_dir_) / "hparams.csv").string(), out,
                                "CsvTracker");
}

void CsvTracker::widen(const std::vector<std::string>& new_keys) {
  bool had_header = !columns_.empty();
  if (!had_header) columns_ = {"step", "wall_time"};
  columns_.insert(columns_.end(), new_keys.begin(), new_keys.end());
  std::string header;
  for (size_t i = 0; i < columns_.size(); ++i) header += (i ? "," : "") + csv_field(columns_[i]);
  header += "\n";
  if (!had_header) {
    if (std::fputs(header.c_str(), file_->f) < 0) {
      throw std::runtime_error("CsvTracker: could not write to '" + path_ + "' (disk full?)");
    }
    return;
  }
  // Rewrite the file with the wider header; earlier rows get empty cells on the right. Data rows
  // hold only numbers, so a row is one line and needs no parsing.
  std::fflush(file_->f);
  file_.reset();
  std::string text = read_all(path_);
  size_t end = 0;
  parse_header(text, end);
  std::string pad(new_keys.size(), ',');
  std::string out = header;
  size_t pos = end;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    if (nl > pos) out += text.substr(pos, nl - pos) + pad + "\n";
    pos = nl + 1;
  }
  detail::write_file_atomically(path_, out, "CsvTracker");
  file_ = std::make_unique<File>();
  file_->f = std::fopen(path_.c_str(), "ab");
  if (!file_->f) throw std::runtime_error("CsvTracker: could not reopen '" + path_ + "'");
}

void CsvTracker::log(const std::map<std::string, double>& values, int64_t step) {
  if (!file_) {
    throw std::logic_error("CsvTracker::log: expected an open tracker, but finish() was called; "
                           "log before finish()");
  }
  std::vector<std::string> new_keys;
  for (const auto& [k, v] : values) {
    if (std::find(columns_.begin() + std::min<size_t>(2, columns_.size()), columns_.end(), k) ==
        columns_.end()) {
      new_keys.push_back(k);
    }
  }
  if (columns_.empty() || !new_keys.empty()) widen(new_keys);
  std::string row = std::to_string(step) + "," + detail::format_double(detail::unix_time_now());
  for (size_t i = 2; i < columns_.size(); ++i) {
    row += ",";
    auto it = values.find(columns_[i]);
    if (it != values.end()) row += detail::format_double(it->second);
  }
  row += "\n";
  if (std::fwrite(row.data(), 1, row.size(), file_->f) != row.size() ||
      std::fflush(file_->f) != 0) {
    throw std::runtime_error("CsvTracker: could not write to '" + path_ +
                             "' (disk full?); free space or choose another logging folder");
  }
}

void CsvTracker::finish() { file_.reset(); }

}  // namespace tandem::track
