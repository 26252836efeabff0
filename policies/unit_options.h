// The options a wrap policy may set per FSDP unit, and the sharding
// strategies they choose from. This is the bottom of the option vocabulary:
// the core's FsdpOptions (fsdp/fsdp_options.h) builds on it, so that
// policies can name per-unit options without depending on the core.
// Dtypes are libtorch's at::ScalarType (only c10/core/ScalarType.h is
// included), one vocabulary from the flags to the tensors.
#ifndef FSDP_POLICIES_UNIT_OPTIONS_H_
#define FSDP_POLICIES_UNIT_OPTIONS_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "c10/core/ScalarType.h"

namespace fsdp {

// How a unit's parameters, gradients and optimizer state are split.
enum class ShardingStrategy {
  kFullShard,    // Shard all three; reshard after forward, re-gather for backward.
  kShardGradOp,  // Shard all three; keep full parameters from forward to backward.
  kNoShard,      // Replicate; all-reduce gradients (DDP semantics).
  // Hybrid sharding (ProcessGroups::replicate): FULL_SHARD or
  // SHARD_GRAD_OP within a shard group, replicated across shard groups; each
  // rank's reduced gradient shard is then all-reduced over its replicate
  // group (the ranks holding the same shard).
  kHybridShard,
  kHybridShardZero2,
};

// "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
// "_HYBRID_SHARD_ZERO2" (PyTorch's names).
const char* ShardingStrategyName(ShardingStrategy strategy);

// HYBRID_SHARD or _HYBRID_SHARD_ZERO2.
bool IsHybrid(ShardingStrategy strategy);
// Whether a non-root unit frees its full parameters after forward
// (FULL_SHARD, HYBRID_SHARD) rather than keeping them for backward.
bool ReshardsAfterForward(ShardingStrategy strategy);
// The inverse of ShardingStrategyName (case-insensitive, the leading '_'
// optional); the error lists the valid names.
absl::StatusOr<ShardingStrategy> ParseShardingStrategy(absl::string_view name);

// Mixed precision names its dtypes as libtorch does (at::ScalarType); these
// two are the text form flags and policy specs use.
// The inverse of DtypeFlagName: float32/fp32/float, float16/fp16/half,
// bfloat16/bf16 (case-insensitive). Any other name, other scalar types
// included ("int8", "float64"), is refused, the error listing the valid ones.
absl::StatusOr<at::ScalarType> ParseDtypeFlag(absl::string_view name);
// "float32", "float16", "bfloat16"; libtorch's name for any other type.
std::string DtypeFlagName(at::ScalarType dtype);

// PyTorch's MixedPrecision, per unit. The sharded parameters, and the
// optimizer step on them, always stay in full precision; an unset dtype
// means that full precision.
struct MixedPrecision {
  // The all-gathered (unsharded) parameters: all-gathers, forward and
  // backward compute, and so the gradients autograd produces.
  std::optional<at::ScalarType> param_dtype;
  // The gradient reduce-scatter (all-reduce for NO_SHARD); defaults to
  // param_dtype, as in PyTorch.
  std::optional<at::ScalarType> reduce_dtype;
  // Floating-point buffers of the unit's modules are cast to it at Wrap and
  // stay so (FULL state dicts return them in their original dtype).
  std::optional<at::ScalarType> buffer_dtype;
  // Keep the reduced gradient in the reduction's dtype instead of upcasting
  // it to the parameters' (the optimizer must then accept it).
  bool keep_low_precision_grads = false;
  // Cast floating-point inputs of the unit's forward (UnitForward::Input)
  // to param_dtype; for the root, cast_root_forward_inputs.
  bool cast_forward_inputs = false;
  bool cast_root_forward_inputs = true;
  // Floating-point tensors the unit's forward returns (UnitForward::Return)
  // are cast to it, so that autograd casts their gradients back (FSDP2's
  // MixedPrecisionPolicy.output_dtype): a bfloat16 model handing float32
  // logits to its loss, say.
  std::optional<at::ScalarType> output_dtype;

  bool enabled() const {
    return param_dtype.has_value() || reduce_dtype.has_value() || buffer_dtype.has_value() ||
           output_dtype.has_value();
  }
  // "param_dtype=bfloat16,reduce_dtype=float32,..." (only what is set).
  std::string ToString() const;
};

// The dtypes mixed precision computes, gathers and reduces in: float32,
// float16 and bfloat16, the ones ParseDtypeFlag names. Other floating
// types are refused for parameters and reductions: float64 is no lower
// precision, and the float8 types have no reduction arithmetic in the
// collectives.
bool IsMixedPrecisionDtype(at::ScalarType dtype);

// A MixedPrecision whose param_dtype and reduce_dtype pass
// IsMixedPrecisionDtype and whose buffer_dtype and output_dtype are
// floating types (cast locally only, so float64 and the float8 types are
// allowed, as in PyTorch); the first other one is named, as InvalidArgument. FsdpOptions
// validation and the wrap plan (for the root and for a policy's per-unit
// override) call it.
absl::Status ValidateMixedPrecision(const MixedPrecision& mp);

// How a unit's parameters travel in its all-gathers (ZeRO++'s qwZ;
// fsdp/quantized_gather.h). The shards, the optimizer step on them and the
// gradients stay as they are: only the unsharded parameters that forward
// and backward compute with are approximate.
//  * kBf16: each rank's shard is sent in bfloat16 and cast back to the
//    compute dtype (which stays the parameters' dtype, or param_dtype):
//    half the bytes of float32.
//  * kInt8: each rank's shard is sent as one byte per value, in blocks of
//    at most 256 values with two float32 parameters each
//    (comm/block_quantization.h), and decoded into the compute dtype:
//    about 0.26x the bytes of float32. No block spans two parameters.
// Refused (by Wrap, naming the unit) under NO_SHARD, which all-gathers
// nothing, for parameters that are not float32, float64, float16 or
// bfloat16, and kBf16 where the unit already all-gathers in a 16-bit dtype.
//
// The same codes for how a unit's gradients travel in its reduction
// (reduce_quantization; ZeRO++'s qgZ; QuantizedReduceScatter in
// fsdp/quantized_gather.h): each rank codes each rank's chunk of its flat
// gradient, an all-to-all delivers them, and each rank decodes its W
// chunks and sums them in float32; under hybrid sharding the replicate
// group's all-reduce is coded likewise (QuantizedAllReduce). Refused
// likewise, and kBf16 where the unit already reduces in a 16-bit
// reduce_dtype; a comm hook cannot be combined with it.
enum class CommQuantization { kNone, kBf16, kInt8 };

// "none", "bf16", "int8".
const char* CommQuantizationName(CommQuantization quantization);
// The inverse of CommQuantizationName (case-insensitive; "bfloat16" too);
// the error lists the valid names.
absl::StatusOr<CommQuantization> ParseCommQuantization(absl::string_view name);

// Per-unit overrides chosen by a policy. A field left unset takes the
// root's value (FsdpOptions).
struct UnitOptions {
  std::optional<ShardingStrategy> strategy;
  // Replaces the root's mixed precision as a whole.
  std::optional<MixedPrecision> mixed_precision;
  std::optional<CommQuantization> all_gather_quantization;
  std::optional<CommQuantization> reduce_quantization;

  bool empty() const {
    return !strategy.has_value() && !mixed_precision.has_value() &&
           !all_gather_quantization.has_value() && !reduce_quantization.has_value();
  }
  // "strategy=NO_SHARD,param_dtype=bfloat16,all_gather_quantization=int8",
  // or "" when empty.
  std::string ToString() const;
};

}  // namespace fsdp

#endif  // FSDP_POLICIES_UNIT_OPTIONS_H_
