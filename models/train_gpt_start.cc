#include "models/train_gpt_start.h"

#include <cstdio>
#include <optional>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "launch/error_file.h"
#include "models/train_gpt_checks.h"
#include "models/train_gpt_config.h"
#include "models/train_gpt_flags.h"
#include "models/train_gpt_restart.h"
#include "optim/run_checkpoints.h"

namespace train_gpt {

int Refuse(const std::vector<std::string>& problems, const std::string& preface) {
  if (!preface.empty()) {
    std::fprintf(stderr, "train_gpt: %s\n", fsdp::PrintableText(preface).c_str());
  }
  for (const std::string& problem : problems) {
    for (absl::string_view line : absl::StrSplit(problem, '\n')) {
      std::fprintf(stderr, "train_gpt: %s\n", fsdp::PrintableText(line).c_str());
    }
  }
  // For the launcher: a refusal that repeats in every attempt is
  // deterministic, and ends the restarts.
  fsdp::WriteRankErrorFile(absl::StrJoin(problems, "\n"), std::nullopt);
  return 2;
}

std::variant<int, JobStart> StartJob(const std::optional<fsdp::LaunchEnvironment>& env) {
  JobStart job;
  const bool launcher = !env.has_value();
  // A restarted rank continues the job's run; every rank decides alike,
  // from the same directory, since none of the failed attempt is left.
  absl::StatusOr<std::optional<std::string>> restart_note = std::nullopt;
  if (!launcher && env->restart_count > 0) restart_note = ContinueAfterRestart(env->restart_count);
  if (!restart_note.ok()) return Refuse({std::string(restart_note.status().message())});
  const bool resume = absl::GetFlag(FLAGS_resume);
  const std::optional<int> launcher_world_size =
      launcher ? std::nullopt : std::optional<int>(env->world_size);
  const auto flag_problems = [&](bool settings_pending) {
    job.world_size = launcher ? absl::GetFlag(FLAGS_world_size) : env->world_size;
    absl::StatusOr<fsdp::FsdpOptions> options = FsdpOptionsFromFlags();
    if (!options.ok()) return std::vector<std::string>{options.status().ToString()};
    return FlagProblems(options->strategy, job.world_size,
                        launcher ? job.world_size : env->local_world_size, launcher_world_size,
                        settings_pending);
  };
  // The options, the wrap policy (loading its plugin) and the placement,
  // once the settings are final: before anything is created for a new run,
  // after the checkpoint's settings are taken for a resumed one.
  const auto settle = [&]() -> std::optional<int> {
    absl::StatusOr<fsdp::FsdpOptions> options = FsdpOptionsFromFlags();
    absl::StatusOr<std::unique_ptr<fsdp::WrapPolicy>> policy = BuildWrapPolicy();
    for (const absl::Status& s : {options.status(), policy.status()}) {
      if (!s.ok()) return Refuse({s.ToString()});
    }
    job.options = *std::move(options);
    job.policy = *std::move(policy);
    if (absl::StatusOr<Placement> placement =
            ResolvePlacement(launcher ? 0 : env->local_rank,
                             launcher ? job.world_size : env->local_world_size);
        !placement.ok()) {
      return Refuse({std::string(placement.status().message())});
    }
    return std::nullopt;
  };
  if (std::vector<std::string> problems = flag_problems(/*settings_pending=*/resume);
      !problems.empty()) {
    return Refuse(problems);
  }
  if (!resume) {
    if (std::optional<int> refused = settle()) return *refused;
  }
  if (absl::Status ready = PrepareOutputs(); !ready.ok()) {
    return Refuse({std::string(ready.message())});
  }
  // The job's launcher, or its rank 0 when another launcher started it,
  // owns the output directories before anything is read or written there.
  if (launcher || env->rank == 0) {
    absl::StatusOr<std::vector<fsdp::DirectoryLock>> locks = LockOutputDirectories();
    if (!locks.ok()) return Refuse({std::string(locks.status().message())});
    job.locks = *std::move(locks);
  }
  if (absl::Status nothing = CheckExportsReplaceNothing(); !nothing.ok()) {
    return Refuse({std::string(nothing.message())});
  }
  absl::StatusOr<std::optional<fsdp::RunCheckpoints>> run =
      OpenCheckpoints(fsdp::NewRunId(), job.world_size);
  if (!run.ok()) return Refuse({std::string(run.status().message())});
  if (resume) {
    // --resume without a checkpoint to resume is refused by OpenCheckpoints.
    const fsdp::StepCheckpoint& from = *(*run)->resume_from();
    absl::StatusOr<std::vector<std::string>> notes =
        TakeSettingsFromCheckpoint(from, job.world_size, launcher_world_size);
    if (!notes.ok()) return Refuse({std::string(notes.status().message())});
    job.notes = *std::move(notes);
    if (std::vector<std::string> problems = flag_problems(/*settings_pending=*/false);
        !problems.empty()) {
      return Refuse(problems, absl::StrCat("with the settings of the checkpoint '", from.path,
                                           "' (", absl::StrJoin(job.notes, "; "), "):"));
    }
    if (std::optional<int> refused = settle()) return *refused;
  }
  if (restart_note->has_value()) job.notes.insert(job.notes.begin(), **restart_note);
  return job;
}

}  // namespace train_gpt
