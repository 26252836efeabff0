// Starts the ranks of a job as processes on this host, torchrun-style, and
// reports how each ended; for a job across hosts, one launcher runs on
// each host and the launchers act as one.
//
// The launcher serves the rendezvous store itself (a c10d TCPStore) and
// gives every rank the variables torchrun's agent sets: RANK, LOCAL_RANK,
// ROLE_RANK, GROUP_RANK (the node), WORLD_SIZE, LOCAL_WORLD_SIZE,
// ROLE_WORLD_SIZE, GROUP_WORLD_SIZE (the nodes), ROLE_NAME=default,
// MASTER_ADDR (127.0.0.1 on one host), MASTER_PORT,
// TORCHELASTIC_USE_AGENT_STORE=True, TORCHELASTIC_RESTART_COUNT=0,
// TORCHELASTIC_MAX_RESTARTS=0, TORCHELASTIC_RUN_ID=none and
// TORCH_NCCL_ASYNC_ERROR_HANDLING (kept if set, else 1). A rank of ours
// builds its group with CreateGlooCollectivesFromEnvironment
// (rendezvous.h); a Python rank's init_process_group("gloo") finds the same
// store through env://. Unlike torchrun, which defaults OMP_NUM_THREADS to
// 1, each rank gets max(1, cores / nproc_per_node) intra-op threads unless
// the launcher's environment sets OMP_NUM_THREADS.
//
// Nothing is left behind: when a rank fails, the others get `failure_grace`
// to end on their own (their collectives fail within their timeout and they
// report why) and are then killed; at `timeout` every rank still running is
// killed; ranks die with the launcher (PR_SET_PDEATHSIG). SIGINT, SIGTERM,
// SIGHUP and SIGQUIT sent to the launcher while it waits are forwarded to
// every rank (each rank is its own process group, so a terminal's Ctrl-C
// reaches the launcher only); ranks still running `failure_grace` later are
// killed. The handlers are process-wide: run one launch at a time.
//
// Across hosts (nnodes > 1), as torchrun's static rendezvous
// (--nnodes --node-rank --master-addr --master-port): every host's
// launcher gets the same nnodes and nproc_per_node and its own node_rank;
// node 0's launcher serves the store at master_port on every interface and
// the others reach it at master_addr:master_port. Node k runs ranks
// k * nproc_per_node ... (k + 1) * nproc_per_node - 1. Through the store
// the launchers
//   - join before any rank starts: a node rank taken twice, or nodes that
//     disagree on nnodes or nproc_per_node, fail every launcher that sees
//     it; nodes that do not join within `join_timeout` are named;
//   - pass failures on: a rank that fails, or a signal a launcher forwards,
//     is reported to every other launcher within about 100 ms, and each
//     gives its own ranks `failure_grace` from then. A lost host counts as
//     failed too: node 0's launcher hears every other launcher's heartbeat
//     (each second) and reports a node silent for `node_timeout` whose
//     ranks had not all ended; a launcher whose store stops answering (its
//     host cut off, node 0 gone) counts that as a failure;
//   - finish together: node 0's launcher serves the store until every
//     launcher has reported how its ranks ended (at most
//     `exit_barrier_timeout` after its own ranks ended, or `failure_grace`
//     plus 10 s once a failure is known; a signal that arrives while it
//     waits ends the wait, and fails the job) and then reports the whole
//     job. A node that was taken for lost reports it even if its ranks
//     succeeded.
#ifndef FSDP_LAUNCH_LOCAL_LAUNCHER_H_
#define FSDP_LAUNCH_LOCAL_LAUNCHER_H_

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace fsdp {

struct LocalLaunchOptions {
  int nproc_per_node = 2;         // Ranks on this host.
  std::string program;            // Path of the executable every rank runs.
  std::vector<std::string> args;  // Its arguments (argv[1:]).
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  std::chrono::milliseconds failure_grace = std::chrono::seconds(10);
  // Rank r's stdout and stderr go to <log_dir>/rank_<r>.log; with no
  // log_dir, the ranks write to the launcher's stdout and stderr.
  std::string log_dir;
  std::vector<std::pair<std::string, std::string>> extra_env;
  std::vector<std::string> unset_env;  // Removed from the ranks' environment.
  // Called once every rank of this host has started, with each rank's pid
  // (by local rank).
  std::function<void(const std::vector<int>&)> on_started;

  // A job across hosts (see the top of this file); nnodes == 1 runs on this
  // host alone, with the store on a free port and MASTER_ADDR=127.0.0.1.
  // The timeouts must be positive, node_timeout at least 3 s (heartbeats
  // come each second).
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;  // How every host reaches node 0's launcher.
  int master_port = 29500;
  std::chrono::milliseconds join_timeout = std::chrono::minutes(5);
  std::chrono::milliseconds exit_barrier_timeout = std::chrono::minutes(5);
  std::chrono::milliseconds node_timeout = std::chrono::seconds(30);
};

struct RankOutcome {
  enum class Ending {
    kExited,                  // `code` is the exit status.
    kSignaled,                // `code` is the signal that ended it.
    kKilledAtTimeout,         // Still running at the job timeout.
    kKilledAfterPeerFailure,  // Still running `failure_grace` after a failure
                              // (a rank's, a signal, another node's).
  };
  int rank = 0;  // In the whole job.
  Ending ending = Ending::kExited;
  int code = 0;
  std::string log_path;  // Empty without LocalLaunchOptions::log_dir.
  int pid = 0;

  bool ok() const { return ending == Ending::kExited && code == 0; }
  // "rank 2 was killed: it did not finish within 30000 ms".
  std::string Describe() const;
};

struct LaunchResult {
  std::vector<RankOutcome> ranks;  // This host's, indexed by local rank.
  // The first signal the launcher received and forwarded; 0 if none.
  int forwarded_signal = 0;
  // Across hosts: what went wrong elsewhere, as this launcher learned it
  // ("node 1: rank 3 exited with code 1", a launcher that sent no report,
  // the store lost). Empty on one host.
  std::vector<std::string> other_nodes_failures;

  bool ok() const;  // Every rank of this host succeeded, and no other node failed.
  std::vector<int> FailedRanks() const;  // Of this host, by rank.
  // One line per rank that did not succeed, each followed by the last
  // `log_tail_bytes` of its log when there is one, then the other nodes'
  // failures; "" when ok().
  std::string Summary(size_t log_tail_bytes = 2000) const;
};

// Fails (kInvalidArgument, kUnavailable) only when the job cannot be started;
// how the ranks ended is in the result.
absl::StatusOr<LaunchResult> LaunchLocalRanks(const LocalLaunchOptions& options);

// For a program that is its own launcher (the main jobs): runs `world_size`
// copies of the current executable on this host with argv[1:], reports on stdout and
// stderr under `program_name` (the pid of each rank first), and returns
// main()'s exit code: 0 when every rank succeeded, 1 when one failed (each
// failure named), 2 when the job could not start, 128 + the signal when the
// launcher was interrupted.
int LaunchSelfAndReport(int argc, char** argv, int world_size, std::chrono::milliseconds timeout,
                        const std::string& program_name);

// The same for any program: runs `options` (its on_started is replaced) and
// reports as above.
int LaunchAndReport(LocalLaunchOptions options, const std::string& program_name);

}  // namespace fsdp

#endif  // FSDP_LAUNCH_LOCAL_LAUNCHER_H_
