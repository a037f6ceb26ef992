// The whole model from its model-parallel parts (see parallel/full_state.h).
#include "tandem/parallel/full_state.h"
#include "tandem/error.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <nlohmann/json.hpp>

#include <stdexcept>

#include "tandem/comm/collectives.h"
#include "tandem/comm/process_group.h"
#include "detail/reshard.h"

namespace tandem::parallel {
namespace {

using json = nlohmann::json;

int64_t parts_of(const std::string& how) {
  if (how == "cols") return 0;
  if (how.rfind("rows/", 0) == 0) {
    try {
      size_t pos = 0;
      const auto p = std::stoll(how.substr(5), &pos);
      if (pos == how.size() - 5 && p >= 1) return p;
    } catch (const std::exception&) {
    }
  }
  throw ::tandem::Refused("join_tensor_parallel_shards: split '" + how +
                              "': expected \"cols\" or \"rows/<parts >= 1>\"");
}

// A tensor's bytes as a 1-D uint8 CPU tensor, and back.
at::Tensor to_bytes(const at::Tensor& t) {
  auto c = t.detach().to(at::kCPU).contiguous();
  return at::from_blob(c.data_ptr(), {static_cast<int64_t>(c.nbytes())}, at::kByte).clone();
}

}  // namespace

at::Tensor cut_tensor_parallel_shard(const at::Tensor& dense, const std::string& how, int rank,
                                     int size) {
  return detail::cut_for_rank(dense, how, rank, size);
}

at::Tensor join_tensor_parallel_shards(const std::vector<at::Tensor>& shards,
                                       const std::string& how) {
  if (shards.empty()) throw ::tandem::Refused("join_tensor_parallel_shards: no shards");
  const int64_t parts = parts_of(how);
  for (const auto& s : shards)
    if (s.sizes() != shards.front().sizes() || s.scalar_type() != shards.front().scalar_type())
      throw ::tandem::Refused("join_tensor_parallel_shards: shards of different shapes or "
                                  "dtypes; every tp rank's shard of a tensor has one shape");
  if (parts == 0) {
    if (shards.front().dim() < 2)
      throw ::tandem::Refused("join_tensor_parallel_shards: a 'cols' split needs 2-D shards");
    return at::cat(shards, 1);
  }
  if (shards.front().dim() < 1 || shards.front().size(0) % parts != 0)
    throw ::tandem::Refused("join_tensor_parallel_shards: shards of " +
                                std::to_string(shards.front().size(0)) + " rows do not split into " +
                                std::to_string(parts) + " blocks");
  std::vector<std::vector<at::Tensor>> blocks;
  for (const auto& s : shards) blocks.push_back(s.chunk(parts, 0));
  std::vector<at::Tensor> ordered;
  for (int64_t j = 0; j < parts; ++j)
    for (const auto& b : blocks) ordered.push_back(b[static_cast<size_t>(j)]);
  return at::cat(ordered, 0);
}

std::vector<std::pair<std::string, at::Tensor>> gather_model_parallel_state(
    const std::vector<std::pair<std::string, at::Tensor>>& local,
    const std::map<std::string, std::string>& splits, ProcessGroup* tp, ProcessGroup* pp,
    bool holds) {
  if (!holds) return {};
  std::vector<std::pair<std::string, at::Tensor>> mine;
  at::NoGradGuard no_grad;
  if (tp && tp->size() > 1) {
    for (const auto& [name, t] : local) {
      auto it = splits.find(name);
      if (it == splits.end()) {
        mine.emplace_back(name, t);
        continue;
      }
      auto shards = tp->allgather(t.detach().contiguous());
      if (tp->rank() == 0) mine.emplace_back(name, join_tensor_parallel_shards(shards, it->second));
    }
    if (tp->rank() != 0) return {};
  } else {
    mine = local;
  }
  if (!pp || pp->size() == 1) return mine;
  // Every stage's tensors to pipeline rank 0: a header (names, dtypes, shapes) and the bytes.
  json header = json::array();
  std::vector<at::Tensor> bytes;
  for (const auto& [name, t] : mine) {
    header.push_back({{"name", name},
                      {"dtype", static_cast<int>(t.scalar_type())},
                      {"shape", t.sizes().vec()}});
    bytes.push_back(to_bytes(t));
  }
  auto flat = bytes.empty() ? at::empty({0}, at::kByte) : at::cat(bytes);
  auto headers = comm::gather_object(*pp, header.dump());
  auto all = comm::gather(*pp, flat);
  if (pp->rank() != 0) return {};
  std::vector<std::pair<std::string, at::Tensor>> out;
  int64_t offset = 0;
  for (const auto& h : headers)
    for (const auto& e : json::parse(h)) {
      const auto dtype = static_cast<at::ScalarType>(e["dtype"].get<int>());
      const auto shape = e["shape"].get<std::vector<int64_t>>();
      auto t = at::empty(shape, at::TensorOptions().dtype(dtype));
      const auto n = static_cast<int64_t>(t.nbytes());
      if (n > 0)
        at::from_blob(t.data_ptr(), {n}, at::kByte).copy_(all.narrow(0, offset, n));
      offset += n;
      out.emplace_back(e["name"].get<std::string>(), t);
    }
  return out;
}

}  // namespace tandem::parallel
