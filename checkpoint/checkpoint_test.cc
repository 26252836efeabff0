#include "checkpoint/checkpoint.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "comm/gloo_collectives.h"
#include "comm/hybrid_groups.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "optim/training_checkpoint.h"
#include "statedict/sharded_checkpoint.h"
#include "statedict/state_dict.h"
#include "testing/multi_rank.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"
#include "torch/optim/adamw.h"

namespace fsdp {
namespace {

using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::Net;
using ::fsdp::testing::RunOnThreadRanks;
using ::fsdp::testing::Targets;
using ::testing::HasSubstr;

std::string Dir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
}

// A Net wrapped one unit per block, and AdamW over its shards.
struct Trainer {
  Net model;
  std::unique_ptr<FullyShardedModel> fsdp;
  std::unique_ptr<torch::optim::AdamW> optimizer;

  explicit Trainer(const ProcessGroups& groups, bool freeze_head = false,
                   const FsdpOptions& options = {}) {
    if (freeze_head) model->head->weight.requires_grad_(false);
    fsdp =
        FullyShardedModel::Wrap(model.ptr(), groups, options, *ModuleTypePolicy::Of<BlockImpl>())
            .value();
    std::vector<at::Tensor> trainable;
    for (const at::Tensor& p : UniqueParameters(*model)) {
      if (p.requires_grad()) trainable.push_back(p);
    }
    optimizer = std::make_unique<torch::optim::AdamW>(
        trainable, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
  }
  // The global loss of one step.
  float Step(Collectives& comm, int step) {
    const int64_t rows = kGlobalBatch / comm.world_size();
    at::Tensor loss =
        at::mse_loss(model->forward(Inputs(step, 0).narrow(0, comm.rank() * rows, rows)),
                     Targets(step, 0).narrow(0, comm.rank() * rows, rows));
    loss.backward();
    optimizer->step();
    optimizer->zero_grad();
    at::Tensor global = loss.detach().clone();
    comm.AllReduce(global, ReduceOp::kAvg)->Wait();
    return global.item<float>();
  }
};

void ExpectSameStateDict(const StateDict& got, const StateDict& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first);
    EXPECT_TRUE(at::equal(got[i].second.cpu(), want[i].second.cpu())) << got[i].first;
  }
}

// Saved at W = 2 with the optimizer and the train state; loaded at W = 3
// and W = 1 into fresh models: the train state comes back, and the next
// steps' losses equal the uninterrupted run's up to float32 rounding of
// the reductions in another order.
TEST(Checkpoint, ResumesARunAtOtherWorldSizes) {
  const std::string dir = Dir("resume");
  std::vector<float> want;
  absl::Status first = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm);
    for (int step = 0; step < 3; ++step) t.Step(comm, step);
    absl::Status saved = SaveCheckpoint(dir, *t.fsdp, t.optimizer.get(), {3, 96});
    ASSERT_TRUE(saved.ok()) << saved;
    for (int step = 3; step < 6; ++step) {
      const float loss = t.Step(comm, step);
      if (comm.rank() == 0) want.push_back(loss);
    }
  });
  ASSERT_TRUE(first.ok()) << first;
  for (int world : {3, 1}) {
    absl::Status second = RunOnThreadRanks(world, [&](Collectives& comm) {
      Trainer t(comm);
      TrainState state;
      absl::Status loaded = LoadCheckpoint(dir, *t.fsdp, t.optimizer.get(), &state);
      ASSERT_TRUE(loaded.ok()) << loaded;
      EXPECT_EQ(state.step, 3);
      EXPECT_EQ(state.data_position, 96);
      for (int step = 3; step < 6; ++step) {
        EXPECT_NEAR(t.Step(comm, step), want[step - 3], 1e-5 * std::abs(want[step - 3]))
            << "world " << world << " step " << step;
      }
    });
    EXPECT_TRUE(second.ok()) << second;
  }
}

// Without an optimizer: the model alone, and the train state with its
// labels (a bad label name is refused on every rank, and nothing is saved).
TEST(Checkpoint, SavesAndLoadsTheModelAlone) {
  const std::string dir = Dir("model_alone");
  // CMake's TEST_TMPDIR outlives a run: no checkpoint of an earlier one.
  std::filesystem::remove_all(dir);
  StateDict saved_state;
  absl::Status first = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm);
    t.Step(comm, 0);
    TrainState bad{1, 0, {{"settings..lr", "x"}}};
    absl::Status refused = SaveCheckpoint(dir, *t.fsdp, nullptr, bad);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_THAT(refused.message(), HasSubstr("TrainState label 'settings..lr'"));
    refused = SaveCheckpoint(dir, *t.fsdp, nullptr, {1, 0, {{"a", "x"}, {"a.b", "y"}}});
    EXPECT_THAT(refused.message(), HasSubstr("cannot also be the prefix of another"));
    struct stat st;
    EXPECT_NE(stat((dir + "/.metadata").c_str(), &st), 0);
    TrainState train_state{1, 0, {{"run_id", "abc"}, {"settings.lr", "0.01"}}};
    ASSERT_TRUE(SaveCheckpoint(dir, *t.fsdp, nullptr, train_state).ok());
    StateDict state = GetModelStateDict(*t.fsdp).value();
    if (comm.rank() == 0) saved_state = state;
  });
  ASSERT_TRUE(first.ok()) << first;
  absl::Status second = RunOnThreadRanks(3, [&](Collectives& comm) {
    Trainer t(comm);
    TrainState state;
    absl::Status loaded = LoadCheckpoint(dir, *t.fsdp, nullptr, &state);
    ASSERT_TRUE(loaded.ok()) << loaded;
    EXPECT_EQ(state.step, 1);
    EXPECT_EQ(state.labels,
              (std::map<std::string, std::string>{{"run_id", "abc"}, {"settings.lr", "0.01"}}));
    ExpectSameStateDict(GetModelStateDict(*t.fsdp).value(), saved_state);
    // A checkpoint without optimizer state cannot restore one.
    absl::Status with_optimizer = LoadCheckpoint(dir, *t.fsdp, t.optimizer.get());
    EXPECT_FALSE(with_optimizer.ok());
    EXPECT_THAT(with_optimizer.message(), HasSubstr("optim"));
  });
  EXPECT_TRUE(second.ok()) << second;
}

// A save killed mid-write leaves temporary files beside the checkpoint; the
// next save of the same directory, in either format the front door writes,
// removes them.
TEST(Checkpoint, TheNextSaveRemovesWhatAKilledSaveLeft) {
  for (const CheckpointFormat format :
       {CheckpointFormat::kDistributed, CheckpointFormat::kHuggingFace}) {
    const std::string dir = Dir(format == CheckpointFormat::kDistributed ? "leftovers_dcp"
                                                                         : "leftovers_hf");
    std::filesystem::create_directories(dir);
    const std::string left = dir + "/__1_0.distcp.tmp-999999-7";
    std::ofstream(left) << "half a file";
    absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
      Trainer t(comm);
      CheckpointIoOptions options;
      options.format = format;
      ASSERT_TRUE(SaveCheckpoint(dir, *t.fsdp, nullptr, {}, options).ok());
    });
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_FALSE(std::filesystem::exists(left)) << dir;
  }
}

// No checkpoint there: kNotFound, and nothing changes, so a new run starts.
TEST(Checkpoint, AnEmptyOrAbsentDirectoryIsNotFound) {
  const std::string empty = Dir("empty");
  mkdir(empty.c_str(), 0755);
  absl::Status run = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm);
    const StateDict before = GetModelStateDict(*t.fsdp).value();
    TrainState state{7, 8};
    for (const std::string& dir : {empty, Dir("absent")}) {
      absl::Status loaded = LoadCheckpoint(dir, *t.fsdp, t.optimizer.get(), &state);
      EXPECT_TRUE(absl::IsNotFound(loaded)) << loaded;
      EXPECT_THAT(loaded.message(), HasSubstr("holds no checkpoint"));
    }
    EXPECT_EQ(state.step, 7);
    ExpectSameStateDict(GetModelStateDict(*t.fsdp).value(), before);
  });
  EXPECT_TRUE(run.ok()) << run;
}

// A checkpoint of this project's older SHARDED format (manifest.pb) still
// resumes, its step taken from the manifest.
TEST(Checkpoint, LoadsAnOlderShardedCheckpoint) {
  const std::string dir = Dir("sharded");
  mkdir(dir.c_str(), 0755);
  StateDict saved_state;
  absl::Status first = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm);
    t.Step(comm, 0);
    t.Step(comm, 1);
    ASSERT_TRUE(SaveTrainingCheckpoint(*t.fsdp, *t.optimizer, dir, {{"step", "2"}}).ok());
    StateDict state = GetModelStateDict(*t.fsdp).value();
    if (comm.rank() == 0) saved_state = state;
  });
  ASSERT_TRUE(first.ok()) << first;
  absl::Status second = RunOnThreadRanks(1, [&](Collectives& comm) {
    Trainer t(comm);
    TrainState state;
    absl::Status loaded = LoadCheckpoint(dir, *t.fsdp, t.optimizer.get(), &state);
    ASSERT_TRUE(loaded.ok()) << loaded;
    EXPECT_EQ(state.step, 2);
    ExpectSameStateDict(GetModelStateDict(*t.fsdp).value(), saved_state);
  });
  EXPECT_TRUE(second.ok()) << second;
}

// cpu_offload: rank 0 alone gets the dict, in host memory, as PyTorch's
// full state dict with cpu_offload; ignore_frozen_params leaves frozen
// parameters out.
TEST(StateDictOptions, GetHonoursCpuOffloadAndFrozenParameters) {
  absl::Status run = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm, /*freeze_head=*/true);
    StateDictOptions offload;
    offload.cpu_offload = true;
    const StateDict on_rank0 = GetModelStateDict(*t.fsdp, offload).value();
    if (comm.rank() == 0) {
      ASSERT_EQ(on_rank0.size(), 8u);  // Three blocks' and the head's weight and bias.
      for (const auto& [name, tensor] : on_rank0) EXPECT_TRUE(tensor.is_cpu()) << name;
    } else {
      EXPECT_TRUE(on_rank0.empty());
    }
    StateDictOptions trainable;
    trainable.ignore_frozen_params = true;
    const StateDict state = GetModelStateDict(*t.fsdp, trainable).value();
    ASSERT_EQ(state.size(), 7u);
    for (const auto& entry : state) EXPECT_NE(entry.first, "head.weight");
  });
  EXPECT_TRUE(run.ok()) << run;
}

// A state dict gathered at W = 2 loads at W = 3: from every rank, and from
// rank 0 alone (the others pass nothing).
TEST(StateDictOptions, SetLoadsFromEveryRankOrFromRank0) {
  StateDict saved;
  OptimStateDict saved_optim;
  absl::Status first = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm);
    t.Step(comm, 0);
    StateDict state = GetModelStateDict(*t.fsdp).value();
    OptimStateDict optim = GetOptimizerStateDict(*t.fsdp, *t.optimizer).value();
    if (comm.rank() == 0) {
      saved = state;
      saved_optim = optim;
    }
  });
  ASSERT_TRUE(first.ok()) << first;
  for (bool from_rank0 : {false, true}) {
    absl::Status second = RunOnThreadRanks(3, [&](Collectives& comm) {
      Trainer t(comm);
      StateDictOptions options;
      options.broadcast_from_rank0 = from_rank0;
      const bool give = !from_rank0 || comm.rank() == 0;
      absl::Status model = SetModelStateDict(*t.fsdp, give ? saved : StateDict{}, options);
      ASSERT_TRUE(model.ok()) << model;
      absl::Status optim =
          SetOptimizerStateDict(*t.fsdp, *t.optimizer, give ? saved_optim : OptimStateDict{},
                                options);
      ASSERT_TRUE(optim.ok()) << optim;
      ExpectSameStateDict(GetModelStateDict(*t.fsdp).value(), saved);
      const OptimStateDict got = GetOptimizerStateDict(*t.fsdp, *t.optimizer).value();
      ASSERT_EQ(got.state.size(), saved_optim.state.size());
      for (size_t i = 0; i < got.state.size(); ++i) {
        EXPECT_EQ(got.state[i].first, saved_optim.state[i].first);
        for (const auto& [name, tensor] : saved_optim.state[i].second.tensors) {
          EXPECT_TRUE(at::equal(got.state[i].second.tensors.at(name), tensor))
              << got.state[i].first << " " << name << (from_rank0 ? " from rank 0" : "");
        }
      }
    });
    EXPECT_TRUE(second.ok()) << second;
  }
}

// Under hybrid sharding "rank 0" is the first replica's shard rank 0: the
// other replicas' shard ranks 0 pass nothing too, and must still load it.
TEST(StateDictOptions, FromRank0ReachesEveryReplicaUnderHybridSharding) {
  StateDict saved;
  OptimStateDict saved_optim;
  absl::Status first = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm);
    t.Step(comm, 0);
    StateDict state = GetModelStateDict(*t.fsdp).value();
    OptimStateDict optim = GetOptimizerStateDict(*t.fsdp, *t.optimizer).value();
    if (comm.rank() == 0) {
      saved = state;
      saved_optim = optim;
    }
  });
  ASSERT_TRUE(first.ok()) << first;
  const HybridShardLayout layout = HybridShardLayout::Create(4, 2).value();
  auto store = c10::make_intrusive<c10d::HashStore>();
  absl::Status second = RunOnThreadRanks(4, [&](Collectives& world) {
    GlooOptions gloo;
    gloo.hostname = "127.0.0.1";
    gloo.timeout = std::chrono::seconds(60);
    auto groups = CreateHybridShardCollectives(world.rank(), layout, gloo.group_name,
                                               GlooGroupConnector(store, gloo));
    ASSERT_TRUE(groups.ok()) << groups.status();
    FsdpOptions options;
    options.strategy = ShardingStrategy::kHybridShard;
    ProcessGroups hybrid(*groups->shard);
    hybrid.replicate = groups->replicate.get();
    Trainer t(hybrid, /*freeze_head=*/false, options);
    StateDictOptions from_rank0;
    from_rank0.broadcast_from_rank0 = true;
    const bool give = world.rank() == 0;
    absl::Status model = SetModelStateDict(*t.fsdp, give ? saved : StateDict{}, from_rank0);
    ASSERT_TRUE(model.ok()) << "rank " << world.rank() << ": " << model;
    absl::Status optim = SetOptimizerStateDict(
        *t.fsdp, *t.optimizer, give ? saved_optim : OptimStateDict{}, from_rank0);
    ASSERT_TRUE(optim.ok()) << "rank " << world.rank() << ": " << optim;
    ExpectSameStateDict(GetModelStateDict(*t.fsdp).value(), saved);
    const OptimStateDict got = GetOptimizerStateDict(*t.fsdp, *t.optimizer).value();
    ASSERT_EQ(got.state.size(), saved_optim.state.size());
    for (size_t i = 0; i < got.state.size(); ++i) {
      for (const auto& [name, tensor] : saved_optim.state[i].second.tensors) {
        EXPECT_TRUE(at::equal(got.state[i].second.tensors.at(name), tensor))
            << "rank " << world.rank() << ": " << got.state[i].first << " " << name;
      }
    }
  });
  EXPECT_TRUE(second.ok()) << second;
}

// A buffer that is not contiguous cannot be viewed flat: saving works, and
// loading it back is refused by name in both sharded formats rather than
// silently leaving it as it was.
TEST(Checkpoint, ABufferThatIsNotContiguousIsRefusedOnLoadByName) {
  const std::string dcp = Dir("non_contiguous_dcp");
  const std::string sharded = Dir("non_contiguous_sharded");
  mkdir(sharded.c_str(), 0755);
  absl::Status run = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    model->register_buffer("transposed", at::arange(12, at::kFloat).reshape({4, 3}).t());
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>()).value();
    ASSERT_TRUE(SaveCheckpoint(dcp, *wrapped).ok());
    ASSERT_TRUE(SaveShardedCheckpoint(*wrapped, sharded).ok());
    for (const std::string& dir : {dcp, sharded}) {
      absl::Status loaded = LoadCheckpoint(dir, *wrapped);
      ASSERT_FALSE(loaded.ok()) << dir;
      EXPECT_THAT(std::string(loaded.message()), HasSubstr("transposed' is not contiguous in the model"))
          << dir;
    }
  });
  EXPECT_TRUE(run.ok()) << run;
}

// strict: a missing entry is refused by name and nothing changes. Not
// strict: entries the model lacks are ignored and missing ones keep their
// values. ignore_frozen_params: a frozen parameter may be missing.
TEST(StateDictOptions, StrictAndFrozenDecideWhatMayBeMissing) {
  absl::Status run = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm, /*freeze_head=*/true);
    const StateDict before = GetModelStateDict(*t.fsdp).value();
    StateDict partial;
    for (const auto& [name, tensor] : before) {
      if (name != "head.weight" && name != "blocks.0.fc.bias") {
        partial.emplace_back(name, tensor + 1);
      }
    }
    partial.emplace_back("not.in.the.model", at::zeros({2}));

    absl::Status strict = SetModelStateDict(*t.fsdp, partial);
    EXPECT_FALSE(strict.ok());
    EXPECT_THAT(strict.message(), HasSubstr("blocks.0.fc.bias"));
    ExpectSameStateDict(GetModelStateDict(*t.fsdp).value(), before);

    StateDictOptions lenient;
    lenient.strict = false;
    absl::Status loaded = SetModelStateDict(*t.fsdp, partial, lenient);
    ASSERT_TRUE(loaded.ok()) << loaded;
    const StateDict after = GetModelStateDict(*t.fsdp).value();
    ASSERT_EQ(after.size(), before.size());
    for (size_t i = 0; i < after.size(); ++i) {
      const std::string& name = after[i].first;
      ASSERT_EQ(name, before[i].first);
      const bool kept = name == "head.weight" || name == "blocks.0.fc.bias";
      EXPECT_TRUE(at::allclose(after[i].second, kept ? before[i].second : before[i].second + 1))
          << name;
    }

    // Strict, but the frozen head.weight may be missing (the trainable
    // blocks.0.fc.bias may not): head.weight, set to +5 first, keeps that.
    StateDictOptions frozen_optional;
    frozen_optional.ignore_frozen_params = true;
    StateDict head_plus_5;
    for (const auto& [name, tensor] : before) {
      if (name == "head.weight") head_plus_5.emplace_back(name, tensor + 5);
    }
    ASSERT_TRUE(SetModelStateDict(*t.fsdp, head_plus_5, lenient).ok());
    StateDict without_frozen;
    for (const auto& entry : before) {
      if (entry.first != "head.weight") without_frozen.push_back(entry);
    }
    absl::Status frozen = SetModelStateDict(*t.fsdp, without_frozen, frozen_optional);
    ASSERT_TRUE(frozen.ok()) << frozen;
    StateDict want = before;
    for (auto& [name, tensor] : want) {
      if (name == "head.weight") tensor = tensor + 5;
    }
    ExpectSameStateDict(GetModelStateDict(*t.fsdp).value(), want);
    StateDict without_trainable;
    for (const auto& entry : before) {
      if (entry.first != "blocks.0.fc.bias") without_trainable.push_back(entry);
    }
    absl::Status trainable_missing =
        SetModelStateDict(*t.fsdp, without_trainable, frozen_optional);
    EXPECT_FALSE(trainable_missing.ok());
    EXPECT_THAT(trainable_missing.message(), HasSubstr("blocks.0.fc.bias"));
  });
  EXPECT_TRUE(run.ok()) << run;
}

// torch.save files both ways, the model's and the optimizer's.
TEST(TorchFile, SavesAndLoadsModelAndOptimizerState) {
  const std::string dir = Dir("torch_file");
  mkdir(dir.c_str(), 0755);
  absl::Status run = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm);
    t.Step(comm, 0);
    StateDictOptions offload;
    offload.cpu_offload = true;
    const StateDict state = GetModelStateDict(*t.fsdp, offload).value();
    const OptimStateDict optim = GetOptimizerStateDict(*t.fsdp, *t.optimizer, offload).value();
    if (comm.rank() == 0) {
      ASSERT_TRUE(SaveTorchFile(dir + "/model.pt", state).ok());
      ASSERT_TRUE(SaveTorchFile(dir + "/optim.pt", optim).ok());
    }
    comm.Barrier();
    const StateDict everywhere = GetModelStateDict(*t.fsdp).value();
    ExpectSameStateDict(LoadTorchFile(dir + "/model.pt").value(), everywhere);
    // Into a fresh model and optimizer: the same state comes back.
    Trainer fresh(comm);
    ASSERT_TRUE(SetModelStateDict(*fresh.fsdp, LoadTorchFile(dir + "/model.pt").value()).ok());
    const OptimStateDict read = LoadTorchFile<OptimStateDict>(dir + "/optim.pt").value();
    ASSERT_TRUE(SetOptimizerStateDict(*fresh.fsdp, *fresh.optimizer, read).ok());
    const OptimStateDict want = GetOptimizerStateDict(*t.fsdp, *t.optimizer).value();
    const OptimStateDict got = GetOptimizerStateDict(*fresh.fsdp, *fresh.optimizer).value();
    ASSERT_EQ(got.state.size(), want.state.size());
    ASSERT_GT(got.state.size(), 0u);
    for (size_t i = 0; i < got.state.size(); ++i) {
      EXPECT_EQ(got.state[i].first, want.state[i].first);
      ASSERT_EQ(got.state[i].second.tensors.size(), want.state[i].second.tensors.size());
      for (const auto& [name, tensor] : want.state[i].second.tensors) {
        EXPECT_TRUE(at::equal(got.state[i].second.tensors.at(name), tensor))
            << want.state[i].first << " " << name;
      }
    }
    // The next step is the same from both.
    EXPECT_EQ(fresh.Step(comm, 1), t.Step(comm, 1));
  });
  EXPECT_TRUE(run.ok()) << run;
}

// Misuse and damage: every rank gets the same error, and nothing changes.
TEST(Checkpoint, RefusesWhatWouldBeAmbiguousOrIsDamaged) {
  const std::string sharded = Dir("old_sharded"), runs = Dir("runs"), damaged = Dir("damaged");
  mkdir(sharded.c_str(), 0755);
  mkdir(runs.c_str(), 0755);
  mkdir((runs + "/step-00000004").c_str(), 0755);
  absl::Status run = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm);
    t.Step(comm, 0);
    ASSERT_TRUE(SaveTrainingCheckpoint(*t.fsdp, *t.optimizer, sharded).ok());
    absl::Status beside = SaveCheckpoint(sharded, *t.fsdp, t.optimizer.get());
    EXPECT_EQ(beside.code(), absl::StatusCode::kFailedPrecondition) << beside;
    EXPECT_THAT(beside.message(), HasSubstr("holds a SHARDED checkpoint"));

    absl::Status step_dirs = LoadCheckpoint(runs, *t.fsdp, t.optimizer.get());
    EXPECT_EQ(step_dirs.code(), absl::StatusCode::kFailedPrecondition) << step_dirs;
    EXPECT_THAT(step_dirs.message(), HasSubstr("step-NNNNNNNN directories"));

    // A data file gone: damage, not "no checkpoint" (the README's program
    // would start afresh on kNotFound).
    ASSERT_TRUE(SaveCheckpoint(damaged, *t.fsdp, t.optimizer.get()).ok());
    comm.Barrier();
    if (comm.rank() == 1) {
      DIR* d = opendir(damaged.c_str());
      ASSERT_NE(d, nullptr);
      while (dirent* e = readdir(d)) {
        const std::string name = e->d_name;
        if (name.rfind("__1_", 0) == 0) ASSERT_EQ(unlink((damaged + "/" + name).c_str()), 0);
      }
      closedir(d);
    }
    comm.Barrier();
    const StateDict before = GetModelStateDict(*t.fsdp).value();
    absl::Status lost = LoadCheckpoint(damaged, *t.fsdp, t.optimizer.get());
    EXPECT_FALSE(lost.ok());
    EXPECT_FALSE(absl::IsNotFound(lost)) << lost;
    ExpectSameStateDict(GetModelStateDict(*t.fsdp).value(), before);
  });
  EXPECT_TRUE(run.ok()) << run;
}

// Rank 0's dict alone, without broadcast_from_rank0: refused on every rank
// before anything changes (the others would keep their values).
TEST(StateDictOptions, DictsThatDifferAcrossRanksAreRefused) {
  absl::Status run = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm);
    const StateDict before = GetModelStateDict(*t.fsdp).value();
    StateDict changed;
    for (const auto& [name, tensor] : before) changed.emplace_back(name, tensor + 1);
    StateDictOptions lenient;
    lenient.strict = false;
    absl::Status loaded =
        SetModelStateDict(*t.fsdp, comm.rank() == 0 ? changed : StateDict{}, lenient);
    EXPECT_EQ(loaded.code(), absl::StatusCode::kInvalidArgument) << loaded;
    EXPECT_THAT(loaded.message(), HasSubstr("broadcast_from_rank0"));
    ExpectSameStateDict(GetModelStateDict(*t.fsdp).value(), before);
  });
  EXPECT_TRUE(run.ok()) << run;
}

}  // namespace
}  // namespace fsdp
