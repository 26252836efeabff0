#include "checkpoint/async_checkpoint.h"

#include <signal.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "comm/gloo_collectives.h"
#include "comm/hybrid_groups.h"
#include "comm/launch_environment.h"
#include "comm/rendezvous.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "optim/training_checkpoint.h"
#include "testing/multi_rank.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"
#include "torch/optim/adamw.h"

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
  return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/async_", name);
}

GlooOptions LoopbackGloo() {
  GlooOptions gloo;
  gloo.hostname = "127.0.0.1";
  gloo.timeout = std::chrono::seconds(60);
  return gloo;
}

// A Net wrapped one unit per block, AdamW over its shards, and a
// checkpointer whose groups `connect` connects under `group_name`.
struct Trainer {
  Net model;
  std::unique_ptr<FullyShardedModel> fsdp;
  std::unique_ptr<torch::optim::AdamW> optimizer;
  std::unique_ptr<AsyncCheckpointer> saver;

  Trainer(const ProcessGroups& groups, const GroupConnector& connect,
          const FsdpOptions& options = {}, const std::string& group_name = "async_checkpoint") {
    fsdp = FullyShardedModel::Wrap(model.ptr(), groups, options, *ModuleTypePolicy::Of<BlockImpl>())
               .value();
    optimizer = std::make_unique<torch::optim::AdamW>(
        UniqueParameters(*model), torch::optim::AdamWOptions(0.01).weight_decay(0.1));
    saver = AsyncCheckpointer::Create(*fsdp, connect, group_name).value();
  }
  // The global loss of one step; `data_world` ranks split the batch.
  float Step(Collectives& data, int step) {
    const int64_t rows = kGlobalBatch / data.world_size();
    at::Tensor loss =
        at::mse_loss(model->forward(Inputs(step, 0).narrow(0, data.rank() * rows, rows)),
                     Targets(step, 0).narrow(0, data.rank() * rows, rows));
    loss.backward();
    optimizer->step();
    optimizer->zero_grad();
    at::Tensor global = loss.detach().clone();
    data.AllReduce(global, ReduceOp::kAvg)->Wait();
    return global.item<float>();
  }
};

// Connects one test's checkpointer groups in thread mode (the ranks' own
// groups meet through the harness's store).
GroupConnector NewConnector() {
  return GlooGroupConnector(c10::make_intrusive<c10d::HashStore>(), LoopbackGloo());
}

// Saved in the background after step 3 while steps 4-6 train: what lands
// is the state at the save (steps 4-6 continue from it exactly), and the
// outcome is reported once.
TEST(AsyncCheckpointer, LandsTheStateAtSaveWhileTrainingGoesOn) {
  const std::string dir = Dir("lands");
  const GroupConnector connect = NewConnector();
  std::vector<float> want;
  absl::Status first = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm, connect);
    for (int step = 0; step < 3; ++step) t.Step(comm, step);
    TrainState state{3, 96, {{"run_id", "abc"}}};
    absl::Status saved = t.saver->Save(dir, *t.fsdp, t.optimizer.get(), state);
    ASSERT_TRUE(saved.ok()) << saved;
    EXPECT_TRUE(t.saver->in_flight());
    EXPECT_GT(t.saver->last_times().staged_bytes, 0);
    for (int step = 3; step < 6; ++step) {
      const float loss = t.Step(comm, step);
      if (comm.rank() == 0) want.push_back(loss);
      absl::Status polled = t.saver->Poll();
      EXPECT_TRUE(polled.ok()) << polled;
    }
    absl::Status waited = t.saver->Wait();
    EXPECT_TRUE(waited.ok()) << waited;
    EXPECT_FALSE(t.saver->in_flight());
    EXPECT_GT(t.saver->last_times().written.count(), 0);
    EXPECT_TRUE(t.saver->Wait().ok());  // Reported once; nothing in flight.
  });
  ASSERT_TRUE(first.ok()) << first;
  for (int world : {2, 1}) {
    const GroupConnector load_connect = NewConnector();
    absl::Status second = RunOnThreadRanks(world, [&](Collectives& comm) {
      Trainer t(comm, load_connect);
      TrainState state;
      absl::Status loaded = LoadCheckpoint(dir, *t.fsdp, t.optimizer.get(), &state);
      ASSERT_TRUE(loaded.ok()) << loaded;
      EXPECT_EQ(state.step, 3);
      EXPECT_EQ(state.data_position, 96);
      EXPECT_EQ(state.labels["run_id"], "abc");
      for (int step = 3; step < 6; ++step) {
        const float loss = t.Step(comm, step);
        const float tolerance = world == 2 ? 0.0f : 1e-5f * std::abs(want[step - 3]);
        EXPECT_NEAR(loss, want[step - 3], tolerance) << "world " << world << " step " << step;
      }
    });
    ASSERT_TRUE(second.ok()) << second;
  }
}

// Holds each background write back until `release` returns true on the
// writer's thread (polled), for as long as a test lives.
class HoldWritesBack {
 public:
  explicit HoldWritesBack(std::function<bool()> release) {
    checkpoint_internal::SetBeforeBackgroundWriteForTesting([release] {
      while (!release()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    });
  }
  ~HoldWritesBack() { checkpoint_internal::SetBeforeBackgroundWriteForTesting(nullptr); }
};

// On the host the shards are written from where they are: the optimizer
// step after a save waits (at the end of backward) until they are written,
// so a write held back 300 ms still lands the state at Save, and training
// reports the time it waited.
TEST(AsyncCheckpointer, HoldsTheShardsUntilWritten) {
  const std::string dir = Dir("holds");
  const GroupConnector connect = NewConnector();
  std::atomic<bool> stepping{false};
  const auto since = std::make_shared<std::atomic<int64_t>>(0);
  HoldWritesBack held_back([&] {
    // 300 ms after a rank started the step that follows the save.
    if (!stepping.load()) return false;
    const int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
    int64_t zero = 0;
    since->compare_exchange_strong(zero, now);
    return now - since->load() > 300'000'000;
  });
  std::vector<float> want;
  absl::Status first = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm, connect);
    for (int step = 0; step < 3; ++step) t.Step(comm, step);
    ASSERT_TRUE(t.saver->Save(dir, *t.fsdp, t.optimizer.get(), TrainState{3}).ok());
    EXPECT_GT(t.saver->last_times().held_bytes, 0);
    stepping = true;
    for (int step = 3; step < 6; ++step) {
      const float loss = t.Step(comm, step);
      if (comm.rank() == 0) want.push_back(loss);
      EXPECT_TRUE(t.saver->Poll().ok());
    }
    absl::Status waited = t.saver->Wait();
    ASSERT_TRUE(waited.ok()) << waited;
    EXPECT_GT(t.saver->last_times().held.count(), 0);
  });
  ASSERT_TRUE(first.ok()) << first;
  const GroupConnector load_connect = NewConnector();
  absl::Status second = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm, load_connect);
    TrainState state;
    ASSERT_TRUE(LoadCheckpoint(dir, *t.fsdp, t.optimizer.get(), &state).ok());
    EXPECT_EQ(state.step, 3);
    for (int step = 3; step < 6; ++step) EXPECT_EQ(t.Step(comm, step), want[step - 3]);
  });
  ASSERT_TRUE(second.ok()) << second;
}

// A shard changed in place by hand while its write is held back would land
// a checkpoint of two steps: the save fails instead, on every rank at the
// same Poll, naming the tensor, and the checkpoint before it stays.
TEST(AsyncCheckpointer, AShardChangedByHandFailsTheSave) {
  const std::string dir = Dir("changed");
  const GroupConnector connect = NewConnector();
  std::atomic<int> changed{0};
  std::atomic<bool> holding{false};
  HoldWritesBack held_back([&] { return !holding.load() || changed.load() == 2; });
  absl::Status run = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm, connect);
    for (int step = 0; step < 2; ++step) t.Step(comm, step);
    ASSERT_TRUE(t.saver->Save(dir, *t.fsdp, t.optimizer.get(), TrainState{2}).ok());
    ASSERT_TRUE(t.saver->Wait().ok());
    t.Step(comm, 2);
    holding = true;
    ASSERT_TRUE(t.saver->Save(dir, *t.fsdp, t.optimizer.get(), TrainState{3}).ok());
    {
      at::NoGradGuard no_grad;
      UniqueParameters(*t.model).front().add_(1.0);
    }
    ++changed;
    absl::Status outcome;
    while (outcome.ok() && t.saver->in_flight()) outcome = t.saver->Poll();
    EXPECT_THAT(std::string(outcome.message()), HasSubstr("changed in place"));
    TrainState state;
    ASSERT_TRUE(LoadCheckpoint(dir, *t.fsdp, t.optimizer.get(), &state).ok());
    EXPECT_EQ(state.step, 2);
  });
  ASSERT_TRUE(run.ok()) << run;
}

// A save due while the one before is still writing waits for it; both land.
TEST(AsyncCheckpointer, OneSaveInFlight) {
  const GroupConnector connect = NewConnector();
  StateDict want;
  absl::Status run = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm, connect);
    t.Step(comm, 0);
    ASSERT_TRUE(t.saver->Save(Dir("first"), *t.fsdp, t.optimizer.get(), {1}).ok());
    ASSERT_TRUE(t.saver->Save(Dir("second"), *t.fsdp, t.optimizer.get(), {1}).ok());
    EXPECT_GE(t.saver->last_times().waited.count(), 0);
    EXPECT_EQ(t.saver->dir(), Dir("second"));
    // The destructor waits for the second.
    StateDict state = GetModelStateDict(*t.fsdp).value();
    if (comm.rank() == 0) want = state;
  });
  ASSERT_TRUE(run.ok()) << run;
  for (const char* name : {"first", "second"}) {
    const GroupConnector load_connect = NewConnector();
    absl::Status load = RunOnThreadRanks(2, [&](Collectives& comm) {
      Trainer t(comm, load_connect);
      TrainState state;
      absl::Status loaded = LoadCheckpoint(Dir(name), *t.fsdp, t.optimizer.get(), &state);
      ASSERT_TRUE(loaded.ok()) << name << ": " << loaded;
      EXPECT_EQ(state.step, 1);
      const StateDict got = GetModelStateDict(*t.fsdp).value();
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(at::equal(got[i].second, want[i].second)) << name << " " << got[i].first;
      }
    });
    ASSERT_TRUE(load.ok()) << load;
  }
}

// Refusals come back from Save itself, on every rank, and start nothing.
TEST(AsyncCheckpointer, RefusesAtSave) {
  const GroupConnector connect = NewConnector();
  absl::Status run = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm, connect);
    t.Step(comm, 0);
    CheckpointIoOptions hugging_face;
    hugging_face.format = CheckpointFormat::kHuggingFace;
    absl::Status refused = t.saver->Save(Dir("refused"), *t.fsdp, nullptr, {}, hugging_face);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(refused.message(), HasSubstr("SaveCheckpoint"));
    TrainState bad{1, 0, {{"has space", "x"}}};
    refused = t.saver->Save(Dir("refused"), *t.fsdp, t.optimizer.get(), bad);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_THAT(refused.message(), HasSubstr("has space"));
    EXPECT_FALSE(t.saver->in_flight());
    Net other;
    auto other_fsdp =
        FullyShardedModel::Wrap(other.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>()).value();
    refused = t.saver->Save(Dir("refused"), *other_fsdp);
    EXPECT_THAT(refused.message(), HasSubstr("not the one"));
  });
  ASSERT_TRUE(run.ok()) << run;
  EXPECT_FALSE(std::filesystem::exists(Dir("refused") + "/.metadata"));
}

// Under hybrid sharding one shard group writes and the other replica
// stages nothing; the checkpoint loads without hybrid sharding.
TEST(AsyncCheckpointer, HybridShardWritesOnce) {
  const std::string dir = Dir("hybrid");
  const HybridShardLayout layout = HybridShardLayout::Create(4, 2).value();
  const GroupConnector connect = NewConnector();
  StateDict want;
  absl::Status run = RunOnThreadRanks(4, [&](Collectives& world) {
    auto groups = CreateHybridShardCollectives(world.rank(), layout, "hybrid", connect);
    ASSERT_TRUE(groups.ok()) << groups.status();
    FsdpOptions options;
    options.strategy = ShardingStrategy::kHybridShard;
    ProcessGroups hybrid(*groups->shard);
    hybrid.replicate = groups->replicate.get();
    Trainer t(hybrid, connect, options);
    t.Step(world, 0);
    ASSERT_TRUE(t.saver->Save(dir, *t.fsdp, t.optimizer.get(), {1}).ok());
    const bool writes = groups->replicate->rank() == 0;
    EXPECT_EQ(t.saver->last_times().staged_bytes > 0, writes) << "rank " << world.rank();
    t.Step(world, 1);
    absl::Status waited = t.saver->Wait();
    EXPECT_TRUE(waited.ok()) << waited;
    // The state after step 1; the load below takes step 1 again.
    const StateDict state = GetModelStateDict(*t.fsdp).value();
    if (world.rank() == 0) want = state;
  });
  ASSERT_TRUE(run.ok()) << run;
  const GroupConnector load_connect = NewConnector();
  absl::Status load = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm, load_connect);
    ASSERT_TRUE(LoadCheckpoint(dir, *t.fsdp, t.optimizer.get()).ok());
    t.Step(comm, 1);  // The step taken after the save, again.
    const StateDict got = GetModelStateDict(*t.fsdp).value();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(at::allclose(got[i].second, want[i].second, 1e-5, 1e-6)) << got[i].first;
    }
  });
  ASSERT_TRUE(load.ok()) << load;
}

// The main job's SHARDED training checkpoint in the background loads as
// the blocking one does.
TEST(AsyncCheckpointer, ShardedTrainingCheckpoint) {
  const std::string dir = Dir("sharded");
  std::filesystem::create_directories(dir);
  const GroupConnector connect = NewConnector();
  StateDict want;
  absl::Status run = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm, connect);
    t.Step(comm, 0);
    ASSERT_TRUE(checkpoint_internal::SaveShardedInBackground(*t.saver, dir, *t.fsdp, *t.optimizer,
                                                             {{"step", "1"}})
                    .ok());
    const StateDict state = GetModelStateDict(*t.fsdp).value();
    if (comm.rank() == 0) want = state;
    t.Step(comm, 1);
    absl::Status waited = t.saver->Wait();
    EXPECT_TRUE(waited.ok()) << waited;
  });
  ASSERT_TRUE(run.ok()) << run;
  const GroupConnector load_connect = NewConnector();
  absl::Status load = RunOnThreadRanks(2, [&](Collectives& comm) {
    Trainer t(comm, load_connect);
    absl::Status loaded = LoadTrainingCheckpoint(*t.fsdp, *t.optimizer, dir);
    ASSERT_TRUE(loaded.ok()) << loaded;
    const StateDict got = GetModelStateDict(*t.fsdp).value();
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(at::equal(got[i].second, want[i].second)) << got[i].first;
    }
  });
  ASSERT_TRUE(load.ok()) << load;
}

// One rank's write fails in the background (its files may not grow past
// 512 bytes, as on a full disk): every rank learns it at the same Poll, the
// checkpoint that was in the directory is the one that loads, and nothing
// is left behind.
TEST(AsyncCheckpointer, FailedWriteReportedAtTheSameBoundaryOnEveryRank) {
  const std::string dir = Dir("failed");
  absl::Status run = RunOnProcessRanks(2, [&](Collectives& comm) {
    const LaunchEnvironment env = ReadLaunchEnvironment().value();
    Trainer t(comm, GlooConnectorFromEnvironment(env, LoopbackGloo()).value());
    t.Step(comm, 0);
    ASSERT_TRUE(t.saver->Save(dir, *t.fsdp, t.optimizer.get(), {1}).ok());
    ASSERT_TRUE(t.saver->Wait().ok());
    t.Step(comm, 1);
    if (comm.rank() == 1) {
      signal(SIGXFSZ, SIG_IGN);
      rlimit limit{512, 512};
      ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &limit), 0);
    }
    ASSERT_TRUE(t.saver->Save(dir, *t.fsdp, t.optimizer.get(), {2}).ok());
    absl::Status outcome;
    int boundary = 0;
    while (outcome.ok() && boundary < 200) {
      t.Step(comm, 2 + boundary % 3);
      ++boundary;
      outcome = t.saver->Poll();
      if (!t.saver->in_flight()) break;
    }
    EXPECT_FALSE(outcome.ok()) << "rank " << comm.rank();
    EXPECT_THAT(outcome.message(), HasSubstr("was not saved"));
    if (comm.rank() == 1) {
      EXPECT_THAT(outcome.message(), HasSubstr("File too large"));
    }
    at::Tensor mine = at::full({1}, static_cast<double>(boundary), at::kDouble);
    at::Tensor all = at::empty({2}, at::kDouble);
    comm.AllGatherIntoTensor(all, mine)->Wait();
    EXPECT_EQ(all[0].item<double>(), all[1].item<double>()) << "the ranks learned it apart";
    rlimit unlimited{RLIM_INFINITY, RLIM_INFINITY};
    setrlimit(RLIMIT_FSIZE, &unlimited);
    Trainer fresh(comm, GlooConnectorFromEnvironment(env, LoopbackGloo()).value(), {}, "fresh");
    TrainState state;
    absl::Status loaded = LoadCheckpoint(dir, *fresh.fsdp, fresh.optimizer.get(), &state);
    EXPECT_TRUE(loaded.ok()) << loaded;
    EXPECT_EQ(state.step, 1);
  });
  ASSERT_TRUE(run.ok()) << run;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    EXPECT_THAT(entry.path().filename().string(), ::testing::Not(HasSubstr(".tmp")));
  }
}

}  // namespace
}  // namespace fsdp
