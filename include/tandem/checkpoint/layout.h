// Note [Checkpoint layout]: the one owner of what a tandem checkpoint directory holds: the names
// of its files, the keys of the records its parts write (state.json's "layout" and "mesh", a
// model part's safetensors metadata, an optimizer file's "tandem" record) and the checked
// reading of each. The checkpoint parts (parallel/checkpoint_parts.cpp, accelerator_state.cpp),
// resharding (parallel/reshard.cpp), the topology and merge_weights spell them through here
// only, so a file one writes is a file the others find, and a value altered on disk is refused
// with the file, the key and what was expected, never read as a wrong number.
//
//   model.safetensors, model_1.safetensors, ...    a model, whole (no model parallel)
//   model.mp<r>.safetensors                        the model of global rank r's (tp, pp)
//                                                  coordinate, written by its first dp rank
//   optimizer[_i].{safetensors,json}               an optimizer, whole
//   optimizer[_i].mp<r>.{safetensors,json}         rank r's whole optimizer under model parallel
//   optimizer[_i].rank<r>.{safetensors,json}       rank r's ZeRO shards
//   master_weights[_i][.mp<r>].safetensors         fp32 masters of a mixed-precision optimizer
//   random_states_<r>.safetensors                  rank r's generators
//   custom_<name>.bin                              a registered object's bytes
// and state.json's "layout" ({"mesh", "strategy"}) with, under model parallel, "mesh" (the mesh
// string alone, as checkpoints before "layout" recorded it).
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tandem::checkpoint {

class StateReader;

namespace layout {

// --- File names -------------------------------------------------------------------------------

/// "model", "model_1", ...: the i-th object of a kind.
std::string indexed(const std::string& stem, std::size_t i);
/// model[_i].safetensors; its sharded form's index model[_i].safetensors.index.json.
std::string model_file(std::size_t i);
std::string model_index_file(std::size_t i);
/// model[_i].mp<rank>.safetensors.
std::string model_part_file(std::size_t i, int rank);
/// The rank of a model part's file name (model[_i].mp<rank>.safetensors), nullopt when
/// `file_name` is not one; throws when its rank has 10 digits or more.
std::optional<int> model_part_rank(const std::string& file_name, std::size_t i);
/// optimizer[_i], optimizer[_i].mp<rank>, optimizer[_i].rank<rank>: add kTensors or kJson.
std::string optimizer_stem(std::size_t i);
std::string optimizer_part_stem(std::size_t i, int rank);
std::string optimizer_shard_stem(std::size_t i, int rank);
/// master_weights[_i].safetensors, master_weights[_i].mp<rank>.safetensors.
std::string master_weights_file(std::size_t i);
std::string master_weights_part_file(std::size_t i, int rank);
std::string random_states_file(int rank);
std::string custom_file(const std::string& name);
inline constexpr const char* kTensors = ".safetensors";
inline constexpr const char* kJson = ".json";

// --- The saving run's layout (state.json) -----------------------------------------------------

inline constexpr const char* kLayoutKey = "layout";
inline constexpr const char* kMeshKey = "mesh";

/// How a checkpoint's run was laid out: its state.json "layout" ({"mesh", "strategy"}), or for a
/// checkpoint written before it, what its "mesh" key and world size say.
struct SavedRunLayout {
  std::string mesh;      // Topology::shape_string() of the saving run ("" when unknown)
  std::string strategy;  // "ddp", "zero-2", ... ("" when unknown)
  int world = 0;
  bool recorded = false;  // written by a run that records its layout
  /// Pipeline stages per rank (interleaved schedules); the layout records it when above 1.
  int pp_virtual_stages = 1;
  /// Expert-parallel ranks (Note [Expert parallel]); the layout records it when above 1.
  int ep_size = 1;
  /// "dp 2 x tp 2 (4 processes, zero-3)"; "pp 2 (2 processes, ddp, 2 pipeline stages per
  /// rank)"; "dp 4 (4 processes, ddp, experts over ep 2)".
  std::string describe() const;
};
/// The "layout" value, a JSON document ("pp_virtual_stages" and "ep_size" only when above 1).
std::string run_layout_json(const std::string& mesh, const std::string& strategy,
                            int pp_virtual_stages = 1, int ep_size = 1);
/// The "mesh" value, a JSON document.
std::string mesh_json(const std::string& mesh);
/// Reads "layout" (or "mesh"), refusing a value that is not what run_layout_json wrote.
SavedRunLayout saved_run_layout(const StateReader& r);

// --- Mesh strings ("pp 1 x dp_replicate 1 x dp_shard 2 x tp 2") -------------------------------

/// The "<name> <size>" parts of a mesh string, in order; throws std::invalid_argument naming
/// the part that is not a name and a positive size.
std::vector<std::pair<std::string, int>> mesh_dims(const std::string& mesh);
/// "dp 2 x tp 2": the sizes above 1 (dp for dp_replicate x dp_shard unless both are above 1), or
/// "1 process".
std::string short_mesh(const std::string& mesh);
/// Whether a mesh string has tp or pp above 1.
bool model_parallel_mesh(const std::string& mesh);

// --- A model part's safetensors metadata (Note [Tensor-parallel shards in checkpoints]) --------

inline constexpr const char* kMeshMeta = "tandem_mesh";
inline constexpr const char* kPipelineStageMeta = "tandem_pp_stage";
inline constexpr const char* kTpSizeMeta = "tandem_tp_size";
inline constexpr const char* kTpRankMeta = "tandem_tp_rank";
inline constexpr const char* kTpSplitMeta = "tandem_tp_split";

/// How a file's tensors were cut over tensor parallel: size 0 when it was not (a pipeline stage
/// of a run without tensor parallelism, or a whole model).
struct TpCut {
  int size = 0;
  int rank = 0;
  std::map<std::string, std::string> split;  // name -> "cols" | "rows/<parts>"; absent: whole
};

/// The metadata of a model part: format "pt", the mesh, the pipeline stage (when there is one)
/// and the tensor-parallel cut (when tp.size > 0).
std::map<std::string, std::string> model_part_metadata(const std::string& mesh,
                                                       std::optional<int> pipeline_stage,
                                                       const TpCut& tp);

/// Reads the tensor-parallel cut of a file's metadata, every value checked: size an integer in
/// [1, 65536], rank in [0, size), split a JSON object of "cols" or "rows/<parts>" (parts >= 1),
/// the three keys together or none. A bad value throws std::runtime_error
/// "<where>: metadata "<key>" is "<value>", expected ...<fix>" (`where` names the file).
TpCut read_tp_cut(const std::map<std::string, std::string>& metadata, const std::string& where,
                  const std::string& fix);

/// Whether `how` is a split a checkpoint may record ("cols" or "rows/<parts>", parts >= 1);
/// the parts of "rows/<parts>" (1 for "cols").
bool valid_split(const std::string& how);
long long split_parts(const std::string& how);

/// The fix said after a metadata problem found while resuming.
inline constexpr const char* kAlteredFileFix =
    "; the file was altered or written by another tool: resume from the files exactly as "
    "save_state() wrote them, or save the checkpoint again";

// --- An optimizer file's "tandem" record (Note [Resharding a checkpoint]) ---------------------

inline constexpr const char* kOptimizerRecordKey = "tandem";

/// What a whole optimizer file records of its parameters (names and splits per parameter group)
/// or a ZeRO shard file of its units (splits per unit, no names: the "zero" record has them).
struct OptimizerRecord {
  int tp_rank = 0;
  int tp_size = 1;
  std::vector<std::vector<std::string>> names;   // per group; empty in a ZeRO shard file
  std::vector<std::vector<std::string>> splits;  // per group (or unit): "" whole, "cols", ...
};
/// The record as a JSON document.
std::string optimizer_record_json(const OptimizerRecord& record);
/// Reads a record (`record_json`, the value of "tandem") with checks: tp_rank in [0, tp_size),
/// names and splits of one shape (when there are names), every split valid. Throws
/// std::runtime_error "<where>: its "tandem" record ..." naming what is wrong.
OptimizerRecord read_optimizer_record(const std::string& record_json, const std::string& where);

}  // namespace layout
}  // namespace tandem::checkpoint
