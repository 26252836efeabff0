// Wrapping with policies: per-unit options observed in the running model,
// policies from spec strings and from the example plugin training a model,
// the wrap plan, and the checks made before wrapping (frozen parameters,
// ignored modules, subtrees already wrapped).
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "fsdp/flat_param_handle.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "fsdp/utilities.h"
#include "fsdp/wrap_plan.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/registry.h"
#include "policies/wrap_policy.h"
#include "testing/multi_rank.h"
#include "torch/nn/utils/clip_grad.h"

namespace fsdp {
namespace {

using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::MakeOptimizer;
using ::fsdp::testing::Net;
using ::fsdp::testing::Optim;
using ::fsdp::testing::RunOnThreadRanks;
using ::fsdp::testing::Targets;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int kSteps = 4;
constexpr double kMaxNorm = 0.05;

struct Trajectory {
  std::vector<float> losses;
  std::vector<double> norms;
  std::map<std::string, at::Tensor> params;
};

// Single-process training on the global batch; `prepare` freezes what the
// FSDP run freezes.
Trajectory TrainLocally(const std::function<void(Net&)>& prepare = nullptr, bool clip = true) {
  Net model;
  if (prepare) prepare(model);
  auto optimizer = MakeOptimizer(Optim::kAdam, model->parameters());
  Trajectory t;
  for (int step = 0; step < kSteps; ++step) {
    at::Tensor loss = at::mse_loss(model->forward(Inputs(step, 0)), Targets(step, 0));
    loss.backward();
    t.losses.push_back(loss.item<float>());
    if (clip) t.norms.push_back(torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxNorm));
    optimizer->step();
    optimizer->zero_grad();
  }
  for (const auto& item : model->named_parameters()) {
    t.params[item.key()] = item.value().detach().clone();
  }
  return t;
}

// Trains the wrapped model on this rank's rows and checks every step
// against `expected`; `check_step` sees each step's counters.
void TrainWrappedAndCompare(Net& model, FullyShardedModel& fsdp, Collectives& comm,
                            const Trajectory& expected,
                            const std::function<void(int, const CollectiveCounters&)>& check_step,
                            FullyShardedModel* other_model = nullptr) {
  auto optimizer = MakeOptimizer(Optim::kAdam, model->parameters());
  const int64_t rows = kGlobalBatch / comm.world_size();
  for (int step = 0; step < kSteps; ++step) {
    comm.ResetCounters();
    at::Tensor loss =
        at::mse_loss(model->forward(Inputs(step, 0).narrow(0, comm.rank() * rows, rows)),
                     Targets(step, 0).narrow(0, comm.rank() * rows, rows));
    loss.backward();
    if (check_step) check_step(step, comm.counters());
    if (!expected.norms.empty()) {
      const double norm = ClipGradNorm(fsdp, kMaxNorm).value().item<double>();
      EXPECT_NEAR(norm, expected.norms[step], 1e-5 * expected.norms[step]) << "step " << step;
    }
    optimizer->step();
    optimizer->zero_grad();
    at::Tensor global = loss.detach().clone();
    comm.AllReduce(global, ReduceOp::kAvg)->Wait();
    EXPECT_NEAR(global.item<float>(), expected.losses[step],
                1e-5 * std::abs(expected.losses[step]) + 1e-7)
        << "step " << step;
  }
  SummonFullParams full(fsdp);
  std::optional<SummonFullParams> other_full;
  if (other_model != nullptr) other_full.emplace(*other_model);
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(at::allclose(item.value(), expected.params.at(item.key()), 1e-5, 1e-6))
        << item.key();
  }
}

// blocks.0 replicated, blocks.1 SHARD_GRAD_OP, blocks.2 and the root
// FULL_SHARD: each unit's collectives and memory follow its own strategy.
TEST(PolicyWrap, PerUnitStrategiesTakeEffectInTheRuntime) {
  const Trajectory expected = TrainLocally();
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    CustomPolicy policy([](const std::string& fqn,
                           const torch::nn::Module& m) -> std::optional<UnitOptions> {
      if (dynamic_cast<const BlockImpl*>(&m) == nullptr) return std::nullopt;
      UnitOptions options;
      if (fqn == "blocks.0") options.strategy = ShardingStrategy::kNoShard;
      if (fqn == "blocks.1") options.strategy = ShardingStrategy::kShardGradOp;
      return options;
    });
    auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, {}, policy);
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    FullyShardedModel& fsdp = **wrapped;
    std::vector<ShardingStrategy> strategies;
    for (const auto& unit : fsdp.units()) strategies.push_back(unit->strategy());
    EXPECT_THAT(strategies, ElementsAre(ShardingStrategy::kFullShard, ShardingStrategy::kNoShard,
                                        ShardingStrategy::kShardGradOp,
                                        ShardingStrategy::kFullShard));
    const std::string plan = fsdp.plan().ToString();
    EXPECT_THAT(plan, HasSubstr("blocks.0 ("));
    EXPECT_THAT(plan, HasSubstr("): NO_SHARD (override), 2 params, 104 elements, shard 104 per "
                                "rank"));
    EXPECT_THAT(plan, HasSubstr("): SHARD_GRAD_OP (override), 2 params, 154 elements, shard 77 "
                                "per rank"));
    // In blocks.2's forward: blocks.0 holds no full buffer (replicated),
    // blocks.1 still does (SHARD_GRAD_OP keeps it until backward), the
    // root and blocks.2 do.
    std::vector<int64_t> in_forward(3, -1);
    testing::g_in_block_forward = [&](int index) { in_forward[index] = fsdp.FullParamBytes(); };
    auto full_bytes = [&](int unit) {
      return fsdp.units()[unit]->handle()->layout().padded_numel() * 4;
    };
    TrainWrappedAndCompare(model, fsdp, comm, expected, [&](int step, const CollectiveCounters& c) {
      // Gathers: root once (kept for backward), blocks.1 once, blocks.2
      // twice; blocks.0 never. Reductions: three reduce-scatters and one
      // all-reduce (blocks.0), plus nothing else.
      EXPECT_EQ(c.Calls(CollectiveOp::kAllGather), 4 + (step == 0 ? 3 : 0));
      EXPECT_EQ(c.Calls(CollectiveOp::kReduceScatter), 3);
      EXPECT_EQ(c.Calls(CollectiveOp::kAllReduce), 1);
      EXPECT_EQ(in_forward[2], full_bytes(0) + full_bytes(2) + full_bytes(3));
    });
    testing::g_in_block_forward = nullptr;
    EXPECT_EQ(model->blocks[0]->as<BlockImpl>()->fc->weight.dim(), 2) << "replicated: full shape";
    EXPECT_EQ(model->blocks[1]->as<BlockImpl>()->fc->weight.dim(), 1) << "sharded: 1-D shard";
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(PolicyWrap, SpecStringPolicyFromTheRegistryTrains) {
  const Trajectory expected = TrainLocally();
  absl::Status status = RunOnThreadRanks(3, [&](Collectives& comm) {
    Net model;
    auto policy = PolicyRegistry::Global().Build("module:Block,strategy=SHARD_GRAD_OP");
    ASSERT_TRUE(policy.ok()) << policy.status();
    auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, {}, **policy);
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    ASSERT_EQ((*wrapped)->units().size(), 4u);
    for (size_t u = 1; u < 4; ++u) {
      EXPECT_EQ((*wrapped)->units()[u]->strategy(), ShardingStrategy::kShardGradOp);
    }
    TrainWrappedAndCompare(model, **wrapped, comm, expected,
                           [](int step, const CollectiveCounters& c) {
                             EXPECT_EQ(c.Calls(CollectiveOp::kAllGather), 4 + (step == 0 ? 3 : 0));
                           });
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(PolicyWrap, ExamplePluginPolicyTrains) {
  absl::Status loaded = LoadPolicyPlugin("policies/examples/libfqn_glob_policy.so");
  ASSERT_TRUE(loaded.ok()) << loaded;
  const Trajectory expected = TrainLocally();
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto policy = PolicyRegistry::Global().Build("fqn_glob:blocks.*");
    ASSERT_TRUE(policy.ok()) << policy.status();
    auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, {}, **policy);
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    std::vector<std::string> fqns;
    for (const auto& unit : (*wrapped)->units()) fqns.push_back(unit->fqn());
    EXPECT_THAT(fqns, ElementsAre("", "blocks.0", "blocks.1", "blocks.2"));
    TrainWrappedAndCompare(model, **wrapped, comm, expected, nullptr);
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A plan made on its own refuses the root's options as Wrap would, rather
// than print a plan with them.
TEST(PolicyWrap, PlanWrapRefusesTheRootsBadMixedPrecision) {
  Net model;
  auto policy = PolicyRegistry::Global().Build("module:Block");
  ASSERT_TRUE(policy.ok());
  FsdpOptions options;
  options.mixed_precision.param_dtype = at::kDouble;
  auto plan = PlanWrap(*model, /*world_size=*/8, options, **policy);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(),
              HasSubstr("mixed_precision: MixedPrecision::param_dtype is Double, not one of "
                        "float32, float16, bfloat16"));
}

// A policy cannot make a unit hybrid under a non-hybrid root: Wrap takes a
// replicate group only with a hybrid root, so the plan refuses it before
// any unit is sharded, naming the module.
TEST(PolicyWrap, AHybridUnitUnderANonHybridRootIsRefusedByThePlan) {
  Net model;
  auto policy = PolicyRegistry::Global().Build("module:Block,strategy=hybrid_shard");
  ASSERT_TRUE(policy.ok()) << policy.status();
  auto plan = PlanWrap(*model, /*world_size=*/4, {}, **policy);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(),
              HasSubstr("module 'blocks.0' with strategy HYBRID_SHARD but the root's strategy "
                        "is FULL_SHARD: a unit can be hybrid only when the root is"));
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net wrapped_model;
    auto wrapped = FullyShardedModel::Wrap(wrapped_model.ptr(), comm, {}, **policy);
    ASSERT_FALSE(wrapped.ok());
    EXPECT_THAT(wrapped.status().message(), HasSubstr(absl::StrCat("rank ", comm.rank(), " of 2")));
    EXPECT_EQ(GetModuleUnit(wrapped_model.get()), nullptr);
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(PolicyWrap, PlanWrapIsADryRunThatChangesNothing) {
  Net model;
  const at::Tensor before = model->blocks[0]->as<BlockImpl>()->fc->weight.clone();
  auto policy = PolicyRegistry::Global().Build("module:Block");
  ASSERT_TRUE(policy.ok());
  auto plan = PlanWrap(*model, /*world_size=*/8, {}, **policy);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(at::equal(model->blocks[0]->as<BlockImpl>()->fc->weight, before));
  EXPECT_EQ(GetModuleUnit(model.get()), nullptr);
  const std::string text = plan->ToString();
  EXPECT_THAT(text, HasSubstr("FSDP wrap plan: policy 'module:Block', world size 8, root "
                              "strategy FULL_SHARD\n"));
  // Root: head 9*5+5 = 50 -> 7 per rank; blocks 104, 154, 108 -> 13, 20, 14.
  EXPECT_THAT(text, HasSubstr("  <root> ("));
  EXPECT_THAT(text, HasSubstr("    blocks.1 ("));
  EXPECT_THAT(text, HasSubstr("FULL_SHARD, 2 params, 154 elements, shard 20 per rank\n"));
  EXPECT_THAT(text, HasSubstr("total: 4 units, 416 elements; persistent per rank: 54 elements "
                              "(13.0% of unsharded)"));
}

TEST(PolicyWrap, FrozenUnitIsNeverReducedAndStaysUnchanged) {
  auto freeze_block0 = [](Net& model) {
    for (auto& p : model->blocks[0]->parameters()) p.requires_grad_(false);
  };
  const Trajectory expected = TrainLocally(freeze_block0);
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    freeze_block0(model);
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    EXPECT_EQ((*wrapped)->plan().units[1].trainable_numel, 0);
    EXPECT_THAT((*wrapped)->plan().ToString(), HasSubstr("FULL_SHARD, frozen, 2 params"));
    TrainWrappedAndCompare(model, **wrapped, comm, expected,
                           [](int, const CollectiveCounters& c) {
                             EXPECT_EQ(c.Calls(CollectiveOp::kReduceScatter), 3)
                                 << "the frozen unit's gradients are not reduced";
                           });
    EXPECT_FALSE(model->blocks[0]->as<BlockImpl>()->fc->weight.grad().defined());
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(PolicyWrap, PlanSizesFrozenAndTrainableSegmentsApart) {
  Net model;
  model->blocks[1]->as<BlockImpl>()->fc->bias.requires_grad_(false);
  auto policy = PolicyRegistry::Global().Build("module:Block");
  ASSERT_TRUE(policy.ok());
  auto plan = PlanWrap(*model, /*world_size=*/8, {}, **policy);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // blocks.1: an 11x13 weight (trainable) and an 11-element bias (frozen),
  // each segment padded apart: ceil(143 / 8) + ceil(11 / 8) = 18 + 2 per
  // rank.
  EXPECT_EQ(plan->units[2].trainable_numel, 143);
  EXPECT_THAT(plan->ToString(),
              HasSubstr("FULL_SHARD, 2 params, 154 elements (143 trainable), shard 20 per rank\n"));
}

TEST(PolicyWrap, IgnoredModuleIsNeitherShardedNorReduced) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    Net model;
    FsdpOptions options;
    options.ignored_modules = {model->blocks[1].get()};
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    std::vector<std::string> fqns;
    for (const auto& unit : (*wrapped)->units()) fqns.push_back(unit->fqn());
    EXPECT_THAT(fqns, ElementsAre("", "blocks.0", "blocks.2"));
    EXPECT_THAT((*wrapped)->plan().ignored_params,
                ElementsAre("blocks.1.fc.weight", "blocks.1.fc.bias"));
    auto& ignored = *model->blocks[1]->as<BlockImpl>();
    EXPECT_EQ(ignored.fc->weight.dim(), 2);
    comm.ResetCounters();
    const int64_t rows = kGlobalBatch / comm.world_size();
    at::Tensor loss = at::mse_loss(model->forward(Inputs(0, 0).narrow(0, comm.rank() * rows, rows)),
                                   Targets(0, 0).narrow(0, comm.rank() * rows, rows));
    loss.backward();
    EXPECT_EQ(comm.counters().Calls(CollectiveOp::kReduceScatter), 3);
    // The local gradient of this rank's rows only, in full shape.
    ASSERT_TRUE(ignored.fc->weight.grad().defined());
    EXPECT_EQ(ignored.fc->weight.grad().sizes(), ignored.fc->weight.sizes());
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(PolicyWrap, SubtreeWrappedByAnotherModelIsLeftAlone) {
  // Without clipping: each model clips only its own gradients.
  const Trajectory expected = TrainLocally(nullptr, /*clip=*/false);
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto inner = FullyShardedModel::Wrap(model->blocks[0], comm, {}, NoUnitsPolicy());
    ASSERT_TRUE(inner.ok()) << inner.status();
    auto outer = FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(outer.ok()) << outer.status();
    EXPECT_THAT((*outer)->plan().left_alone, ElementsAre("blocks.0"));
    std::vector<std::string> fqns;
    for (const auto& unit : (*outer)->units()) fqns.push_back(unit->fqn());
    EXPECT_THAT(fqns, ElementsAre("", "blocks.1", "blocks.2"));
    // Wrapping the inner root again is refused.
    auto again = FullyShardedModel::Wrap(model->blocks[0], comm, {}, NoUnitsPolicy());
    EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
    // Both models run their own units inside one forward and backward.
    TrainWrappedAndCompare(
        model, **outer, comm, expected,
        [](int, const CollectiveCounters& c) {
          EXPECT_EQ(c.Calls(CollectiveOp::kReduceScatter), 4) << "three outer units and the inner";
        },
        inner->get());
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(PolicyWrap, PolicyChoosingTheRootOrAModuleTwiceIsAnError) {
  absl::Status status = RunOnThreadRanks(1, [](Collectives& comm) {
    Net model;
    class Bad final : public WrapPolicy {
     public:
      explicit Bad(bool root) : root_(root) {}
      std::string Describe() const override { return "bad"; }
      absl::StatusOr<std::vector<UnitTarget>> Targets(const PolicyInput& in) const override {
        const torch::nn::Module* block = in.root->children()[0]->children()[0].get();
        if (root_) return std::vector<UnitTarget>{{"", in.root, {}}};
        return std::vector<UnitTarget>{{"blocks.0", block, {}}, {"blocks.0", block, {}}};
      }
      bool root_;
    };
    auto root = FullyShardedModel::Wrap(model.ptr(), comm, {}, Bad(true));
    EXPECT_THAT(root.status().message(),
                HasSubstr("wrap policy 'bad' chose the root, which is always a unit"));
    auto twice = FullyShardedModel::Wrap(model.ptr(), comm, {}, Bad(false));
    EXPECT_THAT(twice.status().message(), HasSubstr("chose module 'blocks.0' twice"));
    FsdpOptions options;
    options.ignored_modules = {model->blocks[0].get()};
    auto ignored = FullyShardedModel::Wrap(model.ptr(), comm, options, Bad(false));
    EXPECT_THAT(ignored.status().message(),
                HasSubstr("chose module 'blocks.0', which is ignored"));
  });
  EXPECT_TRUE(status.ok()) << status;
}

}  // namespace
}  // namespace fsdp
