#include "comm/work_result.h"

#include <stdexcept>
#include <string>

#include "c10/util/Exception.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(ErrorMessageOf, IsEmptyWhenTheFunctionReturns) {
  EXPECT_EQ(ErrorMessageOf([] {}), "");
}

TEST(ErrorMessageOf, KeepsAC10ErrorsMessageWithoutItsBacktrace) {
  const std::string message = ErrorMessageOf([] { TORCH_CHECK(false, "all-gather failed"); });
  EXPECT_EQ(message, "all-gather failed");
  EXPECT_EQ(ErrorMessageOf([] { throw std::runtime_error("closed by peer"); }), "closed by peer");
}

TEST(ErrorMessageOf, IsNeverEmptyForAnError) {
  EXPECT_FALSE(ErrorMessageOf([] { throw std::runtime_error(""); }).empty());
}

TEST(WorkResult, WaitsOnceAndRepeatsSuccess) {
  WorkResult result;
  int waits = 0;
  EXPECT_FALSE(result.done());
  result.Wait([&] { return ++waits, std::string(); });
  result.Wait([&] { return ++waits, std::string(); });
  EXPECT_TRUE(result.done());
  EXPECT_EQ(waits, 1);
}

TEST(WorkResult, AFailedWorkStaysFailed) {
  WorkResult result;
  int waits = 0;
  for (int call = 0; call < 2; ++call) {
    try {
      result.Wait([&] { return ++waits, std::string("broadcast failed: timeout"); });
      ADD_FAILURE() << "call " << call << " did not throw";
    } catch (const c10::Error& e) {
      EXPECT_EQ(e.msg(), "broadcast failed: timeout");
      EXPECT_THAT(e.msg(), Not(HasSubstr("Exception raised from")));
    }
  }
  EXPECT_EQ(waits, 1);
}

// A wait that fails while explaining its failure: the exception reaches
// the first caller, and every later Wait still fails with its message.
TEST(WorkResult, AWaitThatThrowsLeavesTheWorkFailed) {
  WorkResult result;
  EXPECT_THROW(result.Wait([]() -> std::string { throw std::runtime_error("store unreachable"); }),
               std::runtime_error);
  try {
    result.Wait([] { return std::string(); });
    ADD_FAILURE() << "the second Wait passed";
  } catch (const c10::Error& e) {
    EXPECT_EQ(e.msg(), "store unreachable");
  }
}

}  // namespace
}  // namespace fsdp
