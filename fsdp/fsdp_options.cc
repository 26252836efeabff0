#include "fsdp/fsdp_options.h"

#include "absl/strings/str_cat.h"

namespace fsdp {

std::string CrossRankOptionsKey(const FsdpOptions& options, const ProcessGroups& groups) {
  // Every field is bound by name, so that adding one to FsdpOptions or
  // ProcessGroups breaks these lines until the new field is either keyed
  // below or named as one that may differ between ranks.
  [[maybe_unused]] const auto& [shard /* its size is the plan's world size */, replicate_group,
                                post_forward_group] = groups;
  [[maybe_unused]] const auto& [strategy, mixed_precision, all_gather_quantization,
                                reduce_quantization, backward_prefetch, forward_prefetch,
                                limit_all_gathers, check_execution_order, verify_collectives_every,
                                offload_params, gradient_divide_factor, device_id, ignored_modules,
                                sync_module_states, param_init_fn, trace /* may differ */,
                                debug_log /* may differ */] = options;
  return absl::StrCat(
      "strategy=", ShardingStrategyName(strategy),
      ",replicate_group_size=", replicate_group != nullptr ? replicate_group->world_size() : 0,
      ",post_forward_group_size=",
      post_forward_group != nullptr ? post_forward_group->world_size() : 0, ",mixed_precision={",
      mixed_precision.ToString(), "}",
      // Only when set: the default key stays what builds before it hash.
      all_gather_quantization == CommQuantization::kNone
          ? ""
          : absl::StrCat(",all_gather_quantization=",
                         CommQuantizationName(all_gather_quantization)),
      reduce_quantization == CommQuantization::kNone
          ? ""
          : absl::StrCat(",reduce_quantization=", CommQuantizationName(reduce_quantization)),
      ",backward_prefetch=", static_cast<int>(backward_prefetch),
      ",forward_prefetch=", forward_prefetch, ",limit_all_gathers=", limit_all_gathers,
      ",check_execution_order=", check_execution_order,
      ",verify_collectives_every=", verify_collectives_every, ",offload_params=", offload_params,
      ",gradient_divide_factor=",
      gradient_divide_factor ? absl::StrCat(*gradient_divide_factor) : "unset",
      ",device_type=", device_id ? c10::DeviceTypeName(device_id->type(), true) : "unset",
      ",ignored_modules=", ignored_modules.size(), ",sync_module_states=", sync_module_states,
      ",param_init_fn=", param_init_fn ? "set" : "unset", ";");
}

namespace {

// What CheckAllGatherQuantization and CheckReduceQuantization share:
// `option` names the option, `moves` what its collective moves,
// `travelling` the dtype that collective carries without the option.
absl::Status CheckQuantization(const std::string& unit, ShardingStrategy strategy,
                               CommQuantization quantization, at::ScalarType param_dtype,
                               const std::string& first_param, const char* option,
                               const char* moves, at::ScalarType travelling) {
  if (quantization == CommQuantization::kNone) return absl::OkStatus();
  const std::string what = absl::StrCat("unit '", unit, "' has ", option, "=",
                                        CommQuantizationName(quantization), " but ");
  if (strategy == ShardingStrategy::kNoShard) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "its strategy is NO_SHARD, which ", moves, " nothing; give it ", option,
                     "=none (a policy's per-unit option) or a strategy that shards"));
  }
  // The dtypes the coding kernels read (no float8: ATen counts it floating).
  if (param_dtype != at::kFloat && param_dtype != at::kDouble && param_dtype != at::kHalf &&
      param_dtype != at::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(what, "its parameters ('", first_param,
                                                   "', ...) are ", c10::toString(param_dtype),
                                                   ", not float32, float64, float16 or bfloat16"));
  }
  if (quantization == CommQuantization::kBf16 && c10::elementSize(travelling) <= 2) {
    return absl::InvalidArgumentError(absl::StrCat(what, "it already ", moves, " in ",
                                                   c10::toString(travelling),
                                                   " (mixed precision or the parameters' dtype): "
                                                   "bf16 would save nothing"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckAllGatherQuantization(const std::string& unit, ShardingStrategy strategy,
                                        const MixedPrecision& mixed_precision,
                                        CommQuantization quantization, at::ScalarType param_dtype,
                                        const std::string& first_param) {
  return CheckQuantization(unit, strategy, quantization, param_dtype, first_param,
                           "all_gather_quantization", "all-gathers",
                           mixed_precision.param_dtype.value_or(param_dtype));
}

absl::Status CheckReduceQuantization(const std::string& unit, ShardingStrategy strategy,
                                     const MixedPrecision& mixed_precision,
                                     CommQuantization quantization, at::ScalarType param_dtype,
                                     const std::string& first_param) {
  // ResolvedUnitOptions::reduce_dtype(): reduce_dtype, else param_dtype.
  const at::ScalarType reduced =
      mixed_precision.reduce_dtype.value_or(mixed_precision.param_dtype.value_or(param_dtype));
  return CheckQuantization(unit, strategy, quantization, param_dtype, first_param,
                           "reduce_quantization", "reduce-scatters", reduced);
}

absl::Status ValidateFsdpOptions(const FsdpOptions& options) {
  if (absl::Status mp = ValidateMixedPrecision(options.mixed_precision); !mp.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("FsdpOptions::mixed_precision: ", mp.message()));
  }
  if (options.verify_collectives_every < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("FsdpOptions::verify_collectives_every must be >= 0 (0: never), got ",
                     options.verify_collectives_every));
  }
  if (options.gradient_divide_factor && !(*options.gradient_divide_factor > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("FsdpOptions::gradient_divide_factor must be positive, got ",
                     *options.gradient_divide_factor));
  }
  return absl::OkStatus();
}

absl::Status ValidateProcessGroups(const ProcessGroups& groups, const FsdpOptions& options) {
  if (groups.shard == nullptr) {
    return absl::InvalidArgumentError("ProcessGroups::shard is null; it names the shard group");
  }
  if (IsHybrid(options.strategy) != (groups.replicate != nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ProcessGroups::replicate is ", groups.replicate != nullptr ? "set" : "not set",
        " but the strategy is ", ShardingStrategyName(options.strategy),
        ": hybrid sharding (HYBRID_SHARD, _HYBRID_SHARD_ZERO2) takes the shard group in "
        "ProcessGroups::shard and the replicate group in ProcessGroups::replicate; the other "
        "strategies take no replicate group"));
  }
  if (groups.replicate == groups.shard) {
    return absl::InvalidArgumentError(
        "ProcessGroups::replicate is the shard group; hybrid sharding needs two groups that "
        "cross (each rank in one of each: comm/hybrid_groups.h forms them): one group passed "
        "as both would reduce every gradient twice over it");
  }
  // Sizes only, the same on every rank; which ranks is checked at the
  // first forward, where every rank can learn of a wrong group.
  if (const Collectives* post = groups.post_forward; post != nullptr) {
    const int k = post->world_size();
    const int w = groups.shard->world_size();
    if (k <= 1 || k >= w || w % k != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ProcessGroups::post_forward has ", k, " ranks but must have k with 1 < k < ", w,
          " (the shard group's size) and k dividing it"));
    }
  }
  return absl::OkStatus();
}

}  // namespace fsdp
