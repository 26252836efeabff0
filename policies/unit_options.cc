#include "policies/unit_options.h"

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
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

absl::StatusOr<at::ScalarType> ParseDtypeFlag(absl::string_view name) {
  for (auto [alias, dtype] : {std::pair<const char*, at::ScalarType>{"float32", at::kFloat},
                              {"fp32", at::kFloat},
                              {"float", at::kFloat},
                              {"float16", at::kHalf},
                              {"fp16", at::kHalf},
                              {"half", at::kHalf},
                              {"bfloat16", at::kBFloat16},
                              {"bf16", at::kBFloat16}}) {
    if (absl::EqualsIgnoreCase(name, alias)) return dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype '", name, "' (valid: float32/fp32, float16/fp16, bfloat16/bf16)"));
}

std::string DtypeFlagName(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "float32";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    default:
      return c10::toString(dtype);
  }
}

bool IsMixedPrecisionDtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

absl::Status ValidateMixedPrecision(const MixedPrecision& mp) {
  using Dtype = const std::optional<at::ScalarType>*;
  // What the collectives gather and reduce in.
  for (auto [name, dtype] : {std::pair<const char*, Dtype>{"param_dtype", &mp.param_dtype},
                             {"reduce_dtype", &mp.reduce_dtype}}) {
    if (dtype->has_value() && !IsMixedPrecisionDtype(**dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("MixedPrecision::", name, " is ", DtypeFlagName(**dtype),
                       ", not one of float32, float16, bfloat16"));
    }
  }
  // Only cast locally: any floating type, as PyTorch allows (float64 too).
  for (auto [name, dtype] : {std::pair<const char*, Dtype>{"buffer_dtype", &mp.buffer_dtype},
                             {"output_dtype", &mp.output_dtype}}) {
    if (dtype->has_value() && !at::isFloatingType(**dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("MixedPrecision::", name, " is ",
                                                     DtypeFlagName(**dtype),
                                                     ", not a floating-point type"));
    }
  }
  return absl::OkStatus();
}

std::string MixedPrecision::ToString() const {
  std::vector<std::string> parts;
  if (param_dtype) parts.push_back(absl::StrCat("param_dtype=", DtypeFlagName(*param_dtype)));
  if (reduce_dtype) parts.push_back(absl::StrCat("reduce_dtype=", DtypeFlagName(*reduce_dtype)));
  if (buffer_dtype) parts.push_back(absl::StrCat("buffer_dtype=", DtypeFlagName(*buffer_dtype)));
  if (output_dtype) parts.push_back(absl::StrCat("output_dtype=", DtypeFlagName(*output_dtype)));
  if (keep_low_precision_grads) parts.push_back("keep_low_precision_grads=true");
  if (cast_forward_inputs) parts.push_back("cast_forward_inputs=true");
  if (!cast_root_forward_inputs) parts.push_back("cast_root_forward_inputs=false");
  return absl::StrJoin(parts, ",");
}

const char* CommQuantizationName(CommQuantization quantization) {
  switch (quantization) {
    case CommQuantization::kNone:
      return "none";
    case CommQuantization::kBf16:
      return "bf16";
    case CommQuantization::kInt8:
      return "int8";
  }
  return "invalid";
}

absl::StatusOr<CommQuantization> ParseCommQuantization(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "none") return CommQuantization::kNone;
  if (lower == "bf16" || lower == "bfloat16") return CommQuantization::kBf16;
  if (lower == "int8") return CommQuantization::kInt8;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown quantization '", name, "'; valid: none, bf16, int8"));
}

std::string UnitOptions::ToString() const {
  std::vector<std::string> parts;
  if (strategy) parts.push_back(absl::StrCat("strategy=", ShardingStrategyName(*strategy)));
  if (mixed_precision) {
    const std::string mp = mixed_precision->ToString();
    parts.push_back(mp.empty() ? "full_precision" : mp);
  }
  if (all_gather_quantization) {
    parts.push_back(
        absl::StrCat("all_gather_quantization=", CommQuantizationName(*all_gather_quantization)));
  }
  if (reduce_quantization) {
    parts.push_back(
        absl::StrCat("reduce_quantization=", CommQuantizationName(*reduce_quantization)));
  }
  return absl::StrJoin(parts, ",");
}

}  // namespace fsdp
