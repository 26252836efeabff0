// Internal to checkpoint/: SaveCheckpoint's Distributed Checkpoint up to
// the write, shared by the blocking save (checkpoint.cc) and the one in
// the background (async_checkpoint.cc), so that both check and write the
// same things.
#ifndef FSDP_CHECKPOINT_SAVE_INTERNAL_H_
#define FSDP_CHECKPOINT_SAVE_INTERNAL_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"
#include "formats/dcp.h"
#include "fsdp/fully_shard.h"
#include "statedict/dcp_sharded.h"
#include "torch/optim/optimizer.h"

namespace fsdp::checkpoint_internal {

// This rank's shards (viewing the model's and the optimizer's storage) and
// the values rank 0 writes. `ready` is this rank's outcome of the checks
// (the train state's labels, what `dir` holds): a refusal there travels in
// the save's own round, so that no rank skips it.
struct DistributedSave {
  std::vector<DcpTensorShard> shards;
  std::vector<DcpItem> values;
  absl::Status ready;
};

// Every rank of the model's groups calls, with the model IDLE. Under hybrid
// sharding the checks are agreed here (only the writers' shard group takes
// part in the save's round): a refusal is then returned on every rank.
absl::StatusOr<DistributedSave> PrepareDistributedSave(const std::string& dir,
                                                       FullyShardedModel& model,
                                                       torch::optim::Optimizer* optimizer,
                                                       const TrainState& train_state,
                                                       const CheckpointIoOptions& options);

}  // namespace fsdp::checkpoint_internal

#endif  // FSDP_CHECKPOINT_SAVE_INTERNAL_H_
