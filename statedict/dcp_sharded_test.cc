#include "statedict/dcp_sharded.h"

#include <dirent.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/gloo_collectives.h"
#include "comm/hybrid_groups.h"
#include "formats/dcp.h"
#include "formats/torch_file.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "statedict/state_dict.h"
#include "testing/multi_rank.h"
#include "testing/torch_python.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"
#include "torch/nn/modules/linear.h"
#include "torch/nn/modules/normalization.h"

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
using ::testing::HasSubstr;

constexpr char kScript[] = "formats/dcp_interop.py";
constexpr char kFixtures[] = "formats/testdata/dcp";
constexpr int kNoDcp = 3;  // dcp_interop.py's exit status when torch has no DCP.

std::string NewDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
  EXPECT_EQ(std::system(absl::StrCat("rm -rf '", dir, "' && mkdir -p '", dir, "'").c_str()), 0);
  return dir;
}

std::vector<std::string> DataFiles(const std::string& dir) {
  std::vector<std::string> files;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      if (absl::EndsWith(e->d_name, ".distcp")) files.push_back(e->d_name);
    }
    closedir(d);
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void ExpectSameState(const StateDict& got, const StateDict& expected) {
  ASSERT_EQ(got.size(), expected.size());
  for (size_t k = 0; k < expected.size(); ++k) {
    SCOPED_TRACE(expected[k].first);
    EXPECT_EQ(got[k].first, expected[k].first);
    EXPECT_TRUE(at::equal(got[k].second, expected[k].second));
  }
}

// Every box of every range of small tensors: in order, each the flat
// elements it claims, together exactly the range, and few.
TEST(DcpBoxes, TheBoxesOfAFlatRangeAreItsElementsInOrder) {
  const std::vector<std::vector<int64_t>> shapes = {{}, {5}, {3, 4}, {2, 3, 4}, {2, 1, 3, 2}};
  for (const std::vector<int64_t>& shape : shapes) {
    const at::Tensor index =
        at::arange(at::IntArrayRef(shape).empty() ? 1 : at::empty(shape).numel(), at::kLong)
            .view(shape);
    const int64_t numel = index.numel();
    for (int64_t lo = 0; lo <= numel; ++lo) {
      for (int64_t hi = lo; hi <= numel; ++hi) {
        SCOPED_TRACE(absl::StrCat("shape of ", shape.size(), " dims, [", lo, ", ", hi, ")"));
        const std::vector<DcpBox> boxes = DcpBoxesOfFlatRange(shape, lo, hi);
        int64_t next = lo;
        for (const DcpBox& box : boxes) {
          ASSERT_EQ(box.flat_begin, next);
          at::Tensor elements = index;
          for (size_t d = 0; d < shape.size(); ++d) {
            elements = elements.narrow(static_cast<int64_t>(d), box.offsets[d], box.sizes[d]);
          }
          ASSERT_TRUE(at::equal(elements.reshape({-1}),
                                at::arange(next, next + elements.numel(), at::kLong)));
          next += elements.numel();
        }
        EXPECT_EQ(next, hi);
        if (!shape.empty()) EXPECT_LE(boxes.size(), 2 * shape.size() - 1);
      }
    }
  }
}

// The model FSDP2 saved in testdata/dcp/fsdp2_w2: Sequential(Linear(6, 5),
// ReLU, Linear(5, 3), LayerNorm(3)).
struct SequentialLikeImpl : torch::nn::Module, ShardableModule {
  SequentialLikeImpl() {
    register_module("0", torch::nn::Linear(6, 5));
    register_module("2", torch::nn::Linear(5, 3));
    register_module("3", torch::nn::LayerNorm(torch::nn::LayerNormOptions({3})));
  }
};
TORCH_MODULE(SequentialLike);

// FSDP2 wrote rows of each tensor per rank; our flat shards cut across
// them at any world size, and each rank reads only the chunks it meets.
TEST(ShardedDcp, Fsdp2sRowChunksLoadIntoFlatShardsAtAnyWorldSize) {
  const std::string dir = absl::StrCat(kFixtures, "/fsdp2_w2");
  auto expected = LoadTorchStateDict(dir + "/expected.pt");
  ASSERT_TRUE(expected.ok()) << expected.status();
  int64_t stored = 0;
  for (const std::string& file : DataFiles(dir + "/ckpt")) {
    stored += static_cast<int64_t>(ReadFile(dir + "/ckpt/" + file).size());
  }
  for (int world : {1, 2, 3}) {
    SCOPED_TRACE(absl::StrCat("W = ", world));
    absl::Status status = RunOnThreadRanks(world, [&](Collectives& comm) {
      SequentialLike model;
      auto wrapped =
          FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
      ASSERT_TRUE(wrapped.ok()) << wrapped.status();
      ShardedLoadStats stats;
      absl::Status loaded = LoadShardedDcpModel(**wrapped, dir + "/ckpt", "", &stats);
      ASSERT_TRUE(loaded.ok()) << loaded;
      EXPECT_GE(stats.bytes_read, stats.bytes_needed);
      if (world == 3) {
        EXPECT_LT(stats.bytes_read, stored);  // Not every chunk.
      }
      auto full = FullStateDict(**wrapped);
      ASSERT_TRUE(full.ok()) << full.status();
      if (comm.rank() == 0) ExpectSameState(*full, *expected);
    });
    EXPECT_TRUE(status.ok()) << status;
  }
}

// Trains Net at W = 3 and saves its model as a sharded DCP under "model";
// returns the FULL state it saved.
StateDict TrainAndSave(const std::string& dir) {
  StateDict saved;
  absl::Status status = RunOnThreadRanks(3, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
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
    absl::Status saved_status = SaveShardedDcpModel(**wrapped, dir, "model");
    ASSERT_TRUE(saved_status.ok()) << saved_status;
    auto full = FullStateDict(**wrapped);
    ASSERT_TRUE(full.ok());
    if (comm.rank() == 0) saved = *full;
  });
  EXPECT_TRUE(status.ok()) << status;
  return saved;
}

TEST(ShardedDcp, EachRankWritesItsShardsAndTheCheckpointLoadsAtAnyWorldSize) {
  const std::string dir = NewDir("sharded_dcp");
  const StateDict saved = TrainAndSave(dir + "/ckpt");
  ASSERT_FALSE(saved.empty());
  // One data file per rank, each holding that rank's chunks.
  const std::vector<std::string> files = DataFiles(dir + "/ckpt");
  ASSERT_EQ(files.size(), 3u);
  auto metadata = ReadDcpMetadata(dir + "/ckpt");
  ASSERT_TRUE(metadata.ok()) << metadata.status();
  std::set<std::string> written_by;
  for (const DcpTensorEntry& tensor : metadata->tensors) {
    for (const DcpChunk& chunk : tensor.chunks) written_by.insert(chunk.location.relative_path);
  }
  EXPECT_EQ(written_by.size(), 3u);
  // One reader of the whole: the same state.
  auto whole = LoadDcpStateDict(dir + "/ckpt", "model.");
  ASSERT_TRUE(whole.ok()) << whole.status();
  ExpectSameState(*whole, saved);

  for (int world : {1, 2, 3, 4}) {
    SCOPED_TRACE(absl::StrCat("W = ", world));
    absl::Status status = RunOnThreadRanks(world, [&](Collectives& comm) {
      Net model;  // Fresh: the checkpoint replaces it.
      auto wrapped =
          FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
      ASSERT_TRUE(wrapped.ok());
      ShardedLoadStats stats;
      absl::Status loaded = LoadShardedDcpModel(**wrapped, dir + "/ckpt", "model", &stats);
      ASSERT_TRUE(loaded.ok()) << loaded;
      auto full = FullStateDict(**wrapped);
      ASSERT_TRUE(full.ok());
      if (comm.rank() == 0) ExpectSameState(*full, saved);
    });
    EXPECT_TRUE(status.ok()) << status;
  }
  // PyTorch's dcp.load reads it too.
  ASSERT_TRUE(SaveTorchStateDict(dir + "/expected.pt", saved).ok());
  const int python = std::system(absl::StrCat("timeout 120 ", ::fsdp::testing::TorchPython(), " ",
                                              kScript, " check_load '", dir, "' model")
                                     .c_str());
  ASSERT_TRUE(WIFEXITED(python));
  if (WEXITSTATUS(python) == kNoDcp) GTEST_SKIP() << "this torch cannot read DCP checkpoints";
  EXPECT_EQ(WEXITSTATUS(python), 0);
}

// Two 4 MiB blocks: at the world size that wrote it, a rank reads its own
// chunks and nothing else.
struct BigNetImpl : torch::nn::Module, ShardableModule {
  BigNetImpl() {
    a = register_module("a", testing::Block(1024, 1024, 0));
    b = register_module("b", testing::Block(1024, 1024, 1));
  }
  testing::Block a{nullptr}, b{nullptr};
};
TORCH_MODULE(BigNet);

TEST(ShardedDcp, AtTheSameWorldSizeARankReadsOnlyItsOwnChunks) {
  const std::string dir = NewDir("sharded_dcp_big") + "/ckpt";
  for (int pass = 0; pass < 2; ++pass) {
    absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
      BigNet model;
      auto wrapped =
          FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
      ASSERT_TRUE(wrapped.ok());
      if (pass == 0) {
        ASSERT_TRUE(SaveShardedDcpModel(**wrapped, dir).ok());
        return;
      }
      ShardedLoadStats stats;
      ASSERT_TRUE(LoadShardedDcpModel(**wrapped, dir, "model", &stats).ok());
      // Half of 2 x (4 MiB + 4 KiB), plus each chunk's archive framing.
      EXPECT_EQ(stats.bytes_needed, (1024 * 1024 + 1024) * 4);
      EXPECT_GE(stats.bytes_read, stats.bytes_needed);
      EXPECT_LT(stats.bytes_read, stats.bytes_needed + 16 * 1024);
      std::printf("rank %d read %lld bytes for %lld it needed\n", comm.rank(),
                  static_cast<long long>(stats.bytes_read),
                  static_cast<long long>(stats.bytes_needed));
    });
    ASSERT_TRUE(status.ok()) << status;
  }
}

// Under hybrid sharding (W = 4 as 2 x 2) the two shard groups hold the same
// shards: one group writes (two data files), every rank returns once it
// has, and the checkpoint loads at another layout.
TEST(ShardedDcp, HybridShardingWritesOneCopyThatLoadsElsewhere) {
  const std::string dir = NewDir("sharded_dcp_hybrid") + "/ckpt";
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
                absl::Status status = SaveShardedDcpModel(**wrapped, dir);
                ASSERT_TRUE(status.ok()) << status;
                EXPECT_EQ(DataFiles(dir).size(), 2u);
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
                absl::Status loaded = LoadShardedDcpModel(**wrapped, dir);
                ASSERT_TRUE(loaded.ok()) << loaded;
                auto full = FullStateDict(**wrapped);
                ASSERT_TRUE(full.ok());
                if (comm.rank() == 0) ExpectSameState(*full, saved);
              }).ok());
}

// A rank that cannot read its part leaves every rank's model as it was.
TEST(ShardedDcp, ARankThatCannotReadItsPartLoadsNothingAnywhere) {
  const std::string dir = NewDir("sharded_dcp_lost");
  ASSERT_FALSE(TrainAndSave(dir + "/ckpt").empty());
  auto metadata = ReadDcpMetadata(dir + "/ckpt");
  ASSERT_TRUE(metadata.ok());
  // Rank 2's file is lost; at W = 3 only rank 2 needs it.
  std::string lost;
  for (const std::string& file : DataFiles(dir + "/ckpt")) {
    if (absl::StartsWith(file, "__2_")) lost = file;
  }
  ASSERT_FALSE(lost.empty());
  ASSERT_EQ(unlink((dir + "/ckpt/" + lost).c_str()), 0);
  absl::Status status = RunOnThreadRanks(3, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    auto before = FullStateDict(**wrapped);
    ASSERT_TRUE(before.ok());
    absl::Status loaded = LoadShardedDcpModel(**wrapped, dir + "/ckpt");
    ASSERT_FALSE(loaded.ok());
    if (comm.rank() == 2) {
      EXPECT_THAT(loaded.message(), HasSubstr(lost));
    } else {
      EXPECT_THAT(loaded.message(), HasSubstr("nothing was loaded: rank(s) 2 could not load"));
    }
    auto after = FullStateDict(**wrapped);
    ASSERT_TRUE(after.ok());
    ExpectSameState(*after, *before);
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A save that fails on one rank fails on every rank and leaves the
// checkpoint that was there whole, with no new data files beside it.
TEST(ShardedDcp, ASaveThatFailsOnOneRankKeepsTheCheckpointThatWasThere) {
  const std::string dir = NewDir("sharded_dcp_failed_save") + "/ckpt";
  const StateDict saved = TrainAndSave(dir);
  const std::string metadata_before = ReadFile(dir + "/.metadata");
  const std::vector<std::string> files_before = DataFiles(dir);
  absl::Status status = RunOnThreadRanks(3, [&](Collectives& comm) {
    DcpTensorShard t;
    t.path = {{false, "model", 0}, {false, "w", 0}};
    t.shape = {6};
    t.sharded = true;
    t.lo = 2 * comm.rank();
    t.hi = t.lo + 2;
    // Rank 1 holds the wrong number of elements.
    t.local = at::ones({comm.rank() == 1 ? 3 : 2});
    absl::Status result = SaveShardedDcp(comm, dir, {t});
    ASSERT_FALSE(result.ok());
    EXPECT_THAT(result.message(), HasSubstr("was not saved (the one there is unchanged)"));
    EXPECT_THAT(result.message(), HasSubstr("rank 1: 'model.w': this rank's part holds 3"));
  });
  EXPECT_TRUE(status.ok()) << status;
  // Ranks that pass different tensors (here another name on rank 2).
  status = RunOnThreadRanks(3, [&](Collectives& comm) {
    DcpTensorShard t;
    t.path = {{false, "model", 0}, {false, comm.rank() == 2 ? "v" : "w", 0}};
    t.shape = {6};
    t.sharded = true;
    t.lo = 2 * comm.rank();
    t.hi = t.lo + 2;
    t.local = at::ones({2});
    absl::Status result = SaveShardedDcp(comm, dir, {t});
    ASSERT_FALSE(result.ok());
    EXPECT_THAT(result.message(), HasSubstr("rank 2 passed other tensors than rank 0"));
  });
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(ReadFile(dir + "/.metadata"), metadata_before);
  EXPECT_EQ(DataFiles(dir), files_before);
  auto whole = LoadDcpStateDict(dir, "model.");
  ASSERT_TRUE(whole.ok()) << whole.status();
  ExpectSameState(*whole, saved);
}

// A checkpoint of another model is refused by name, and nothing changes.
TEST(ShardedDcp, ACheckpointOfAnotherModelIsRefusedNamingWhatDiffers) {
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok());
    absl::Status loaded =
        LoadShardedDcpModel(**wrapped, absl::StrCat(kFixtures, "/fsdp2_w2/ckpt"), "");
    ASSERT_FALSE(loaded.ok());
    EXPECT_THAT(loaded.message(), HasSubstr("'blocks.0.fc.weight' is missing"));
  });
  EXPECT_TRUE(status.ok()) << status;
}

}  // namespace
}  // namespace fsdp
