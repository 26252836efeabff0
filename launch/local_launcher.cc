#include "launch/local_launcher.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "comm/rendezvous.h"
#include "comm/store_deadline.h"
#include "launch/rank_process.h"

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

// The first forwarded signal received while LaunchLocalRanks waits.
// Lock-free, so that the handler may set it on any thread (the watcher's
// and store helpers' included) while the main thread reads it.
std::atomic<int> g_received_signal{0};
// How many arrived, and the last, so that a wait can tell a new one from
// the first.
std::atomic<int> g_signal_count{0};
std::atomic<int> g_last_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);

void RecordSignal(int signal) {
  int none = 0;
  g_received_signal.compare_exchange_strong(none, signal);
  g_last_signal.store(signal);
  g_signal_count.fetch_add(1);
}

// Installs RecordSignal for kForwardedSignals while alive; restores the
// previous handlers after.
class ForwardedSignalScope {
 public:
  ForwardedSignalScope() {
    g_received_signal.store(0);
    struct sigaction action {};
    action.sa_handler = RecordSignal;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
      ::sigaction(kForwardedSignals[i], &action, &previous_[i]);
    }
  }
  ~ForwardedSignalScope() {
    for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
      ::sigaction(kForwardedSignals[i], &previous_[i], nullptr);
    }
  }
  ForwardedSignalScope(const ForwardedSignalScope&) = delete;
  ForwardedSignalScope& operator=(const ForwardedSignalScope&) = delete;

 private:
  struct sigaction previous_[std::size(kForwardedSignals)];
};

std::vector<uint8_t> Bytes(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

std::string Text(const std::vector<uint8_t>& bytes) {
  return std::string(bytes.begin(), bytes.end());
}

// How long one operation on node 0's store may take from another host
// before that host counts as cut off from the job.
constexpr std::chrono::seconds kStoreOperationTimeout(30);
constexpr std::chrono::milliseconds kStorePollInterval(100);
constexpr std::chrono::seconds kHeartbeatInterval(1);

// The launchers' keys in their store, each operation bounded by
// kStoreOperationTimeout (comm/store_deadline.h): a launcher cut off from
// node 0 must still end.
class LauncherStore {
 public:
  LauncherStore(c10::intrusive_ptr<c10d::Store> store, std::string name)
      : store_(std::move(store), std::move(name)) {}

  int64_t Add(const std::string& key, int64_t value) {
    return store_.Call([key, value](c10d::Store& s) { return s.add(key, value); },
                       kStoreOperationTimeout);
  }
  void Set(const std::string& key, const std::string& value) {
    store_.Call([key, bytes = Bytes(value)](c10d::Store& s) { s.set(key, bytes); },
                kStoreOperationTimeout);
  }
  std::string Get(const std::string& key) {
    return Text(store_.Call([key](c10d::Store& s) { return s.get(key); }, kStoreOperationTimeout));
  }
  bool Has(const std::vector<std::string>& keys) {
    return store_.Call([keys](c10d::Store& s) { return s.check(keys); }, kStoreOperationTimeout);
  }

 private:
  DeadlineStore store_;
};

// The launchers of a job across hosts, meeting through the store node 0's
// launcher serves (keys under "fsdp_launch/"). A watcher thread posts this
// node's first failure and collects the other nodes' failures, so that a
// store that stops answering never stalls the reaping of ranks.
class LauncherGroup {
 public:
  // Waits until every node's launcher has joined with the same nnodes and
  // nproc_per_node; fails naming the nodes missing or in disagreement.
  static absl::StatusOr<std::unique_ptr<LauncherGroup>> Join(const LocalLaunchOptions& options,
                                                             Clock::time_point deadline,
                                                             c10::intrusive_ptr<c10d::Store> store);

  ~LauncherGroup() { StopWatching(); }
  LauncherGroup(const LauncherGroup&) = delete;
  LauncherGroup& operator=(const LauncherGroup&) = delete;

  // Tells the other launchers (only the first call does); never blocks.
  void ReportFailure(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_reported_) return;
    failure_reported_ = true;
    pending_failure_ = what;
    wake_.notify_all();
  }

  bool OtherNodeFailed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return !other_failures_.empty();
  }

  // Reports this node's outcome ("" when every rank succeeded). Node 0 then
  // serves the store until every other launcher has reported, for at most
  // exit_barrier_timeout, or failure_grace + 10 s once a failure is known
  // (a launcher still silent then is named). Returns every failure
  // elsewhere: the lost store first, then by node.
  std::vector<std::string> Finish(const std::string& outcome, bool failure_known) {
    StopWatching();
    const int n = options_.nnodes;
    const int self = options_.node_rank;
    const int signals_before = g_signal_count.load();
    try {
      if (store_lost_) return Failures();
      if (!pending_failure_.empty()) Post(pending_failure_);
      if (self != 0 && !failure_reported_ && store_->Has({Key("failed/", self)})) {
        TakenForLost(store_->Get(Key("failed/", self)));
      }
      store_->Set(Key("done/", self), outcome);
      if (self == 0) {
        const std::chrono::milliseconds wait =
            failure_known || !other_failures_.empty()
                ? options_.failure_grace + std::chrono::seconds(10)
                : options_.exit_barrier_timeout;
        const auto start = Clock::now();
        const auto deadline = start + wait;
        // A node already found silent is not waited for.
        const auto reported = [&](int node) {
          return silent_[node] || store_->Has({Key("done/", node)});
        };
        bool interrupted = false;
        for (int node = 1; node < n && !interrupted; ++node) {
          while (!reported(node) && Clock::now() < deadline) {
            if (g_signal_count.load() != signals_before) {
              interrupted = true;
              break;
            }
            std::this_thread::sleep_for(kStorePollInterval);
            Beat();  // The watcher has stopped; a node lost now is still found.
          }
        }
        const auto waited =
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
        if (interrupted) {
          const std::string why =
              absl::StrCat("its launcher was interrupted by signal ", g_last_signal.load(),
                           " while waiting for the other nodes' reports");
          if (!failure_reported_) Post(why);
          other_failures_[-3] = absl::StrCat("node 0: ", why, " (", waited.count(), " ms)");
        }
        for (int node = 1; node < n; ++node) {
          const bool done = store_->Has({Key("done/", node)});
          const std::string said = done ? store_->Get(Key("done/", node)) : "";
          if (silent_[node]) {
            // Frozen, not gone: it woke and said how its ranks ended.
            if (done && !said.empty()) other_failures_[node] += "; it said later: " + said;
            continue;
          }
          if (!done) {
            other_failures_[node] =
                absl::StrCat(other_failures_.count(node) > 0 ? other_failures_[node] + "; " : "",
                             "its launcher sent no final report within ", waited.count(),
                             " ms (its host lost, or its ranks still running)");
            continue;
          }
          if (!said.empty()) other_failures_[node] = said;
        }
      }
    } catch (...) {
      LoseStore(StatusFromCurrentException(absl::StatusCode::kUnavailable));
    }
    return Failures();
  }

 private:
  LauncherGroup(const LocalLaunchOptions& options, std::unique_ptr<LauncherStore> store)
      : options_(options),
        store_(std::move(store)),
        silent_(options.nnodes, false),
        beats_(options.nnodes, -1),
        heard_(options.nnodes, Clock::now()) {
    watcher_ = std::thread([this] { Watch(); });
  }

  static std::string Key(const std::string& name, int node = -1) {
    return absl::StrCat("fsdp_launch/", name, node < 0 ? "" : std::to_string(node));
  }

  // Store calls (and the heartbeat state) are used by one thread at a
  // time: the watcher, or the caller of Finish once the watcher has stopped.
  void Post(const std::string& failure) {
    store_->Set(Key("failed/", options_.node_rank), failure);
    store_->Add(Key("failures"), 1);
    std::lock_guard<std::mutex> lock(mu_);
    pending_failure_.clear();
  }

  std::vector<std::string> Failures() const {
    std::vector<std::string> out;
    for (const auto& [node, what] : other_failures_) {
      out.push_back(node < 0 ? what : absl::StrCat("node ", node, ": ", what));
    }
    return out;
  }

  // Node 0's launcher heard no heartbeat from here for node_timeout and
  // told the others to stop: so must this node. REQUIRES: mu_ held, or
  // the watcher stopped.
  void TakenForLost(const std::string& what) {
    other_failures_[-2] = "node 0's launcher took this node for lost: " + what;
  }

  void LoseStore(const absl::Status& why) {
    std::lock_guard<std::mutex> lock(mu_);
    store_lost_ = true;
    other_failures_[-1] = absl::StrCat("lost the launchers' store at ", options_.master_addr, ":",
                                       options_.master_port,
                                       " (node 0's launcher, or the way to it): ", why.message());
  }

  void Watch() {
    const int n = options_.nnodes;
    // The count of failures posted at the last scan. A failure's key is
    // set before the count grows, so a scan after a new count sees it.
    int64_t scanned = 0;
    std::vector<bool> read(n, false);
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      const std::string pending = pending_failure_;
      lock.unlock();
      try {
        if (!pending.empty()) Post(pending);
        Beat();
        const int64_t posted = store_->Add(Key("failures"), 0);
        for (int node = 0; posted != scanned && node < n; ++node) {
          if (read[node] || !store_->Has({Key("failed/", node)})) continue;
          read[node] = true;
          const std::string what = store_->Get(Key("failed/", node));
          std::lock_guard<std::mutex> report(mu_);
          if (node != options_.node_rank) {
            if (other_failures_.count(node) == 0) other_failures_[node] = what;
          } else if (!failure_reported_) {
            TakenForLost(what);
          }
        }
        scanned = posted;
      } catch (...) {
        LoseStore(StatusFromCurrentException(absl::StatusCode::kUnavailable));
        return;
      }
      lock.lock();
      wake_.wait_for(lock, kStorePollInterval,
                     [this] { return stop_ || !pending_failure_.empty(); });
    }
  }

  // Each second: another node's launcher says it is alive; node 0's hears
  // them (they hear node 0 by its store answering at all) and reports a
  // node silent for node_timeout, and not done, as failed, so that every
  // launcher stops its ranks.
  void Beat() {
    if (Clock::now() < next_beat_) return;
    next_beat_ = Clock::now() + kHeartbeatInterval;
    if (options_.node_rank != 0) {
      store_->Add(Key("alive/", options_.node_rank), 1);
      return;
    }
    for (int node = 1; node < options_.nnodes; ++node) {
      const int64_t beat = store_->Add(Key("alive/", node), 0);
      if (beat != beats_[node]) {
        beats_[node] = beat;
        heard_[node] = Clock::now();
        continue;
      }
      if (silent_[node] || Clock::now() - heard_[node] <= options_.node_timeout ||
          store_->Has({Key("done/", node)})) {
        continue;
      }
      const std::string silent =
          absl::StrCat("its launcher went silent: no heartbeat for ", options_.node_timeout.count(),
                       " ms (its host lost, or the launcher killed)");
      silent_[node] = true;
      // A node that said why it failed keeps its word; the others know
      // to stop already.
      if (store_->Has({Key("failed/", node)})) {
        const std::string said = store_->Get(Key("failed/", node));
        std::lock_guard<std::mutex> lock(mu_);
        other_failures_[node] = said + "; then " + silent;
        continue;
      }
      store_->Set(Key("failed/", node), silent);
      store_->Add(Key("failures"), 1);
      std::lock_guard<std::mutex> lock(mu_);
      other_failures_[node] = silent;
    }
  }

  void StopWatching() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      wake_.notify_all();
    }
    if (watcher_.joinable()) watcher_.join();
  }

  const LocalLaunchOptions& options_;
  const std::unique_ptr<LauncherStore> store_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  bool failure_reported_ = false;
  bool store_lost_ = false;
  std::string pending_failure_;
  std::map<int, std::string> other_failures_;  // By node; -1: the store lost.
  // Node 0's view of the others' heartbeats, by node.
  std::vector<bool> silent_;
  std::vector<int64_t> beats_;
  std::vector<Clock::time_point> heard_;
  Clock::time_point next_beat_ = Clock::now();
  std::thread watcher_;
};

absl::StatusOr<std::unique_ptr<LauncherGroup>> LauncherGroup::Join(
    const LocalLaunchOptions& options, Clock::time_point deadline,
    c10::intrusive_ptr<c10d::Store> served) {
  const int self = options.node_rank;
  const std::string who = absl::StrCat("launcher of node ", self, " of ", options.nnodes);
  const std::string where = absl::StrCat(options.master_addr, ":", options.master_port);
  const std::string shape =
      absl::StrCat("--nnodes=", options.nnodes, " --nproc_per_node=", options.nproc_per_node);
  auto store = std::make_unique<LauncherStore>(std::move(served), "the store");
  // A launcher that gives up says why, for the others to say too rather
  // than find the store gone; node 0's serves a moment longer for them to
  // read it.
  const auto give_up = [&](absl::Status why) {
    try {
      store->Set(Key("join_failed"), absl::StrCat("node ", self, ": ", why.message()));
      if (self == 0) std::this_thread::sleep_for(std::chrono::seconds(1));
    } catch (...) {
      // The store is gone too: `why` stands alone.
    }
    return why;
  };
  const auto gave_up = [&]() -> std::optional<absl::Status> {
    if (!store->Has({Key("join_failed")})) return std::nullopt;
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": the join failed at ", store->Get(Key("join_failed"))));
  };
  try {
    if (store->Add(Key("claimed/", self), 1) != 1) {
      // Not said for the others: the launcher that holds this node rank
      // may well run the job.
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": another launcher already joined the job at ", where, " as node ",
                       self, ": give each host its own --node_rank"));
    }
    store->Set(Key("shape/", self), shape);
    std::vector<std::string> shapes;
    for (int node = 0; node < options.nnodes; ++node) shapes.push_back(Key("shape/", node));
    while (!store->Has(shapes)) {
      if (std::optional<absl::Status> failed = gave_up()) return *failed;
      if (Clock::now() >= deadline) {
        std::vector<int> missing;
        for (int node = 0; node < options.nnodes; ++node) {
          if (!store->Has({shapes[node]})) missing.push_back(node);
        }
        if (missing.empty()) break;  // The last came just now.
        return give_up(absl::DeadlineExceededError(absl::StrCat(
            who, ": node", missing.size() > 1 ? "s " : " ", absl::StrJoin(missing, ", "),
            " did not join at ", where, " within ", options.join_timeout.count(), " ms")));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    // Complete, but one may have given up just before (node 0 serves a
    // moment after giving up, for this).
    if (std::optional<absl::Status> failed = gave_up()) return *failed;
    for (int node = 0; node < options.nnodes; ++node) {
      const std::string theirs = store->Get(shapes[node]);
      if (theirs != shape) {
        return give_up(absl::FailedPreconditionError(
            absl::StrCat(who, ": node ", node, "'s launcher was started with ", theirs,
                         ", this one with ", shape, ": every node's must agree")));
      }
    }
  } catch (...) {
    absl::Status cause = StatusFromCurrentException(absl::StatusCode::kUnavailable);
    return absl::Status(cause.code(), absl::StrCat(who, ": lost the launchers' store at ", where,
                                                   " while joining: ", cause.message()));
  }
  return std::unique_ptr<LauncherGroup>(new LauncherGroup(options, std::move(store)));
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

// What this launcher meets its ranks and the other launchers through.
// Destroyed in reverse: the group (whose watcher uses the store) first, the
// server (which serves the store) last.
struct LauncherRendezvous {
  std::unique_ptr<RendezvousServer> server;  // Node 0's launcher, or one host's.
  c10::intrusive_ptr<c10d::Store> store;
  int port = 0;                          // MASTER_PORT for the ranks.
  std::unique_ptr<LauncherGroup> group;  // Across hosts only.
};

// Serves the store (node 0, or a job on one host) or reaches node 0's, then
// joins the other launchers; no rank starts before every node has joined.
absl::StatusOr<LauncherRendezvous> MeetOtherLaunchers(const LocalLaunchOptions& options) {
  const bool multi_node = options.nnodes > 1;
  const Clock::time_point join_deadline = Clock::now() + options.join_timeout;
  LauncherRendezvous met;
  met.port = options.master_port;
  if (!multi_node || options.node_rank == 0) {
    FSDP_ASSIGN_OR_RETURN(
        met.server, RendezvousServer::Start(multi_node ? options.master_port : 0, options.timeout));
    met.port = met.server->port();
    met.store = met.server->store();
  } else {
    absl::StatusOr<c10::intrusive_ptr<c10d::Store>> reached = ConnectStoreAt(
        options.master_addr, options.master_port, options.join_timeout, kStoreOperationTimeout);
    if (!reached.ok()) {
      return absl::Status(
          reached.status().code(),
          absl::StrCat("launcher of node ", options.node_rank, " of ", options.nnodes,
                       ": node 0's launcher is not there: ", reached.status().message()));
    }
    met.store = *std::move(reached);
  }
  if (multi_node) {
    FSDP_ASSIGN_OR_RETURN(met.group, LauncherGroup::Join(options, join_deadline, met.store));
  }
  return met;
}

// This host's ranks from their start until each has ended, by local rank.
struct RunningRanks {
  RunningRanks(const LocalLaunchOptions& options, LauncherGroup* group)
      : options(options), group(group), pids(options.nproc_per_node, -1) {}

  // A failure anywhere gives the ranks still running failure_grace to end
  // on their own; a later failure does not extend it.
  void StartFailureGrace() {
    kill_after_failure = std::min(kill_after_failure, Clock::now() + options.failure_grace);
  }

  const LocalLaunchOptions& options;
  LauncherGroup* const group;  // Null on one host.
  LaunchResult result;
  std::vector<pid_t> pids;  // -1 once the rank has ended.
  int running = 0;
  Clock::time_point kill_after_failure = Clock::time_point::max();
};

// Starts every rank of this host. When one cannot start, the ranks already
// started are killed and the other launchers told, so that nothing is left
// waiting for it.
absl::Status StartLocalRanks(int port, RunningRanks& ranks) {
  const LocalLaunchOptions& options = ranks.options;
  LaunchResult& result = ranks.result;
  std::vector<pid_t>& pids = ranks.pids;
  LauncherGroup* const group = ranks.group;
  const int nproc = options.nproc_per_node;
  for (int local = 0; local < nproc; ++local) {
    RankOutcome outcome;
    outcome.rank = options.node_rank * nproc + local;
    if (!options.log_dir.empty()) {
      outcome.log_path = absl::StrCat(options.log_dir, "/rank_", outcome.rank, ".log");
    }
    result.ranks.push_back(outcome);
    absl::StatusOr<pid_t> pid = StartRank(options, local, port, outcome.log_path);
    if (!pid.ok()) {
      for (int started = 0; started < local; ++started) {
        ::kill(-pids[started], SIGKILL);
        ::waitpid(pids[started], nullptr, 0);
      }
      if (group != nullptr) {
        group->ReportFailure(
            absl::StrCat("its launcher could not start its ranks: ", pid.status().message()));
        group->Finish(pid.status().ToString(), /*failure_known=*/true);
      }
      return pid.status();
    }
    pids[local] = *pid;
    result.ranks[local].pid = *pid;
  }
  if (options.on_started) options.on_started(std::vector<int>(pids.begin(), pids.end()));
  ranks.running = nproc;
  return absl::OkStatus();
}

// Records how each rank that ended since the last call ended; a failure
// starts the grace period and is passed on to the other launchers.
void ReapEndedRanks(RunningRanks& ranks) {
  for (int local = 0; local < ranks.options.nproc_per_node; ++local) {
    if (ranks.pids[local] < 0) continue;
    int status = 0;
    const pid_t done = ::waitpid(ranks.pids[local], &status, WNOHANG);
    if (done != ranks.pids[local]) continue;
    RankOutcome& outcome = ranks.result.ranks[local];
    if (WIFSIGNALED(status)) {
      outcome.ending = RankOutcome::Ending::kSignaled;
      outcome.code = WTERMSIG(status);
    } else {
      outcome.ending = RankOutcome::Ending::kExited;
      outcome.code = WEXITSTATUS(status);
    }
    ranks.pids[local] = -1;
    --ranks.running;
    if (!outcome.ok()) {
      ranks.StartFailureGrace();
      if (ranks.group != nullptr) ranks.group->ReportFailure(outcome.Describe());
    }
  }
}

// Passes the first signal the launcher received on to every rank still
// running, once; it counts as a failure of the job.
void ForwardReceivedSignal(RunningRanks& ranks) {
  LaunchResult& result = ranks.result;
  if (g_received_signal.load() == 0 || result.forwarded_signal != 0) return;
  result.forwarded_signal = g_received_signal.load();
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

// Polls the ranks until every one has ended, or kills the rest at the job
// timeout or once the grace after a failure runs out.
void WatchRanks(RunningRanks& ranks) {
  const Clock::time_point deadline = Clock::now() + ranks.options.timeout;
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

// Tells the other launchers how this host's ranks ended, and records what
// failed elsewhere.
void FinishWithOtherLaunchers(LauncherGroup& group, LaunchResult& result) {
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
                                             /*failure_known=*/!failed.empty());
}

}  // namespace

absl::StatusOr<LaunchResult> LaunchLocalRanks(const LocalLaunchOptions& options) {
  FSDP_RETURN_IF_ERROR(ValidateLaunchOptions(options));
  FSDP_ASSIGN_OR_RETURN(LauncherRendezvous met, MeetOtherLaunchers(options));
  ForwardedSignalScope forwarding;
  RunningRanks ranks(options, met.group.get());
  FSDP_RETURN_IF_ERROR(StartLocalRanks(met.port, ranks));
  WatchRanks(ranks);
  if (met.group != nullptr) FinishWithOtherLaunchers(*met.group, ranks.result);
  return std::move(ranks.result);
}

}  // namespace fsdp
