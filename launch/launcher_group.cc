#include "launch/launcher_group.h"

#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "launch/forwarded_signals.h"

namespace fsdp::launch_internal {
namespace {

std::vector<uint8_t> Bytes(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

std::string Text(const std::vector<uint8_t>& bytes) {
  return std::string(bytes.begin(), bytes.end());
}

}  // namespace

int64_t LauncherStore::Add(const std::string& key, int64_t value) {
  return store_.Call([key, value](c10d::Store& s) { return s.add(key, value); },
                     kStoreOperationTimeout);
}

void LauncherStore::Set(const std::string& key, const std::string& value) {
  store_.Call([key, bytes = Bytes(value)](c10d::Store& s) { s.set(key, bytes); },
              kStoreOperationTimeout);
}

std::string LauncherStore::Get(const std::string& key) {
  return Text(store_.Call([key](c10d::Store& s) { return s.get(key); }, kStoreOperationTimeout));
}

bool LauncherStore::Has(const std::vector<std::string>& keys) {
  return store_.Call([keys](c10d::Store& s) { return s.check(keys); }, kStoreOperationTimeout);
}

void LauncherGroup::ReportFailure(const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_reported_) return;
  failure_reported_ = true;
  pending_failure_ = what;
  wake_.notify_all();
}

void LauncherGroup::PostDecision(const std::string& decision) {
  try {
    store_->Set(Key("decision"), decision);
    if (absl::StartsWith(decision, kRestart)) return;
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    for (int node = 1; node < options_.nnodes; ++node) {
      while (!silent_[node] && !store_->Has({Key("decided/", node)}) &&
             Clock::now() < deadline) {
        std::this_thread::sleep_for(kStorePollInterval);
      }
    }
  } catch (...) {
    // The others find the store gone, and fail.
  }
}

absl::StatusOr<std::string> LauncherGroup::AwaitDecision(Clock::time_point deadline) {
  const auto start = Clock::now();
  try {
    while (!store_lost_ && !store_->Has({Key("decision")})) {
      // Any signal since the attempt began: one that came before this wait
      // must not be lost in it.
      if (FirstForwardedSignal() != 0) {
        return absl::CancelledError(absl::StrCat("the launcher was interrupted by signal ",
                                                 FirstForwardedSignal(),
                                                 " before node 0 decided what follows"));
      }
      if (Clock::now() >= deadline) {
        const auto waited =
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
        return absl::DeadlineExceededError(absl::StrCat("node 0's launcher said within ",
                                                        waited.count(),
                                                        " ms neither to restart nor to stop"));
      }
      std::this_thread::sleep_for(kStorePollInterval);
    }
    if (store_lost_) return absl::UnavailableError("the launchers' store is lost");
    std::string decision = store_->Get(Key("decision"));
    store_->Set(Key("decided/", options_.node_rank), "1");
    return decision;
  } catch (...) {
    return StatusFromCurrentException(absl::StatusCode::kUnavailable);
  }
}

std::vector<std::string> LauncherGroup::Finish(const std::string& outcome, bool failure_known,
                                               const std::string& first_error) {
  StopWatching();
  const int n = options_.nnodes;
  const int self = options_.node_rank;
  const int signals_before = ForwardedSignalCount();
  try {
    if (store_lost_) return Failures();
    if (!pending_failure_.empty()) Post(pending_failure_);
    if (self != 0 && !failure_reported_ && store_->Has({Key("failed/", self)})) {
      TakenForLost(store_->Get(Key("failed/", self)));
    }
    if (!first_error.empty()) store_->Set(Key("error/", self), first_error);
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
          if (ForwardedSignalCount() != signals_before) {
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
            absl::StrCat("its launcher was interrupted by signal ", LastForwardedSignal(),
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
      for (int node = 0; node < n; ++node) {
        if (store_->Has({Key("error/", node)}))
          node_errors_.push_back(store_->Get(Key("error/", node)));
      }
    }
  } catch (...) {
    LoseStore(StatusFromCurrentException(absl::StatusCode::kUnavailable));
  }
  return Failures();
}

void LauncherGroup::Post(const std::string& failure) {
  store_->Set(Key("failed/", options_.node_rank), failure);
  store_->Add(Key("failures"), 1);
  std::lock_guard<std::mutex> lock(mu_);
  pending_failure_.clear();
}

std::vector<std::string> LauncherGroup::Failures() const {
  std::vector<std::string> out;
  for (const auto& [node, what] : other_failures_) {
    out.push_back(node < 0 ? what : absl::StrCat("node ", node, ": ", what));
  }
  return out;
}

void LauncherGroup::TakenForLost(const std::string& what) {
  other_failures_[-2] = "node 0's launcher took this node for lost: " + what;
}

void LauncherGroup::LoseStore(const absl::Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  store_lost_ = true;
  other_failures_[-1] = absl::StrCat("lost the launchers' store at ", options_.master_addr, ":",
                                     options_.master_port,
                                     " (node 0's launcher, or the way to it): ", why.message());
}

void LauncherGroup::Watch() {
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

void LauncherGroup::Beat() {
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

void LauncherGroup::StopWatching() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    wake_.notify_all();
  }
  if (watcher_.joinable()) watcher_.join();
}

absl::StatusOr<std::unique_ptr<LauncherGroup>> LauncherGroup::Join(
    const LocalLaunchOptions& options, int attempt, Clock::time_point deadline,
    c10::intrusive_ptr<c10d::Store> served) {
  const auto Key = [attempt](const std::string& name, int node = -1) {
    return AttemptKey(attempt, name, node);
  };
  const int self = options.node_rank;
  const std::string who = absl::StrCat("launcher of node ", self, " of ", options.nnodes);
  const std::string where = absl::StrCat(options.master_addr, ":", options.master_port);
  const std::string shape =
      absl::StrCat("--nnodes=", options.nnodes, " --nproc_per_node=", options.nproc_per_node,
                   " --max_restarts=", options.max_restarts);
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
      if (FirstForwardedSignal() != 0) {
        return give_up(absl::CancelledError(
            absl::StrCat(who, ": interrupted by signal ", FirstForwardedSignal(),
                         " while waiting for the other nodes to join")));
      }
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
  return std::unique_ptr<LauncherGroup>(new LauncherGroup(options, attempt, std::move(store)));
}

void LauncherGroup::AbandonJoin(const LocalLaunchOptions& options, int attempt,
                                c10::intrusive_ptr<c10d::Store> store, const std::string& why) {
  try {
    LauncherStore(std::move(store), "the store")
        .Set(AttemptKey(attempt, "join_failed"),
             absl::StrCat("node ", options.node_rank, ": ", why));
    // Node 0's store goes with it: served a moment longer, for the others
    // to read why.
    if (options.node_rank == 0) std::this_thread::sleep_for(std::chrono::seconds(1));
  } catch (...) {
    // The store is gone: the others find that instead.
  }
}

}  // namespace fsdp::launch_internal
