#include "launch/local_launcher.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "comm/rendezvous.h"
#include "launch/forwarded_signals.h"
#include "launch/launcher_group.h"
#include "launch/rank_process.h"

namespace fsdp {
namespace {

using launch_internal::Clock;
using launch_internal::FirstForwardedSignal;
using launch_internal::ForwardedSignalScope;
using launch_internal::kHeartbeatInterval;
using launch_internal::kStoreOperationTimeout;
using launch_internal::LauncherGroup;
using launch_internal::LauncherStore;

int64_t WallClockNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Refuses options that could not start a job, or would fail it later for
// a reason the ranks' errors would not name.
absl::Status ValidateLaunchOptions(const LocalLaunchOptions& options) {
  if (options.nproc_per_node < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("launcher: nproc_per_node ", options.nproc_per_node, " must be >= 1"));
  }
  if (options.nnodes < 1 || options.node_rank < 0 || options.node_rank >= options.nnodes) {
    return absl::InvalidArgumentError(absl::StrCat("launcher: node rank ", options.node_rank,
                                                   " is not one of ", options.nnodes, " nodes"));
  }
  if (options.nnodes > 1 && options.master_addr.empty()) {
    return absl::InvalidArgumentError(
        "launcher: a job across nodes needs master_addr, the host of node 0's launcher");
  }
  if (options.nnodes > 1 && (options.master_port < 1 || options.master_port > 65535)) {
    return absl::InvalidArgumentError(
        absl::StrCat("launcher: master port ", options.master_port, " is not a TCP port"));
  }
  if (options.program.empty() || ::access(options.program.c_str(), X_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("launcher: '", options.program, "' is not an executable file"));
  }
  if (options.timeout.count() <= 0) {
    return absl::InvalidArgumentError("launcher: timeout must be positive");
  }
  if (options.max_restarts < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("launcher: max_restarts (", options.max_restarts, ") must not be negative"));
  }
  if (options.restart_backoff.count() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("launcher: restart_backoff (",
                                                   options.restart_backoff.count(),
                                                   " ms) must not be negative"));
  }
  if (options.repeated_failure_limit < 2) {
    return absl::InvalidArgumentError(absl::StrCat("launcher: repeated_failure_limit (",
                                                   options.repeated_failure_limit,
                                                   ") must be at least 2"));
  }
  if (options.nnodes > 1) {
    for (const auto& [name, value] :
         {std::pair{"join_timeout", options.join_timeout},
          std::pair{"exit_barrier_timeout", options.exit_barrier_timeout}}) {
      if (value.count() <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("launcher: ", name, " (", value.count(), " ms) must be positive"));
      }
    }
    if (options.node_timeout < 3 * kHeartbeatInterval) {
      return absl::InvalidArgumentError(
          absl::StrCat("launcher: node_timeout (", options.node_timeout.count(),
                       " ms) must span at least 3 heartbeats (",
                       std::chrono::milliseconds(3 * kHeartbeatInterval).count(), " ms)"));
    }
  }

  if (!options.log_dir.empty()) {
    struct stat info;
    if (::stat(options.log_dir.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("launcher: log directory '", options.log_dir, "' does not exist"));
    }
  }
  return absl::OkStatus();
}

// What this launcher meets its ranks and the other launchers through, for
// every attempt of the job. Destroyed in reverse: the group (whose watcher
// uses the store) first, the server (which serves the store) last.
struct LauncherRendezvous {
  std::unique_ptr<RendezvousServer> server;  // Node 0's launcher, or one host's.
  c10::intrusive_ptr<c10d::Store> store;
  int port = 0;                          // MASTER_PORT for the ranks.
  std::string run_id;                    // TORCHELASTIC_RUN_ID, node 0's.
  std::unique_ptr<LauncherGroup> group;  // Across hosts only; this attempt's.
};

std::string RandomRunId() {
  std::random_device random;
  const uint64_t id = (static_cast<uint64_t>(random()) << 32) | random();
  return absl::StrFormat("%016x", id);
}

// Serves the store (node 0, or a job on one host) or reaches node 0's; the
// run id is node 0's.
absl::StatusOr<LauncherRendezvous> ServeOrReachStore(const LocalLaunchOptions& options) {
  const bool multi_node = options.nnodes > 1;
  LauncherRendezvous met;
  met.port = options.master_port;
  met.run_id = options.run_id.empty() ? RandomRunId() : options.run_id;
  if (!multi_node || options.node_rank == 0) {
    FSDP_ASSIGN_OR_RETURN(
        met.server, RendezvousServer::Start(multi_node ? options.master_port : 0, options.timeout));
    met.port = met.server->port();
    met.store = met.server->store();
    if (multi_node) {
      try {
        LauncherStore(met.store, "the store").Set("fsdp_launch/run_id", met.run_id);
      } catch (...) {
        absl::Status cause = StatusFromCurrentException(absl::StatusCode::kUnavailable);
        return absl::Status(cause.code(), absl::StrCat("launcher of node 0: could not publish "
                                                       "the job's run id: ", cause.message()));
      }
    }
    return met;
  }
  absl::StatusOr<c10::intrusive_ptr<c10d::Store>> reached = ConnectStoreAt(
      options.master_addr, options.master_port, options.join_timeout, kStoreOperationTimeout);
  const std::string who =
      absl::StrCat("launcher of node ", options.node_rank, " of ", options.nnodes);
  if (!reached.ok()) {
    return absl::Status(reached.status().code(),
                        absl::StrCat(who, ": node 0's launcher is not there: ",
                                     reached.status().message()));
  }
  met.store = *std::move(reached);
  try {
    met.run_id = LauncherStore(met.store, "the store").Get("fsdp_launch/run_id");
  } catch (...) {
    absl::Status cause = StatusFromCurrentException(absl::StatusCode::kUnavailable);
    return absl::Status(cause.code(), absl::StrCat(who, ": could not read the job's run id: ",
                                                   cause.message()));
  }
  return met;
}

// What a launcher tells node 0 in place of its ranks' first failure when a
// restart must not follow: it was interrupted, or could not start its ranks.
constexpr char kInterrupted[] = "interrupted";
constexpr char kCannotStart[] = "cannot start";

// Each rank's error file of each attempt, in a directory of the launcher's
// own that is removed with it.
class ErrorFiles {
 public:
  static absl::StatusOr<ErrorFiles> Create() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp",
                                       "/fsdp_launch_errors.XXXXXX");
    if (::mkdtemp(pattern.data()) == nullptr) {
      return absl::UnavailableError(absl::StrCat("launcher: cannot create a directory for the "
                                                 "ranks' error files (", pattern, "): ",
                                                 std::strerror(errno)));
    }
    return ErrorFiles(pattern);
  }
  ErrorFiles(ErrorFiles&& other) noexcept : dir_(std::exchange(other.dir_, "")) {}
  ErrorFiles& operator=(ErrorFiles&&) = delete;
  ~ErrorFiles() {
    if (dir_.empty()) return;
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  std::string Of(int attempt, int rank) const {
    return absl::StrCat(dir_, "/attempt_", attempt, "_rank_", rank, ".json");
  }

 private:
  explicit ErrorFiles(std::string dir) : dir_(std::move(dir)) {}
  std::string dir_;
};

// This host's ranks from their start until each has ended, by local rank.
struct RunningRanks {
  RunningRanks(const LocalLaunchOptions& options, LauncherGroup* group, int attempt)
      : options(options),
        group(group),
        attempt(attempt),
        pids(options.nproc_per_node, -1),
        seen_running_ns(options.nproc_per_node, 0) {}

  // A failure anywhere gives the ranks still running failure_grace to end
  // on their own; a later failure does not extend it.
  void StartFailureGrace() {
    kill_after_failure = std::min(kill_after_failure, Clock::now() + options.failure_grace);
  }

  const LocalLaunchOptions& options;
  LauncherGroup* const group;  // Null on one host.
  const int attempt;           // The restart count.
  LaunchResult result;
  std::vector<pid_t> pids;  // -1 once the rank has ended.
  // Per rank: the wall clock (ns) of the last look that found it running.
  std::vector<int64_t> seen_running_ns;
  std::vector<std::string> error_files;
  int running = 0;
  Clock::time_point kill_after_failure = Clock::time_point::max();
};

// Starts every rank of this host. When one cannot start, the ranks already
// started are killed and the other launchers told, so that nothing is left
// waiting for it. A restart's logs are files of their own.
absl::Status StartLocalRanks(const LauncherRendezvous& met, const ErrorFiles& errors,
                             RunningRanks& ranks) {
  const LocalLaunchOptions& options = ranks.options;
  LaunchResult& result = ranks.result;
  std::vector<pid_t>& pids = ranks.pids;
  LauncherGroup* const group = ranks.group;
  const int nproc = options.nproc_per_node;
  for (int local = 0; local < nproc; ++local) {
    RankOutcome outcome;
    outcome.rank = options.node_rank * nproc + local;
    if (!options.log_dir.empty()) {
      outcome.log_path = absl::StrCat(
          options.log_dir, "/rank_", outcome.rank,
          ranks.attempt > 0 ? absl::StrCat(".restart_", ranks.attempt) : std::string(), ".log");
    }
    result.ranks.push_back(outcome);
    const RankAttempt attempt{ranks.attempt, met.run_id, errors.Of(ranks.attempt, outcome.rank)};
    ranks.error_files.push_back(attempt.error_file);
    absl::StatusOr<pid_t> pid = StartRank(options, local, met.port, outcome.log_path, attempt);
    if (!pid.ok()) {
      for (int started = 0; started < local; ++started) {
        ::kill(-pids[started], SIGKILL);
        ::waitpid(pids[started], nullptr, 0);
      }
      if (group != nullptr) {
        group->ReportFailure(
            absl::StrCat("its launcher could not start its ranks: ", pid.status().message()));
        group->Finish(pid.status().ToString(), /*failure_known=*/true, kCannotStart);
      }
      return pid.status();
    }
    pids[local] = *pid;
    ranks.seen_running_ns[local] = WallClockNs();
    result.ranks[local].pid = *pid;
  }
  if (options.on_started) options.on_started(std::vector<int>(pids.begin(), pids.end()));
  ranks.running = nproc;
  return absl::OkStatus();
}

// Records how each rank that ended since the last call ended, with what
// a failed one wrote to its error file; a failure starts the grace period
// and is passed on to the other launchers.
void ReapEndedRanks(RunningRanks& ranks) {
  for (int local = 0; local < ranks.options.nproc_per_node; ++local) {
    if (ranks.pids[local] < 0) continue;
    int status = 0;
    const int64_t now_ns = WallClockNs();
    const pid_t done = ::waitpid(ranks.pids[local], &status, WNOHANG);
    if (done != ranks.pids[local]) {
      ranks.seen_running_ns[local] = now_ns;
      continue;
    }
    RankOutcome& outcome = ranks.result.ranks[local];
    if (WIFSIGNALED(status)) {
      outcome.ending = RankOutcome::Ending::kSignaled;
      outcome.code = WTERMSIG(status);
    } else {
      outcome.ending = RankOutcome::Ending::kExited;
      outcome.code = WEXITSTATUS(status);
    }
    // Not the time of this look: a peer that failed because of this rank
    // may have written its error file since, and would be taken for the
    // cause.
    outcome.ended_at_ns = ranks.seen_running_ns[local];
    ranks.pids[local] = -1;
    --ranks.running;
    if (!outcome.ok()) {
      if (absl::StatusOr<RankError> said = ReadRankErrorFile(ranks.error_files[local]); said.ok()) {
        outcome.error = *std::move(said);
      }
      ranks.StartFailureGrace();
      if (ranks.group != nullptr) ranks.group->ReportFailure(outcome.Describe());
    }
  }
}

// Passes the first signal the launcher received on to every rank still
// running, once; it counts as a failure of the job.
void ForwardReceivedSignal(RunningRanks& ranks) {
  LaunchResult& result = ranks.result;
  if (FirstForwardedSignal() == 0 || result.forwarded_signal != 0) return;
  result.forwarded_signal = FirstForwardedSignal();
  for (int local = 0; local < ranks.options.nproc_per_node; ++local) {
    if (ranks.pids[local] >= 0) ::kill(-ranks.pids[local], result.forwarded_signal);
  }
  ranks.StartFailureGrace();
  if (ranks.group != nullptr) {
    ranks.group->ReportFailure(absl::StrCat("its launcher was interrupted by signal ",
                                            result.forwarded_signal, " (",
                                            strsignal(result.forwarded_signal), ")"));
  }
}

// Kills every rank still running, each recorded as ended by `ending`.
void KillRunningRanks(RunningRanks& ranks, RankOutcome::Ending ending) {
  for (int local = 0; local < ranks.options.nproc_per_node; ++local) {
    if (ranks.pids[local] < 0) continue;
    ::kill(-ranks.pids[local], SIGKILL);  // The rank's whole process group.
    ::waitpid(ranks.pids[local], nullptr, 0);
    ranks.result.ranks[local].ending = ending;
    ranks.result.ranks[local].code = SIGKILL;
    ranks.pids[local] = -1;
    if (ranks.group != nullptr) ranks.group->ReportFailure(ranks.result.ranks[local].Describe());
  }
}

// Polls the ranks until every one has ended, or kills the rest at the job's
// deadline or once the grace after a failure runs out.
void WatchRanks(RunningRanks& ranks, Clock::time_point deadline) {
  while (ranks.running > 0) {
    ReapEndedRanks(ranks);
    if (ranks.running == 0) break;
    ForwardReceivedSignal(ranks);
    if (ranks.group != nullptr && ranks.group->OtherNodeFailed()) ranks.StartFailureGrace();
    const Clock::time_point now = Clock::now();
    if (now >= deadline || now >= ranks.kill_after_failure) {
      KillRunningRanks(ranks, now >= deadline ? RankOutcome::Ending::kKilledAtTimeout
                                              : RankOutcome::Ending::kKilledAfterPeerFailure);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// The earliest failure of an attempt's ranks, as the launchers pass it to
// node 0: "<ns>\x1f<step or empty>\x1f<rank>\x1f<1: the rank wrote it>\x1f<node>\x1f
// <message>", or one of the words above.

struct FirstError {
  int64_t timestamp_ns = 0;
  std::string step;  // Empty when the rank did not say.
  int rank = -1;
  bool written = true;  // By the rank; otherwise how it ended, as the launcher saw it.
  int node = -1;        // Across hosts: the node it ran on.
  std::string message;

  std::string Encode() const {
    return absl::StrCat(timestamp_ns, "\x1f", step, "\x1f", rank, "\x1f", written ? 1 : 0,
                        "\x1f", node, "\x1f", message);
  }
  static std::optional<FirstError> Decode(const std::string& text) {
    std::vector<std::string> parts = absl::StrSplit(text, absl::MaxSplits('\x1f', 5));
    FirstError error;
    if (parts.size() != 6 || !absl::SimpleAtoi(parts[0], &error.timestamp_ns) ||
        !absl::SimpleAtoi(parts[2], &error.rank) || !absl::SimpleAtoi(parts[4], &error.node)) {
      return std::nullopt;
    }
    error.step = parts[1];
    error.written = parts[3] == "1";
    error.message = parts[5];
    return error;
  }
  // What must repeat for a failure to be deterministic; empty when nothing
  // tells (a rank killed by a signal twice may have met two different
  // faults).
  std::string Signature() const {
    return written ? absl::StrCat(step, "\x1f", message) : std::string();
  }
  std::string Describe() const {
    const std::string line = message.substr(0, message.find('\n'));
    return absl::StrCat(node >= 0 ? absl::StrCat("node ", node, ": ") : std::string(),
                        written ? absl::StrCat("rank ", rank) : std::string(),
                        step.empty() ? "" : absl::StrCat(" at step ", step),
                        written ? ": " : "", line.substr(0, 500));
  }
};

// `node`: -1 on one host.
std::string FirstErrorOf(const LaunchResult& result, int node) {
  if (result.forwarded_signal != 0) return kInterrupted;
  std::optional<FirstError> first;
  for (const RankOutcome& r : result.ranks) {
    // A rank that ended on its own without saying why (killed by a signal,
    // an exit without an error file) is a failure as of when it ended;
    // the ranks the launcher killed for another's are not.
    std::optional<FirstError> error;
    if (r.error.has_value()) {
      // A file that gives no time counts as written when the rank ended.
      error = FirstError{r.error->timestamp_ns != 0 ? r.error->timestamp_ns : r.ended_at_ns,
                         r.error->step ? std::to_string(*r.error->step) : std::string(), r.rank,
                         /*written=*/true, node, r.error->message};
    } else if (!r.ok() && (r.ending == RankOutcome::Ending::kExited ||
                           r.ending == RankOutcome::Ending::kSignaled)) {
      error = FirstError{r.ended_at_ns, "", r.rank, /*written=*/false, node, r.EndingText()};
    }
    if (error && (!first || error->timestamp_ns < first->timestamp_ns)) first = error;
  }
  return first.has_value() ? first->Encode() : "";
}

// Tells the other launchers how this host's ranks ended, and records what
// failed elsewhere.
void FinishWithOtherLaunchers(LauncherGroup& group, int node, LaunchResult& result) {
  // The ranks that failed on their own first: the cause, then the
  // ranks killed for it.
  std::vector<std::string> failed, killed;
  for (const RankOutcome& r : result.ranks) {
    if (r.ok()) continue;
    const bool was_killed = r.ending == RankOutcome::Ending::kKilledAtTimeout ||
                            r.ending == RankOutcome::Ending::kKilledAfterPeerFailure;
    (was_killed ? killed : failed).push_back(r.Describe());
  }
  failed.insert(failed.end(), killed.begin(), killed.end());
  if (result.forwarded_signal != 0) {
    failed.insert(failed.begin(), absl::StrCat("its launcher was interrupted by signal ",
                                               result.forwarded_signal));
  }
  result.other_nodes_failures = group.Finish(absl::StrJoin(failed, "; "),
                                             /*failure_known=*/!failed.empty(),
                                             FirstErrorOf(result, node));
}

// Whether a failed attempt is followed by a restart: "" when it is,
// otherwise why not. `errors` are the nodes' FirstErrorOf; `cause` is set
// to the failure's description either way.
std::string WhyNoRestart(const LocalLaunchOptions& options, int attempt, const LaunchResult& result,
                         const std::vector<std::string>& errors, Clock::time_point deadline,
                         std::vector<std::string>& signatures, std::string& cause) {
  std::optional<FirstError> first;
  bool interrupted = FirstForwardedSignal() != 0;
  bool cannot_start = false;
  for (const std::string& text : errors) {
    if (text == kInterrupted) interrupted = true;
    if (text == kCannotStart) cannot_start = true;
    std::optional<FirstError> error = FirstError::Decode(text);
    if (error && (!first || error->timestamp_ns < first->timestamp_ns)) first = error;
  }
  cause = first ? first->Describe() : absl::StrJoin(absl::StrSplit(result.Summary(0), '\n',
                                                                   absl::SkipEmpty()),
                                                    "; ");
  signatures.push_back(first ? first->Signature() : "");
  if (interrupted || result.forwarded_signal != 0) return "the launcher was interrupted";
  if (cannot_start) return "a launcher could not start its ranks";
  // How many attempts in a row ended the way this one did.
  size_t repeats = 0;
  while (!signatures.back().empty() && repeats < signatures.size() &&
         signatures[signatures.size() - 1 - repeats] == signatures.back()) {
    ++repeats;
  }
  const bool last_restart_used = attempt >= options.max_restarts;
  if (repeats >= static_cast<size_t>(options.repeated_failure_limit) ||
      (last_restart_used && repeats >= 2)) {
    return absl::StrCat("the same failure (", cause, ") ended the last ", repeats,
                        " attempts: it is deterministic, and a restart would repeat it");
  }
  if (last_restart_used) return absl::StrCat("all ", options.max_restarts, " restarts were used");
  if (Clock::now() >= deadline) {
    return absl::StrCat("the job's timeout (", options.timeout.count(), " ms) has passed");
  }
  return "";
}

constexpr std::chrono::seconds kMaxRestartBackoff(60);

// Sleeps `backoff`; false when a forwarded signal arrives meanwhile.
bool BackOff(std::chrono::milliseconds backoff) {
  const auto until = Clock::now() + backoff;
  while (Clock::now() < until) {
    if (FirstForwardedSignal() != 0) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return FirstForwardedSignal() == 0;
}

// One attempt: joins the other launchers under this attempt's keys, runs
// this host's ranks to their end and reports to the others.
absl::StatusOr<LaunchResult> RunAttempt(const LocalLaunchOptions& options, int attempt,
                                        Clock::time_point deadline, const ErrorFiles& errors,
                                        LauncherRendezvous& met) {
  met.group.reset();
  if (options.nnodes > 1) {
    FSDP_ASSIGN_OR_RETURN(met.group, LauncherGroup::Join(options, attempt,
                                                         Clock::now() + options.join_timeout,
                                                         met.store));
  }
  RunningRanks ranks(options, met.group.get(), attempt);
  FSDP_RETURN_IF_ERROR(StartLocalRanks(met, errors, ranks));
  WatchRanks(ranks, deadline);
  if (met.group != nullptr) FinishWithOtherLaunchers(*met.group, options.node_rank, ranks.result);
  return std::move(ranks.result);
}

// What follows an attempt, decided by node 0 for every node (or by the one
// launcher). The other nodes wait for node 0's word even when their own
// ranks succeeded: another node's may not have.
struct AfterAttempt {
  bool restart = false;
  std::string cause;       // Why the attempt failed, when it did.
  std::string no_restart;  // Why a failed attempt is not restarted.
  bool abandoned = false;  // Without node 0's decision: it may restart.
  bool undecided = false;  // Node 0's decision never came.
};

AfterAttempt DecideAfterAttempt(const LocalLaunchOptions& options, int attempt,
                                const LaunchResult& result, Clock::time_point deadline,
                                LauncherGroup* group, std::vector<std::string>& signatures) {
  AfterAttempt after;
  if (group == nullptr || options.node_rank == 0) {
    if (result.ok()) {
      if (group != nullptr) group->PostDecision("done");
      return after;
    }
    const std::vector<std::string> errors = group == nullptr
                                                ? std::vector<std::string>{FirstErrorOf(result, -1)}
                                                : group->node_errors();
    after.no_restart =
        WhyNoRestart(options, attempt, result, errors, deadline, signatures, after.cause);
    after.restart = after.no_restart.empty();
    if (group != nullptr) {
      group->PostDecision(after.restart ? absl::StrCat(LauncherGroup::kRestart, after.cause)
                                        : absl::StrCat("stop ", after.no_restart));
    }
    return after;
  }
  // Node 0's ranks may still run (past this node's) until its deadline,
  // which is up to join_timeout after this node's.
  absl::StatusOr<std::string> decision =
      group->AwaitDecision(std::max(deadline, Clock::now()) + options.join_timeout +
                           options.failure_grace + std::chrono::seconds(20));
  if (!decision.ok()) {
    // Node 0 may restart without this node; unless the store is lost, tell
    // the next attempt's join (a lost store's helper would hold it 30 s).
    after.abandoned = decision.status().code() != absl::StatusCode::kUnavailable;
    after.undecided = true;
    after.no_restart =
        absl::StrCat("no word from node 0's launcher: ", decision.status().message());
  } else if (absl::StartsWith(*decision, LauncherGroup::kRestart)) {
    after.restart = true;
    after.cause = decision->substr(LauncherGroup::kRestart.size());
  } else if (absl::StartsWith(*decision, "stop ")) {
    after.no_restart = absl::StrCat("node 0's launcher decided so: ", decision->substr(5));
  }
  return after;
}

}  // namespace

absl::StatusOr<LaunchResult> LaunchLocalRanks(const LocalLaunchOptions& options) {
  FSDP_RETURN_IF_ERROR(ValidateLaunchOptions(options));
  FSDP_ASSIGN_OR_RETURN(ErrorFiles errors, ErrorFiles::Create());
  FSDP_ASSIGN_OR_RETURN(LauncherRendezvous met, ServeOrReachStore(options));
  ForwardedSignalScope forwarding;
  const Clock::time_point deadline = Clock::now() + options.timeout;
  std::vector<JobRestart> restarts;
  std::vector<std::string> signatures;  // Of each failed attempt.
  std::chrono::milliseconds backoff =
      std::min<std::chrono::milliseconds>(options.restart_backoff, kMaxRestartBackoff);
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<LaunchResult> result = RunAttempt(options, attempt, deadline, errors, met);
    if (!result.ok()) {
      if (restarts.empty()) return result.status();
      return absl::Status(
          result.status().code(),
          absl::StrCat("after ", restarts.size(), restarts.size() == 1 ? " restart" : " restarts",
                       ", restart ", attempt, " could not start: ", result.status().message()));
    }
    result->restarts = restarts;
    if (options.max_restarts == 0) return result;
    const AfterAttempt after =
        DecideAfterAttempt(options, attempt, *result, deadline, met.group.get(), signatures);
    if (!after.restart) {
      if (after.abandoned) {
        LauncherGroup::AbandonJoin(options, attempt + 1, met.store, after.no_restart);
      }
      // Whether the job failed elsewhere is unknown: not a success.
      if (after.undecided) result->other_nodes_failures.push_back(after.no_restart);
      if (result->forwarded_signal == 0 && !result->ok()) {
        result->forwarded_signal = FirstForwardedSignal();
      }
      result->no_restart = after.no_restart;
      return result;
    }
    restarts.push_back(JobRestart{attempt + 1, after.cause, backoff});
    if (options.on_restart) options.on_restart(restarts.back());
    if (!BackOff(backoff)) {
      result->forwarded_signal = FirstForwardedSignal();
      result->no_restart = "the launcher was interrupted during the back-off";
      if (met.group != nullptr) {
        LauncherGroup::AbandonJoin(options, attempt + 1, met.store, result->no_restart);
      }
      return result;
    }
    backoff = std::min<std::chrono::milliseconds>(2 * backoff, kMaxRestartBackoff);
  }
}

}  // namespace fsdp
