// The arithmetic of row-major meshes and MeshShape (mesh.h): no LibTorch at run time, so that
// the launcher links it (Note [A launcher without LibTorch]). DeviceMesh is in mesh.cpp.
#include "tandem/comm/mesh.h"
#include "tandem/error.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

namespace tandem::comm {
namespace {

std::string describe(const MeshDims& dims) {
  std::string s;
  for (const auto& [name, size] : dims) s += (s.empty() ? "" : " x ") + name + " " + std::to_string(size);
  return s.empty() ? "(no dimensions)" : s;
}

int product(const MeshDims& dims) {
  long long p = 1;
  for (const auto& d : dims) p *= d.second;
  return static_cast<int>(p);
}

}  // namespace

std::vector<std::vector<int>> mesh_slices(const std::vector<int>& shape,
                                          const std::vector<int>& dim_indices) {
  const int nd = static_cast<int>(shape.size());
  std::vector<bool> in_slice(static_cast<size_t>(nd), false);
  for (int d : dim_indices) {
    if (d < 0 || d >= nd)
      throw ::tandem::Refused("mesh_slices: dimension " + std::to_string(d) +
                                  " does not exist in a mesh of " + std::to_string(nd) +
                                  " dimensions");
    if (in_slice[static_cast<size_t>(d)])
      throw ::tandem::Refused("mesh_slices: dimension " + std::to_string(d) + " given twice");
    in_slice[static_cast<size_t>(d)] = true;
  }
  int world = 1;
  for (int s : shape) world *= s;
  // Group every rank by its coordinates on the other dimensions; ranks come in ascending order,
  // which is row-major order of the slice dimensions within a slice.
  std::map<std::vector<int>, std::vector<int>> slices;
  for (int r = 0; r < world; ++r) {
    auto c = coordinates_of(r, shape);
    std::vector<int> key;
    for (int d = 0; d < nd; ++d)
      if (!in_slice[static_cast<size_t>(d)]) key.push_back(c[static_cast<size_t>(d)]);
    slices[key].push_back(r);
  }
  std::vector<std::vector<int>> out;
  for (auto& [key, ranks] : slices) out.push_back(std::move(ranks));
  return out;
}

std::vector<std::vector<int>> mesh_slices(const std::vector<int>& shape, int dim_index) {
  return mesh_slices(shape, std::vector<int>{dim_index});
}

std::vector<int> coordinates_of(int rank, const std::vector<int>& shape) {
  int world = 1;
  for (int s : shape) {
    if (s < 1) throw ::tandem::Refused("coordinates_of: mesh sizes must be >= 1");
    world *= s;
  }
  if (rank < 0 || rank >= world)
    throw ::tandem::Refused("coordinates_of: rank " + std::to_string(rank) +
                                " is outside a mesh of " + std::to_string(world) + " ranks");
  std::vector<int> c(shape.size());
  for (size_t i = shape.size(); i-- > 0;) {
    c[i] = rank % shape[i];
    rank /= shape[i];
  }
  return c;
}

void validate_mesh_shape(int world, const MeshDims& dims, int local_world_size) {
  std::set<std::string> seen;
  for (const auto& [name, size] : dims) {
    if (name.empty()) throw ::tandem::Refused("device mesh: a dimension has no name");
    if (!seen.insert(name).second)
      throw ::tandem::Refused("device mesh: dimension '" + name + "' is given twice (" +
                                  describe(dims) + ")");
    if (size < 1)
      throw ::tandem::Refused("device mesh: dimension " + name + " has size " +
                                  std::to_string(size) + "; sizes must be at least 1");
  }
  const int p = product(dims);
  if (p != world) {
    std::string fix;
    if (p < world && world % p == 0) {
      const int missing = world / p;
      fix = "a factor " + std::to_string(missing) + " is missing: ";
      std::string options;
      for (const auto& [name, size] : dims) {
        if (!options.empty()) options += ", or ";
        options += name + " " + std::to_string(size * missing);
      }
      fix += "e.g. " + options + " would fit";
    } else {
      std::string options;
      for (const auto& [name, size] : dims) {
        const int others = p / size;
        if (world % others == 0) {
          if (!options.empty()) options += ", or ";
          options += name + " " + std::to_string(world / others);
        }
      }
      fix = options.empty()
                ? "no single size can be changed to fit; choose sizes whose product is " +
                      std::to_string(world) + ", or run " + std::to_string(p) + " processes"
                : "e.g. " + options + " would fit, or run " + std::to_string(p) + " processes";
    }
    throw ::tandem::Refused("device mesh " + describe(dims) + " has " + std::to_string(p) +
                                " ranks but the job has " + std::to_string(world) + ": " + fix);
  }
  if (local_world_size > 0) {
    for (const auto& [name, size] : dims) {
      if (name != "tp" || size == 1) continue;
      if (size > local_world_size || local_world_size % size != 0)
        throw ::tandem::Refused(
            "tensor parallel size " + std::to_string(size) + " does not fit in the " +
            std::to_string(local_world_size) +
            " processes of one machine: a tensor-parallel group moves activations at every "
            "layer and must stay within a machine (tp must divide the processes per machine). "
            "Choose a tp size that divides " + std::to_string(local_world_size) +
            " and use the other ranks for data or pipeline parallel");
    }
  }
}

MeshShape MeshShape::resolve(int world, int local_world_size, bool shard_data) const {
  MeshShape r = *this;
  if (r.pp == 0) r.pp = 1;
  if (r.tp == 0) r.tp = 1;
  if (r.cp == 0) r.cp = 1;
  auto derive = [&](int given, const char* name) {
    const int fixed = r.pp * r.tp * r.cp * given;
    if (fixed < 1 || world % fixed != 0)
      throw ::tandem::Refused("parallelism sizes " + to_string() + ": " + std::to_string(world) +
                                  " processes are not a multiple of pp x cp x tp x the dp size given (" +
                                  std::to_string(fixed) + "), so " + name +
                                  " cannot be derived; set sizes whose product is " +
                                  std::to_string(world));
    return world / fixed;
  };
  if (r.dp_replicate == 0 && r.dp_shard == 0) {
    if (shard_data) {
      r.dp_replicate = 1;
      r.dp_shard = derive(1, "dp_shard_size");
    } else {
      r.dp_shard = 1;
      r.dp_replicate = derive(1, "dp_replicate_size");
    }
  } else if (r.dp_replicate == 0) {
    r.dp_replicate = derive(r.dp_shard, "dp_replicate_size");
  } else if (r.dp_shard == 0) {
    r.dp_shard = derive(r.dp_replicate, "dp_shard_size");
  }
  validate_mesh_shape(world, r.dims(), local_world_size);
  return r;
}

MeshDims MeshShape::dims() const {
  auto one = [](int v) { return v == 0 ? 1 : v; };
  MeshDims d{{"pp", one(pp)}, {"dp_replicate", one(dp_replicate)}, {"dp_shard", one(dp_shard)}};
  if (cp > 1) d.emplace_back("cp", cp);
  d.emplace_back("tp", one(tp));
  return d;
}

std::string MeshShape::to_string() const {
  auto s = [](int v) { return v == 0 ? std::string("unset") : std::to_string(v); };
  return "pp " + s(pp) + " x dp_replicate " + s(dp_replicate) + " x dp_shard " + s(dp_shard) +
         (cp > 1 ? " x cp " + s(cp) : std::string()) + " x tp " + s(tp);
}

}  // namespace tandem::comm
