#include "fsdp/gradient_reduction.h"

#include <chrono>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "comm/gloo_collectives.h"
#include "comm/hybrid_groups.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"

namespace fsdp {
namespace {

using ::fsdp::testing::RunOnThreadRanks;

// Trainable w (3) and b (2) around a frozen f (4): the trainable segment is
// [w0 w1 w2 b0 b1 pad] over two ranks, three elements each.
struct Unit {
  std::vector<FlatParamEntry> params = {{"w", at::zeros({3}).requires_grad_()},
                                        {"f", at::zeros({2, 2})},
                                        {"b", at::zeros({2}).requires_grad_()}};
  FlatLayout layout;

  Unit(int world, int rank) {
    std::vector<FlatLayout::Param> specs;
    for (const FlatParamEntry& p : params) {
      specs.push_back({p.fqn, p.param.sizes().vec(), p.param.requires_grad()});
    }
    layout = FlatLayout::Of(specs, /*sharded=*/true, world, rank);
  }

  // Every trainable parameter's gradient: `value` everywhere.
  void SetGrads(float value) {
    for (const FlatParamEntry& p : params) {
      if (p.param.requires_grad()) p.param.mutable_grad() = at::full(p.param.sizes(), value);
    }
  }
};

// The average over the ranks, added into the sharded gradient across
// reductions; .grad is cleared by Start and the aliases view the result.
TEST(GradientReduction, AveragesOverTheGroupAndAccumulates) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& group) {
    Unit unit(2, group.rank());
    GradientReduction reduction("u", "unit 'u'", unit.layout, group, UnitPlacement{}, {});
    for (int step = 1; step <= 2; ++step) {
      unit.SetGrads(static_cast<float>(group.rank() + 1));  // Average 1.5.
      reduction.Start(unit.params, /*all_reduce=*/true);
      EXPECT_FALSE(unit.params[0].param.grad().defined()) << "copied in, then cleared";
      EXPECT_TRUE(reduction.pending());
      EXPECT_TRUE(reduction.Finish());
      EXPECT_FALSE(reduction.pending());
      // Rank 1's last element is padding, which stays zero.
      const at::Tensor expected =
          group.rank() == 0 ? at::full({3}, 1.5f * step)
                            : at::cat({at::full({2}, 1.5f * step), at::zeros({1})});
      EXPECT_TRUE(at::allclose(reduction.sharded_grad(), expected)) << reduction.sharded_grad();
    }
    // Rank 0 owns w; rank 1 owns b. The frozen parameter has no alias.
    EXPECT_EQ(reduction.grad_aliases()[0].numel(), group.rank() == 0 ? 3 : 0);
    EXPECT_FALSE(reduction.grad_aliases()[1].defined());
    EXPECT_EQ(reduction.grad_aliases()[2].numel(), group.rank() == 0 ? 0 : 2);
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A user's divide factor replaces the average: the sum divided by it.
TEST(GradientReduction, DividesTheSumByAGivenFactor) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& group) {
    Unit unit(2, group.rank());
    GradientReductionOptions options;
    options.divide_factor = 4.0;
    GradientReduction reduction("u", "unit 'u'", unit.layout, group, UnitPlacement{}, options);
    unit.SetGrads(2.0f);  // Sum 4, divided by 4.
    reduction.Start(unit.params, true);
    reduction.Finish();
    EXPECT_NEAR(reduction.sharded_grad()[0].item<float>(), 1.0f, 1e-6);
    EXPECT_THROW(reduction.SetDivideFactor(0.0), c10::Error);
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Hybrid sharding (2 shard groups of 2): a reduction that leaves the
// all-reduce out keeps the shard group's sum aside, the next one adds it
// before its all-reduce, so the replicate group carries it once and the
// result is the average over all four ranks of both backward passes.
TEST(GradientReduction, HybridPartialSumCrossesTheReplicateGroupOnce) {
  const HybridShardLayout layout = HybridShardLayout::Create(4, 2).value();
  auto store = c10::make_intrusive<c10d::HashStore>();
  absl::Status status = RunOnThreadRanks(4, [&](Collectives& world) {
    GlooOptions gloo;
    gloo.hostname = "127.0.0.1";
    gloo.timeout = std::chrono::seconds(60);
    auto groups = CreateHybridShardCollectives(world.rank(), layout, gloo.group_name,
                                               GlooGroupConnector(store, gloo));
    ASSERT_TRUE(groups.ok()) << groups.status();
    Collectives& shard = *groups->shard;
    Collectives& replicate = *groups->replicate;
    Unit unit(shard.world_size(), shard.rank());
    GradientReductionOptions options;
    options.replicate = &replicate;
    GradientReduction reduction("u", "unit 'u'", unit.layout, shard, UnitPlacement{}, options);
    replicate.ResetCounters();
    // Backward 1 gives rank r the gradient r, backward 2 gives 10: the
    // average over ranks of their sum is 1.5 + 10.
    unit.SetGrads(static_cast<float>(world.rank()));
    reduction.Start(unit.params, /*all_reduce=*/false);
    EXPECT_FALSE(reduction.Finish()) << "no sharded gradient to show yet";
    EXPECT_TRUE(reduction.has_partial());
    EXPECT_FALSE(reduction.sharded_grad().defined());
    EXPECT_EQ(replicate.counters().Calls(CollectiveOp::kAllReduce), 0);
    unit.SetGrads(10.0f);
    reduction.Start(unit.params, /*all_reduce=*/true);
    EXPECT_TRUE(reduction.Finish());
    EXPECT_FALSE(reduction.has_partial());
    EXPECT_EQ(replicate.counters().Calls(CollectiveOp::kAllReduce), 1);
    EXPECT_NEAR(reduction.sharded_grad()[0].item<float>(), 11.5f, 1e-5);
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Hooks never run under hybrid sharding (RegisterCommHook refuses them);
// the pipeline refuses one set directly rather than skip the replicate
// group, and leaves the gradients where they were.
TEST(GradientReduction, RefusesACommHookUnderHybridSharding) {
  const HybridShardLayout layout = HybridShardLayout::Create(2, 1).value();
  auto store = c10::make_intrusive<c10d::HashStore>();
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& world) {
    GlooOptions gloo;
    gloo.hostname = "127.0.0.1";
    auto groups = CreateHybridShardCollectives(world.rank(), layout, gloo.group_name,
                                               GlooGroupConnector(store, gloo));
    ASSERT_TRUE(groups.ok()) << groups.status();
    Unit unit(groups->shard->world_size(), groups->shard->rank());
    GradientReductionOptions options;
    options.replicate = groups->replicate.get();
    GradientReduction reduction("u", "unit 'u'", unit.layout, *groups->shard, UnitPlacement{},
                                options);
    DefaultCommHook hook;
    reduction.SetCommHook(&hook);
    unit.SetGrads(1.0f);
    EXPECT_THROW(reduction.Start(unit.params, true), c10::Error);
    EXPECT_FALSE(reduction.pending());
    EXPECT_TRUE(unit.params[0].param.grad().defined()) << "refused before .grad is taken";
  });
  EXPECT_TRUE(status.ok()) << status;
}

}  // namespace
}  // namespace fsdp
