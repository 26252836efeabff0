#include "comm/staged_collectives.h"

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ATen/ATen.h"
#include "absl/status/status.h"
#include "c10/util/Exception.h"
#include "comm/collectives.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"

namespace fsdp {
namespace {

using ::fsdp::testing::RunOnThreadRanks;
using ::testing::HasSubstr;

// Every operation through staging gives exactly what the host group gives
// (bit for bit, whatever its rounding of 16-bit sums), at sizes 1, uneven
// and large, in the dtypes FSDP uses; in float64, where sums are exact,
// also the values expected.
TEST(StagedCollectives, EveryOperationGivesTheHostGroupsResult) {
  absl::Status status = RunOnThreadRanks(3, [](Collectives& host) {
    std::unique_ptr<Collectives> staged = CreateStagedCollectives(host, at::kCPU);
    const int r = host.rank(), w = host.world_size();
    for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
      for (int64_t n : {1, 7, 4099}) {
        SCOPED_TRACE(::testing::Message() << c10::toString(dtype) << " n=" << n);
        const at::TensorOptions options = at::TensorOptions().dtype(dtype);
        const at::Tensor mine = at::arange(n, options) + 100 * r;
        const at::Tensor full = at::arange(w * n, options) + r;
        // The same collective on both groups, from the same inputs.
        auto both = [&](const std::function<void(Collectives&, at::Tensor&)>& op,
                        const at::Tensor& like) {
          at::Tensor through_host = like.clone(), through_staging = like.clone();
          op(host, through_host);
          op(*staged, through_staging);
          EXPECT_TRUE(at::equal(through_staging, through_host));
          return through_staging;
        };
        const at::Tensor gathered = both(
            [&](Collectives& g, at::Tensor& out) { g.AllGatherIntoTensor(out, mine)->Wait(); },
            at::empty({w * n}, options));
        const at::Tensor summed = both(
            [&](Collectives& g, at::Tensor& out) {
              g.ReduceScatterTensor(out, full, ReduceOp::kSum)->Wait();
            },
            at::empty({n}, options));
        both([&](Collectives& g,
                 at::Tensor& out) { g.ReduceScatterTensor(out, full, ReduceOp::kAvg)->Wait(); },
             at::empty({n}, options));
        const at::Tensor reduced = both(
            [&](Collectives& g, at::Tensor& t) { g.AllReduce(t, ReduceOp::kSum)->Wait(); }, mine);
        both([&](Collectives& g, at::Tensor& t) { g.AllReduce(t, ReduceOp::kAvg)->Wait(); },
             mine);
        const at::Tensor broadcast =
            both([&](Collectives& g, at::Tensor& t) { g.Broadcast(t, /*root=*/1)->Wait(); },
                 mine);
        if (dtype != at::kDouble) continue;
        for (int q = 0; q < w; ++q) {
          EXPECT_TRUE(at::equal(gathered.narrow(0, q * n, n), at::arange(n, options) + 100 * q));
        }
        EXPECT_TRUE(at::equal(summed, at::arange(w * n, options).narrow(0, r * n, n) * w + 3));
        EXPECT_TRUE(at::equal(reduced, at::arange(n, options) * w + 300));
        EXPECT_TRUE(at::equal(broadcast, at::arange(n, options) + 100));
      }
    }
    staged->Barrier();
    EXPECT_EQ(staged->counters().calls[static_cast<int>(CollectiveOp::kAllGather)], 9);
    EXPECT_EQ(staged->counters().calls[static_cast<int>(CollectiveOp::kBarrier)], 1);
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Issuing returns before the collective has run, and collectives run in
// issue order whatever order they are waited in: rank 0 issues while rank 1
// is still asleep, then waits for them newest first.
TEST(StagedCollectives, IssueDoesNotWaitAndOrderIsKept) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& host) {
    std::unique_ptr<Collectives> staged = CreateStagedCollectives(host, at::kCPU);
    if (host.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    std::vector<at::Tensor> tensors;
    std::vector<std::unique_ptr<CollectiveWork>> works;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < 8; ++i) {
      tensors.push_back(at::full({5 + i}, static_cast<float>(i + host.rank())));
      works.push_back(staged->AllReduce(tensors.back(), ReduceOp::kSum));
    }
    const auto issued = std::chrono::steady_clock::now() - start;
    if (host.rank() == 0) EXPECT_LT(issued, std::chrono::milliseconds(250));
    for (int i = 7; i >= 0; --i) {
      works[i]->Wait();
      EXPECT_TRUE(at::equal(tensors[i], at::full({5 + i}, static_cast<float>(2 * i + 1))));
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A host group whose all-reduces fail, and which records the label each
// was issued under.
class FailingHost final : public Collectives {
 public:
  FailingHost() : Collectives(0, 2) {}
  std::vector<std::string> labels;

 protected:
  std::unique_ptr<CollectiveWork> DoAllGather(const at::Tensor&, const at::Tensor&) override {
    return MakeFailedWork("unused");
  }
  std::unique_ptr<CollectiveWork> DoReduceScatter(const at::Tensor&, const at::Tensor&,
                                                  ReduceOp) override {
    return MakeFailedWork("unused");
  }
  std::unique_ptr<CollectiveWork> DoAllReduce(const at::Tensor&, ReduceOp) override {
    labels.push_back(label_unit() + "/" + label_phase());
    return MakeFailedWork("rank 1 is gone");
  }
  std::unique_ptr<CollectiveWork> DoBroadcast(const at::Tensor&, int) override {
    return MakeFailedWork("unused");
  }
  std::unique_ptr<CollectiveWork> DoAllToAll(const at::Tensor&, const at::Tensor&) override {
    return MakeFailedWork("unused");
  }
  void DoBarrier() override {}
};

// The first failure is the host group's own; the collectives queued behind
// it fail at once, quoting it; the host group saw the FSDP label.
TEST(StagedCollectives, AFailureFailsTheQueueBehindIt) {
  FailingHost host;
  std::unique_ptr<Collectives> staged = CreateStagedCollectives(host, at::kCPU);
  std::vector<std::unique_ptr<CollectiveWork>> works;
  {
    CollectiveLabel label(*staged, "blocks.1", "forward");
    for (int i = 0; i < 3; ++i) works.push_back(staged->AllReduce(at::ones({4}), ReduceOp::kSum));
  }
  try {
    works[0]->Wait();
    ADD_FAILURE() << "the first collective did not fail";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("rank 1 is gone"));
  }
  for (int i = 1; i < 3; ++i) {
    try {
      works[i]->Wait();
      ADD_FAILURE() << "collective " << i << " did not fail";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(),
                  HasSubstr("rank 0 of 2: not run: an earlier collective of this group failed: "));
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("rank 1 is gone"));
    }
  }
  works.clear();
  staged.reset();
  EXPECT_THAT(host.labels, ::testing::ElementsAre("blocks.1/forward"));
}

// An unwaited work's destruction waits for its collective, so the caller's
// tensor is complete afterwards; destroying the group runs what is queued.
TEST(StagedCollectives, DestructionWaits) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& host) {
    at::Tensor t = at::full({3}, static_cast<float>(host.rank() + 1));
    {
      std::unique_ptr<Collectives> staged = CreateStagedCollectives(host, at::kCPU);
      staged->AllReduce(t, ReduceOp::kSum).reset();
    }
    EXPECT_TRUE(at::equal(t, at::full({3}, 3.0f)));
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(StagedCollectives, HandlesItsDeviceAndTheHost) {
  FailingHost host;
  std::unique_ptr<Collectives> staged = CreateStagedCollectives(host, at::kCPU);
  EXPECT_TRUE(staged->HandlesDevice(at::kCPU));
  EXPECT_FALSE(staged->HandlesDevice(c10::Device(at::kCUDA, 0)));
}

}  // namespace
}  // namespace fsdp
