#include "fsdp/fsdp_options.h"

#include "absl/strings/str_cat.h"

namespace fsdp {

std::string CrossRankOptionsKey(const FsdpOptions& options) {
  // Every field is bound by name, so that adding one to FsdpOptions breaks
  // this line until the new field is either keyed below or named as one
  // that may differ between ranks.
  [[maybe_unused]] const auto& [strategy, replicate_group, post_forward_group, mixed_precision,
                                backward_prefetch,
                                forward_prefetch, limit_all_gathers, check_execution_order,
                                verify_collectives_every, offload_params, gradient_divide_factor,
                                device_id, ignored_modules, sync_module_states, param_init_fn,
                                trace /* may differ */, debug_log /* may differ */] = options;
  return absl::StrCat(
      "strategy=", ShardingStrategyName(strategy),
      ",replicate_group_size=", replicate_group != nullptr ? replicate_group->world_size() : 0,
      ",post_forward_group_size=",
      post_forward_group != nullptr ? post_forward_group->world_size() : 0,
      ",mixed_precision={", mixed_precision.ToString(), "}",
      ",backward_prefetch=", static_cast<int>(backward_prefetch),
      ",forward_prefetch=", forward_prefetch,
      ",limit_all_gathers=", limit_all_gathers,
      ",check_execution_order=", check_execution_order,
      ",verify_collectives_every=", verify_collectives_every,
      ",offload_params=", offload_params,
      ",gradient_divide_factor=",
      gradient_divide_factor ? absl::StrCat(*gradient_divide_factor) : "unset",
      ",device_type=", device_id ? c10::DeviceTypeName(device_id->type(), true) : "unset",
      ",ignored_modules=", ignored_modules.size(),
      ",sync_module_states=", sync_module_states,
      ",param_init_fn=", param_init_fn ? "set" : "unset", ";");
}

absl::Status ValidateFsdpOptions(const FsdpOptions& options) {
  if (IsHybrid(options.strategy) != (options.replicate_group != nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FsdpOptions::replicate_group is ", options.replicate_group != nullptr ? "set" : "not set",
        " but the strategy is ", ShardingStrategyName(options.strategy),
        ": hybrid sharding (HYBRID_SHARD, _HYBRID_SHARD_ZERO2) takes the shard group as the "
        "group and the replicate group in replicate_group; the other strategies take no "
        "replicate group"));
  }
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

}  // namespace fsdp
