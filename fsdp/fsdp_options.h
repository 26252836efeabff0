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

// When, in backward, the next unit's all-gather is issued (PyTorch's
// BackwardPrefetch): at the start of the current unit's backward, or after
// its gradients are reduced.
enum class BackwardPrefetch { kNone, kBackwardPre, kBackwardPost };

}  // namespace fsdp

#endif  // FSDP_FSDP_FSDP_OPTIONS_H_
