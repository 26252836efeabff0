// Starting one rank of a local launch as its own process: the environment
// torchrun's agent would give it (the variables listed in local_launcher.h,
// on top of the launcher's own environment less unset_env and any stale
// launcher variables, then extra_env), its own process group, and death
// with the launcher. Private to the local_launcher target; apart from
// local_launcher.cc so that what one rank process gets can be read, and
// changed, without the launchers' coordination around it.
#ifndef FSDP_LAUNCH_RANK_PROCESS_H_
#define FSDP_LAUNCH_RANK_PROCESS_H_

#include <sys/types.h>

#include <string>

#include "absl/status/statusor.h"
#include "launch/local_launcher.h"

namespace fsdp {

// What differs between the attempts of a job that restarts.
struct RankAttempt {
  int restart_count = 0;   // TORCHELASTIC_RESTART_COUNT.
  std::string run_id;      // TORCHELASTIC_RUN_ID.
  std::string error_file;  // TORCHELASTIC_ERROR_FILE.
};

// Forks and execs `options.program` as local rank `local_rank` of
// `attempt`, with MASTER_PORT=`port` and its stdout and stderr in `log_path`
// (inherited when empty); returns its pid, which is also its process group. Fails
// (kUnavailable) when the log cannot be created or fork fails; a failed
// exec shows as the rank exiting with code 127.
absl::StatusOr<pid_t> StartRank(const LocalLaunchOptions& options, int local_rank, int port,
                                const std::string& log_path, const RankAttempt& attempt);

}  // namespace fsdp

#endif  // FSDP_LAUNCH_RANK_PROCESS_H_
