// The main job's optimizer: built from --optimizer, --optimizer_kernel,
// --weight_decay_groups and the hyper-parameter flags, and, after a
// checkpoint or --init_optim_state_dict is loaded, the hyper-parameters
// given on the command line applied over the loaded ones. Kept apart from
// the training loop because both a new and a resumed run go through it.
#ifndef FSDP_MODELS_TRAIN_GPT_OPTIMIZER_H_
#define FSDP_MODELS_TRAIN_GPT_OPTIMIZER_H_

#include <memory>
#include <string>
#include <vector>

#include "ATen/core/Tensor.h"
#include "torch/optim/optimizer.h"

namespace train_gpt {

// The optimizer the flags ask for over `groups` of parameters, each
// hyper-parameter not given at its default (a group without decay at 0).
std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
    const std::vector<std::vector<at::Tensor>>& groups);

// After loading a checkpoint: every hyper-parameter given on the command
// line replaces the checkpoint's; the others keep the checkpoint's. Returns
// what the optimizer now uses, and where each value came from.
std::string ApplyGivenHyperparameters(torch::optim::Optimizer& optimizer);

}  // namespace train_gpt

#endif  // FSDP_MODELS_TRAIN_GPT_OPTIMIZER_H_
