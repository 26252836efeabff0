// Internal to statedict/: the model's state-dict tensors and where the
// parameters among them live in the FSDP units' flat parameters.
#ifndef FSDP_STATEDICT_MODEL_TENSORS_H_
#define FSDP_STATEDICT_MODEL_TENSORS_H_

#include <cstddef>
#include <string>
#include <unordered_map>

#include "absl/status/status.h"
#include "fsdp/fully_shard.h"
#include "statedict/torch_file.h"
#include "torch/nn/module.h"

namespace fsdp::statedict_internal {

// PyTorch's state_dict order: a module's own parameters, its own buffers,
// then its children's, recursively (a shared child under each of its
// names). The tensors are the module's own (not copies).
StateDict NamedTensors(const torch::nn::Module& module);

// A parameter held by a unit: its handle and its index there.
struct Placement {
  FlatParamHandle* handle = nullptr;
  size_t entry = 0;
};
using Placements = std::unordered_map<const void*, Placement>;  // By TensorImpl.
Placements PlacementsOf(const FullyShardedModel& model);

}  // namespace fsdp::statedict_internal

#endif  // FSDP_STATEDICT_MODEL_TENSORS_H_
