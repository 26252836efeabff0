#include "testing/multi_rank.h"

#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "comm/gloo_collectives.h"
#include "comm/launch_environment.h"
#include "comm/rendezvous.h"
#include "gtest/gtest.h"
#include "launch/local_launcher.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"

namespace fsdp::testing {
namespace {

// Set in the environment of rank processes: which RunOnProcessRanks call of
// the current test this process exists to run.
constexpr char kWorkerCallVariable[] = "FSDP_TESTING_WORKER_CALL";

// Variables of the test runner that must not reach rank processes: with
// them, a rank would write the parent's result files or skip the test as
// belonging to another shard.
const std::vector<std::string> kRunnerVariables = {
    "GTEST_OUTPUT",         "XML_OUTPUT_FILE",   "GTEST_TOTAL_SHARDS",
    "GTEST_SHARD_INDEX",    "GTEST_SHARD_STATUS_FILE", "TEST_PREMATURE_EXIT_FILE",
    "TEST_TOTAL_SHARDS",    "TEST_SHARD_INDEX",  "TEST_SHARD_STATUS_FILE",
    kWorkerCallVariable};

std::string CurrentTestName() {
  const ::testing::TestInfo* info =
      ::testing::UnitTest::GetInstance()->current_test_info();
  if (info == nullptr) return "";
  return absl::StrCat(info->test_suite_name(), ".", info->name());
}

// Numbers the RunOnProcessRanks calls within each test, in the parent and in
// the rank processes alike.
int NextProcessCallIndex() {
  static std::mutex mu;
  static std::map<std::string, int> calls;
  std::lock_guard<std::mutex> lock(mu);
  return calls[CurrentTestName()]++;
}

std::string DescribeCurrentException() {
  return std::string(StatusFromCurrentException().message());
}

// Runs as rank RANK of a process-mode call: build the group from the
// environment, run the body, exit without returning to the test.
[[noreturn]] void RunAsRankProcess(const RankBody& body, const MultiRankOptions& options) {
  int exit_code = 0;
  std::unique_ptr<Collectives> comm;
  try {
    LaunchEnvironment env = ValueOrThrow(ReadLaunchEnvironment());
    GlooOptions gloo = options.gloo;
    gloo.timeout = options.collective_timeout;
    comm = ValueOrThrow(CreateGlooCollectivesFromEnvironment(env, gloo));
    SCOPED_TRACE(absl::StrCat("rank ", env.rank));
    body(*comm);
    if (::testing::Test::HasFailure()) {
      std::fprintf(stderr, "rank %d: the test body recorded gtest failures (above)\n",
                   env.rank);
      exit_code = 1;
    }
  } catch (...) {
    const std::string error = DescribeCurrentException();
    // The other ranks' failures then quote this one instead of waiting.
    if (comm) comm->ReportStopped(error);
    std::fprintf(stderr, "rank process failed: %s\n", error.c_str());
    exit_code = 1;
  }
  std::fflush(nullptr);
  // Skip static destructors and gtest's reporting: the parent reports.
  std::_Exit(exit_code);
}

}  // namespace

absl::Status RunOnThreadRanks(int world_size, const RankBody& body,
                              const MultiRankOptions& options) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world size ", world_size, " < 1"));
  }
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    int finished = 0;
    std::vector<bool> done;
    std::vector<std::string> errors;
  };
  auto shared = std::make_shared<Shared>();
  shared->done.assign(world_size, false);
  shared->errors.assign(world_size, "");
  auto store = c10::make_intrusive<c10d::HashStore>();

  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([=, &body, &options] {
      std::string error;
      std::unique_ptr<Collectives> comm;
      try {
        SCOPED_TRACE(absl::StrCat("rank ", rank));
        GlooOptions gloo = options.gloo;
        gloo.interface.clear();
        gloo.hostname = "127.0.0.1";
        gloo.timeout = options.collective_timeout;
        comm = ValueOrThrow(CreateGlooCollectives(store, rank, world_size, gloo));
        body(*comm);
      } catch (...) {
        error = DescribeCurrentException();
        if (comm) comm->ReportStopped(error);
      }
      comm.reset();  // Closes this rank's connections before it reports done.
      std::lock_guard<std::mutex> lock(shared->mu);
      shared->errors[rank] = error;
      shared->done[rank] = true;
      ++shared->finished;
      shared->cv.notify_all();
    });
  }

  std::unique_lock<std::mutex> lock(shared->mu);
  const bool all_finished = shared->cv.wait_for(lock, options.timeout, [&] {
    return shared->finished == world_size;
  });
  if (!all_finished) {
    std::vector<int> hung;
    for (int rank = 0; rank < world_size; ++rank) {
      if (!shared->done[rank]) hung.push_back(rank);
    }
    std::string message = absl::StrCat(
        "multi-rank test ", CurrentTestName(), ": rank(s) ", absl::StrJoin(hung, ", "),
        " of ", world_size, " did not finish within ", options.timeout.count(), " ms");
    for (int rank = 0; rank < world_size; ++rank) {
      if (!shared->errors[rank].empty()) {
        absl::StrAppend(&message, "\nrank ", rank, " failed: ", shared->errors[rank]);
      }
    }
    // The stuck threads still use this test's objects, so the test cannot
    // return; the process ends with the diagnosis.
    std::fprintf(stderr, "%s\n", message.c_str());
    std::fflush(nullptr);
    std::_Exit(kHungRanksExitCode);
  }
  lock.unlock();
  for (std::thread& t : threads) t.join();

  std::vector<std::string> failures;
  for (int rank = 0; rank < world_size; ++rank) {
    if (!shared->errors[rank].empty()) {
      failures.push_back(absl::StrCat("rank ", rank, ": ", shared->errors[rank]));
    }
  }
  if (failures.empty()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(failures.size(), " of ", world_size,
                                          " ranks failed:\n",
                                          absl::StrJoin(failures, "\n")));
}

absl::Status RunOnProcessRanks(int world_size, const RankBody& body,
                               const MultiRankOptions& options) {
  const int call = NextProcessCallIndex();
  if (std::optional<std::string> worker_call = ProcessEnv(kWorkerCallVariable)) {
    int wanted = -1;
    if (absl::SimpleAtoi(*worker_call, &wanted) && wanted == call) {
      RunAsRankProcess(body, options);
    }
    return absl::OkStatus();  // Another call of this test is this process's job.
  }
  if (world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world size ", world_size, " < 1"));
  }
  const std::string test = CurrentTestName();
  if (test.empty()) {
    return absl::FailedPreconditionError("RunOnProcessRanks must be called inside a TEST");
  }
  std::string log_root = "/tmp";
  if (std::optional<std::string> tmp = ProcessEnv("TEST_TMPDIR")) log_root = *tmp;
  std::string log_dir = log_root + "/multi_rank_XXXXXX";
  if (::mkdtemp(log_dir.data()) == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot create a log directory under ",
                                               log_root));
  }

  LocalLaunchOptions launch;
  launch.nproc_per_node = world_size;
  launch.program = "/proc/self/exe";
  launch.args = {absl::StrCat("--gtest_filter=", test)};
  launch.timeout = options.timeout;
  launch.failure_grace = options.collective_timeout;
  launch.log_dir = log_dir;
  launch.unset_env = kRunnerVariables;
  launch.extra_env = {{kWorkerCallVariable, std::to_string(call)}};
  FSDP_ASSIGN_OR_RETURN(LaunchResult result, LaunchLocalRanks(launch));
  if (result.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(
      "multi-rank test ", test, ": rank(s) ", absl::StrJoin(result.FailedRanks(), ", "),
      " of ", world_size, " failed (logs in ", log_dir, "):\n", result.Summary()));
}

}  // namespace fsdp::testing
