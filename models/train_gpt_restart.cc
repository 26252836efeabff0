#include "models/train_gpt_restart.h"

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "models/train_gpt_flags.h"
#include "optim/run_checkpoints.h"

namespace train_gpt {
namespace {

std::atomic<int64_t> g_step_in_progress{0};

bool IsOurRunId(const std::string& id) {
  if (id.size() != 16) return false;
  for (char c : id) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

std::string LauncherRunId() {
  const char* id = std::getenv("TORCHELASTIC_RUN_ID");
  return id != nullptr && IsOurRunId(id) ? std::string(id) : std::string();
}

}  // namespace

std::string NewJobRunId() {
  const std::string id = LauncherRunId();
  return id.empty() ? fsdp::NewRunId() : id;
}

absl::StatusOr<std::optional<std::string>> ContinueAfterRestart(int restart_count) {
  const std::string dir = absl::GetFlag(FLAGS_checkpoint_dir);
  const std::string restart = absl::StrCat("restart ", restart_count, ": ");
  if (absl::GetFlag(FLAGS_resume)) return std::nullopt;  // The same as the first attempt.
  if (dir.empty()) {
    return restart + "no --checkpoint_dir, so the job starts again from step 1";
  }
  absl::StatusOr<std::vector<fsdp::StepCheckpoint>> steps = fsdp::ListStepCheckpoints(dir);
  if (!steps.ok()) return steps.status();
  const std::string ours = LauncherRunId();
  // Without --overwrite_checkpoints the first attempt refused a directory
  // holding any checkpoint, so whatever is complete there now is this
  // job's; with it, only the run id tells.
  const bool overwrite = absl::GetFlag(FLAGS_overwrite_checkpoints);
  const fsdp::StepCheckpoint* newest = nullptr;
  const fsdp::StepCheckpoint* other_run = nullptr;  // Only with overwrite.
  for (const fsdp::StepCheckpoint& step : *steps) {
    if (step.state != fsdp::StepCheckpoint::State::kComplete) continue;
    if (overwrite && ours.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--checkpoint_dir=", dir, ": restart ", restart_count, " cannot tell whether ",
          step.path, " is this job's or the one --overwrite_checkpoints replaces: the "
          "launcher's TORCHELASTIC_RUN_ID is not fsdp_launch's; resume by hand with --resume"));
    }
    (!overwrite || step.run_id == ours ? newest : other_run) = &step;
  }
  if (newest != nullptr && other_run != nullptr) {
    // The first attempt died before the old run's checkpoints were removed;
    // --resume refuses a directory of two runs, and starting over would
    // lose this job's.
    return absl::FailedPreconditionError(absl::StrCat(
        "--checkpoint_dir=", dir, ": restart ", restart_count, " finds complete checkpoints of "
        "this job (newest ", newest->path, ") and of the run --overwrite_checkpoints replaces (",
        other_run->path, "); remove the other run's and resume with --resume"));
  }
  if (newest != nullptr) {
    absl::SetFlag(&FLAGS_resume, true);
    absl::SetFlag(&FLAGS_overwrite_checkpoints, false);
    return absl::StrCat(restart, "resuming from ", newest->path, " (step ", newest->step, ")");
  }
  if (!steps->empty()) absl::SetFlag(&FLAGS_overwrite_checkpoints, true);
  return restart + "no complete checkpoint of this job yet, so it starts again from step 1";
}

void NoteStepInProgress(int64_t step) { g_step_in_progress.store(step); }

std::optional<int64_t> StepInProgress() {
  const int64_t step = g_step_in_progress.load();
  return step > 0 ? std::optional<int64_t>(step) : std::nullopt;
}

int RestartCount() {
  const char* count = std::getenv("TORCHELASTIC_RESTART_COUNT");
  int parsed = 0;
  return count != nullptr && absl::SimpleAtoi(count, &parsed) ? parsed : 0;
}

void MaybeKillForTest(int step, int rank, int world_size) {
  if (step != absl::GetFlag(FLAGS_TEST_kill_at_step) || rank != world_size - 1) return;
  if (RestartCount() != 0) return;
  std::printf("rank %d: killing itself at step %d (--TEST_kill_at_step)\n", rank, step);
  std::fflush(stdout);
  std::raise(SIGKILL);
}

}  // namespace train_gpt
