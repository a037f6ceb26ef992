// merge_weights (see merge_weights.h): headers are read from every source, the merged header is
// planned with the writer's own layout rules, and tensor bytes are copied with pread/write.
#include "tandem/checkpoint/merge_weights.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <vector>

#include "../detail/write_all.h"
#include "detail/posix_file.h"
#include "tandem/checkpoint/layout.h"
#include "tandem/checkpoint/safetensors_header.h"
#include "tandem/checkpoint/training_state.h"

namespace tandem::checkpoint {
namespace {

namespace fs = std::filesystem;

using detail::errno_text;
using detail::Fd;
using detail::shown;

// The source files of the model in `checkpoint`; `verify` is called on an index before it is read.
std::vector<fs::path> model_files(const fs::path& checkpoint, std::size_t index,
                                  const std::function<void(const fs::path&)>& verify) {
  auto fail = [&](const std::string& what) {
    throw std::runtime_error("merge_weights: " + checkpoint.string() + ": " + what);
  };
  fs::path p = checkpoint;
  if (fs::is_directory(p)) {
    const auto whole = layout::model_file(index), sharded = layout::model_index_file(index);
    if (fs::exists(p / sharded))
      p = p / sharded;
    else if (fs::exists(p / whole))
      p = p / whole;
    else
      fail("holds neither " + whole + " nor " + sharded +
           "; expected a directory written by save_state() or save_model()");
  } else if (!fs::exists(p)) {
    fail("does not exist");
  }
  if (p.string().size() > 5 && p.string().substr(p.string().size() - 5) == ".json") {
    verify(p);
    auto idx = read_safetensors_index(p.string());
    std::vector<fs::path> out;
    for (const auto& f : idx.files) {
      if (!fs::exists(p.parent_path() / f))
        fail("its index " + p.filename().string() + " lists " + f + ", which is missing");
      out.push_back(p.parent_path() / f);
    }
    return out;
  }
  return {p};
}

// A run of bytes of one source file.
struct Segment {
  std::size_t file;
  uint64_t offset;  // absolute, in the source file
  uint64_t length;
};

// The files of a model-parallel save_state() (Note [Model-parallel checkpoints]): <stem>.mp<r>
// .safetensors, by rank; empty when there are none.
std::vector<fs::path> model_parallel_files(const fs::path& checkpoint, std::size_t index) {
  std::vector<std::pair<int, fs::path>> found;
  if (!fs::is_directory(checkpoint)) return {};
  for (const auto& e : fs::directory_iterator(checkpoint)) {
    std::optional<int> rank;
    try {
      rank = layout::model_part_rank(e.path().filename().string(), index);
    } catch (const std::runtime_error& bad) {
      throw std::runtime_error("merge_weights: " + checkpoint.string() + "/" + bad.what());
    }
    if (rank) found.emplace_back(*rank, e.path());
  }
  std::sort(found.begin(), found.end());
  std::vector<fs::path> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

constexpr const char* kMetadataFix =
    "; the file was altered or written by another tool: merge the model.mp<r> files exactly as "
    "save_state() wrote them, or save the checkpoint again";

// The tensor-parallel cut of one model.mp<r> file (Note [Tensor-parallel shards in
// checkpoints]), every value checked by the checkpoint's layout.
layout::TpCut tp_metadata(const fs::path& file, const SafetensorsMetadata& meta) {
  return layout::read_tp_cut(meta, "merge_weights: " + file.string(), kMetadataFix);
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string tensor_text(const TensorInfo& t) {
  return std::string(dtype_name(t.dtype)) + " " + shape_text(t.shape);
}

// Note [Joining tensor-parallel shards]: each file's metadata names its tp rank and how each
// split tensor was cut (Note [Tensor-parallel shards in checkpoints], accelerator_state.cpp).
// "rows/k": the dense rows are k blocks (q, k, v of a fused projection), each split into tp
// consecutive parts; the dense tensor is block 0 of rank 0, ..., of rank tp-1, then block 1 of
// every rank, ... "cols": every row is the ranks' columns one after the other. A tensor no
// file splits is replicated (or belongs to one pipeline stage): the first copy is taken, after
// checking that every copy has its shape. Every metadata value and every shard's shape is
// checked before a byte is planned, so that a bad file is refused, never joined short.
std::map<std::string, std::pair<TensorInfo, std::vector<Segment>>> join_model_parallel(
    const std::vector<fs::path>& files, const std::vector<SafetensorsHeader>& headers) {
  auto fail = [](const std::string& what) {
    throw std::runtime_error("merge_weights: " + what);
  };
  struct Shard {
    std::size_t file;
    const TensorInfo* info;
  };
  std::vector<layout::TpCut> meta;
  for (std::size_t f = 0; f < files.size(); ++f)
    meta.push_back(tp_metadata(files[f], headers[f].metadata));
  const int tp_size = meta.front().size;
  for (std::size_t f = 1; f < files.size(); ++f)
    if (meta[f].size != tp_size)
      fail(files[f].string() + ": metadata \"tandem_tp_size\" is " +
           (meta[f].size ? shown(std::to_string(meta[f].size)) : std::string("absent")) +
           ", but in " + files.front().string() + " it is " +
           (tp_size ? shown(std::to_string(tp_size)) : std::string("absent")) +
           " (expected the files of one checkpoint, which agree)" + kMetadataFix);

  std::map<std::string, std::map<int, Shard>> by_rank;  // name -> tp rank -> shard
  std::map<std::string, std::pair<std::string, std::size_t>> split;  // name -> how, which file
  for (std::size_t f = 0; f < files.size(); ++f) {
    for (const auto& [name, how] : meta[f].split) {
      auto [it, added] = split.emplace(name, std::make_pair(how, f));
      if (!added && it->second.first != how)
        fail(files[f].string() + ": metadata \"tandem_tp_split\" gives tensor '" + name +
             "' the split " + shown(how) + ", but " + files[it->second.second].string() +
             " gives " + shown(it->second.first) + " (expected one split per tensor)" +
             kMetadataFix);
    }
    const int rank = meta[f].rank;
    for (const auto& [name, info] : headers[f].tensors) {
      auto& slot = by_rank[name];
      auto it = slot.find(rank);
      if (it == slot.end()) {
        slot.emplace(rank, Shard{f, &info});
      } else if (it->second.info->shape != info.shape || it->second.info->dtype != info.dtype) {
        fail("tensor '" + name + "' of tp rank " + std::to_string(rank) + " is " +
             tensor_text(*it->second.info) + " in " + files[it->second.file].string() + " but " +
             tensor_text(info) + " in " + files[f].string() +
             " (expected the same tensor in every pipeline stage that holds it)");
      }
    }
  }

  // Every shard checked before any is joined.
  for (const auto& [name, ranks] : by_rank) {
    const Shard& first = ranks.begin()->second;
    auto how = split.find(name);
    if (how == split.end()) {
      for (const auto& [r, s] : ranks)
        if (s.info->shape != first.info->shape || s.info->dtype != first.info->dtype)
          fail("tensor '" + name + "' is " + tensor_text(*first.info) + " in " +
               files[first.file].string() + " but " + tensor_text(*s.info) + " in " +
               files[s.file].string() +
               ", and no file's metadata \"tandem_tp_split\" names it (expected a replicated "
               "tensor to be the same on every tp rank)" +
               kMetadataFix);
      continue;
    }
    const std::string& cut = how->second.first;
    for (int r = 0; r < tp_size; ++r)
      if (!ranks.count(r))
        fail("the shard of tp rank " + std::to_string(r) + " of '" + name +
             "' is in none of the model.mp<r> files; copy every rank's file of the checkpoint");
    const bool cols = cut == "cols";
    const int64_t parts = layout::split_parts(cut);
    for (const auto& [r, s] : ranks) {
      const TensorInfo& t = *s.info;
      const std::string file = files[s.file].string();
      if (!meta[s.file].split.count(name))
        fail(file + ": metadata \"tandem_tp_split\" does not name tensor '" + name + "', but " +
             files[how->second.second].string() + " splits it as " + shown(cut) +
             " (expected every shard of a split tensor to say how it was cut)" + kMetadataFix);
      if (t.dtype != first.info->dtype || t.shape.size() != first.info->shape.size())
        fail("the shards of '" + name + "' differ: " + tensor_text(*first.info) + " in " +
             files[first.file].string() + ", " + tensor_text(t) + " in " + file +
             " (expected one dtype and one number of dimensions)" + kMetadataFix);
      if (cols && t.shape.size() != 2)
        fail(file + ": metadata \"tandem_tp_split\" gives tensor '" + name +
             "' the split \"cols\", but it is " + tensor_text(t) +
             " (expected a 2-D tensor for a split by columns)" + kMetadataFix);
      if (!cols && (t.shape.empty() || t.shape[0] % parts != 0))
        fail(file + ": metadata \"tandem_tp_split\" gives tensor '" + name + "' the split " +
             shown(cut) + ", but its shard is " + tensor_text(t) + ": " +
             (t.shape.empty() ? std::string("a scalar has no rows")
                              : std::to_string(t.shape[0]) + " rows do not divide into " +
                                    std::to_string(parts) + " equal parts") +
             kMetadataFix);
      // Every dimension but the split one is the dense tensor's.
      const std::size_t dim = cols ? 1 : 0;
      for (std::size_t d = 0; d < t.shape.size(); ++d)
        if (d != dim && t.shape[d] != first.info->shape[d])
          fail("the shards of '" + name + "' (split " + shown(cut) + ") disagree in dimension " +
               std::to_string(d) + ": " + tensor_text(*first.info) + " in " +
               files[first.file].string() + ", " + tensor_text(t) + " in " + file +
               " (expected them to differ only in dimension " + std::to_string(dim) + ")" +
               kMetadataFix);
    }
  }

  std::map<std::string, std::pair<TensorInfo, std::vector<Segment>>> out;
  for (const auto& [name, ranks] : by_rank) {
    const auto& first = *ranks.begin()->second.info;
    TensorInfo joined = first;
    std::vector<Segment> segments;
    auto start = [&](const Shard& s) { return headers[s.file].data_offset() + s.info->begin; };
    auto how = split.find(name);
    if (how == split.end()) {
      const auto& s = ranks.begin()->second;
      segments.push_back({s.file, start(s), s.info->nbytes()});
    } else {
      // The dense tensor is `pieces` runs of every rank's bytes in rank order: for "cols" each
      // row of each shard, for "rows/<parts>" each fused block of each shard (checked above:
      // every shard divides into them exactly).
      const bool cols = how->second.first == "cols";
      const std::size_t dim = cols ? 1 : 0;
      int64_t pieces = cols ? first.shape[0] : std::stoll(how->second.first.substr(5));
      joined.shape[dim] = 0;
      uint64_t bytes = 0;
      for (const auto& [r, s] : ranks) {
        joined.shape[dim] += s.info->shape[dim];
        bytes += s.info->nbytes();
      }
      if (bytes == 0) pieces = 0;
      for (int64_t i = 0; i < pieces; ++i)
        for (const auto& [r, s] : ranks) {
          const uint64_t piece = s.info->nbytes() / static_cast<uint64_t>(pieces);
          segments.push_back({s.file, start(s) + static_cast<uint64_t>(i) * piece, piece});
        }
    }
    uint64_t total = 0;
    for (const auto& sg : segments) total += sg.length;
    uint64_t need = dtype_size(joined.dtype);
    bool overflow = false;
    for (auto d : joined.shape)
      overflow = overflow || __builtin_mul_overflow(need, static_cast<uint64_t>(d), &need);
    if (overflow || total != need)
      fail("joining '" + name + "' gave " + std::to_string(total) + " bytes for " +
           tensor_text(joined) + ", which needs " +
           (overflow ? std::string("more than 2^64") : std::to_string(need)) +
           " (expected every shard to hold its part exactly)" + kMetadataFix);
    joined.begin = 0;
    joined.end = total;
    out[name] = {joined, std::move(segments)};
  }
  return out;
}

}  // namespace

MergeReport merge_weights(const std::string& checkpoint, const std::string& out_dir,
                          std::size_t model_index) {
  // A save_state() checkpoint (a manifest.json beside the model's files) is verified as
  // load_state verifies it, with the same code: every file read is listed in the manifest and
  // has its size and xxh64, so that a damaged file is refused, never merged.
  const fs::path home =
      fs::is_directory(checkpoint) ? fs::path(checkpoint) : fs::path(checkpoint).parent_path();
  std::unique_ptr<StateReader> manifest;
  if (fs::exists(home / "manifest.json"))
    manifest = std::make_unique<StateReader>(home.string(), "", "merge_weights");
  auto verify = [&](const fs::path& file) {
    if (manifest) manifest->verified(file.filename().string());
  };

  auto sources = model_parallel_files(checkpoint, model_index);
  const bool model_parallel = !sources.empty();
  if (!model_parallel) sources = model_files(checkpoint, model_index, verify);
  std::map<std::string, std::vector<Segment>> from;
  std::vector<TensorInfo> entries;
  std::vector<SafetensorsHeader> headers;
  for (const auto& f : sources) {
    verify(f);
    headers.push_back(read_safetensors_header(f.string()));
  }
  if (model_parallel) {
    for (auto& [name, joined] : join_model_parallel(sources, headers)) {
      entries.push_back(joined.first);
      from[name] = std::move(joined.second);
    }
  } else {
    for (std::size_t f = 0; f < sources.size(); ++f)
      for (const auto& [name, info] : headers[f].tensors) {
        if (from.count(name))
          throw std::runtime_error("merge_weights: tensor '" + name + "' is in both " +
                                   sources[from.at(name).front().file].string() + " and " +
                                   sources[f].string());
        from[name] = {{f, headers[f].data_offset() + info.begin, info.nbytes()}};
        entries.push_back(info);
      }
  }
  const auto layout = plan_safetensors_layout(entries);
  const std::string header = encode_safetensors_header(layout, {{"format", "pt"}});

  fs::create_directories(out_dir);
  const fs::path target = fs::path(out_dir) / layout::model_file(0);
  const fs::path tmp = fs::path(out_dir) / ".model.safetensors.tmp";
  auto fail = [&](const std::string& what) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw std::runtime_error("merge_weights: " + what + ": " + errno_text());
  };
  MergeReport report;
  {
    Fd out(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (out.get() < 0) fail("cannot create " + tmp.string());
    auto write_or_fail = [&](const char* p, std::size_t n) {
      if (!::tandem::detail::write_all(out.get(), p, n))
        fail("writing " + tmp.string() + " (is the disk full?)");
    };
    write_or_fail(header.data(), header.size());
    std::vector<std::unique_ptr<Fd>> in(sources.size());
    std::vector<char> buffer(std::size_t(64) << 20);
    for (const auto& e : layout) {
      for (const auto& src : from.at(e.name)) {
        if (!in[src.file]) {
          in[src.file] =
              std::make_unique<Fd>(::open(sources[src.file].c_str(), O_RDONLY | O_CLOEXEC));
          if (in[src.file]->get() < 0) fail("cannot open " + sources[src.file].string());
        }
        uint64_t done = 0;
        while (done < src.length) {
          const std::size_t n =
              static_cast<std::size_t>(std::min<uint64_t>(buffer.size(), src.length - done));
          ssize_t r =
              ::pread(in[src.file]->get(), buffer.data(), n, static_cast<off_t>(src.offset + done));
          if (r < 0 && errno == EINTR) continue;
          if (r <= 0) fail("reading '" + e.name + "' from " + sources[src.file].string());
          write_or_fail(buffer.data(), static_cast<std::size_t>(r));
          done += static_cast<uint64_t>(r);
        }
      }
      report.bytes += e.nbytes();
      ++report.tensors;
    }
    if (::fsync(out.get()) != 0) fail("fsync of " + tmp.string());
  }
  std::error_code ec;
  fs::rename(tmp, target, ec);
  if (ec) fail("renaming " + tmp.string() + " to " + target.string());
  report.output = target.string();
  report.sources = sources.size();
  return report;
}

}  // namespace tandem::checkpoint
