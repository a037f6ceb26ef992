// safetensors for LibTorch tensors: dtype mapping, the streaming writer and the mmap reader.
// The header logic (validation, layout, encoding) lives in safetensors_header.cpp.
#include "tandem/checkpoint/safetensors.h"
#include "tandem/error.h"

#include <ATen/ops/empty.h>
#include <torch/version.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <map>

#include "compat/float8.h"
#include "detail/posix_file.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tandem's safetensors code copies tensor bytes as they are: it needs a little-endian host"
#endif

namespace tandem::checkpoint {
namespace {

using detail::errno_text;
using detail::Fd;

// What the writer needs: the layout (data order) and, for each entry, the caller's tensor.
struct WritePlan {
  std::vector<TensorInfo> layout;
  std::vector<const at::Tensor*> tensors;  // parallel to layout
  std::string header;                      // length + padded JSON
};

WritePlan plan_write(const NamedTensors& tensors, const SafetensorsMetadata& metadata) {
  std::vector<TensorInfo> entries;
  std::map<std::string, const at::Tensor*> by_name;
  entries.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) {
      throw ::tandem::Refused("save_safetensors: tensor '" + name +
                                  "' is undefined (expected a tensor with storage): drop it "
                                  "from the list");
    }
    if (t.layout() != c10::kStrided) {
      throw ::tandem::Refused("save_safetensors: tensor '" + name +
                                  "' is sparse or has another non-strided layout; the format "
                                  "holds dense tensors: call .to_dense() first");
    }
    TensorInfo info;
    info.name = name;
    try {
      info.dtype = dtype_of(t.scalar_type());
    } catch (const std::invalid_argument& e) {
      throw ::tandem::Refused("save_safetensors: tensor '" + name + "': " + e.what());
    }
    info.shape = t.sizes().vec();
    entries.push_back(std::move(info));
    by_name.emplace(name, &t);
  }
  WritePlan plan;
  plan.layout = plan_safetensors_layout(std::move(entries));
  for (const auto& e : plan.layout) plan.tensors.push_back(by_name.at(e.name));
  plan.header = encode_safetensors_header(plan.layout, metadata);
  return plan;
}

// Streams the plan's bytes to `sink`, one CPU-contiguous tensor at a time.
void write_plan(const WritePlan& plan, const std::function<void(const void*, std::size_t)>& sink) {
  sink(plan.header.data(), plan.header.size());
  for (std::size_t i = 0; i < plan.layout.size(); ++i) {
    const auto& info = plan.layout[i];
    if (info.nbytes() == 0) continue;
    at::Tensor t =
        plan.tensors[i]->detach().to(c10::kCPU).resolve_conj().resolve_neg().contiguous();
    sink(t.data_ptr(), static_cast<std::size_t>(info.nbytes()));
  }
}

}  // namespace

bool dtype_supported(Dtype dtype) {
  switch (dtype) {
    case Dtype::kF8_E4M3:
      return compat::float8_e4m3fn().has_value();
    case Dtype::kF8_E5M2:
      return compat::float8_e5m2().has_value();
    default:
      return true;
  }
}

c10::ScalarType to_scalar_type(Dtype dtype) {
  switch (dtype) {
    case Dtype::kF64:
      return c10::ScalarType::Double;
    case Dtype::kF32:
      return c10::ScalarType::Float;
    case Dtype::kF16:
      return c10::ScalarType::Half;
    case Dtype::kBF16:
      return c10::ScalarType::BFloat16;
    case Dtype::kI64:
      return c10::ScalarType::Long;
    case Dtype::kI32:
      return c10::ScalarType::Int;
    case Dtype::kI16:
      return c10::ScalarType::Short;
    case Dtype::kI8:
      return c10::ScalarType::Char;
    case Dtype::kU8:
      return c10::ScalarType::Byte;
    case Dtype::kBool:
      return c10::ScalarType::Bool;
    case Dtype::kF8_E4M3:
    case Dtype::kF8_E5M2: {
      auto t = dtype == Dtype::kF8_E4M3 ? compat::float8_e4m3fn() : compat::float8_e5m2();
      if (t) return *t;
      throw ::tandem::Refused(
          "dtype " + std::string(dtype_name(dtype)) + " needs a float8 scalar type, which " +
          "LibTorch " + TORCH_VERSION +
          " lacks (float8 arrived in LibTorch 2.1): build tandem "
          "against LibTorch >= 2.1, or store the tensor as F16, BF16 or F32");
    }
  }
  throw ::tandem::Refused("unknown Dtype value " + std::to_string(static_cast<int>(dtype)));
}

Dtype dtype_of(c10::ScalarType type) {
  for (Dtype d : all_dtypes()) {
    if (dtype_supported(d) && to_scalar_type(d) == type) return d;
  }
  throw ::tandem::Refused(std::string("dtype ") + c10::toString(type) +
                              " has no safetensors equivalent (expected one of float64, float32, "
                              "float16, bfloat16, int64, int32, int16, int8, uint8, bool or "
                              "float8): convert it with .to(...) first");
}

std::string serialize_safetensors(const NamedTensors& tensors,
                                  const SafetensorsMetadata& metadata) {
  WritePlan plan = plan_write(tensors, metadata);
  std::string out;
  out.reserve(plan.header.size() + (plan.layout.empty() ? 0 : plan.layout.back().end));
  write_plan(plan,
             [&](const void* p, std::size_t n) { out.append(static_cast<const char*>(p), n); });
  return out;
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const SafetensorsMetadata& metadata) {
  WritePlan plan = plan_write(tensors, metadata);  // validate before touching the file
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    throw std::runtime_error("save_safetensors: cannot create '" + path + "': " + errno_text() +
                             " (check that the directory exists and is writable)");
  }
  auto fail = [&](const char* what) {
    throw std::runtime_error("save_safetensors: " + std::string(what) + " '" + path +
                             "' failed: " + errno_text() + " (is the disk full?)");
  };
  write_plan(plan, [&](const void* p, std::size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      ssize_t w = ::write(fd.get(), c, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        fail("writing");
      }
      c += w;
      n -= static_cast<std::size_t>(w);
    }
  });
  if (::fsync(fd.get()) != 0) fail("fsync of");
  if (::close(fd.release()) != 0) fail("closing");
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    throw std::runtime_error("safetensors file '" + path + "': cannot open it: " + errno_text());
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    throw std::runtime_error("safetensors file '" + path + "': fstat failed: " + errno_text());
  }
  if (!S_ISREG(st.st_mode)) {
    throw std::runtime_error("safetensors file '" + path +
                             "': is not a regular file (expected a .safetensors file)");
  }
  auto file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    parse_safetensors_header({}, file_size, path);  // throws the "too short" error
  }
  void* map = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (map == MAP_FAILED) {
    throw std::runtime_error("safetensors file '" + path + "': mmap of " +
                             std::to_string(file_size) + " bytes failed: " + errno_text());
  }
  map_ = map;
  map_size_ = file_size;
  fd_ = fd.release();
  try {
    header_ = parse_safetensors_header(std::string_view(static_cast<const char*>(map_), map_size_),
                                       file_size, path);
  } catch (...) {
    close_file();
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  close_file();
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      map_(std::exchange(other.map_, nullptr)),
      map_size_(std::exchange(other.map_size_, 0)),
      header_(std::move(other.header_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    close_file();
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    map_ = std::exchange(other.map_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
    header_ = std::move(other.header_);
  }
  return *this;
}

void SafetensorsFile::close_file() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (map_ != nullptr) ::munmap(map_, map_size_);
  map_ = nullptr;
  map_size_ = 0;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(header_.tensors.size());
  for (const auto& [name, _] : header_.tensors) out.push_back(name);
  return out;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = header_.tensors.find(name);
  if (it == header_.tensors.end()) {
    std::string some;
    int shown = 0;
    for (const auto& [n, _] : header_.tensors) {
      if (shown++ == 5) {
        some += ", ...";
        break;
      }
      some += (some.empty() ? "" : ", ") + n;
    }
    throw ::tandem::Refused("safetensors file '" + path_ + "': no tensor named '" + name +
                                "' (it holds " + std::to_string(header_.tensors.size()) +
                                " tensors: " + (some.empty() ? "none" : some) + ")");
  }
  return it->second;
}

const void* SafetensorsFile::data_of(const TensorInfo& info) const {
  return static_cast<const char*>(map_) + header_.data_offset() + info.begin;
}

// The LibTorch dtype of `name`, or an error naming the file and the tensor (F8 before 2.1).
c10::ScalarType SafetensorsFile::scalar_type_of(const std::string& name,
                                                const TensorInfo& i) const {
  try {
    return to_scalar_type(i.dtype);
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error("safetensors file '" + path_ + "': tensor '" + name +
                             "': " + e.what());
  }
}

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const TensorInfo& i = info(name);
  const c10::ScalarType type = scalar_type_of(name, i);
  at::Tensor t = at::empty(i.shape, at::TensorOptions().dtype(type));
  if (i.nbytes() > 0) std::memcpy(t.data_ptr(), data_of(i), i.nbytes());
  return t;
}

void SafetensorsFile::read_into(const std::string& name, at::Tensor& dst) const {
  const TensorInfo& i = info(name);
  if (!dst.defined() || dst.sizes().vec() != i.shape) {
    throw ::tandem::Refused(
        "safetensors file '" + path_ + "': tensor '" + name + "' has shape " +
        c10::str(c10::IntArrayRef(i.shape)) + ", but the destination has shape " +
        (dst.defined() ? c10::str(dst.sizes()) : std::string("(undefined)")) +
        " (expected equal shapes)");
  }
  read_elements(name, 0, dst);
}

void SafetensorsFile::read_range_into(const std::string& name, int64_t begin,
                                      at::Tensor& dst) const {
  const TensorInfo& i = info(name);
  int64_t numel = 1;
  for (auto d : i.shape) numel *= d;
  if (!dst.defined() || begin < 0 || begin + dst.numel() > numel)
    throw ::tandem::Refused(
        "safetensors file '" + path_ + "': tensor '" + name + "' has " + std::to_string(numel) +
        " elements; elements [" + std::to_string(begin) + ", " +
        std::to_string(begin + (dst.defined() ? dst.numel() : 0)) + ") are not among them");
  read_elements(name, begin, dst);
}

void SafetensorsFile::read_elements(const std::string& name, int64_t begin,
                                    at::Tensor& dst) const {
  const TensorInfo& i = info(name);
  if (dst.numel() == 0) return;
  bool direct = dst.device().is_cpu() && dst.is_contiguous() && dst.layout() == c10::kStrided &&
                !dst.is_conj() && !dst.is_neg() && dtype_supported(i.dtype) &&
                to_scalar_type(i.dtype) == dst.scalar_type();
  const uint64_t element = i.nbytes() / std::max<uint64_t>(1, [&] {
    uint64_t n = 1;
    for (auto d : i.shape) n *= static_cast<uint64_t>(d);
    return n;
  }());
  const uint64_t first = static_cast<uint64_t>(begin) * element;
  const uint64_t bytes = static_cast<uint64_t>(dst.numel()) * element;
  if (direct) {
    // Note [Reading into parameters]: pread copies from the page cache into the parameter once;
    // a memcpy out of the mapping costs a page fault per 4 KiB and leaves the pages resident.
    // A range (a shard of a tensor) reads only its own bytes.
    char* out = static_cast<char*>(dst.data_ptr());
    uint64_t offset = header_.data_offset() + i.begin + first;
    uint64_t left = bytes;
    while (left > 0) {
      const size_t chunk = static_cast<size_t>(std::min<uint64_t>(left, 1u << 30));
      ssize_t got = ::pread(fd_, out, chunk, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        throw std::runtime_error("safetensors file '" + path_ + "': reading tensor '" + name +
                                 "' failed: " + (got < 0 ? errno_text() : "unexpected end of file"));
      out += got;
      offset += static_cast<uint64_t>(got);
      left -= static_cast<uint64_t>(got);
    }
    // copy_ would bump the version counter that autograd checks; do as it does.
    if (!dst.is_inference()) dst.unsafeGetTensorImpl()->bump_version();
    return;
  }
  const c10::ScalarType type = scalar_type_of(name, i);
  // Converted (or moved) through a copy of the range alone.
  at::Tensor part = at::empty({dst.numel()}, at::TensorOptions().dtype(type));
  std::memcpy(part.data_ptr(), static_cast<const char*>(data_of(i)) + first, bytes);
  dst.copy_(part.view(dst.sizes()));
}

}  // namespace tandem::checkpoint
