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
#include <vector>

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

}  // namespace

MergeReport merge_weights(const std::string& checkpoint, const std::string& out_dir,
                          std::size_t model_index) {
  const auto sources = model_files(checkpoint, model_index);
  struct Source {
    std::size_t file;
    uint64_t offset;  // absolute, in the source file
  };
  std::map<std::string, Source> from;
  std::vector<TensorInfo> entries;
  std::vector<SafetensorsHeader> headers;
  for (std::size_t f = 0; f < sources.size(); ++f) {
    headers.push_back(read_safetensors_header(sources[f].string()));
    for (const auto& [name, info] : headers.back().tensors) {
      if (from.count(name))
        throw std::runtime_error("merge_weights: tensor '" + name + "' is in both " +
                                 sources[from.at(name).file].string() + " and " +
                                 sources[f].string());
      from[name] = {f, headers.back().data_offset() + info.begin};
      TensorInfo e = info;
      entries.push_back(e);
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
      const auto& src = from.at(e.name);
      if (!in[src.file]) {
        in[src.file] = std::make_unique<Fd>(::open(sources[src.file].c_str(), O_RDONLY | O_CLOEXEC));
        if (in[src.file]->fd < 0) fail("cannot open " + sources[src.file].string());
      }
      uint64_t done = 0;
      while (done < e.nbytes()) {
        const std::size_t n =
            static_cast<std::size_t>(std::min<uint64_t>(buffer.size(), e.nbytes() - done));
        ssize_t r = ::pread(in[src.file]->fd, buffer.data(), n,
                            static_cast<off_t>(src.offset + done));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) fail("reading '" + e.name + "' from " + sources[src.file].string());
        write_all(buffer.data(), static_cast<std::size_t>(r));
        done += static_cast<uint64_t>(r);
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
