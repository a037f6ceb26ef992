// merge_weights (see merge_weights.h): headers are read from every source, the merged header is
// planned with the writer's own layout rules, and tensor bytes are copied with pread/write.
#include "tandem/checkpoint/merge_weights.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <stdexcept>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "tandem/checkpoint/safetensors_header.h"

namespace tandem::checkpoint {
namespace {

namespace fs = std::filesystem;

std::string errno_text() { return std::strerror(errno); }

struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

// The source files of the model in `checkpoint`.
std::vector<fs::path> model_files(const fs::path& checkpoint, std::size_t index) {
  auto fail = [&](const std::string& what) {
    throw std::runtime_error("merge_weights: " + checkpoint.string() + ": " + what);
  };
  fs::path p = checkpoint;
  if (fs::is_directory(p)) {
    const std::string stem = index == 0 ? "model" : "model_" + std::to_string(index);
    if (fs::exists(p / (stem + ".safetensors.index.json")))
      p = p / (stem + ".safetensors.index.json");
    else if (fs::exists(p / (stem + ".safetensors")))
      p = p / (stem + ".safetensors");
    else
      fail("holds neither " + stem + ".safetensors nor " + stem +
           ".safetensors.index.json; expected a directory written by save_state() or "
           "save_model()");
  } else if (!fs::exists(p)) {
    fail("does not exist");
  }
  if (p.string().size() > 5 && p.string().substr(p.string().size() - 5) == ".json") {
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
  const std::string prefix = (index == 0 ? "model" : "model_" + std::to_string(index)) + ".mp";
  const std::string suffix = ".safetensors";
  for (const auto& e : fs::directory_iterator(checkpoint)) {
    const std::string f = e.path().filename().string();
    if (f.size() <= prefix.size() + suffix.size() || f.compare(0, prefix.size(), prefix) != 0 ||
        f.compare(f.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    const std::string rank = f.substr(prefix.size(), f.size() - prefix.size() - suffix.size());
    if (rank.find_first_not_of("0123456789") == std::string::npos)
      found.emplace_back(std::stoi(rank), e.path());
  }
  std::sort(found.begin(), found.end());
  std::vector<fs::path> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

// Note [Joining tensor-parallel shards]: each file's metadata names its tp rank and how each
// split tensor was cut (Note [Tensor-parallel shards in checkpoints], accelerator_state.cpp).
// "rows/k": the dense rows are k blocks (q, k, v of a fused projection), each split into tp
// consecutive parts; the dense tensor is block 0 of rank 0, ..., of rank tp-1, then block 1 of
// every rank, ... "cols": every row is the ranks' columns one after the other. A tensor no
// file splits is replicated (or belongs to one pipeline stage): the first copy is taken.
std::map<std::string, std::pair<TensorInfo, std::vector<Segment>>> join_model_parallel(
    const std::vector<fs::path>& files, const std::vector<SafetensorsHeader>& headers) {
  auto fail = [](const std::string& what) {
    throw std::runtime_error("merge_weights: " + what);
  };
  struct Shard {
    std::size_t file;
    const TensorInfo* info;
  };
  std::map<std::string, std::map<int, Shard>> by_rank;  // name -> tp rank -> shard
  std::map<std::string, std::string> split;
  int tp_size = 1;
  for (std::size_t f = 0; f < files.size(); ++f) {
    const auto& meta = headers[f].metadata;
    int rank = 0;
    if (meta.count("tandem_tp_size")) {
      tp_size = std::stoi(meta.at("tandem_tp_size"));
      rank = std::stoi(meta.at("tandem_tp_rank"));
      const auto cuts = nlohmann::json::parse(meta.at("tandem_tp_split"));
      for (auto it = cuts.begin(); it != cuts.end(); ++it) split[it.key()] = it.value().get<std::string>();
    }
    for (const auto& [name, info] : headers[f].tensors) {
      auto& slot = by_rank[name];
      auto it = slot.find(rank);
      if (it == slot.end()) {
        slot.emplace(rank, Shard{f, &info});
      } else if (it->second.info->shape != info.shape || it->second.info->dtype != info.dtype) {
        fail("tensor '" + name + "' of tp rank " + std::to_string(rank) + " differs between " +
             files[it->second.file].string() + " and " + files[f].string());
      }
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
      for (int r = 0; r < tp_size; ++r)
        if (!ranks.count(r))
          fail("the shard of tp rank " + std::to_string(r) + " of '" + name +
               "' is in none of the model.mp<r> files; copy every rank's file of the checkpoint");
      for (const auto& [r, s] : ranks)
        if (s.info->shape.size() != first.shape.size() || s.info->dtype != first.dtype)
          fail("the shards of '" + name + "' differ in rank or dtype");
      // The dense tensor is `pieces` runs of every rank's bytes in rank order: for "cols" each
      // row of each shard, for "rows/<parts>" each fused block of each shard.
      const bool cols = how->second == "cols";
      if (!cols && how->second.rfind("rows/", 0) != 0)
        fail("'" + name + "' has an unknown split '" + how->second + "'");
      if (cols && first.shape.size() != 2) fail("'" + name + "' is split by columns but is not 2-D");
      const std::size_t dim = cols ? 1 : 0;
      const int64_t pieces = cols ? first.shape[0] : std::stoll(how->second.substr(5));
      joined.shape[dim] = 0;
      for (const auto& [r, s] : ranks) joined.shape[dim] += s.info->shape[dim];
      for (int64_t i = 0; i < pieces; ++i)
        for (const auto& [r, s] : ranks) {
          const uint64_t piece = s.info->nbytes() / static_cast<uint64_t>(pieces);
          segments.push_back({s.file, start(s) + static_cast<uint64_t>(i) * piece, piece});
        }
    }
    uint64_t total = 0;
    for (const auto& sg : segments) total += sg.length;
    joined.begin = 0;
    joined.end = total;
    out[name] = {joined, std::move(segments)};
  }
  return out;
}

}  // namespace

MergeReport merge_weights(const std::string& checkpoint, const std::string& out_dir,
                          std::size_t model_index) {
  auto sources = model_parallel_files(checkpoint, model_index);
  const bool model_parallel = !sources.empty();
  if (!model_parallel) sources = model_files(checkpoint, model_index);
  std::map<std::string, std::vector<Segment>> from;
  std::vector<TensorInfo> entries;
  std::vector<SafetensorsHeader> headers;
  for (const auto& f : sources) headers.push_back(read_safetensors_header(f.string()));
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
  const fs::path target = fs::path(out_dir) / "model.safetensors";
  const fs::path tmp = fs::path(out_dir) / ".model.safetensors.tmp";
  auto fail = [&](const std::string& what) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw std::runtime_error("merge_weights: " + what + ": " + errno_text());
  };
  MergeReport report;
  {
    Fd out(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (out.fd < 0) fail("cannot create " + tmp.string());
    auto write_all = [&](const char* p, std::size_t n) {
      while (n > 0) {
        ssize_t w = ::write(out.fd, p, n);
        if (w < 0) {
          if (errno == EINTR) continue;
          fail("writing " + tmp.string() + " (is the disk full?)");
        }
        p += w;
        n -= static_cast<std::size_t>(w);
      }
    };
    write_all(header.data(), header.size());
    std::vector<std::unique_ptr<Fd>> in(sources.size());
    std::vector<char> buffer(std::size_t(64) << 20);
    for (const auto& e : layout) {
      for (const auto& src : from.at(e.name)) {
        if (!in[src.file]) {
          in[src.file] =
              std::make_unique<Fd>(::open(sources[src.file].c_str(), O_RDONLY | O_CLOEXEC));
          if (in[src.file]->fd < 0) fail("cannot open " + sources[src.file].string());
        }
        uint64_t done = 0;
        while (done < src.length) {
          const std::size_t n =
              static_cast<std::size_t>(std::min<uint64_t>(buffer.size(), src.length - done));
          ssize_t r = ::pread(in[src.file]->fd, buffer.data(), n,
                              static_cast<off_t>(src.offset + done));
          if (r < 0 && errno == EINTR) continue;
          if (r <= 0) fail("reading '" + e.name + "' from " + sources[src.file].string());
          write_all(buffer.data(), static_cast<std::size_t>(r));
          done += static_cast<uint64_t>(r);
        }
      }
      report.bytes += e.nbytes();
      ++report.tensors;
    }
    if (::fsync(out.fd) != 0) fail("fsync of " + tmp.string());
  }
  std::error_code ec;
  fs::rename(tmp, target, ec);
  if (ec) fail("renaming " + tmp.string() + " to " + target.string());
  report.output = target.string();
  report.sources = sources.size();
  return report;
}

}  // namespace tandem::checkpoint
