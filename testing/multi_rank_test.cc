#include "testing/multi_rank.h"

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "ATen/ATen.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(ThreadRanks, RunsEveryRankOnce) {
  std::atomic<int> rank_mask{0};
  absl::Status status = RunOnThreadRanks(4, [&](Collectives& comm) {
    EXPECT_EQ(comm.world_size(), 4);
    rank_mask.fetch_or(1 << comm.rank());
  });
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(rank_mask.load(), 0b1111);
}

TEST(ThreadRanks, ReportsEveryFailedRank) {
  absl::Status status = RunOnThreadRanks(4, [](Collectives& comm) {
    if (comm.rank() == 1 || comm.rank() == 3) {
      throw std::runtime_error("bad shard on rank " + std::to_string(comm.rank()));
    }
  });
  ASSERT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr("2 of 4 ranks failed"));
  EXPECT_THAT(status.message(), HasSubstr("rank 1: bad shard on rank 1"));
  EXPECT_THAT(status.message(), HasSubstr("rank 3: bad shard on rank 3"));
  EXPECT_THAT(status.message(), Not(HasSubstr("rank 0:")));
}

TEST(ThreadRanksDeathTest, HungRankIsNamedAndEndsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  MultiRankOptions options;
  // Long enough for the other ranks to connect and finish on a loaded
  // machine, so that only rank 1 is named.
  options.timeout = std::chrono::seconds(5);
  EXPECT_EXIT(
      {
        (void)RunOnThreadRanks(
            3,
            [](Collectives& comm) {
              if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(60));
            },
            options);
      },
      ::testing::ExitedWithCode(kHungRanksExitCode),
      "rank\\(s\\) 1 of 3 did not finish within 5000 ms");
}

TEST(ProcessRanks, RunsInSeparateProcessesThroughTheEnvironment) {
  // Code before the call runs in every rank process too, so the processes
  // are told apart by exchanging their pids.
  absl::Status status = RunOnProcessRanks(3, [](Collectives& comm) {
    EXPECT_EQ(comm.world_size(), 3);
    EXPECT_EQ(std::getenv("RANK"), std::to_string(comm.rank()));
    at::Tensor pid = at::zeros({3}, at::kDouble);
    pid[comm.rank()] = static_cast<double>(::getpid());
    comm.AllReduce(pid, ReduceOp::kSum)->Wait();
    // Three distinct processes took part (threads would share one pid).
    EXPECT_EQ(std::get<0>(at::_unique(pid)).numel(), 3);
  });
  EXPECT_TRUE(status.ok()) << status;
  // A second call in the same test runs its own body.
  status = RunOnProcessRanks(2, [](Collectives& comm) { EXPECT_EQ(comm.world_size(), 2); });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(ProcessRanks, ReportsExceptionsAndGtestFailuresByRank) {
  absl::Status status = RunOnProcessRanks(3, [](Collectives& comm) {
    if (comm.rank() == 1) throw std::runtime_error("optimizer state missing");
    if (comm.rank() == 2) {
      EXPECT_EQ(comm.rank(), 7) << "deliberate failure";
    }
  });
  ASSERT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr("rank(s) 1, 2 of 3 failed"));
  EXPECT_THAT(status.message(), HasSubstr("rank 1 exited with code 1"));
  EXPECT_THAT(status.message(), HasSubstr("optimizer state missing"));
  EXPECT_THAT(status.message(), HasSubstr("deliberate failure"));
}

TEST(ProcessRanks, HungRankIsKilledAndNamed) {
  MultiRankOptions options;
  options.timeout = std::chrono::seconds(10);
  options.collective_timeout = std::chrono::seconds(10);
  const auto start = std::chrono::steady_clock::now();
  absl::Status status = RunOnProcessRanks(
      2,
      [](Collectives& comm) {
        if (comm.rank() == 0) std::this_thread::sleep_for(std::chrono::seconds(120));
      },
      options);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(40));
  ASSERT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr("rank(s) 0 of 2 failed"));
  EXPECT_THAT(status.message(),
              HasSubstr("rank 0 was killed: it did not finish within the job timeout"));
}

}  // namespace
}  // namespace fsdp::testing
