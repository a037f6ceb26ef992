// Optimizer state in a file, streamed around the step (detail/state_on_disk.h).
//
// Note [Optimizer state on disk]: under offload_optimizer_device nvme (ZeRO-Infinity's
// optimizer offload) every rank keeps its optimizer shards' state (Adam's moments, SGD's
// momentum) in one file under offload_optimizer_nvme_path instead of in memory. The step runs
// unit by unit (each unit is one tensor of the optimizer, its shard): while unit i steps, unit
// i+1's record is read into the next of three buffers and unit i-1's is written back from the
// one before, so the disk works under the update; a buffer is reused only after its write had a
// whole unit's step to finish. Stepping a unit alone is the optimizer's own step with the other
// units' gradients set aside: LibTorch's optimizers skip parameters without a gradient and their
// arithmetic is per parameter, so the result is the in-memory step's, bit for bit. Scalar state
// (step counts) stays in memory. A unit's first step creates its state in memory, as the
// optimizer always does, and writes it out at once. Resident memory holds three buffers of the
// largest unit's state, not the state; the file's pages are the kernel's page cache (reclaimable,
// outside every process's resident set).
#include "detail/state_on_disk.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace tandem::parallel::detail {
namespace {

constexpr int64_t kAlign = 4096;

int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

StateOnDisk::StateOnDisk(const std::string& dir, const std::string& name, std::string prefix)
    : prefix_(std::move(prefix)) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw std::runtime_error(prefix_ + " offload_optimizer_nvme_path " + dir + ": cannot create "
                             "the directory (" + ec.message() + "); choose a writable directory");
  path_ = (std::filesystem::path(dir) /
           ("tandem-optimizer-" + std::to_string(getpid()) + "-" + name + ".state"))
              .string();
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd_ < 0)
    throw std::runtime_error(prefix_ + " offload_optimizer_nvme_path: cannot create " + path_ +
                             " (" + std::strerror(errno) + "); choose a writable directory");
}

StateOnDisk::~StateOnDisk() {
  try {
    finish();
  } catch (...) {
  }
  if (fd_ >= 0) ::close(fd_);
  if (!path_.empty()) ::unlink(path_.c_str());
}

void StateOnDisk::read(int64_t offset, int64_t bytes, void* dst) const {
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd_, static_cast<char*>(dst) + done,
                              static_cast<size_t>(bytes - done), offset + done);
    if (n <= 0)
      throw std::runtime_error(prefix_ + " optimizer state on disk: reading " + path_ + " failed (" +
                               (n == 0 ? std::string("the file is shorter than written")
                                       : std::strerror(errno)) +
                               "); the file must stay in place while the run lasts");
    done += n;
  }
}

void StateOnDisk::write(int64_t offset, int64_t bytes, const void* src) const {
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pwrite(fd_, static_cast<const char*>(src) + done,
                               static_cast<size_t>(bytes - done), offset + done);
    if (n < 0)
      throw std::runtime_error(
          prefix_ + " optimizer state on disk: writing " + path_ + " failed (" +
          std::strerror(errno) + ")" +
          (errno == ENOSPC ? ": the disk is full; free space there or choose another "
                             "offload_optimizer_nvme_path"
                           : ""));
    done += n;
  }
}

void StateOnDisk::wait(Slot& s) {
  if (!s.pending.valid()) return;
  auto f = std::move(s.pending);
  try {
    f.get();
  } catch (...) {
    s.unit = -1;
    throw;
  }
}

StateOnDisk::Slot& StateOnDisk::slot_for_read() {
  Slot& s = slots_[next_slot_];
  next_slot_ = (next_slot_ + 1) % slots_.size();
  wait(s);  // its last write is done before the buffer is read into
  s.unit = -1;
  return s;
}

void StateOnDisk::prefetch(size_t k) {
  if (!on_disk(k)) return;
  for (auto& s : slots_)
    if (s.unit == static_cast<long>(k)) return;
  Slot& s = slot_for_read();
  const Record& r = records_[k];
  if (!s.buffer.defined() || s.buffer.numel() < r.bytes)
    s.buffer = at::empty({r.bytes}, at::TensorOptions().dtype(at::kByte));
  s.unit = static_cast<long>(k);
  void* dst = s.buffer.data_ptr();
  s.pending = std::async(std::launch::async,
                         [this, offset = r.offset, bytes = r.bytes, dst] { read(offset, bytes, dst); });
}

void StateOnDisk::load(size_t k, const StateFields& fields) {
  if (!on_disk(k)) return;
  prefetch(k);  // a no-op when it was prefetched
  Slot* slot = nullptr;
  for (auto& s : slots_)
    if (s.unit == static_cast<long>(k)) slot = &s;
  wait(*slot);
  const Record& r = records_[k];
  auto* base = static_cast<uint8_t*>(slot->buffer.data_ptr());
  const at::Tensor keep = slot->buffer;  // the views hold the buffer
  for (const auto& f : r.fields)
    for (const auto& [name, t] : fields)
      if (name == f.name)
        *t = at::from_blob(base + f.offset, f.sizes, [keep](void*) {},
                           at::TensorOptions().dtype(f.dtype));
}

void StateOnDisk::load_copy(size_t k, const StateFields& fields) {
  if (!on_disk(k)) return;
  finish();  // no write of this record in flight
  const Record& r = records_[k];
  for (const auto& f : r.fields)
    for (const auto& [name, t] : fields)
      if (name == f.name) {
        *t = at::empty(f.sizes, at::TensorOptions().dtype(f.dtype));
        read(r.offset + f.offset, f.bytes, t->data_ptr());
      }
}

void StateOnDisk::store(size_t k, const StateFields& fields) {
  if (records_.size() <= k) records_.resize(k + 1);
  Record& r = records_[k];
  std::vector<std::pair<const Field*, at::Tensor*>> present;
  if (r.bytes == 0) {  // the first store lays the record out
    int64_t off = 0;
    for (const auto& [name, t] : fields) {
      if (!t->defined()) continue;
      Field f;
      f.name = name;
      f.sizes = t->sizes().vec();
      f.dtype = t->scalar_type();
      f.offset = off;
      f.bytes = static_cast<int64_t>(t->numel() * t->element_size());
      off = aligned(off + f.bytes);
      r.fields.push_back(f);
    }
    if (r.fields.empty()) return;
    r.bytes = off;
    r.offset = end_;
    end_ += r.bytes;
    // The padding after the last field is never written: the file holds it as a hole.
    if (::ftruncate(fd_, end_) != 0)
      throw std::runtime_error(prefix_ + " optimizer state on disk: growing " + path_ + " to " +
                               std::to_string(end_) + " bytes failed (" + std::strerror(errno) +
                               "); free space there or choose another offload_optimizer_nvme_path");
  }
  for (const auto& f : r.fields) {
    at::Tensor* t = nullptr;
    for (const auto& [name, p] : fields)
      if (name == f.name) t = p;
    if (!t || !t->defined() || t->sizes().vec() != f.sizes || t->scalar_type() != f.dtype)
      throw std::runtime_error(prefix_ + " optimizer state on disk: the state field " + f.name +
                               " of unit " + std::to_string(k) + " changed its shape or dtype, or "
                               "went away, since it was first written; offload_optimizer_device "
                               "nvme needs an optimizer whose state keeps its layout");
    present.emplace_back(&f, t);
  }
  // Loaded into a buffer and updated in place there: written back in the background.
  for (auto& s : slots_) {
    if (s.unit != static_cast<long>(k)) continue;
    auto* base = static_cast<uint8_t*>(s.buffer.data_ptr());
    bool in_place = !s.pending.valid();
    for (const auto& [f, t] : present)
      in_place = in_place && t->data_ptr() == base + f->offset;
    if (in_place) {
      for (const auto& [f, t] : present) *t = at::Tensor();
      s.pending = std::async(std::launch::async, [this, offset = r.offset, bytes = r.bytes, base] {
        write(offset, bytes, base);
      });
      return;
    }
    wait(s);
    s.unit = -1;  // its bytes are stale now
  }
  // The first store, or state the optimizer replaced: written now, field by field.
  for (const auto& [f, t] : present) {
    const at::Tensor c = t->contiguous();
    write(r.offset + f->offset, f->bytes, c.data_ptr());
    *t = at::Tensor();
  }
}

void StateOnDisk::finish() {
  std::exception_ptr first;
  for (auto& s : slots_) {
    try {
      wait(s);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace tandem::parallel::detail
