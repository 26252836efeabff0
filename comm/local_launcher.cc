#include "comm/local_launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <iterator>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "comm/rendezvous.h"

extern char** environ;

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kLauncherVariables[] = {
    "RANK",        "LOCAL_RANK",       "ROLE_RANK",   "GROUP_RANK",
    "WORLD_SIZE",  "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE",
    "ROLE_NAME",   "MASTER_ADDR",      "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID"};

constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

// The first forwarded signal received while LaunchLocalRanks waits.
volatile sig_atomic_t g_received_signal = 0;

void RecordSignal(int signal) {
  if (g_received_signal == 0) g_received_signal = signal;
}

// Installs RecordSignal for kForwardedSignals while alive; restores the
// previous handlers after.
class ForwardedSignalScope {
 public:
  ForwardedSignalScope() {
    g_received_signal = 0;
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

// The environment of rank `rank`, as "NAME=value" strings.
std::vector<std::string> RankEnvironment(const LocalLaunchOptions& options, int rank,
                                         int port) {
  std::map<std::string, std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const char* eq = std::strchr(*entry, '=');
    if (eq == nullptr) continue;
    env[std::string(*entry, eq - *entry)] = eq + 1;
  }
  for (const std::string& name : options.unset_env) env.erase(name);
  for (const char* name : kLauncherVariables) env.erase(name);
  // As torchrun's agent for one node: the node is group 0 of 1, and every
  // rank has the default role.
  for (const char* name : {"RANK", "LOCAL_RANK", "ROLE_RANK"}) env[name] = std::to_string(rank);
  for (const char* name : {"WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE"}) {
    env[name] = std::to_string(options.world_size);
  }
  env["GROUP_RANK"] = "0";
  env["GROUP_WORLD_SIZE"] = "1";
  env["ROLE_NAME"] = "default";
  env["MASTER_ADDR"] = "127.0.0.1";
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
    env["OMP_NUM_THREADS"] = std::to_string(std::max(1u, cores / options.world_size));
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
absl::StatusOr<pid_t> StartRank(const LocalLaunchOptions& options, int rank, int port,
                                const std::string& log_path) {
  std::vector<std::string> argv_strings = {options.program};
  argv_strings.insert(argv_strings.end(), options.args.begin(), options.args.end());
  std::vector<std::string> env_strings = RankEnvironment(options, rank, port);
  std::vector<char*> argv = CStrings(argv_strings);
  std::vector<char*> envp = CStrings(env_strings);
  int log_fd = -1;
  if (!log_path.empty()) {
    log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (log_fd < 0) {
      return absl::UnavailableError(absl::StrCat("launcher: cannot create log ", log_path,
                                                 ": ", std::strerror(errno)));
    }
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    if (log_fd >= 0) ::close(log_fd);
    return absl::UnavailableError(
        absl::StrCat("launcher: fork for rank ", rank, " failed: ", std::strerror(errno)));
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

}  // namespace

std::string RankOutcome::Describe() const {
  switch (ending) {
    case Ending::kExited:
      return code == 0 ? absl::StrCat("rank ", rank, " succeeded")
                       : absl::StrCat("rank ", rank, " exited with code ", code);
    case Ending::kSignaled:
      return absl::StrCat("rank ", rank, " died of signal ", code, " (", strsignal(code),
                          ")");
    case Ending::kKilledAtTimeout:
      return absl::StrCat("rank ", rank,
                          " was killed: it did not finish within the job timeout");
    case Ending::kKilledAfterPeerFailure:
      return absl::StrCat("rank ", rank,
                          " was killed: it was still running after another rank failed");
  }
  return "";
}

bool LaunchResult::ok() const { return FailedRanks().empty(); }

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
  return out;
}

absl::StatusOr<LaunchResult> LaunchLocalRanks(const LocalLaunchOptions& options) {
  if (options.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("launcher: world size ", options.world_size, " must be >= 1"));
  }
  if (options.program.empty() || ::access(options.program.c_str(), X_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("launcher: '", options.program, "' is not an executable file"));
  }
  if (options.timeout.count() <= 0) {
    return absl::InvalidArgumentError("launcher: timeout must be positive");
  }
  if (!options.log_dir.empty()) {
    struct stat info;
    if (::stat(options.log_dir.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("launcher: log directory '", options.log_dir, "' does not exist"));
    }
  }
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<RendezvousServer> server,
                        RendezvousServer::Start(/*port=*/0, options.timeout));
  ForwardedSignalScope forwarding;

  LaunchResult result;
  std::vector<pid_t> pids(options.world_size, -1);
  for (int rank = 0; rank < options.world_size; ++rank) {
    RankOutcome outcome;
    outcome.rank = rank;
    if (!options.log_dir.empty()) {
      outcome.log_path = absl::StrCat(options.log_dir, "/rank_", rank, ".log");
    }
    result.ranks.push_back(outcome);
    absl::StatusOr<pid_t> pid = StartRank(options, rank, server->port(), outcome.log_path);
    if (!pid.ok()) {
      for (int started = 0; started < rank; ++started) {
        ::kill(-pids[started], SIGKILL);
        ::waitpid(pids[started], nullptr, 0);
      }
      return pid.status();
    }
    pids[rank] = *pid;
    result.ranks[rank].pid = *pid;
  }
  if (options.on_started) options.on_started(std::vector<int>(pids.begin(), pids.end()));

  const Clock::time_point deadline = Clock::now() + options.timeout;
  Clock::time_point kill_after_failure = Clock::time_point::max();
  int running = options.world_size;
  while (running > 0) {
    for (int rank = 0; rank < options.world_size; ++rank) {
      if (pids[rank] < 0) continue;
      int status = 0;
      const pid_t done = ::waitpid(pids[rank], &status, WNOHANG);
      if (done != pids[rank]) continue;
      RankOutcome& outcome = result.ranks[rank];
      if (WIFSIGNALED(status)) {
        outcome.ending = RankOutcome::Ending::kSignaled;
        outcome.code = WTERMSIG(status);
      } else {
        outcome.ending = RankOutcome::Ending::kExited;
        outcome.code = WEXITSTATUS(status);
      }
      pids[rank] = -1;
      --running;
      if (!outcome.ok() && kill_after_failure == Clock::time_point::max()) {
        kill_after_failure = Clock::now() + options.failure_grace;
      }
    }
    if (running == 0) break;
    if (g_received_signal != 0 && result.forwarded_signal == 0) {
      result.forwarded_signal = g_received_signal;
      for (int rank = 0; rank < options.world_size; ++rank) {
        if (pids[rank] >= 0) ::kill(-pids[rank], result.forwarded_signal);
      }
      kill_after_failure = std::min(kill_after_failure, Clock::now() + options.failure_grace);
    }
    const Clock::time_point now = Clock::now();
    if (now >= deadline || now >= kill_after_failure) {
      const auto ending = now >= deadline ? RankOutcome::Ending::kKilledAtTimeout
                                          : RankOutcome::Ending::kKilledAfterPeerFailure;
      for (int rank = 0; rank < options.world_size; ++rank) {
        if (pids[rank] < 0) continue;
        ::kill(-pids[rank], SIGKILL);  // The rank's whole process group.
        ::waitpid(pids[rank], nullptr, 0);
        result.ranks[rank].ending = ending;
        result.ranks[rank].code = SIGKILL;
        pids[rank] = -1;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return result;
}

int LaunchSelfAndReport(int argc, char** argv, int world_size,
                        std::chrono::milliseconds timeout, const std::string& program_name) {
  LocalLaunchOptions options;
  options.world_size = world_size;
  options.program = "/proc/self/exe";
  options.args.assign(argv + 1, argv + argc);
  options.timeout = timeout;
  return LaunchAndReport(options, program_name);
}

int LaunchAndReport(LocalLaunchOptions options, const std::string& program_name) {
  const int world_size = options.world_size;
  options.on_started = [&](const std::vector<int>& pids) {
    std::string line = absl::StrCat(program_name, ": launched ", world_size, " local ranks:");
    for (size_t rank = 0; rank < pids.size(); ++rank) {
      absl::StrAppend(&line, " rank ", rank, " pid ", pids[rank],
                      rank + 1 < pids.size() ? "," : "\n");
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
    std::fprintf(stderr, "%s: interrupted by signal %d (%s), forwarded to every rank\n%s",
                 program_name.c_str(), result->forwarded_signal,
                 strsignal(result->forwarded_signal), result->Summary().c_str());
    return 128 + result->forwarded_signal;
  }
  if (!result->ok()) {
    std::fprintf(stderr, "%s: the job failed:\n%s", program_name.c_str(),
                 result->Summary().c_str());
    return 1;
  }
  std::printf("all %d ranks succeeded\n", world_size);
  return 0;
}

}  // namespace fsdp
