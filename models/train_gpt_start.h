// The start of the main job: every refusal, once, before a rank starts.
// StartJob runs the checks (train_gpt_checks.h) in the order that lets a
// resumed run take its settings from its checkpoint first, takes the
// output directories' locks and resolves the settings a rank needs
// (JobStart). Refuse prints a refusal the one way every caller does.
#ifndef FSDP_MODELS_TRAIN_GPT_START_H_
#define FSDP_MODELS_TRAIN_GPT_START_H_

#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "base/directory_lock.h"
#include "comm/launch_environment.h"
#include "fsdp/fsdp_options.h"
#include "policies/wrap_policy.h"

namespace train_gpt {

// Prints each line of `problems` as the job's refusal; the exit code 2.
int Refuse(const std::vector<std::string>& problems, const std::string& preface = "");

// What a job starts with, once nothing was refused.
struct JobStart {
  int world_size = 0;
  fsdp::FsdpOptions options;
  std::unique_ptr<fsdp::WrapPolicy> policy;
  std::vector<fsdp::DirectoryLock> locks;  // Held for the job's life.
  std::vector<std::string> notes;          // Rank 0 prints them.
};

// Everything that can be refused is refused here, once, before a rank
// starts (under torchrun or srun, by every rank alike): the flags, the
// paths, the output directories' owner, the checkpoint to resume and the
// settings it records. `env` is none in launcher mode. Returns the exit
// code of a refusal, else the job's start.
std::variant<int, JobStart> StartJob(const std::optional<fsdp::LaunchEnvironment>& env);

}  // namespace train_gpt

#endif  // FSDP_MODELS_TRAIN_GPT_START_H_
