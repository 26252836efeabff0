#include "comm/store_deadline.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/rendezvous.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/free_port.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;

// A store served by another process that can be frozen (SIGSTOP), as a host
// cut off mid-run looks to its clients: connected, and silent. The server is
// node 0 of a two-node launch that never completes: it serves until killed.
class FrozenServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    port_ = ::fsdp::testing::FreeTcpPort();
    const std::string port_flag = "--master_port=" + std::to_string(port_);
    server_ = ::fork();
    ASSERT_GE(server_, 0);
    if (server_ == 0) {
      ::execl("launch/fsdp_launch", "launch/fsdp_launch", "--nnodes=2", "--node_rank=0",
              "--master_addr=127.0.0.1", port_flag.c_str(), "--join_timeout_s=60", "--",
              "/bin/true", nullptr);
      ::_exit(127);
    }
    auto store =
        ConnectStoreAt("127.0.0.1", port_, std::chrono::seconds(20), std::chrono::seconds(60));
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *store;
  }
  void TearDown() override {
    if (server_ > 0) {
      ::kill(server_, SIGKILL);
      ::waitpid(server_, nullptr, 0);
    }
  }

  int port_ = 0;
  pid_t server_ = -1;
  c10::intrusive_ptr<c10d::Store> store_;
};

TEST_F(FrozenServerTest, ACallToASilentStoreGivesUpAtItsDeadline) {
  DeadlineStore store(store_, "the frozen store");
  const auto add = [](c10d::Store& s) { return s.add("counter", 1); };
  EXPECT_EQ(store.Call(add, std::chrono::seconds(10)), 1);
  EXPECT_EQ(store.Call(add, std::chrono::seconds(10)), 2);

  ASSERT_EQ(::kill(server_, SIGSTOP), 0);
  // kill() returns before every thread of the server has stopped; until the
  // group stop completes, its serving thread can still answer.
  int wait_status = 0;
  ASSERT_EQ(::waitpid(server_, &wait_status, WUNTRACED), server_);
  ASSERT_TRUE(WIFSTOPPED(wait_status)) << "the server ended instead of stopping";
  const auto start = std::chrono::steady_clock::now();
  try {
    store.Call(add, std::chrono::milliseconds(300));
    FAIL() << "a frozen store answered";
  } catch (const StoreUnreachable& e) {
    EXPECT_THAT(e.what(), HasSubstr("the frozen store did not answer within 300 ms"));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_TRUE(store.unreachable());
  // The abandoned call may still be answered: the store is not used again.
  ::kill(server_, SIGCONT);
  EXPECT_THROW(
      {
        try {
          store.Call(add, std::chrono::seconds(10));
        } catch (const StoreUnreachable& e) {
          EXPECT_THAT(e.what(), HasSubstr("stopped answering before"));
          throw;
        }
      },
      StoreUnreachable);
}

TEST_F(FrozenServerTest, ACallsOwnErrorAndResultComeBack) {
  DeadlineStore store(store_, "the store");
  store.Call([](c10d::Store& s) { s.set("key", std::vector<uint8_t>{'v'}); },
             std::chrono::seconds(10));
  EXPECT_EQ(store.Call([](c10d::Store& s) { return s.get("key"); }, std::chrono::seconds(10)),
            std::vector<uint8_t>{'v'});
  EXPECT_THROW(store.Call([](c10d::Store&) -> int { throw std::invalid_argument("bad key"); },
                          std::chrono::seconds(10)),
               std::invalid_argument);
  EXPECT_FALSE(store.unreachable());
}

}  // namespace
}  // namespace fsdp
