// Starts the ranks of a job as processes on this host, torchrun-style, and
// reports how each ended.
//
// The launcher serves the rendezvous store itself and gives every rank RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1,
// MASTER_PORT and TORCHELASTIC_USE_AGENT_STORE=True, so a rank builds its
// group with CreateGlooCollectivesFromEnvironment (rendezvous.h). Unless the
// launcher's environment sets OMP_NUM_THREADS, each rank gets
// max(1, cores / world_size) intra-op threads.
//
// Nothing is left behind: when a rank fails, the others get `failure_grace`
// to end on their own (their collectives fail within their timeout and they
// report why) and are then killed; at `timeout` every rank still running is
// killed; ranks die with the launcher (PR_SET_PDEATHSIG).
#ifndef FSDP_COMM_LOCAL_LAUNCHER_H_
#define FSDP_COMM_LOCAL_LAUNCHER_H_

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace fsdp {

struct LocalLaunchOptions {
  int world_size = 2;
  std::string program;            // Path of the executable every rank runs.
  std::vector<std::string> args;  // Its arguments (argv[1:]).
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  std::chrono::milliseconds failure_grace = std::chrono::seconds(10);
  // Rank r's stdout and stderr go to <log_dir>/rank_<r>.log; with no
  // log_dir, the ranks write to the launcher's stdout and stderr.
  std::string log_dir;
  std::vector<std::pair<std::string, std::string>> extra_env;
  std::vector<std::string> unset_env;  // Removed from the ranks' environment.
};

struct RankOutcome {
  enum class Ending {
    kExited,               // `code` is the exit status.
    kSignaled,             // `code` is the signal that ended it.
    kKilledAtTimeout,      // Still running at the job timeout.
    kKilledAfterPeerFailure,  // Still running `failure_grace` after a failure.
  };
  int rank = 0;
  Ending ending = Ending::kExited;
  int code = 0;
  std::string log_path;  // Empty without LocalLaunchOptions::log_dir.

  bool ok() const { return ending == Ending::kExited && code == 0; }
  // "rank 2 was killed: it did not finish within 30000 ms".
  std::string Describe() const;
};

struct LaunchResult {
  std::vector<RankOutcome> ranks;  // Indexed by rank.

  bool ok() const;
  std::vector<int> FailedRanks() const;
  // One line per rank that did not succeed, each followed by the last
  // `log_tail_bytes` of its log when there is one; "" when ok().
  std::string Summary(size_t log_tail_bytes = 2000) const;
};

// Fails (kInvalidArgument, kUnavailable) only when the job cannot be started;
// how the ranks ended is in the result.
absl::StatusOr<LaunchResult> LaunchLocalRanks(const LocalLaunchOptions& options);

// For a program that is its own launcher (the main jobs): runs `world_size`
// copies of the current executable with argv[1:], reports on stdout and
// stderr under `program_name`, and returns main()'s exit code: 0 when every
// rank succeeded, 1 when one failed (each failure named, with the tail of
// its output), 2 when the job could not start.
int LaunchSelfAndReport(int argc, char** argv, int world_size,
                        std::chrono::milliseconds timeout, const std::string& program_name);

}  // namespace fsdp

#endif  // FSDP_COMM_LOCAL_LAUNCHER_H_
