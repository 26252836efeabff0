#include "comm/local_launcher.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <algorithm>
#include <csignal>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string MakeLogDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(tmp ? tmp : "/tmp") + "/launcher_XXXXXX";
  EXPECT_NE(::mkdtemp(dir.data()), nullptr);
  return dir;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

LocalLaunchOptions ShellJob(int world_size, const std::string& script) {
  LocalLaunchOptions options;
  options.world_size = world_size;
  options.program = "/bin/sh";
  options.args = {"-c", script};
  options.log_dir = MakeLogDir();
  options.timeout = std::chrono::seconds(20);
  return options;
}

TEST(LocalLauncher, GivesEveryRankTheRendezvousEnvironment) {
  LocalLaunchOptions options = ShellJob(
      3, "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR "
         "$TORCHELASTIC_USE_AGENT_STORE $EXTRA ${DROPPED:-unset} omp=$OMP_NUM_THREADS "
         "$MASTER_PORT");
  options.extra_env = {{"EXTRA", "x"}};
  options.unset_env = {"DROPPED"};
  ::setenv("DROPPED", "leaked", 1);
  ::setenv("OMP_NUM_THREADS", "5", 1);  // The launcher's own setting wins.
  auto result = LaunchLocalRanks(options);
  ::unsetenv("DROPPED");
  ::unsetenv("OMP_NUM_THREADS");
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->ok()) << result->Summary();
  for (int rank = 0; rank < 3; ++rank) {
    const std::string log = ReadFile(result->ranks[rank].log_path);
    EXPECT_THAT(log, HasSubstr(std::to_string(rank) + " 3 " + std::to_string(rank) +
                               " 3 127.0.0.1 True x unset omp=5 "));
  }
}

TEST(LocalLauncher, SetsTheVariablesOfTorchrunsAgent) {
  ::unsetenv("TORCH_NCCL_ASYNC_ERROR_HANDLING");
  auto result = LaunchLocalRanks(ShellJob(
      2, "echo $ROLE_RANK $GROUP_RANK $ROLE_WORLD_SIZE $GROUP_WORLD_SIZE $ROLE_NAME "
         "$TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS $TORCHELASTIC_RUN_ID "
         "$TORCH_NCCL_ASYNC_ERROR_HANDLING"));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(ReadFile(result->ranks[1].log_path), "1 0 2 1 default 0 0 none 1\n");
}

// The ranks are their own process groups, so a terminal's Ctrl-C reaches only
// the launcher: it must pass the signal on and report that it did.
TEST(LocalLauncher, ForwardsSignalsToEveryRank) {
  LocalLaunchOptions options = ShellJob(
      2, "trap 'echo got-term; exit 7' TERM; echo ready; while :; do sleep 0.05; done");
  std::thread signaller;
  options.on_started = [&](const std::vector<int>& pids) {
    EXPECT_EQ(pids.size(), 2u);
    signaller = std::thread([log_dir = options.log_dir] {
      // Once both ranks have installed their trap.
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (std::chrono::steady_clock::now() < give_up &&
             (ReadFile(log_dir + "/rank_0.log").find("ready") == std::string::npos ||
              ReadFile(log_dir + "/rank_1.log").find("ready") == std::string::npos)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      ::kill(::getpid(), SIGTERM);
    });
  };
  auto result = LaunchLocalRanks(options);
  signaller.join();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->forwarded_signal, SIGTERM);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_GT(result->ranks[rank].pid, 0);
    EXPECT_THAT(result->ranks[rank].Describe(),
                HasSubstr("rank " + std::to_string(rank) + " exited with code 7"));
    EXPECT_THAT(ReadFile(result->ranks[rank].log_path), HasSubstr("got-term"));
  }
}

TEST(LocalLauncher, GivesEachRankItsShareOfTheCores) {
  ::unsetenv("OMP_NUM_THREADS");
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  auto result = LaunchLocalRanks(ShellJob(2, "echo omp=$OMP_NUM_THREADS"));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_THAT(ReadFile(result->ranks[1].log_path),
              HasSubstr("omp=" + std::to_string(std::max(1u, cores / 2))));
}

TEST(LocalLauncher, RanksInheritOnlyTheStandardStreams) {
  // ls of the rank's own descriptors: 0, 1, 2 and the one ls opens for
  // /proc/self/fd itself.
  auto result = LaunchLocalRanks(ShellJob(1, "ls /proc/self/fd | tr '\\n' ' '"));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(ReadFile(result->ranks[0].log_path), "0 1 2 3 ");
}

TEST(LocalLauncher, ReportsExitCodesAndSignals) {
  auto result = LaunchLocalRanks(ShellJob(
      3, "if [ $RANK = 1 ]; then echo boom >&2; exit 3; fi; "
         "if [ $RANK = 2 ]; then kill -TERM $$; fi"));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_FALSE(result->ok());
  EXPECT_THAT(result->FailedRanks(), ElementsAre(1, 2));
  const std::string summary = result->Summary();
  EXPECT_THAT(summary, HasSubstr("rank 1 exited with code 3"));
  EXPECT_THAT(summary, HasSubstr("boom"));  // The tail of rank 1's log.
  EXPECT_THAT(summary, HasSubstr("rank 2 died of signal 15"));
  EXPECT_THAT(summary, ::testing::Not(HasSubstr("rank 0")));
}

TEST(LocalLauncher, KillsRanksStillRunningAtTheTimeout) {
  LocalLaunchOptions options = ShellJob(2, "if [ $RANK = 1 ]; then sleep 60; fi");
  options.timeout = std::chrono::milliseconds(1500);
  const auto start = std::chrono::steady_clock::now();
  auto result = LaunchLocalRanks(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_THAT(result->FailedRanks(), ElementsAre(1));
  EXPECT_THAT(result->Summary(),
              HasSubstr("rank 1 was killed: it did not finish within the job timeout"));
}

TEST(LocalLauncher, KillsSurvivorsAfterTheFailureGrace) {
  LocalLaunchOptions options =
      ShellJob(3, "if [ $RANK = 0 ]; then exit 2; fi; sleep 60");
  options.failure_grace = std::chrono::milliseconds(300);
  const auto start = std::chrono::steady_clock::now();
  auto result = LaunchLocalRanks(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_THAT(result->FailedRanks(), ElementsAre(0, 1, 2));
  EXPECT_THAT(result->Summary(), HasSubstr("rank 0 exited with code 2"));
  EXPECT_THAT(result->Summary(),
              HasSubstr("rank 2 was killed: it was still running after another rank failed"));
}

TEST(LocalLauncher, RejectsBadOptions) {
  LocalLaunchOptions options = ShellJob(2, "true");
  options.program = "/nonexistent/trainer";
  EXPECT_THAT(LaunchLocalRanks(options).status().message(),
              HasSubstr("'/nonexistent/trainer' is not an executable file"));
  options = ShellJob(0, "true");
  EXPECT_THAT(LaunchLocalRanks(options).status().message(),
              HasSubstr("world size 0 must be >= 1"));
  options = ShellJob(2, "true");
  options.log_dir = "/nonexistent/logs";
  EXPECT_THAT(LaunchLocalRanks(options).status().message(),
              HasSubstr("log directory '/nonexistent/logs' does not exist"));
}

}  // namespace
}  // namespace fsdp
