// find_executable_batch_size: try, recognise out-of-memory errors, release, shrink, retry.
#include "tandem/track/batch_size.h"
#include "tandem/error.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <new>
#include <stdexcept>

namespace tandem::track {

#ifdef TANDEM_WITH_CUDA
namespace detail {
void empty_cuda_cache();  // track/detail/cuda_cache.cpp, compiled only with CUDA
}  // namespace detail
#endif

namespace {

std::string first_line(const std::string& s) {
  auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

}  // namespace

bool is_out_of_memory(const std::exception& error) {
  if (dynamic_cast<const std::bad_alloc*>(&error)) return true;
  if (dynamic_cast<const c10::OutOfMemoryError*>(&error)) return true;
  if (auto* e = dynamic_cast<const c10::Error*>(&error)) {
    const std::string& msg = e->msg();
    return msg.find("CUDA out of memory") != std::string::npos ||
           msg.find("DefaultCPUAllocator: can't allocate memory") != std::string::npos;
  }
  return false;
}

void release_cached_memory() {
#ifdef TANDEM_WITH_CUDA
  detail::empty_cuda_cache();
#endif
}

int64_t find_executable_batch_size(const std::function<void(int64_t)>& fn,
                                   int64_t starting_batch_size,
                                   const BatchSizeFinderOptions& options) {
  if (!fn) throw ::tandem::Refused("find_executable_batch_size: expected a function, got none");
  if (starting_batch_size < 1) {
    throw ::tandem::Refused("find_executable_batch_size: expected a starting batch size of "
                                "at least 1, found " + std::to_string(starting_batch_size));
  }
  const double factor = options.factor();
  if (!(factor > 0 && factor < 1)) {
    throw ::tandem::Refused("find_executable_batch_size: expected a factor between 0 and 1 "
                                "(0.9, or 0.5 to halve), found " + std::to_string(factor));
  }
  int64_t batch = starting_batch_size;
  while (batch > 0) {
    std::string what;
    try {
      fn(batch);
      return batch;
    } catch (const std::exception& e) {
      if (!is_out_of_memory(e)) throw;
      what = first_line(e.what());
    }
    // Out of the catch block: the exception, and whatever it kept alive, is gone by now.
    release_cached_memory();
    int64_t next = static_cast<int64_t>(std::floor(static_cast<double>(batch) * factor));
    if (next >= batch) next = batch - 1;
    if (options.on_retry()) options.on_retry()(batch, next, what);
    batch = next;
  }
  throw std::runtime_error(
      "find_executable_batch_size: expected some batch size from " +
      std::to_string(starting_batch_size) + " down to 1 to fit in memory, but every one ran out "
      "of memory; the model's weights and optimizer states may not fit on their own: shard them "
      "(ZeRO / FSDP), use lower precision, or a smaller model");
}

}  // namespace tandem::track
