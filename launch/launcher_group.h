// How the launchers of one job across hosts act as one (local_launcher.h
// says what they agree on): they meet through the store node 0's launcher
// serves, under keys of the attempt. Private to the local_launcher target.
#ifndef FSDP_LAUNCH_LAUNCHER_GROUP_H_
#define FSDP_LAUNCH_LAUNCHER_GROUP_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "comm/store_deadline.h"
#include "launch/local_launcher.h"

namespace fsdp::launch_internal {

using Clock = std::chrono::steady_clock;

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

  int64_t Add(const std::string& key, int64_t value);
  void Set(const std::string& key, const std::string& value);
  std::string Get(const std::string& key);
  bool Has(const std::vector<std::string>& keys);

 private:
  DeadlineStore store_;
};

// The launchers of a job across hosts, meeting through the store node 0's
// launcher serves (each attempt's keys under "fsdp_launch/attempt_<n>/").
// A watcher thread posts this node's first failure and collects the other
// nodes' failures, so that a store that stops answering never stalls the
// reaping of ranks.
class LauncherGroup {
 public:
  // Waits until every node's launcher has joined with the same nnodes,
  // nproc_per_node and max_restarts; fails naming the nodes missing or in
  // disagreement, or when a forwarded signal arrives.
  static absl::StatusOr<std::unique_ptr<LauncherGroup>> Join(const LocalLaunchOptions& options,
                                                             int attempt,
                                                             Clock::time_point deadline,
                                                             c10::intrusive_ptr<c10d::Store> store);

  ~LauncherGroup() { StopWatching(); }
  LauncherGroup(const LauncherGroup&) = delete;
  LauncherGroup& operator=(const LauncherGroup&) = delete;

  // Tells the other launchers (only the first call does); never blocks.
  void ReportFailure(const std::string& what);

  // Node 0, after Finish: each node's first error, as posted.
  const std::vector<std::string>& node_errors() const { return node_errors_; }

  // Node 0, after Finish: tells every launcher what follows this attempt
  // and, unless the job restarts (then the next attempt's join is the
  // wait), serves the store until each has read it, 10 s at most.
  void PostDecision(const std::string& decision);

  // The other nodes, after Finish: node 0's decision, waited for until
  // `deadline`; kCancelled once a forwarded signal has arrived.
  absl::StatusOr<std::string> AwaitDecision(Clock::time_point deadline);

  // A launcher that will not join `attempt` (interrupted during the
  // back-off, or without node 0's decision) says so, so that the others'
  // Join fails at once rather than at join_timeout. Never throws.
  static void AbandonJoin(const LocalLaunchOptions& options, int attempt,
                          c10::intrusive_ptr<c10d::Store> store, const std::string& why);

  static constexpr absl::string_view kRestart = "restart ";

  bool OtherNodeFailed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return !other_failures_.empty();
  }

  // Reports this node's outcome ("" when every rank succeeded). Node 0 then
  // serves the store until every other launcher has reported, for at most
  // exit_barrier_timeout, or failure_grace + 10 s once a failure is known
  // (a launcher still silent then is named). Returns every failure
  // elsewhere: the lost store first, then by node.
  // `first_error` (FirstError's encoding, "" when none) goes to node 0 for
  // the restart decision.
  std::vector<std::string> Finish(const std::string& outcome, bool failure_known,
                                  const std::string& first_error = "");

 private:
  LauncherGroup(const LocalLaunchOptions& options, int attempt,
                std::unique_ptr<LauncherStore> store)
      : options_(options),
        attempt_(attempt),
        store_(std::move(store)),
        silent_(options.nnodes, false),
        beats_(options.nnodes, -1),
        heard_(options.nnodes, Clock::now()) {
    watcher_ = std::thread([this] { Watch(); });
  }

  // Each attempt of a restarting job meets under its own keys.
  static std::string AttemptKey(int attempt, const std::string& name, int node = -1) {
    return absl::StrCat("fsdp_launch/attempt_", attempt, "/", name,
                        node < 0 ? "" : std::to_string(node));
  }
  std::string Key(const std::string& name, int node = -1) const {
    return AttemptKey(attempt_, name, node);
  }

  // Store calls (and the heartbeat state) are used by one thread at a
  // time: the watcher, or the caller of Finish once the watcher has stopped.
  void Post(const std::string& failure);

  std::vector<std::string> Failures() const;

  // Node 0's launcher heard no heartbeat from here for node_timeout and
  // told the others to stop: so must this node. REQUIRES: mu_ held, or
  // the watcher stopped.
  void TakenForLost(const std::string& what);

  void LoseStore(const absl::Status& why);

  void Watch();

  // Each second: another node's launcher says it is alive; node 0's hears
  // them (they hear node 0 by its store answering at all) and reports a
  // node silent for node_timeout, and not done, as failed, so that every
  // launcher stops its ranks.
  void Beat();

  void StopWatching();

  const LocalLaunchOptions& options_;
  const int attempt_;
  const std::unique_ptr<LauncherStore> store_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  bool failure_reported_ = false;
  bool store_lost_ = false;
  std::string pending_failure_;
  std::map<int, std::string> other_failures_;  // By node; -1: the store lost.
  std::vector<std::string> node_errors_;       // Node 0's, after Finish.
  // Node 0's view of the others' heartbeats, by node.
  std::vector<bool> silent_;
  std::vector<int64_t> beats_;
  std::vector<Clock::time_point> heard_;
  Clock::time_point next_beat_ = Clock::now();
  std::thread watcher_;
};

}  // namespace fsdp::launch_internal

#endif  // FSDP_LAUNCH_LAUNCHER_GROUP_H_
