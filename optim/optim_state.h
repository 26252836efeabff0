// Optimizer state of FSDP models, keyed by parameter FQN, as PyTorch's
// FSDP.optim_state_dict does. optim/ reaches the core through the model's
// units and their shards (fsdp/shard_placement.h), never a unit's flat
// parameter.
//
// An optimizer built after wrapping steps each original parameter's shard
// (a 1-D piece of its unit's flat shard), so its per-parameter state is per
// shard. The FULL optimizer state dict unflattens and gathers it: for every
// parameter, every state tensor shaped like the parameter's shard
// ("elementwise": Adam's exp_avg, SGD's momentum_buffer, Adagrad's sum,
// ...) becomes a tensor of the parameter's full shape, gathered one unit
// and one state key at a time; every other state value (Adam's step) is
// kept as it is (equal on every rank). Any libtorch optimizer works without
// special code: state is read and written through the optimizer's own
// serialize().
//
// Loading maps it back at any world size and wrapping: each rank slices its
// own shard out of the full tensors. Everything is checked first (unknown or
// missing parameters, shapes, parameter groups) and a problem leaves the
// optimizer untouched. Parameters that have no state yet (a fresh
// optimizer) get it by one step with learning rate 0 and zero gradients,
// which changes no parameter, and then the loaded values.
//
// The same format serves plain (unwrapped) modules: state moves between an
// unwrapped model's optimizer and an FSDP model's, both ways (PyTorch's
// rekeying between parameter index and FQN is this mapping).
#ifndef FSDP_OPTIM_OPTIM_STATE_H_
#define FSDP_OPTIM_OPTIM_STATE_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ATen/core/Tensor.h"
#include "ATen/core/ivalue.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp/fully_shard.h"
#include "optim/optim_state_dict.h"
#include "statedict/state_dict.h"
#include "torch/nn/module.h"
#include "torch/optim/optimizer.h"

namespace fsdp {

// Every rank must call. `options` as for the model's FULL state dict
// (statedict/state_dict.h): with rank0_only, ranks other than 0 get an
// empty dict; with offload_to_cpu, the state tensors are in host memory.
// REQUIRES: the model IDLE (else kFailedPrecondition); `optimizer` built
// over the model's parameters after wrapping.
absl::StatusOr<OptimStateDict> FullOptimStateDict(FullyShardedModel& model,
                                                  torch::optim::Optimizer& optimizer,
                                                  const FullStateDictOptions& options = {});
// Every rank passes the same dict; no communication. Like every call
// below, kFailedPrecondition unless the model is IDLE.
absl::Status LoadFullOptimStateDict(FullyShardedModel& model, torch::optim::Optimizer& optimizer,
                                    const OptimStateDict& state);
// Only rank 0 holds the dict (PyTorch's scatter_full_optim_state_dict):
// it is broadcast, and every rank loads its shard; `state` is read on rank 0
// only (under hybrid sharding, the first replica's: rank 0 of both groups).
// The error of a rank that cannot load is every rank's.
absl::Status LoadFullOptimStateDictFromRank0(FullyShardedModel& model,
                                             torch::optim::Optimizer& optimizer,
                                             const OptimStateDict& state);

// SHARDED: this rank's own part of the state, as each rank of a sharded
// checkpoint writes and reads it (optim/dcp_checkpoint.h); no
// communication. Laid out as a FULL dict, except that each elementwise
// tensor holds only the elements of the parameter's flattened state this
// rank holds: 1-D, [lo, hi) of OptimizerShardPlaces' place. (Loading also
// takes a tensor of the parameter's full shape, and this rank's part of it:
// a reader may not know a state's parameter before it has read it all.)
struct ParamShardPlace {
  std::vector<int64_t> full_shape;
  bool sharded = false;  // Else every rank holds all of it.
  int64_t lo = 0, hi = 0;
};
// By FQN, every parameter of the optimizer; fails if one is not the model's.
absl::StatusOr<std::map<std::string, ParamShardPlace>> OptimizerShardPlaces(
    const FullyShardedModel& model, torch::optim::Optimizer& optimizer);
// The tensors may share storage with the optimizer's own state: write
// them out before the optimizer steps again.
absl::StatusOr<OptimStateDict> ShardedOptimStateDict(FullyShardedModel& model,
                                                     torch::optim::Optimizer& optimizer);
// Each rank passes its own part, read for its places at any world size;
// checked as a FULL load is, then applied. Check alone changes nothing.
absl::Status CheckShardedOptimStateDict(FullyShardedModel& model,
                                        torch::optim::Optimizer& optimizer,
                                        const OptimStateDict& state);
absl::Status LoadShardedOptimStateDict(FullyShardedModel& model, torch::optim::Optimizer& optimizer,
                                       const OptimStateDict& state);

// The same for an unwrapped module and its optimizer.
absl::StatusOr<OptimStateDict> ModuleOptimStateDict(const torch::nn::Module& module,
                                                    torch::optim::Optimizer& optimizer);
absl::Status LoadModuleOptimStateDict(const torch::nn::Module& module,
                                      torch::optim::Optimizer& optimizer,
                                      const OptimStateDict& state);

}  // namespace fsdp

#endif  // FSDP_OPTIM_OPTIM_STATE_H_
