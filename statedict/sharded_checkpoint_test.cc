#include "statedict/sharded_checkpoint.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/gloo_collectives.h"
#include "comm/hybrid_groups.h"
#include "formats/atomic_file.h"
#include "fsdp/shard_placement.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "statedict/state_dict.h"
#include "testing/multi_rank.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"

namespace fsdp {
namespace {

using ::fsdp::testing::Block;
using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::MakeOptimizer;
using ::fsdp::testing::Net;
using ::fsdp::testing::Optim;
using ::fsdp::testing::RunOnThreadRanks;
using ::fsdp::testing::Targets;
using ::testing::HasSubstr;

std::string NewDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
  mkdir(dir.c_str(), 0755);
  return dir;
}

// The shard files in `dir`, sorted (shard-0-..., shard-1-..., ...).
std::vector<std::string> ShardFiles(const std::string& dir) {
  std::vector<std::string> files;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return files;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (absl::StartsWith(name, "shard-") && absl::EndsWith(name, ".bin")) {
      files.push_back(dir + "/" + name);
    }
  }
  closedir(d);
  std::sort(files.begin(), files.end());
  return files;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size());
}

// Trains Net at W = 4 for a few steps, saves a SHARDED checkpoint, and
// returns the full state it saved.
StateDict TrainAndSave(const std::string& dir, ShardingStrategy strategy) {
  StateDict saved;
  absl::Status status = RunOnThreadRanks(4, [&](Collectives& comm) {
    Net model;
    FsdpOptions options;
    options.strategy = strategy;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    auto optimizer = MakeOptimizer(Optim::kAdam, model->parameters());
    const int64_t rows = kGlobalBatch / 4;
    for (int step = 0; step < 2; ++step) {
      at::mse_loss(model->forward(Inputs(step, 0).narrow(0, comm.rank() * rows, rows)),
                   Targets(step, 0).narrow(0, comm.rank() * rows, rows))
          .backward();
      optimizer->step();
      optimizer->zero_grad();
    }
    absl::Status saved_status =
        SaveShardedCheckpoint(**wrapped, dir, {{"saved_by", "TrainAndSave"}});
    ASSERT_TRUE(saved_status.ok()) << saved_status;
    auto full = FullStateDict(**wrapped);
    ASSERT_TRUE(full.ok());
    if (comm.rank() == 0) saved = *full;
  });
  EXPECT_TRUE(status.ok()) << status;
  return saved;
}

struct LoadCase {
  int world_size;
  ShardingStrategy strategy;
};

class ShardedCheckpointReshard : public ::testing::TestWithParam<LoadCase> {};

TEST_P(ShardedCheckpointReshard, SavedAtFourLoadsAtAnotherWorldSizeAndStrategy) {
  static const std::string dir = NewDir("reshard");
  static const StateDict saved = TrainAndSave(dir, ShardingStrategy::kFullShard);
  ASSERT_FALSE(saved.empty());
  const LoadCase c = GetParam();
  absl::Status status = RunOnThreadRanks(c.world_size, [&](Collectives& comm) {
    Net model;  // Fresh initialization: the checkpoint replaces it.
    FsdpOptions options;
    options.strategy = c.strategy;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    ShardedLoadStats stats;
    absl::Status loaded = LoadShardedCheckpoint(**wrapped, dir, &stats);
    ASSERT_TRUE(loaded.ok()) << loaded;
    EXPECT_GE(stats.bytes_read, stats.bytes_needed);
    auto full = FullStateDict(**wrapped);
    ASSERT_TRUE(full.ok());
    ASSERT_EQ(full->size(), saved.size());
    for (size_t k = 0; k < saved.size(); ++k) {
      EXPECT_EQ((*full)[k].first, saved[k].first);
      EXPECT_TRUE(at::equal((*full)[k].second, saved[k].second)) << saved[k].first;
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

std::string LoadCaseName(const ::testing::TestParamInfo<LoadCase>& info) {
  return absl::StrCat("W", info.param.world_size, "_", ShardingStrategyName(info.param.strategy));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ShardedCheckpointReshard,
    ::testing::Values(LoadCase{1, ShardingStrategy::kFullShard},
                      LoadCase{2, ShardingStrategy::kFullShard},
                      LoadCase{3, ShardingStrategy::kFullShard},
                      LoadCase{4, ShardingStrategy::kFullShard},
                      LoadCase{3, ShardingStrategy::kShardGradOp},
                      LoadCase{2, ShardingStrategy::kNoShard}),
    LoadCaseName);

TEST(ShardedCheckpoint, ReplicatedTensorsAreWrittenOnceAndNoShardUnitsRoundTrip) {
  const std::string dir = NewDir("no_shard");
  const StateDict saved = TrainAndSave(dir, ShardingStrategy::kNoShard);
  // Rank 0 holds every replicated tensor; the others' files are headers.
  const std::vector<std::string> files = ShardFiles(dir);
  ASSERT_EQ(files.size(), 4u);
  for (size_t r = 1; r < 4; ++r) EXPECT_EQ(ReadFile(files[r]).size(), 32u) << files[r];
  absl::Status status = RunOnThreadRanks(3, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    ASSERT_TRUE(LoadShardedCheckpoint(**wrapped, dir).ok());
    auto full = FullStateDict(**wrapped);
    for (size_t k = 0; k < saved.size(); ++k) {
      EXPECT_TRUE(at::equal((*full)[k].second, saved[k].second)) << saved[k].first;
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Two 4 MiB blocks: loading at W = 2 reads about half of the checkpoint.
struct BigNetImpl : torch::nn::Module, ShardableModule {
  BigNetImpl() {
    a = register_module("a", Block(1024, 1024, 0));
    b = register_module("b", Block(1024, 1024, 1));
  }
  Block a{nullptr}, b{nullptr};
};
TORCH_MODULE(BigNet);

// Under hybrid sharding (W = 4 as 2 x 2) both shard groups hold the same
// shards: one copy is written (by replicate rank 0), every rank returns
// after it, and the checkpoint loads at another layout.
TEST(ShardedCheckpoint, HybridShardingWritesOneCopyThatLoadsElsewhere) {
  const std::string dir = NewDir("hybrid");
  const HybridShardLayout layout = HybridShardLayout::Create(4, 2).value();
  auto store = c10::make_intrusive<c10d::HashStore>();
  StateDict saved;
  ASSERT_TRUE(RunOnThreadRanks(4, [&](Collectives& world) {
                GlooOptions gloo;
                gloo.hostname = "127.0.0.1";
                auto groups = CreateHybridShardCollectives(world.rank(), layout, gloo.group_name,
                                                           GlooGroupConnector(store, gloo));
                ASSERT_TRUE(groups.ok()) << groups.status();
                Net model;
                FsdpOptions options;
                options.strategy = ShardingStrategy::kHybridShard;
                ProcessGroups hybrid(*groups->shard);
                hybrid.replicate = groups->replicate.get();
                auto wrapped = FullyShardedModel::Wrap(model.ptr(), hybrid, options,
                                                       *ModuleTypePolicy::Of<BlockImpl>());
                ASSERT_TRUE(wrapped.ok()) << wrapped.status();
                auto optimizer = MakeOptimizer(Optim::kAdam, model->parameters());
                at::mse_loss(model->forward(Inputs(0, 0).narrow(0, world.rank() * 3, 3)),
                             Targets(0, 0).narrow(0, world.rank() * 3, 3))
                    .backward();
                optimizer->step();
                absl::Status status = SaveShardedCheckpoint(**wrapped, dir);
                ASSERT_TRUE(status.ok()) << status;
                // Every rank sees the finished checkpoint once Save returns.
                EXPECT_EQ(ShardFiles(dir).size(), 2u);
                auto full = FullStateDict(**wrapped);
                ASSERT_TRUE(full.ok());
                if (world.rank() == 0) saved = *full;
              }).ok());
  ASSERT_FALSE(saved.empty());
  ASSERT_TRUE(RunOnThreadRanks(3, [&](Collectives& comm) {
                Net model;
                auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, {},
                                                       *ModuleTypePolicy::Of<BlockImpl>());
                ASSERT_TRUE(wrapped.ok());
                absl::Status loaded = LoadShardedCheckpoint(**wrapped, dir);
                ASSERT_TRUE(loaded.ok()) << loaded;
                auto full = FullStateDict(**wrapped);
                ASSERT_TRUE(full.ok());
                ASSERT_EQ(full->size(), saved.size());
                for (size_t k = 0; k < saved.size(); ++k) {
                  EXPECT_TRUE(at::equal((*full)[k].second, saved[k].second)) << saved[k].first;
                }
              }).ok());
}

TEST(ShardedCheckpoint, EachRankReadsOnlyTheChunksItNeeds) {
  const std::string dir = NewDir("big");
  absl::Status saved = RunOnThreadRanks(4, [&](Collectives& comm) {
    BigNet model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    ASSERT_TRUE(SaveShardedCheckpoint(**wrapped, dir).ok());
  });
  ASSERT_TRUE(saved.ok()) << saved;
  int64_t total = 0;
  for (const std::string& f : ShardFiles(dir)) total += static_cast<int64_t>(ReadFile(f).size());
  absl::Status loaded = RunOnThreadRanks(2, [&](Collectives& comm) {
    BigNet model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    ShardedLoadStats stats;
    ASSERT_TRUE(LoadShardedCheckpoint(**wrapped, dir, &stats).ok());
    EXPECT_NEAR(static_cast<double>(stats.bytes_needed), total / 2.0, 0.01 * total);
    // Whole 1 MiB chunks around what it needs, plus the file headers.
    EXPECT_LE(stats.bytes_read, stats.bytes_needed + 4 * (1 << 20) + 4 * 32);
    EXPECT_LT(stats.bytes_read, total * 3 / 4) << "read far more than its half";
  });
  EXPECT_TRUE(loaded.ok()) << loaded;
}

// Runs a load at W = 2 that must fail on every rank with `message` and
// leave every shard bit-for-bit unchanged.
void ExpectLoadFails(const std::string& dir, const std::string& message) {
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    std::vector<at::Tensor> before;
    for (const auto& unit : (*wrapped)->units()) {
      before.push_back(UnitShard::Of(*unit).value().local().clone());
    }
    absl::Status loaded = LoadShardedCheckpoint(**wrapped, dir);
    ASSERT_FALSE(loaded.ok());
    EXPECT_THAT(loaded.message(), HasSubstr("nothing was loaded"));
    if (comm.rank() == 0 || !absl::StrContains(loaded.message(), "could not read")) {
      EXPECT_THAT(loaded.message(), HasSubstr(message));
    }
    for (size_t u = 0; u < before.size(); ++u) {
      EXPECT_TRUE(at::equal(before[u], UnitShard::Of(*(*wrapped)->units()[u]).value().local()));
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(ShardedCheckpoint, CorruptionIsDetectedAndNothingIsLoaded) {
  const std::string dir = NewDir("corrupt");
  TrainAndSave(dir, ShardingStrategy::kFullShard);
  const std::vector<std::string> files = ShardFiles(dir);
  ASSERT_EQ(files.size(), 4u);
  const std::string shard0 = ReadFile(files[0]);

  // A flipped byte inside rank 0's first piece.
  std::string flipped = shard0;
  flipped[40] = static_cast<char>(flipped[40] ^ 0x01);
  WriteFile(files[0], flipped);
  ExpectLoadFails(dir, "fails its CRC-32 check");

  // Truncated.
  WriteFile(files[0], shard0.substr(0, shard0.size() - 3));
  ExpectLoadFails(dir, "the manifest records");

  // Missing.
  WriteFile(files[0], shard0);
  ASSERT_EQ(rename(files[0].c_str(), (files[0] + ".away").c_str()), 0);
  ExpectLoadFails(dir, "cannot be opened");
  ASSERT_EQ(rename((files[0] + ".away").c_str(), files[0].c_str()), 0);

  // A shard file of another checkpoint in its place.
  const std::string other = NewDir("corrupt_other");
  TrainAndSave(other, ShardingStrategy::kFullShard);
  WriteFile(files[0], ReadFile(ShardFiles(other)[0]));
  ExpectLoadFails(dir, "does not belong to this checkpoint");
  WriteFile(files[0], shard0);

  // No manifest: an interrupted save, or no checkpoint at all.
  const std::string manifest = ReadFile(dir + "/manifest.pb");
  unlink((dir + "/manifest.pb").c_str());
  ExpectLoadFails(dir, "manifest.pb is missing");
  EXPECT_EQ(ReadCheckpointMetadata(dir).status().code(), absl::StatusCode::kNotFound);
  WriteFile(dir + "/manifest.pb", "garbage");
  ExpectLoadFails(dir, "is corrupt: it is not a fsdp_cpp.sharded.v1 manifest");
  // A flipped byte inside the manifest is the manifest's fault, not a shard
  // file's or the model's: every byte position is caught by its checksum.
  for (size_t at : {size_t{2}, size_t{9}, manifest.size() / 2, manifest.size() - 1}) {
    SCOPED_TRACE(at);
    std::string damaged = manifest;
    damaged[at] = static_cast<char>(damaged[at] ^ 0x10);
    WriteFile(dir + "/manifest.pb", damaged);
    ExpectLoadFails(dir, "/manifest.pb' is corrupt");
    const absl::StatusOr<CheckpointMetadata> metadata = ReadCheckpointMetadata(dir);
    EXPECT_EQ(metadata.status().code(), absl::StatusCode::kDataLoss);
  }
  WriteFile(dir + "/manifest.pb", manifest);
  const absl::StatusOr<CheckpointMetadata> metadata = ReadCheckpointMetadata(dir);
  ASSERT_TRUE(metadata.ok()) << metadata.status();
  EXPECT_EQ(*metadata, (CheckpointMetadata{{"saved_by", "TrainAndSave"}}));

  // Intact again: it loads.
  absl::Status ok = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    EXPECT_TRUE(LoadShardedCheckpoint(**wrapped, dir).ok());
  });
  EXPECT_TRUE(ok.ok()) << ok;
}

// A model with other names and shapes than the checkpoint's.
struct OtherNetImpl : torch::nn::Module, ShardableModule {
  OtherNetImpl() {
    blocks = register_module("blocks", torch::nn::ModuleList(Block(7, 13, 0), Block(13, 4, 1)));
    tail = register_module("tail", torch::nn::Linear(4, 5));
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear tail{nullptr};
};
TORCH_MODULE(OtherNet);

TEST(ShardedCheckpoint, ACheckpointOfAnotherModelIsRefusedListingEveryDifference) {
  const std::string dir = NewDir("other_model");
  TrainAndSave(dir, ShardingStrategy::kFullShard);
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    OtherNet model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    absl::Status loaded = LoadShardedCheckpoint(**wrapped, dir);
    ASSERT_FALSE(loaded.ok());
    const std::string message(loaded.message());
    EXPECT_THAT(message, HasSubstr("does not fit this model"));
    EXPECT_THAT(message, HasSubstr("'blocks.1.fc.weight' has shape [11, 13], the model's is "
                                   "[4, 13]"));
    EXPECT_THAT(message, HasSubstr("missing: tail.weight, tail.bias"));
    EXPECT_THAT(message, HasSubstr("not in the model: blocks.2.fc.weight, blocks.2.fc.bias, "
                                   "head.weight, head.bias"));
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(ShardedCheckpoint, AFailedSaveFailsOnEveryRankAndWritesNoManifest) {
  const std::string dir = NewDir("failed_save") + "/does/not/exist";
  absl::Status status = RunOnThreadRanks(3, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    absl::Status saved = SaveShardedCheckpoint(**wrapped, dir);
    ASSERT_FALSE(saved.ok());
    EXPECT_THAT(saved.message(), HasSubstr("was not saved (no manifest written)"));
    if (comm.rank() == 0) {
      EXPECT_THAT(saved.message(), HasSubstr("rank 2: cannot create"));
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A rank whose write throws (a tensor without data here; out of memory or
// a device error alike) still reaches the save's collectives: every rank
// returns the failure instead of waiting for it, and no manifest is
// written.
TEST(ShardedCheckpoint, ARankWhoseWriteThrowsFailsTheSaveOnEveryRankWithoutAHang) {
  const std::string dir = NewDir("throwing_save");
  absl::Status status = RunOnThreadRanks(3, [&](Collectives& comm) {
    CheckpointTensor t;
    t.fqn = "w";
    t.shape = {6};
    t.sharded = true;
    t.lo = 2 * comm.rank();
    t.hi = t.lo + 2;
    t.local = comm.rank() == 1 ? at::empty({2}, at::TensorOptions().device(at::kMeta))
                               : at::ones({2});
    absl::Status saved = SaveCheckpointTensors(comm, dir, {t}, {});
    ASSERT_FALSE(saved.ok()) << "rank " << comm.rank();
    EXPECT_THAT(saved.message(), HasSubstr("was not saved (no manifest written)"));
    if (comm.rank() == 0) EXPECT_THAT(saved.message(), HasSubstr("rank 1: "));
  });
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_NE(access((dir + "/manifest.pb").c_str(), F_OK), 0);
}

// The temporary files a killed save left (no live writer holds them) are
// removed by the next save of the directory; another writer's, still
// open, is not.
TEST(ShardedCheckpoint, TheNextSaveRemovesTheTempFilesOfAKilledOne) {
  const std::string dir = NewDir("killed_save_leftovers");
  const std::string left = dir + "/shard-1-of-2-00000000000000ab.bin.tmp-999999-0";
  std::ofstream(left) << "half a shard";
  absl::StatusOr<AtomicFileWriter> live = AtomicFileWriter::Open(dir + "/notes.txt");
  ASSERT_TRUE(live.ok()) << live.status();
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    ASSERT_TRUE(SaveShardedCheckpoint(**wrapped, dir).ok());
  });
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_NE(access(left.c_str(), F_OK), 0) << "the killed save's file is still there";
  int temporaries = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    temporaries += entry.path().filename().string().find(".tmp-") != std::string::npos;
  }
  EXPECT_EQ(temporaries, 1) << "the live writer's file should stay";
  EXPECT_TRUE(live->Write("x", 1).ok());
  EXPECT_TRUE(live->Commit().ok());
}

}  // namespace
}  // namespace fsdp
