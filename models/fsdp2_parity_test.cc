// Our FSDP against PyTorch's own FSDP2 (`fully_shard`): the GPT of
// nanoGPT's layout trained from the same initial weights on the same
// batches with AdamW, by our FSDP over thread ranks and by FSDP2 in Python
// ranks (models/fsdp2_parity.py, started by our launcher), at W = 2 and 3
// for FULL_SHARD and SHARD_GRAD_OP, at W = 4 as HYBRID_SHARD (2 replicas of
// 2-rank shard groups: FSDP2's 2-D mesh), at W = 4 as FULL_SHARD
// resharding to pairs after forward (FSDP2's reshard_after_forward=2, our
// ProcessGroups::post_forward), and in bfloat16 mixed precision.
// Every step's global mean loss and the final parameters must agree.
//
// Tolerances and why. Both sides run the same libtorch kernels on the same
// inputs, so the first forward is identical; they differ in the order of
// floating-point sums (FSDP2's Gloo reduce-scatter against ours) and in
// AdamW's moment update (PyTorch's lerp against libtorch's mul and add):
// a rounding or so per step. AdamW divides by the root of the second
// moment, which turns rounding noise in a gradient that is mathematically
// zero into steps of the learning rate's size: the key third of
// attn.c_attn.bias is such a parameter (softmax does not change when a key
// bias shifts every score of a query equally), and it is where the largest
// differences are. Measured (torch 2.15, 2026-11-25): in float32, losses
// within 4.8e-7 and parameters within 1.5e-5 of FSDP2's, so the test asks
// for 1e-5 and 1e-4; a wrong reduction (a missing 1/W, a unit reduced
// twice, a stale shard) moves parameters by about the learning rate, 1e-2,
// per step. In bfloat16 (8 bits of mantissa) losses agree within 1.7e-4
// (asked: 1e-3) and the parameters' distance from FSDP2's is 2.2% of
// FSDP2's own update (asked: 5%), nine tenths of it in c_attn.bias.
//
// Needs a PyTorch with FSDP2 (torch >= 2.6) through testing/torch_python.h:
// it runs under tools/test_torch2.sh (torch 2.15); against Debian's torch
// 1.13 it is skipped, saying so.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "comm/gloo_collectives.h"
#include "comm/hybrid_groups.h"
#include "formats/torch_file.h"
#include "fsdp/fully_shard.h"
#include "fsdp/utilities.h"
#include "gtest/gtest.h"
#include "launch/local_launcher.h"
#include "models/gpt.h"
#include "statedict/state_dict.h"
#include "testing/multi_rank.h"
#include "testing/torch_python.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"
#include "torch/optim/adamw.h"

namespace models {
namespace {

using ::fsdp::ShardingStrategy;
using ::fsdp::testing::RunOnThreadRanks;

constexpr int kSteps = 4;
constexpr int kGlobalBatch = 12;  // Divisible by 2, 3 and 4.
constexpr double kLr = 1e-2;
constexpr double kWeightDecay = 0.1;
// See the top of the file.
constexpr double kFp32ParamTolerance = 1e-4;
constexpr double kBf16LossTolerance = 1e-3;
constexpr double kBf16RelativeTolerance = 0.05;

GptConfig Config() {
  GptConfig config;
  config.vocab_size = 256;
  config.block_size = 16;
  config.n_layer = 2;
  config.n_head = 2;
  config.n_embd = 32;
  config.seed = 21;
  return config;
}

struct ParityCase {
  std::string name;
  int world_size;
  int shard_group_size;  // world_size unless hybrid.
  ShardingStrategy strategy;
  bool bf16;
  int post_forward_group_size = 0;  // FSDP2's reshard_after_forward as an int; 0: unset.
};

std::string StrategyFlag(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kShardGradOp:
      return "shard_grad_op";
    case ShardingStrategy::kHybridShard:
      return "hybrid_shard";
    default:
      return "full_shard";
  }
}

struct Trajectory {
  std::vector<double> losses;                // Global mean, per step.
  std::map<std::string, at::Tensor> params;  // Full, float32, after the last step.
};

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

// Whether the interop Python has FSDP2; the reason when not.
std::string MissingFsdp2() {
  const std::string python = ::fsdp::testing::TorchPython();
  const int status = std::system(absl::StrCat("timeout 120 ", python,
                                              " -c 'from torch.distributed.fsdp import "
                                              "fully_shard' > /dev/null 2>&1")
                                     .c_str());
  if (status == 0) return "";
  return absl::StrCat(python,
                      " has no torch.distributed.fsdp.fully_shard (FSDP2 needs "
                      "torch >= 2.6): this test runs under tools/test_torch2.sh");
}

// The initial weights and every step's tokens, written for Python; returns
// the weights.
std::map<std::string, at::Tensor> WriteInputs(const std::string& dir, const at::Tensor& tokens) {
  Gpt model(Config());
  fsdp::StateDict init;
  std::map<std::string, at::Tensor> weights;
  for (const auto& item : model->named_parameters()) {
    init.emplace_back(item.key(), item.value().detach());
    weights[item.key()] = item.value().detach().clone();
  }
  EXPECT_TRUE(fsdp::SaveTorchStateDict(dir + "/init.pt", init).ok());
  EXPECT_TRUE(fsdp::SaveTorchStateDict(dir + "/batches.pt", {{"tokens", tokens}}).ok());
  return weights;
}

Trajectory TrainWithFsdp2(const std::string& dir, const ParityCase& c) {
  fsdp::LocalLaunchOptions launch;
  launch.nproc_per_node = c.world_size;
  launch.program = ::fsdp::testing::TorchPython();
  launch.log_dir = dir;
  launch.timeout = std::chrono::minutes(4);
  const GptConfig config = Config();
  launch.args = {"models/fsdp2_parity.py",           dir,
                 StrategyFlag(c.strategy),           c.bf16 ? "bf16" : "fp32",
                 std::to_string(c.shard_group_size), std::to_string(config.n_layer),
                 std::to_string(config.n_head),      std::to_string(config.n_embd),
                 std::to_string(config.block_size),  std::to_string(kLr),
                 std::to_string(kWeightDecay),       std::to_string(c.post_forward_group_size)};
  Trajectory t;
  absl::StatusOr<fsdp::LaunchResult> launched = fsdp::LaunchLocalRanks(launch);
  EXPECT_TRUE(launched.ok()) << launched.status();
  if (!launched.ok()) return t;
  EXPECT_TRUE(launched->ok()) << launched->Summary();
  if (!launched->ok()) return t;
  auto losses = fsdp::LoadTorchStateDict(dir + "/py_losses.pt");
  auto final_params = fsdp::LoadTorchStateDict(dir + "/py_final.pt");
  EXPECT_TRUE(losses.ok()) << losses.status();
  EXPECT_TRUE(final_params.ok()) << final_params.status();
  if (!losses.ok() || !final_params.ok()) return t;
  const at::Tensor l = (*losses)[0].second;
  for (int64_t i = 0; i < l.numel(); ++i) t.losses.push_back(l[i].item<double>());
  for (const auto& [name, value] : *final_params) t.params[name] = value;
  return t;
}

// Trains on this rank's rows of each step's batch; rank 0 returns the full
// parameters.
void TrainRank(fsdp::Collectives& world, const fsdp::ProcessGroups& groups, const ParityCase& c,
               const at::Tensor& tokens, Trajectory& out) {
  Gpt model(Config());
  fsdp::FsdpOptions options;
  options.strategy = c.strategy;
  if (c.bf16) {
    options.mixed_precision.param_dtype = at::kBFloat16;
    options.mixed_precision.reduce_dtype = at::kFloat;
  }
  auto wrapped = fsdp::FullyShardedModel::Wrap(model.ptr(), groups, options,
                                               *fsdp::ModuleTypePolicy::Of<BlockImpl>());
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  torch::optim::AdamW adamw(
      fsdp::UniqueParameters(*model),
      torch::optim::AdamWOptions(kLr).betas({0.9, 0.999}).eps(1e-8).weight_decay(kWeightDecay));
  const int64_t rows = kGlobalBatch / c.world_size;
  for (int step = 0; step < kSteps; ++step) {
    const at::Tensor batch = tokens[step].narrow(0, world.rank() * rows, rows);
    const at::Tensor logits = model->forward(batch.narrow(1, 0, Config().block_size));
    at::Tensor loss = LanguageModelLoss(logits, batch.narrow(1, 1, Config().block_size));
    loss.backward();
    adamw.step();
    adamw.zero_grad();
    at::Tensor mean = loss.detach().clone();
    world.AllReduce(mean, fsdp::ReduceOp::kAvg)->Wait();
    if (world.rank() == 0) out.losses.push_back(mean.item<double>());
  }
  auto state = fsdp::FullStateDict(**wrapped, {.rank0_only = true});
  ASSERT_TRUE(state.ok()) << state.status();
  for (const auto& [name, value] : *state) out.params[name] = value.to(at::kFloat);
}

Trajectory TrainWithOurs(const ParityCase& c, const at::Tensor& tokens) {
  Trajectory t;
  if (c.strategy != ShardingStrategy::kHybridShard && c.post_forward_group_size == 0) {
    EXPECT_TRUE(RunOnThreadRanks(c.world_size, [&](fsdp::Collectives& world) {
                  TrainRank(world, world, c, tokens, t);
                }).ok());
    return t;
  }
  // Hybrid: the shard and replicate groups. Resharding to smaller groups
  // after forward: that layout's shard groups are the post-forward groups.
  const bool hybrid = c.strategy == ShardingStrategy::kHybridShard;
  const auto layout = fsdp::HybridShardLayout::Create(
                          c.world_size, hybrid ? c.shard_group_size : c.post_forward_group_size)
                          .value();
  auto store = c10::make_intrusive<c10d::HashStore>();
  EXPECT_TRUE(RunOnThreadRanks(c.world_size, [&](fsdp::Collectives& world) {
                fsdp::GlooOptions gloo;
                gloo.hostname = "127.0.0.1";
                gloo.timeout = std::chrono::seconds(60);
                auto groups = fsdp::CreateHybridShardCollectives(
                    world.rank(), layout, gloo.group_name, fsdp::GlooGroupConnector(store, gloo));
                ASSERT_TRUE(groups.ok()) << groups.status();
                fsdp::ProcessGroups fsdp_groups(hybrid ? *groups->shard : world);
                if (hybrid) {
                  fsdp_groups.replicate = groups->replicate.get();
                } else {
                  fsdp_groups.post_forward = groups->shard.get();
                }
                TrainRank(world, fsdp_groups, c, tokens, t);
              }).ok());
  return t;
}

class Fsdp2Parity : public ::testing::TestWithParam<ParityCase> {};

TEST_P(Fsdp2Parity, LossesAndFinalParametersMatchPyTorchsFullyShard) {
  static const std::string missing = MissingFsdp2();
  if (!missing.empty()) GTEST_SKIP() << missing;
  const ParityCase& c = GetParam();
  const std::string dir = absl::StrCat(TempDir(), "/fsdp2_parity_", c.name);
  ASSERT_EQ(std::system(absl::StrCat("rm -rf '", dir, "' && mkdir -p '", dir, "'").c_str()), 0);
  at::manual_seed(5);
  const at::Tensor tokens =
      at::randint(Config().vocab_size, {kSteps, kGlobalBatch, Config().block_size + 1}, at::kLong);
  const std::map<std::string, at::Tensor> init = WriteInputs(dir, tokens);
  const Trajectory theirs = TrainWithFsdp2(dir, c);
  const Trajectory ours = TrainWithOurs(c, tokens);
  ASSERT_EQ(theirs.losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(ours.losses.size(), static_cast<size_t>(kSteps));

  double worst_loss = 0;
  for (int step = 0; step < kSteps; ++step) {
    worst_loss = std::max(worst_loss, std::abs(ours.losses[step] - theirs.losses[step]));
    EXPECT_NEAR(ours.losses[step], theirs.losses[step], c.bf16 ? kBf16LossTolerance : 1e-5)
        << "step " << step;
  }
  ASSERT_EQ(ours.params.size(), theirs.params.size());
  double worst_param = 0, squared_difference = 0, squared_update = 0;
  std::string worst_name;
  for (const auto& [name, value] : ours.params) {
    ASSERT_TRUE(theirs.params.count(name)) << name << " is not in FSDP2's state dict";
    const at::Tensor& other = theirs.params.at(name);
    ASSERT_EQ(value.sizes(), other.sizes()) << name;
    const double difference = (value - other).abs().max().item<double>();
    if (difference >= worst_param) {
      worst_param = difference;
      worst_name = name;
    }
    squared_difference += (value - other).pow(2).sum().item<double>();
    squared_update += (other - init.at(name)).pow(2).sum().item<double>();
  }
  const double relative = std::sqrt(squared_difference / squared_update);
  if (c.bf16) {
    EXPECT_LE(relative, kBf16RelativeTolerance);
  } else {
    EXPECT_LE(worst_param, kFp32ParamTolerance) << "at " << worst_name;
  }
  // The figures the tolerances above are set against.
  std::printf(
      "%s: largest loss difference %.3g; parameters: largest difference %.3g (%s), "
      "|ours - FSDP2's| / |FSDP2's - initial| = %.3g\n",
      c.name.c_str(), worst_loss, worst_param, worst_name.c_str(), relative);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Fsdp2Parity,
    ::testing::Values(ParityCase{"FullShard_W2", 2, 2, ShardingStrategy::kFullShard, false},
                      ParityCase{"FullShard_W3", 3, 3, ShardingStrategy::kFullShard, false},
                      ParityCase{"ShardGradOp_W2", 2, 2, ShardingStrategy::kShardGradOp, false},
                      ParityCase{"ShardGradOp_W3", 3, 3, ShardingStrategy::kShardGradOp, false},
                      ParityCase{"HybridShard_W4_2x2", 4, 2, ShardingStrategy::kHybridShard, false},
                      ParityCase{"FullShard_W4_ReshardAfterForward2", 4, 4,
                                 ShardingStrategy::kFullShard, false, 2},
                      ParityCase{"FullShard_W2_bf16", 2, 2, ShardingStrategy::kFullShard, true},
                      ParityCase{"FullShard_W3_bf16", 3, 3, ShardingStrategy::kFullShard, true}),
    [](const ::testing::TestParamInfo<ParityCase>& info) { return info.param.name; });

}  // namespace
}  // namespace models
