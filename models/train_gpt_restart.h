// A restarted rank of the main job: which run it continues. The launcher
// (ours or torchrun) restarts every rank of a failed job with
// TORCHELASTIC_RESTART_COUNT > 0; the job then resumes from the newest
// complete checkpoint of its own run in --checkpoint_dir, as --resume
// would, and starts again from step 1 when the failed attempts left none.
#ifndef FSDP_MODELS_TRAIN_GPT_RESTART_H_
#define FSDP_MODELS_TRAIN_GPT_RESTART_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace train_gpt {

// The id a new run of this job records in its checkpoints: the launcher's
// TORCHELASTIC_RUN_ID when it is one of ours (16 hex digits, the same in
// every attempt), otherwise a fresh one.
std::string NewJobRunId();

// For a restarted rank without --resume: sets --resume (and clears
// --overwrite_checkpoints) when --checkpoint_dir holds a complete checkpoint
// of this job's run, or --overwrite_checkpoints when it holds only the
// failed attempts' interrupted saves (or the checkpoints the first attempt
// was told to overwrite). Returns a note for the log; nullopt when there
// is nothing to say. Fails when it cannot tell whose the checkpoints are.
absl::StatusOr<std::optional<std::string>> ContinueAfterRestart(int restart_count);

// The training step this process is in, for the rank's error file (the
// launcher tells a failure that repeats from one that does not by its step
// and message); nullopt before the first step.
void NoteStepInProgress(int64_t step);
std::optional<int64_t> StepInProgress();

// TORCHELASTIC_RESTART_COUNT: 0 in the job's first attempt, or without a
// launcher that restarts.
int RestartCount();

// In the job's first attempt only (TORCHELASTIC_RESTART_COUNT unset or 0),
// the last rank kills itself with SIGKILL as --TEST_kill_at_step begins.
void MaybeKillForTest(int step, int rank, int world_size);

}  // namespace train_gpt

#endif  // FSDP_MODELS_TRAIN_GPT_RESTART_H_
