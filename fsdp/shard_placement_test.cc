#include "fsdp/shard_placement.h"

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "comm/collectives.h"
#include "fsdp/flat_param_handle.h"
#include "fsdp/test_models.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"

namespace fsdp {
namespace {

using testing::BlockImpl;
using testing::Net;
using testing::RunOnThreadRanks;

class ShardPlacementTest : public ::testing::TestWithParam<ShardingStrategy> {};

// The ranks' pieces of every parameter tile its full tensor exactly once
// (once per rank under NO_SHARD), each piece is the unwrapped model's
// elements [lo, hi), and writing into `local` writes the model's shard.
TEST_P(ShardPlacementTest, TheRanksPiecesAreTheFullTensorsAndViewTheShards) {
  constexpr int kWorld = 3;
  Net reference;
  std::vector<std::pair<std::string, at::Tensor>> full;
  for (const auto& item : reference->named_parameters()) {
    full.emplace_back(item.key(), item.value().detach().reshape({-1}).clone());
  }
  std::vector<std::vector<ShardPlacement>> seen(kWorld);
  absl::Status status = RunOnThreadRanks(kWorld, [&](Collectives& comm) {
    Net model;
    FsdpOptions options;
    options.strategy = GetParam();
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    const ShardPlacements placements = ShardPlacementsOf(**wrapped);
    for (const auto& [name, flat] : full) {
      const at::Tensor param = model->named_parameters()[name];
      const ShardPlacement p = PlacementOf(placements, param);
      ASSERT_GE(p.unit, 0) << name;
      ASSERT_LT(p.unit, static_cast<int>((*wrapped)->units().size())) << name;
      bool held = false;
      for (const auto& entry : (*wrapped)->units()[p.unit]->handle()->entries()) {
        held |= entry.param.unsafeGetTensorImpl() == param.unsafeGetTensorImpl();
      }
      EXPECT_TRUE(held) << name << " is not in unit " << p.unit;
      ASSERT_LE(p.hi, flat.numel()) << name;
      ASSERT_LE(p.lo, p.hi) << name;
      EXPECT_EQ(p.sharded, GetParam() != ShardingStrategy::kNoShard) << name;
      ASSERT_EQ(p.local.dim(), 1);
      ASSERT_EQ(p.local.numel(), p.hi - p.lo) << name;
      EXPECT_TRUE(at::equal(p.local, flat.narrow(0, p.lo, p.hi - p.lo))) << name;
      seen[comm.rank()].push_back(p);
    }
    // Writing through `local` is writing the shard the unit trains.
    const ShardPlacement head = PlacementOf(placements, model->named_parameters()["head.weight"]);
    head.local.fill_(7);
    const at::Tensor again = PlacementOf(ShardPlacementsOf(**wrapped),
                                         model->named_parameters()["head.weight"]).local;
    EXPECT_TRUE(at::equal(again, at::full_like(again, 7)));
  });
  ASSERT_TRUE(status.ok()) << status;
  for (int r = 0; r < kWorld; ++r) ASSERT_EQ(seen[r].size(), full.size());
  for (size_t k = 0; k < full.size(); ++k) {
    std::vector<int> covered(full[k].second.numel(), 0);
    for (int r = 0; r < kWorld; ++r) {
      for (int64_t i = seen[r][k].lo; i < seen[r][k].hi; ++i) ++covered[i];
    }
    const int times = GetParam() == ShardingStrategy::kNoShard ? kWorld : 1;
    for (int64_t i = 0; i < full[k].second.numel(); ++i) {
      ASSERT_EQ(covered[i], times) << full[k].first << " element " << i;
    }
  }
}

// A unit's shard as a whole (what LOCAL state dicts save and optimizer
// state is gathered like): gathering it gives every parameter's full
// tensor, and the parameters' placements are views of it.
TEST_P(ShardPlacementTest, AUnitsShardGathersToTheFullTensorsAndHoldsThePlacements) {
  constexpr int kWorld = 2;
  Net reference;
  std::map<std::string, at::Tensor> full;
  for (const auto& item : reference->named_parameters()) {
    full[item.key()] = item.value().detach().clone();
  }
  absl::Status status = RunOnThreadRanks(kWorld, [&](Collectives& comm) {
    Net model;
    FsdpOptions options;
    options.strategy = GetParam();
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    std::map<const void*, std::string> name_of;
    for (const auto& item : model->named_parameters()) {
      name_of[item.value().unsafeGetTensorImpl()] = item.key();
    }
    const ShardPlacements placements = ShardPlacementsOf(**wrapped);
    size_t seen = 0;
    for (size_t u = 0; u < (*wrapped)->units().size(); ++u) {
      const std::optional<UnitShard> shard = UnitShard::Of(*(*wrapped)->units()[u]);
      if (!shard.has_value()) continue;
      const FlatLayout& layout = shard->layout();
      EXPECT_EQ(shard->strategy(), GetParam());
      EXPECT_EQ(layout.sharded(), GetParam() != ShardingStrategy::kNoShard);
      ASSERT_EQ(shard->local().numel(), layout.shard_numel());
      const at::Tensor gathered = shard->AllGather(shard->local());
      for (size_t i = 0; i < layout.params().size(); ++i) {
        const std::string& name = name_of.at(shard->param(i).unsafeGetTensorImpl());
        EXPECT_TRUE(at::equal(layout.FullViewOf(gathered, i), full.at(name))) << name;
        EXPECT_EQ(PlacementOf(placements, shard->param(i)).unit, static_cast<int>(u)) << name;
        ++seen;
      }
      shard->local().fill_(static_cast<float>(u + 1));
      for (size_t i = 0; i < layout.params().size(); ++i) {
        const at::Tensor local = PlacementOf(placements, shard->param(i)).local;
        EXPECT_TRUE(at::equal(local, at::full_like(local, static_cast<float>(u + 1))));
      }
    }
    EXPECT_EQ(seen, full.size());
  });
  ASSERT_TRUE(status.ok()) << status;
}

TEST(ShardPlacement, ATensorNoUnitHoldsIsWholeAndInPlaceOnlyWhenContiguous) {
  const at::Tensor buffer = at::arange(6, at::kFloat).reshape({2, 3});
  const ShardPlacement p = PlacementOf(ShardPlacements{}, buffer);
  EXPECT_EQ(p.unit, -1);
  EXPECT_FALSE(p.sharded);
  EXPECT_EQ(p.lo, 0);
  EXPECT_EQ(p.hi, 6);
  EXPECT_EQ(p.full_shape, (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(p.in_place);
  p.local.fill_(3);
  EXPECT_TRUE(at::equal(buffer, at::full({2, 3}, 3.0f)));
  const at::Tensor transposed = at::arange(6, at::kFloat).reshape({2, 3}).t();
  const ShardPlacement q = PlacementOf(ShardPlacements{}, transposed);
  EXPECT_FALSE(q.in_place);
  EXPECT_TRUE(at::equal(q.local, transposed.reshape({-1})));
}

INSTANTIATE_TEST_SUITE_P(Strategies, ShardPlacementTest,
                         ::testing::Values(ShardingStrategy::kFullShard,
                                           ShardingStrategy::kShardGradOp,
                                           ShardingStrategy::kNoShard),
                         [](const auto& info) { return ShardingStrategyName(info.param); });

}  // namespace
}  // namespace fsdp
