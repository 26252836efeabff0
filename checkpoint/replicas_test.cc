#include "checkpoint/replicas.h"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "comm/gloo_collectives.h"
#include "comm/hybrid_groups.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"
#include "torch/optim/adamw.h"

namespace fsdp {
namespace {

using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::Net;
using ::fsdp::testing::RunOnThreadRanks;
using ::fsdp::testing::Targets;
using ::testing::AllOf;
using ::testing::HasSubstr;

// A Net (with a buffer) wrapped one unit per block, AdamW over its shards,
// and two steps, so that every replica holds trained weights and state.
struct Trained {
  Net model;
  std::unique_ptr<FullyShardedModel> fsdp;
  std::unique_ptr<torch::optim::AdamW> optimizer;

  Trained(Collectives& world, const ProcessGroups& groups, ShardingStrategy strategy,
          bool ignore_head = false) {
    model->register_buffer("scale", at::arange(6, at::kFloat));
    FsdpOptions options;
    options.strategy = strategy;
    if (ignore_head) options.ignored_modules = {model->head.get()};
    fsdp = FullyShardedModel::Wrap(model.ptr(), groups, options,
                                   *ModuleTypePolicy::Of<BlockImpl>())
               .value();
    optimizer = std::make_unique<torch::optim::AdamW>(UniqueParameters(*model),
                                                      torch::optim::AdamWOptions(0.01));
    const int64_t rows = kGlobalBatch / world.world_size();
    for (int step = 0; step < 2; ++step) {
      at::mse_loss(model->forward(Inputs(step, 0).narrow(0, world.rank() * rows, rows)),
                   Targets(step, 0).narrow(0, world.rank() * rows, rows))
          .backward();
      optimizer->step();
      optimizer->zero_grad();
    }
  }

  // The parameter's elements this rank holds (a view of its shard).
  at::Tensor Param(const std::string& name) {
    for (const auto& item : model->named_parameters()) {
      if (item.key() == name) return item.value();
    }
    ADD_FAILURE() << "no parameter " << name;
    return at::Tensor();
  }
  at::Tensor ExpAvg(const std::string& name) {
    auto& state = optimizer->state().at(StateKey(optimizer->state(), Param(name)));
    return static_cast<torch::optim::AdamWParamState&>(*state).exp_avg();
  }

  // libtorch 1.x keys optimizer state by the TensorImpl's address as text,
  // 2.x by the address.
  template <typename StateMap>
  static typename StateMap::key_type StateKey(const StateMap&, const at::Tensor& p) {
    if constexpr (std::is_same_v<typename StateMap::key_type, std::string>) {
      std::ostringstream out;
      out << p.unsafeGetTensorImpl();
      return out.str();
    } else {
      return p.unsafeGetTensorImpl();
    }
  }
};

// Flips one bit of the tensor's first element, in place.
void FlipBit(const at::Tensor& t) {
  ASSERT_GT(t.numel(), 0);
  static_cast<unsigned char*>(t.data_ptr())[1] ^= 0x04;
}

std::unique_ptr<HybridShardCollectives> Hybrid(Collectives& world,
                                               const c10::intrusive_ptr<c10d::Store>& store) {
  GlooOptions gloo;
  gloo.hostname = "127.0.0.1";
  gloo.timeout = std::chrono::seconds(60);
  auto groups = CreateHybridShardCollectives(world.rank(), HybridShardLayout::Create(4, 2).value(),
                                             gloo.group_name, GlooGroupConnector(store, gloo));
  EXPECT_TRUE(groups.ok()) << groups.status();
  return groups.ok() ? std::make_unique<HybridShardCollectives>(std::move(*groups)) : nullptr;
}

// HYBRID_SHARD at W = 4 (two replicas of two shards): after training the
// replicas agree; one flipped bit in one replica's parameter shard, and
// separately in its optimizer state, is found by every rank's next check,
// which names the tensor, its unit, the group and the ranks.
TEST(CheckReplicas, FindsOneFlippedBitInAReplicasParameterOrOptimizerState) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  absl::Status status = RunOnThreadRanks(4, [&](Collectives& world) {
    std::unique_ptr<HybridShardCollectives> groups = Hybrid(world, store);
    ASSERT_NE(groups, nullptr);
    ProcessGroups hybrid(*groups->shard);
    hybrid.replicate = groups->replicate.get();
    Trained t(world, hybrid, ShardingStrategy::kHybridShard);
    absl::Status clean = CheckReplicas(*t.fsdp, t.optimizer.get());
    ASSERT_TRUE(clean.ok()) << clean;
    // The second replica's shard rank 0.
    const bool corrupt = groups->shard->rank() == 0 && groups->replicate->rank() == 1;
    const std::string name = "blocks.1.fc.weight";
    if (corrupt) FlipBit(t.Param(name));
    absl::Status found = CheckReplicas(*t.fsdp, t.optimizer.get());
    EXPECT_EQ(found.code(), absl::StatusCode::kDataLoss) << found;
    EXPECT_THAT(found.message(),
                AllOf(HasSubstr("the replicas disagree"),
                      HasSubstr("'blocks.1.fc.weight' (parameter, unit 'blocks.1'): among the "
                                "replicas of shard 0, replica 0 holds "),
                      HasSubstr(", replica 1 holds ")));
    if (corrupt) FlipBit(t.Param(name));
    clean = CheckReplicas(*t.fsdp, t.optimizer.get());
    EXPECT_TRUE(clean.ok()) << clean;
    if (corrupt) FlipBit(t.ExpAvg(name));
    found = CheckReplicas(*t.fsdp, t.optimizer.get());
    EXPECT_EQ(found.code(), absl::StatusCode::kDataLoss) << found;
    EXPECT_THAT(found.message(),
                HasSubstr("'blocks.1.fc.weight' (optimizer state 'exp_avg', unit 'blocks.1')"));
    EXPECT_THAT(found.message(), ::testing::Not(HasSubstr("(parameter")));
    // Without the optimizer, its state is not compared.
    EXPECT_TRUE(CheckReplicas(*t.fsdp).ok());
  });
  EXPECT_TRUE(status.ok()) << status;
}

// NO_SHARD: every rank holds every parameter, and the shard group
// compares them; with three ranks the odd one is named last.
TEST(CheckReplicas, UnderNoShardEveryRankIsAReplica) {
  absl::Status status = RunOnThreadRanks(3, [&](Collectives& comm) {
    Trained t(comm, comm, ShardingStrategy::kNoShard);
    ASSERT_TRUE(CheckReplicas(*t.fsdp, t.optimizer.get()).ok());
    if (comm.rank() == 1) FlipBit(t.Param("head.bias"));
    absl::Status found = CheckReplicas(*t.fsdp, t.optimizer.get());
    EXPECT_EQ(found.code(), absl::StatusCode::kDataLoss) << found;
    EXPECT_THAT(found.message(), HasSubstr("'head.bias' (parameter, the root unit): across "
                                           "the ranks, ranks 0, 2 hold "));
    EXPECT_THAT(found.message(), HasSubstr(", rank 1 holds "));
  });
  EXPECT_TRUE(status.ok()) << status;
}

// FULL_SHARD keeps one copy of each shard: a flipped parameter bit has no
// replica to differ from, but every rank's copy of a buffer is compared.
TEST(CheckReplicas, UnderFullShardTheBuffersAreCompared) {
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trained t(comm, comm, ShardingStrategy::kFullShard);
    ASSERT_TRUE(CheckReplicas(*t.fsdp, t.optimizer.get()).ok());
    if (comm.rank() == 1) FlipBit(t.model->named_buffers()["scale"]);
    absl::Status found = CheckReplicas(*t.fsdp, t.optimizer.get());
    EXPECT_EQ(found.code(), absl::StatusCode::kDataLoss) << found;
    EXPECT_THAT(found.message(), HasSubstr("'scale' (buffer, in no unit): across the ranks, "));
    if (comm.rank() == 1) FlipBit(t.model->named_buffers()["scale"]);
    EXPECT_TRUE(CheckReplicas(*t.fsdp, t.optimizer.get()).ok());
  });
  EXPECT_TRUE(status.ok()) << status;
}

// An ignored module is each rank's own: its parameters and their optimizer
// state, trained on each rank's batch alone, differ across ranks and are
// not compared. Nor are buffers when the options leave them out.
TEST(CheckReplicas, LeavesOutIgnoredModulesAndBuffersWhenAsked) {
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trained t(comm, comm, ShardingStrategy::kNoShard, /*ignore_head=*/true);
    const at::Tensor head = t.model->head->weight.detach().flatten();
    at::Tensor both = at::empty({2 * head.numel()});
    comm.AllGatherIntoTensor(both, head)->Wait();
    EXPECT_FALSE(at::equal(both.narrow(0, 0, head.numel()), both.narrow(0, head.numel(),
                                                                         head.numel())))
        << "the ignored head should have trained apart";
    absl::Status clean = CheckReplicas(*t.fsdp, t.optimizer.get());
    EXPECT_TRUE(clean.ok()) << clean;
    if (comm.rank() == 1) FlipBit(t.model->named_buffers()["scale"]);
    ReplicaCheckOptions no_buffers;
    no_buffers.compare_buffers = false;
    EXPECT_TRUE(CheckReplicas(*t.fsdp, t.optimizer.get(), no_buffers).ok());
    EXPECT_EQ(CheckReplicas(*t.fsdp, t.optimizer.get()).code(), absl::StatusCode::kDataLoss);
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A state class libtorch does not have: read through its serialize().
struct VelocityState : torch::optim::OptimizerCloneableParamState<VelocityState> {
  at::Tensor velocity;
  void serialize(torch::serialize::OutputArchive& archive) const override {
    archive.write("velocity", velocity);
  }
  void serialize(torch::serialize::InputArchive& archive) override {
    archive.read("velocity", velocity);
  }
};

TEST(CheckReplicas, ReadsTheStateOfOptimizersOfItsOwnThroughSerialize) {
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trained t(comm, comm, ShardingStrategy::kNoShard);
    at::Tensor first;
    for (auto& entry : t.optimizer->state()) {
      auto velocity = std::make_unique<VelocityState>();
      velocity->velocity =
          static_cast<torch::optim::AdamWParamState&>(*entry.second).exp_avg().clone();
      if (!first.defined()) first = velocity->velocity;
      entry.second = std::move(velocity);
    }
    ASSERT_TRUE(first.defined());
    absl::Status clean = CheckReplicas(*t.fsdp, t.optimizer.get());
    EXPECT_TRUE(clean.ok()) << clean;
    if (comm.rank() == 1) FlipBit(first);
    absl::Status found = CheckReplicas(*t.fsdp, t.optimizer.get());
    EXPECT_EQ(found.code(), absl::StatusCode::kDataLoss) << found;
    EXPECT_THAT(found.message(), HasSubstr("(optimizer state 'velocity', "));
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(CheckReplicas, ComparesTheGradientNormAndRefusesABusyModel) {
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trained t(comm, comm, ShardingStrategy::kFullShard);
    EXPECT_TRUE(CheckGradientNormAgrees(*t.fsdp, 0.25).ok());
    const absl::Status differ = CheckGradientNormAgrees(*t.fsdp, comm.rank() == 1 ? 0.5 : 0.25);
    EXPECT_EQ(differ.code(), absl::StatusCode::kDataLoss) << differ;
    EXPECT_THAT(differ.message(), HasSubstr("across the shard group, rank 0 0.25, rank 1 0.5"));
    // Mid-step (after forward, before backward) the shards are not the
    // parameters' values: refused on every rank, before any collective.
    at::Tensor loss = t.model->forward(Inputs(0, 0)).sum();
    EXPECT_EQ(CheckReplicas(*t.fsdp).code(), absl::StatusCode::kFailedPrecondition);
    loss.backward();
    t.optimizer->zero_grad();
  });
  EXPECT_TRUE(status.ok()) << status;
}

}  // namespace
}  // namespace fsdp
