#include "optim/optim_state.h"

#include <cmath>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "optim/optim_internal.h"
#include "statedict/state_dict.h"
#include "testing/multi_rank.h"
#include "torch/optim/adagrad.h"
#include "torch/optim/adam.h"
#include "torch/optim/adamw.h"
#include "torch/nn/modules/linear.h"
#include "torch/optim/sgd.h"

namespace fsdp {
namespace {

using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::Net;
using ::fsdp::testing::RunOnThreadRanks;
using ::fsdp::testing::Targets;
using ::testing::HasSubstr;

std::string Repr(const c10::IValue& v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

enum class Kind { kSgdMomentum, kAdam, kAdamW, kAdagrad };

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kSgdMomentum: return "SgdMomentum";
    case Kind::kAdam: return "Adam";
    case Kind::kAdamW: return "AdamW";
    case Kind::kAdagrad: return "Adagrad";
  }
  return "?";
}

std::unique_ptr<torch::optim::Optimizer> Make(Kind kind, std::vector<at::Tensor> params) {
  switch (kind) {
    case Kind::kSgdMomentum:
      return std::make_unique<torch::optim::SGD>(params,
                                                 torch::optim::SGDOptions(0.1).momentum(0.9));
    case Kind::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
    case Kind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
    case Kind::kAdagrad:
      return std::make_unique<torch::optim::Adagrad>(params, torch::optim::AdagradOptions(0.05));
  }
  return nullptr;
}

// One optimizer step on the global batch of `step` (rows of this rank).
float Step(Net& model, torch::optim::Optimizer& optimizer, int step, int rank, int world) {
  const int64_t rows = kGlobalBatch / world;
  at::Tensor loss = at::mse_loss(model->forward(Inputs(step, 0).narrow(0, rank * rows, rows)),
                                 Targets(step, 0).narrow(0, rank * rows, rows));
  loss.backward();
  optimizer.step();
  optimizer.zero_grad();
  return loss.item<float>();
}

struct Case {
  Kind kind;
  int world_size;
  ShardingStrategy strategy;
};

class OptimStateResume : public ::testing::TestWithParam<Case> {};

// Train unwrapped for 3 steps; move model and optimizer state into an FSDP
// model at W ranks; both continue for 3 steps with the same losses. And the
// FSDP side's FULL optimizer state equals the unwrapped optimizer's.
TEST_P(OptimStateResume, UnwrappedStateContinuesInFsdpAndGathersBack) {
  const Case c = GetParam();
  Net reference;
  auto ref_optimizer = Make(c.kind, reference->parameters());
  for (int step = 0; step < 3; ++step) Step(reference, *ref_optimizer, step, 0, 1);
  const StateDict model_state = ModuleStateDict(*reference);
  auto optim_state = ModuleOptimStateDict(*reference, *ref_optimizer);
  ASSERT_TRUE(optim_state.ok()) << optim_state.status();
  ASSERT_EQ(optim_state->state.size(), 8u) << "every parameter has state";
  std::vector<float> expected;
  for (int step = 3; step < 6; ++step) expected.push_back(Step(reference, *ref_optimizer, step, 0, 1));
  auto expected_state = ModuleOptimStateDict(*reference, *ref_optimizer);
  ASSERT_TRUE(expected_state.ok());

  absl::Status status = RunOnThreadRanks(c.world_size, [&](Collectives& comm) {
    Net model;
    FsdpOptions options;
    options.strategy = c.strategy;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    auto optimizer = Make(c.kind, model->parameters());
    ASSERT_TRUE(LoadFullStateDict(**wrapped, model_state).ok());
    absl::Status loaded = LoadFullOptimStateDict(**wrapped, *optimizer, *optim_state);
    ASSERT_TRUE(loaded.ok()) << loaded;
    for (int step = 3; step < 6; ++step) {
      at::Tensor loss = at::full({1}, Step(model, *optimizer, step, comm.rank(), comm.world_size()));
      comm.AllReduce(loss, ReduceOp::kAvg)->Wait();
      EXPECT_NEAR(loss.item<float>(), expected[step - 3],
                  1e-5 * std::abs(expected[step - 3]) + 1e-7)
          << "step " << step;
    }
    auto gathered = FullOptimStateDict(**wrapped, *optimizer, {.rank0_only = true});
    ASSERT_TRUE(gathered.ok()) << gathered.status();
    if (comm.rank() != 0) {
      EXPECT_TRUE(gathered->state.empty());
      return;
    }
    ASSERT_EQ(gathered->state.size(), expected_state->state.size());
    for (size_t i = 0; i < gathered->state.size(); ++i) {
      const auto& [fqn, mine] = gathered->state[i];
      const auto& [want_fqn, want] = expected_state->state[i];
      EXPECT_EQ(fqn, want_fqn);
      ASSERT_EQ(mine.tensors.size(), want.tensors.size()) << fqn;
      for (const auto& [key, t] : want.tensors) {
        EXPECT_TRUE(at::allclose(mine.tensors.at(key), t, 1e-5, 1e-7)) << fqn << " " << key;
      }
      for (const auto& [key, v] : want.values) {
        EXPECT_EQ(Repr(mine.values.at(key)), Repr(v)) << fqn << " " << key;
      }
    }
    EXPECT_EQ(gathered->param_groups.size(), 1u);
    EXPECT_EQ(gathered->param_groups[0].params.size(), 8u);
    // And back into an unwrapped model's optimizer: it continues like the
    // reference.
    Net plain;
    auto plain_optimizer = Make(c.kind, UniqueParameters(*plain));
    ASSERT_TRUE(LoadModuleStateDict(*plain, ModuleStateDict(*reference)).ok());
    ASSERT_TRUE(LoadModuleOptimStateDict(*plain, *plain_optimizer, *gathered).ok());
    const float a = Step(plain, *plain_optimizer, 6, 0, 1);
    const float b = Step(reference, *ref_optimizer, 6, 0, 1);
    EXPECT_EQ(a, b) << "the first step's loss depends only on the weights";
    EXPECT_NEAR(Step(plain, *plain_optimizer, 7, 0, 1), Step(reference, *ref_optimizer, 7, 0, 1),
                1e-5);
  });
  EXPECT_TRUE(status.ok()) << status;
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (Kind kind : {Kind::kSgdMomentum, Kind::kAdam, Kind::kAdamW, Kind::kAdagrad}) {
    for (int w : {1, 2, 3}) cases.push_back({kind, w, ShardingStrategy::kFullShard});
  }
  cases.push_back({Kind::kAdam, 3, ShardingStrategy::kShardGradOp});
  cases.push_back({Kind::kAdamW, 2, ShardingStrategy::kNoShard});
  return cases;
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return absl::StrCat(KindName(info.param.kind), "_W", info.param.world_size, "_",
                      ShardingStrategyName(info.param.strategy));
}

INSTANTIATE_TEST_SUITE_P(Cases, OptimStateResume, ::testing::ValuesIn(Cases()), CaseName);

// The direct reading of Adam's, AdamW's and SGD's state gives what their
// serialize() writes, read back through an archive (the path every other
// optimizer takes), and copies, not views.
TEST(OptimState, KnownOptimizersReadAsTheirArchivesSayWithoutOne) {
  torch::nn::Linear layer(3, 2);
  std::vector<std::unique_ptr<torch::optim::Optimizer>> optimizers;
  optimizers.push_back(std::make_unique<torch::optim::Adam>(
      layer->parameters(), torch::optim::AdamOptions(0.1).amsgrad(true)));
  optimizers.push_back(
      std::make_unique<torch::optim::AdamW>(layer->parameters(), torch::optim::AdamWOptions(0.1)));
  optimizers.push_back(std::make_unique<torch::optim::SGD>(
      layer->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)));
  for (auto& optimizer : optimizers) {
    for (int step = 0; step < 2; ++step) {
      layer->forward(at::ones({4, 3})).sum().backward();
      optimizer->step();
      optimizer->zero_grad();
    }
    ASSERT_EQ(optimizer->state().size(), 2u);
    for (const auto& [key, state] : optimizer->state()) {
      const optim_internal::RawState direct = optim_internal::ReadOptimizerState(*state);
      const optim_internal::RawState archived = optim_internal::ReadRaw(
          [&](torch::serialize::OutputArchive& a) { state->serialize(a); });
      std::map<std::string, at::Tensor> want(archived.tensors.begin(), archived.tensors.end());
      ASSERT_EQ(direct.tensors.size(), want.size());
      for (const auto& [name, t] : direct.tensors) {
        ASSERT_TRUE(want.count(name)) << name;
        EXPECT_TRUE(at::equal(t, want[name])) << name;
        t.add_(1);  // A copy: the optimizer's own is unchanged.
      }
      ASSERT_EQ(direct.values.size(), archived.values.size());
      for (size_t i = 0; i < direct.values.size(); ++i) {
        EXPECT_EQ(direct.values[i].first, archived.values[i].first);
        EXPECT_EQ(direct.values[i].second, archived.values[i].second) << direct.values[i].first;
      }
      const optim_internal::RawState again = optim_internal::ReadOptimizerState(*state);
      for (const auto& [name, t] : again.tensors) EXPECT_TRUE(at::equal(t, want[name])) << name;
    }
  }
}

TEST(OptimState, BadStateIsRefusedAndTheOptimizerUntouched) {
  Net reference;
  auto ref_optimizer = Make(Kind::kAdam, reference->parameters());
  Step(reference, *ref_optimizer, 0, 0, 1);
  auto good = ModuleOptimStateDict(*reference, *ref_optimizer);
  ASSERT_TRUE(good.ok());
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    auto optimizer = Make(Kind::kAdam, model->parameters());
    Step(model, *optimizer, 0, comm.rank(), 2);
    auto before = FullOptimStateDict(**wrapped, *optimizer);
    ASSERT_TRUE(before.ok());

    OptimStateDict bad = *good;
    bad.state[0].second.tensors["exp_avg"] = at::zeros({3});
    bad.state.emplace_back("nope.weight", ParamOptimState{});
    bad.param_groups[0].params.pop_back();
    absl::Status loaded = LoadFullOptimStateDict(**wrapped, *optimizer, bad);
    ASSERT_FALSE(loaded.ok());
    const std::string message(loaded.message());
    EXPECT_THAT(message, HasSubstr("nothing was changed"));
    EXPECT_THAT(message, HasSubstr("'blocks.0.fc.weight' state 'exp_avg' has shape [3], the "
                                   "model's is [13, 7]"));
    EXPECT_THAT(message, HasSubstr("state for 'nope.weight', which is not a parameter"));
    EXPECT_THAT(message, HasSubstr("parameter group 0 holds"));

    auto after = FullOptimStateDict(**wrapped, *optimizer);
    ASSERT_TRUE(after.ok());
    for (size_t i = 0; i < before->state.size(); ++i) {
      for (const auto& [key, t] : before->state[i].second.tensors) {
        EXPECT_TRUE(at::equal(after->state[i].second.tensors.at(key), t));
      }
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

// FSDP at W = 2 -> FULL optimizer state -> FSDP at W = 3: training
// continues as it would have at W = 2.
TEST(OptimState, MovesBetweenWorldSizes) {
  StateDict model_state;
  OptimStateDict optim_state;
  std::vector<float> expected;
  absl::Status first = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    auto optimizer = Make(Kind::kAdamW, model->parameters());
    for (int step = 0; step < 2; ++step) Step(model, *optimizer, step, comm.rank(), 2);
    auto state = FullStateDict(**wrapped);
    auto optim = FullOptimStateDict(**wrapped, *optimizer);
    ASSERT_TRUE(state.ok() && optim.ok());
    if (comm.rank() == 0) {
      model_state = *state;
      optim_state = *optim;
    }
    for (int step = 2; step < 5; ++step) {
      at::Tensor loss = at::full({1}, Step(model, *optimizer, step, comm.rank(), 2));
      comm.AllReduce(loss, ReduceOp::kAvg)->Wait();
      if (comm.rank() == 0) expected.push_back(loss.item<float>());
    }
  });
  ASSERT_TRUE(first.ok()) << first;
  absl::Status second = RunOnThreadRanks(3, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    auto optimizer = Make(Kind::kAdamW, model->parameters());
    ASSERT_TRUE(LoadFullStateDict(**wrapped, model_state).ok());
    ASSERT_TRUE(LoadFullOptimStateDict(**wrapped, *optimizer, optim_state).ok());
    for (int step = 2; step < 5; ++step) {
      at::Tensor loss = at::full({1}, Step(model, *optimizer, step, comm.rank(), 3));
      comm.AllReduce(loss, ReduceOp::kAvg)->Wait();
      EXPECT_NEAR(loss.item<float>(), expected[step - 2], 1e-5 * std::abs(expected[step - 2]));
    }
  });
  EXPECT_TRUE(second.ok()) << second;
}

// Frozen parameters given to an optimizer that keeps state for them too
// (Adagrad makes `sum` for every parameter at construction): a wholly
// frozen unit (blocks.0) and a unit with a frozen bias beside a trainable
// weight (blocks.1). The FULL state equals the unwrapped optimizer's and
// moves to another world size.
TEST(OptimState, FrozenParametersWithStateGatherAndMove) {
  auto freeze = [](Net& model) {
    for (auto& p : model->blocks[0]->parameters()) p.requires_grad_(false);
    model->blocks[1]->as<BlockImpl>()->fc->bias.requires_grad_(false);
  };
  OptimStateDict expected;
  {
    Net model;
    freeze(model);
    auto optimizer = Make(Kind::kAdagrad, UniqueParameters(*model));
    for (int step = 0; step < 2; ++step) Step(model, *optimizer, step, 0, 1);
    expected = ModuleOptimStateDict(*model, *optimizer).value();
  }
  auto expect_equal = [&](const OptimStateDict& got, int world) {
    ASSERT_EQ(got.state.size(), expected.state.size()) << "world " << world;
    for (size_t i = 0; i < got.state.size(); ++i) {
      EXPECT_EQ(got.state[i].first, expected.state[i].first);
      const at::Tensor& sum = got.state[i].second.tensors.at("sum");
      EXPECT_TRUE(at::allclose(sum, expected.state[i].second.tensors.at("sum"), 1e-5, 1e-7))
          << got.state[i].first << " at world " << world;
    }
  };
  OptimStateDict saved;
  StateDict saved_model;
  absl::Status first = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    freeze(model);
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    auto optimizer = Make(Kind::kAdagrad, UniqueParameters(*model));
    for (int step = 0; step < 2; ++step) Step(model, *optimizer, step, comm.rank(), 2);
    auto optim = FullOptimStateDict(**wrapped, *optimizer);
    ASSERT_TRUE(optim.ok()) << optim.status();
    expect_equal(*optim, 2);
    auto state = FullStateDict(**wrapped);
    ASSERT_TRUE(state.ok());
    if (comm.rank() == 0) {
      saved = *optim;
      saved_model = *state;
    }
  });
  ASSERT_TRUE(first.ok()) << first;
  absl::Status second = RunOnThreadRanks(3, [&](Collectives& comm) {
    Net model;
    freeze(model);
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    auto optimizer = Make(Kind::kAdagrad, UniqueParameters(*model));
    ASSERT_TRUE(LoadFullStateDict(**wrapped, saved_model).ok());
    absl::Status loaded = LoadFullOptimStateDict(**wrapped, *optimizer, saved);
    ASSERT_TRUE(loaded.ok()) << loaded;
    auto again = FullOptimStateDict(**wrapped, *optimizer);
    ASSERT_TRUE(again.ok()) << again.status();
    expect_equal(*again, 3);
    SummonFullParams full(**wrapped);
    EXPECT_EQ(LoadFullOptimStateDict(**wrapped, *optimizer, saved).code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(LoadFullOptimStateDictFromRank0(**wrapped, *optimizer, saved).code(),
              absl::StatusCode::kFailedPrecondition);
  });
  EXPECT_TRUE(second.ok()) << second;
}

// Only rank 0 holds the FULL state (as after reading a checkpoint there):
// it is broadcast and every rank takes its shard.
TEST(OptimState, LoadsFromRank0Only) {
  Net reference;
  auto ref_optimizer = Make(Kind::kAdam, UniqueParameters(*reference));
  for (int step = 0; step < 2; ++step) Step(reference, *ref_optimizer, step, 0, 1);
  const StateDict model_state = ModuleStateDict(*reference);
  auto optim_state = ModuleOptimStateDict(*reference, *ref_optimizer);
  ASSERT_TRUE(optim_state.ok());
  std::vector<float> expected;
  for (int step = 2; step < 4; ++step) expected.push_back(Step(reference, *ref_optimizer, step, 0, 1));
  absl::Status status = RunOnThreadRanks(3, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    auto optimizer = Make(Kind::kAdam, UniqueParameters(*model));
    ASSERT_TRUE(LoadFullStateDict(**wrapped, model_state).ok());
    const OptimStateDict nothing;
    absl::Status loaded = LoadFullOptimStateDictFromRank0(
        **wrapped, *optimizer, comm.rank() == 0 ? *optim_state : nothing);
    ASSERT_TRUE(loaded.ok()) << loaded;
    for (int step = 2; step < 4; ++step) {
      at::Tensor loss = at::full({1}, Step(model, *optimizer, step, comm.rank(), 3));
      comm.AllReduce(loss, ReduceOp::kAvg)->Wait();
      EXPECT_NEAR(loss.item<float>(), expected[step - 2], 1e-5 * std::abs(expected[step - 2]));
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    a = register_module("a", torch::nn::Linear(3, 3));
    b = register_module("b", torch::nn::Linear(3, 3));
    b->weight = b->register_parameter("shared", a->weight);
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Tied);

TEST(OptimState, AParameterListedTwiceIsNamed) {
  Tied model;
  torch::optim::SGD twice(model->parameters(), torch::optim::SGDOptions(0.1));
  auto state = ModuleOptimStateDict(*model, twice);
  ASSERT_FALSE(state.ok());
  EXPECT_THAT(state.status().message(),
              HasSubstr("the optimizer holds parameter 'a.weight' twice (a tied weight?)"));
  torch::optim::SGD once(UniqueParameters(*model), torch::optim::SGDOptions(0.1));
  EXPECT_TRUE(ModuleOptimStateDict(*model, once).ok());
}

}  // namespace
}  // namespace fsdp
