#include "comm/store_fingerprint_exchange.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comm/rendezvous.h"
#include "gtest/gtest.h"
#include "testing/free_port.h"

namespace fsdp {
namespace {

// A store served by another process (node 0 of a two-node launch that never
// completes), so that the test can end it as a rank hosting the store ends.
class ServedStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const int port = ::fsdp::testing::FreeTcpPort();
    const std::string port_flag = "--master_port=" + std::to_string(port);
    server_ = ::fork();
    ASSERT_GE(server_, 0);
    if (server_ == 0) {
      ::execl("launch/fsdp_launch", "launch/fsdp_launch", "--nnodes=2", "--node_rank=0",
              "--master_addr=127.0.0.1", port_flag.c_str(), "--join_timeout_s=60", "--",
              "/bin/true", nullptr);
      ::_exit(127);
    }
    auto store =
        ConnectStoreAt("127.0.0.1", port, std::chrono::seconds(20), std::chrono::seconds(60));
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *store;
  }
  void TearDown() override { EndServer(); }

  void EndServer() {
    if (server_ <= 0) return;
    ::kill(server_, SIGKILL);
    ::waitpid(server_, nullptr, 0);
    server_ = -1;
  }

  pid_t server_ = -1;
  c10::intrusive_ptr<c10d::Store> store_;
};

TEST_F(ServedStoreTest, CollectWaitsForMissingReportsThenReturnsThosePresent) {
  auto rank0 = MakeStoreFingerprintExchange(store_, "g", 0, 3);
  auto rank1 = MakeStoreFingerprintExchange(store_, "g", 1, 3);
  rank0->Publish("r", "zero");
  rank1->Publish("r", "one");
  const auto start = std::chrono::steady_clock::now();
  const auto reports = rank1->Collect("r", std::chrono::milliseconds(400));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(400));
  ASSERT_EQ(reports.size(), 3u);
  EXPECT_EQ(reports[0], "zero");
  EXPECT_EQ(reports[1], "one");
  EXPECT_FALSE(reports[2].has_value());
}

// The failure CI met: the rank hosting the store had waited out its window
// and exited while another survivor, which had started later, still waited.
TEST_F(ServedStoreTest, AStoreClosedDuringTheWaitLeavesTheReportsAlreadyRead) {
  auto rank0 = MakeStoreFingerprintExchange(store_, "g", 0, 4);
  auto rank1 = MakeStoreFingerprintExchange(store_, "g", 1, 4);
  rank0->Publish("failure", "zero");
  rank1->Publish("failure", "one");
  std::thread host_ends([this] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    EndServer();
  });
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::optional<std::string>> reports;
  std::string error;
  try {
    reports = rank1->Collect("failure", std::chrono::seconds(20));
  } catch (const std::exception& e) {
    error = e.what();
  }
  const auto waited = std::chrono::steady_clock::now() - start;
  host_ends.join();
  ASSERT_EQ(error, "");
  EXPECT_LT(waited, std::chrono::seconds(10)) << "returned when the store closed, not at the end";
  ASSERT_EQ(reports.size(), 4u);
  EXPECT_EQ(reports[0], "zero");
  EXPECT_EQ(reports[1], "one");
  EXPECT_FALSE(reports[2].has_value());
  EXPECT_FALSE(reports[3].has_value());
}

}  // namespace
}  // namespace fsdp
