#include "fsdp/fsdp_options.h"

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

}  // namespace fsdp
