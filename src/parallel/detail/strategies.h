// The strategies behind make_strategy (strategy.h), one file each.
#pragma once

#include <memory>

#include "tandem/parallel/strategy.h"

namespace tandem::parallel::detail {

/// ZeRO stages 1, 2 and 3 (zero.cpp).
std::unique_ptr<Strategy> make_zero_strategy(const ShardingOptions& options,
                                             StrategyContext context);

}  // namespace tandem::parallel::detail
