// The value an optimizer's state dict is in memory, keyed by parameter FQN
// as PyTorch's get_optimizer_state_dict keys it: what the front door's
// optimizer functions (checkpoint/checkpoint.h) take and return. Installed
// with the package, as flat_shard_optimizers.h is; the other optim/ headers
// are the front door's building blocks.
#ifndef FSDP_OPTIM_OPTIM_STATE_DICT_H_
#define FSDP_OPTIM_OPTIM_STATE_DICT_H_

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ATen/core/Tensor.h"
#include "ATen/core/ivalue.h"

namespace fsdp {

struct ParamOptimState {
  std::map<std::string, at::Tensor> tensors;  // Elementwise: the parameter's full shape.
  std::map<std::string, c10::IValue> values;  // Everything else (step counts, ...).
};

struct ParamGroupState {
  std::vector<std::string> params;  // FQNs, in the group's order.
  // lr, betas, weight_decay, ...: the optimizer's own (all of them when
  // gathered; a load needs every one the optimizer has), and for Adam and
  // AdamW PyTorch's decoupled_weight_decay (false, true), which a load
  // checks against the optimizer's class where weight decay is on.
  std::map<std::string, c10::IValue> options;
};

struct OptimStateDict {
  std::vector<std::pair<std::string, ParamOptimState>> state;  // Parameters with state.
  std::vector<ParamGroupState> param_groups;
};

}  // namespace fsdp

#endif  // FSDP_OPTIM_OPTIM_STATE_DICT_H_
