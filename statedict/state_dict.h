// Model state dicts of FSDP models, and of plain libtorch modules with the
// same keys. statedict/ reaches the core only through the root state
// (FullyShardedModel: its units, in pre-order, and their handles).
//
// Keys are exactly those PyTorch's Module.state_dict() gives the same model
// without FSDP: for each module in pre-order, its own parameters, then its
// own buffers, prefixed by its FQN; a tensor registered under two names
// (tied weights) appears under both.
//
// State dict types (PyTorch's StateDictType), set on the root for all its
// units at once — SetStateDictType, or the scoped StateDictTypeScope:
//   FULL     the unsharded tensors, gathered unit by unit (below); loads from
//            a state dict of any world size, or of the unwrapped module.
//   SHARDED  every rank's own shards, as a checkpoint directory with a
//            manifest: SaveShardedCheckpoint / LoadShardedCheckpoint
//            (statedict/sharded_checkpoint.h) load at any world size.
//            StateDictOf and LoadStateDict refuse this type, pointing there.
//   LOCAL    the flat shards as they are: "<unit>.flat_param" and
//            "<unit>.flat_param_layout" (world size, rank, strategy, the
//            parameters' sizes) per unit, plus buffers and ignored
//            parameters by name. Loads only into the same layout; anything
//            else is an error naming the unit and both layouts.
//
// FULL, gathering: every rank must call. Units are all-gathered one at a
// time, in pre-order, and each is resharded before the next is gathered, so
// no rank holds more than one unit's full parameters at once (measured:
// FullStateDictStats). The result holds copies (full parameters are freed
// after each unit): in host memory with offload_to_cpu (the default, as
// PyTorch's FullStateDictConfig recommends for GPU models), else on the
// tensors' own device. With rank0_only, ranks other than 0 get an empty
// state dict and never hold a copy.
//
// FULL, loading: every rank passes the same full state dict (each reads the
// file; see statedict/torch_file.h). Everything is checked first — missing
// and unexpected keys, shapes, dtypes, tied names with different values —
// and all problems are reported in one error, with the model untouched; only
// then each rank copies its own shard of every parameter out of the full
// tensors. No communication.
#ifndef FSDP_STATEDICT_STATE_DICT_H_
#define FSDP_STATEDICT_STATE_DICT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp/fully_shard.h"
#include "statedict/torch_file.h"
#include "torch/nn/module.h"

namespace fsdp {

enum class StateDictType { kFull, kSharded, kLocal };

struct StateDictSettings {
  StateDictType type = StateDictType::kFull;
  // FULL only.
  bool rank0_only = false;
  bool offload_to_cpu = true;
};

// The settings of `model` (FULL, not rank0_only, until set).
StateDictSettings GetStateDictSettings(const FullyShardedModel& model);
void SetStateDictType(FullyShardedModel& model, const StateDictSettings& settings);

// Sets the type for its lifetime and restores the previous one.
class StateDictTypeScope {
 public:
  StateDictTypeScope(FullyShardedModel& model, const StateDictSettings& settings);
  StateDictTypeScope(const StateDictTypeScope&) = delete;
  StateDictTypeScope& operator=(const StateDictTypeScope&) = delete;
  ~StateDictTypeScope();

 private:
  FullyShardedModel& model_;
  StateDictSettings previous_;
};

struct FullStateDictStats {
  // Largest FullParamBytes() seen while gathering: at most one unit's.
  int64_t peak_full_param_bytes = 0;
};

// The state dict of the type `model` is set to. REQUIRES: the model IDLE.
absl::StatusOr<StateDict> StateDictOf(FullyShardedModel& model,
                                      FullStateDictStats* stats = nullptr);
// Loads a state dict of the type `model` is set to; all-or-nothing.
absl::Status LoadStateDict(FullyShardedModel& model, const StateDict& state);

// The same for a plain (unwrapped) module: its state dict, and loading one
// (with the same checks, all-or-nothing).
StateDict ModuleStateDict(const torch::nn::Module& module);
absl::Status LoadModuleStateDict(torch::nn::Module& module, const StateDict& state);

}  // namespace fsdp

#endif  // FSDP_STATEDICT_STATE_DICT_H_
