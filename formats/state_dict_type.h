// The value a state dict is in memory: what the front door's get/set and
// torch.save functions (checkpoint/checkpoint.h) take and return. It lives
// with the file formats, the lowest package that reads and writes it, so
// that everything above (statedict/, optim/, checkpoint/) shares this one
// type. The only formats/ header installed with the package; the formats
// themselves are the front door's building blocks.
#ifndef FSDP_FORMATS_STATE_DICT_TYPE_H_
#define FSDP_FORMATS_STATE_DICT_TYPE_H_

#include <string>
#include <utility>
#include <vector>

#include "ATen/core/Tensor.h"

namespace fsdp {

// An ordered state dict: names (FQNs) and tensors. A tensor may appear
// under several names (tied parameters); a file then stores it once.
using StateDict = std::vector<std::pair<std::string, at::Tensor>>;

}  // namespace fsdp

#endif  // FSDP_FORMATS_STATE_DICT_TYPE_H_
