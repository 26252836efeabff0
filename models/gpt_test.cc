#include "models/gpt.h"

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "fsdp/activation_checkpointing.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"
#include "torch/optim/adam.h"
#include "torch/optim/adamw.h"
#include "torch/optim/sgd.h"

namespace models {
namespace {

using ::fsdp::testing::RunOnThreadRanks;

GptConfig TinyConfig() {
  GptConfig config;
  config.vocab_size = 32;
  config.block_size = 8;
  config.n_layer = 2;
  config.n_head = 2;
  config.n_embd = 16;
  config.seed = 7;
  return config;
}

TEST(Gpt, HasNanoGptParameterNamesAndTiedHead) {
  Gpt model(TinyConfig());
  std::vector<std::string> names;
  for (const auto& item : model->named_parameters()) names.push_back(item.key());
  std::vector<std::string> expected = {"transformer.wte.weight", "transformer.wpe.weight"};
  for (int i = 0; i < 2; ++i) {
    const std::string h = "transformer.h." + std::to_string(i) + ".";
    for (const char* leaf :
         {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
          "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
          "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"}) {
      expected.push_back(h + leaf);
    }
  }
  expected.push_back("transformer.ln_f.weight");
  expected.push_back("transformer.ln_f.bias");
  expected.push_back("lm_head.weight");
  EXPECT_EQ(names, expected);
  EXPECT_TRUE(model->lm_head->weight.is_same(model->transformer->wte->weight));
  at::Tensor logits = model->forward(at::zeros({3, 5}, at::kLong));
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{3, 5, 32}));
}

TEST(Gpt, SameSeedSameModel) {
  Gpt a(TinyConfig()), b(TinyConfig());
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i], pb[i]));
}

constexpr int kGlobalBatch = 12;
constexpr int kSteps = 5;

// Deterministic token sequences: [kGlobalBatch, block_size + 1].
at::Tensor Tokens(int step) {
  return (at::arange(kGlobalBatch * 9, at::kLong) * 7 + step * 13).remainder(31).view(
      {kGlobalBatch, 9});
}

enum class Optim { kSgdMomentum, kAdam, kAdamW };

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(Optim kind,
                                                       std::vector<at::Tensor> params) {
  switch (kind) {
    case Optim::kSgdMomentum:
      return std::make_unique<torch::optim::SGD>(params,
                                                 torch::optim::SGDOptions(0.1).momentum(0.9));
    case Optim::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(3e-3));
    case Optim::kAdamW:
      break;
  }
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(3e-3));
}

struct Case {
  int world_size;
  fsdp::ShardingStrategy strategy;
  Optim optim;
  bool flat;  // The whole model one unit instead of one unit per block.
};

class GptFsdpParity : public ::testing::TestWithParam<Case> {};

// The GPT trained through FSDP: every step's loss and the final parameters
// match single-process training on the global batch.
TEST_P(GptFsdpParity, MatchesLocalTraining) {
  const Case c = GetParam();
  std::vector<float> expected_losses;
  std::map<std::string, at::Tensor> expected_params;
  {
    Gpt model(TinyConfig());
    auto optimizer = MakeOptimizer(c.optim, fsdp::UniqueParameters(*model));
    for (int step = 0; step < kSteps; ++step) {
      at::Tensor tokens = Tokens(step);
      at::Tensor loss = LanguageModelLoss(model->forward(tokens.narrow(1, 0, 8)),
                                          tokens.narrow(1, 1, 8));
      loss.backward();
      expected_losses.push_back(loss.item<float>());
      optimizer->step();
      optimizer->zero_grad();
    }
    for (const auto& item : model->named_parameters()) {
      expected_params[item.key()] = item.value().detach().clone();
    }
  }
  absl::Status status = RunOnThreadRanks(c.world_size, [&](fsdp::Collectives& comm) {
    Gpt model(TinyConfig());
    fsdp::FsdpOptions options;
    options.strategy = c.strategy;
    const fsdp::LambdaPolicy none([](const std::string&, const torch::nn::Module&) {
      return false;
    });
    const auto per_block = fsdp::ModuleTypePolicy::Of<BlockImpl>();
    auto wrapped = fsdp::FullyShardedModel::Wrap(
        model.ptr(), comm, options,
        c.flat ? none : static_cast<const fsdp::WrapPolicy&>(*per_block));
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    ASSERT_EQ((*wrapped)->units().size(), c.flat ? 1u : 3u);  // Root and two blocks.
    auto optimizer = MakeOptimizer(c.optim, fsdp::UniqueParameters(*model));
    const int64_t rows = kGlobalBatch / comm.world_size();
    for (int step = 0; step < kSteps; ++step) {
      comm.ResetCounters();
      at::Tensor tokens = Tokens(step).narrow(0, comm.rank() * rows, rows);
      at::Tensor loss = LanguageModelLoss(model->forward(tokens.narrow(1, 0, 8)),
                                          tokens.narrow(1, 1, 8));
      loss.backward();
      optimizer->step();
      optimizer->zero_grad();
      const fsdp::CollectiveCounters counted = comm.counters();
      if (c.strategy == fsdp::ShardingStrategy::kFullShard && !c.flat) {
        // Plus, on the first step, the wrap-plan check and the two of the execution-order check.
        EXPECT_EQ(counted.Calls(fsdp::CollectiveOp::kAllGather), 2 * 2 + 1 + (step == 0 ? 3 : 0));
        EXPECT_EQ(counted.Calls(fsdp::CollectiveOp::kReduceScatter), 3);
      }
      at::Tensor global = loss.detach().clone();
      comm.AllReduce(global, fsdp::ReduceOp::kAvg)->Wait();
      // Float32: losses at 1e-5 relative, as for the MLP (rounding of the
      // cross-rank gradient sum).
      EXPECT_NEAR(global.item<float>(), expected_losses[step],
                  1e-5 * std::abs(expected_losses[step]))
          << "step " << step;
    }
    fsdp::SummonFullParams full(**wrapped);
    // Parameters at 1e-5: the largest difference measured is 2.2e-6, on
    // attention biases whose exact gradient is zero (softmax ignores a
    // shift shared by a row of scores), so their gradients are rounding
    // noise that AdamW normalizes into real steps. A wrong gradient anywhere
    // moves parameters by ~lr = 3e-3 per step.
    for (const auto& item : model->named_parameters()) {
      const at::Tensor& want = expected_params.at(item.key());
      EXPECT_TRUE(at::allclose(item.value().detach(), want, 1e-5, 1e-5))
          << item.key() << " max diff "
          << (item.value().detach() - want).abs().max().item<float>();
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (int w : {1, 2, 3, 4}) {
    for (fsdp::ShardingStrategy s :
         {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp,
          fsdp::ShardingStrategy::kNoShard}) {
      for (Optim o : {Optim::kSgdMomentum, Optim::kAdam, Optim::kAdamW}) {
        cases.push_back({w, s, o, /*flat=*/false});
      }
      cases.push_back({w, s, w % 2 == 0 ? Optim::kAdam : Optim::kSgdMomentum, /*flat=*/true});
    }
  }
  return cases;
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const char* optim[] = {"SgdMomentum", "Adam", "AdamW"};
  return "W" + std::to_string(info.param.world_size) + "_" +
         fsdp::ShardingStrategyName(info.param.strategy) + "_" +
         optim[static_cast<int>(info.param.optim)] + (info.param.flat ? "_Flat" : "");
}

INSTANTIATE_TEST_SUITE_P(Cases, GptFsdpParity, ::testing::ValuesIn(Cases()), CaseName);

// One rank's run of the GPT under FSDP, with or without each block
// checkpointed: every step's loss, the final shards and the collectives.
struct CheckpointRun {
  std::vector<at::Tensor> losses;
  std::vector<at::Tensor> shards;
  std::vector<fsdp::CollectiveCounters> counters;
};

CheckpointRun TrainWithCheckpointing(fsdp::Collectives& comm, fsdp::FsdpOptions options,
                                     const GptConfig& config, bool checkpoint, bool seed_dropout) {
  Gpt model(config);
  auto wrapped = fsdp::FullyShardedModel::Wrap(model.ptr(), comm, options,
                                               *fsdp::ModuleTypePolicy::Of<BlockImpl>());
  EXPECT_TRUE(wrapped.ok()) << wrapped.status();
  if (checkpoint) {
    absl::StatusOr<std::vector<std::string>> chosen =
        fsdp::ApplyActivationCheckpointing(*model, *fsdp::ModuleTypePolicy::Of<BlockImpl>());
    EXPECT_TRUE(chosen.ok()) << chosen.status();
    if (chosen.ok()) EXPECT_EQ(chosen->size(), static_cast<size_t>(config.n_layer));
  }
  // Dropout draws from the process's default generator: the same draws in
  // both runs.
  if (seed_dropout) at::manual_seed(1000 + comm.rank());
  auto optimizer = MakeOptimizer(Optim::kAdamW, fsdp::UniqueParameters(*model));
  const int64_t rows = kGlobalBatch / comm.world_size();
  CheckpointRun run;
  for (int step = 0; step < 3; ++step) {
    comm.ResetCounters();
    at::Tensor tokens = Tokens(step).narrow(0, comm.rank() * rows, rows);
    at::Tensor loss =
        LanguageModelLoss(model->forward(tokens.narrow(1, 0, 8)), tokens.narrow(1, 1, 8));
    // One region per block in the graph, or none.
    EXPECT_EQ(fsdp::CheckpointedRegionsInGraph(loss), checkpoint ? config.n_layer : 0);
    loss.backward();
    optimizer->step();
    optimizer->zero_grad();
    run.losses.push_back(loss.detach());
    run.counters.push_back(comm.counters());
  }
  for (const at::Tensor& p : fsdp::UniqueParameters(*model)) {
    run.shards.push_back(p.detach().clone());
  }
  return run;
}

// Checkpointing changes nothing in the result: losses and parameters equal
// bit for bit, with the same collectives per step.
void ExpectSameTraining(const CheckpointRun& plain, const CheckpointRun& checkpointed) {
  ASSERT_EQ(plain.losses.size(), checkpointed.losses.size());
  for (size_t i = 0; i < plain.losses.size(); ++i) {
    EXPECT_TRUE(at::equal(plain.losses[i], checkpointed.losses[i]))
        << "step " << i << ": " << plain.losses[i].item<float>() << " vs "
        << checkpointed.losses[i].item<float>();
    for (fsdp::CollectiveOp op :
         {fsdp::CollectiveOp::kAllGather, fsdp::CollectiveOp::kReduceScatter,
          fsdp::CollectiveOp::kAllReduce}) {
      EXPECT_EQ(plain.counters[i].Calls(op), checkpointed.counters[i].Calls(op))
          << "step " << i << ", op " << static_cast<int>(op);
    }
  }
  ASSERT_EQ(plain.shards.size(), checkpointed.shards.size());
  for (size_t i = 0; i < plain.shards.size(); ++i) {
    EXPECT_TRUE(at::equal(plain.shards[i], checkpointed.shards[i]))
        << "parameter " << i << " max diff "
        << (plain.shards[i].to(at::kFloat) - checkpointed.shards[i].to(at::kFloat))
               .abs()
               .max()
               .item<float>();
  }
}

struct CheckpointCase {
  int world_size;
  fsdp::ShardingStrategy strategy;
  bool bf16;
};

class GptActivationCheckpointing : public ::testing::TestWithParam<CheckpointCase> {};

TEST_P(GptActivationCheckpointing, TrainsBitForBitAsWithout) {
  const CheckpointCase c = GetParam();
  absl::Status status = RunOnThreadRanks(c.world_size, [&](fsdp::Collectives& comm) {
    fsdp::FsdpOptions options;
    options.strategy = c.strategy;
    if (c.bf16) options.mixed_precision.param_dtype = at::kBFloat16;
    const CheckpointRun plain = TrainWithCheckpointing(comm, options, TinyConfig(), false, false);
    const CheckpointRun checkpointed =
        TrainWithCheckpointing(comm, options, TinyConfig(), true, false);
    ExpectSameTraining(plain, checkpointed);
  });
  EXPECT_TRUE(status.ok()) << status;
}

std::vector<CheckpointCase> CheckpointCases() {
  std::vector<CheckpointCase> cases;
  for (int w : {1, 2, 3}) {
    for (fsdp::ShardingStrategy s :
         {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp,
          fsdp::ShardingStrategy::kNoShard}) {
      cases.push_back({w, s, /*bf16=*/false});
    }
    cases.push_back({w, fsdp::ShardingStrategy::kFullShard, /*bf16=*/true});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, GptActivationCheckpointing, ::testing::ValuesIn(CheckpointCases()),
                         [](const ::testing::TestParamInfo<CheckpointCase>& info) {
                           return "W" + std::to_string(info.param.world_size) + "_" +
                                  fsdp::ShardingStrategyName(info.param.strategy) +
                                  (info.param.bf16 ? "_BFloat16" : "");
                         });

// Dropout from the default generator, which thread ranks would share: one
// process per rank.
TEST(GptActivationCheckpointing, DropoutTrainsBitForBitAsWithoutOnProcessRanks) {
  for (int world_size : {2, 3}) {
    absl::Status status =
        ::fsdp::testing::RunOnProcessRanks(world_size, [&](fsdp::Collectives& comm) {
          GptConfig config = TinyConfig();
          config.dropout = 0.2;
          const CheckpointRun plain = TrainWithCheckpointing(comm, {}, config, false, true);
          const CheckpointRun checkpointed = TrainWithCheckpointing(comm, {}, config, true, true);
          ExpectSameTraining(plain, checkpointed);
          // Dropout is on: the same model without it computes another loss.
          const CheckpointRun no_dropout =
              TrainWithCheckpointing(comm, {}, TinyConfig(), false, true);
          EXPECT_FALSE(at::equal(no_dropout.losses[0], plain.losses[0]));
        });
    EXPECT_TRUE(status.ok()) << "W=" << world_size << ": " << status;
  }
}

}  // namespace
}  // namespace models
