// fsdp_launch: runs any program as the ranks of a single-node job, the way
// `torchrun --standalone --no-python --nproc-per-node=N` does, with the
// rendezvous store served by the launcher (comm/local_launcher.h).
//
//   bazel run //comm:launch -- --nproc_per_node=2 -- /path/to/trainer --flag=x
//   bazel run //comm:launch -- --nproc_per_node=2 -- /usr/bin/python3 ddp.py
//
// Exits 0 when every rank succeeded, 1 naming each rank that failed, 2 when
// the job could not start, and 128 + the signal when interrupted (the signal
// is forwarded to every rank first).
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "comm/local_launcher.h"

ABSL_FLAG(int, nproc_per_node, 2, "Ranks to start on this host.");
ABSL_FLAG(int, timeout_s, 3600, "Kill every rank still running after this many seconds.");
ABSL_FLAG(int, failure_grace_s, 10,
          "After a rank fails or a signal arrives, seconds the others get to end on their "
          "own before they are killed.");
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
      "fsdp_launch [--nproc_per_node=N] [--timeout_s=S] [--log_dir=D] -- PROGRAM [ARGS...]");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() < 2) {
    std::fprintf(stderr, "fsdp_launch: no program given\nusage: %s\n",
                 absl::ProgramUsageMessage().data());
    return 2;
  }
  fsdp::LocalLaunchOptions options;
  options.world_size = absl::GetFlag(FLAGS_nproc_per_node);
  options.program = ResolveProgram(rest[1]);
  options.args.assign(rest.begin() + 2, rest.end());
  options.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s));
  options.failure_grace = std::chrono::seconds(absl::GetFlag(FLAGS_failure_grace_s));
  options.log_dir = absl::GetFlag(FLAGS_log_dir);
  return fsdp::LaunchAndReport(options, "fsdp_launch");
}
