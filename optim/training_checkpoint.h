// SHARDED training checkpoints: the model's SHARDED checkpoint
// (statedict/sharded_checkpoint.h) and the optimizer's state in the same
// directory and manifest, so that training resumes exactly where it stopped
// — at the same world size bit for bit, at another one within float32
// rounding of the reductions' changed order.
//
// The optimizer's entries live under "optim/": for every parameter and
// state key, "optim/state/<fqn>/<key>" — elementwise tensors (shaped like
// the parameter's shard) sharded exactly as the parameter, everything else
// (step counts, other tensors) replicated and written once; for every
// parameter group g, "optim/group/<g>/<option>" (lr, betas, ...) and
// "optim/group/<g>/param/<fqn>" (its position in the group). Loading checks
// them all with the model's tensors before changing anything; a checkpoint
// of a different optimizer, parameter grouping or model is refused with
// every difference listed, and the model and optimizer stay as they were.
// Saving requires every parameter to have optimizer state (save after the
// first step); loading into a fresh optimizer creates it (see
// optim/optim_state.h).
#ifndef FSDP_OPTIM_TRAINING_CHECKPOINT_H_
#define FSDP_OPTIM_TRAINING_CHECKPOINT_H_

#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp/fully_shard.h"
#include "statedict/sharded_checkpoint.h"
#include "torch/optim/optimizer.h"

namespace fsdp {

// Every rank calls; `dir` must exist and be the same directory on every rank.
// `metadata` lands in the manifest (ReadCheckpointMetadata reads it back);
// rank 0's is the one written.
absl::Status SaveTrainingCheckpoint(FullyShardedModel& model, torch::optim::Optimizer& optimizer,
                                    const std::string& dir,
                                    const CheckpointMetadata& metadata = {});
// What SaveTrainingCheckpoint writes, without writing it: this rank's
// checkpoint tensors of the model and the optimizer (viewing their
// storage), for SaveModelCheckpointTensors. No collective; fails (the same
// on every rank) when a parameter has no optimizer state yet.
absl::StatusOr<std::vector<CheckpointTensor>> TrainingCheckpointTensors(
    FullyShardedModel& model, torch::optim::Optimizer& optimizer);
absl::Status LoadTrainingCheckpoint(FullyShardedModel& model, torch::optim::Optimizer& optimizer,
                                    const std::string& dir);
// The storages (StorageImpl addresses) of the optimizer's own state
// tensors that a checkpoint reads in place, for a save that outlives the
// call and must hold them (checkpoint/async_checkpoint.h). State read
// through a copy (an optimizer's serialize() other than libtorch's Adam,
// AdamW and SGD and ours) is not among them.
std::set<const void*> OptimizerStateStorages(const torch::optim::Optimizer& optimizer);

}  // namespace fsdp

#endif  // FSDP_OPTIM_TRAINING_CHECKPOINT_H_
