// The strategies behind make_strategy (strategy.h), one file each.
#pragma once

#include <memory>
#include <string>

#include "tandem/parallel/expert_parallel.h"
#include "tandem/parallel/strategy.h"

namespace tandem::parallel {
/// "model 2 (Generator)": how refusals that list parameter names say which model they are of
/// (the index counts the prepared models from 1).
std::string model_label(const torch::nn::Module& model, int index);
}  // namespace tandem::parallel

namespace tandem::parallel::detail {

/// Note [Expert parallel]: the reducer of the expert parameters `experts` a rank holds: over
/// their replicas, divided by the whole data-parallel size (an expert's gradient already sums
/// what its ep group sent it), every replica joining every reduction (an expert may get no token
/// in a step, on one replica or all).
std::unique_ptr<GradientReducer> make_expert_reducer(
    const std::vector<std::pair<std::string, at::Tensor>>& experts, const HeldExperts& held,
    ReducerOptions options);

/// ZeRO stages 1, 2 and 3 (zero/).
std::unique_ptr<Strategy> make_zero_strategy(const ShardingOptions& options,
                                             StrategyContext context);

}  // namespace tandem::parallel::detail
