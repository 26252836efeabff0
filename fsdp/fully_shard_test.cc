#include "fsdp/fully_shard.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "fsdp/flat_param_handle.h"
#include "fsdp/unit_forward.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "testing/multi_rank.h"
#include "torch/nn/module.h"
#include "torch/nn/modules/container/modulelist.h"
#include "torch/nn/modules/container/sequential.h"
#include "torch/nn/modules/linear.h"
#include "torch/optim/adam.h"
#include "torch/nn/utils/clip_grad.h"
#include "torch/optim/sgd.h"

namespace fsdp {
namespace {

using ::fsdp::testing::Block;
using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::g_after_block_backward;
using ::fsdp::testing::g_in_block_forward;
using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::Net;
using ::fsdp::testing::NetImpl;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::MakeOptimizer;
using ::fsdp::testing::MultiRankOptions;
using ::fsdp::testing::Optim;
using ::fsdp::testing::RunOnThreadRanks;
using ::fsdp::testing::Targets;
using ::testing::HasSubstr;

constexpr int kSteps = 5;

struct Trajectory {
  std::vector<float> losses;
  std::vector<double> grad_norms;  // Before clipping, when clipping.
  std::map<std::string, at::Tensor> params;
};

constexpr double kMaxNorm = 0.05;  // Small enough that every step clips.

// clip_norm_type 0: no clipping.
Trajectory TrainLocally(Optim kind, int micro_batches, double clip_norm_type = 0) {
  Net model;
  auto optimizer = MakeOptimizer(kind, model->parameters());
  Trajectory t;
  for (int step = 0; step < kSteps; ++step) {
    float loss_sum = 0;
    for (int micro = 0; micro < micro_batches; ++micro) {
      at::Tensor loss = at::mse_loss(model->forward(Inputs(step, micro)), Targets(step, micro));
      loss.backward();
      loss_sum += loss.item<float>();
    }
    t.losses.push_back(loss_sum / micro_batches);
    if (clip_norm_type != 0) {
      t.grad_norms.push_back(
          torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxNorm, clip_norm_type));
    }
    optimizer->step();
    optimizer->zero_grad();
  }
  for (const auto& item : model->named_parameters()) {
    t.params[item.key()] = item.value().detach().clone();
  }
  return t;
}

struct Case {
  int world_size;
  ShardingStrategy strategy;
  Optim optim;
  int micro_batches;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  bool forward_prefetch = false;
  bool flat = false;  // The whole model one unit (the root) instead of per block.
};

class FullyShardParity : public ::testing::TestWithParam<Case> {};

// The model trains through the runtime's hooks only (no handle is touched
// by the test): every step's loss, the final parameters, the collectives of
// each step and the full-parameter memory seen inside each block's forward.
TEST_P(FullyShardParity, MatchesLocalTraining) {
  const Case c = GetParam();
  const Trajectory expected = TrainLocally(c.optim, c.micro_batches);
  absl::Status status = RunOnThreadRanks(c.world_size, [&](Collectives& comm) {
    Net model;
    FsdpOptions options;
    options.strategy = c.strategy;
    options.backward_prefetch = c.backward_prefetch;
    options.forward_prefetch = c.forward_prefetch;
    const std::unique_ptr<ModuleTypePolicy> per_block = ModuleTypePolicy::Of<BlockImpl>();
    const LambdaPolicy none([](const std::string&, const torch::nn::Module&) { return false; });
    auto wrapped = FullyShardedModel::Wrap(
        model.ptr(), comm, options, c.flat ? none : static_cast<const WrapPolicy&>(*per_block));
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    FullyShardedModel& fsdp = **wrapped;
    const int64_t units = c.flat ? 1 : 4;  // The root (head) and three blocks.
    ASSERT_EQ(static_cast<int64_t>(fsdp.units().size()), units);
    auto optimizer = MakeOptimizer(c.optim, model->parameters());

    // Largest full size of one block and of the root, for the memory bound.
    int64_t root_bytes = fsdp.units()[0]->handle()->layout().padded_numel() * 4;
    int64_t max_block_bytes = 0;
    for (size_t u = 1; u < fsdp.units().size(); ++u) {
      max_block_bytes =
          std::max(max_block_bytes, fsdp.units()[u]->handle()->layout().padded_numel() * 4);
    }
    int64_t peak_in_forward = 0, peak_in_backward = 0;
    g_in_block_forward = [&](int) {
      peak_in_forward = std::max(peak_in_forward, fsdp.FullParamBytes());
    };
    g_after_block_backward = [&](int) {
      peak_in_backward = std::max(peak_in_backward, fsdp.FullParamBytes());
    };

    const int64_t rows = kGlobalBatch / comm.world_size();
    const bool sharded = c.strategy != ShardingStrategy::kNoShard;
    for (int step = 0; step < kSteps; ++step) {
      comm.ResetCounters();
      at::Tensor loss_sum = at::zeros({1});
      for (int micro = 0; micro < c.micro_batches; ++micro) {
        at::Tensor x = Inputs(step, micro).narrow(0, comm.rank() * rows, rows);
        at::Tensor y = Targets(step, micro).narrow(0, comm.rank() * rows, rows);
        at::Tensor loss = at::mse_loss(model->forward(x), y);
        loss.backward();
        loss_sum += loss.detach();
        EXPECT_EQ(fsdp.training_state(), ModelTrainingState::kIdle);
        if (sharded) {
          EXPECT_EQ(fsdp.FullParamBytes(), 0) << "all resharded after backward";
        }
      }
      const CollectiveCounters counted = comm.counters();
      // FULL_SHARD: blocks gather in forward and again in backward; the root
      // keeps its parameters from forward to backward. SHARD_GRAD_OP: once
      // per unit. NO_SHARD: no gathers, one all-reduce per unit.
      const int64_t blocks = units - 1;
      const int64_t gathers = c.strategy == ShardingStrategy::kFullShard
                                  ? blocks * 2 + 1
                                  : (sharded ? units : 0);
      // Prefetching moves all-gathers earlier, never adds any; the first
      // step adds the wrap-plan check at lazy init and the two of the execution-order check.
      EXPECT_EQ(counted.Calls(CollectiveOp::kAllGather),
                gathers * c.micro_batches + (step == 0 ? 3 : 0));
      EXPECT_EQ(counted.Calls(CollectiveOp::kReduceScatter),
                (sharded ? units : 0) * c.micro_batches);
      EXPECT_EQ(counted.Calls(CollectiveOp::kAllReduce), (sharded ? 0 : units) * c.micro_batches);

      optimizer->step();
      optimizer->zero_grad();
      comm.AllReduce(loss_sum, ReduceOp::kAvg)->Wait();
      const float loss = loss_sum.item<float>() / c.micro_batches;
      // Tolerance as in flat_param_handle_test.cc: float32 rounding of the
      // cross-rank sum, far below the effect of a wrong gradient.
      EXPECT_NEAR(loss, expected.losses[step], 1e-5 * std::abs(expected.losses[step]) + 1e-7)
          << "step " << step;
    }
    g_in_block_forward = nullptr;
    g_after_block_backward = nullptr;
    // In backward, after a block's backward: the root, that block (until its
    // gradients are reduced) and, when prefetching, the next block.
    if (c.strategy == ShardingStrategy::kFullShard && !c.flat) {
      const bool prefetching = c.backward_prefetch != BackwardPrefetch::kNone;
      EXPECT_LE(peak_in_backward, root_bytes + (prefetching ? 2 : 1) * max_block_bytes);
      EXPECT_GT(peak_in_backward, 0);
    }
    // Memory, sampled inside each block's forward: FULL_SHARD holds the root
    // and the block running, plus the next block when prefetching forward
    // (which the sample then shows); SHARD_GRAD_OP accumulates blocks.
    if (c.strategy == ShardingStrategy::kFullShard && !c.flat) {
      EXPECT_LE(peak_in_forward, root_bytes + (c.forward_prefetch ? 2 : 1) * max_block_bytes);
      if (c.forward_prefetch) {
        EXPECT_GT(peak_in_forward, root_bytes + max_block_bytes);
      }
      EXPECT_GT(peak_in_forward, 0);
    }
    SummonFullParams full(fsdp);
    for (const auto& item : model->named_parameters()) {
      const at::Tensor& want = expected.params.at(item.key());
      EXPECT_TRUE(at::allclose(item.value().detach(), want, 1e-5, 1e-6))
          << item.key() << " max diff "
          << (item.value().detach() - want).abs().max().item<float>();
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (int w : {1, 2, 3, 4}) {
    for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                               ShardingStrategy::kNoShard}) {
      for (Optim o : {Optim::kSgdMomentum, Optim::kAdam}) cases.push_back({w, s, o, 1});
    }
  }
  for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
    cases.push_back({3, s, Optim::kAdam, 2});  // Gradient accumulation.
  }
  // Prefetch settings (the cases above use the default, BACKWARD_PRE).
  cases.push_back({2, ShardingStrategy::kFullShard, Optim::kSgdMomentum, 1,
                   BackwardPrefetch::kNone, false});
  cases.push_back({3, ShardingStrategy::kFullShard, Optim::kAdam, 1,
                   BackwardPrefetch::kBackwardPost, false});
  cases.push_back({3, ShardingStrategy::kFullShard, Optim::kAdam, 1,
                   BackwardPrefetch::kBackwardPre, true});
  cases.push_back({4, ShardingStrategy::kFullShard, Optim::kSgdMomentum, 2,
                   BackwardPrefetch::kBackwardPost, true});
  cases.push_back({4, ShardingStrategy::kShardGradOp, Optim::kSgdMomentum, 1,
                   BackwardPrefetch::kBackwardPre, true});
  // Flat wrapping: the whole model one unit.
  for (int w : {1, 2, 3, 4}) {
    for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                               ShardingStrategy::kNoShard}) {
      cases.push_back({w, s, w % 2 == 0 ? Optim::kAdam : Optim::kSgdMomentum, 1,
                       BackwardPrefetch::kBackwardPre, false, /*flat=*/true});
    }
  }
  return cases;
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  const char* prefetch[] = {"_NoBackwardPrefetch", "", "_BackwardPost"};
  return "W" + std::to_string(c.world_size) + "_" + ShardingStrategyName(c.strategy) +
         (c.optim == Optim::kSgdMomentum ? "_SgdMomentum" : "_Adam") +
         (c.micro_batches > 1 ? "_Accumulate2" : "") +
         prefetch[static_cast<int>(c.backward_prefetch)] +
         (c.forward_prefetch ? "_ForwardPrefetch" : "") + (c.flat ? "_Flat" : "");
}

INSTANTIATE_TEST_SUITE_P(Cases, FullyShardParity, ::testing::ValuesIn(Cases()), CaseName);

struct UtilityCase {
  int world_size;
  ShardingStrategy strategy;
  double clip_norm_type;  // 0: no clipping.
  bool no_sync_first_micro_batch;
};

class FullyShardUtilities : public ::testing::TestWithParam<UtilityCase> {};

// ClipGradNorm matches torch::nn::utils::clip_grad_norm_ on the unwrapped
// model (the norm it reports and the training it produces), and NoSync over
// the first of two micro-batches matches accumulating both, with no
// communication for the first.
TEST_P(FullyShardUtilities, MatchLocalTraining) {
  const UtilityCase c = GetParam();
  const int micro_batches = c.no_sync_first_micro_batch ? 2 : 1;
  const Trajectory expected = TrainLocally(Optim::kSgdMomentum, micro_batches, c.clip_norm_type);
  absl::Status status = RunOnThreadRanks(c.world_size, [&](Collectives& comm) {
    Net model;
    FsdpOptions options;
    options.strategy = c.strategy;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    FullyShardedModel& fsdp = **wrapped;
    auto optimizer = MakeOptimizer(Optim::kSgdMomentum, model->parameters());
    const int64_t rows = kGlobalBatch / comm.world_size();
    for (int step = 0; step < kSteps; ++step) {
      at::Tensor loss_sum = at::zeros({1});
      for (int micro = 0; micro < micro_batches; ++micro) {
        at::Tensor x = Inputs(step, micro).narrow(0, comm.rank() * rows, rows);
        at::Tensor y = Targets(step, micro).narrow(0, comm.rank() * rows, rows);
        comm.ResetCounters();
        if (c.no_sync_first_micro_batch && micro == 0) {
          NoSync no_sync(fsdp);
          at::Tensor loss = at::mse_loss(model->forward(x), y);
          loss.backward();
          loss_sum += loss.detach();
          const CollectiveCounters counted = comm.counters();
          EXPECT_EQ(counted.Calls(CollectiveOp::kReduceScatter), 0);
          EXPECT_EQ(counted.Calls(CollectiveOp::kAllReduce), 0);
          continue;
        }
        at::Tensor loss = at::mse_loss(model->forward(x), y);
        loss.backward();
        loss_sum += loss.detach();
      }
      if (c.clip_norm_type != 0) {
        const double norm = ClipGradNorm(fsdp, kMaxNorm, c.clip_norm_type).value().item<double>();
        EXPECT_NEAR(norm, expected.grad_norms[step], 1e-5 * expected.grad_norms[step])
            << "step " << step;
      }
      optimizer->step();
      optimizer->zero_grad();
      comm.AllReduce(loss_sum, ReduceOp::kAvg)->Wait();
      EXPECT_NEAR(loss_sum.item<float>() / micro_batches, expected.losses[step],
                  1e-5 * std::abs(expected.losses[step]) + 1e-7)
          << "step " << step;
    }
    SummonFullParams full(fsdp);
    for (const auto& item : model->named_parameters()) {
      const at::Tensor& want = expected.params.at(item.key());
      EXPECT_TRUE(at::allclose(item.value().detach(), want, 1e-5, 1e-6))
          << item.key() << " max diff "
          << (item.value().detach() - want).abs().max().item<float>();
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

// SetRequiresGradientSync (FSDP2's set_requires_gradient_sync) over the
// first of two micro-batches matches accumulating both locally: on the root
// with recurse (every unit, as NoSync), and on blocks.1 alone (the other
// units reduce both micro-batches and accumulate the reduced shards).
TEST(FullyShard, RequiresGradientSyncPerUnitMatchesAccumulation) {
  const Trajectory expected = TrainLocally(Optim::kSgdMomentum, 2, 0);
  for (const bool only_block_1 : {false, true}) {
    SCOPED_TRACE(only_block_1 ? "blocks.1 alone" : "the root, recursively");
    absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
      Net model;
      auto wrapped =
          FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
      ASSERT_TRUE(wrapped.ok()) << wrapped.status();
      FullyShardedModel& fsdp = **wrapped;
      const torch::nn::Module& target =
          only_block_1 ? static_cast<const torch::nn::Module&>(*model->blocks[1]) : *model;
      auto optimizer = MakeOptimizer(Optim::kSgdMomentum, model->parameters());
      const int64_t rows = kGlobalBatch / 2;
      for (int step = 0; step < kSteps; ++step) {
        for (int micro = 0; micro < 2; ++micro) {
          ASSERT_TRUE(
              fsdp.SetRequiresGradientSync(target, {.requires_gradient_sync = micro == 1}).ok());
          comm.ResetCounters();
          at::Tensor x = Inputs(step, micro).narrow(0, comm.rank() * rows, rows);
          at::Tensor y = Targets(step, micro).narrow(0, comm.rank() * rows, rows);
          at::mse_loss(model->forward(x), y).backward();
          // Root and three blocks reduce, less those told not to.
          EXPECT_EQ(comm.counters().Calls(CollectiveOp::kReduceScatter),
                    micro == 1 ? 4 : (only_block_1 ? 3 : 0));
        }
        optimizer->step();
        optimizer->zero_grad();
      }
      for (const auto& unit : fsdp.units()) EXPECT_TRUE(unit->requires_gradient_sync());
      torch::nn::Linear stranger(2, 2);
      EXPECT_EQ(fsdp.SetRequiresGradientSync(*stranger, {.requires_gradient_sync = false}).code(),
                absl::StatusCode::kNotFound);
      // Without recurse the root's unit alone is set; the defaults set it back.
      ASSERT_TRUE(
          fsdp.SetRequiresGradientSync(*model, {.requires_gradient_sync = false, .recurse = false})
              .ok());
      for (const auto& unit : fsdp.units()) {
        EXPECT_EQ(unit->requires_gradient_sync(), !unit->is_root()) << unit->fqn();
      }
      ASSERT_TRUE(fsdp.SetRequiresGradientSync(*model, {}).ok());
      for (const auto& unit : fsdp.units()) EXPECT_TRUE(unit->requires_gradient_sync());
      SummonFullParams full(fsdp);
      for (const auto& item : model->named_parameters()) {
        const at::Tensor& want = expected.params.at(item.key());
        EXPECT_TRUE(at::allclose(item.value().detach(), want, 1e-5, 1e-6))
            << item.key() << " max diff "
            << (item.value().detach() - want).abs().max().item<float>();
      }
    });
    EXPECT_TRUE(status.ok()) << status;
  }
}

std::vector<UtilityCase> UtilityCases() {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<UtilityCase> cases;
  for (int w : {1, 2, 3, 4}) {
    for (double norm : {2.0, 1.0, inf}) {
      cases.push_back({w, ShardingStrategy::kFullShard, norm, false});
    }
  }
  cases.push_back({3, ShardingStrategy::kShardGradOp, 2.0, false});
  cases.push_back({3, ShardingStrategy::kNoShard, 2.0, false});
  cases.push_back({2, ShardingStrategy::kNoShard, inf, false});
  for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                             ShardingStrategy::kNoShard}) {
    cases.push_back({3, s, 0, true});
    cases.push_back({2, s, 2.0, true});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, FullyShardUtilities, ::testing::ValuesIn(UtilityCases()),
    [](const ::testing::TestParamInfo<UtilityCase>& info) {
      const UtilityCase& c = info.param;
      std::string clip = c.clip_norm_type == 0 ? "NoClip"
                         : std::isinf(c.clip_norm_type)
                             ? "ClipInf"
                             : "Clip" + std::to_string(static_cast<int>(c.clip_norm_type));
      return "W" + std::to_string(c.world_size) + "_" + ShardingStrategyName(c.strategy) + "_" +
             clip + (c.no_sync_first_micro_batch ? "_NoSync" : "");
    });

TEST(FullyShard, ClipGradNormAndNoSyncRefuseMisuse) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    FullyShardedModel& fsdp = **wrapped;
    {
      NoSync no_sync(fsdp);
      at::mse_loss(model->forward(Inputs(0, 0)), Targets(0, 0)).backward();
      const auto inside = ClipGradNorm(fsdp, 1.0);
      EXPECT_EQ(inside.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_THAT(inside.status().message(), HasSubstr("ClipGradNorm inside NoSync"));
    }
    const auto bad_norm = ClipGradNorm(fsdp, 1.0, 0.5);
    EXPECT_EQ(bad_norm.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(bad_norm.status().message(), HasSubstr("norm_type 0.5 must be >= 1 or infinity"));
    const auto bad_max = ClipGradNorm(fsdp, -1.0);
    EXPECT_EQ(bad_max.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(bad_max.status().message(), HasSubstr("max_norm -1 must be >= 0"));
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(SummonFullParams, ShowsFullParametersAndWritesBack) {
  absl::Status status = RunOnThreadRanks(3, [](Collectives& comm) {
    Net reference;
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    FullyShardedModel& fsdp = **wrapped;
    auto ref_params = reference->named_parameters();
    {
      SummonFullParams full(fsdp);
      for (const auto& item : model->named_parameters()) {
        EXPECT_TRUE(at::equal(item.value(), ref_params[item.key()])) << item.key();
      }
      torch::NoGradGuard no_grad;
      model->blocks[1]->as<BlockImpl>()->fc->weight.fill_(0.5);  // Same on every rank.
    }
    EXPECT_EQ(fsdp.FullParamBytes(), 0);
    {
      SummonOptions options;
      options.writeback = false;
      SummonFullParams full(fsdp, options);
      EXPECT_TRUE(at::equal(model->blocks[1]->as<BlockImpl>()->fc->weight,
                            at::full({11, 13}, 0.5)))
          << "the first scope wrote its change back";
      torch::NoGradGuard no_grad;
      model->head->weight.fill_(7);
    }
    {
      SummonFullParams full(fsdp);
      EXPECT_TRUE(at::equal(model->head->weight, ref_params["head.weight"]))
          << "without writeback the change is dropped";
    }
    {
      SummonOptions options;
      options.writeback = false;
      options.rank0_only = true;
      SummonFullParams full(fsdp, options);
      const int64_t numel = model->blocks[0]->as<BlockImpl>()->fc->weight.numel();
      if (comm.rank() == 0) {
        EXPECT_EQ(numel, 13 * 7);
      } else {
        EXPECT_LT(numel, 13 * 7) << "other ranks keep their shards";
      }
    }
    {
      SummonOptions options;
      options.recurse = false;
      SummonFullParams full(fsdp, options);
      EXPECT_EQ(model->head->weight.sizes(), (std::vector<int64_t>{5, 9}));
      EXPECT_EQ(model->blocks[0]->as<BlockImpl>()->fc->weight.dim(), 1)
          << "recurse=false leaves the blocks sharded";
    }
    {
      // One unit by its module, as summon_full_params(module, recurse=False).
      SummonOptions options;
      options.recurse = false;
      SummonFullParams full(fsdp, *model->blocks[1], options);
      EXPECT_EQ(model->blocks[1]->as<BlockImpl>()->fc->weight.sizes(),
                (std::vector<int64_t>{11, 13}));
      EXPECT_EQ(model->blocks[0]->as<BlockImpl>()->fc->weight.dim(), 1);
      EXPECT_EQ(model->blocks[2]->as<BlockImpl>()->fc->weight.dim(), 1);
      EXPECT_EQ(model->head->weight.dim(), 1) << "the root's unit stays sharded";
    }
    {
      // A module no unit wraps is refused by name.
      EXPECT_THROW(SummonFullParams(fsdp, *model->blocks[1]->as<BlockImpl>()->fc), c10::Error);
    }
    EXPECT_EQ(fsdp.FullParamBytes(), 0);
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(SummonFullParams, WithGradsShowsTheUnshardedGradients) {
  // The gradients of the unwrapped model on the global batch.
  Net reference;
  at::mse_loss(reference->forward(Inputs(0, 0)), Targets(0, 0)).backward();
  std::map<std::string, at::Tensor> expected;
  for (const auto& item : reference->named_parameters()) {
    expected[item.key()] = item.value().grad().clone();
  }
  absl::Status status = RunOnThreadRanks(4, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    const int64_t rows = kGlobalBatch / comm.world_size();
    at::mse_loss(model->forward(Inputs(0, 0).narrow(0, comm.rank() * rows, rows)),
                 Targets(0, 0).narrow(0, comm.rank() * rows, rows))
        .backward();
    SummonOptions options;
    options.with_grads = true;
    {
      SummonFullParams full(**wrapped, options);
      for (const auto& item : model->named_parameters()) {
        EXPECT_TRUE(at::allclose(item.value().grad(), expected.at(item.key()), 1e-5, 1e-7))
            << item.key();
      }
      model->head->weight.grad().zero_();  // Written back to the shards.
    }
    SummonFullParams again(**wrapped, options);
    EXPECT_EQ(model->head->weight.grad().abs().sum().item<float>(), 0);
    EXPECT_GT(model->head->bias.grad().abs().sum().item<float>(), 0);
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(SummonFullParams, RefusesMisuse) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    SummonOptions both;
    both.rank0_only = true;
    try {
      SummonFullParams full(**wrapped, both);
      ADD_FAILURE() << "writeback with rank0_only did not throw";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.msg(), HasSubstr("writeback and rank0_only together are not supported"));
    }
    SummonFullParams full(**wrapped);
    try {
      model->forward(Inputs(0, 0));
      ADD_FAILURE() << "forward inside SummonFullParams did not throw";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.msg(), HasSubstr("unit '<root>' on rank " + std::to_string(comm.rank()) +
                                     " of 2: cannot enter FORWARD from SUMMON_FULL_PARAMS"));
    }
    EXPECT_EQ((*wrapped)->training_state(), ModelTrainingState::kIdle)
        << "a refused forward leaves the model as it was";
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Three blocks of one shape whose order depends on the rank: without the
// check, ranks would exchange the wrong blocks' shards without any error.
struct RankOrderedNetImpl : torch::nn::Module, ShardableModule {
  explicit RankOrderedNetImpl(int rank) : rank(rank) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) blocks->push_back(Block(6, 6, i));
  }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    const std::vector<int> order = rank == 1 ? std::vector<int>{0, 2, 1}
                                             : std::vector<int>{0, 1, 2};
    for (int i : order) x = blocks[i]->as<BlockImpl>()->forward(x);
    return unit.Return(x);
  }
  torch::nn::ModuleList blocks{nullptr};
  int rank;
};
TORCH_MODULE(RankOrderedNet);

// Equal-sized units in another order on rank 1. The collective headers
// (comm/gloo_collectives.h) stop the first all-gather whose unit differs;
// without them, the execution order check at the end of the first forward
// does. Either way the error names the units on every rank, and every unit
// is left resharded and idle.
TEST(FullyShard, DifferentUnitOrderAcrossRanksIsNamedOnEveryRank) {
  for (const bool headers : {true, false}) {
    SCOPED_TRACE(headers ? "with collective headers" : "without collective headers");
    MultiRankOptions options;
    options.gloo.check_collective_headers = headers;
    absl::Status status = RunOnThreadRanks(3, [&](Collectives& comm) {
      RankOrderedNet model(comm.rank());
      auto wrapped =
          FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
      ASSERT_TRUE(wrapped.ok()) << wrapped.status();
      try {
        model->forward(at::ones({2, 6}));
        ADD_FAILURE() << "a different unit order on rank 1 was not detected";
      } catch (const c10::Error& e) {
        if (headers) {
          EXPECT_THAT(e.msg(), HasSubstr("first divergence at collective #2:\n"
                                         "    ranks 0, 2 issued #2 all-gather of 42 Float "
                                         "(unit 'blocks.1', forward)\n"
                                         "    rank 1 issued #2 all-gather of 42 Float (unit "
                                         "'blocks.2', forward)"));
        } else {
          EXPECT_THAT(e.msg(),
                      HasSubstr("FSDP units ran in different orders on different ranks"));
          EXPECT_THAT(e.msg(), HasSubstr("at position 2 of the order in which units finished "
                                         "their forward, rank 0 ran 'blocks.1', rank 1 ran "
                                         "'blocks.2', rank 2 ran 'blocks.1'"));
        }
      }
      EXPECT_EQ((*wrapped)->training_state(), ModelTrainingState::kIdle);
      EXPECT_EQ((*wrapped)->FullParamBytes(), 0);
      for (const auto& unit : (*wrapped)->units()) {
        if (unit->handle() != nullptr) {
          EXPECT_EQ(unit->handle()->training_state(), HandleTrainingState::kIdle) << unit->fqn();
        }
      }
    }, options);
    EXPECT_TRUE(status.ok()) << status;
  }
}

TEST(FullyShard, ApplyInitializesThroughTheShards) {
  absl::Status status = RunOnThreadRanks(3, [](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    int visited = 0;
    const absl::Status applied = Apply(**wrapped, [&](torch::nn::Module& module) {
      ++visited;
      if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(&module)) {
        linear->weight.fill_(0.125);
        linear->bias.zero_();
      }
    });
    ASSERT_TRUE(applied.ok()) << applied;
    {
      SummonFullParams full(**wrapped);
      EXPECT_EQ(Apply(**wrapped, [](torch::nn::Module&) {}).code(),
                absl::StatusCode::kFailedPrecondition);
    }
    const absl::Status thrown = Apply(
        **wrapped, [](torch::nn::Module&) { TORCH_CHECK(false, "an initializer that fails"); });
    EXPECT_THAT(thrown.message(), HasSubstr("an initializer that fails"));
    EXPECT_TRUE((*wrapped)->RequireIdle("after a failed Apply").ok());
    EXPECT_EQ(visited, 9);  // The root, the ModuleList, 3 blocks, their Linears, the head.
    EXPECT_EQ((*wrapped)->FullParamBytes(), 0);
    SummonFullParams full(**wrapped);
    for (const auto& item : model->named_parameters()) {
      const bool weight = item.key().find("weight") != std::string::npos;
      EXPECT_TRUE(at::equal(item.value(), at::full_like(item.value(), weight ? 0.125 : 0.0)))
          << item.key();
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Blocks inside a torch::nn::Sequential, whose forward libtorch dispatches
// through AnyModule: the blocks' scopes still run.
struct SequentialNetImpl : torch::nn::Module, ShardableModule {
  SequentialNetImpl() {
    body = register_module("body", torch::nn::Sequential(Block(7, 13, 0), Block(13, 11, 1),
                                                         Block(11, 5, 2)));
    testing::FillDeterministically(*this);
  }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    return unit.Return(body->forward(x));
  }
  torch::nn::Sequential body{nullptr};
};
TORCH_MODULE(SequentialNet);

TEST(FullyShard, BlocksInsideSequentialAreUnits) {
  std::vector<float> expected;
  {
    SequentialNet model;
    auto optimizer = MakeOptimizer(Optim::kAdam, model->parameters());
    for (int step = 0; step < 3; ++step) {
      at::Tensor loss = at::mse_loss(model->forward(Inputs(step, 0)), Targets(step, 0));
      loss.backward();
      expected.push_back(loss.item<float>());
      optimizer->step();
      optimizer->zero_grad();
    }
  }
  absl::Status status = RunOnThreadRanks(3, [&](Collectives& comm) {
    SequentialNet model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    EXPECT_EQ((*wrapped)->units().size(), 4u);
    EXPECT_EQ((*wrapped)->units()[1]->fqn(), "body.0");
    auto optimizer = MakeOptimizer(Optim::kAdam, model->parameters());
    const int64_t rows = kGlobalBatch / comm.world_size();
    for (int step = 0; step < 3; ++step) {
      comm.ResetCounters();
      at::Tensor loss =
          at::mse_loss(model->forward(Inputs(step, 0).narrow(0, comm.rank() * rows, rows)),
                       Targets(step, 0).narrow(0, comm.rank() * rows, rows));
      loss.backward();
      optimizer->step();
      optimizer->zero_grad();
      // Three blocks gathered twice; the root holds no parameters.
      EXPECT_EQ(comm.counters().Calls(CollectiveOp::kAllGather), 6 + (step == 0 ? 3 : 0));
      at::Tensor global = loss.detach().clone();
      comm.AllReduce(global, ReduceOp::kAvg)->Wait();
      EXPECT_NEAR(global.item<float>(), expected[step], 1e-5 * std::abs(expected[step]));
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(FullyShard, ParameterNamesAndIdentityAreThoseOfTheUnwrappedModel) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    Net model;
    std::vector<std::string> names_before;
    std::vector<const void*> impls_before;
    for (const auto& item : model->named_parameters()) {
      names_before.push_back(item.key());
      impls_before.push_back(item.value().unsafeGetTensorImpl());
    }
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    std::vector<std::string> names_after;
    std::vector<const void*> impls_after;
    for (const auto& item : model->named_parameters()) {
      names_after.push_back(item.key());
      impls_after.push_back(item.value().unsafeGetTensorImpl());
    }
    EXPECT_EQ(names_after, names_before);
    EXPECT_EQ(impls_after, impls_before);
    EXPECT_EQ(GetModuleUnit(model->blocks[1].get())->fqn(), "blocks.1");
    EXPECT_TRUE(GetModuleUnit(model.get())->is_root());
    EXPECT_EQ(GetModuleUnit(model->head.get()), nullptr) << "the head is not a unit";
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(FullyShard, SelectingAModuleFsdpCannotHookIsAnErrorNamingIt) {
  absl::Status status = RunOnThreadRanks(1, [](Collectives& comm) {
    Net model;
    auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, {},
                                           *ModuleTypePolicy::Of<torch::nn::LinearImpl>());
    ASSERT_FALSE(wrapped.ok());
    EXPECT_THAT(std::string(wrapped.status().message()),
                ::testing::ContainsRegex("chose module 'blocks.0.fc' \\([^)]*Linear[^)]*\\) "
                                         "as an FSDP unit but FSDP cannot hook its forward"));
    // Nothing was registered by the failed wrap.
    EXPECT_EQ(GetModuleUnit(model.get()), nullptr);
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A root FSDP cannot hook may hold no parameters of its own.
struct PlainRootImpl : torch::nn::Module {
  PlainRootImpl() {
    block = register_module("block", Block(4, 4, 0));
    scale = register_parameter("scale", at::ones({4}));
  }
  Block block{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(PlainRoot);

TEST(FullyShard, RootWithOwnParametersMustBeHookable) {
  absl::Status status = RunOnThreadRanks(1, [](Collectives& comm) {
    PlainRoot model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_FALSE(wrapped.ok());
    EXPECT_THAT(wrapped.status().message(),
                HasSubstr("holds parameters of its own ('scale', ...) but FSDP cannot hook "
                          "its forward"));
    EXPECT_EQ(GetModuleUnit(model->block.get()), nullptr) << "nothing registered";
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(FullyShard, FailedWrapLeavesTheModelUntouched) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    Net model;
    // The last block's bias is float64: that unit cannot be flattened.
    auto& fc = model->blocks[2]->as<BlockImpl>()->fc;
    fc->bias.set_data(fc->bias.detach().to(at::kDouble));
    std::vector<at::Tensor> before;
    for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_FALSE(wrapped.ok());
    EXPECT_THAT(wrapped.status().message(),
                HasSubstr("unit 'blocks.2' on rank " + std::to_string(comm.rank()) +
                          " of 2: cannot flatten parameters: 'blocks.2.fc.bias' has dtype "
                          "Double but 'blocks.2.fc.weight' has Float"));
    const auto after = model->parameters();
    ASSERT_EQ(after.size(), before.size());
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_TRUE(at::equal(after[i], before[i])) << "parameter " << i << " was changed";
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(FullyShard, WrappingTwiceIsAnError) {
  absl::Status status = RunOnThreadRanks(1, [](Collectives& comm) {
    Net model;
    auto first = FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(first.ok()) << first.status();
    auto second =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
    EXPECT_THAT(second.status().message(), HasSubstr("is already part of a wrapped model"));
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(FullyShard, BadOptionsAreRefusedAtWrap) {
  absl::Status status = RunOnThreadRanks(1, [](Collectives& comm) {
    Net model;
    FsdpOptions options;
    options.verify_collectives_every = -1;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    EXPECT_EQ(wrapped.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(wrapped.status().message(),
                HasSubstr("FsdpOptions::verify_collectives_every must be >= 0 (0: never), "
                          "got -1"));
    EXPECT_EQ(GetModuleUnit(model.get()), nullptr) << "nothing registered";
    FsdpOptions zero_divide;
    zero_divide.gradient_divide_factor = 0.0;
    wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, zero_divide, *ModuleTypePolicy::Of<BlockImpl>());
    EXPECT_THAT(wrapped.status().message(),
                HasSubstr("FsdpOptions::gradient_divide_factor must be positive, got 0"));
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A parameter used by two sibling units cannot be sharded by either.
struct SharedWeightBlockImpl : torch::nn::Module, ShardableModule {
  explicit SharedWeightBlockImpl(at::Tensor shared) {
    weight = register_parameter("weight", shared);
  }
  at::Tensor weight;
};
TORCH_MODULE(SharedWeightBlock);

struct TiedImpl : torch::nn::Module, ShardableModule {
  TiedImpl() {
    at::Tensor shared = at::ones({4, 4});
    a = register_module("a", SharedWeightBlock(shared));
    b = register_module("b", SharedWeightBlock(shared));
  }
  SharedWeightBlock a{nullptr}, b{nullptr};
};
TORCH_MODULE(Tied);

// A parameter registered by two units goes to the lowest unit holding both
// (here the root), which is unsharded whenever either runs.
TEST(FullyShard, SharedParameterGoesToTheLowestUnitHoldingAllItsUsers) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    Tied model;
    auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, {},
                                           *ModuleTypePolicy::Of<SharedWeightBlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    const WrapPlan& plan = (*wrapped)->plan();
    ASSERT_EQ(plan.units.size(), 3u);
    EXPECT_THAT(plan.units[0].param_fqns, ::testing::ElementsAre("a.weight"));
    EXPECT_TRUE(plan.units[1].param_fqns.empty());
    EXPECT_TRUE(plan.units[2].param_fqns.empty());
    EXPECT_NE((*wrapped)->units()[0]->handle(), nullptr);
    EXPECT_EQ((*wrapped)->units()[1]->handle(), nullptr);
    EXPECT_EQ(model->a->weight.numel(), 8) << "the root's shard of 16 elements";
    EXPECT_TRUE(model->a->weight.is_same(model->b->weight));
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(FullyShard, NoGradForwardLeavesNothingUnsharded) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    Net model;
    FsdpOptions options;
    options.strategy = ShardingStrategy::kShardGradOp;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    {
      torch::NoGradGuard no_grad;
      model->forward(Inputs(0, 0));
    }
    EXPECT_EQ((*wrapped)->FullParamBytes(), 0);
    EXPECT_EQ((*wrapped)->training_state(), ModelTrainingState::kIdle);
    at::mse_loss(model->forward(Inputs(0, 0)), Targets(0, 0)).backward();
    EXPECT_EQ((*wrapped)->FullParamBytes(), 0);
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined());
  });
  EXPECT_TRUE(status.ok()) << status;
}


namespace nested {

// A unit that holds parameters of its own and a nested unit: the nested
// block's parameters belong to the block, the rest to the outer unit.
struct OuterImpl : torch::nn::Module, ShardableModule {
  OuterImpl(int64_t in, int64_t mid, int64_t out, int index) {
    fc = register_module("fc", torch::nn::Linear(in, mid));
    inner = register_module("inner", Block(mid, out, index));
  }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    return unit.Return(inner->forward(at::tanh(fc->forward(x))));
  }
  torch::nn::Linear fc{nullptr};
  Block inner{nullptr};
};
TORCH_MODULE(Outer);

struct NestedNetImpl : torch::nn::Module, ShardableModule {
  NestedNetImpl() {
    outers = register_module("outers", torch::nn::ModuleList());
    outers->push_back(Outer(7, 13, 11, 0));
    outers->push_back(Outer(11, 9, 5, 1));
    testing::FillDeterministically(*this);
  }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    for (const auto& outer : *outers) x = outer->as<OuterImpl>()->forward(x);
    return unit.Return(x);
  }
  torch::nn::ModuleList outers{nullptr};
};
TORCH_MODULE(NestedNet);

struct NestedCase {
  int world_size;
  ShardingStrategy strategy;
};

class NestedUnits : public ::testing::TestWithParam<NestedCase> {};

TEST_P(NestedUnits, MatchLocalTrainingWithCountedCollectivesAndBoundedMemory) {
  const NestedCase c = GetParam();
  std::vector<float> expected_losses;
  std::map<std::string, at::Tensor> expected_params;
  {
    NestedNet model;
    auto optimizer = MakeOptimizer(Optim::kAdam, model->parameters());
    for (int step = 0; step < kSteps; ++step) {
      at::Tensor loss = at::mse_loss(model->forward(Inputs(step, 0)), Targets(step, 0));
      loss.backward();
      expected_losses.push_back(loss.item<float>());
      optimizer->step();
      optimizer->zero_grad();
    }
    for (const auto& item : model->named_parameters()) {
      expected_params[item.key()] = item.value().detach().clone();
    }
  }
  absl::Status status = RunOnThreadRanks(c.world_size, [&](Collectives& comm) {
    NestedNet model;
    FsdpOptions options;
    options.strategy = c.strategy;
    auto wrapped = FullyShardedModel::Wrap(
        model.ptr(), comm, options,
        LambdaPolicy([](const std::string&, const torch::nn::Module& m) {
          return dynamic_cast<const OuterImpl*>(&m) != nullptr ||
                 dynamic_cast<const BlockImpl*>(&m) != nullptr;
        }));
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    FullyShardedModel& fsdp = **wrapped;
    std::vector<std::string> fqns;
    for (const auto& unit : fsdp.units()) fqns.push_back(unit->fqn());
    EXPECT_THAT(fqns, ::testing::ElementsAre("", "outers.0", "outers.0.inner", "outers.1",
                                             "outers.1.inner"));
    EXPECT_EQ(fsdp.units()[0]->handle(), nullptr) << "the root holds no parameters";
    EXPECT_EQ(fsdp.units()[1]->handle()->layout().flat_numel(), 7 * 13 + 13)
        << "outer's own Linear only";
    // Inside an inner block's forward, FULL_SHARD holds exactly that block
    // and its outer unit; no other unit's parameters.
    int64_t max_pair_bytes = 0;
    for (size_t u : {1, 3}) {
      max_pair_bytes =
          std::max(max_pair_bytes, (fsdp.units()[u]->handle()->layout().padded_numel() +
                                    fsdp.units()[u + 1]->handle()->layout().padded_numel()) *
                                       4);
    }
    int64_t peak_in_forward = 0;
    g_in_block_forward = [&](int) {
      peak_in_forward = std::max(peak_in_forward, fsdp.FullParamBytes());
    };
    auto optimizer = MakeOptimizer(Optim::kAdam, model->parameters());
    const int64_t rows = kGlobalBatch / comm.world_size();
    const bool sharded = c.strategy != ShardingStrategy::kNoShard;
    for (int step = 0; step < kSteps; ++step) {
      comm.ResetCounters();
      at::Tensor loss =
          at::mse_loss(model->forward(Inputs(step, 0).narrow(0, comm.rank() * rows, rows)),
                       Targets(step, 0).narrow(0, comm.rank() * rows, rows));
      loss.backward();
      optimizer->step();
      optimizer->zero_grad();
      const int64_t units_with_params = 4;
      const int64_t gathers = c.strategy == ShardingStrategy::kFullShard
                                  ? 2 * units_with_params
                                  : (sharded ? units_with_params : 0);
      EXPECT_EQ(comm.counters().Calls(CollectiveOp::kAllGather),
                gathers + (step == 0 ? 3 : 0));
      EXPECT_EQ(comm.counters().Calls(CollectiveOp::kReduceScatter),
                sharded ? units_with_params : 0);
      if (sharded) {
        EXPECT_EQ(fsdp.FullParamBytes(), 0);
      }
      at::Tensor global = loss.detach().clone();
      comm.AllReduce(global, ReduceOp::kAvg)->Wait();
      EXPECT_NEAR(global.item<float>(), expected_losses[step],
                  1e-5 * std::abs(expected_losses[step]) + 1e-7)
          << "step " << step;
    }
    g_in_block_forward = nullptr;
    if (c.strategy == ShardingStrategy::kFullShard) {
      EXPECT_EQ(peak_in_forward, max_pair_bytes);
    }
    SummonFullParams full(fsdp);
    for (const auto& item : model->named_parameters()) {
      EXPECT_TRUE(at::allclose(item.value(), expected_params.at(item.key()), 1e-5, 1e-6))
          << item.key();
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

std::string NestedCaseName(const ::testing::TestParamInfo<NestedCase>& info) {
  return "W" + std::to_string(info.param.world_size) + "_" +
         ShardingStrategyName(info.param.strategy);
}

std::vector<NestedCase> NestedCases() {
  std::vector<NestedCase> cases;
  for (int w : {2, 3}) {
    for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                               ShardingStrategy::kNoShard}) {
      cases.push_back({w, s});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, NestedUnits, ::testing::ValuesIn(NestedCases()),
                         NestedCaseName);

}  // namespace nested

TEST(FullyShard, DifferentWrapPlansAcrossRanksAreNamedAtTheFirstForward) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    Net model;
    const LambdaPolicy flat([](const std::string&, const torch::nn::Module&) { return false; });
    const std::unique_ptr<ModuleTypePolicy> per_block = ModuleTypePolicy::Of<BlockImpl>();
    auto wrapped = FullyShardedModel::Wrap(
        model.ptr(), comm, {},
        comm.rank() == 0 ? static_cast<const WrapPolicy&>(*per_block) : flat);
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    try {
      model->forward(at::ones({2, 7}));
      ADD_FAILURE() << "different wrap plans were not detected";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.msg(), HasSubstr(absl::StrCat("rank ", comm.rank(),
                                                  " of 2: ranks wrapped the model differently")));
      EXPECT_THAT(e.msg(), HasSubstr("rank 0: 4 units, "));
      EXPECT_THAT(e.msg(), HasSubstr("rank 1: 1 units, "));
    }
    EXPECT_EQ((*wrapped)->training_state(), ModelTrainingState::kIdle);
    EXPECT_EQ((*wrapped)->FullParamBytes(), 0);
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(FullyShard, DifferentOptionsAcrossRanksAreNamedAtTheFirstForward) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    Net model;
    FsdpOptions options;
    options.forward_prefetch = comm.rank() == 1;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    try {
      model->forward(at::ones({2, 7}));
      ADD_FAILURE() << "different options were not detected";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.msg(), HasSubstr("ranks wrapped the model differently (units, their "
                                     "parameters, or FSDP options differ)"));
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Uses a block's parameter in the root's own forward, outside the block's
// scope, and none of the block's output: its gradient reaches the
// accumulator before the block's pre-backward hook ever ran.
struct ParameterUsedOutsideItsUnitImpl : torch::nn::Module, ShardableModule {
  ParameterUsedOutsideItsUnitImpl() { block = register_module("block", Block(7, 5, 0)); }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    at::Tensor y = block->forward(x).detach();
    return unit.Return(y.sum() + block->fc->weight.sum());
  }
  Block block{nullptr};
};
TORCH_MODULE(ParameterUsedOutsideItsUnit);

TEST(FullyShard, GradientBeforeItsUnitsPreBackwardIsNamed) {
  absl::Status status = RunOnThreadRanks(1, [](Collectives& comm) {
    ParameterUsedOutsideItsUnit model;
    FsdpOptions options;
    options.strategy = ShardingStrategy::kShardGradOp;  // Full parameters until backward.
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    at::Tensor loss = model->forward(at::ones({2, 7}));
    try {
      loss.backward();
      ADD_FAILURE() << "a gradient outside the unit's backward was not detected";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.msg(), HasSubstr("unit 'block' on rank 0 of 1: a gradient arrived before "
                                     "the unit's pre-backward hook ran (state IDLE)"));
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

}  // namespace
}  // namespace fsdp
