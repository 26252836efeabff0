// Starts the ranks of a job as processes on this host, torchrun-style, and
// reports how each ended.
//
// The launcher serves the rendezvous store itself (a c10d TCPStore) and
// gives every rank the variables torchrun's agent sets for a single-node job:
// RANK, LOCAL_RANK, ROLE_RANK, GROUP_RANK=0, WORLD_SIZE, LOCAL_WORLD_SIZE,
// ROLE_WORLD_SIZE, GROUP_WORLD_SIZE=1, ROLE_NAME=default,
// MASTER_ADDR=127.0.0.1, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True,
// TORCHELASTIC_RESTART_COUNT=0, TORCHELASTIC_MAX_RESTARTS=0,
// TORCHELASTIC_RUN_ID=none and TORCH_NCCL_ASYNC_ERROR_HANDLING (kept if set,
// else 1). A rank of ours builds its group with
// CreateGlooCollectivesFromEnvironment (rendezvous.h); a Python rank's
// init_process_group("gloo") finds the same store through env://. Unlike
// torchrun, which defaults OMP_NUM_THREADS to 1, each rank gets
// max(1, cores / world_size) intra-op threads unless the launcher's
// environment sets OMP_NUM_THREADS.
//
// Nothing is left behind: when a rank fails, the others get `failure_grace`
// to end on their own (their collectives fail within their timeout and they
// report why) and are then killed; at `timeout` every rank still running is
// killed; ranks die with the launcher (PR_SET_PDEATHSIG). SIGINT, SIGTERM,
// SIGHUP and SIGQUIT sent to the launcher while it waits are forwarded to
// every rank (each rank is its own process group, so a terminal's Ctrl-C
// reaches the launcher only); ranks still running `failure_grace` later are
// killed. The handlers are process-wide: run one launch at a time.
#ifndef FSDP_COMM_LOCAL_LAUNCHER_H_
#define FSDP_COMM_LOCAL_LAUNCHER_H_

#include <chrono>
#include <functional>
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
  // Called once every rank has started, with each rank's pid (by rank).
  std::function<void(const std::vector<int>&)> on_started;
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
  int pid = 0;

  bool ok() const { return ending == Ending::kExited && code == 0; }
  // "rank 2 was killed: it did not finish within 30000 ms".
  std::string Describe() const;
};

struct LaunchResult {
  std::vector<RankOutcome> ranks;  // Indexed by rank.
  // The first signal the launcher received and forwarded; 0 if none.
  int forwarded_signal = 0;

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
// stderr under `program_name` (the pid of each rank first), and returns
// main()'s exit code: 0 when every rank succeeded, 1 when one failed (each
// failure named), 2 when the job could not start, 128 + the signal when the
// launcher was interrupted.
int LaunchSelfAndReport(int argc, char** argv, int world_size,
                        std::chrono::milliseconds timeout, const std::string& program_name);

// The same for any program: runs `options` (its on_started is replaced) and
// reports as above.
int LaunchAndReport(LocalLaunchOptions options, const std::string& program_name);

}  // namespace fsdp

#endif  // FSDP_COMM_LOCAL_LAUNCHER_H_
