// Frozen and trainable parameters in one unit, as LoRA fine-tuning has
// them: each unit holds frozen base projections and their trainable
// low-rank adapters. Sharded training matches local training step by step,
// only the trainable parameters' gradients are reduced (the counted bytes
// say so) and kept, and the frozen parameters never change.
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "ATen/ATen.h"
#include "fsdp/flat_param_handle.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_util.h"
#include "fsdp/unit_module.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"
#include "torch/nn/modules/container/sequential.h"
#include "torch/nn/modules/linear.h"
#include "torch/optim/adamw.h"

namespace fsdp {
namespace {

using ::fsdp::testing::FillDeterministically;
using ::fsdp::testing::RunOnThreadRanks;
using ::testing::HasSubstr;

constexpr int64_t kWidth = 10;
constexpr int64_t kRank = 3;   // The adapters' rank.
constexpr int64_t kBatch = 6;  // Divisible by 2 and 3.
constexpr int kSteps = 4;
constexpr int kBlocks = 2;
// Per block: two frozen base Linears, two adapters (A and B each).
constexpr int64_t kFrozenPerBlock = 2 * (kWidth * kWidth + kWidth);
constexpr int64_t kTrainablePerBlock = 2 * (2 * kRank * kWidth);
constexpr int64_t kHead = kWidth * kWidth + kWidth;  // The root's trainable head.

// y = base(x) + B A x: a frozen projection and its trainable low-rank update.
class LoraLinearImpl : public torch::nn::Module {
 public:
  LoraLinearImpl() {
    base = register_module("base", torch::nn::Linear(kWidth, kWidth));
    lora_a = register_parameter("lora_a", at::empty({kRank, kWidth}));
    lora_b = register_parameter("lora_b", at::empty({kWidth, kRank}));
  }
  at::Tensor forward(const at::Tensor& x) {
    return base->forward(x) + at::matmul(at::matmul(x, lora_a.t()), lora_b.t());
  }

  torch::nn::Linear base{nullptr};
  at::Tensor lora_a, lora_b;
};
TORCH_MODULE(LoraLinear);

class LoraBlockImpl : public torch::nn::Module {
 public:
  LoraBlockImpl() {
    in = register_module("in", LoraLinear());
    out = register_module("out", LoraLinear());
  }
  at::Tensor forward(const at::Tensor& x) { return out->forward(at::tanh(in->forward(x))); }

  LoraLinear in{nullptr}, out{nullptr};
};
TORCH_MODULE(LoraBlock);

// Freezes the base projections, as a LoRA recipe does after loading them.
void FreezeBases(torch::nn::Module& model) {
  for (const auto& item : model.named_parameters()) {
    if (item.key().find(".base.") != std::string::npos) item.value().requires_grad_(false);
  }
}

torch::nn::Sequential PlainModel(at::ScalarType dtype = at::kFloat) {
  torch::nn::Sequential model(LoraBlock(), LoraBlock(), torch::nn::Linear(kWidth, kWidth));
  FillDeterministically(*model);
  model->to(dtype);
  FreezeBases(*model);
  return model;
}

// The same modules, each block a unit and the root (the head) one too.
UnitModule<torch::nn::SequentialImpl> UnitModel(at::ScalarType dtype = at::kFloat) {
  UnitModule model(torch::nn::Sequential(UnitModule(LoraBlock{}), UnitModule(LoraBlock{}),
                                         torch::nn::Linear(kWidth, kWidth)));
  FillDeterministically(*model);
  model->to(dtype);
  FreezeBases(*model);
  return model;
}

std::vector<at::Tensor> Trainable(const torch::nn::Module& model) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : model.parameters()) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

std::unique_ptr<torch::optim::AdamW> Optimizer(const torch::nn::Module& model) {
  return std::make_unique<torch::optim::AdamW>(
      Trainable(model), torch::optim::AdamWOptions(0.01).weight_decay(0.01));
}

at::Tensor Inputs(int step) {
  return at::sin(at::arange(kBatch * kWidth, at::kFloat) * 0.37 + step).view({kBatch, kWidth});
}
at::Tensor Targets(int step) {
  return at::cos(at::arange(kBatch * kWidth, at::kFloat) * 0.11 - step).view({kBatch, kWidth});
}

int64_t Padded(int64_t numel, int64_t world) { return (numel + world - 1) / world * world; }

struct Case {
  int world_size;
  ShardingStrategy strategy;
  bool offload_params;
  // Parameters in float64 computed in float32 (MixedPrecision param_dtype):
  // the low-precision copy of both segments; the reduction is in float32.
  bool float32_compute = false;
};

class FrozenAndTrainableInOneUnit : public ::testing::TestWithParam<Case> {};

TEST_P(FrozenAndTrainableInOneUnit, MatchesLocalTrainingAndReducesOnlyTrainableBytes) {
  const Case c = GetParam();
  const at::ScalarType dtype = c.float32_compute ? at::kDouble : at::kFloat;
  // Local training: the losses, the last step's gradients and the final
  // parameters.
  std::vector<float> expected_losses;
  std::map<std::string, at::Tensor> expected_grads, expected_params, initial_params;
  {
    torch::nn::Sequential model = PlainModel(dtype);
    for (const auto& item : model->named_parameters()) {
      initial_params[item.key()] = item.value().detach().clone();
    }
    auto optimizer = Optimizer(*model);
    for (int step = 0; step < kSteps; ++step) {
      at::Tensor loss =
          at::mse_loss(model->forward(Inputs(step).to(dtype)), Targets(step).to(dtype));
      loss.backward();
      expected_losses.push_back(loss.item<float>());
      if (step == kSteps - 1) {
        for (const auto& item : model->named_parameters()) {
          if (item.value().grad().defined()) {
            expected_grads[item.key()] = item.value().grad().clone();
          }
        }
      }
      optimizer->step();
      optimizer->zero_grad();
    }
    for (const auto& item : model->named_parameters()) {
      expected_params[item.key()] = item.value().detach().clone();
    }
  }
  ASSERT_EQ(expected_grads.size(), 2u * 2 * kBlocks + 2) << "adapters and head only";

  absl::Status status = RunOnThreadRanks(c.world_size, [&](Collectives& comm) {
    auto model = UnitModel(dtype);
    FsdpOptions options;
    options.strategy = c.strategy;
    options.offload_params = c.offload_params;
    if (c.float32_compute) options.mixed_precision.param_dtype = at::kFloat;
    auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, options,
                                           *ModuleTypePolicy::Of<UnitModuleImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    FullyShardedModel& fsdp = **wrapped;
    ASSERT_EQ(fsdp.units().size(), 3u);
    const bool sharded = c.strategy != ShardingStrategy::kNoShard;
    const int64_t w = sharded ? c.world_size : 1;
    for (int b = 1; b <= kBlocks; ++b) {
      const FlatParamHandle& h = *fsdp.units()[b]->handle();
      EXPECT_EQ(h.layout().trainable_numel(), kTrainablePerBlock);
      EXPECT_EQ(h.layout().flat_numel(), kTrainablePerBlock + kFrozenPerBlock);
      // Two segments, each padded to a multiple of the shard group.
      EXPECT_EQ(h.layout().shard_numel(),
                (Padded(kTrainablePerBlock, w) + Padded(kFrozenPerBlock, w)) / w);
      EXPECT_EQ(h.layout().trainable_shard_numel(), Padded(kTrainablePerBlock, w) / w);
    }
    EXPECT_THAT(fsdp.plan().ToString(),
                HasSubstr(std::to_string(kTrainablePerBlock + kFrozenPerBlock) + " elements (" +
                          std::to_string(kTrainablePerBlock) + " trainable)"));

    auto optimizer = Optimizer(*model);
    const int64_t rows = kBatch / c.world_size;
    // Only the trainable segments travel in backward: the blocks' adapters
    // and the head, each padded to a multiple of the shard group.
    const int64_t reduced_bytes =
        (kBlocks * Padded(kTrainablePerBlock, w) + Padded(kHead, w)) * 4;
    const int64_t whole_units_bytes =
        (kBlocks * Padded(kTrainablePerBlock + kFrozenPerBlock, w) + Padded(kHead, w)) * 4;
    for (int step = 0; step < kSteps; ++step) {
      comm.ResetCounters();
      const at::Tensor x = Inputs(step).narrow(0, comm.rank() * rows, rows).to(dtype);
      const at::Tensor y = model->forward(x);  // In the compute dtype.
      at::Tensor loss =
          at::mse_loss(y, Targets(step).narrow(0, comm.rank() * rows, rows).to(y.scalar_type()));
      loss.backward();
      const CollectiveCounters counted = comm.counters();
      const CollectiveOp reduction =
          sharded ? CollectiveOp::kReduceScatter : CollectiveOp::kAllReduce;
      EXPECT_EQ(counted.Calls(reduction), kBlocks + 1) << "step " << step;
      EXPECT_EQ(counted.Bytes(reduction), reduced_bytes)
          << "step " << step << ": reducing whole units would move " << whole_units_bytes;
      // A block's unshard is one all-gather per segment. FULL_SHARD gathers
      // the blocks in forward and again in backward, SHARD_GRAD_OP once;
      // the root, one segment, once. The first step adds the cross-rank
      // wrap check (one) and execution-order check (two).
      const int64_t gathers =
          !sharded ? 0
                   : (c.strategy == ShardingStrategy::kFullShard ? 2 : 1) * kBlocks * 2 + 1;
      EXPECT_EQ(counted.Calls(CollectiveOp::kAllGather), gathers + (step == 0 ? 3 : 0))
          << "step " << step;

      if (step == kSteps - 1) {
        SummonOptions with_grads;
        with_grads.writeback = false;
        with_grads.with_grads = true;
        SummonFullParams full(fsdp, with_grads);
        for (const auto& item : model->named_parameters()) {
          auto expected = expected_grads.find(item.key());
          if (expected == expected_grads.end()) {
            EXPECT_FALSE(item.value().grad().defined()) << item.key() << " is frozen";
            continue;
          }
          // Each rank's gradient is of its rows' mean: the average over
          // ranks is the global batch's.
          ASSERT_TRUE(item.value().grad().defined()) << item.key();
          EXPECT_TRUE(at::allclose(item.value().grad(), expected->second, 1e-4, 1e-6))
              << item.key();
        }
      }
      optimizer->step();
      optimizer->zero_grad();
      at::Tensor global = loss.detach().clone();
      comm.AllReduce(global, ReduceOp::kAvg)->Wait();
      EXPECT_NEAR(global.item<float>(), expected_losses[step],
                  1e-5 * std::abs(expected_losses[step]))
          << "step " << step;
    }
    // Gradient memory only for the trainable segment.
    for (const auto& unit : fsdp.units()) {
      const FlatParamHandle& h = *unit->handle();
      EXPECT_EQ(
          h.ShardBytesOn(c10::DeviceType::CPU),
          (h.layout().shard_numel() + h.layout().trainable_shard_numel()) * at::elementSize(dtype))
          << unit->fqn();
    }
    EXPECT_EQ(fsdp.FullParamBytes(), 0);
    SummonFullParams full(fsdp);
    for (const auto& item : model->named_parameters()) {
      if (item.value().requires_grad()) {
        EXPECT_TRUE(at::allclose(item.value(), expected_params.at(item.key()), 1e-5, 1e-6))
            << item.key();
        EXPECT_FALSE(at::equal(item.value(), initial_params.at(item.key())))
            << item.key() << " trained";
      } else {
        EXPECT_TRUE(at::equal(item.value(), initial_params.at(item.key())))
            << item.key() << " is frozen";
      }
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Which parameters train is fixed when the model is wrapped (it fixes the
// segments); a later change is named at the next forward, before the unit
// gathers anything.
// A unit with frozen parameters reshards as soon as its backward is done
// (its adapters' gradients and its input's gradient), not at the end of
// the whole backward: when the gradient reaches the model's input, the
// last thing backward computes, both blocks are sharded again, so a LoRA
// model is never unsharded whole. The input requires grad so that the
// first block's input gradient is computed too.
TEST(FrozenAndTrainable, AUnitReshardsOnceItsInputsGradientIsComputed) {
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    auto model = UnitModel();
    auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, {},
                                           *ModuleTypePolicy::Of<UnitModuleImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    FullyShardedModel& fsdp = **wrapped;
    ASSERT_EQ(fsdp.units().size(), 3u);
    for (int step = 0; step < 2; ++step) {
      at::Tensor x = Inputs(step).narrow(0, comm.rank() * 3, 3).clone().requires_grad_(true);
      std::vector<bool> unsharded_at_input;
      x.register_hook([&](const at::Tensor& grad) {
        for (size_t u = 1; u < fsdp.units().size(); ++u) {
          unsharded_at_input.push_back(fsdp.units()[u]->handle()->is_unsharded());
        }
        return grad;
      });
      at::mse_loss(model->forward(x), Targets(step).narrow(0, comm.rank() * 3, 3)).backward();
      EXPECT_EQ(unsharded_at_input, (std::vector<bool>{false, false})) << "step " << step;
      EXPECT_TRUE(x.grad().defined());
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(FrozenAndTrainable, ChangingRequiresGradAfterWrappingIsAnError) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    auto model = UnitModel();
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<UnitModuleImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    const at::Tensor x = Inputs(0).narrow(0, comm.rank() * 3, 3);
    const at::Tensor head_weight = model->named_parameters()["2.weight"];
    head_weight.requires_grad_(false);
    try {
      model->forward(x);
      ADD_FAILURE() << "a frozen head went unnoticed";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.msg(), HasSubstr("unit '<root>' on rank " + std::to_string(comm.rank()) +
                                     " of 2: '2.weight' has requires_grad=false but was "
                                     "trainable when the model was wrapped"));
    }
    head_weight.requires_grad_(true);
    at::mse_loss(model->forward(x), Targets(0).narrow(0, comm.rank() * 3, 3)).backward();
    EXPECT_TRUE(head_weight.grad().defined()) << "the refused forward changed nothing";

    model->named_parameters()["1.in.base.weight"].requires_grad_(true);
    try {
      model->forward(x);
      ADD_FAILURE() << "an unfrozen base went unnoticed";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.msg(), HasSubstr("'1.in.base.weight' has requires_grad=true but was frozen "
                                     "when the model was wrapped; which parameters train is "
                                     "fixed at wrap time"));
    }
    model->named_parameters()["1.in.base.weight"].requires_grad_(false);
    at::mse_loss(model->forward(x), Targets(0).narrow(0, comm.rank() * 3, 3)).backward();
    EXPECT_EQ((*wrapped)->FullParamBytes(), 0) << "the abandoned forward left nothing gathered";
  });
  EXPECT_TRUE(status.ok()) << status;
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, FrozenAndTrainableInOneUnit,
    ::testing::Values(Case{2, ShardingStrategy::kFullShard, false},
                      Case{3, ShardingStrategy::kFullShard, false},
                      Case{3, ShardingStrategy::kShardGradOp, false},
                      Case{2, ShardingStrategy::kNoShard, false},
                      Case{3, ShardingStrategy::kFullShard, true},
                      Case{3, ShardingStrategy::kFullShard, false, /*float32_compute=*/true}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return std::string(ShardingStrategyName(info.param.strategy)) + "_W" +
             std::to_string(info.param.world_size) +
             (info.param.offload_params ? "_offload" : "") +
             (info.param.float32_compute ? "_f64_params_f32_compute" : "");
    });

}  // namespace
}  // namespace fsdp
