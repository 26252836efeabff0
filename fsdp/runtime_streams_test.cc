// The streams layer on a device with streams and events, played by a
// recording guard registered for PrivateUse1 (this CPU build has no such
// device), and on CPU, where it must do nothing.
#include "fsdp/runtime_streams.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "c10/core/impl/DeviceGuardImplInterface.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

using ::testing::ElementsAre;

constexpr c10::DeviceType kFake = c10::DeviceType::PrivateUse1;

// Streams are ids; the current stream starts at 0 and pool streams count up
// from 1. Events are ids; an event completes after `queries_until_done`
// queries that found it incomplete.
struct RecordingGuard final : c10::impl::DeviceGuardImplInterface {
  static std::vector<std::string>& Log() {
    static std::vector<std::string> log;
    return log;
  }
  static int& QueriesUntilDone() {
    static int n = 0;
    return n;
  }
  static int64_t& NextStream() {
    static int64_t next = 1;
    return next;
  }

  c10::DeviceType type() const override { return kFake; }
  c10::Device exchangeDevice(c10::Device d) const override { return d; }
  c10::Device getDevice() const override { return c10::Device(kFake, 0); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const noexcept override {
    return c10::Stream(c10::Stream::UNSAFE, d, 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high_priority) const override {
    const int64_t id = NextStream()++;
    Log().push_back(absl::StrCat("pool s", id, high_priority ? " high" : ""));
    return c10::Stream(c10::Stream::UNSAFE, d, id);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    static intptr_t next_event = 1;
    if (*event == nullptr) *event = reinterpret_cast<void*>(next_event++);
    Log().push_back(absl::StrCat("record e", reinterpret_cast<intptr_t>(*event), " on s",
                                 stream.id()));
  }
  void block(void* event, const c10::Stream& stream) const override {
    Log().push_back(absl::StrCat("block s", stream.id(), " on e",
                                 reinterpret_cast<intptr_t>(event)));
  }
  bool queryEvent(void* event) const override {
    if (QueriesUntilDone() > 0) {
      --QueriesUntilDone();
      Log().push_back(absl::StrCat("query e", reinterpret_cast<intptr_t>(event), " busy"));
      return false;
    }
    return true;
  }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  // libtorch 2.x's host wait (DeviceEvent::Synchronize through
  // c10::Event::synchronize); 1.13's interface has no such hook and its
  // DeviceEvent polls queryEvent instead, so this is deliberately not marked
  // override: under 1.13 it is an extra, unused member.
  void synchronizeEvent(void* event) const {
    Log().push_back(absl::StrCat("synchronize e", reinterpret_cast<intptr_t>(event)));
    QueriesUntilDone() = 0;
  }
};

const RecordingGuard* const kGuard = new RecordingGuard();
const c10::impl::DeviceGuardImplRegistrar kRegistrar(kFake, kGuard);

// The event a log line names ("query e3 busy" -> "e3").
std::string EventIn(const std::string& line) {
  const size_t start = line.find(" e");
  if (start == std::string::npos) return "";
  const size_t end = line.find(' ', start + 1);
  return line.substr(start + 1, end == std::string::npos ? std::string::npos : end - start - 1);
}

class RuntimeStreamsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RecordingGuard::Log().clear();
    RecordingGuard::QueriesUntilDone() = 0;
  }
};

TEST_F(RuntimeStreamsTest, AsynchronousDeviceGetsTwoPoolStreamsBesideCompute) {
  RuntimeStreams streams(c10::Device(kFake, 0));
  EXPECT_TRUE(streams.asynchronous());
  EXPECT_EQ(streams.compute().id(), 0);
  EXPECT_NE(streams.all_gather(), streams.compute());
  EXPECT_NE(streams.reduce_scatter(), streams.compute());
  EXPECT_NE(streams.reduce_scatter(), streams.all_gather());
  ASSERT_EQ(RecordingGuard::Log().size(), 2u);
  EXPECT_THAT(RecordingGuard::Log()[0], ::testing::EndsWith(" high"))
      << "the all-gather stream is high priority, as PyTorch's unshard stream";
}

TEST_F(RuntimeStreamsTest, WaitStreamRecordsOnTheProducerAndBlocksTheWaiter) {
  RuntimeStreams streams(c10::Device(kFake, 0));
  RecordingGuard::Log().clear();
  RuntimeStreams::WaitStream(streams.compute(), streams.all_gather());
  const std::string ag = absl::StrCat("s", streams.all_gather().id());
  ASSERT_EQ(RecordingGuard::Log().size(), 2u);
  EXPECT_THAT(RecordingGuard::Log()[0], ::testing::StartsWith("record "));
  EXPECT_THAT(RecordingGuard::Log()[0], ::testing::EndsWith(" on " + ag));
  EXPECT_THAT(RecordingGuard::Log()[1], ::testing::StartsWith("block s0 on "));
  RecordingGuard::Log().clear();
  RuntimeStreams::WaitStream(streams.compute(), streams.compute());
  EXPECT_TRUE(RecordingGuard::Log().empty()) << "a stream never waits on itself";
}

TEST_F(RuntimeStreamsTest, RateLimiterWaitsOnTheOldestFreeEventOnlyWhenTheLimitIsReached) {
  RuntimeStreams streams(c10::Device(kFake, 0));
  AllGatherRateLimiter limiter(2);
  limiter.BeforeAllGather();
  limiter.OnReshard(DeviceEvent::RecordOn(streams.compute()));
  limiter.BeforeAllGather();
  EXPECT_EQ(limiter.outstanding(), 1u);
  limiter.OnReshard(DeviceEvent::RecordOn(streams.compute()));
  EXPECT_EQ(limiter.host_waits(), 0);
  RecordingGuard::Log().clear();
  // Two frees outstanding and the oldest still busy on the device: the
  // host waits for it, and only for it.
  RecordingGuard::QueriesUntilDone() = 3;
  limiter.BeforeAllGather();
  EXPECT_EQ(limiter.host_waits(), 1);
  EXPECT_EQ(limiter.outstanding(), 1u);
  EXPECT_EQ(RecordingGuard::QueriesUntilDone(), 0);
  // Under 1.13 the wait polls ("query eN busy" until done); under 2.x it
  // queries once and then synchronizes on the event. Either way it touches
  // the oldest event alone.
  ASSERT_FALSE(RecordingGuard::Log().empty());
  const std::string oldest = EventIn(RecordingGuard::Log().front());
  for (const std::string& line : RecordingGuard::Log()) {
    EXPECT_EQ(EventIn(line), oldest) << line << ": only the oldest event is waited on";
  }
  // Already complete: dequeued without counting a wait.
  limiter.OnReshard(DeviceEvent::RecordOn(streams.compute()));
  limiter.BeforeAllGather();
  EXPECT_EQ(limiter.host_waits(), 1);
}

TEST_F(RuntimeStreamsTest, DisabledLimiterKeepsNothing) {
  AllGatherRateLimiter limiter(0);
  limiter.OnReshard(DeviceEvent::RecordOn(RuntimeStreams(c10::Device(kFake, 0)).compute()));
  limiter.BeforeAllGather();
  EXPECT_EQ(limiter.outstanding(), 0u);
  EXPECT_EQ(limiter.host_waits(), 0);
}

TEST_F(RuntimeStreamsTest, CpuIsSynchronous) {
  RuntimeStreams streams(c10::Device(c10::DeviceType::CPU));
  EXPECT_FALSE(streams.asynchronous());
  EXPECT_EQ(streams.all_gather(), streams.compute());
  EXPECT_EQ(streams.reduce_scatter(), streams.compute());
  DeviceEvent event = DeviceEvent::RecordOn(streams.compute());
  EXPECT_TRUE(event.Query());
  event.Synchronize();
  event.BlockStream(streams.compute());
  RuntimeStreams::WaitStream(streams.all_gather(), streams.compute());
  AllGatherRateLimiter limiter(2);
  for (int i = 0; i < 5; ++i) {
    limiter.BeforeAllGather();
    limiter.OnReshard(DeviceEvent::RecordOn(streams.compute()));
  }
  EXPECT_EQ(limiter.host_waits(), 0);
  EXPECT_TRUE(RecordingGuard::Log().empty()) << "CPU never reaches a device guard's events";
}

}  // namespace
}  // namespace fsdp
