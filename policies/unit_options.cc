#include "policies/unit_options.h"

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace fsdp {

const char* ShardingStrategyName(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard:
      return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard:
      return "NO_SHARD";
  }
  return "invalid";
}

absl::StatusOr<ShardingStrategy> ParseShardingStrategy(absl::string_view name) {
  for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                             ShardingStrategy::kNoShard}) {
    if (absl::EqualsIgnoreCase(name, ShardingStrategyName(s))) return s;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown sharding strategy '", name, "' (valid: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD)"));
}

void UnitOptions::OverrideWith(const UnitOptions& other) {
  if (other.strategy) strategy = other.strategy;
}

std::string UnitOptions::ToString() const {
  return strategy ? absl::StrCat("strategy=", ShardingStrategyName(*strategy)) : "";
}

}  // namespace fsdp
