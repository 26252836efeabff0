// FSDP2's controls over when a unit holds full parameters and how its
// gradients are divided: SetReshardAfterBackward, Unshard (with its
// UnshardHandle) and Reshard, and SetGradientDivideFactor per unit.
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "fsdp/flat_param_handle.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"
#include "torch/nn/modules/linear.h"
#include "torch/optim/sgd.h"

namespace fsdp {
namespace {

using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::g_after_block_backward;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::MakeOptimizer;
using ::fsdp::testing::Net;
using ::fsdp::testing::Optim;
using ::fsdp::testing::RunOnThreadRanks;
using ::fsdp::testing::Targets;
using ::testing::HasSubstr;

constexpr int kSteps = 3;
constexpr int kMicroBatches = 2;

struct AccumulationRun {
  std::vector<float> losses;                 // Rank 0's, per micro-batch.
  std::map<std::string, at::Tensor> params;  // Full, after the last step.
  // Per micro-batch, rank 0's all-gathers in forward and in backward.
  std::vector<int64_t> forward_gathers, backward_gathers;
  std::vector<int64_t> kept_bytes;  // FullParamBytes between the micro-batches.
};

at::Tensor RankRows(const at::Tensor& batch, int rank, int world) {
  const int64_t rows = kGlobalBatch / world;
  return batch.narrow(0, rank * rows, rows);
}

// Gradient accumulation over two micro-batches, the first without
// gradient sync and, with `keep`, without resharding after its backward.
AccumulationRun Accumulate(int world, ShardingStrategy strategy, bool keep,
                           std::optional<at::ScalarType> param_dtype = std::nullopt) {
  AccumulationRun run;
  absl::Status status = RunOnThreadRanks(world, [&](Collectives& comm) {
    Net model;
    FsdpOptions options;
    options.strategy = strategy;
    options.mixed_precision.param_dtype = param_dtype;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    FullyShardedModel& fsdp = **wrapped;
    auto optimizer = MakeOptimizer(Optim::kSgdMomentum, model->parameters());
    for (int step = 0; step < kSteps; ++step) {
      for (int micro = 0; micro < kMicroBatches; ++micro) {
        const bool last = micro == kMicroBatches - 1;
        ASSERT_TRUE(fsdp.SetRequiresGradientSync(*model, {.requires_gradient_sync = last}).ok());
        ASSERT_TRUE(
            fsdp.SetReshardAfterBackward(*model, {.reshard_after_backward = last || !keep}).ok());
        comm.ResetCounters();
        at::Tensor out = model->forward(RankRows(Inputs(step, micro), comm.rank(), world));
        at::Tensor loss =
            at::mse_loss(out.to(at::kFloat), RankRows(Targets(step, micro), comm.rank(), world));
        const int64_t forward_gathers = comm.counters().Calls(CollectiveOp::kAllGather);
        loss.backward();
        if (comm.rank() != 0) continue;
        run.losses.push_back(loss.item<float>());
        run.forward_gathers.push_back(forward_gathers);
        run.backward_gathers.push_back(comm.counters().Calls(CollectiveOp::kAllGather) -
                                       forward_gathers);
        run.kept_bytes.push_back(fsdp.FullParamBytes());
      }
      optimizer->step();
      optimizer->zero_grad();
    }
    SummonFullParams full(fsdp);
    if (comm.rank() != 0) return;
    for (const auto& item : model->named_parameters()) {
      run.params[item.key()] = item.value().detach().clone();
    }
  });
  EXPECT_TRUE(status.ok()) << status;
  return run;
}

// The net holds 7*13+13 + 13*11+11 + 11*9+9 + 9*5+5 = 416 parameters.
int64_t BytesPerElement(at::ScalarType dtype) { return dtype == at::kFloat ? 4 : 2; }

struct KeepCase {
  int world;
  ShardingStrategy strategy;
  std::optional<at::ScalarType> param_dtype;
};

class ReshardAfterBackward : public ::testing::TestWithParam<KeepCase> {};

// Keeping the full parameters after the non-reducing micro-batch changes
// no number (bit for bit, against the same accumulation resharding after
// it), saves the next forward's all-gathers (and, under SHARD_GRAD_OP,
// its backward's), and the reducing micro-batch leaves nothing unsharded.
TEST_P(ReshardAfterBackward, KeptParametersSkipTheNextAllGathersAndChangeNoNumber) {
  const KeepCase c = GetParam();
  const AccumulationRun plain = Accumulate(c.world, c.strategy, false, c.param_dtype);
  const AccumulationRun kept = Accumulate(c.world, c.strategy, true, c.param_dtype);
  ASSERT_EQ(kept.losses.size(), plain.losses.size());
  for (size_t i = 0; i < kept.losses.size(); ++i) {
    EXPECT_EQ(kept.losses[i], plain.losses[i]) << "micro-batch " << i;
  }
  ASSERT_EQ(kept.params.size(), plain.params.size());
  for (const auto& [name, value] : plain.params) {
    EXPECT_TRUE(at::equal(kept.params.at(name), value)) << name;
  }
  // Resharding after backward: every unit is gathered in forward, and the
  // blocks again in backward under FULL_SHARD (the root keeps its own).
  // NO_SHARD gathers nothing; what it keeps is its bfloat16 copy.
  const bool no_shard = c.strategy == ShardingStrategy::kNoShard;
  const int64_t forward_gathers = no_shard ? 0 : 4;  // The root and three blocks.
  const int64_t backward_gathers = c.strategy == ShardingStrategy::kFullShard ? 3 : 0;
  const int64_t full_bytes = 416 * BytesPerElement(c.param_dtype.value_or(at::kFloat));
  for (size_t i = 0; i < kept.losses.size(); ++i) {
    SCOPED_TRACE("micro-batch " + std::to_string(i));
    const bool first = i % kMicroBatches == 0;
    // The first forward also checks the wrap and the unit order across
    // ranks, with all-gathers of its own.
    if (i > 0) EXPECT_EQ(plain.forward_gathers[i], forward_gathers);
    EXPECT_EQ(plain.backward_gathers[i], backward_gathers);
    EXPECT_EQ(plain.kept_bytes[i], 0);
    if (i > 0) EXPECT_EQ(kept.forward_gathers[i], first ? forward_gathers : 0);
    EXPECT_EQ(kept.backward_gathers[i], backward_gathers);
    if (first) {
      EXPECT_GE(kept.kept_bytes[i], full_bytes);  // Padding aside, every unit's.
    } else {
      EXPECT_EQ(kept.kept_bytes[i], 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ReshardAfterBackward,
    ::testing::Values(KeepCase{2, ShardingStrategy::kFullShard, std::nullopt},
                      KeepCase{3, ShardingStrategy::kFullShard, std::nullopt},
                      KeepCase{2, ShardingStrategy::kShardGradOp, std::nullopt},
                      KeepCase{3, ShardingStrategy::kFullShard, at::kBFloat16},
                      KeepCase{2, ShardingStrategy::kNoShard, at::kBFloat16}),
    [](const ::testing::TestParamInfo<KeepCase>& info) {
      return "W" + std::to_string(info.param.world) + "_" +
             ShardingStrategyName(info.param.strategy) +
             (info.param.param_dtype ? std::string("_") + DtypeFlagName(*info.param.param_dtype)
                                     : std::string());
    });

// Forward and backward of micro-batch `micro` of step 0 on this rank's
// rows; returns the loss.
float MicroBatch(Net& model, Collectives& comm, int micro) {
  at::Tensor loss = at::mse_loss(model->forward(RankRows(Inputs(0, micro), comm.rank(), 2)),
                                 RankRows(Targets(0, micro), comm.rank(), 2));
  loss.backward();
  return loss.item<float>();
}

// Kept full parameters stay valid only while no shard changes: a write to
// one rank's shard of the root between micro-batches (here by hand, on rank
// 0 alone) makes every rank gather the root again, and the next loss is the
// one the written shard gives (that of a run that resharded instead). The
// parameters point at their shards between passes, and SummonFullParams
// drops what is kept.
TEST(ReshardAfterBackward, AShardWrittenOnOneRankIsGatheredAgainOnEvery) {
  std::vector<float> losses(2);  // [resharded before the write, kept], rank 0's.
  for (int keep = 0; keep < 2; ++keep) {
    absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
      Net model;
      auto wrapped =
          FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
      ASSERT_TRUE(wrapped.ok()) << wrapped.status();
      FullyShardedModel& fsdp = **wrapped;
      ASSERT_TRUE(fsdp.SetRequiresGradientSync(*model, {.requires_gradient_sync = false}).ok());
      ASSERT_TRUE(fsdp.SetReshardAfterBackward(*model, {.reshard_after_backward = false}).ok());
      MicroBatch(model, comm, 0);
      EXPECT_GT(fsdp.FullParamBytes(), 0);
      for (const auto& item : model->named_parameters()) {
        EXPECT_EQ(item.value().dim(), 1) << item.key();  // On its shard between passes.
      }
      if (keep == 0) ASSERT_TRUE(fsdp.Reshard(*model).ok());
      if (comm.rank() == 0) {
        at::NoGradGuard no_grad;
        model->head->weight.add_(0.5);  // Rank 0's part of the root's shard.
      }
      comm.ResetCounters();
      const float loss = MicroBatch(model, comm, 1);
      if (comm.rank() == 0) losses[keep] = loss;
      // The root and three blocks: all gathered again after Reshard; kept,
      // the root only, as stale; and the blocks again for backward.
      EXPECT_EQ(comm.counters().Calls(CollectiveOp::kAllGather), keep == 0 ? 4 + 3 : 1 + 3);
      EXPECT_EQ(comm.counters().Calls(CollectiveOp::kAllReduce), keep == 0 ? 0 : 1);
      MicroBatch(model, comm, 0);
      ASSERT_GT(fsdp.FullParamBytes(), 0);
      { SummonFullParams full(fsdp); }
      EXPECT_EQ(fsdp.FullParamBytes(), 0);
    });
    EXPECT_TRUE(status.ok()) << status;
  }
  EXPECT_EQ(losses[0], losses[1]);
}

// A frozen unit has no gradients to reduce, so a reducing backward keeps it
// too; only the trainable units reshard. With int8 all-gathers the kept
// parameters are the decoded values, which the check between steps must
// still recognize as this shard's (else every step would gather again).
TEST(ReshardAfterBackward, FrozenUnitsStayUnshardedAcrossReducingBackward) {
  for (CommQuantization quantization : {CommQuantization::kNone, CommQuantization::kInt8}) {
    SCOPED_TRACE(CommQuantizationName(quantization));
    absl::Status status = RunOnThreadRanks(2, [quantization](Collectives& comm) {
      Net model;
      for (auto& p : model->blocks[1]->parameters()) p.set_requires_grad(false);
      FsdpOptions options;
      options.all_gather_quantization = quantization;
      auto wrapped =
          FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
      ASSERT_TRUE(wrapped.ok()) << wrapped.status();
      FullyShardedModel& fsdp = **wrapped;
      ASSERT_TRUE(fsdp.SetReshardAfterBackward(*model, {.reshard_after_backward = false}).ok());
      auto optimizer = MakeOptimizer(Optim::kAdam, model->parameters());
      const FlatParamHandle* frozen = fsdp.units()[2]->handle();
      ASSERT_EQ(fsdp.units()[2]->fqn(), "blocks.1");
      for (int step = 0; step < 3; ++step) {
        comm.ResetCounters();
        at::Tensor loss = at::mse_loss(model->forward(RankRows(Inputs(step, 0), comm.rank(), 2)),
                                       RankRows(Targets(step, 0), comm.rank(), 2));
        const int64_t forward_gathers = comm.counters().Calls(CollectiveOp::kAllGather);
        loss.backward();
        // From the second step on, blocks.1's forward needs no all-gather (its
        // backward does: FULL_SHARD reshards it after forward).
        if (step > 0) EXPECT_EQ(forward_gathers, 3);
        EXPECT_EQ(comm.counters().Calls(CollectiveOp::kAllGather) - forward_gathers, 3);
        EXPECT_TRUE(frozen->holds_kept_full());
        for (const auto& unit : fsdp.units()) {
          EXPECT_FALSE(unit->handle()->is_unsharded()) << unit->fqn();
          if (unit->handle() != frozen) EXPECT_FALSE(unit->handle()->holds_kept_full());
        }
        EXPECT_TRUE(ClipGradNorm(fsdp, 1.0).ok());  // Between steps as always.
        optimizer->step();  // Steps the trainable units only: the kept one stays valid.
        optimizer->zero_grad();
      }
      ASSERT_TRUE(fsdp.Reshard(*model).ok());
      EXPECT_EQ(fsdp.FullParamBytes(), 0);
    });
    EXPECT_TRUE(status.ok()) << status;
  }
}

// Unshard issues one unit's all-gather and returns; the forward waits for
// it and gathers only the others, with the losses of a plain run.
TEST(Unshard, AnAsyncUnshardServesTheUnitsForward) {
  std::vector<std::vector<float>> losses(2);  // [plain, unsharded ahead], rank 0.
  for (int ahead = 0; ahead < 2; ++ahead) {
    absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
      Net model;
      auto wrapped =
          FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
      ASSERT_TRUE(wrapped.ok()) << wrapped.status();
      FullyShardedModel& fsdp = **wrapped;
      auto optimizer = MakeOptimizer(Optim::kAdam, model->parameters());
      const torch::nn::Module& first_block = *model->blocks[0];
      for (int step = 0; step < kSteps; ++step) {
        comm.ResetCounters();
        if (ahead == 1) {
          absl::StatusOr<UnshardHandle> handle = fsdp.Unshard(first_block);
          ASSERT_TRUE(handle.ok()) << handle.status();
          // The first Unshard also checks the wrap across ranks (one
          // all-gather), as the first forward would.
          const int64_t issued = step == 0 ? 2 : 1;
          EXPECT_EQ(comm.counters().Calls(CollectiveOp::kAllGather), issued);
          EXPECT_GT(fsdp.FullParamBytes(), 0);  // Allocated for the gather, this unit's only.
          EXPECT_EQ(fsdp.FullParamBytes(), fsdp.units()[1]->handle()->full_param_bytes());
          if (step == 1) {
            handle->Wait();  // Gathered and kept; the parameters stay on their shards.
            EXPECT_TRUE(fsdp.units()[1]->handle()->holds_kept_full());
            EXPECT_EQ(model->blocks[0]->as<BlockImpl>()->fc->weight.dim(), 1);
          }
          // Twice is once; Wait after it served is a no-op.
          ASSERT_TRUE(fsdp.Unshard(first_block).ok());
          EXPECT_EQ(comm.counters().Calls(CollectiveOp::kAllGather), issued);
          if (step == 2) handle->Wait();
        }
        at::Tensor loss = at::mse_loss(model->forward(RankRows(Inputs(step, 0), comm.rank(), 2)),
                                       RankRows(Targets(step, 0), comm.rank(), 2));
        if (step > 0) EXPECT_EQ(comm.counters().Calls(CollectiveOp::kAllGather), 4);
        loss.backward();
        optimizer->step();
        optimizer->zero_grad();
        if (comm.rank() == 0) losses[ahead].push_back(loss.item<float>());
      }
      EXPECT_EQ(fsdp.FullParamBytes(), 0);
    });
    EXPECT_TRUE(status.ok()) << status;
  }
  EXPECT_EQ(losses[0], losses[1]);
}

// An optimizer step after Unshard (before the forward) reaches no rank's
// gathered copy (it was taken from a copy of the shard), and the forward
// gathers the unit again: its loss is a plain run's. Unshard in backward,
// or of a stranger, is refused by name.
TEST(Unshard, AStepAfterUnshardIsGatheredAgain) {
  std::vector<float> losses(2);  // [plain, unsharded before the step], rank 0's.
  for (int ahead = 0; ahead < 2; ++ahead) {
    absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
      Net model;
      auto wrapped =
          FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
      ASSERT_TRUE(wrapped.ok()) << wrapped.status();
      FullyShardedModel& fsdp = **wrapped;
      torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
      MicroBatch(model, comm, 0);
      if (ahead == 1) ASSERT_TRUE(fsdp.Unshard(*model->blocks[1]).ok());
      optimizer.step();
      optimizer.zero_grad();
      comm.ResetCounters();
      const float loss = MicroBatch(model, comm, 1);
      if (comm.rank() == 0) losses[ahead] = loss;
      EXPECT_EQ(comm.counters().Calls(CollectiveOp::kAllGather), 4 + 3);
      EXPECT_EQ(comm.counters().Calls(CollectiveOp::kAllReduce), ahead);  // The check.
      EXPECT_FALSE(fsdp.units()[2]->handle()->holds_kept_full());
      if (ahead == 0) return;

      absl::Status in_backward;
      g_after_block_backward = [&](int index) {
        if (index == 2) in_backward = fsdp.Unshard(*model->blocks[0]).status();
      };
      MicroBatch(model, comm, 0);
      g_after_block_backward = nullptr;
      EXPECT_EQ(in_backward.code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_THAT(in_backward.message(), HasSubstr("the model is in backward"));
      torch::nn::Linear stranger(2, 2);
      EXPECT_EQ(fsdp.Unshard(*stranger).status().code(), absl::StatusCode::kNotFound);
      EXPECT_EQ(fsdp.Reshard(*stranger).code(), absl::StatusCode::kNotFound);
      EXPECT_EQ(fsdp.SetReshardAfterBackward(*stranger, {.reshard_after_backward = false}).code(),
                absl::StatusCode::kNotFound);
    });
    EXPECT_TRUE(status.ok()) << status;
  }
  EXPECT_EQ(losses[0], losses[1]);
}

// A divide factor on one unit changes that unit's gradients alone: at W = 2,
// factor 1 (the sum) doubles blocks.1's and leaves the others as they are;
// nullopt restores the average.
TEST(GradientDivideFactor, PerUnitFactorScalesThatUnitOnly) {
  // [default, blocks.1 summed, set and reset], rank 0's full gradients.
  std::vector<std::map<std::string, at::Tensor>> grads(3);
  for (int run = 0; run < 3; ++run) {
    absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
      Net model;
      auto wrapped =
          FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
      ASSERT_TRUE(wrapped.ok()) << wrapped.status();
      FullyShardedModel& fsdp = **wrapped;
      if (run >= 1)
        ASSERT_TRUE(fsdp.SetGradientDivideFactor(*model->blocks[1], {.factor = 1.0}).ok());
      if (run == 2)
        ASSERT_TRUE(fsdp.SetGradientDivideFactor(*model, {.factor = std::nullopt}).ok());
      EXPECT_EQ(fsdp.SetGradientDivideFactor(*model, {.factor = 0.0}).code(),
                absl::StatusCode::kInvalidArgument);
      at::mse_loss(model->forward(RankRows(Inputs(0, 0), comm.rank(), 2)),
                   RankRows(Targets(0, 0), comm.rank(), 2))
          .backward();
      SummonFullParams full(fsdp, {.writeback = false, .rank0_only = false, .with_grads = true});
      if (comm.rank() != 0) return;
      for (const auto& item : model->named_parameters()) {
        grads[run][item.key()] = item.value().grad().clone();
      }
    });
    EXPECT_TRUE(status.ok()) << status;
  }
  ASSERT_EQ(grads[0].size(), 8u);
  for (const auto& [name, grad] : grads[0]) {
    const bool scaled = name.rfind("blocks.1.", 0) == 0;
    EXPECT_TRUE(at::equal(scaled ? grad * 2 : grad, grads[1].at(name))) << name;
    EXPECT_TRUE(at::equal(grad, grads[2].at(name))) << name;
  }
}

}  // namespace
}  // namespace fsdp
