#include "policies/unit_options.h"

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace fsdp {

const char* ShardingStrategyName(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard:
      return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard:
      return "NO_SHARD";
    case ShardingStrategy::kHybridShard:
      return "HYBRID_SHARD";
    case ShardingStrategy::kHybridShardZero2:
      return "_HYBRID_SHARD_ZERO2";
  }
  return "invalid";
}

bool IsHybrid(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::kHybridShard ||
         strategy == ShardingStrategy::kHybridShardZero2;
}

bool ReshardsAfterForward(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::kFullShard || strategy == ShardingStrategy::kHybridShard;
}

absl::StatusOr<ShardingStrategy> ParseShardingStrategy(absl::string_view name) {
  const absl::string_view bare = absl::StripPrefix(name, "_");
  for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                             ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard,
                             ShardingStrategy::kHybridShardZero2}) {
    if (absl::EqualsIgnoreCase(bare, absl::StripPrefix(ShardingStrategyName(s), "_"))) return s;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown sharding strategy '", name,
                   "' (valid: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, "
                   "_HYBRID_SHARD_ZERO2)"));
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  return "invalid";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (auto [alias, dtype] : {std::pair<const char*, DType>{"float32", DType::kFloat32},
                              {"fp32", DType::kFloat32},
                              {"float", DType::kFloat32},
                              {"float16", DType::kFloat16},
                              {"fp16", DType::kFloat16},
                              {"half", DType::kFloat16},
                              {"bfloat16", DType::kBFloat16},
                              {"bf16", DType::kBFloat16}}) {
    if (absl::EqualsIgnoreCase(name, alias)) return dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype '", name, "' (valid: float32/fp32, float16/fp16, bfloat16/bf16)"));
}

std::string MixedPrecision::ToString() const {
  std::vector<std::string> parts;
  if (param_dtype) parts.push_back(absl::StrCat("param_dtype=", DTypeName(*param_dtype)));
  if (reduce_dtype) parts.push_back(absl::StrCat("reduce_dtype=", DTypeName(*reduce_dtype)));
  if (buffer_dtype) parts.push_back(absl::StrCat("buffer_dtype=", DTypeName(*buffer_dtype)));
  if (output_dtype) parts.push_back(absl::StrCat("output_dtype=", DTypeName(*output_dtype)));
  if (keep_low_precision_grads) parts.push_back("keep_low_precision_grads=true");
  if (cast_forward_inputs) parts.push_back("cast_forward_inputs=true");
  if (!cast_root_forward_inputs) parts.push_back("cast_root_forward_inputs=false");
  return absl::StrJoin(parts, ",");
}

std::string UnitOptions::ToString() const {
  std::vector<std::string> parts;
  if (strategy) parts.push_back(absl::StrCat("strategy=", ShardingStrategyName(*strategy)));
  if (mixed_precision) {
    const std::string mp = mixed_precision->ToString();
    parts.push_back(mp.empty() ? "full_precision" : mp);
  }
  return absl::StrJoin(parts, ",");
}

}  // namespace fsdp
