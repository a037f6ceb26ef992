// The reader of TANDEM_* variables that resolve_run_config and the *_from_env functions share
// (run_config.cpp, env_readers.cpp). Internal to src/config.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../detail/env.h"
#include "tandem/config/run_config.h"
#include "tandem/error.h"

namespace tandem::config::detail {

using ::tandem::detail::lower;
using ::tandem::detail::parse_bool;
using ::tandem::detail::upper;

// Reads one environment map: an empty value counts as unset, every value read is noted in
// `used` (RunConfig::from_environment), and every error names the variable by its table row.
class Reader {
 public:
  explicit Reader(const EnvMap& env, std::map<std::string, std::string>* used = nullptr)
      : env_(env), used_(used) {}

  std::optional<std::string> get(const std::string& name) const {
    auto it = env_.find(name);
    if (it == env_.end() || it->second.empty()) return std::nullopt;
    if (used_) (*used_)[name] = it->second;
    return it->second;
  }
  std::optional<bool> boolean(const std::string& name) const {
    auto v = get(name);
    if (!v) return std::nullopt;
    return parse_bool(env_origin(name), *v);
  }
  std::optional<int> positive_int(const std::string& name) const {
    auto v = get(name);
    if (!v) return std::nullopt;
    try {
      size_t pos = 0;
      const int x = std::stoi(*v, &pos);
      if (pos == v->size() && x >= 1) return x;
    } catch (const std::exception&) {
    }
    throw ::tandem::Refused(env_value_origin(name, *v) + " must be a positive integer");
  }
  std::optional<int64_t> integer(const std::string& name) const {
    auto v = get(name);
    if (!v) return std::nullopt;
    try {
      size_t pos = 0;
      const long long x = std::stoll(*v, &pos);
      if (pos == v->size()) return x;
    } catch (const std::exception&) {
    }
    throw ::tandem::Refused(env_value_origin(name, *v) + " must be an integer");
  }
  std::optional<double> non_negative(const std::string& name) const {
    auto v = get(name);
    if (!v) return std::nullopt;
    try {
      size_t pos = 0;
      const double x = std::stod(*v, &pos);
      if (pos == v->size() && x >= 0) return x;
    } catch (const std::exception&) {
    }
    throw ::tandem::Refused(env_value_origin(name, *v) + " must be a number >= 0");
  }
  /// Every variable whose name starts with `prefix` (consulted or not: the caller checks).
  std::vector<std::pair<std::string, std::string>> with_prefix(const std::string& prefix) const {
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& [k, v] : env_)
      if (k.rfind(prefix, 0) == 0) out.emplace_back(k, v);
    return out;
  }
  void note(const std::string& name, const std::string& value) const {
    if (used_ && !value.empty()) (*used_)[name] = value;
  }

 private:
  const EnvMap& env_;
  std::map<std::string, std::string>* used_;
};


// The readers of one setting each, from one environment map (env_readers.cpp).
std::optional<parallel::ShardingOptions> sharding_of(const Reader& env);
comm::MeshShape mesh_shape_of(const Reader& env);
/// A mesh size from the environment variable `name` (0 when unset); refuses what is not a
/// positive integer, naming the variable and where it comes from.
int mesh_size(const Reader& env, const char* name);
bool activation_checkpointing_of(const EnvMap& map, const Reader& env);
precision::Fp8Options fp8_of(const Reader& env);

}  // namespace tandem::config::detail
