// The options a wrap policy may set per FSDP unit, and the sharding
// strategies they choose from. This is the bottom of the option vocabulary:
// the core's FsdpOptions (fsdp/fsdp_options.h) builds on it, so that
// policies can name per-unit options without depending on the core.
#ifndef FSDP_POLICIES_UNIT_OPTIONS_H_
#define FSDP_POLICIES_UNIT_OPTIONS_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fsdp {

// How a unit's parameters, gradients and optimizer state are split.
enum class ShardingStrategy {
  kFullShard,    // Shard all three; reshard after forward, re-gather for backward.
  kShardGradOp,  // Shard all three; keep full parameters from forward to backward.
  kNoShard,      // Replicate; all-reduce gradients (DDP semantics).
};

// "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD".
const char* ShardingStrategyName(ShardingStrategy strategy);
// The inverse of ShardingStrategyName (case-insensitive); the error lists
// the valid names.
absl::StatusOr<ShardingStrategy> ParseShardingStrategy(absl::string_view name);

// Per-unit overrides chosen by a policy. A field left unset takes the
// root's value (FsdpOptions). Mixed-precision fields join here with the
// mixed-precision work.
struct UnitOptions {
  std::optional<ShardingStrategy> strategy;

  bool empty() const { return !strategy.has_value(); }
  // Fields set in `other` replace this one's.
  void OverrideWith(const UnitOptions& other);
  // "strategy=NO_SHARD", or "" when empty.
  std::string ToString() const;
};

}  // namespace fsdp

#endif  // FSDP_POLICIES_UNIT_OPTIONS_H_
