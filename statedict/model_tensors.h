// Internal to statedict/ and checkpoint/: the model's state-dict tensors (where each lives
// on this rank is the core's answer, fsdp/shard_placement.h).
#ifndef FSDP_STATEDICT_MODEL_TENSORS_H_
#define FSDP_STATEDICT_MODEL_TENSORS_H_

#include <string>

#include "absl/status/status.h"
#include "formats/torch_file.h"
#include "fsdp/fully_shard.h"
#include "torch/nn/module.h"

namespace fsdp::statedict_internal {

// PyTorch's state_dict order: a module's own parameters, its own buffers,
// then its children's, recursively (a shared child under each of its
// names). The tensors are the module's own (not copies).
StateDict NamedTensors(const torch::nn::Module& module);

}  // namespace fsdp::statedict_internal

#endif  // FSDP_STATEDICT_MODEL_TENSORS_H_
