// CPU offload (FsdpOptions::offload_params): training matches the same run
// without offload bit for bit, and single-process training within float32
// rounding, across strategies, optimizers, gradient accumulation (inside
// NoSync and outside it), mixed precision, hybrid sharding and
// ClipGradNorm; summon_full_params writes back into the host shards.
//
// This build computes on CPU, so the compute device and the host are the
// same memory; offload still makes every copy (the code path a CUDA build
// runs), which is what these tests exercise. What they cannot show, pinned
// memory and the stream ordering of the copies, needs a GPU.
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "comm/gloo_collectives.h"
#include "comm/hybrid_groups.h"
#include "fsdp/flat_param_handle.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "fsdp/utilities.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"
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

constexpr int kSteps = 4;
constexpr double kMaxNorm = 0.05;  // Every step clips.

struct Trajectory {
  std::vector<float> losses;
  std::vector<double> norms;  // ClipGradNorm's, when clipping.
  std::map<std::string, at::Tensor> params;  // Full, after the last step.
};

struct OffloadCase {
  const char* name;
  int world_size;
  ShardingStrategy strategy;
  Optim optim;
  int micro_batches = 1;
  bool no_sync_first = false;  // The first micro-batch inside NoSync.
  bool clip = false;
  std::optional<at::ScalarType> param_dtype;
  int shard_group_size = 0;  // Hybrid: > 0.
};

// The unwrapped model on the whole global batch.
Trajectory TrainLocally(const OffloadCase& c) {
  Net model;
  auto optimizer = MakeOptimizer(c.optim, model->parameters());
  Trajectory run;
  for (int step = 0; step < kSteps; ++step) {
    float loss_sum = 0;
    for (int micro = 0; micro < c.micro_batches; ++micro) {
      at::Tensor loss = at::mse_loss(model->forward(Inputs(step, micro)), Targets(step, micro));
      loss.backward();
      loss_sum += loss.item<float>();
    }
    run.losses.push_back(loss_sum / c.micro_batches);
    if (c.clip) run.norms.push_back(torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxNorm));
    optimizer->step();
    optimizer->zero_grad();
  }
  for (const auto& item : model->named_parameters()) {
    run.params[item.key()] = item.value().detach().clone();
  }
  return run;
}

// Rank 0's run of FSDP with or without offload; checks on every rank, for
// the offloaded run, where the shards and gradients live.
Trajectory TrainSharded(const OffloadCase& c, bool offload) {
  std::vector<Trajectory> runs(c.world_size);
  auto store = c10::make_intrusive<c10d::HashStore>();
  absl::Status status = RunOnThreadRanks(c.world_size, [&](Collectives& comm) {
    HybridShardCollectives hybrid;
    ProcessGroups fsdp_groups(comm);
    FsdpOptions options;
    options.strategy = c.strategy;
    options.offload_params = offload;
    options.mixed_precision.param_dtype = c.param_dtype;
    if (c.shard_group_size > 0) {
      GlooOptions gloo;
      gloo.hostname = "127.0.0.1";
      gloo.timeout = std::chrono::seconds(60);
      auto groups = CreateHybridShardCollectives(
          comm.rank(), HybridShardLayout::Create(c.world_size, c.shard_group_size).value(),
          gloo.group_name, GlooGroupConnector(store, gloo));
      ASSERT_TRUE(groups.ok()) << groups.status();
      hybrid = std::move(*groups);
      fsdp_groups.shard = hybrid.shard.get();
      fsdp_groups.replicate = hybrid.replicate.get();
    }
    Net model;
    auto wrapped = FullyShardedModel::Wrap(model.ptr(), fsdp_groups, options,
                                           *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    FullyShardedModel& fsdp = **wrapped;
    auto optimizer = MakeOptimizer(c.optim, model->parameters());
    const int64_t rows = kGlobalBatch / comm.world_size();
    Trajectory& run = runs[comm.rank()];
    for (int step = 0; step < kSteps; ++step) {
      at::Tensor loss_sum = at::zeros({1});
      for (int micro = 0; micro < c.micro_batches; ++micro) {
        at::Tensor x = Inputs(step, micro).narrow(0, comm.rank() * rows, rows);
        at::Tensor y = Targets(step, micro).narrow(0, comm.rank() * rows, rows);
        std::optional<NoSync> no_sync;
        if (c.no_sync_first && micro == 0) no_sync.emplace(fsdp);
        at::Tensor loss = at::mse_loss(model->forward(x).to(at::kFloat), y);
        loss.backward();
        loss_sum += loss.detach();
      }
      if (offload) {
        for (const auto& unit : fsdp.units()) {
          const FlatParamHandle& h = *unit->handle();
          EXPECT_TRUE(h.offloads_params());
          // Shard and gradient in host memory (the parameters' dtype).
          EXPECT_EQ(h.ShardBytesOn(c10::DeviceType::CPU), 2 * h.layout().shard_numel() * 4)
              << unit->fqn();
          // What the optimizer steps: host views of the shard and of the
          // sharded gradient.
          for (size_t i = 0; i < h.entries().size(); ++i) {
            const at::Tensor& p = h.entries()[i].param;
            EXPECT_TRUE(p.is_alias_of(h.local_shard())) << h.entries()[i].fqn;
            ASSERT_TRUE(p.grad().defined()) << h.entries()[i].fqn;
            EXPECT_TRUE(p.grad().device().is_cpu());
            EXPECT_EQ(p.grad().sizes(), p.sizes());
          }
        }
      }
      if (c.clip) run.norms.push_back(ClipGradNorm(fsdp, kMaxNorm).value().item<double>());
      optimizer->step();
      optimizer->zero_grad();
      comm.AllReduce(loss_sum, ReduceOp::kAvg)->Wait();
      run.losses.push_back(loss_sum.item<float>() / c.micro_batches);
    }
    SummonFullParams full(fsdp, {/*writeback=*/false});
    for (const auto& item : model->named_parameters()) {
      run.params[item.key()] = item.value().detach().clone();
    }
  });
  EXPECT_TRUE(status.ok()) << status;
  return runs[0];
}

class CpuOffload : public ::testing::TestWithParam<OffloadCase> {};

TEST_P(CpuOffload, MatchesTheRunWithoutOffloadAndLocalTraining) {
  const OffloadCase c = GetParam();
  const Trajectory offloaded = TrainSharded(c, /*offload=*/true);
  const Trajectory on_device = TrainSharded(c, /*offload=*/false);
  ASSERT_EQ(offloaded.losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(on_device.losses.size(), static_cast<size_t>(kSteps));
  // The same arithmetic in the same order: bit for bit.
  EXPECT_EQ(offloaded.losses, on_device.losses);
  EXPECT_EQ(offloaded.norms, on_device.norms);
  for (const auto& [fqn, p] : on_device.params) {
    EXPECT_TRUE(at::equal(offloaded.params.at(fqn), p))
        << fqn << " max diff " << (offloaded.params.at(fqn) - p).abs().max().item<float>();
  }
  if (c.param_dtype) return;  // Low precision is compared with full precision above only.
  const Trajectory local = TrainLocally(c);
  for (int step = 0; step < kSteps; ++step) {
    EXPECT_NEAR(offloaded.losses[step], local.losses[step],
                1e-5 * std::abs(local.losses[step]) + 1e-7)
        << "step " << step;
    if (c.clip) {
      EXPECT_NEAR(offloaded.norms[step], local.norms[step], 1e-5 * local.norms[step]);
    }
  }
  for (const auto& [fqn, want] : local.params) {
    EXPECT_TRUE(at::allclose(offloaded.params.at(fqn), want, 1e-5, 1e-6))
        << fqn << " max diff " << (offloaded.params.at(fqn) - want).abs().max().item<float>();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CpuOffload,
    ::testing::Values(
        OffloadCase{"W2_FullShard_Adam", 2, ShardingStrategy::kFullShard, Optim::kAdam},
        OffloadCase{"W3_FullShard_Sgd_Accumulate2", 3, ShardingStrategy::kFullShard,
                    Optim::kSgdMomentum, 2},
        OffloadCase{"W2_FullShard_Adam_NoSyncThenSync", 2, ShardingStrategy::kFullShard,
                    Optim::kAdam, 2, true},
        OffloadCase{"W4_ShardGradOp_Sgd_Accumulate2_Clip", 4, ShardingStrategy::kShardGradOp,
                    Optim::kSgdMomentum, 2, false, true},
        OffloadCase{"W3_NoShard_Adam_Accumulate2", 3, ShardingStrategy::kNoShard, Optim::kAdam,
                    2},
        OffloadCase{"W2_NoShard_Sgd_NoSyncThenSync_Clip", 2, ShardingStrategy::kNoShard,
                    Optim::kSgdMomentum, 2, true, true},
        OffloadCase{"W1_FullShard_Adam_Clip", 1, ShardingStrategy::kFullShard, Optim::kAdam, 1,
                    false, true},
        OffloadCase{"W2_FullShard_bf16_Accumulate2", 2, ShardingStrategy::kFullShard,
                    Optim::kSgdMomentum, 2, false, false, at::kBFloat16},
        OffloadCase{"W4_HybridShard2_Adam_Accumulate2", 4, ShardingStrategy::kHybridShard,
                    Optim::kAdam, 2, false, false, std::nullopt, 2}),
    [](const ::testing::TestParamInfo<OffloadCase>& info) { return info.param.name; });

// Offloaded NO_SHARD computes on the compute-device copy, not on the host
// shard it would view without offload; summon_full_params shows (and
// writes back into) the host shards for every strategy.
TEST(CpuOffload, ComputesOnTheDeviceCopyAndSummonWritesBackToTheHost) {
  for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
    SCOPED_TRACE(ShardingStrategyName(strategy));
    ASSERT_TRUE(RunOnThreadRanks(2, [&](Collectives& comm) {
                  Net model;
                  FsdpOptions options;
                  options.strategy = strategy;
                  options.offload_params = true;
                  auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, options,
                                                         *ModuleTypePolicy::Of<BlockImpl>());
                  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
                  FullyShardedModel& fsdp = **wrapped;
                  const FlatParamHandle& block0 =
                      *fsdp.units()[1]->handle();  // Pre-order: root, blocks.0, ...
                  bool checked = false;
                  ::fsdp::testing::g_in_block_forward = [&](int index) {
                    if (index != 0) return;
                    const at::Tensor& w = model->blocks[0]->as<BlockImpl>()->fc->weight;
                    EXPECT_FALSE(w.is_alias_of(block0.local_shard()));
                    EXPECT_EQ(w.sizes(), (std::vector<int64_t>{13, 7}));
                    EXPECT_GT(block0.full_param_bytes(), 0);
                    checked = true;
                  };
                  at::Tensor loss = at::mse_loss(model->forward(Inputs(0, 0)), Targets(0, 0));
                  loss.backward();
                  ::fsdp::testing::g_in_block_forward = nullptr;
                  EXPECT_TRUE(checked);
                  EXPECT_EQ(fsdp.FullParamBytes(), 0);
                  {
                    SummonFullParams full(fsdp, {/*writeback=*/true});
                    at::NoGradGuard no_grad;
                    model->blocks[0]->as<BlockImpl>()->fc->bias.fill_(comm.rank() + 1.5);
                  }
                  // Every rank wrote its own value into its own part.
                  SummonFullParams full(fsdp, {/*writeback=*/false});
                  const at::Tensor bias = model->blocks[0]->as<BlockImpl>()->fc->bias;
                  ASSERT_EQ(bias.numel(), 13);
                  if (strategy == ShardingStrategy::kNoShard) {
                    EXPECT_TRUE(at::equal(bias, at::full({13}, comm.rank() + 1.5)));
                  } else {
                    // blocks.0 holds 13*7 + 13 = 104 elements, 52 per rank:
                    // the bias (elements 91..103) lies in rank 1's half.
                    EXPECT_TRUE(at::equal(bias, at::full({13}, 2.5)));
                  }
                }).ok());
  }
}

}  // namespace
}  // namespace fsdp
