// sync_module_states: ranks that initialized differently train from rank 0's
// parameters and buffers after Wrap, one broadcast per unit.
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"

namespace fsdp {
namespace {

using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::Net;
using ::fsdp::testing::RunOnThreadRanks;

// Net as rank `rank` would initialize it on its own: parameters shifted by
// the rank, and two buffers (one float, one integer) holding the rank.
Net RankInitializedNet(int rank) {
  Net model;
  at::NoGradGuard no_grad;
  for (at::Tensor& p : model->parameters()) p.add_(0.25 * rank);
  model->register_buffer("scale", at::full({3}, 1.5 * rank));
  model->register_buffer("steps", at::full({2}, 7 + rank, at::kLong));
  return model;
}

void ExpectRankZeroState(Net& model, FullyShardedModel& fsdp) {
  Net rank0 = RankInitializedNet(0);
  SummonFullParams full(fsdp, {/*writeback=*/false});
  const auto want = rank0->named_parameters();
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value(), want[item.key()])) << item.key();
  }
  EXPECT_TRUE(at::equal(model->named_buffers()["scale"], rank0->named_buffers()["scale"]));
  EXPECT_TRUE(at::equal(model->named_buffers()["steps"], rank0->named_buffers()["steps"]));
  EXPECT_EQ(model->named_buffers()["steps"].scalar_type(), at::kLong);
}

TEST(SyncModuleStates, EveryRankStartsFromRankZero) {
  ASSERT_TRUE(RunOnThreadRanks(3, [](Collectives& comm) {
                Net model = RankInitializedNet(comm.rank());
                FsdpOptions options;
                options.sync_module_states = true;
                comm.ResetCounters();
                auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, options,
                                                       *ModuleTypePolicy::Of<BlockImpl>());
                ASSERT_TRUE(wrapped.ok()) << wrapped.status();
                // Unit by unit: one broadcast per unit (the root's head and
                // three blocks) and one per buffer.
                EXPECT_EQ(comm.counters().Calls(CollectiveOp::kBroadcast), 4 + 2);
                ExpectRankZeroState(model, **wrapped);
              }).ok());
}

// Without it each rank keeps its own initialization: the check above can
// fail.
TEST(SyncModuleStates, WithoutItRanksKeepTheirOwnInitialization) {
  ASSERT_TRUE(RunOnThreadRanks(2, [](Collectives& comm) {
                Net model = RankInitializedNet(comm.rank());
                comm.ResetCounters();
                auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, {},
                                                       *ModuleTypePolicy::Of<BlockImpl>());
                ASSERT_TRUE(wrapped.ok());
                EXPECT_EQ(comm.counters().Calls(CollectiveOp::kBroadcast), 0);
                EXPECT_EQ(model->named_buffers()["steps"][0].item<int64_t>(), 7 + comm.rank());
              }).ok());
}

}  // namespace
}  // namespace fsdp
