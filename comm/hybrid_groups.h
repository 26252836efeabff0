// The process groups of hybrid sharding: shard within a group of ranks,
// replicate across groups.
//
// With N ranks and shard-group size S (S divides N), rank r belongs to
//   shard group      r / S, ranks { (r/S)*S, ..., (r/S)*S + S-1 }  (contiguous:
//                    on one node when S = ranks per node), and
//   replicate group  r % S, ranks { r%S, r%S + S, ..., r%S + N-S } (the ranks
//                    holding the same shard).
// Every rank is in exactly one group of each kind. S = N is plain full
// sharding (one shard group, N replicate groups of one rank); S = 1 is pure
// replication.
#ifndef FSDP_COMM_HYBRID_GROUPS_H_
#define FSDP_COMM_HYBRID_GROUPS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/collectives.h"

namespace fsdp {

class HybridShardLayout {
 public:
  // Fails with kInvalidArgument unless world_size >= 1, shard_group_size >= 1
  // and shard_group_size divides world_size.
  static absl::StatusOr<HybridShardLayout> Create(int world_size, int shard_group_size);

  int world_size() const { return world_size_; }
  int shard_group_size() const { return shard_group_size_; }
  int replicate_group_size() const { return world_size_ / shard_group_size_; }
  int num_shard_groups() const { return replicate_group_size(); }
  int num_replicate_groups() const { return shard_group_size_; }

  // REQUIRES: 0 <= rank < world_size() for the functions below.
  int ShardGroupIndex(int rank) const { return rank / shard_group_size_; }
  int ReplicateGroupIndex(int rank) const { return rank % shard_group_size_; }
  int RankInShardGroup(int rank) const { return rank % shard_group_size_; }
  int RankInReplicateGroup(int rank) const { return rank / shard_group_size_; }
  std::vector<int> ShardGroupRanks(int rank) const;
  std::vector<int> ReplicateGroupRanks(int rank) const;

  // All groups of each kind, in index order.
  std::vector<std::vector<int>> ShardGroups() const;
  std::vector<std::vector<int>> ReplicateGroups() const;

  bool operator==(const HybridShardLayout& other) const {
    return world_size_ == other.world_size_ &&
           shard_group_size_ == other.shard_group_size_;
  }

 private:
  HybridShardLayout(int world_size, int shard_group_size)
      : world_size_(world_size), shard_group_size_(shard_group_size) {}

  int world_size_;
  int shard_group_size_;
};

// This rank's two groups.
struct HybridShardCollectives {
  std::unique_ptr<Collectives> shard;
  std::unique_ptr<Collectives> replicate;
};

// Connects `rank`'s shard and replicate groups through `connect` (any
// backend: GlooGroupConnector, NcclGroupConnector), named
// "<group_name>/shard<i>" and "<group_name>/replicate<i>". Every rank of the
// job must call it.
absl::StatusOr<HybridShardCollectives> CreateHybridShardCollectives(
    int rank, const HybridShardLayout& layout, const std::string& group_name,
    const GroupConnector& connect);

}  // namespace fsdp

#endif  // FSDP_COMM_HYBRID_GROUPS_H_
