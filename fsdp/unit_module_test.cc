#include "fsdp/unit_module.h"

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "fsdp/activation_checkpointing.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_util.h"
#include "fsdp/utilities.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"
#include "torch/nn/modules/container/sequential.h"
#include "torch/nn/modules/dropout.h"
#include "torch/nn/modules/linear.h"
#include "torch/nn/modules/transformerlayer.h"

namespace fsdp {
namespace {

using ::fsdp::testing::FillDeterministically;
using ::fsdp::testing::MakeOptimizer;
using ::fsdp::testing::Optim;
using ::fsdp::testing::RunOnThreadRanks;

constexpr int64_t kModel = 16;   // d_model
constexpr int64_t kSeq = 5;
constexpr int64_t kBatch = 6;    // Divisible by 2 and 3.
constexpr int kSteps = 4;

torch::nn::TransformerEncoderLayer Layer() {
  return torch::nn::TransformerEncoderLayer(
      torch::nn::TransformerEncoderLayerOptions(kModel, /*nhead=*/4)
          .dim_feedforward(32)
          .dropout(0.0));
}

// Two stock encoder layers and a stock head, no FSDP anywhere.
torch::nn::Sequential PlainModel() {
  torch::nn::Sequential model(Layer(), Layer(), torch::nn::Linear(kModel, kModel));
  FillDeterministically(*model);
  return model;
}

// The same modules, each layer and the root held by a UnitModule.
UnitModule<torch::nn::SequentialImpl> UnitModel() {
  UnitModule first(Layer());
  UnitModule second(Layer());
  UnitModule model(torch::nn::Sequential(first, second, torch::nn::Linear(kModel, kModel)));
  FillDeterministically(*model);
  return model;
}

// [seq, batch, d_model]: the layers' default (not batch-first) layout.
at::Tensor Inputs(int step) {
  return at::sin(at::arange(kSeq * kBatch * kModel, at::kFloat) * 0.13 + step)
      .view({kSeq, kBatch, kModel});
}
at::Tensor Targets(int step) {
  return at::cos(at::arange(kSeq * kBatch * kModel, at::kFloat) * 0.07 - step)
      .view({kSeq, kBatch, kModel}) * 0.5;
}

std::vector<std::string> Names(const torch::nn::Module& module) {
  std::vector<std::string> names;
  for (const auto& item : module.named_parameters()) names.push_back(item.key());
  return names;
}

TEST(UnitModule, NamesAndValuesAreThoseOfTheHeldModules) {
  torch::nn::Sequential plain = PlainModel();
  auto held = UnitModel();
  ASSERT_EQ(Names(*held), Names(*plain));
  const auto plain_params = plain->named_parameters();
  for (const auto& item : held->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value(), plain_params[item.key()])) << item.key();
  }
  EXPECT_TRUE(at::equal(held->forward(Inputs(0)), plain->forward(Inputs(0))));
}

TEST(UnitModule, ModeAndNamesFollowTheHeldModule) {
  torch::nn::Dropout dropout(0.5);
  dropout->eval();
  UnitModule held(dropout);
  EXPECT_FALSE(held->is_training()) << "takes the held module's mode";
  const at::Tensor x = at::ones({4, 8});
  EXPECT_TRUE(at::equal(held->forward(x), x)) << "dropout in eval mode";
  held->train();
  EXPECT_TRUE(dropout->is_training()) << "train() reaches the held module";

  UnitModule no_bias(torch::nn::Linear(torch::nn::LinearOptions(3, 2).bias(false)));
  EXPECT_EQ(Names(*no_bias), std::vector<std::string>{"weight"});
}

class UnitModuleParity : public ::testing::TestWithParam<int> {};

// Stock TransformerEncoderLayers as units train exactly like the plain
// model: every step's global loss and the final parameters. (SGD: Adam
// would turn the attention key bias's rounding-level gradients into
// full-size steps of either sign.)
TEST_P(UnitModuleParity, TransformerEncoderLayersAsUnitsMatchLocalTraining) {
  const int world_size = GetParam();
  std::vector<float> expected_losses;
  std::map<std::string, at::Tensor> expected_params;
  {
    torch::nn::Sequential model = PlainModel();
    auto optimizer = MakeOptimizer(Optim::kSgdMomentum, model->parameters());
    for (int step = 0; step < kSteps; ++step) {
      at::Tensor loss = at::mse_loss(model->forward(Inputs(step)), Targets(step));
      loss.backward();
      expected_losses.push_back(loss.item<float>());
      optimizer->step();
      optimizer->zero_grad();
    }
    for (const auto& item : model->named_parameters()) {
      expected_params[item.key()] = item.value().detach().clone();
    }
  }
  absl::Status status = RunOnThreadRanks(world_size, [&](Collectives& comm) {
    auto model = UnitModel();
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<UnitModuleImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    FullyShardedModel& fsdp = **wrapped;
    ASSERT_EQ(fsdp.units().size(), 3u);  // The root (the head) and both layers.
    EXPECT_EQ(fsdp.units()[1]->fqn(), "0");
    EXPECT_EQ(fsdp.units()[2]->fqn(), "1");
    auto optimizer = MakeOptimizer(Optim::kSgdMomentum, model->parameters());
    const int64_t rows = kBatch / world_size;
    for (int step = 0; step < kSteps; ++step) {
      comm.ResetCounters();
      at::Tensor loss =
          at::mse_loss(model->forward(Inputs(step).narrow(1, comm.rank() * rows, rows)),
                       Targets(step).narrow(1, comm.rank() * rows, rows));
      loss.backward();
      optimizer->step();
      optimizer->zero_grad();
      // Both layers gathered in forward and again in backward (the root
      // keeps its parameters between the two), plus the root's; the first
      // step also checks the wrap (one) and the execution order (two)
      // across ranks.
      EXPECT_EQ(comm.counters().Calls(CollectiveOp::kAllGather), 5 + (step == 0 ? 3 : 0))
          << "step " << step;
      EXPECT_EQ(comm.counters().Calls(CollectiveOp::kReduceScatter), 3) << "step " << step;
      at::Tensor global = loss.detach().clone();
      comm.AllReduce(global, ReduceOp::kAvg)->Wait();
      EXPECT_NEAR(global.item<float>(), expected_losses[step],
                  1e-5 * std::abs(expected_losses[step]))
          << "step " << step;
    }
    EXPECT_EQ(fsdp.FullParamBytes(), 0);
    SummonFullParams full(fsdp);
    for (const auto& item : model->named_parameters()) {
      EXPECT_TRUE(at::allclose(item.value(), expected_params.at(item.key()), 1e-5, 1e-6))
          << item.key();
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Stock layers held by UnitModules, checkpointed: the same training, bit
// for bit, with the same collectives.
TEST_P(UnitModuleParity, CheckpointedLayersTrainAsWithout) {
  const int world_size = GetParam();
  absl::Status status = RunOnThreadRanks(world_size, [&](Collectives& comm) {
    auto train = [&](bool checkpoint) {
      auto model = UnitModel();
      auto wrapped =
          FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<UnitModuleImpl>());
      EXPECT_TRUE(wrapped.ok()) << wrapped.status();
      if (checkpoint) {
        absl::StatusOr<std::vector<std::string>> applied =
            ApplyActivationCheckpointing(*model, *ModuleTypePolicy::Of<UnitModuleImpl>());
        EXPECT_TRUE(applied.ok()) << applied.status();
        if (applied.ok()) EXPECT_EQ(*applied, (std::vector<std::string>{"0", "1"}));
      }
      auto optimizer = MakeOptimizer(Optim::kAdam, model->parameters());
      const int64_t rows = kBatch / world_size;
      std::vector<at::Tensor> results;
      std::vector<int> gathers;
      for (int step = 0; step < kSteps; ++step) {
        comm.ResetCounters();
        at::Tensor loss =
            at::mse_loss(model->forward(Inputs(step).narrow(1, comm.rank() * rows, rows)),
                         Targets(step).narrow(1, comm.rank() * rows, rows));
        const int regions = CheckpointedRegionsInGraph(loss);
        loss.backward();
        optimizer->step();
        optimizer->zero_grad();
        results.push_back(loss.detach());
        gathers.push_back(comm.counters().Calls(CollectiveOp::kAllGather));
        EXPECT_EQ(regions, checkpoint ? 2 : 0);
      }
      for (const at::Tensor& p : model->parameters()) results.push_back(p.detach().clone());
      return std::make_pair(results, gathers);
    };
    const auto [plain, plain_gathers] = train(false);
    const auto [checkpointed, checkpointed_gathers] = train(true);
    EXPECT_EQ(plain_gathers, checkpointed_gathers);
    ASSERT_EQ(plain.size(), checkpointed.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_TRUE(at::equal(plain[i], checkpointed[i])) << "result " << i;
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, UnitModuleParity, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "W" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace fsdp
