// Options shared by every layer of FSDP; the bottom of the fsdp package, so
// that no two places define a sharding strategy.
#ifndef FSDP_FSDP_FSDP_OPTIONS_H_
#define FSDP_FSDP_FSDP_OPTIONS_H_

namespace fsdp {

// How a unit's parameters, gradients and optimizer state are split.
enum class ShardingStrategy {
  kFullShard,    // Shard all three; reshard after forward, re-gather for backward.
  kShardGradOp,  // Shard all three; keep full parameters from forward to backward.
  kNoShard,      // Replicate; all-reduce gradients (DDP semantics).
};

const char* ShardingStrategyName(ShardingStrategy strategy);

}  // namespace fsdp

#endif  // FSDP_FSDP_FSDP_OPTIONS_H_
