#include "fsdp/flat_layout.h"

#include <cstdint>
#include <vector>

#include "ATen/ATen.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

using Param = FlatLayout::Param;

// 15 + 7 + 4 = 26 elements over 3 ranks: padded to 27, shards of 9.
std::vector<Param> ThreeTrainable() {
  return {{"a", {5, 3}, true}, {"b", {7}, true}, {"c", {2, 2}, true}};
}

TEST(FlatLayout, PadsToTheWorldSizeAndSplitsInShards) {
  // Rank 0 owns a[0:9]; rank 1 a[9:15], b[0:3]; rank 2 b[3:7], c, padding.
  const std::vector<std::vector<int64_t>> offsets = {{0, 0, 0}, {9, 0, 0}, {0, 3, 0}};
  const std::vector<std::vector<int64_t>> owned = {{9, 0, 0}, {6, 3, 0}, {0, 4, 4}};
  for (int r = 0; r < 3; ++r) {
    const FlatLayout layout = FlatLayout::Of(ThreeTrainable(), /*sharded=*/true, 3, r);
    EXPECT_EQ(layout.flat_numel(), 26);
    EXPECT_EQ(layout.padded_numel(), 27);
    EXPECT_EQ(layout.shard_numel(), 9);
    EXPECT_EQ(layout.trainable_shard_numel(), 9);
    ASSERT_EQ(layout.segments().size(), 1u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(layout.params()[i].shard_offset, offsets[r][i]) << r << " " << i;
      EXPECT_EQ(layout.params()[i].shard_numel, owned[r][i]) << r << " " << i;
    }
    EXPECT_EQ(layout.params()[1].offset, 15);
    EXPECT_EQ(layout.params()[2].offset, 22);
  }
}

// The views: a shard-shaped buffer gives each parameter the elements of
// its flattened full tensor that the rank owns; a full-shaped one gives
// the parameter in its shape.
TEST(FlatLayout, ViewsFindEachParameterInFlatBuffers) {
  const at::Tensor full = at::arange(27, at::kFloat);
  for (int r = 0; r < 3; ++r) {
    const FlatLayout layout = FlatLayout::Of(ThreeTrainable(), true, 3, r);
    const at::Tensor shard = full.narrow(0, r * 9, 9);
    for (size_t i = 0; i < 3; ++i) {
      const FlatParamInfo& info = layout.params()[i];
      const at::Tensor whole = layout.FullViewOf(full, i);
      EXPECT_EQ(whole.sizes().vec(), info.shape);
      const at::Tensor mine = layout.ShardViewOf(shard, i);
      ASSERT_EQ(mine.numel(), info.shard_numel);
      EXPECT_TRUE(
          at::equal(mine, whole.reshape({-1}).narrow(0, info.shard_offset, info.shard_numel)))
          << r << " " << i;
    }
  }
}

// Trainable a (5) and c (2): 7 -> padded 9, 3 per rank. Frozen b (4):
// 4 -> padded 6, 2 per rank. The trainable segment comes first.
TEST(FlatLayout, FrozenParametersLieInTheirOwnSegmentAfterTheTrainable) {
  const std::vector<Param> params = {{"a", {5}, true}, {"b", {2, 2}, false}, {"c", {2}, true}};
  const std::vector<std::vector<int64_t>> owned = {{3, 2, 0}, {2, 2, 1}, {0, 0, 1}};
  for (int r = 0; r < 3; ++r) {
    const FlatLayout layout = FlatLayout::Of(params, true, 3, r);
    EXPECT_EQ(layout.flat_numel(), 11);
    EXPECT_EQ(layout.trainable_numel(), 7);
    EXPECT_EQ(layout.padded_numel(), 15);
    EXPECT_EQ(layout.shard_numel(), 5);
    EXPECT_EQ(layout.trainable_shard_numel(), 3);
    ASSERT_EQ(layout.segments().size(), 2u);
    EXPECT_TRUE(layout.segments()[0].trainable);
    EXPECT_EQ(layout.segments()[1].full_begin, 9);
    EXPECT_EQ(layout.segments()[1].shard_begin, 3);
    EXPECT_EQ(layout.params()[1].offset, 9) << "the frozen segment follows the padded trainable";
    EXPECT_EQ(layout.params()[2].offset, 5);
    EXPECT_EQ(&layout.SegmentOf(1), &layout.segments()[1]);
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(layout.params()[i].shard_numel, owned[r][i]);
  }
  // Rank 1's shard [a3 a4 c0 | b2 b3]: c's part is at element 2, b's at 3.
  const FlatLayout layout = FlatLayout::Of(params, true, 3, 1);
  const at::Tensor shard = at::arange(5, at::kFloat);
  EXPECT_TRUE(at::equal(layout.ShardViewOf(shard, 2), at::arange(2, 3, at::kFloat)));
  EXPECT_TRUE(at::equal(layout.ShardViewOf(shard, 1), at::arange(3, 5, at::kFloat)));
}

TEST(FlatLayout, EmptyParametersAddNoSegment) {
  const FlatLayout trainable = FlatLayout::Of({{"a", {5}, true}, {"e", {0}, false}}, true, 2, 0);
  EXPECT_EQ(trainable.segments().size(), 1u);
  EXPECT_TRUE(trainable.has_trainable_params());
  EXPECT_EQ(trainable.shard_numel(), 3);
  EXPECT_EQ(trainable.params()[1].shard_numel, 0);

  const FlatLayout frozen = FlatLayout::Of({{"z", {0}, true}, {"f", {3}, false}}, true, 2, 1);
  EXPECT_EQ(frozen.segments().size(), 1u);
  EXPECT_FALSE(frozen.has_trainable_params());
  EXPECT_EQ(frozen.trainable_shard_numel(), 0);
  EXPECT_EQ(frozen.shard_numel(), 2);
  EXPECT_EQ(frozen.params()[1].shard_offset, 2);
  EXPECT_EQ(frozen.params()[1].shard_numel, 1);
}

// NO_SHARD: one rank's layout, unpadded, whatever the group's size; the
// shard is the flat parameter and its views have the parameters' shapes.
TEST(FlatLayout, UnshardedLayoutIsTheWholeUnpaddedFlatParameter) {
  const FlatLayout layout = FlatLayout::Of(ThreeTrainable(), /*sharded=*/false, 4, 3);
  EXPECT_FALSE(layout.sharded());
  EXPECT_EQ(layout.rank(), 0);
  EXPECT_EQ(layout.padded_numel(), 26);
  EXPECT_EQ(layout.shard_numel(), 26);
  const at::Tensor flat = at::arange(26, at::kFloat);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(layout.params()[i].shard_numel, layout.params()[i].numel);
    EXPECT_EQ(layout.ShardViewOf(flat, i).sizes().vec(), layout.params()[i].shape);
  }
}

// Every element of every parameter is owned by exactly one rank, for world
// sizes that divide the segments evenly and those that leave padding.
TEST(FlatLayout, EveryElementHasExactlyOneOwner) {
  const std::vector<Param> params = {
      {"w", {3, 7}, true}, {"s", {}, false}, {"b", {7}, true}, {"f", {2, 5}, false}};
  for (int world = 1; world <= 8; ++world) {
    std::vector<int64_t> owned(params.size(), 0);
    for (int r = 0; r < world; ++r) {
      const FlatLayout layout = FlatLayout::Of(params, true, world, r);
      for (size_t i = 0; i < params.size(); ++i) {
        const FlatParamInfo& info = layout.params()[i];
        EXPECT_LE(info.shard_offset + info.shard_numel, info.numel);
        owned[i] += info.shard_numel;
      }
    }
    const FlatLayout layout = FlatLayout::Of(params, true, world, 0);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(owned[i], layout.params()[i].numel) << "world " << world << ", " << params[i].fqn;
    }
    EXPECT_EQ(layout.padded_numel(), world * layout.shard_numel());
  }
}

}  // namespace
}  // namespace fsdp
