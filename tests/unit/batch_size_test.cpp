// find_executable_batch_size with injected out-of-memory errors of each kind.
#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include <new>
#include <vector>

#include "tandem/track/batch_size.h"

using tandem::track::BatchSizeFinderOptions;
using tandem::track::find_executable_batch_size;

namespace {

c10::SourceLocation here() { return {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}; }

// Fails with `error` for batch sizes above 37, recording every size tried.
template <typename Error>
std::function<void(int64_t)> fails_above_37(std::vector<int64_t>& tried, Error error) {
  return [&tried, error](int64_t batch) {
    tried.push_back(batch);
    if (batch > 37) throw error;
  };
}

}  // namespace

TEST(BatchSizeFinder, TenPercentStepsWithOutOfMemoryError) {
  std::vector<int64_t> tried;
  auto oom = c10::OutOfMemoryError(here(), "CUDA out of memory. Tried to allocate 2.00 GiB");
  EXPECT_EQ(find_executable_batch_size(fails_above_37(tried, oom), 128), 36);
  // floor(b * 0.9) each time, as Accelerate's int(b * 0.9).
  EXPECT_EQ(tried, (std::vector<int64_t>{128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36}));
}

TEST(BatchSizeFinder, HalvingWithTheCpuAllocatorMessage) {
  std::vector<int64_t> tried;
  auto oom = c10::Error(here(), "DefaultCPUAllocator: can't allocate memory: you tried to "
                                "allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)");
  auto opts = BatchSizeFinderOptions().factor(0.5);
  EXPECT_EQ(find_executable_batch_size(fails_above_37(tried, oom), 128, opts), 32);
  EXPECT_EQ(tried, (std::vector<int64_t>{128, 64, 32}));
}

TEST(BatchSizeFinder, CudaMessageInAPlainErrorAndBadAlloc) {
  std::vector<int64_t> tried;
  auto cuda = c10::Error(here(), "CUDA out of memory. Tried to allocate 20.00 MiB");
  EXPECT_EQ(find_executable_batch_size(fails_above_37(tried, cuda), 40, BatchSizeFinderOptions().factor(0.5)), 20);
  tried.clear();
  EXPECT_EQ(find_executable_batch_size(fails_above_37(tried, std::bad_alloc()), 38), 34);
  EXPECT_EQ(tried, (std::vector<int64_t>{38, 34}));
}

TEST(BatchSizeFinder, ReportsRetries) {
  std::vector<std::pair<int64_t, int64_t>> retries;
  std::string last_message;
  auto opts = BatchSizeFinderOptions().factor(0.5).on_retry(
      [&](int64_t failed, int64_t next, const std::string& msg) {
        retries.emplace_back(failed, next);
        last_message = msg;
      });
  std::vector<int64_t> tried;
  auto oom = c10::OutOfMemoryError(here(), "CUDA out of memory. Tried to allocate 2.00 GiB\nmore");
  find_executable_batch_size(fails_above_37(tried, oom), 100, opts);
  EXPECT_EQ(retries, (std::vector<std::pair<int64_t, int64_t>>{{100, 50}, {50, 25}}));
  EXPECT_EQ(last_message.find('\n'), std::string::npos);
  EXPECT_NE(last_message.find("CUDA out of memory"), std::string::npos);
}

TEST(BatchSizeFinder, OtherErrorsPassThroughUntouched) {
  int calls = 0;
  try {
    find_executable_batch_size([&](int64_t) { ++calls; throw std::out_of_range("index 7 of 3"); }, 64);
    FAIL() << "expected the error";
  } catch (const std::out_of_range& e) {
    EXPECT_STREQ(e.what(), "index 7 of 3");
  }
  EXPECT_EQ(calls, 1);

  calls = 0;
  EXPECT_THROW(find_executable_batch_size(
                   [&](int64_t) {
                     ++calls;
                     throw c10::Error(here(), "Expected all tensors to be on the same device");
                   },
                   64),
               c10::Error);
  EXPECT_EQ(calls, 1);
}

TEST(BatchSizeFinder, GivesUpAtZeroNamingTheStart) {
  std::vector<int64_t> tried;
  try {
    find_executable_batch_size([&](int64_t b) { tried.push_back(b); throw std::bad_alloc(); }, 8);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("from 8 down to 1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(tried, (std::vector<int64_t>{8, 7, 6, 5, 4, 3, 2, 1}));  // at least one less each time
  EXPECT_THROW(find_executable_batch_size([](int64_t) {}, 0), std::invalid_argument);
  EXPECT_THROW(find_executable_batch_size([](int64_t) {}, 8, BatchSizeFinderOptions().factor(1.0)),
               std::invalid_argument);
}
