// What the launcher says about a job: each rank's ending in words, the
// result's summary with the tail of each failed rank's log, and the
// LaunchAndReport front end that prints them and turns them into main()'s
// exit code. Kept apart from local_launcher.cc, which runs the job, so that
// the wording can change without touching the process and store machinery;
// everything here reads only what LaunchLocalRanks returns.
#include "launch/local_launcher.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "launch/forwarded_signals.h"

namespace fsdp {
namespace {

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

}  // namespace

std::string RankOutcome::Describe() const {
  std::string said;
  if (error.has_value()) {
    const std::string first_line = error->message.substr(0, error->message.find('\n'));
    said = absl::StrCat(": ", first_line.substr(0, 500), first_line.size() > 500 ? "..." : "");
  }
  return absl::StrCat(EndingText(), said);
}

std::string RankOutcome::EndingText() const {
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

int LaunchSelfAndReport(int argc, char** argv, const SelfLaunch& launch,
                        const std::string& program_name) {
  LocalLaunchOptions options;
  options.nproc_per_node = launch.world_size;
  options.program = "/proc/self/exe";
  options.args.assign(argv + 1, argv + argc);
  options.timeout = launch.timeout;
  options.max_restarts = launch.max_restarts;
  options.restart_backoff = launch.restart_backoff;
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
  options.on_restart = [&](const JobRestart& restart) {
    std::fprintf(stderr, "%s: restart %d of %d in %lld ms%s; the attempt before it failed: %s\n",
                 program_name.c_str(), restart.count, options.max_restarts,
                 static_cast<long long>(restart.backoff.count()), here.c_str(),
                 restart.cause.c_str());
    std::fflush(stderr);
  };
  const auto restarts_said = [](const LaunchResult& result) -> std::string {
    if (result.restarts.empty()) return "";
    return absl::StrCat(" after ", result.restarts.size(), " restart",
                        result.restarts.size() > 1 ? "s" : "");
  };
  absl::StatusOr<LaunchResult> result = LaunchLocalRanks(options);
  if (!result.ok()) {
    std::fprintf(stderr, "%s: %s\n", program_name.c_str(), result.status().ToString().c_str());
    // Interrupted before its ranks started (waiting for the other nodes).
    if (result.status().code() == absl::StatusCode::kCancelled &&
        launch_internal::FirstForwardedSignal() != 0) {
      return 128 + launch_internal::FirstForwardedSignal();
    }
    return 2;
  }
  if (result->forwarded_signal != 0) {
    std::fprintf(stderr, "%s: interrupted by signal %d (%s), forwarded to every rank%s\n%s",
                 program_name.c_str(), result->forwarded_signal,
                 strsignal(result->forwarded_signal), here.c_str(), result->Summary().c_str());
    return 128 + result->forwarded_signal;
  }
  const std::string after = restarts_said(*result);
  if (!result->ok()) {
    std::fprintf(stderr, "%s: the job failed%s%s%s:\n%s", program_name.c_str(), after.c_str(),
                 result->no_restart.empty() ? "" : "; no restart: ", result->no_restart.c_str(),
                 result->Summary().c_str());
    return 1;
  }
  if (options.nnodes == 1) {
    std::printf("all %d ranks succeeded%s\n", nproc, after.c_str());
  } else if (options.node_rank == 0) {
    std::printf("all %d ranks on %d nodes succeeded%s\n", nproc * options.nnodes, options.nnodes,
                after.c_str());
  } else {
    std::printf("all %d ranks of node %d succeeded (ranks %d-%d)%s\n", nproc, options.node_rank,
                first_rank, first_rank + nproc - 1, after.c_str());
  }
  return 0;
}

}  // namespace fsdp
