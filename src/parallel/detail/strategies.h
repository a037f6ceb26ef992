// The strategies behind make_strategy (strategy.h), one file each.
#pragma once

#include <memory>
#include <string>

#include "tandem/parallel/strategy.h"

namespace tandem::parallel {
/// "model 2 (Generator)": how refusals that list parameter names say which model they are of
/// (the index counts the prepared models from 1).
std::string model_label(const torch::nn::Module& model, int index);
}  // namespace tandem::parallel

namespace tandem::parallel::detail {

/// ZeRO stages 1, 2 and 3 (zero/).
std::unique_ptr<Strategy> make_zero_strategy(const ShardingOptions& options,
                                             StrategyContext context);

}  // namespace tandem::parallel::detail
