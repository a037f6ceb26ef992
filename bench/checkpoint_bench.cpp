// Checkpoint throughput: save_model / load_model of a ~1 GB model beside writing and reading the
// same bytes with plain file I/O, alternating within each of several repetitions (medians), and
// the peak resident memory of a sharded load in a fresh process.
//   checkpoint_bench [LAYERS=16] [DIR] [REPS=3]      throughput; then runs the memory check
//   checkpoint_bench --sharded-load LAYERS DIR       (internal) the fresh process of that check
// Prints "RESULT checkpoint <name>=<value>" lines.
#include <fcntl.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "tandem/checkpoint/model_io.h"
#include "tandem/track/cpu_memory.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void drop_page_cache_of(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

torch::nn::Sequential make_model(int64_t layers) {
  torch::nn::Sequential model;
  for (int64_t i = 0; i < layers; ++i)
    model->push_back(torch::nn::Linear(torch::nn::LinearOptions(4096, 4096).bias(false)));
  return model;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}
double spread(const std::vector<double>& v) {
  auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return 100.0 * (*hi - *lo) / median(v);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--sharded-load") {
    // A fresh process: the model (its bytes, as a user's process has them), then the load.
    auto model = make_model(std::atoll(argv[2]));
    const int64_t before = (tandem::track::resident_memory().current_bytes / 1024);
    tandem::checkpoint::load_model(*model, argv[3]);
    std::printf("RESULT checkpoint rss_model_mb=%.1f peak_rss_mb=%.1f\n", before / 1024.0,
                (tandem::track::resident_memory().peak_bytes / 1024) / 1024.0);
    return 0;
  }
  const int64_t layers = argc > 1 ? std::atoll(argv[1]) : 16;  // 16 x 4096 x 4096 fp32 = 1.07 GB
  const std::string dir = argc > 2 ? argv[2] : "/tmp/tandem-ckpt-bench";
  const int reps = argc > 3 ? std::atoi(argv[3]) : 3;
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto model = make_model(layers);
  int64_t bytes = 0;
  for (auto& p : model->parameters()) bytes += p.numel() * 4;
  const double gb = bytes / 1e9;

  std::vector<double> save, plain_save, load, plain_load;
  for (int r = 0; r < reps; ++r) {
    // Saves: tandem (safetensors, one file, fsync) then the same bytes with one fwrite + fsync.
    fs::remove_all(dir + "/single");
    auto t = Clock::now();
    tandem::checkpoint::save_model(*model, dir + "/single", "100GB");
    save.push_back(gb / since(t));
    fs::remove(dir + "/plain.bin");
    t = Clock::now();
    {
      FILE* f = std::fopen((dir + "/plain.bin").c_str(), "wb");
      for (auto& p : model->parameters()) std::fwrite(p.data_ptr(), 1, p.numel() * 4, f);
      std::fflush(f);
      ::fsync(::fileno(f));
      std::fclose(f);
    }
    plain_save.push_back(gb / since(t));
    // Loads from a cold page cache, in alternating order.
    for (int which = 0; which < 2; ++which) {
      const bool tandem_first = r % 2 == 0;
      const bool tandem_now = (which == 0) == tandem_first;
      for (auto& p : model->parameters()) p.detach().zero_();
      if (tandem_now) {
        drop_page_cache_of(dir + "/single/model.safetensors");
        t = Clock::now();
        tandem::checkpoint::load_model(*model, dir + "/single");
        load.push_back(gb / since(t));
      } else {
        drop_page_cache_of(dir + "/plain.bin");
        t = Clock::now();
        FILE* f = std::fopen((dir + "/plain.bin").c_str(), "rb");
        for (auto& p : model->parameters()) {
          size_t n = std::fread(p.data_ptr(), 1, p.numel() * 4, f);
          (void)n;
        }
        std::fclose(f);
        plain_load.push_back(gb / since(t));
      }
    }
  }
  std::printf("RESULT checkpoint model_gb=%.3f reps=%d\n", gb, reps);
  std::printf("RESULT checkpoint save_gbps=%.3f save_spread=%.1f plain_write_gbps=%.3f plain_write_spread=%.1f\n",
              median(save), spread(save), median(plain_save), spread(plain_save));
  std::printf("RESULT checkpoint load_gbps=%.3f load_spread=%.1f plain_read_gbps=%.3f plain_read_spread=%.1f\n",
              median(load), spread(load), median(plain_load), spread(plain_load));

  // Peak resident memory of a sharded load (200 MB shards) in a fresh process.
  tandem::checkpoint::save_model(*model, dir + "/sharded", "200MB");
  int64_t largest = 0;
  for (auto& e : fs::directory_iterator(dir + "/sharded"))
    if (e.path().extension() == ".safetensors")
      largest = std::max<int64_t>(largest, static_cast<int64_t>(fs::file_size(e.path())));
  std::fflush(stdout);
  const std::string cmd = std::string("'") + argv[0] + "' --sharded-load " + std::to_string(layers) +
                          " '" + dir + "/sharded'";
  if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "the sharded-load process failed\n");
  std::printf("RESULT checkpoint model_mb=%.1f largest_shard_mb=%.1f\n", bytes / 1048576.0,
              largest / 1048576.0);
  fs::remove_all(dir);
  return 0;
}
