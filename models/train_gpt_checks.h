// What the main job (//models:train_gpt) decides before any rank
// trains: its FSDP options and wrap policy from the flags, every problem
// with the flags and the paths they name, which job owns the output
// directories, and the settings a resumed run takes from its checkpoint.
//
// The launcher runs these before it starts a rank; a rank runs them again
// (under torchrun or srun, each rank on its own). Every problem names the
// flag and what would be valid. They only read, except PrepareOutputs
// (creates the output directories), LockOutputDirectories and
// TakeSettingsFromCheckpoint (sets the flags the user left out).
#ifndef FSDP_MODELS_TRAIN_GPT_CHECKS_H_
#define FSDP_MODELS_TRAIN_GPT_CHECKS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/directory_lock.h"
#include "fsdp/fsdp_options.h"
#include "models/output_paths.h"
#include "optim/run_checkpoints.h"
#include "policies/wrap_policy.h"

namespace train_gpt {

// Whether the user gave flag `name` on the command line (a flag left out
// may take its value from a resumed run's checkpoint).
bool Given(const char* name);

// The corpus the job generates without --data; a sequence needs
// --block_size + 1 bytes of it.
inline constexpr int64_t kGeneratedCorpusBytes = int64_t{1} << 20;
// The held-out part of --data's `size` bytes: the last tenth.
inline int64_t HeldOutBytes(int64_t size) { return size / 10; }

// --sharding_strategy, --backward_prefetch, --param_dtype and the rest.
absl::StatusOr<fsdp::FsdpOptions> FsdpOptionsFromFlags();
// Loads --policy_plugin (if any) and builds --wrap_policy.
absl::StatusOr<std::unique_ptr<fsdp::WrapPolicy>> BuildWrapPolicy();

// Every problem with the flags: values out of range, flags given without
// the flag they depend on, input paths that cannot be read, and a run too
// large for this host's memory. `world_size` and `ranks_on_host` as the job
// will have them; `launcher_world_size` is WORLD_SIZE when another launcher
// started this rank (--world_size must then agree), else none.
// `settings_pending`: a resumed run before TakeSettingsFromCheckpoint, whose
// flags left out may still change; the checks across flags wait for them.
std::vector<std::string> FlagProblems(fsdp::ShardingStrategy strategy, int world_size,
                                      int ranks_on_host, std::optional<int> launcher_world_size,
                                      bool settings_pending);

// The job's outputs, as the flags name them.
std::vector<fsdp::OutputPath> Outputs();
// Checks that the outputs do not overlap, then creates and test-writes
// every output path, so that a bad one fails now rather than after hours.
absl::Status PrepareOutputs();
// Every output directory locked for this job (base/directory_lock.h),
// before anything is written there; a rank started by the job's own
// launcher shares the launcher's locks. Errors name the flag.
absl::StatusOr<std::vector<fsdp::DirectoryLock>> LockOutputDirectories();
// The exports would replace nothing, unless --overwrite_exports.
absl::Status CheckExportsReplaceNothing();

// The settings this run records in its checkpoints: the flags a resumed
// run takes from them, and the job's world size.
std::map<std::string, std::string> RecordedSettings(int world_size);

// The run's checkpoint directory (none without --checkpoint_dir), checked
// against --resume, --overwrite_checkpoints and --steps; its checkpoints
// record RecordedSettings(world_size).
absl::StatusOr<std::optional<fsdp::RunCheckpoints>> OpenCheckpoints(const std::string& run_id,
                                                                    int world_size);

// A resumed run continues as the run of `from` was set up: each setting
// `from` records whose flag was left out takes the checkpoint's value
// (absl::SetFlag); one given with another value is refused when the
// checkpoint cannot continue under it (the optimizer, its parameter groups,
// the model's shape), else used. Returns one line for each setting that
// now differs from the flag's default or the checkpoint's, saying where its
// value came from; an error lists every refusal. `world_size` is the job's;
// `launcher_world_size` as for FlagProblems.
absl::StatusOr<std::vector<std::string>> TakeSettingsFromCheckpoint(
    const fsdp::StepCheckpoint& from, int world_size, std::optional<int> launcher_world_size);

}  // namespace train_gpt

#endif  // FSDP_MODELS_TRAIN_GPT_CHECKS_H_
