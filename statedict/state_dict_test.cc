#include "statedict/state_dict.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "formats/torch_file.h"
#include "fsdp/shard_placement.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"

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
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::Not;

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

std::vector<std::string> Keys(const StateDict& state) {
  std::vector<std::string> keys;
  for (const auto& [name, tensor] : state) keys.push_back(name);
  return keys;
}

// Every rank's persistent storage: its shards, as copies.
std::vector<at::Tensor> Shards(const FullyShardedModel& model) {
  std::vector<at::Tensor> shards;
  for (const auto& unit : model.units()) {
    if (auto shard = UnitShard::Of(*unit)) shards.push_back(shard->local().clone());
  }
  return shards;
}

struct Case {
  int world_size;
  ShardingStrategy strategy;
};

class FullStateDictGather : public ::testing::TestWithParam<Case> {};

// The gathered state dict equals the unwrapped model's, key for key, while
// no rank ever holds more than one unit's full parameters.
TEST_P(FullStateDictGather, EqualsTheUnwrappedModelsAndGathersOneUnitAtATime) {
  const Case c = GetParam();
  Net reference;
  const StateDict want = ModuleStateDict(*reference);
  absl::Status status = RunOnThreadRanks(c.world_size, [&](Collectives& comm) {
    Net model;
    FsdpOptions options;
    options.strategy = c.strategy;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    int64_t largest_unit = 0;
    for (const auto& unit : (*wrapped)->units()) {
      largest_unit =
          std::max(largest_unit, UnitShard::Of(*unit).value().layout().padded_numel() * 4);
    }
    FullStateDictStats stats;
    auto state = FullStateDict(**wrapped, {}, &stats);
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_THAT(Keys(*state), ElementsAreArray(Keys(want)));
    for (size_t k = 0; k < want.size(); ++k) {
      EXPECT_TRUE(at::equal((*state)[k].second, want[k].second)) << want[k].first;
    }
    if (c.strategy != ShardingStrategy::kNoShard) {
      EXPECT_GT(stats.peak_full_param_bytes, 0);
      EXPECT_LE(stats.peak_full_param_bytes, largest_unit) << "more than one unit at a time";
    }
    EXPECT_EQ((*wrapped)->FullParamBytes(), 0);

    // Round trip: load changed values, gather them back.
    StateDict changed = want;
    for (auto& [name, tensor] : changed) tensor = tensor * 2 + 1;
    ASSERT_TRUE(LoadFullStateDict(**wrapped, changed).ok());
    auto again = FullStateDict(**wrapped);
    ASSERT_TRUE(again.ok());
    for (size_t k = 0; k < changed.size(); ++k) {
      EXPECT_TRUE(at::equal((*again)[k].second, changed[k].second)) << changed[k].first;
    }

    // In host memory or on the model's device, the result is a copy:
    // changing it changes nothing in the model.
    for (bool offload_to_cpu : {true, false}) {
      auto copies = FullStateDict(**wrapped, {.offload_to_cpu = offload_to_cpu});
      ASSERT_TRUE(copies.ok()) << copies.status();
      for (auto& [name, tensor] : *copies) tensor.add_(1);
      auto after = FullStateDict(**wrapped);
      ASSERT_TRUE(after.ok()) << after.status();
      for (size_t k = 0; k < changed.size(); ++k) {
        EXPECT_TRUE(at::equal((*after)[k].second, changed[k].second))
            << changed[k].first << " (offload_to_cpu " << offload_to_cpu << ")";
      }
    }

    // rank0_only: the other ranks take part but get nothing.
    auto rank0 = FullStateDict(**wrapped, {.rank0_only = true});
    ASSERT_TRUE(rank0.ok()) << rank0.status();
    EXPECT_EQ(rank0->size(), comm.rank() == 0 ? want.size() : 0u);
  });
  EXPECT_TRUE(status.ok()) << status;
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (int w : {1, 2, 3, 4}) {
    for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                               ShardingStrategy::kNoShard}) {
      cases.push_back({w, s});
    }
  }
  return cases;
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return absl::StrCat("W", info.param.world_size, "_", ShardingStrategyName(info.param.strategy));
}

INSTANTIATE_TEST_SUITE_P(Cases, FullStateDictGather, ::testing::ValuesIn(Cases()), CaseName);

// Train at W = 3, save on rank 0 through a torch.save file, load at W = 2
// and into the unwrapped model: all three compute the same outputs.
TEST(FullStateDictFile, SavedAtOneWorldSizeLoadsAtAnotherAndIntoThePlainModule) {
  const std::string path = TempDir() + "/net_w3.pt";
  absl::Status trained = RunOnThreadRanks(3, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    auto optimizer = MakeOptimizer(Optim::kAdam, model->parameters());
    const int64_t rows = kGlobalBatch / 3;
    for (int step = 0; step < 3; ++step) {
      at::mse_loss(model->forward(Inputs(step, 0).narrow(0, comm.rank() * rows, rows)),
                   Targets(step, 0).narrow(0, comm.rank() * rows, rows))
          .backward();
      optimizer->step();
      optimizer->zero_grad();
    }
    auto state = FullStateDict(**wrapped, {.rank0_only = true});
    ASSERT_TRUE(state.ok()) << state.status();
    if (comm.rank() == 0) {
      ASSERT_TRUE(SaveTorchStateDict(path, *state).ok());
    }
  });
  ASSERT_TRUE(trained.ok()) << trained;

  auto state = LoadTorchStateDict(path);
  ASSERT_TRUE(state.ok()) << state.status();
  Net plain;
  ASSERT_TRUE(LoadModuleStateDict(*plain, *state).ok());
  const at::Tensor x = Inputs(9, 0);
  const at::Tensor want = plain->forward(x).detach();
  EXPECT_FALSE(at::equal(want, Net()->forward(x).detach())) << "training changed nothing?";

  absl::Status loaded = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    auto from_file = LoadTorchStateDict(path);  // Every rank reads the file.
    ASSERT_TRUE(from_file.ok());
    ASSERT_TRUE(LoadFullStateDict(**wrapped, *from_file).ok());
    at::Tensor out;
    {
      at::NoGradGuard no_grad;
      out = model->forward(x);
    }
    EXPECT_TRUE(at::allclose(out, want, 1e-6, 1e-7));
  });
  EXPECT_TRUE(loaded.ok()) << loaded;
}

TEST(FullStateDictLoad, EveryProblemIsListedAndTheModelIsUntouched) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    const std::vector<at::Tensor> before = Shards(**wrapped);
    Net other;
    StateDict bad = ModuleStateDict(*other);
    for (auto& [name, tensor] : bad) tensor = tensor + 1;  // Would change every value.
    auto find = [&bad](const std::string& name) -> at::Tensor& {
      for (auto& [k, v] : bad) {
        if (k == name) return v;
      }
      ADD_FAILURE() << "no " << name;
      return bad.front().second;
    };
    find("blocks.1.fc.weight") = at::zeros({3, 3});
    find("blocks.1.fc.bias") = find("blocks.1.fc.bias").to(at::kDouble);
    bad.erase(std::find_if(bad.begin(), bad.end(),
                           [](const auto& kv) { return kv.first == "blocks.0.fc.bias"; }));
    bad.emplace_back("extra.weight", at::zeros({1}));
    absl::Status load = LoadFullStateDict(**wrapped, bad);
    ASSERT_FALSE(load.ok());
    EXPECT_EQ(load.code(), absl::StatusCode::kInvalidArgument);
    const std::string message(load.message());
    EXPECT_THAT(message, HasSubstr(absl::StrCat("rank ", comm.rank(), " of 2: cannot load the "
                                                "state dict (nothing was changed)")));
    EXPECT_THAT(message, HasSubstr("'blocks.1.fc.weight' has shape [3, 3], the model's is [11, 13]"));
    EXPECT_THAT(message, HasSubstr("'blocks.1.fc.bias' has dtype Double, the model's is Float"));
    EXPECT_THAT(message, HasSubstr("missing: blocks.0.fc.bias"));
    EXPECT_THAT(message, HasSubstr("not in the model: extra.weight"));
    const std::vector<at::Tensor> after = Shards(**wrapped);
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_TRUE(at::equal(before[i], after[i])) << "unit " << i << " changed";
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Mixed precision never reaches a FULL state dict: parameters come from the
// float32 shards (not the bfloat16 all-gather), and buffers that
// buffer_dtype keeps in low precision come back in their original dtype.
TEST(FullStateDict, MixedPrecisionGivesFullPrecision) {
  ASSERT_TRUE(RunOnThreadRanks(2, [](Collectives& comm) {
                Net model;
                model->register_buffer("scale", at::full({3}, 1.0 / 3));
                const auto initial = Net()->named_parameters();  // Same values (deterministic).
                FsdpOptions options;
                options.mixed_precision.param_dtype = at::kBFloat16;
                options.mixed_precision.buffer_dtype = at::kBFloat16;
                auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, options,
                                                       *ModuleTypePolicy::Of<BlockImpl>());
                ASSERT_TRUE(wrapped.ok());
                auto full = FullStateDict(**wrapped);
                ASSERT_TRUE(full.ok()) << full.status();
                bool found = false;
                for (const auto& [name, value] : *full) {
                  if (initial.contains(name)) {
                    EXPECT_EQ(value.scalar_type(), at::kFloat) << name;
                    EXPECT_TRUE(at::equal(value, initial[name])) << name;
                  }
                  if (name != "scale") continue;
                  found = true;
                  EXPECT_EQ(value.scalar_type(), at::kFloat);
                  // The values are the bfloat16-rounded ones, upcast.
                  EXPECT_TRUE(at::equal(value, at::full({3}, 1.0 / 3).to(at::kBFloat16).to(at::kFloat)));
                }
                EXPECT_TRUE(found);
              }).ok());
}

TEST(FullStateDictLoad, RefusedInsideSummonFullParams) {
  absl::Status status = RunOnThreadRanks(1, [](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    SummonFullParams full(**wrapped);
    auto state = FullStateDict(**wrapped);
    EXPECT_EQ(state.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(state.status().message(), HasSubstr("(inside SummonFullParams?)"));
    EXPECT_EQ(LocalStateDict(**wrapped).status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(LoadLocalStateDict(**wrapped, {}).code(), absl::StatusCode::kFailedPrecondition);
  });
  EXPECT_TRUE(status.ok()) << status;
}

class LocalStateDictLayout : public ::testing::TestWithParam<ShardingStrategy> {};

TEST_P(LocalStateDictLayout, RoundTripsInTheSameLayoutAndRefusesAnother) {
  FsdpOptions options;
  options.strategy = GetParam();
  std::vector<StateDict> saved(3);
  absl::Status status = RunOnThreadRanks(3, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    auto state = LocalStateDict(**wrapped);
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(Keys(*state)[0], "flat_param");
    EXPECT_EQ(Keys(*state)[2], "blocks.0.flat_param");
    saved[comm.rank()] = *state;
  });
  ASSERT_TRUE(status.ok()) << status;
  // Into fresh models of the same layout: the same shards.
  status = RunOnThreadRanks(3, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    for (const auto& unit : (*wrapped)->units()) UnitShard::Of(*unit).value().local().fill_(-1);
    absl::Status loaded = LoadLocalStateDict(**wrapped, saved[comm.rank()]);
    ASSERT_TRUE(loaded.ok()) << loaded;
    EXPECT_TRUE(at::equal(UnitShard::Of(*(*wrapped)->units()[1]).value().local(),
                          saved[comm.rank()][2].second));
  });
  ASSERT_TRUE(status.ok()) << status;
  // At another world size: refused, naming the layouts, nothing changed.
  status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    const std::vector<at::Tensor> before = Shards(**wrapped);
    absl::Status loaded = LoadLocalStateDict(**wrapped, saved[comm.rank()]);
    ASSERT_FALSE(loaded.ok());
    EXPECT_THAT(loaded.message(),
                HasSubstr(absl::StrCat("'blocks.0.flat_param' was saved as rank ", comm.rank(),
                                       " of 3, ", ShardingStrategyName(GetParam()),
                                       ", 2 parameters of 104 elements, but here it is rank ",
                                       comm.rank(), " of 2")));
    // Said once, by the layout: not again as shards of the wrong shape.
    EXPECT_THAT(loaded.message(), Not(HasSubstr("has shape")));
    EXPECT_THAT(loaded.message(), Not(HasSubstr("not in the model")));
    const std::vector<at::Tensor> after = Shards(**wrapped);
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(before[i], after[i]));
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A unit mixing frozen and trainable parameters orders its flat shard by
// which ones train: a LOCAL state dict saved with one parameter frozen
// round-trips, and loads into no wrapping that froze another.
TEST(LocalStateDictLayoutOfMixedUnits, WhichParametersTrainIsPartOfTheLayout) {
  std::vector<StateDict> saved(2);
  auto wrap_with_frozen = [](Net& model, Collectives& comm, bool freeze_weight) {
    BlockImpl& block = *model->blocks[0]->as<BlockImpl>();
    (freeze_weight ? block.fc->weight : block.fc->bias).requires_grad_(false);
    return FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
  };
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto wrapped = wrap_with_frozen(model, comm, /*freeze_weight=*/false);
    ASSERT_TRUE(wrapped.ok());
    auto state = LocalStateDict(**wrapped);
    ASSERT_TRUE(state.ok()) << state.status();
    saved[comm.rank()] = *state;
    for (const auto& unit : (*wrapped)->units()) UnitShard::Of(*unit).value().local().fill_(-1);
    absl::Status loaded = LoadLocalStateDict(**wrapped, saved[comm.rank()]);
    ASSERT_TRUE(loaded.ok()) << loaded;
    EXPECT_TRUE(at::equal(UnitShard::Of(*(*wrapped)->units()[1]).value().local(),
                          saved[comm.rank()][2].second));
  });
  ASSERT_TRUE(status.ok()) << status;
  status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto wrapped = wrap_with_frozen(model, comm, /*freeze_weight=*/true);
    ASSERT_TRUE(wrapped.ok());
    const std::vector<at::Tensor> before = Shards(**wrapped);
    absl::Status loaded = LoadLocalStateDict(**wrapped, saved[comm.rank()]);
    ASSERT_FALSE(loaded.ok());
    EXPECT_THAT(loaded.message(),
                HasSubstr("2 parameters of 104 elements (trainable: parameters 0), but here "
                          "it is rank "));
    EXPECT_THAT(loaded.message(), HasSubstr("(trainable: parameters 1)"));
    const std::vector<at::Tensor> after = Shards(**wrapped);
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(before[i], after[i]));
  });
  EXPECT_TRUE(status.ok()) << status;
}

INSTANTIATE_TEST_SUITE_P(Strategies, LocalStateDictLayout,
                         ::testing::Values(ShardingStrategy::kFullShard,
                                           ShardingStrategy::kShardGradOp,
                                           ShardingStrategy::kNoShard),
                         [](const ::testing::TestParamInfo<ShardingStrategy>& info) {
                           return std::string(ShardingStrategyName(info.param));
                         });

}  // namespace
}  // namespace fsdp
