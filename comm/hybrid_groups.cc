#include "comm/hybrid_groups.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace fsdp {

absl::StatusOr<HybridShardLayout> HybridShardLayout::Create(int world_size,
                                                            int shard_group_size) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("hybrid sharding: world size ", world_size, " must be >= 1"));
  }
  if (shard_group_size < 1 || shard_group_size > world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("hybrid sharding: shard group size ", shard_group_size,
                     " is not in [1, world size ", world_size, "]"));
  }
  if (world_size % shard_group_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hybrid sharding: shard group size ", shard_group_size,
        " does not divide world size ", world_size, " (", world_size % shard_group_size,
        " ranks would be left without a shard group)"));
  }
  return HybridShardLayout(world_size, shard_group_size);
}

std::vector<int> HybridShardLayout::ShardGroupRanks(int rank) const {
  std::vector<int> ranks;
  const int first = ShardGroupIndex(rank) * shard_group_size_;
  for (int r = first; r < first + shard_group_size_; ++r) ranks.push_back(r);
  return ranks;
}

std::vector<int> HybridShardLayout::ReplicateGroupRanks(int rank) const {
  std::vector<int> ranks;
  for (int r = ReplicateGroupIndex(rank); r < world_size_; r += shard_group_size_) {
    ranks.push_back(r);
  }
  return ranks;
}

std::vector<std::vector<int>> HybridShardLayout::ShardGroups() const {
  std::vector<std::vector<int>> groups;
  for (int g = 0; g < num_shard_groups(); ++g) {
    groups.push_back(ShardGroupRanks(g * shard_group_size_));
  }
  return groups;
}

std::vector<std::vector<int>> HybridShardLayout::ReplicateGroups() const {
  std::vector<std::vector<int>> groups;
  for (int g = 0; g < num_replicate_groups(); ++g) groups.push_back(ReplicateGroupRanks(g));
  return groups;
}

absl::StatusOr<HybridShardCollectives> CreateHybridShardCollectives(
    int rank, const HybridShardLayout& layout, const std::string& group_name,
    const GroupConnector& connect) {
  if (rank < 0 || rank >= layout.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hybrid sharding: rank ", rank, " is not in [0, world size ", layout.world_size(),
        ")"));
  }
  // Shard groups connect first on every rank, then replicate groups: each
  // group only waits for its own members, so the order cannot deadlock.
  HybridShardCollectives groups;
  FSDP_ASSIGN_OR_RETURN(groups.shard,
                        connect(absl::StrCat(group_name, "/shard", layout.ShardGroupIndex(rank)),
                                layout.RankInShardGroup(rank), layout.shard_group_size()));
  FSDP_ASSIGN_OR_RETURN(
      groups.replicate,
      connect(absl::StrCat(group_name, "/replicate", layout.ReplicateGroupIndex(rank)),
              layout.RankInReplicateGroup(rank), layout.replicate_group_size()));
  return groups;
}

}  // namespace fsdp
