#include "launch/local_launcher.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/free_port.h"

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

LocalLaunchOptions ShellJob(int nproc, const std::string& script) {
  LocalLaunchOptions options;
  options.nproc_per_node = nproc;
  options.program = "/bin/sh";
  options.args = {"-c", script};
  options.log_dir = MakeLogDir();
  options.timeout = std::chrono::seconds(20);
  return options;
}

TEST(LocalLauncher, GivesEveryRankTheRendezvousEnvironment) {
  LocalLaunchOptions options =
      ShellJob(3,
               "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR "
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
  auto result = LaunchLocalRanks(
      ShellJob(2,
               "echo $ROLE_RANK $GROUP_RANK $ROLE_WORLD_SIZE $GROUP_WORLD_SIZE $ROLE_NAME "
               "$TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS $TORCHELASTIC_RUN_ID "
               "$TORCH_NCCL_ASYNC_ERROR_HANDLING"));
  ASSERT_TRUE(result.ok()) << result.status();
  // The run id: 16 random hex digits, as a --standalone torchrun's is random.
  EXPECT_THAT(ReadFile(result->ranks[1].log_path),
              ::testing::MatchesRegex("1 0 2 1 default 0 0 [0-9a-f]{16} 1\n"));
}

// A failed rank's error file, as a torchelastic @record writes it.
constexpr char kWriteErrorFile[] =
    "printf \"{\\\"message\\\": {\\\"message\\\": \\\"loss is NaN\\\", "
    "\\\"extraInfo\\\": {\\\"step\\\": \\\"3\\\", \\\"timestamp\\\": "
    "\\\"1\\\"}}}\" > $TORCHELASTIC_ERROR_FILE";

LocalLaunchOptions RestartingJob(int nproc, const std::string& script, int max_restarts) {
  LocalLaunchOptions options = ShellJob(nproc, script);
  options.max_restarts = max_restarts;
  options.restart_backoff = std::chrono::milliseconds(100);
  options.failure_grace = std::chrono::seconds(1);
  return options;
}

TEST(LocalLauncherRestarts, RestartsEveryRankAfterAFailureAndCountsTheRestarts) {
  // Rank 1 fails in the first attempt; rank 0 would wait for it forever.
  const std::string script =
      "echo attempt $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS "
      "$TORCHELASTIC_RUN_ID; if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then "
      "if [ $RANK = 1 ]; then " + std::string(kWriteErrorFile) + "; exit 3; fi; sleep 60; fi";
  std::vector<JobRestart> seen;
  LocalLaunchOptions options = RestartingJob(2, script, 3);
  options.on_restart = [&](const JobRestart& restart) { seen.push_back(restart); };
  const auto start = std::chrono::steady_clock::now();
  auto result = LaunchLocalRanks(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
  EXPECT_TRUE(result->ok()) << result->Summary();
  ASSERT_EQ(result->restarts.size(), 1u);
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].count, 1);
  EXPECT_EQ(seen[0].cause, "rank 1 at step 3: loss is NaN");
  // Each attempt has its own log; the run id stays.
  const std::string first = ReadFile(options.log_dir + "/rank_0.log");
  const std::string second = ReadFile(options.log_dir + "/rank_0.restart_1.log");
  ASSERT_THAT(first, HasSubstr("attempt 0 of 3 "));
  ASSERT_THAT(second, HasSubstr("attempt 1 of 3 "));
  EXPECT_EQ(first.substr(first.size() - 17), second.substr(second.size() - 17));
  EXPECT_EQ(result->ranks[0].log_path, options.log_dir + "/rank_0.restart_1.log");
}

TEST(LocalLauncherRestarts, AFailureThatRepeatsAtTheSameStepIsDeterministic) {
  const std::string script =
      "if [ $RANK = 1 ]; then " + std::string(kWriteErrorFile) + "; exit 1; fi; sleep 60";
  auto result = LaunchLocalRanks(RestartingJob(2, script, 5));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_FALSE(result->ok());
  // The third identical failure ends it, three restarts early.
  EXPECT_EQ(result->restarts.size(), 2u);
  EXPECT_THAT(result->no_restart, HasSubstr("the same failure (rank 1 at step 3: loss is NaN) "
                                            "ended the last 3 attempts: it is deterministic"));
  EXPECT_THAT(result->Summary(), HasSubstr("rank 1 exited with code 1: loss is NaN"));
}

TEST(LocalLauncherRestarts, TheLastRestartFailingLikeEveryAttemptIsDeterministic) {
  const std::string script = "if [ $RANK = 1 ]; then " + std::string(kWriteErrorFile) +
                             "; exit 1; fi; sleep 60";
  auto result = LaunchLocalRanks(RestartingJob(2, script, 1));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->restarts.size(), 1u);
  EXPECT_THAT(result->no_restart, HasSubstr("ended the last 2 attempts: it is deterministic"));
}

TEST(LocalLauncherRestarts, AFailureWithoutAnErrorFileIsRetriedUpToTheLimit) {
  auto result = LaunchLocalRanks(RestartingJob(2, "if [ $RANK = 1 ]; then exit 4; fi", 2));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_FALSE(result->ok());
  EXPECT_EQ(result->restarts.size(), 2u);
  EXPECT_EQ(result->restarts[1].backoff, std::chrono::milliseconds(200));
  EXPECT_EQ(result->no_restart, "all 2 restarts were used");
  EXPECT_THAT(result->restarts[0].cause, HasSubstr("rank 1 exited with code 4"));
}

TEST(LocalLauncherRestarts, ASignalEndsTheJobWithoutARestart) {
  LocalLaunchOptions options = RestartingJob(2, "sleep 60", 3);
  options.on_started = [](const std::vector<int>&) { std::raise(SIGTERM); };
  auto result = LaunchLocalRanks(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->forwarded_signal, SIGTERM);
  EXPECT_TRUE(result->restarts.empty());
  EXPECT_EQ(result->no_restart, "the launcher was interrupted");
}

// The ranks are their own process groups, so a terminal's Ctrl-C reaches only
// the launcher: it must pass the signal on and report that it did.
TEST(LocalLauncher, ForwardsSignalsToEveryRank) {
  LocalLaunchOptions options =
      ShellJob(2, "trap 'echo got-term; exit 7' TERM; echo ready; while :; do sleep 0.05; done");
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
  auto result = LaunchLocalRanks(ShellJob(3,
                                          "if [ $RANK = 1 ]; then echo boom >&2; exit 3; fi; "
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
  LocalLaunchOptions options = ShellJob(3, "if [ $RANK = 0 ]; then exit 2; fi; sleep 60");
  options.failure_grace = std::chrono::milliseconds(300);
  const auto start = std::chrono::steady_clock::now();
  auto result = LaunchLocalRanks(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_THAT(result->FailedRanks(), ElementsAre(0, 1, 2));
  EXPECT_THAT(result->Summary(), HasSubstr("rank 0 exited with code 2"));
  EXPECT_THAT(result->Summary(),
              HasSubstr("rank 2 was killed: it was still running after the job failed"));
}

TEST(LocalLauncher, RejectsBadOptions) {
  LocalLaunchOptions options = ShellJob(2, "true");
  options.program = "/nonexistent/trainer";
  EXPECT_THAT(LaunchLocalRanks(options).status().message(),
              HasSubstr("'/nonexistent/trainer' is not an executable file"));
  options = ShellJob(0, "true");
  EXPECT_THAT(LaunchLocalRanks(options).status().message(),
              HasSubstr("nproc_per_node 0 must be >= 1"));
  options = ShellJob(2, "true");
  options.log_dir = "/nonexistent/logs";
  EXPECT_THAT(LaunchLocalRanks(options).status().message(),
              HasSubstr("log directory '/nonexistent/logs' does not exist"));
}

// Node 0 of a two-node job on this host, launched here.
LocalLaunchOptions NodeZero(int port, int nproc, const std::string& script) {
  LocalLaunchOptions options = ShellJob(nproc, script);
  options.nnodes = 2;
  options.node_rank = 0;
  options.master_addr = "127.0.0.1";
  options.master_port = port;
  options.failure_grace = std::chrono::seconds(1);
  options.join_timeout = std::chrono::seconds(20);
  return options;
}

// Another node's launcher, the fsdp_launch binary, started in the
// background: its output goes to <dir>/out, its exit status to <dir>/rc
// and its pid to <dir>/pid.
struct OtherNode {
  std::string dir;
  std::string Output() const { return ReadFile(dir + "/out"); }
  // -1 until it has ended (waits up to 20 s).
  int ExitCode() const {
    for (int i = 0; i < 200; ++i) {
      const std::string rc = ReadFile(dir + "/rc");
      if (!rc.empty()) return std::atoi(rc.c_str());
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return -1;
  }
  int Pid() const { return std::atoi(ReadFile(dir + "/pid").c_str()); }
};

OtherNode StartNode(int node_rank, int port, int nproc, const std::string& script,
                    const std::string& flags = "") {
  OtherNode node{MakeLogDir()};
  const std::string command =
      "launch/fsdp_launch --nnodes=2 --node_rank=" + std::to_string(node_rank) +
      " --master_addr=127.0.0.1 --master_port=" + std::to_string(port) +
      " --nproc_per_node=" + std::to_string(nproc) + " --failure_grace_s=1 --join_timeout_s=20 " +
      "--timeout_s=60 --log_dir=" + node.dir + " " + flags + " -- /bin/sh -c '" + script + "'";
  EXPECT_EQ(std::system(("(" + command + " > " + node.dir + "/out 2>&1 & echo $! > " + node.dir +
                         "/pid; wait $!; echo $? > " + node.dir + "/rc) &")
                            .c_str()),
            0);
  return node;
}

constexpr char kWhereAmI[] =
    "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $GROUP_WORLD_SIZE "
    "$MASTER_ADDR";

TEST(LocalLauncherAcrossNodes, TwoLaunchersRunOneJob) {
  const int port = ::fsdp::testing::FreeTcpPort();
  const OtherNode node1 = StartNode(1, port, 2, kWhereAmI);
  auto result = LaunchLocalRanks(NodeZero(port, 2, kWhereAmI));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->ok()) << result->Summary();
  ASSERT_EQ(result->ranks.size(), 2u);
  EXPECT_EQ(result->ranks[1].rank, 1);
  EXPECT_EQ(ReadFile(result->ranks[1].log_path), "1 4 1 2 0 2 127.0.0.1\n");
  ASSERT_EQ(node1.ExitCode(), 0) << node1.Output();
  EXPECT_EQ(ReadFile(node1.dir + "/rank_3.log"), "3 4 1 2 1 2 127.0.0.1\n");
  EXPECT_THAT(node1.Output(), HasSubstr("all 2 ranks of node 1 succeeded (ranks 2-3)"));
}

TEST(LocalLauncherAcrossNodes, AFailureOnOneNodeStopsEveryNode) {
  const std::string script = "if [ $RANK = 3 ]; then exit 3; fi; sleep 60";
  const int port = ::fsdp::testing::FreeTcpPort();
  const OtherNode node1 = StartNode(1, port, 2, script);
  const auto start = std::chrono::steady_clock::now();
  auto result = LaunchLocalRanks(NodeZero(port, 2, script));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  EXPECT_THAT(result->FailedRanks(), ElementsAre(0, 1));
  const std::string summary = result->Summary();
  EXPECT_THAT(summary, HasSubstr("rank 0 was killed: it was still running after the job failed"));
  // Node 1's final report: the cause first, then the rank killed for it.
  EXPECT_THAT(summary, HasSubstr("node 1: rank 3 exited with code 3; rank 2 was killed"));
  EXPECT_EQ(node1.ExitCode(), 1);
  EXPECT_THAT(node1.Output(), HasSubstr("rank 3 exited with code 3"));
}

TEST(LocalLauncherAcrossNodes, NodeZeroRestartsEveryNodeAfterAFailureOnAnother) {
  const std::string script =
      "if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then if [ $RANK = 3 ]; then exit 3; fi; sleep 60; "
      "fi; echo attempt $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_RUN_ID";
  const int port = ::fsdp::testing::FreeTcpPort();
  const OtherNode node1 =
      StartNode(1, port, 2, script, "--max_restarts=2 --restart_backoff_s=0.1");
  LocalLaunchOptions options = NodeZero(port, 2, script);
  options.max_restarts = 2;
  options.restart_backoff = std::chrono::milliseconds(100);
  auto result = LaunchLocalRanks(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->ok()) << result->Summary();
  ASSERT_EQ(result->restarts.size(), 1u);
  EXPECT_THAT(result->restarts[0].cause, HasSubstr("node 1: rank 3 exited with code 3"));
  ASSERT_EQ(node1.ExitCode(), 0) << node1.Output();
  EXPECT_THAT(node1.Output(), HasSubstr("restart 1 of 2 in 100 ms on node 1 of 2"));
  EXPECT_THAT(node1.Output(), HasSubstr("all 2 ranks of node 1 succeeded (ranks 2-3) after 1 "
                                        "restart"));
  // One run id on both nodes.
  const std::string here = ReadFile(options.log_dir + "/rank_0.restart_1.log");
  ASSERT_THAT(here, HasSubstr("attempt 1 "));
  EXPECT_EQ(ReadFile(node1.dir + "/rank_3.restart_1.log"), here);
}

TEST(LocalLauncherAcrossNodes, ASilentNodeCountsAsLost) {
  const int port = ::fsdp::testing::FreeTcpPort();
  const OtherNode node1 = StartNode(1, port, 2, "exec sleep 60");
  LocalLaunchOptions options = NodeZero(port, 2, "sleep 60");
  options.node_timeout = std::chrono::seconds(3);
  options.on_started = [&](const std::vector<int>&) {
    // Node 1's launcher dies with its ranks (they die with it), as when
    // its host is lost: only its heartbeat stops.
    ASSERT_GT(node1.Pid(), 0);
    ::kill(node1.Pid(), SIGKILL);
  };
  const auto start = std::chrono::steady_clock::now();
  auto result = LaunchLocalRanks(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  EXPECT_THAT(result->FailedRanks(), ElementsAre(0, 1));
  EXPECT_THAT(result->Summary(),
              HasSubstr("node 1: its launcher went silent: no heartbeat for 3000 ms"));
}

// A launcher frozen past node_timeout (SIGSTOP: its ranks run on) is taken
// for lost; when it wakes it learns so and stops its ranks too.
TEST(LocalLauncherAcrossNodes, ANodeTakenForLostStopsToo) {
  const int port = ::fsdp::testing::FreeTcpPort();
  const OtherNode node1 = StartNode(1, port, 1, "exec sleep 60");
  LocalLaunchOptions options = NodeZero(port, 1, "sleep 60");
  options.node_timeout = std::chrono::seconds(3);
  // Frozen well past node_timeout plus a heartbeat check; node 0 serves
  // (its rank stopping within failure_grace) until well after it wakes.
  constexpr auto kFrozen = std::chrono::seconds(8);
  options.failure_grace = std::chrono::seconds(12);
  std::thread freezer;
  options.on_started = [&](const std::vector<int>&) {
    const int pid = node1.Pid();
    ASSERT_GT(pid, 0);
    freezer = std::thread([pid, kFrozen] {
      ::kill(pid, SIGSTOP);
      std::this_thread::sleep_for(kFrozen);
      ::kill(pid, SIGCONT);
    });
  };
  auto result = LaunchLocalRanks(options);
  if (freezer.joinable()) freezer.join();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_THAT(result->Summary(), HasSubstr("node 1: its launcher went silent"));
  EXPECT_EQ(node1.ExitCode(), 1);
  EXPECT_THAT(node1.Output(),
              HasSubstr("node 0's launcher took this node for lost: its launcher went silent"));
  EXPECT_THAT(node1.Output(), HasSubstr("rank 1 was killed: it was still running after the job"));
}

// A signal node 0's launcher forwards stops every node, and node 0 still
// waits for their reports; one that comes while it waits for them ends the
// wait, said as such (nothing was forwarded then).
TEST(LocalLauncherAcrossNodes, SignalsStopEveryNode) {
  const auto signal_after = [](std::chrono::milliseconds delay) {
    return std::thread([delay] {
      std::this_thread::sleep_for(delay);
      ::kill(::getpid(), SIGTERM);
    });
  };
  {
    const int port = ::fsdp::testing::FreeTcpPort();
    const OtherNode node1 = StartNode(1, port, 1, "exec sleep 60");
    LocalLaunchOptions options = NodeZero(port, 1, "exec sleep 60");
    std::thread signaller;
    options.on_started = [&](const std::vector<int>&) {
      signaller = signal_after(std::chrono::milliseconds(500));
    };
    auto result = LaunchLocalRanks(options);
    if (signaller.joinable()) signaller.join();
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->forwarded_signal, SIGTERM);
    EXPECT_THAT(result->Summary(), HasSubstr("rank 0 died of signal 15"));
    EXPECT_THAT(result->Summary(),
                HasSubstr("node 1: rank 1 was killed: it was still running after the job failed"));
    EXPECT_EQ(node1.ExitCode(), 1);
    EXPECT_THAT(node1.Output(),
                HasSubstr("node 0: its launcher was interrupted by signal 15 (Terminated)"));
  }
  {
    const int port = ::fsdp::testing::FreeTcpPort();
    const OtherNode node1 = StartNode(1, port, 1, "exec sleep 60");
    LocalLaunchOptions options = NodeZero(port, 1, "true");
    std::thread signaller;
    options.on_started = [&](const std::vector<int>&) {
      signaller = signal_after(std::chrono::milliseconds(1500));
    };
    const auto start = std::chrono::steady_clock::now();
    auto result = LaunchLocalRanks(options);
    if (signaller.joinable()) signaller.join();
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
    EXPECT_EQ(result->forwarded_signal, 0);
    EXPECT_FALSE(result->ok());
    EXPECT_THAT(result->Summary(), HasSubstr("node 0: its launcher was interrupted by signal 15 "
                                             "while waiting for the other nodes' reports"));
    EXPECT_EQ(node1.ExitCode(), 1);
  }
}

TEST(LocalLauncherAcrossNodes, NodesMustAllJoinAndAgree) {
  LocalLaunchOptions alone = NodeZero(::fsdp::testing::FreeTcpPort(), 2, "true");
  alone.join_timeout = std::chrono::seconds(1);
  EXPECT_THAT(LaunchLocalRanks(alone).status().message(),
              HasSubstr("launcher of node 0 of 2: node 1 did not join at 127.0.0.1:"));

  const int port = ::fsdp::testing::FreeTcpPort();
  const OtherNode three = StartNode(1, port, 3, "true");
  // Each says why, whether it compared the shapes itself or read the
  // other's reason first, rather than finding the store gone.
  const std::string zero =
      std::string(LaunchLocalRanks(NodeZero(port, 2, "true")).status().message());
  EXPECT_EQ(three.ExitCode(), 2);
  for (const std::string& why : {zero, three.Output()}) {
    EXPECT_THAT(why, ::testing::ContainsRegex(
                         "started with --nnodes=2 --nproc_per_node=[23] --max_restarts=0, "
                         "this one with --nnodes=2 --nproc_per_node=[23] --max_restarts=0"));
    EXPECT_THAT(why, ::testing::Not(HasSubstr("lost the launchers' store")));
  }
  // A node that would not restart would leave the others waiting in the
  // next attempt's join.
  const int restarts_port = ::fsdp::testing::FreeTcpPort();
  const OtherNode restarting = StartNode(1, restarts_port, 2, "true", "--max_restarts=1");
  const std::string not_restarting =
      std::string(LaunchLocalRanks(NodeZero(restarts_port, 2, "true")).status().message());
  EXPECT_EQ(restarting.ExitCode(), 2);
  for (const std::string& why : {not_restarting, restarting.Output()}) {
    EXPECT_THAT(why, ::testing::ContainsRegex("--max_restarts=[01], this one with --nnodes=2 "
                                              "--nproc_per_node=2 --max_restarts=[01]"));
  }

  const int shared = ::fsdp::testing::FreeTcpPort();
  const OtherNode first = StartNode(1, shared, 1, "true");
  const OtherNode second = StartNode(1, shared, 1, "true");
  // Node 0 serves until both have ended, the one turned away included.
  auto result =
      LaunchLocalRanks(NodeZero(shared, 1,
                                "for i in $(seq 400); do [ -e " + first.dir + "/rc ] && [ -e " +
                                    second.dir + "/rc ] && exit 0; sleep 0.05; done; exit 1"));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->ok()) << result->Summary();
  const int first_rc = first.ExitCode(), second_rc = second.ExitCode();
  EXPECT_EQ(first_rc + second_rc, 2) << "one of them joins, the other exits with 2";
  EXPECT_THAT(
      first_rc == 2 ? first.Output() : second.Output(),
      HasSubstr("another launcher already joined the job at 127.0.0.1:" + std::to_string(shared) +
                " as node 1: give each host its own "
                "--node_rank"));
}

// Whether something accepts TCP connections at 127.0.0.1:port.
bool Listening(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool connected =
      ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0;
  ::close(fd);
  return connected;
}

// A launcher interrupted while it waits for the others to join stops at
// once, and says so (the signal handlers are installed by then).
TEST(LocalLauncherAcrossNodes, ASignalEndsTheWaitToJoin) {
  LocalLaunchOptions options = NodeZero(::fsdp::testing::FreeTcpPort(), 2, "true");
  options.join_timeout = std::chrono::seconds(30);
  const int port = options.master_port;
  std::thread signaller([port] {
    // Once node 0 serves the store the join is near (the handlers come
    // just before it): a signal sent earlier would end the test binary.
    while (!Listening(port)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ::kill(::getpid(), SIGTERM);
  });
  const auto start = std::chrono::steady_clock::now();
  const absl::Status status = LaunchLocalRanks(options).status();
  signaller.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(status.message(), HasSubstr("launcher of node 0 of 2: interrupted by signal 15 "
                                          "while waiting for the other nodes to join"));
}

TEST(LocalLauncherAcrossNodes, RejectsBadNodeOptions) {
  LocalLaunchOptions options = NodeZero(::fsdp::testing::FreeTcpPort(), 2, "true");
  options.node_rank = 2;
  EXPECT_THAT(LaunchLocalRanks(options).status().message(),
              HasSubstr("node rank 2 is not one of 2 nodes"));
  options = NodeZero(::fsdp::testing::FreeTcpPort(), 2, "true");
  options.master_addr = "";
  EXPECT_THAT(LaunchLocalRanks(options).status().message(),
              HasSubstr("a job across nodes needs master_addr"));
  const int closed = ::fsdp::testing::FreeTcpPort();
  options = NodeZero(closed, 2, "true");
  options.node_rank = 1;
  options.join_timeout = std::chrono::milliseconds(500);
  EXPECT_THAT(LaunchLocalRanks(options).status().message(),
              HasSubstr("launcher of node 1 of 2: node 0's launcher is not there: cannot reach "
                        "the store at 127.0.0.1:" +
                        std::to_string(closed) + " within 500 ms: Connection refused"));
  options = NodeZero(::fsdp::testing::FreeTcpPort(), 2, "true");
  options.node_timeout = std::chrono::seconds(1);
  EXPECT_THAT(LaunchLocalRanks(options).status().message(),
              HasSubstr("node_timeout (1000 ms) must span at least 3 heartbeats (3000 ms)"));
}

}  // namespace
}  // namespace fsdp
