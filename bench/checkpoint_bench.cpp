// Checkpoint throughput: save_model / load_model of a ~1 GB model beside writing and reading the
// same bytes with plain file I/O, in the same run; and the peak memory of a sharded load.
// Prints "RESULT checkpoint <name>=<value>" lines.
#include <fcntl.h>
#include <unistd.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "tandem/checkpoint/model_io.h"

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int64_t rss_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(std::string(field).size()));
  return -1;
}

void drop_page_cache_of(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t layers = argc > 1 ? std::atoll(argv[1]) : 16;  // 16 x 4096 x 4096 fp32 = 1.07 GB
  const std::string dir = argc > 2 ? argv[2] : "/tmp/tandem-ckpt-bench";
  namespace fs = std::filesystem;
  fs::remove_all(dir);
  fs::create_directories(dir);
  torch::nn::Sequential model;
  for (int64_t i = 0; i < layers; ++i) model->push_back(torch::nn::Linear(torch::nn::LinearOptions(4096, 4096).bias(false)));
  int64_t bytes = 0;
  for (auto& p : model->parameters()) bytes += p.numel() * 4;
  const double gb = bytes / 1e9;

  // tandem: safetensors, one file; then sharded at 200 MB.
  auto t = Clock::now();
  tandem::checkpoint::save_model(*model, dir + "/single", "100GB");
  double save_s = since(t);
  tandem::checkpoint::save_model(*model, dir + "/sharded", "200MB");
  // plain: the same bytes, one fwrite, fsync'd like tandem's files.
  t = Clock::now();
  {
    FILE* f = std::fopen((dir + "/plain.bin").c_str(), "wb");
    for (auto& p : model->parameters()) std::fwrite(p.data_ptr(), 1, p.numel() * 4, f);
    std::fflush(f);
    ::fsync(::fileno(f));
    std::fclose(f);
  }
  double plain_save_s = since(t);

  for (auto& p : model->parameters()) p.detach().zero_();
  drop_page_cache_of(dir + "/single/model.safetensors");
  t = Clock::now();
  tandem::checkpoint::load_model(*model, dir + "/single");
  double load_s = since(t);
  drop_page_cache_of(dir + "/plain.bin");
  t = Clock::now();
  {
    FILE* f = std::fopen((dir + "/plain.bin").c_str(), "rb");
    for (auto& p : model->parameters()) {
      size_t n = std::fread(p.data_ptr(), 1, p.numel() * 4, f);
      (void)n;
    }
    std::fclose(f);
  }
  double plain_load_s = since(t);

  // Peak resident memory during a sharded load, above the model itself.
  int64_t before = rss_kib("VmRSS:");
  ::system("true");
  tandem::checkpoint::load_model(*model, dir + "/sharded");
  int64_t peak = rss_kib("VmHWM:");

  std::printf("RESULT checkpoint model_gb=%.3f\n", gb);
  std::printf("RESULT checkpoint save_gbps=%.3f plain_write_gbps=%.3f\n", gb / save_s, gb / plain_save_s);
  std::printf("RESULT checkpoint load_gbps=%.3f plain_read_gbps=%.3f\n", gb / load_s, gb / plain_load_s);
  std::printf("RESULT checkpoint rss_before_sharded_load_mb=%.1f peak_rss_mb=%.1f\n", before / 1024.0, peak / 1024.0);
  fs::remove_all(dir);
  return 0;
}
