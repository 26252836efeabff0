// fsdp_launch: runs any program as the ranks of a job, the way
// `torchrun --no-python` does, with the rendezvous store served by the
// launcher (launch/local_launcher.h): on one host as `torchrun --standalone
// --nproc-per-node=N`, or across hosts, one launcher on each, as torchrun's
// static rendezvous (--nnodes --node-rank --master-addr --master-port).
//
//   bazel run //launch:fsdp_launch -- --nproc_per_node=2 -- /path/to/trainer --flag=x
//   bazel run //launch:fsdp_launch -- --nproc_per_node=2 -- /usr/bin/python3 ddp.py
//   # on host A (node 0) and host B (node 1), the same but --node_rank:
//   fsdp_launch --nnodes=2 --node_rank=0 --master_addr=A --nproc_per_node=2 -- trainer
//
// With --max_restarts=N a failed job is stopped and started again, at most
// N times (launch/local_launcher.h says when it is not).
//
// Exits 0 when every rank succeeded, 1 naming each rank that failed, 2 when
// the job could not start, and 128 + the signal when interrupted (the signal
// is forwarded to every rank first).
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "launch/local_launcher.h"

ABSL_FLAG(int, nproc_per_node, 2, "Ranks to start on this host.");
ABSL_FLAG(int, nnodes, 1, "Hosts the job runs on, one launcher each.");
ABSL_FLAG(int, node_rank, 0, "This host's place among them (0: the one serving the store).");
ABSL_FLAG(std::string, master_addr, "",
          "With --nnodes > 1: the address every host reaches node 0's launcher at.");
ABSL_FLAG(int, master_port, 29500, "With --nnodes > 1: the port node 0's launcher serves.");
ABSL_FLAG(int, join_timeout_s, 300,
          "With --nnodes > 1: seconds to wait for every node's launcher before starting.");
ABSL_FLAG(int, exit_barrier_timeout_s, 300,
          "With --nnodes > 1: seconds node 0's launcher keeps serving the store for the "
          "other nodes once its own ranks have ended.");
ABSL_FLAG(int, node_timeout_s, 30,
          "With --nnodes > 1: a node whose launcher is silent this long counts as lost, and "
          "the job fails.");
ABSL_FLAG(int, timeout_s, 3600,
          "Kill every rank still running after this many seconds (of the whole job, restarts "
          "included).");
ABSL_FLAG(int, failure_grace_s, 10,
          "After a rank fails or a signal arrives, seconds the others get to end on their "
          "own before they are killed.");
ABSL_FLAG(int, max_restarts, 0,
          "When the job fails, stop every rank and start them all again, at most this many "
          "times (torchrun's --max-restarts; ranks see TORCHELASTIC_RESTART_COUNT). A failure "
          "that repeats at the same step with the same message is not restarted again.");
ABSL_FLAG(double, restart_backoff_s, 1.0,
          "Seconds to wait before the first restart; doubled before each next, at most 60.");
ABSL_FLAG(std::string, log_dir, "",
          "Write rank r's output to <log_dir>/rank_<r>.log instead of this terminal.");

namespace {

// A name without a slash is looked up in PATH, as a shell would.
std::string ResolveProgram(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    const std::string candidate = dirs.substr(start, end - start) + "/" + name;
    if (end > start && ::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  return name;  // The launcher names it as not executable.
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "fsdp_launch [--nproc_per_node=N] [--timeout_s=S] [--log_dir=D] [--max_restarts=R]\n"
      "            [--nnodes=M --node_rank=K --master_addr=HOST [--master_port=P]]\n"
      "            -- PROGRAM [ARGS...]");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  // Under `bazel run`, relative paths (the program, its outputs) are the
  // user's, not the runfiles tree's that Bazel starts us in.
  if (const char* dir = std::getenv("BUILD_WORKING_DIRECTORY"); dir != nullptr && *dir != '\0') {
    if (::chdir(dir) != 0) {
      std::fprintf(stderr, "fsdp_launch: cannot enter BUILD_WORKING_DIRECTORY '%s': %s\n", dir,
                   std::strerror(errno));
      return 2;
    }
  }
  if (rest.size() < 2) {
    std::fprintf(stderr, "fsdp_launch: no program given\nusage: %s\n",
                 absl::ProgramUsageMessage().data());
    return 2;
  }
  fsdp::LocalLaunchOptions options;
  options.nproc_per_node = absl::GetFlag(FLAGS_nproc_per_node);
  options.program = ResolveProgram(rest[1]);
  options.args.assign(rest.begin() + 2, rest.end());
  options.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s));
  options.failure_grace = std::chrono::seconds(absl::GetFlag(FLAGS_failure_grace_s));
  options.log_dir = absl::GetFlag(FLAGS_log_dir);
  options.nnodes = absl::GetFlag(FLAGS_nnodes);
  options.node_rank = absl::GetFlag(FLAGS_node_rank);
  options.master_addr = absl::GetFlag(FLAGS_master_addr);
  options.master_port = absl::GetFlag(FLAGS_master_port);
  options.join_timeout = std::chrono::seconds(absl::GetFlag(FLAGS_join_timeout_s));
  options.exit_barrier_timeout = std::chrono::seconds(absl::GetFlag(FLAGS_exit_barrier_timeout_s));
  options.node_timeout = std::chrono::seconds(absl::GetFlag(FLAGS_node_timeout_s));
  options.max_restarts = absl::GetFlag(FLAGS_max_restarts);
  const double backoff_s = absl::GetFlag(FLAGS_restart_backoff_s);
  if (!(backoff_s >= 0)) {
    std::fprintf(stderr, "fsdp_launch: --restart_backoff_s=%g: must be >= 0\n", backoff_s);
    return 2;
  }
  // Back-offs longer than 60 s are cut to 60 s (and beyond, no longer an integer).
  options.restart_backoff =
      std::chrono::milliseconds(static_cast<int64_t>(std::min(backoff_s, 60.0) * 1000));
  return fsdp::LaunchAndReport(options, "fsdp_launch");
}
