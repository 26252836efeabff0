#include "base/status.h"

#include <stdexcept>
#include <string>

#include "c10/util/Exception.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd input");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  FSDP_ASSIGN_OR_RETURN(int half, Half(x));
  FSDP_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

absl::Status CheckEven(int x) {
  FSDP_RETURN_IF_ERROR(Half(x).status());
  return absl::OkStatus();
}

TEST(StatusMacros, PropagateFirstError) {
  EXPECT_EQ(Quarter(12).value(), 3);
  EXPECT_EQ(Quarter(6).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Quarter(6).status().message(), "odd input");
  EXPECT_TRUE(CheckEven(4).ok());
  EXPECT_EQ(CheckEven(5).code(), absl::StatusCode::kInvalidArgument);
}

TEST(StatusBridge, ThrowIfErrorKeepsCodeAndMessage) {
  EXPECT_NO_THROW(ThrowIfError(absl::OkStatus()));
  try {
    ThrowIfError(absl::FailedPreconditionError("unit 3 is not idle"));
    FAIL() << "expected a throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.msg()).find("FAILED_PRECONDITION: unit 3 is not idle"),
              std::string::npos)
        << e.msg();
  }
  EXPECT_EQ(ValueOrThrow(Half(8)), 4);
  EXPECT_THROW(ValueOrThrow(Half(7)), c10::Error);
}

TEST(StatusBridge, StatusFromCurrentExceptionKeepsMessage) {
  absl::Status status;
  try {
    TORCH_CHECK(false, "rank 2: wrong shape");
  } catch (...) {
    status = StatusFromCurrentException(absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "rank 2: wrong shape");

  try {
    throw std::runtime_error("socket closed");
  } catch (...) {
    status = StatusFromCurrentException();
  }
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(status.message(), "socket closed");
}

}  // namespace
}  // namespace fsdp
