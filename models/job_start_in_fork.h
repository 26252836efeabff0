// The main job's start (models/train_gpt_start.h) run in a fork of a test,
// for tests of its refusals: a launch of the binary is ~0.7 s of loading
// libtorch, which the fork has already done.
#ifndef FSDP_MODELS_JOB_START_IN_FORK_H_
#define FSDP_MODELS_JOB_START_IN_FORK_H_

#include <string>

#include "models/job_test_util.h"

namespace models {
namespace testing {

// What the job's main() does with `flags` (space-separated, unquoted) up
// to its first refusal, in a fork of this process whose flags are still at
// their defaults, none given: parses them as its command line, then runs
// StartJob as the launcher does, exiting with the code main() returns for
// a refusal (the output: what it printed). Exit code 0: nothing was
// refused, and no rank was started.
CommandResult StartJobInFork(const std::string& flags);

}  // namespace testing
}  // namespace models

#endif  // FSDP_MODELS_JOB_START_IN_FORK_H_
