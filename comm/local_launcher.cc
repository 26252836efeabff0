#include "comm/local_launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "comm/rendezvous.h"
#include "comm/store_deadline.h"

extern char** environ;

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kLauncherVariables[] = {"RANK",
                                              "LOCAL_RANK",
                                              "ROLE_RANK",
                                              "GROUP_RANK",
                                              "WORLD_SIZE",
                                              "LOCAL_WORLD_SIZE",
                                              "ROLE_WORLD_SIZE",
                                              "GROUP_WORLD_SIZE",
                                              "ROLE_NAME",
                                              "MASTER_ADDR",
                                              "MASTER_PORT",
                                              "TORCHELASTIC_USE_AGENT_STORE",
                                              "TORCHELASTIC_RESTART_COUNT",
                                              "TORCHELASTIC_MAX_RESTARTS",
                                              "TORCHELASTIC_RUN_ID"};

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

std::string TailOfFile(const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  const std::streamoff start = size > static_cast<std::streamoff>(max_bytes)
                                   ? size - static_cast<std::streamoff>(max_bytes)
                                   : 0;
  in.seekg(start);
  std::ostringstream text;
  text << in.rdbuf();
  return (start > 0 ? "..." : "") + text.str();
}

// The environment of local rank `local_rank`, as "NAME=value" strings.
std::vector<std::string> RankEnvironment(const LocalLaunchOptions& options, int local_rank,
                                         int port) {
  std::map<std::string, std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const char* eq = std::strchr(*entry, '=');
    if (eq == nullptr) continue;
    env[std::string(*entry, eq - *entry)] = eq + 1;
  }
  for (const std::string& name : options.unset_env) env.erase(name);
  for (const char* name : kLauncherVariables) env.erase(name);
  // As torchrun's agent: a node is a group, and every rank has the default
  // role.
  const int world_size = options.nnodes * options.nproc_per_node;
  const int rank = options.node_rank * options.nproc_per_node + local_rank;
  for (const char* name : {"RANK", "ROLE_RANK"}) env[name] = std::to_string(rank);
  for (const char* name : {"WORLD_SIZE", "ROLE_WORLD_SIZE"}) env[name] = std::to_string(world_size);
  env["LOCAL_RANK"] = std::to_string(local_rank);
  env["LOCAL_WORLD_SIZE"] = std::to_string(options.nproc_per_node);
  env["GROUP_RANK"] = std::to_string(options.node_rank);
  env["GROUP_WORLD_SIZE"] = std::to_string(options.nnodes);
  env["ROLE_NAME"] = "default";
  env["MASTER_ADDR"] = options.nnodes > 1 ? options.master_addr : "127.0.0.1";
  env["MASTER_PORT"] = std::to_string(port);
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  env["TORCHELASTIC_RESTART_COUNT"] = "0";
  env["TORCHELASTIC_MAX_RESTARTS"] = "0";
  env["TORCHELASTIC_RUN_ID"] = "none";
  if (env.count("TORCH_NCCL_ASYNC_ERROR_HANDLING") == 0) {
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1";
  }
  // As torchrun does: W ranks each running a full-width OpenMP pool would
  // oversubscribe the host's cores (measured: a 3x slower local reduction).
  if (env.count("OMP_NUM_THREADS") == 0) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    env["OMP_NUM_THREADS"] =
        std::to_string(std::max(1u, cores / static_cast<unsigned>(options.nproc_per_node)));
  }
  for (const auto& [name, value] : options.extra_env) env[name] = value;
  std::vector<std::string> out;
  for (const auto& [name, value] : env) out.push_back(name + "=" + value);
  return out;
}

std::vector<char*> CStrings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// Starts one rank; returns its pid.
absl::StatusOr<pid_t> StartRank(const LocalLaunchOptions& options, int local_rank, int port,
                                const std::string& log_path) {
  std::vector<std::string> argv_strings = {options.program};
  argv_strings.insert(argv_strings.end(), options.args.begin(), options.args.end());
  std::vector<std::string> env_strings = RankEnvironment(options, local_rank, port);
  std::vector<char*> argv = CStrings(argv_strings);
  std::vector<char*> envp = CStrings(env_strings);
  int log_fd = -1;
  if (!log_path.empty()) {
    log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (log_fd < 0) {
      return absl::UnavailableError(
          absl::StrCat("launcher: cannot create log ", log_path, ": ", std::strerror(errno)));
    }
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    if (log_fd >= 0) ::close(log_fd);
    return absl::UnavailableError(absl::StrCat("launcher: fork for local rank ", local_rank,
                                               " failed: ", std::strerror(errno)));
  }
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // The launcher already died.
    ::setpgid(0, 0);
    if (log_fd >= 0) {
      ::dup2(log_fd, STDOUT_FILENO);
      ::dup2(log_fd, STDERR_FILENO);
    }
    // Nothing else of the launcher's (the rendezvous server's listening
    // socket among them) may outlive it in a rank.
    ::close_range(3, ~0U, 0);
    ::execve(argv[0], argv.data(), envp.data());
    const char message[] = "launcher: execve failed\n";
    ssize_t ignored = ::write(STDERR_FILENO, message, sizeof(message) - 1);
    (void)ignored;
    ::_exit(127);
  }
  if (log_fd >= 0) ::close(log_fd);
  return pid;
}

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

}  // namespace

std::string RankOutcome::Describe() const {
  switch (ending) {
    case Ending::kExited:
      return code == 0 ? absl::StrCat("rank ", rank, " succeeded")
                       : absl::StrCat("rank ", rank, " exited with code ", code);
    case Ending::kSignaled:
      return absl::StrCat("rank ", rank, " died of signal ", code, " (", strsignal(code), ")");
    case Ending::kKilledAtTimeout:
      return absl::StrCat("rank ", rank, " was killed: it did not finish within the job timeout");
    case Ending::kKilledAfterPeerFailure:
      return absl::StrCat("rank ", rank, " was killed: it was still running after the job failed");
  }
  return "";
}

bool LaunchResult::ok() const { return FailedRanks().empty() && other_nodes_failures.empty(); }

std::vector<int> LaunchResult::FailedRanks() const {
  std::vector<int> failed;
  for (const RankOutcome& r : ranks) {
    if (!r.ok()) failed.push_back(r.rank);
  }
  return failed;
}

std::string LaunchResult::Summary(size_t log_tail_bytes) const {
  std::string out;
  for (const RankOutcome& r : ranks) {
    if (r.ok()) continue;
    absl::StrAppend(&out, r.Describe(), "\n");
    if (!r.log_path.empty() && log_tail_bytes > 0) {
      absl::StrAppend(&out, "---- end of ", r.log_path, " ----\n",
                      TailOfFile(r.log_path, log_tail_bytes), "\n");
    }
  }
  for (const std::string& elsewhere : other_nodes_failures) absl::StrAppend(&out, elsewhere, "\n");
  return out;
}

absl::StatusOr<LaunchResult> LaunchLocalRanks(const LocalLaunchOptions& options) {
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
  const bool multi_node = options.nnodes > 1;
  const Clock::time_point join_deadline = Clock::now() + options.join_timeout;
  std::unique_ptr<RendezvousServer> server;
  c10::intrusive_ptr<c10d::Store> store;
  int port = options.master_port;
  if (!multi_node || options.node_rank == 0) {
    FSDP_ASSIGN_OR_RETURN(
        server, RendezvousServer::Start(multi_node ? options.master_port : 0, options.timeout));
    port = server->port();
    store = server->store();
  } else {
    absl::StatusOr<c10::intrusive_ptr<c10d::Store>> reached = ConnectStoreAt(
        options.master_addr, options.master_port, options.join_timeout, kStoreOperationTimeout);
    if (!reached.ok()) {
      return absl::Status(
          reached.status().code(),
          absl::StrCat("launcher of node ", options.node_rank, " of ", options.nnodes,
                       ": node 0's launcher is not there: ", reached.status().message()));
    }
    store = *std::move(reached);
  }
  std::unique_ptr<LauncherGroup> group;
  if (multi_node) {
    FSDP_ASSIGN_OR_RETURN(group, LauncherGroup::Join(options, join_deadline, store));
  }
  ForwardedSignalScope forwarding;

  const int nproc = options.nproc_per_node;
  LaunchResult result;
  std::vector<pid_t> pids(nproc, -1);
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

  const Clock::time_point deadline = Clock::now() + options.timeout;
  Clock::time_point kill_after_failure = Clock::time_point::max();
  const auto start_failure_grace = [&] {
    kill_after_failure = std::min(kill_after_failure, Clock::now() + options.failure_grace);
  };
  int running = nproc;
  while (running > 0) {
    for (int local = 0; local < nproc; ++local) {
      if (pids[local] < 0) continue;
      int status = 0;
      const pid_t done = ::waitpid(pids[local], &status, WNOHANG);
      if (done != pids[local]) continue;
      RankOutcome& outcome = result.ranks[local];
      if (WIFSIGNALED(status)) {
        outcome.ending = RankOutcome::Ending::kSignaled;
        outcome.code = WTERMSIG(status);
      } else {
        outcome.ending = RankOutcome::Ending::kExited;
        outcome.code = WEXITSTATUS(status);
      }
      pids[local] = -1;
      --running;
      if (!outcome.ok()) {
        start_failure_grace();
        if (group != nullptr) group->ReportFailure(outcome.Describe());
      }
    }
    if (running == 0) break;
    if (g_received_signal.load() != 0 && result.forwarded_signal == 0) {
      result.forwarded_signal = g_received_signal.load();
      for (int local = 0; local < nproc; ++local) {
        if (pids[local] >= 0) ::kill(-pids[local], result.forwarded_signal);
      }
      start_failure_grace();
      if (group != nullptr) {
        group->ReportFailure(absl::StrCat("its launcher was interrupted by signal ",
                                          result.forwarded_signal, " (",
                                          strsignal(result.forwarded_signal), ")"));
      }
    }
    if (group != nullptr && group->OtherNodeFailed()) start_failure_grace();
    const Clock::time_point now = Clock::now();
    if (now >= deadline || now >= kill_after_failure) {
      const auto ending = now >= deadline ? RankOutcome::Ending::kKilledAtTimeout
                                          : RankOutcome::Ending::kKilledAfterPeerFailure;
      for (int local = 0; local < nproc; ++local) {
        if (pids[local] < 0) continue;
        ::kill(-pids[local], SIGKILL);  // The rank's whole process group.
        ::waitpid(pids[local], nullptr, 0);
        result.ranks[local].ending = ending;
        result.ranks[local].code = SIGKILL;
        pids[local] = -1;
        if (group != nullptr) group->ReportFailure(result.ranks[local].Describe());
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (group != nullptr) {
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
    result.other_nodes_failures = group->Finish(absl::StrJoin(failed, "; "),
                                                /*failure_known=*/!failed.empty());
  }
  return result;
}

int LaunchSelfAndReport(int argc, char** argv, int world_size, std::chrono::milliseconds timeout,
                        const std::string& program_name) {
  LocalLaunchOptions options;
  options.nproc_per_node = world_size;
  options.program = "/proc/self/exe";
  options.args.assign(argv + 1, argv + argc);
  options.timeout = timeout;
  return LaunchAndReport(options, program_name);
}

int LaunchAndReport(LocalLaunchOptions options, const std::string& program_name) {
  const int nproc = options.nproc_per_node;
  const int first_rank = options.node_rank * nproc;
  const std::string here =
      options.nnodes > 1 ? absl::StrCat(" on node ", options.node_rank, " of ", options.nnodes)
                         : "";
  options.on_started = [&](const std::vector<int>& pids) {
    std::string line = absl::StrCat(program_name, ": launched ", nproc, " local ranks", here, ":");
    for (size_t local = 0; local < pids.size(); ++local) {
      absl::StrAppend(&line, " rank ", first_rank + local, " pid ", pids[local],
                      local + 1 < pids.size() ? "," : "\n");
    }
    std::fputs(line.c_str(), stdout);
    std::fflush(stdout);
  };
  absl::StatusOr<LaunchResult> result = LaunchLocalRanks(options);
  if (!result.ok()) {
    std::fprintf(stderr, "%s: %s\n", program_name.c_str(), result.status().ToString().c_str());
    return 2;
  }
  if (result->forwarded_signal != 0) {
    std::fprintf(stderr, "%s: interrupted by signal %d (%s), forwarded to every rank%s\n%s",
                 program_name.c_str(), result->forwarded_signal,
                 strsignal(result->forwarded_signal), here.c_str(), result->Summary().c_str());
    return 128 + result->forwarded_signal;
  }
  if (!result->ok()) {
    std::fprintf(stderr, "%s: the job failed:\n%s", program_name.c_str(),
                 result->Summary().c_str());
    return 1;
  }
  if (options.nnodes == 1) {
    std::printf("all %d ranks succeeded\n", nproc);
  } else if (options.node_rank == 0) {
    std::printf("all %d ranks on %d nodes succeeded\n", nproc * options.nnodes, options.nnodes);
  } else {
    std::printf("all %d ranks of node %d succeeded (ranks %d-%d)\n", nproc, options.node_rank,
                first_rank, first_rank + nproc - 1);
  }
  return 0;
}

}  // namespace fsdp
