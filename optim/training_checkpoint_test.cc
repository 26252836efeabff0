#include "optim/training_checkpoint.h"

#include <sys/stat.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "fsdp/shard_placement.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "statedict/sharded_checkpoint.h"
#include "testing/multi_rank.h"
#include "torch/optim/adagrad.h"
#include "torch/optim/adam.h"
#include "torch/optim/adamw.h"
#include "torch/optim/sgd.h"

namespace fsdp {
namespace {

using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::Net;
using ::fsdp::testing::RunOnProcessRanks;
using ::fsdp::testing::RunOnThreadRanks;
using ::fsdp::testing::Targets;
using ::testing::HasSubstr;

std::string Dir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
  mkdir(dir.c_str(), 0755);
  return dir;
}

enum class Kind { kSgdMomentum, kAdam, kAdamW, kAdagrad };

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

struct Trainer {
  Net model;
  std::unique_ptr<FullyShardedModel> fsdp;
  std::unique_ptr<torch::optim::Optimizer> optimizer;

  // `freeze_weight`: blocks.1's weight frozen, so that unit holds frozen and
  // trainable parameters (its bias moves ahead of the weight in the flat
  // parameter); the optimizer gets the trainable ones.
  explicit Trainer(Collectives& comm, Kind kind = Kind::kAdamW, bool freeze_weight = false) {
    if (freeze_weight) model->blocks[1]->as<BlockImpl>()->fc->weight.requires_grad_(false);
    fsdp =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>()).value();
    std::vector<at::Tensor> trainable;
    for (const at::Tensor& p : UniqueParameters(*model)) {
      if (p.requires_grad()) trainable.push_back(p);
    }
    optimizer = Make(kind, trainable);
  }
  // The global loss of one step.
  float Step(Collectives& comm, int step) {
    const int64_t rows = kGlobalBatch / comm.world_size();
    at::Tensor loss =
        at::mse_loss(model->forward(Inputs(step, 0).narrow(0, comm.rank() * rows, rows)),
                     Targets(step, 0).narrow(0, comm.rank() * rows, rows));
    loss.backward();
    EXPECT_TRUE(ClipGradNorm(*fsdp, 1.0).ok());
    optimizer->step();
    optimizer->zero_grad();
    at::Tensor global = loss.detach().clone();
    comm.AllReduce(global, ReduceOp::kAvg)->Wait();
    return global.item<float>();
  }
};

std::vector<float> ReadLosses(const std::string& path) {
  std::vector<float> losses;
  std::ifstream in(path, std::ios::binary);
  float v;
  while (in.read(reinterpret_cast<char*>(&v), sizeof(v))) losses.push_back(v);
  return losses;
}

void WriteLosses(const std::string& path, const std::vector<float>& losses) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(losses.data()), losses.size() * sizeof(float));
}

// Train 3 steps, save, train 3 more; new processes load and train the same
// 3 steps: the losses are bit-for-bit the same.
TEST(TrainingCheckpoint, ResumesExactlyInNewProcesses) {
  const std::string dir = Dir("resume");
  const std::string losses_path = dir + "/uninterrupted.bin";
  absl::Status first = RunOnProcessRanks(2, [&](Collectives& comm) {
    Trainer t(comm);
    for (int step = 0; step < 3; ++step) t.Step(comm, step);
    absl::Status saved = SaveTrainingCheckpoint(*t.fsdp, *t.optimizer, dir);
    ASSERT_TRUE(saved.ok()) << saved;
    std::vector<float> losses;
    for (int step = 3; step < 6; ++step) losses.push_back(t.Step(comm, step));
    if (comm.rank() == 0) WriteLosses(losses_path, losses);
  });
  ASSERT_TRUE(first.ok()) << first;
  const std::string resumed_path = dir + "/resumed.bin";
  absl::Status second = RunOnProcessRanks(2, [&](Collectives& comm) {
    Trainer t(comm);  // Fresh model and optimizer in fresh processes.
    absl::Status loaded = LoadTrainingCheckpoint(*t.fsdp, *t.optimizer, dir);
    ASSERT_TRUE(loaded.ok()) << loaded;
    std::vector<float> losses;
    for (int step = 3; step < 6; ++step) losses.push_back(t.Step(comm, step));
    if (comm.rank() == 0) WriteLosses(resumed_path, losses);
  });
  ASSERT_TRUE(second.ok()) << second;
  const std::vector<float> want = ReadLosses(losses_path), got = ReadLosses(resumed_path);
  ASSERT_EQ(want.size(), 3u);
  ASSERT_EQ(got.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(got[i], want[i]) << "step " << 3 + i << " (bit for bit)";
  }
}

// Saved at W = 2 after 3 steps, resumed at W = 3 and W = 1: the next 3
// steps' losses equal the uninterrupted run's up to float32 rounding of the
// reductions in another order (relative 1e-5). `after` sees each resumed
// trainer at the end.
void ExpectResumesAtOtherWorldSizes(const std::string& dir, Kind kind, bool freeze_weight,
                                    const std::function<void(Trainer&)>& after = nullptr) {
  std::vector<float> want;
  absl::Status first = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm, kind, freeze_weight);
    for (int step = 0; step < 3; ++step) t.Step(comm, step);
    ASSERT_TRUE(SaveTrainingCheckpoint(*t.fsdp, *t.optimizer, dir).ok());
    for (int step = 3; step < 6; ++step) {
      const float loss = t.Step(comm, step);
      if (comm.rank() == 0) want.push_back(loss);
    }
  });
  ASSERT_TRUE(first.ok()) << first;
  for (int world : {3, 1}) {
    absl::Status second = RunOnThreadRanks(world, [&](Collectives& comm) {
      Trainer t(comm, kind, freeze_weight);
      absl::Status loaded = LoadTrainingCheckpoint(*t.fsdp, *t.optimizer, dir);
      ASSERT_TRUE(loaded.ok()) << loaded;
      for (int step = 3; step < 6; ++step) {
        EXPECT_NEAR(t.Step(comm, step), want[step - 3], 1e-5 * std::abs(want[step - 3]))
            << "world " << world << " step " << step;
      }
      if (after) after(t);
    });
    EXPECT_TRUE(second.ok()) << second;
  }
}

class ResumeAtAnotherWorldSize : public ::testing::TestWithParam<Kind> {};

TEST_P(ResumeAtAnotherWorldSize, ContinuesTheRun) {
  ExpectResumesAtOtherWorldSizes(Dir(absl::StrCat("reshard", static_cast<int>(GetParam()))),
                                 GetParam(), /*freeze_weight=*/false);
}

std::string KindName(const ::testing::TestParamInfo<Kind>& info) {
  const char* names[] = {"SgdMomentum", "Adam", "AdamW", "Adagrad"};
  return names[static_cast<int>(info.param)];
}

INSTANTIATE_TEST_SUITE_P(Optimizers, ResumeAtAnotherWorldSize,
                         ::testing::Values(Kind::kSgdMomentum, Kind::kAdam, Kind::kAdamW,
                                           Kind::kAdagrad),
                         KindName);

// A unit with a frozen parameter beside trainable ones (its flat parameter
// in two segments) saves and resumes at other world sizes like any other;
// the frozen weight keeps its initial value throughout.
TEST(TrainingCheckpoint, AUnitWithFrozenAndTrainableParametersResumesElsewhere) {
  const at::Tensor initial = Net()->blocks[1]->as<BlockImpl>()->fc->weight.detach().clone();
  ExpectResumesAtOtherWorldSizes(Dir("frozen_and_trainable"), Kind::kAdamW,
                                 /*freeze_weight=*/true, [&](Trainer& t) {
                                   SummonFullParams full(*t.fsdp);
                                   EXPECT_TRUE(at::equal(
                                       t.model->blocks[1]->as<BlockImpl>()->fc->weight,
                                       initial));
                                 });
}

// Another optimizer's checkpoint is refused with a message that says what
// state each holds, and stays short however many parameters there are
// (before, every parameter's missing state was listed: 13 KB per rank for
// the main job's GPT).
TEST(TrainingCheckpoint, AnotherOptimizersCheckpointIsRefusedNamingItsState) {
  const std::string dir = Dir("other_optimizer");
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer adamw(comm, Kind::kAdamW);
    adamw.Step(comm, 0);
    ASSERT_TRUE(SaveTrainingCheckpoint(*adamw.fsdp, *adamw.optimizer, dir).ok());
    Trainer sgd(comm, Kind::kSgdMomentum);
    sgd.Step(comm, 0);
    absl::Status loaded = LoadTrainingCheckpoint(*sgd.fsdp, *sgd.optimizer, dir);
    ASSERT_FALSE(loaded.ok());
    const std::string message(loaded.message());
    // The SGD's state the checkpoint lacks, and the AdamW's it holds
    // instead, counted.
    EXPECT_THAT(message, HasSubstr("missing: optim/state/blocks.0.fc.weight/momentum_buffer, "));
    EXPECT_THAT(message, HasSubstr(" and 3 more (11 by their last part: dampening 1, momentum 1, "
                                   "momentum_buffer 8, nesterov 1); not in the model: "));
    EXPECT_THAT(message, HasSubstr(" and 19 more (27 by their last part: amsgrad 1, betas 1, eps "
                                   "1, exp_avg 8, exp_avg_sq 8, step 8)"));
    EXPECT_LT(message.size(), 2000u) << message;
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(TrainingCheckpoint, AModelOnlyCheckpointIsRefusedAndNothingChanges) {
  const std::string dir = Dir("model_only");
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm);
    t.Step(comm, 0);
    ASSERT_TRUE(SaveShardedCheckpoint(*t.fsdp, dir).ok());
    Trainer fresh(comm);
    const at::Tensor before = UnitShard::Of(*fresh.fsdp->units()[1]).value().local().clone();
    absl::Status loaded = LoadTrainingCheckpoint(*fresh.fsdp, *fresh.optimizer, dir);
    ASSERT_FALSE(loaded.ok());
    EXPECT_THAT(loaded.message(), HasSubstr("missing: optim/group/0/param/"));
    EXPECT_TRUE(fresh.optimizer->state().empty()) << "the optimizer stays fresh";
    EXPECT_TRUE(at::equal(UnitShard::Of(*fresh.fsdp->units()[1]).value().local(), before));
    // The model-only load of a training checkpoint works (optimizer entries
    // are ignored).
    ASSERT_TRUE(SaveTrainingCheckpoint(*t.fsdp, *t.optimizer, dir).ok());
    EXPECT_TRUE(LoadShardedCheckpoint(*fresh.fsdp, dir).ok());
    // Saving before the first step is refused.
    Trainer unstepped(comm);
    absl::Status early = SaveTrainingCheckpoint(*unstepped.fsdp, *unstepped.optimizer, dir);
    EXPECT_THAT(early.message(), HasSubstr("has no optimizer state yet"));
  });
  EXPECT_TRUE(status.ok()) << status;
}

}  // namespace
}  // namespace fsdp
