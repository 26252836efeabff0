// Distributed Checkpoints (formats/dcp.h) written and read by every rank
// from and into its own shards, as PyTorch's dcp.save and dcp.load do, so
// that no rank ever holds a full copy of the state:
//
//   saving   each rank writes the part of every tensor its shard holds into
//            a data file of its own (__<rank>_<id>.distcp), as DCP chunks:
//            a flat shard's part of a parameter is not a box of it, so it
//            is stored as the few boxes that make it up (at most
//            2 * dims - 1; DcpBoxesOfFlatRange). Replicated tensors and
//            plain values are written once, by rank 0. Rank 0 then commits
//            .metadata for every rank's chunks. What PyTorch's dcp.load
//            reads at any world size, and ReadDcpMetadata checks.
//   loading  each rank reads only the chunks that hold part of what it
//            needs, whichever world size and layout wrote them (FSDP2's
//            row chunks, ours, a whole tensor), into staging memory; only
//            if every rank succeeded is anything copied into its tensors.
//            A chunk is read whole (one torch.save archive, as dcp.load
//            reads it): from a checkpoint of whole tensors, each rank holds
//            one whole tensor at a time.
//
// Atomic and all-or-nothing as the single-writer forms in dcp.h: a save
// that fails on any rank fails on every rank, naming the rank, and leaves
// the checkpoint that was in the directory as it was (its .metadata is
// replaced last, by rank 0, once every data file is complete); a load that
// fails on any rank changes nothing on any rank.
#ifndef FSDP_STATEDICT_DCP_SHARDED_H_
#define FSDP_STATEDICT_DCP_SHARDED_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ATen/core/Tensor.h"
#include "absl/status/status.h"
#include "comm/collectives.h"
#include "formats/dcp.h"
#include "fsdp/fully_shard.h"
#include "statedict/sharded_checkpoint.h"

namespace fsdp {

// One tensor as this rank holds it: elements [lo, hi) of the flattened
// tensor of `shape`, in `local` (1-D); a replicated tensor (not `sharded`)
// is whole on every rank. `path` is where it sits in the nested state dict.
struct DcpTensorShard {
  std::vector<DcpPathPart> path;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  bool sharded = false;
  int64_t lo = 0, hi = 0;
  // Saving: read from it (any device). Loading: written into it, so it
  // must be contiguous and, with in_place, a view of the model's own
  // storage (a load refuses a copy: CheckpointTensor).
  at::Tensor local;
  bool in_place = true;
};

// Every rank of `group` calls with its shards of the same tensors, in the
// same order (rank 0 checks); `values` (plain values and small tensors,
// dcp.h's DcpItem) are rank 0's to write. `dir` is created if absent and
// must be the same directory on every rank (rank 0 checks that it sees
// every rank's file). `ready` is this rank's outcome of any preparation
// the caller did first: an error there fails the save on every rank.
// `after_write`: as SaveCheckpointTensors' (statedict/sharded_checkpoint.h).
absl::Status SaveShardedDcp(Collectives& group, const std::string& dir,
                            const std::vector<DcpTensorShard>& tensors,
                            const std::vector<DcpItem>& values = {},
                            const absl::Status& ready = absl::OkStatus(),
                            const AfterLocalWrite& after_write = nullptr);

// Every rank of `group` calls with its shards of the same tensors; each is
// found by its path in the checkpoint, whose size and dtype must be the
// shard's (checkpoint entries not asked for are not read, as in dcp.load).
// `ready` is this rank's outcome of any preparation the caller did first:
// an error there fails the load on every rank too. Under hybrid sharding
// `replicate_group` joins the agreement, so that every replica loads or
// none. `stats`, when given, counts this rank's bytes read and needed.
absl::Status LoadShardedDcp(Collectives& group, const std::string& dir,
                            const std::vector<DcpTensorShard>& tensors,
                            ShardedLoadStats* stats = nullptr,
                            const absl::Status& ready = absl::OkStatus(),
                            Collectives* replicate_group = nullptr);

// LoadShardedDcp in two halves, for a caller that folds the agreement
// between ranks into its own (checkpoint/checkpoint.cc agrees once per
// load on the directory, the train state and this): StageShardedDcp reads
// and checks this rank's parts into staging memory and changes nothing
// (no collective); ApplyStagedDcp, once every rank has staged, copies them
// into the tensors (it fails only if the copy throws, e.g. out of memory).
struct StagedDcpLoad {
  std::vector<DcpTensorShard> tensors;
  std::vector<at::Tensor> staging;  // One per tensor, this rank's part.
  ShardedLoadStats stats;
};
absl::Status StageShardedDcp(const std::string& dir, std::vector<DcpTensorShard> tensors,
                             StagedDcpLoad& staged);
absl::Status ApplyStagedDcp(const StagedDcpLoad& staged);

// The model's state-dict tensors as DCP shards under `key` (path (key,
// fqn); no key: (fqn)), viewing the model's own storage. A tied tensor is
// under its first name, and under every one with `every_name` (a save
// writes every name, a load reads one). REQUIRES: the model IDLE.
std::vector<DcpTensorShard> ModelDcpShards(const FullyShardedModel& model, const std::string& key,
                                           bool every_name);

// SaveShardedDcp over the model's shard group. Under hybrid sharding the
// shard groups hold identical shards: only the replicate group's rank 0's
// group writes, and the others return once it has, with its outcome.
absl::Status SaveModelShardedDcp(FullyShardedModel& model, const std::string& dir,
                                 const std::vector<DcpTensorShard>& tensors,
                                 const std::vector<DcpItem>& values = {},
                                 const absl::Status& ready = absl::OkStatus());
// The same over `groups` (statedict/sharded_checkpoint.h); it touches no
// model, so the tensors may be copies taken earlier.
absl::Status SaveModelShardedDcp(const SaveGroups& groups, const std::string& dir,
                                 const std::vector<DcpTensorShard>& tensors,
                                 const std::vector<DcpItem>& values = {},
                                 const absl::Status& ready = absl::OkStatus(),
                                 const AfterLocalWrite& after_write = nullptr);

// The model alone, as FSDP2's dcp.save of {key: get_model_state_dict(model)}
// and dcp.load into it: under hybrid sharding one shard group writes (the
// replicate group's rank 0's), and every rank reads its own part (every
// replica or none).
absl::Status SaveShardedDcpModel(FullyShardedModel& model, const std::string& dir,
                                 const std::string& key = "model");
absl::Status LoadShardedDcpModel(FullyShardedModel& model, const std::string& dir,
                                 const std::string& key = "model",
                                 ShardedLoadStats* stats = nullptr);

}  // namespace fsdp

#endif  // FSDP_STATEDICT_DCP_SHARDED_H_
