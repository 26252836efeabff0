// Running one rank of the main job: its placement resolved, its process
// groups connected (Gloo, NCCL, or staged collectives over Gloo; hybrid
// sharding's shard and replicate groups when asked) and its training run
// (train_gpt_training_run.h) on them. A rank that fails tells its groups
// why, so that the other ranks' errors quote its reason.
#ifndef FSDP_MODELS_TRAIN_GPT_RUN_H_
#define FSDP_MODELS_TRAIN_GPT_RUN_H_

#include <string>
#include <vector>

#include "comm/launch_environment.h"
#include "fsdp/fsdp_options.h"
#include "policies/wrap_policy.h"

namespace train_gpt {

// Trains as rank `env.rank` with `options` and `policy`; `notes` are
// printed first (rank 0). Returns the exit code; throws what stopped the
// run.
int RunRank(const fsdp::LaunchEnvironment& env, fsdp::FsdpOptions options,
            const fsdp::WrapPolicy& policy, const std::vector<std::string>& notes);

}  // namespace train_gpt

#endif  // FSDP_MODELS_TRAIN_GPT_RUN_H_
