// DeviceMesh: a process group per slice of a row-major mesh (the arithmetic: mesh_shape.cpp).
#include "tandem/comm/mesh.h"
#include "tandem/error.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include "tandem/comm/process_group.h"

namespace tandem::comm {

DeviceMesh::DeviceMesh(std::shared_ptr<ProcessGroup> world, MeshDims dims, int local_world_size)
    : world_(std::move(world)) {
  if (!world_) throw ::tandem::Refused("DeviceMesh needs a world ProcessGroup (got nullptr)");
  try {
    validate_mesh_shape(world_->size(), dims, local_world_size);
  } catch (const std::invalid_argument& e) {
    throw ::tandem::Refused(world_->prefix() + " " + e.what());
  }
  for (const auto& d : dims) shape_.push_back(d.second);
  const auto coords = coordinates_of(world_->rank(), shape_);
  for (size_t i = 0; i < dims.size(); ++i) {
    Dim d;
    d.name = dims[i].first;
    d.size = dims[i].second;
    d.coordinate = coords[i];
    d.group = build({static_cast<int>(i)});
    dims_.push_back(std::move(d));
  }
}

std::shared_ptr<ProcessGroup> DeviceMesh::build(const std::vector<int>& dim_indices) {
  // Every rank creates every slice's group, in the same order, so that new_subgroup's call
  // counter (its store prefix) agrees on every rank; this rank keeps the one it belongs to.
  // A slice of every rank is the world group itself (Note [A topology always built]): a plain
  // data-parallel job's "dp" costs no second connection. Every rank sees the same slices, so
  // every rank skips the same calls and the counter still agrees.
  std::shared_ptr<ProcessGroup> mine;
  for (const auto& slice : mesh_slices(shape_, dim_indices)) {
    if (static_cast<int>(slice.size()) == world_->size()) {
      mine = world_;
      continue;
    }
    // The mesh numbers ranks of `world_`; new_subgroup takes global ranks.
    std::vector<int> global;
    for (int r : slice) global.push_back(world_->global_rank(r));
    auto g = world_->new_subgroup(global);
    if (g) mine = std::move(g);
  }
  return mine;
}

void DeviceMesh::flatten(const std::vector<std::string>& dims, const std::string& name) {
  if (has(name))
    throw ::tandem::Refused(world_->prefix() + " DeviceMesh::flatten: dimension '" + name +
                                "' exists already");
  std::vector<int> indices;
  Dim d;
  d.name = name;
  for (const auto& n : dims) {
    int i = -1;
    for (size_t k = 0; k < shape_.size(); ++k)
      if (dims_[k].name == n) i = static_cast<int>(k);
    if (i < 0)
      throw ::tandem::Refused(world_->prefix() + " DeviceMesh::flatten: '" + n +
                                  "' is not one of the mesh's own dimensions");
    indices.push_back(i);
  }
  std::sort(indices.begin(), indices.end());
  int wider = 0, widest = indices.empty() ? -1 : indices.front();
  for (int i : indices) {
    const auto& di = dims_[static_cast<size_t>(i)];
    d.coordinate = d.coordinate * di.size + di.coordinate;
    d.size *= di.size;
    if (di.size > 1) {
      ++wider;
      widest = i;
    }
  }
  // Over one dimension above size 1 (dp over dp_replicate 1 x dp_shard 4), the slices are that
  // dimension's: its group serves (on every rank alike, so the subgroup counter still agrees).
  if (wider <= 1 && widest >= 0)
    d.group = dims_[static_cast<size_t>(widest)].group;
  else
    d.group = build(indices);
  dims_.push_back(std::move(d));
}

const DeviceMesh::Dim& DeviceMesh::find(const std::string& dim) const {
  for (const auto& d : dims_)
    if (d.name == dim) return d;
  std::string names;
  for (const auto& d : dims_) names += (names.empty() ? "" : ", ") + d.name;
  throw ::tandem::Refused(world_->prefix() + " the device mesh has no dimension '" + dim +
                              "'; it has " + names);
}

std::shared_ptr<ProcessGroup> DeviceMesh::operator[](const std::string& dim) const {
  return find(dim).group;
}
int DeviceMesh::size(const std::string& dim) const { return find(dim).size; }
int DeviceMesh::coordinate(const std::string& dim) const { return find(dim).coordinate; }
std::vector<std::string> DeviceMesh::names() const {
  std::vector<std::string> n;
  for (const auto& d : dims_) n.push_back(d.name);
  return n;
}
int DeviceMesh::world_size() const { return world_->size(); }
bool DeviceMesh::has(const std::string& dim) const {
  for (const auto& d : dims_)
    if (d.name == dim) return true;
  return false;
}

DeviceMesh make_device_mesh(std::shared_ptr<ProcessGroup> world, const MeshShape& shape,
                            int local_world_size) {
  const auto resolved = shape.resolve(world->size(), local_world_size);
  DeviceMesh mesh(std::move(world), resolved.dims(), local_world_size);
  mesh.flatten({"dp_replicate", "dp_shard"}, "dp");
  if (resolved.cp > 1) {  // Note [Context parallel]: the cp ranks hold the same parameters
    mesh.flatten({"dp_replicate", "dp_shard", "cp"}, "dp_cp");
    mesh.flatten({"dp_shard", "cp"}, "dp_shard_cp");
  }
  return mesh;
}

}  // namespace tandem::comm
