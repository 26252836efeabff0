// The project's main job: a small GPT language model trained with FSDP
// (one unit per transformer block) across W local processes on a byte-level
// corpus the program generates, printing the loss as it falls.
//
//   bazel run //models:train_gpt -- --world_size=2 --steps=400
//
// Run without launcher variables it launches --world_size copies of itself
// (launch/local_launcher.h); under torchrun or srun it is one rank of their
// job. Every rank draws the same global batch of
// world_size * batch_size sequences and trains on its slice, so the run
// matches single-process training on the global batch.
//
// The job is a library (//models:train_gpt_job): flags (train_gpt_flags.h)
// -> settings (train_gpt_checks.h, train_gpt_config.h) -> the start, where
// everything that can be refused is (train_gpt_start.h) -> a rank's run
// (train_gpt_run.h). This file only strings them together.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status.h"
#include "comm/launch_environment.h"
#include "launch/error_file.h"
#include "launch/local_launcher.h"
#include "models/train_gpt_checks.h"
#include "models/train_gpt_flags.h"
#include "models/train_gpt_restart.h"
#include "models/train_gpt_run.h"
#include "models/train_gpt_start.h"
#include "policies/registry.h"

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_list_policies)) {
    absl::StatusOr<std::unique_ptr<fsdp::WrapPolicy>> policy = train_gpt::BuildWrapPolicy();
    for (const auto& entry : fsdp::PolicyRegistry::Global().List()) {
      std::printf("%-10s %s (%s)\n", entry.name.c_str(), entry.help.c_str(),
                  entry.origin.c_str());
    }
    if (!policy.ok()) return train_gpt::Refuse({policy.status().ToString()});
    return 0;
  }
  absl::StatusOr<fsdp::LaunchEnvironment> env = fsdp::ReadLaunchEnvironment();
  const bool launcher = absl::IsNotFound(env.status());
  if (!launcher && !env.ok()) return train_gpt::Refuse({env.status().ToString()});
  std::variant<int, train_gpt::JobStart> started =
      train_gpt::StartJob(launcher ? std::nullopt : std::optional<fsdp::LaunchEnvironment>(*env));
  if (const int* refused = std::get_if<int>(&started)) return *refused;
  train_gpt::JobStart& job = std::get<train_gpt::JobStart>(started);
  if (launcher) {
    const unsigned cores = std::thread::hardware_concurrency();
    if (cores > 0 && static_cast<unsigned>(job.world_size) > 2 * cores) {
      std::fprintf(stderr,
                   "train_gpt: warning: --world_size=%d is far above this host's %u cores: the "
                   "ranks will time-share them, slowly, and collectives may reach "
                   "--collective_timeout_s\n",
                   job.world_size, cores);
    }
    for (const std::string& note : job.notes) std::printf("note: %s\n", note.c_str());
    std::fflush(stdout);
    fsdp::SelfLaunch launch;
    launch.world_size = job.world_size;
    launch.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s));
    launch.max_restarts = absl::GetFlag(FLAGS_max_restarts);
    // Checked >= 0; back-offs are cut to 60 s.
    launch.restart_backoff = std::chrono::milliseconds(
        static_cast<int64_t>(std::min(absl::GetFlag(FLAGS_restart_backoff_s), 60.0) * 1000));
    return fsdp::LaunchSelfAndReport(argc, argv, launch, "train_gpt");
  }
  // Under its own launcher, which printed them, rank 0 shares the
  // launcher's locks; a restarted rank's notes are new.
  const bool noted = !job.locks.empty() && job.locks.front().shared_with_parent() &&
                     env->restart_count == 0;
  try {
    return train_gpt::RunRank(*env, job.options, *job.policy,
                              noted ? std::vector<std::string>() : job.notes);
  } catch (...) {
    const std::string message =
        fsdp::PrintableText(fsdp::StatusFromCurrentException().message());
    std::fprintf(stderr, "train_gpt rank %d: %s\n", env->rank, message.c_str());
    // The launcher tells a failure that repeats from one that does not by
    // its step and message.
    fsdp::WriteRankErrorFile(message, train_gpt::StepInProgress());
    return 1;
  }
}
