// DeviceMesh: the ranks of a job arranged in named dimensions (pp, dp, tp), one process group per
// slice of each dimension; plus the pure arithmetic of meshes (slices, coordinates, the checks)
// and MeshShape, the sizes read from Accelerate's parallelism_config keys.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tandem/state.h"

namespace tandem {
class ProcessGroup;
}

namespace tandem::comm {

/// Sizes of a mesh's dimensions, outermost first.
using MeshDims = std::vector<std::pair<std::string, int>>;

/// The rank lists of every slice along the dimensions `dim_indices` of a row-major mesh of
/// `shape`: a slice holds the ranks whose coordinates agree on every other dimension, ordered by
/// their coordinates along `dim_indices` (row-major among them). Slices are listed in row-major
/// order of the other dimensions. Each list is ascending. Example: shape {2, 2} (dp, tp):
/// mesh_slices(shape, {1}) = {{0, 1}, {2, 3}} (the tp groups), mesh_slices(shape, {0}) =
/// {{0, 2}, {1, 3}} (the dp groups), mesh_slices(shape, {0, 1}) = {{0, 1, 2, 3}}.
std::vector<std::vector<int>> mesh_slices(const std::vector<int>& shape,
                                          const std::vector<int>& dim_indices);
/// mesh_slices along one dimension.
std::vector<std::vector<int>> mesh_slices(const std::vector<int>& shape, int dim_index);

/// The coordinates of `rank` in a row-major mesh of `shape` (the last dimension varies fastest).
std::vector<int> coordinates_of(int rank, const std::vector<int>& shape);

/// Checks that `dims` can lay out `world` ranks: every size >= 1, names distinct and not empty,
/// the product equal to `world` (the message says which size of which dimension would fit, or
/// that the world is not a multiple of the sizes given), and, when `local_world_size` > 0 (ranks
/// per machine), that a "tp" dimension stays within one machine: tp <= local_world_size and
/// local_world_size % tp == 0 (tensor parallel moves activations at every layer; across machines
/// it is slower than any other layout). Throws std::invalid_argument with the fix.
void validate_mesh_shape(int world, const MeshDims& dims, int local_world_size = 0);

/// The mesh sizes under Accelerate's `parallelism_config` names (dp_replicate_size,
/// dp_shard_size, cp_size, tp_size) plus tandem's pp_size. 0 means not set.
///
/// Resolution against a world size (resolve): tp, cp and pp default to 1, and count with tp
/// wherever the derivation below names it (the data-parallel ranks are world / (pp * cp * tp)). When neither dp size is
/// set, the data-parallel ranks replicate (dp_replicate = world / (pp * tp), dp_shard = 1: plain
/// data parallel), or, when the run shards (`shard_data`: a ZeRO stage), they shard
/// (dp_shard = world / (pp * tp), dp_replicate = 1). When exactly one is set, the
/// other is derived as world / (pp * tp * the one set). When both are set, nothing is derived and
/// the product must equal the world.
///
/// Example:
///   auto shape = tandem::comm::MeshShape().tp_size(2).resolve(4);  // dp_replicate 2, tp 2
///   tandem::comm::DeviceMesh mesh(pg, shape.dims(), state.local_world_size);
struct MeshShape {
  int pp = 0;
  int dp_replicate = 0;
  int dp_shard = 0;
  int tp = 0;
  int cp = 0;  ///< context parallel: every sequence split over cp ranks (Note [Context parallel])

  MeshShape& pp_size(int v) { pp = v; return *this; }
  MeshShape& dp_replicate_size(int v) { dp_replicate = v; return *this; }
  MeshShape& dp_shard_size(int v) { dp_shard = v; return *this; }
  MeshShape& tp_size(int v) { tp = v; return *this; }
  MeshShape& cp_size(int v) { cp = v; return *this; }

  /// True when no size is set (a plain data-parallel job).
  bool empty() const {
    return pp == 0 && dp_replicate == 0 && dp_shard == 0 && tp == 0 && cp == 0;
  }
  /// Every size filled in for `world` ranks (see above), then validate_mesh_shape(world, dims(),
  /// local_world_size). Throws std::invalid_argument when a derived size does not divide.
  MeshShape resolve(int world, int local_world_size = 0, bool shard_data = false) const;
  /// {"pp", pp}, {"dp_replicate", dp_replicate}, {"dp_shard", dp_shard}, {"cp", cp}, {"tp", tp}:
  /// torchtitan's order, tp innermost so that a tensor-parallel group is consecutive ranks on one
  /// machine. Unset sizes count as 1; "cp" is there only when above 1 (the mesh of every other
  /// run, and the layout its checkpoints record, stay as they were).
  MeshDims dims() const;
  /// "pp 1 x dp_replicate 2 x dp_shard 1 x tp 2" (" x cp 2" before tp when set).
  std::string to_string() const;
};

// The sizes a launcher exports are read by the run configuration (config::mesh_shape_from_env)
// and written by the launcher (launch::mesh_shape_environment).

/// The ranks of a job in named dimensions, row-major (the last dimension varies fastest), with
/// one ProcessGroup per slice of every dimension. Building one is collective: every rank of
/// `world` constructs the same mesh (same dims, same order of flatten calls), because each slice
/// group is a ProcessGroup::new_subgroup, numbered in call order.
///
/// Example:
///   DeviceMesh mesh(pg, {{"dp", 2}, {"tp", 2}}, state.local_world_size);
///   auto tp = mesh["tp"];   // this rank and its tensor-parallel peers
///   int d = mesh.coordinate("dp");
class DeviceMesh {
 public:
  /// Validates (validate_mesh_shape) and builds the slice groups of every dimension.
  DeviceMesh(std::shared_ptr<ProcessGroup> world, MeshDims dims, int local_world_size = 0);

  /// Adds the dimension `name` over the existing dimensions `dims` taken together (their
  /// product; e.g. "dp" over dp_replicate and dp_shard), with its slice groups. Collective.
  void flatten(const std::vector<std::string>& dims, const std::string& name);

  /// This rank's slice group along `dim`. Throws naming the dimensions there are.
  std::shared_ptr<ProcessGroup> operator[](const std::string& dim) const;
  /// The size of `dim`.
  int size(const std::string& dim) const;
  /// This rank's coordinate along `dim` (its rank in operator[](dim)).
  int coordinate(const std::string& dim) const;
  /// The dimensions' names: the constructor's in order, then flattened ones.
  std::vector<std::string> names() const;
  int world_size() const;
  bool has(const std::string& dim) const;
  /// The world group the mesh was built over.
  const std::shared_ptr<ProcessGroup>& world() const { return world_; }

 private:
  struct Dim {
    std::string name;
    int size = 1;
    int coordinate = 0;
    std::shared_ptr<ProcessGroup> group;
  };
  const Dim& find(const std::string& dim) const;
  std::shared_ptr<ProcessGroup> build(const std::vector<int>& dim_indices);

  std::shared_ptr<ProcessGroup> world_;
  std::vector<int> shape_;  // of the constructor's dimensions
  std::vector<Dim> dims_;
};

/// The mesh of a MeshShape resolved for `world`: dimensions pp, dp_replicate, dp_shard, (cp,) tp,
/// and "dp" flattened over dp_replicate and dp_shard (the ranks that hold different samples);
/// with cp above 1 also "dp_cp" (dp x cp: what gradients are averaged over) and "dp_shard_cp"
/// (dp_shard x cp: what ZeRO shards over), Note [Context parallel].
DeviceMesh make_device_mesh(std::shared_ptr<ProcessGroup> world, const MeshShape& shape,
                            int local_world_size = 0);

}  // namespace tandem::comm
