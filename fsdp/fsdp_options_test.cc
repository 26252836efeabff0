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
      {"all_gather_quantization",
       [](FsdpOptions& o) { o.all_gather_quantization = CommQuantization::kInt8; }},
  };
}

TEST(CrossRankOptionsKey, EveryFieldRanksMustAgreeOnChangesTheKey) {
  absl::Status status = testing::RunOnThreadRanks(1, [](Collectives& comm) {
    const std::string defaults = CrossRankOptionsKey(FsdpOptions(), comm);
    for (const Change& change : AgreedFieldChanges()) {
      FsdpOptions changed;
      change.apply(changed);
      EXPECT_NE(CrossRankOptionsKey(changed, comm), defaults) << change.field;
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

// The key's text is hashed and compared across ranks, and ranks of
// different builds (before and after ProcessGroups moved the groups out of
// FsdpOptions) must still agree: it is pinned here byte for byte.
TEST(CrossRankOptionsKey, IsPinned) {
  absl::Status status = testing::RunOnThreadRanks(1, [](Collectives& comm) {
    EXPECT_EQ(CrossRankOptionsKey(FsdpOptions(), comm),
              "strategy=FULL_SHARD,replicate_group_size=0,post_forward_group_size=0,"
              "mixed_precision={},backward_prefetch=1,forward_prefetch=0,"
              "limit_all_gathers=1,check_execution_order=1,verify_collectives_every=0,"
              "offload_params=0,gradient_divide_factor=unset,device_type=unset,"
              "ignored_modules=0,sync_module_states=0,param_init_fn=unset;");
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(CrossRankOptionsKey, TheReplicateAndPostForwardGroupsCountByTheirSizes) {
  absl::Status status = testing::RunOnThreadRanks(1, [](Collectives& comm) {
    FsdpOptions hybrid;
    hybrid.strategy = ShardingStrategy::kHybridShard;
    ProcessGroups groups(comm);
    const std::string without = CrossRankOptionsKey(hybrid, groups);
    groups.replicate = &comm;
    EXPECT_NE(CrossRankOptionsKey(hybrid, groups), without);
    EXPECT_NE(CrossRankOptionsKey(hybrid, groups).find("replicate_group_size=1"),
              std::string::npos)
        << CrossRankOptionsKey(hybrid, groups);
    FsdpOptions post_forward;
    ProcessGroups with_post(comm);
    const std::string full_reshard = CrossRankOptionsKey(post_forward, with_post);
    with_post.post_forward = &comm;
    EXPECT_NE(CrossRankOptionsKey(post_forward, with_post), full_reshard);
    EXPECT_NE(CrossRankOptionsKey(post_forward, with_post).find("post_forward_group_size=1"),
              std::string::npos);
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(CrossRankOptionsKey, WhatMayDifferBetweenRanksLeavesTheKeyAlone) {
  absl::Status status = testing::RunOnThreadRanks(1, [](Collectives& comm) {
    FsdpOptions on_gpu0;
    on_gpu0.device_id = c10::Device(c10::kCUDA, 0);
    FsdpOptions on_gpu1 = on_gpu0;
    on_gpu1.device_id = c10::Device(c10::kCUDA, 1);
    TraceRecorder trace(/*rank=*/1);
    on_gpu1.trace = &trace;
    on_gpu1.debug_log = [](const std::string&) {};
    EXPECT_EQ(CrossRankOptionsKey(on_gpu0, comm), CrossRankOptionsKey(on_gpu1, comm));
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(ValidateProcessGroups, AReplicateGroupGoesWithAHybridStrategy) {
  // Two one-rank groups, distinct objects: the shard and the replicate group.
  absl::Status status = testing::RunOnThreadRanks(1, [](Collectives& comm) {
    absl::Status inner = testing::RunOnThreadRanks(1, [&comm](Collectives& other) {
      FsdpOptions hybrid;
      hybrid.strategy = ShardingStrategy::kHybridShard;
      ProcessGroups groups(comm);
      const absl::Status missing = ValidateProcessGroups(groups, hybrid);
      EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(missing.message().find("ProcessGroups::replicate is not set but the strategy is "
                                       "HYBRID_SHARD"),
                std::string::npos)
          << missing;
      groups.replicate = &other;
      EXPECT_TRUE(ValidateProcessGroups(groups, hybrid).ok());
      const absl::Status extra = ValidateProcessGroups(groups, FsdpOptions());
      EXPECT_NE(extra.message().find("ProcessGroups::replicate is set but the strategy is "
                                     "FULL_SHARD"),
                std::string::npos)
          << extra;
      // One group as both would reduce every gradient twice over it.
      groups.replicate = &comm;
      const absl::Status same = ValidateProcessGroups(groups, hybrid);
      EXPECT_EQ(same.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(same.message().find("ProcessGroups::replicate is the shard group"),
                std::string::npos)
          << same;
      ProcessGroups no_shard(comm);
      no_shard.shard = nullptr;
      EXPECT_EQ(ValidateProcessGroups(no_shard, FsdpOptions()).code(),
                absl::StatusCode::kInvalidArgument);
    });
    EXPECT_TRUE(inner.ok()) << inner;
  });
  EXPECT_TRUE(status.ok()) << status;
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
  // Buffers and outputs are cast locally only: any floating type, as in
  // PyTorch.
  options.mixed_precision.reduce_dtype = at::kFloat;
  options.mixed_precision.buffer_dtype = at::kDouble;
  options.mixed_precision.output_dtype = at::kDouble;
  EXPECT_TRUE(ValidateFsdpOptions(options).ok()) << ValidateFsdpOptions(options);
  options.mixed_precision.output_dtype = at::kLong;
  const absl::Status integral = ValidateFsdpOptions(options);
  EXPECT_NE(integral.message().find("MixedPrecision::output_dtype is Long, not a floating-point "
                                    "type"),
            std::string::npos)
      << integral;
}

}  // namespace
}  // namespace fsdp
