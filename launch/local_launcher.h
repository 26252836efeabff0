// Starts the ranks of a job as processes on this host, torchrun-style, and
// reports how each ended; for a job across hosts, one launcher runs on
// each host and the launchers act as one.
//
// The launcher serves the rendezvous store itself (a c10d TCPStore) and
// gives every rank the variables torchrun's agent sets: RANK, LOCAL_RANK,
// ROLE_RANK, GROUP_RANK (the node), WORLD_SIZE, LOCAL_WORLD_SIZE,
// ROLE_WORLD_SIZE, GROUP_WORLD_SIZE (the nodes), ROLE_NAME=default,
// MASTER_ADDR (127.0.0.1 on one host), MASTER_PORT,
// TORCHELASTIC_USE_AGENT_STORE=True, TORCHELASTIC_RESTART_COUNT (0, then
// 1, 2, ... on restarts), TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID
// (the same on every node and every restart), TORCHELASTIC_ERROR_FILE (a
// file per rank and attempt: launch/error_file.h) and
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
//
// Restarts (max_restarts > 0; torchrun's --max-restarts): when the job
// fails — a rank exits non-zero or dies, is killed for hanging past its
// collectives' timeout, a node is lost — every rank of the job has already
// been stopped as above; the launcher then waits a back-off (restart_backoff,
// doubled after each restart, at most 60 s) and starts every rank again,
// with TORCHELASTIC_RESTART_COUNT one higher: a program that checkpoints
// resumes from its last complete checkpoint (the main job does). Across
// hosts node 0's launcher decides for all, after every node has reported,
// and every launcher restarts its ranks; a host that does not come back
// within join_timeout fails the job. No restart when the launcher was
// interrupted, the timeout (the whole job's, restarts included) has passed,
// max_restarts are used up, or the failure is deterministic: the earliest
// failed rank's error file says the same step and message as it did in
// each of the repeated_failure_limit - 1 attempts before. When the last
// restart fails as every attempt before it did (two at least), the result
// says so too. A failure whose rank wrote no error file (a rank killed by
// a signal) is never taken for deterministic. Restarts, with their causes,
// are in the result.
#ifndef FSDP_LAUNCH_LOCAL_LAUNCHER_H_
#define FSDP_LAUNCH_LOCAL_LAUNCHER_H_

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "launch/error_file.h"

namespace fsdp {

// One restart of the job: its number (TORCHELASTIC_RESTART_COUNT), why the
// attempt before it failed, and the back-off waited before it.
struct JobRestart {
  int count = 0;
  std::string cause;
  std::chrono::milliseconds backoff{0};
};

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

  // Restarts (see the top of this file); 0: a failure ends the job.
  int max_restarts = 0;
  std::chrono::milliseconds restart_backoff = std::chrono::seconds(1);
  int repeated_failure_limit = 3;  // At least 2.
  // Called before each restart's back-off.
  std::function<void(const JobRestart&)> on_restart;
  // TORCHELASTIC_RUN_ID; empty: 16 random hex digits, node 0's on every
  // node.
  std::string run_id;
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
  // What a rank that failed on its own wrote to its error file, if it did.
  std::optional<RankError> error;
  // Wall clock (ns) of the launcher's last look that found the rank still
  // running, once it has ended: it ended after that, and the failures it
  // caused in its peers later still, so that a failure that wrote no error
  // file (a rank killed by a signal) is ordered before them. Clocks of
  // different hosts are compared as they are.
  int64_t ended_at_ns = 0;

  bool ok() const { return ending == Ending::kExited && code == 0; }
  // "rank 2 was killed: it did not finish within the job timeout", then
  // ": " and the first line of its error file's message when it wrote one.
  std::string Describe() const;
  std::string EndingText() const;  // The same without the error file's message.
};

struct LaunchResult {
  std::vector<RankOutcome> ranks;  // This host's, indexed by local rank.
  // The first signal the launcher received and forwarded; 0 if none.
  int forwarded_signal = 0;
  // Across hosts: what went wrong elsewhere, as this launcher learned it
  // ("node 1: rank 3 exited with code 1", a launcher that sent no report,
  // the store lost). Empty on one host.
  std::vector<std::string> other_nodes_failures;
  // The restarts made before the last attempt, whose ranks these are.
  std::vector<JobRestart> restarts;
  // Why a failed job was not restarted again, when restarts were allowed
  // ("all 2 restarts were used", "the same failure (...) ended the last 3
  // attempts: it is deterministic, ...").
  std::string no_restart;

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

// How a program that is its own launcher runs itself (LaunchSelfAndReport).
struct SelfLaunch {
  int world_size = 1;
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  int max_restarts = 0;
  std::chrono::milliseconds restart_backoff = std::chrono::seconds(1);
};
// For a program that is its own launcher (the main jobs): runs
// `launch.world_size` copies of the current executable on this host with
// argv[1:], restarting the job as `launch` says, reports on stdout and
// stderr under `program_name` (the pid of each rank first, each restart and
// its cause), and returns main()'s exit code: 0 when every rank succeeded,
// 1 when one failed (each failure named), 2 when the job could not start,
// 128 + the signal when the launcher was interrupted.
int LaunchSelfAndReport(int argc, char** argv, const SelfLaunch& launch,
                        const std::string& program_name);

// The same for any program: runs `options` (its on_started and on_restart
// are replaced) and reports as above.
int LaunchAndReport(LocalLaunchOptions options, const std::string& program_name);

}  // namespace fsdp

#endif  // FSDP_LAUNCH_LOCAL_LAUNCHER_H_
