// An FSDP model and its optimizer as one PyTorch Distributed Checkpoint,
// laid out as an FSDP2 job's dcp.save of
//   {model_key: get_model_state_dict(model),
//    optim_key: get_optimizer_state_dict(model, optimizer)}
// and written and read by every rank from and into its own shards
// (statedict/dcp_sharded.h), so that no rank ever holds a full copy:
//
//   - the model's tensors at (model_key, fqn), each rank writing the part
//     its flat shards hold;
//   - each parameter's elementwise optimizer state (exp_avg, ...) at
//     (optim_key, "state", fqn, name), sharded exactly as the parameter;
//     its step count as PyTorch keeps it (a float32 0-d tensor), written
//     once;
//   - each group's options at (optim_key, "param_groups", g, option), with
//     PyTorch's own (maximize, foreach, ...) at their defaults and the
//     group's "params" as FQNs (optim/torch_optim_file.h's layout).
//
// PyTorch's dcp.load into get_state_dict's dicts, then set_state_dict,
// restores both at any world size; a checkpoint FSDP2 saved that way loads
// here at any world size, each rank reading only the chunks that hold its
// parts (of the model and of the optimizer's elementwise state).
//
// Saving is atomic (the checkpoint in `dir` is replaced only when the new
// .metadata lands) and requires optimizer state for every parameter that
// has had a step (one without is left out, as PyTorch's optimizers leave
// it). Loading reads and checks everything (the model's tensors, the
// optimizer's groups, options and state shapes) on every rank before
// anything changes, and changes the model and optimizer of every rank or of
// none; only running out of memory while the read state is written into
// the optimizer, after the ranks agreed, can leave a rank's model loaded
// and its optimizer not (its error says so).
#ifndef FSDP_OPTIM_DCP_CHECKPOINT_H_
#define FSDP_OPTIM_DCP_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "formats/dcp.h"
#include "fsdp/fully_shard.h"
#include "optim/optim_state_dict.h"
#include "statedict/dcp_sharded.h"
#include "statedict/sharded_checkpoint.h"
#include "torch/optim/optimizer.h"

namespace fsdp {

struct DcpCheckpointKeys {
  std::string model = "model";
  std::string optim = "optim";
};

// Every rank calls; `dir` is created if absent and must be the same
// directory on every rank. `extra` values (rank 0's) are written beside
// them, e.g. a training loop's {"train_state": {"step": N}}. `ready` is
// this rank's outcome of any check the caller did first: an error there
// fails the save on every rank, in the save's own round.
// REQUIRES: the model IDLE.
absl::Status SaveShardedDcpModelAndOptimizer(FullyShardedModel& model,
                                             torch::optim::Optimizer& optimizer,
                                             const std::string& dir,
                                             const DcpCheckpointKeys& keys = {},
                                             const std::vector<DcpItem>& extra = {},
                                             const absl::Status& ready = absl::OkStatus());

// What SaveShardedDcpModelAndOptimizer writes, without writing it: this
// rank's shards of the model and of the optimizer's elementwise state
// (viewing their storage), and the values (options, step counts, `extra`)
// that rank 0 writes. No collective. REQUIRES: the model IDLE.
struct DcpModelAndOptimizer {
  std::vector<DcpTensorShard> shards;
  std::vector<DcpItem> values;
};
absl::StatusOr<DcpModelAndOptimizer> DcpShardsOfModelAndOptimizer(
    FullyShardedModel& model, torch::optim::Optimizer& optimizer,
    const DcpCheckpointKeys& keys = {}, const std::vector<DcpItem>& extra = {});

// Every rank calls. Optimizer state keyed by parameter index (a plain
// Optimizer.state_dict() saved by dcp.save) is read whole and mapped
// through the optimizer's own parameter order, as LoadDcpOptimStateDict
// does. `stats`, when given, counts this rank's bytes read and needed.
// `ready` is this rank's outcome of any preparation the caller did first
// (reading other entries of the checkpoint, say): an error there fails the
// load on every rank, and nothing changes.
absl::Status LoadShardedDcpModelAndOptimizer(FullyShardedModel& model,
                                             torch::optim::Optimizer& optimizer,
                                             const std::string& dir,
                                             const DcpCheckpointKeys& keys = {},
                                             ShardedLoadStats* stats = nullptr,
                                             const absl::Status& ready = absl::OkStatus());

// LoadShardedDcpModelAndOptimizer's optimizer half, for a caller that
// agrees across ranks itself (checkpoint/checkpoint.cc, once per load):
// StageShardedDcpOptimizer reads and checks this rank's part of the state
// under `optim_key` and changes nothing (no collective);
// ApplyStagedDcpOptimizer writes it into the optimizer once every rank has
// staged (and the model was loaded: its error says so).
struct StagedDcpOptimizer {
  OptimStateDict state;
  int64_t bytes_read = 0, bytes_needed = 0;
};
absl::Status StageShardedDcpOptimizer(FullyShardedModel& model,
                                      torch::optim::Optimizer& optimizer, const std::string& dir,
                                      const std::string& optim_key, StagedDcpOptimizer& staged);
absl::Status ApplyStagedDcpOptimizer(FullyShardedModel& model,
                                     torch::optim::Optimizer& optimizer, const std::string& dir,
                                     const StagedDcpOptimizer& staged);

}  // namespace fsdp

#endif  // FSDP_OPTIM_DCP_CHECKPOINT_H_
