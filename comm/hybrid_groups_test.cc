#include "comm/hybrid_groups.h"

#include <string>
#include <thread>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/gloo_collectives.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"

namespace fsdp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(HybridShardLayout, TwoByTwo) {
  auto layout = HybridShardLayout::Create(4, 2);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->ShardGroups(),
            (std::vector<std::vector<int>>{{0, 1}, {2, 3}}));
  EXPECT_EQ(layout->ReplicateGroups(),
            (std::vector<std::vector<int>>{{0, 2}, {1, 3}}));
  EXPECT_THAT(layout->ShardGroupRanks(3), ElementsAre(2, 3));
  EXPECT_THAT(layout->ReplicateGroupRanks(3), ElementsAre(1, 3));
  EXPECT_EQ(layout->RankInShardGroup(3), 1);
  EXPECT_EQ(layout->RankInReplicateGroup(3), 1);
}

TEST(HybridShardLayout, EveryRankInExactlyOneGroupOfEachKind) {
  for (auto [world, shard] : std::vector<std::pair<int, int>>{
           {1, 1}, {4, 2}, {6, 3}, {6, 2}, {6, 6}, {6, 1}, {8, 4}}) {
    auto layout = HybridShardLayout::Create(world, shard);
    ASSERT_TRUE(layout.ok()) << layout.status();
    for (const auto& groups : {layout->ShardGroups(), layout->ReplicateGroups()}) {
      std::vector<int> seen(world, 0);
      for (const auto& group : groups) {
        for (int r : group) ++seen[r];
      }
      EXPECT_EQ(seen, std::vector<int>(world, 1)) << world << "/" << shard;
    }
    for (int r = 0; r < world; ++r) {
      // A rank's position in each group agrees with the group listings.
      EXPECT_EQ(layout->ShardGroupRanks(r)[layout->RankInShardGroup(r)], r);
      EXPECT_EQ(layout->ReplicateGroupRanks(r)[layout->RankInReplicateGroup(r)], r);
      EXPECT_EQ(layout->ShardGroupRanks(r).size(), static_cast<size_t>(shard));
      EXPECT_EQ(layout->ReplicateGroupRanks(r).size(), static_cast<size_t>(world / shard));
    }
  }
}

TEST(HybridShardLayout, RejectsSizesThatDoNotDivide) {
  EXPECT_THAT(HybridShardLayout::Create(6, 4).status().message(),
              HasSubstr("shard group size 4 does not divide world size 6"));
  EXPECT_THAT(HybridShardLayout::Create(4, 0).status().message(),
              HasSubstr("shard group size 0 is not in [1, world size 4]"));
  EXPECT_THAT(HybridShardLayout::Create(4, 8).status().message(),
              HasSubstr("shard group size 8 is not in [1, world size 4]"));
  EXPECT_THAT(HybridShardLayout::Create(0, 1).status().message(),
              HasSubstr("world size 0 must be >= 1"));
}

// Collectives on a shard group reach only its members, and on a replicate
// group only the ranks holding the same shard: W = 6 as 3 x 2.
TEST(HybridShardCollectives, GroupsReachOnlyTheirMembers) {
  const int world = 6;
  auto layout = HybridShardLayout::Create(world, 3).value();
  auto store = c10::make_intrusive<c10d::HashStore>();
  GlooOptions options;
  options.hostname = "127.0.0.1";
  options.timeout = std::chrono::seconds(30);
  std::vector<std::string> errors(world);
  std::vector<float> shard_sums(world), replicate_sums(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto groups = CreateHybridShardCollectives(rank, layout, options.group_name,
                                                   GlooGroupConnector(store, options));
        if (!groups.ok()) {
          errors[rank] = std::string(groups.status().message());
          return;
        }
        EXPECT_EQ(groups->shard->world_size(), 3);
        EXPECT_EQ(groups->replicate->world_size(), 2);
        at::Tensor value = at::full({3}, static_cast<float>(1 << rank));
        groups->shard->AllReduce(value, ReduceOp::kSum)->Wait();
        shard_sums[rank] = value[0].item<float>();
        value.fill_(static_cast<float>(1 << rank));
        groups->replicate->AllReduce(value, ReduceOp::kSum)->Wait();
        replicate_sums[rank] = value[0].item<float>();
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < world; ++rank) {
    ASSERT_EQ(errors[rank], "") << "rank " << rank;
    float shard_expected = 0, replicate_expected = 0;
    for (int r : layout.ShardGroupRanks(rank)) shard_expected += 1 << r;
    for (int r : layout.ReplicateGroupRanks(rank)) replicate_expected += 1 << r;
    EXPECT_EQ(shard_sums[rank], shard_expected) << "rank " << rank;
    EXPECT_EQ(replicate_sums[rank], replicate_expected) << "rank " << rank;
  }
}

}  // namespace
// The groups are made by whatever backend the connector speaks, under names
// derived from the job's group name, with each rank's place in them; a
// connector's failure is returned as it is. No backend here: the connector
// records its calls and refuses the replicate group.
TEST(HybridShardCollectives, ConnectsThroughAnyBackend) {
  auto layout = HybridShardLayout::Create(6, 3).value();
  std::vector<std::string> calls;
  GroupConnector recorder = [&](const std::string& name, int rank,
                                int size) -> absl::StatusOr<std::unique_ptr<Collectives>> {
    calls.push_back(absl::StrCat(name, " rank ", rank, " of ", size));
    if (absl::StrContains(name, "replicate")) return absl::UnavailableError("no peer");
    return std::unique_ptr<Collectives>();
  };
  auto groups = CreateHybridShardCollectives(4, layout, "job", recorder);
  EXPECT_EQ(groups.status(), absl::UnavailableError("no peer"));
  EXPECT_THAT(calls, ElementsAre("job/shard1 rank 1 of 3", "job/replicate1 rank 1 of 2"));

  calls.clear();
  EXPECT_THAT(CreateHybridShardCollectives(6, layout, "job", recorder).status().message(),
              HasSubstr("rank 6 is not in [0, world size 6)"));
  EXPECT_TRUE(calls.empty());
}

}  // namespace fsdp
