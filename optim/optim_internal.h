// Internal to optim/: reading and writing optimizer state through the
// optimizer's own serialize(), and where each optimizer parameter lives in
// the model (its FQN, full shape, and the elements this rank holds).
#ifndef FSDP_OPTIM_OPTIM_INTERNAL_H_
#define FSDP_OPTIM_OPTIM_INTERNAL_H_

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ATen/core/Tensor.h"
#include "ATen/core/ivalue.h"
#include "absl/status/statusor.h"
#include "fsdp/fully_shard.h"
#include "torch/nn/module.h"
#include "torch/optim/optimizer.h"
#include "torch/serialize/input-archive.h"
#include "torch/serialize/output-archive.h"

namespace fsdp::optim_internal {

struct RawState {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::vector<std::pair<std::string, c10::IValue>> values;
};

// What `serialize` writes, read back as named tensors and values.
RawState ReadRaw(const std::function<void(torch::serialize::OutputArchive&)>& serialize);
// How the state's tensors come back: copies for a caller that keeps or
// hands them out, views of the optimizer's own tensors for a checkpoint
// written before the next step (SaveCheckpoint, and a background save,
// which holds the shards until it has read them).
enum class StateRead { kCopies, kViews };
// What `state`'s serialize() writes, read back: directly for libtorch's
// Adam, AdamW and SGD (views or copies, as `read` says), through an
// archive (copies) for any other.
RawState ReadOptimizerState(const torch::optim::OptimizerParamState& state,
                            StateRead read = StateRead::kCopies);
// A state class of ours that serialize()s exactly as its libtorch `base`
// does (the flat-shard optimizers' states): ReadOptimizerState reads it
// directly, as it reads its base. Before any read; idempotent.
void ReadStateAsItsBase(const std::type_info& type, const std::type_info& base);
// An archive holding `raw`, for an object's serialize(InputArchive&).
torch::serialize::InputArchive ArchiveOf(const RawState& raw);
// The key type of Optimizer::state(): the parameter's TensorImpl address,
// printed as a string in libtorch 1.x and the address itself in 2.x.
using OptimizerStateKey =
    std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;
// The key of `param` in Optimizer::state().
OptimizerStateKey StateKey(const at::Tensor& param);
// A parameter group's options by name, and back (all of them, as OptionsOf
// returns them).
std::map<std::string, c10::IValue> OptionsOf(const torch::optim::OptimizerOptions& options);
void WriteOptions(torch::optim::OptimizerOptions& options,
                  const std::map<std::string, c10::IValue>& values);

// A parameter of the optimizer and where it lives on this rank (the
// core's ShardPlacement, fsdp/shard_placement.h).
struct ParamPlace {
  std::string fqn;
  at::Tensor param;  // The optimizer's (local) parameter.
  std::vector<int64_t> full_shape;
  bool sharded = false;
  int64_t lo = 0, hi = 0;  // Local elements of the flattened parameter.
};
using Places = std::unordered_map<const void*, ParamPlace>;  // By TensorImpl.

// One parameter's optimizer state as this rank holds it. Elementwise tensors
// (shaped like the local parameter: Adam's exp_avg, SGD's momentum_buffer,
// Adagrad's sum) are sharded as the parameter is; everything else (step
// counts, tensors of any other shape) every rank holds whole.
struct ParamState {
  std::map<std::string, at::Tensor> elementwise;
  std::map<std::string, c10::IValue> values;
};
// Empty when the optimizer has no state for the parameter yet.
std::optional<ParamState> ReadParamState(torch::optim::Optimizer& optimizer,
                                         const ParamPlace& place,
                                         StateRead read = StateRead::kCopies);
// Overwrites the parameter's state, which must exist (PrimeMissingState).
// Elementwise tensors are shaped like the local parameter or flat.
void WriteParamState(torch::optim::Optimizer& optimizer, const ParamPlace& place,
                     const ParamState& state);

// `model` null: an unwrapped module.
Places PlacesOf(const torch::nn::Module& root, const FullyShardedModel* model);
// The optimizer's parameters, by group, with their places; fails if one is
// not a parameter of the model.
absl::StatusOr<std::vector<std::vector<const ParamPlace*>>> GroupsOf(
    const torch::optim::Optimizer& optimizer, const Places& places);

// Gives every parameter of `wanted` without state a state, by one step at
// learning rate 0 with zero gradients for exactly those parameters (no
// parameter changes; gradients are restored). Returns the state keys it
// created, for UndoPriming.
std::vector<OptimizerStateKey> PrimeMissingState(torch::optim::Optimizer& optimizer,
                                           const std::vector<std::vector<const ParamPlace*>>& groups,
                                           const std::vector<const ParamPlace*>& wanted);
void UndoPriming(torch::optim::Optimizer& optimizer,
                 const std::vector<OptimizerStateKey>& created);

}  // namespace fsdp::optim_internal

#endif  // FSDP_OPTIM_OPTIM_INTERNAL_H_
