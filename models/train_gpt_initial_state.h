// The state a new run of the main job starts from: --init_state_dict into
// the wrapped model and --init_optim_state_dict into the optimizer, from a
// torch.save file or a Distributed Checkpoint directory. A resumed run does
// not come here: its state is its checkpoint's. Both throw, naming the
// file and, where the entries lie under a top-level key, the key flag that
// would select them.
#ifndef FSDP_MODELS_TRAIN_GPT_INITIAL_STATE_H_
#define FSDP_MODELS_TRAIN_GPT_INITIAL_STATE_H_

#include <set>
#include <string>

#include "fsdp/fully_shard.h"
#include "torch/nn/module.h"
#include "torch/optim/optimizer.h"

namespace train_gpt {

// --init_state_dict into the wrapped model; `model_keys` are its state
// dict's names. One rule for every format: an entry the model lacks is
// refused unless --init_state_dict_ignore drops it. `print`: rank 0 says
// what it loaded.
void LoadInitialState(fsdp::FullyShardedModel& fsdp_model, const std::set<std::string>& model_keys,
                      bool print);

// --init_optim_state_dict into `optimizer`, built over `fsdp_model`'s
// shards of `model`'s parameters; then the hyper-parameters given on the
// command line over the loaded ones.
void LoadInitialOptimizerState(torch::nn::Module& model, fsdp::FullyShardedModel& fsdp_model,
                               torch::optim::Optimizer& optimizer, bool print);

}  // namespace train_gpt

#endif  // FSDP_MODELS_TRAIN_GPT_INITIAL_STATE_H_
