#include "launch/rank_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace fsdp {
namespace {

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
                                              "TORCHELASTIC_RUN_ID",
                                              "TORCHELASTIC_ERROR_FILE"};

// The environment of local rank `local_rank`, as "NAME=value" strings.
std::vector<std::string> RankEnvironment(const LocalLaunchOptions& options, int local_rank,
                                         int port, const RankAttempt& attempt) {
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
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt.restart_count);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(options.max_restarts);
  env["TORCHELASTIC_RUN_ID"] = attempt.run_id;
  env["TORCHELASTIC_ERROR_FILE"] = attempt.error_file;
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

}  // namespace

absl::StatusOr<pid_t> StartRank(const LocalLaunchOptions& options, int local_rank, int port,
                                const std::string& log_path, const RankAttempt& attempt) {
  std::vector<std::string> argv_strings = {options.program};
  argv_strings.insert(argv_strings.end(), options.args.begin(), options.args.end());
  std::vector<std::string> env_strings = RankEnvironment(options, local_rank, port, attempt);
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

}  // namespace fsdp
