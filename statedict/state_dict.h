// Model state dicts of FSDP models, and of plain libtorch modules with the
// same keys. statedict/ reaches the core only through the root state
// (FullyShardedModel: its units, in pre-order, and their handles).
//
// Keys are exactly those PyTorch's Module.state_dict() gives the same model
// without FSDP: for each module in pre-order, its own parameters, then its
// own buffers, prefixed by its FQN; a tensor registered under two names
// (tied weights) appears under both.
//
// PyTorch's three state dict types, each with its own entry points (the
// type is in the name, as for the optimizer's in optim/optim_state.h;
// FullStateDict and FullOptimStateDict take FullStateDictOptions):
//   FULL     FullStateDict / LoadFullStateDict: the unsharded tensors,
//            gathered unit by unit (below); loads from a state dict of any
//            world size, or of the unwrapped module.
//   SHARDED  every rank's own shards, as a checkpoint directory with a
//            manifest: SaveShardedCheckpoint / LoadShardedCheckpoint
//            (statedict/sharded_checkpoint.h) load at any world size.
//   LOCAL    LocalStateDict / LoadLocalStateDict: the flat shards as they
//            are: "<unit>.flat_param" and "<unit>.flat_param_layout" (world
//            size, rank, strategy, the parameters' sizes and, for a unit
//            mixing frozen and trainable ones, which train) per unit, plus
//            buffers and ignored parameters by name. Loads only into the
//            same layout; anything else is an error naming the unit and both
//            layouts.
//
// Every entry point returns kFailedPrecondition unless the model is IDLE.
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
// file; see formats/torch_file.h). Everything is checked first — missing
// and unexpected keys, shapes, dtypes, tied names with different values —
// and all problems are reported in one error, with the model untouched; only
// then each rank copies its own shard of every parameter out of the full
// tensors. No communication.
#ifndef FSDP_STATEDICT_STATE_DICT_H_
#define FSDP_STATEDICT_STATE_DICT_H_

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "formats/torch_file.h"
#include "fsdp/fully_shard.h"
#include "torch/nn/module.h"

namespace fsdp {

// How a FULL state dict is gathered, the model's and the optimizer's alike
// (PyTorch's FullStateDictConfig and FullOptimStateDictConfig).
struct FullStateDictOptions {
  // Ranks other than 0 get an empty state dict and never hold a copy.
  bool rank0_only = false;
  // The result in host memory; false leaves each tensor on its device.
  bool offload_to_cpu = true;
};

struct FullStateDictStats {
  // Largest FullParamBytes() seen while gathering: at most one unit's.
  int64_t peak_full_param_bytes = 0;
};

// Every rank must call it.
absl::StatusOr<StateDict> FullStateDict(FullyShardedModel& model,
                                        const FullStateDictOptions& options = {},
                                        FullStateDictStats* stats = nullptr);

// The FULL state dict without holding it, for writers that stream it:
// `visit` gets each entry (its index in the model's state_dict order) with
// its full value, valid during the call only and on the tensor's device.
// Tensors no unit holds come first, then each unit's while that unit alone
// is gathered: the order FullStateDictVisitOrder returns. Tied names are
// visited each. With rank0_only, ranks other than 0 visit nothing (they
// still gather). Every rank must call it. A failed visit stops the visits
// on its rank but not the gathering, so no rank is left in a collective;
// its error is returned (on that rank only: agreeing is the caller's).
using FullTensorVisitor = std::function<absl::Status(size_t index, const at::Tensor& value)>;
absl::Status VisitFullStateDict(FullyShardedModel& model, const FullStateDictOptions& options,
                                const FullTensorVisitor& visit,
                                FullStateDictStats* stats = nullptr);
// The state_dict indices in the order VisitFullStateDict visits them.
// REQUIRES: the model IDLE.
std::vector<size_t> FullStateDictVisitOrder(const FullyShardedModel& model);
// Which entries a FULL load may leave out or ignore (PyTorch's strict=False,
// and frozen parameters a state dict may lack).
struct LoadFullStateDictOptions {
  // Entries of the model the state dict may lack: they keep their values.
  std::set<std::string> may_be_missing;
  // Entries the model lacks are ignored instead of refused.
  bool ignore_unexpected = false;
};

// All-or-nothing; every rank passes the same state dict; no communication.
absl::Status LoadFullStateDict(FullyShardedModel& model, const StateDict& state,
                               const LoadFullStateDictOptions& options = {});

// This rank's shards; no communication.
absl::StatusOr<StateDict> LocalStateDict(const FullyShardedModel& model);
// All-or-nothing; each rank passes the state dict it saved.
absl::Status LoadLocalStateDict(FullyShardedModel& model, const StateDict& state);

// The same for a plain (unwrapped) module: its state dict, and loading one
// (with the same checks, all-or-nothing).
StateDict ModuleStateDict(const torch::nn::Module& module);
absl::Status LoadModuleStateDict(torch::nn::Module& module, const StateDict& state);

}  // namespace fsdp

#endif  // FSDP_STATEDICT_STATE_DICT_H_
