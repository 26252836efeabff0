#include "fsdp/fsdp_options.h"

#include <functional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "testing/multi_rank.h"

namespace fsdp {
namespace {

struct Change {
  const char* field;
  std::function<void(FsdpOptions&)> apply;
};

// One change per field that ranks must agree on; each must change the key.
std::vector<Change> AgreedFieldChanges() {
  return {
      {"strategy", [](FsdpOptions& o) { o.strategy = ShardingStrategy::kShardGradOp; }},
      {"mixed_precision", [](FsdpOptions& o) { o.mixed_precision.param_dtype = at::kBFloat16; }},
      {"backward_prefetch",
       [](FsdpOptions& o) { o.backward_prefetch = BackwardPrefetch::kBackwardPost; }},
      {"forward_prefetch", [](FsdpOptions& o) { o.forward_prefetch = true; }},
      {"limit_all_gathers", [](FsdpOptions& o) { o.limit_all_gathers = false; }},
      {"check_execution_order", [](FsdpOptions& o) { o.check_execution_order = false; }},
      {"verify_collectives_every", [](FsdpOptions& o) { o.verify_collectives_every = 5; }},
      {"offload_params", [](FsdpOptions& o) { o.offload_params = true; }},
      {"gradient_divide_factor", [](FsdpOptions& o) { o.gradient_divide_factor = 1.0; }},
      {"device_id", [](FsdpOptions& o) { o.device_id = c10::Device(c10::kCUDA, 0); }},
      {"ignored_modules", [](FsdpOptions& o) { o.ignored_modules.push_back(nullptr); }},
      {"sync_module_states", [](FsdpOptions& o) { o.sync_module_states = true; }},
      {"param_init_fn", [](FsdpOptions& o) { o.param_init_fn = [](torch::nn::Module&) {}; }},
  };
}

TEST(CrossRankOptionsKey, EveryFieldRanksMustAgreeOnChangesTheKey) {
  const std::string defaults = CrossRankOptionsKey(FsdpOptions());
  for (const Change& change : AgreedFieldChanges()) {
    FsdpOptions changed;
    change.apply(changed);
    EXPECT_NE(CrossRankOptionsKey(changed), defaults) << change.field;
  }
}

TEST(CrossRankOptionsKey, TheReplicateAndPostForwardGroupsCountByTheirSizes) {
  absl::Status status = testing::RunOnThreadRanks(1, [](Collectives& replicate) {
    FsdpOptions hybrid;
    hybrid.strategy = ShardingStrategy::kHybridShard;
    const std::string without = CrossRankOptionsKey(hybrid);
    hybrid.replicate_group = &replicate;
    EXPECT_NE(CrossRankOptionsKey(hybrid), without);
    EXPECT_NE(CrossRankOptionsKey(hybrid).find("replicate_group_size=1"), std::string::npos)
        << CrossRankOptionsKey(hybrid);
    FsdpOptions post_forward;
    const std::string full_reshard = CrossRankOptionsKey(post_forward);
    post_forward.post_forward_group = &replicate;
    EXPECT_NE(CrossRankOptionsKey(post_forward), full_reshard);
    EXPECT_NE(CrossRankOptionsKey(post_forward).find("post_forward_group_size=1"),
              std::string::npos);
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(CrossRankOptionsKey, WhatMayDifferBetweenRanksLeavesTheKeyAlone) {
  FsdpOptions on_gpu0;
  on_gpu0.device_id = c10::Device(c10::kCUDA, 0);
  FsdpOptions on_gpu1 = on_gpu0;
  on_gpu1.device_id = c10::Device(c10::kCUDA, 1);
  TraceRecorder trace(/*rank=*/1);
  on_gpu1.trace = &trace;
  on_gpu1.debug_log = [](const std::string&) {};
  EXPECT_EQ(CrossRankOptionsKey(on_gpu0), CrossRankOptionsKey(on_gpu1));
}

TEST(ValidateFsdpOptions, RefusesADtypeMixedPrecisionDoesNotUse) {
  FsdpOptions options;
  options.mixed_precision.param_dtype = at::kBFloat16;
  EXPECT_TRUE(ValidateFsdpOptions(options).ok());
  options.mixed_precision.reduce_dtype = at::kInt;
  const absl::Status refused = ValidateFsdpOptions(options);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("mixed_precision: MixedPrecision::reduce_dtype is Int, not one "
                                   "of float32, float16, bfloat16"),
            std::string::npos)
      << refused;
  // Floating-point, but no mixed precision: float64 is no lower precision.
  options.mixed_precision.reduce_dtype = at::kDouble;
  EXPECT_EQ(ValidateFsdpOptions(options).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fsdp
