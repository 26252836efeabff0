// The value a state dict is in memory: what the front door's get/set and
// torch.save functions (checkpoint/checkpoint.h) take and return. The only
// statedict/ header installed with the package; the file formats behind it
// are the front door's building blocks.
#ifndef FSDP_STATEDICT_STATE_DICT_TYPE_H_
#define FSDP_STATEDICT_STATE_DICT_TYPE_H_

#include <string>
#include <utility>
#include <vector>

#include "ATen/core/Tensor.h"

namespace fsdp {

// An ordered state dict: names (FQNs) and tensors. A tensor may appear
// under several names (tied parameters); a file then stores it once.
using StateDict = std::vector<std::pair<std::string, at::Tensor>>;

}  // namespace fsdp

#endif  // FSDP_STATEDICT_STATE_DICT_TYPE_H_
