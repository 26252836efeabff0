#include "formats/dcp.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "formats/torch_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "launch/local_launcher.h"
#include "testing/torch_python.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;

constexpr char kScript[] = "formats/dcp_interop.py";
constexpr char kFixtures[] = "formats/testdata/dcp";
constexpr int kNoDcp = 3;  // dcp_interop.py's exit status when torch has no DCP.

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

int RunShell(const std::string& command) {
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int RunPython(const std::string& mode, const std::string& dir) {
  return RunShell(absl::StrCat("timeout 120 ", ::fsdp::testing::TorchPython(), " ", kScript, " ",
                               mode, " '", dir, "'"));
}

// Each tensor of `loaded` equals the one of the same name in `expected`
// (same order, dtype and values).
void ExpectSameState(const StateDict& loaded, const StateDict& expected) {
  ASSERT_EQ(loaded.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    SCOPED_TRACE(expected[i].first);
    EXPECT_EQ(loaded[i].first, expected[i].first);
    EXPECT_EQ(loaded[i].second.scalar_type(), expected[i].second.scalar_type());
    EXPECT_TRUE(at::equal(loaded[i].second, expected[i].second));
  }
}

void ExpectPlainCheckpoint(const std::string& dir) {
  auto metadata = ReadDcpMetadata(dir + "/ckpt");
  ASSERT_TRUE(metadata.ok()) << metadata.status();
  ASSERT_EQ(metadata->tensors.size(), 5u);
  EXPECT_EQ(metadata->tensors[0].fqn, "layer.weight");
  EXPECT_EQ(metadata->tensors[0].size, (std::vector<int64_t>{5, 7}));
  EXPECT_EQ(metadata->tensors[2].dtype, at::kBFloat16);
  EXPECT_TRUE(metadata->tensors[4].size.empty());  // A 0-d tensor.
  ASSERT_EQ(metadata->bytes.size(), 1u);
  EXPECT_EQ(metadata->bytes[0].fqn, "step");

  auto loaded = LoadDcpStateDict(dir + "/ckpt");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto expected = LoadTorchStateDict(dir + "/expected.pt");
  ASSERT_TRUE(expected.ok()) << expected.status();
  ExpectSameState(*loaded, *expected);

  auto layer = LoadDcpStateDict(dir + "/ckpt", "layer.");
  ASSERT_TRUE(layer.ok()) << layer.status();
  ASSERT_EQ(layer->size(), 2u);
  EXPECT_EQ((*layer)[1].first, "bias");
  EXPECT_THAT(LoadDcpStateDict(dir + "/ckpt", "model.").status().message(),
              HasSubstr("has no tensor under 'model.' (its tensors start: layer.weight"));
}

// FSDP2 shards every parameter on dim 0: W = 2 leaves two chunks each.
void ExpectFsdp2Checkpoint(const std::string& dir) {
  auto metadata = ReadDcpMetadata(dir + "/ckpt");
  ASSERT_TRUE(metadata.ok()) << metadata.status();
  ASSERT_EQ(metadata->tensors.size(), 6u);
  const DcpTensorEntry& weight = metadata->tensors[0];
  EXPECT_EQ(weight.fqn, "0.weight");
  EXPECT_EQ(weight.size, (std::vector<int64_t>{5, 6}));
  ASSERT_EQ(weight.chunks.size(), 2u);
  EXPECT_EQ(weight.chunks[0].offsets, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(weight.chunks[1].offsets, (std::vector<int64_t>{3, 0}));
  EXPECT_NE(weight.chunks[0].location.relative_path, weight.chunks[1].location.relative_path);

  auto loaded = LoadDcpStateDict(dir + "/ckpt");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto expected = LoadTorchStateDict(dir + "/expected.pt");
  ASSERT_TRUE(expected.ok()) << expected.status();
  ExpectSameState(*loaded, *expected);

  // Elements 8-25 of 0.weight (rows 1-4, as a flat shard cuts them) span
  // both ranks' chunks; as a sharded load at W = 3 would ask for them.
  auto part = ReadDcpFlatRange(dir + "/ckpt", weight, 8, 26);
  ASSERT_TRUE(part.ok()) << part.status();
  EXPECT_TRUE(at::equal(*part, (*expected)[0].second.reshape({-1}).narrow(0, 8, 18)));
}

TEST(Dcp, ReadsAPlainCheckpointPythonWrote) {
  ExpectPlainCheckpoint(absl::StrCat(kFixtures, "/plain"));
}

// Python 3.12 pickles enum members by value and 3.13 names pathlib's
// classes pathlib._local.*: the same checkpoint, pickled that way.
TEST(Dcp, ReadsMetadataPickledAsNewerPythonsDo) {
  auto loaded = LoadDcpStateDict(absl::StrCat(kFixtures, "/newer_python"));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto expected = LoadTorchStateDict(absl::StrCat(kFixtures, "/plain/expected.pt"));
  ASSERT_TRUE(expected.ok()) << expected.status();
  ExpectSameState(*loaded, *expected);
}

TEST(Dcp, ReadsAnFsdp2CheckpointWrittenAtW2) {
  ExpectFsdp2Checkpoint(absl::StrCat(kFixtures, "/fsdp2_w2"));
}

// The fixtures above were written by torch 2.15; this torch writes fresh
// ones when it can (plain, and FSDP2 on two ranks started by our launcher).
TEST(Dcp, ReadsCheckpointsThisTorchWrites) {
  const std::string dir = TempDir() + "/dcp_fresh";
  ASSERT_EQ(RunShell(absl::StrCat("rm -rf '", dir, "' && mkdir -p '", dir, "'")), 0);
  const int plain = RunPython("write_plain", dir + "/plain");
  if (plain == kNoDcp) GTEST_SKIP() << "this torch cannot write DCP checkpoints";
  ASSERT_EQ(plain, 0);
  ExpectPlainCheckpoint(dir + "/plain");

  LocalLaunchOptions launch;
  launch.nproc_per_node = 2;
  launch.program = ::fsdp::testing::TorchPython();
  launch.args = {kScript, "write_fsdp2", dir + "/fsdp2"};
  launch.log_dir = dir;
  launch.timeout = std::chrono::minutes(2);
  absl::StatusOr<LaunchResult> launched = LaunchLocalRanks(launch);
  ASSERT_TRUE(launched.ok()) << launched.status();
  ASSERT_TRUE(launched->ok()) << launched->Summary();
  ExpectFsdp2Checkpoint(dir + "/fsdp2");
}

std::string CopyFixture(const std::string& name) {
  const std::string to = absl::StrCat(TempDir(), "/", name);
  EXPECT_EQ(
      RunShell(absl::StrCat("rm -rf '", to, "' && cp -rL '", kFixtures, "/", name, "' '", to, "'")),
      0);
  return to;
}

TEST(Dcp, AFlatRangeReadsOnlyTheChunksThatHoldIt) {
  const std::string dir = CopyFixture("fsdp2_w2");
  auto metadata = ReadDcpMetadata(dir + "/ckpt");
  ASSERT_TRUE(metadata.ok()) << metadata.status();
  const DcpTensorEntry& weight = metadata->tensors[0];
  // Rank 1's data file is lost: rank 0's rows still load, all rows do not.
  const std::string rank1_file = weight.chunks[1].location.relative_path;
  std::ofstream(dir + "/ckpt/" + rank1_file, std::ios::trunc).close();
  int64_t bytes_read = 0;
  auto own_rows = ReadDcpFlatRange(dir + "/ckpt", weight, 0, 18, &bytes_read);
  ASSERT_TRUE(own_rows.ok()) << own_rows.status();
  EXPECT_EQ(bytes_read, static_cast<int64_t>(weight.chunks[0].location.length));
  auto all_rows = LoadDcpStateDict(dir + "/ckpt");
  ASSERT_FALSE(all_rows.ok());
  EXPECT_THAT(all_rows.status().message(), HasSubstr(rank1_file));
}

TEST(Dcp, MetadataThatLiesIsRefusedNamingTheProblem) {
  const std::string bad = absl::StrCat(kFixtures, "/bad/");
  const struct {
    const char* name;
    const char* error;
  } cases[] = {
      {"outside",
       "a chunk of 'layer.weight' at [0, 0] of size [6, 7] lies outside its size [5, 7]"},
      {"overlap", "two chunks of 'layer.weight' overlap (at [0, 0] and [2, 0])"},
      {"escape", "the data file of 'layer.bias' is not a file name inside the checkpoint"},
      {"missing", "'counts' has no storage entry for its chunk at [0]"},
      {"transformed", "'layer.bias' is stored through transforms [stream_zstd]"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto loaded = LoadDcpStateDict(bad + c.name);
    ASSERT_FALSE(loaded.ok());
    EXPECT_THAT(loaded.status().message(), HasSubstr(c.error));
    EXPECT_THAT(loaded.status().message(), HasSubstr("DCP checkpoint '" + bad + c.name + "'"));
  }
}

TEST(Dcp, AChunkCutShortIsRefusedNamingItsFile) {
  const std::string dir = CopyFixture("plain");
  // The data file ends inside layer.bias's chunk.
  auto metadata = ReadDcpMetadata(dir + "/ckpt");
  ASSERT_TRUE(metadata.ok()) << metadata.status();
  const DcpStorageLocation& bias = metadata->tensors[1].chunks[0].location;
  ASSERT_EQ(truncate((dir + "/ckpt/" + bias.relative_path).c_str(),
                     static_cast<off_t>(bias.offset + bias.length / 2)),
            0);
  auto loaded = LoadDcpStateDict(dir + "/ckpt");
  ASSERT_FALSE(loaded.ok());
  EXPECT_THAT(loaded.status().message(), HasSubstr(bias.relative_path));
}

TEST(Dcp, AMetadataPickleThatWouldRunACommandIsRefusedAndNothingRuns) {
  const std::string dir = TempDir() + "/dcp_malicious";
  ASSERT_EQ(RunShell(absl::StrCat("rm -rf '", dir, "'")), 0);
  ASSERT_EQ(RunPython("write_malicious", dir), 0);
  auto metadata = ReadDcpMetadata(dir);
  ASSERT_FALSE(metadata.ok());
  EXPECT_THAT(metadata.status().message(),
              HasSubstr("the metadata names posix.system, which DCP's metadata never holds"));
  EXPECT_FALSE(LoadDcpStateDict(dir).ok());
  EXPECT_FALSE(Exists(dir + "/ran"));
  // The file is a real threat: Python's own unpickler runs it.
  ASSERT_EQ(RunShell(absl::StrCat("timeout 60 ", ::fsdp::testing::TorchPython(),
                                  " -c \"import pickle; pickle.load(open('", dir,
                                  "/.metadata', 'rb'))\"")),
            0);
  EXPECT_TRUE(Exists(dir + "/ran"));
}

DcpItem ItemOf(const std::string& name, at::Tensor value) {
  DcpItem item;
  item.path = {DcpPathPart{false, name, 0}};
  item.value = std::move(value);
  return item;
}

std::vector<std::string> TensorNames(const DcpMetadata& metadata) {
  std::vector<std::string> names;
  for (const DcpTensorEntry& t : metadata.tensors) names.push_back(t.fqn);
  return names;
}

// ReadDcpMetadata keeps the last .metadata it parsed: a checkpoint saved
// over it, or a .metadata rewritten in place (even at the same size, within
// the file system's timestamp resolution), must be read afresh.
TEST(Dcp, MetadataIsReadAfreshWhenTheCheckpointChanges) {
  const std::string dir = TempDir() + "/dcp_changes";
  const std::string other = TempDir() + "/dcp_changes_other";
  ASSERT_EQ(RunShell(absl::StrCat("rm -rf '", dir, "' '", other, "'")), 0);
  ASSERT_TRUE(SaveDcpCheckpoint(dir, {ItemOf("first", at::ones({2, 3}))}).ok());
  absl::StatusOr<DcpMetadata> read = ReadDcpMetadata(dir);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_THAT(TensorNames(*read), ::testing::ElementsAre("first"));
  ASSERT_TRUE(ReadDcpMetadata(dir).ok());  // Kept.

  ASSERT_TRUE(SaveDcpCheckpoint(dir, {ItemOf("second", at::ones({4}))}).ok());
  read = ReadDcpMetadata(dir);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_THAT(TensorNames(*read), ::testing::ElementsAre("second"));

  // The same inode, rewritten.
  ASSERT_TRUE(
      SaveDcpCheckpoint(other, {ItemOf("third", at::ones({1})), ItemOf("x", at::ones({1}))}).ok());
  ASSERT_EQ(RunShell(absl::StrCat("cp '", other, "/.metadata' '", dir, "/.metadata'")), 0);
  read = ReadDcpMetadata(dir);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_THAT(TensorNames(*read), ::testing::ElementsAre("third", "x"));

  // The same size, the same inode, at once.
  const std::string same_size = TempDir() + "/dcp_changes_same_size";
  ASSERT_EQ(RunShell(absl::StrCat("rm -rf '", same_size, "'")), 0);
  ASSERT_TRUE(SaveDcpCheckpoint(dir, {ItemOf("aaaa", at::ones({2}))}).ok());
  ASSERT_TRUE(SaveDcpCheckpoint(same_size, {ItemOf("bbbb", at::ones({2}))}).ok());
  read = ReadDcpMetadata(dir);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_THAT(TensorNames(*read), ::testing::ElementsAre("aaaa"));
  ASSERT_EQ(RunShell(absl::StrCat("cp '", same_size, "/.metadata' '", dir, "/.metadata'")), 0);
  read = ReadDcpMetadata(dir);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_THAT(TensorNames(*read), ::testing::ElementsAre("bbbb"));
}

TEST(Dcp, ADirectoryWithoutMetadataIsNamed) {
  EXPECT_FALSE(IsDcpDirectory(TempDir()));
  EXPECT_TRUE(IsDcpDirectory(absl::StrCat(kFixtures, "/plain/ckpt")));
  auto missing = ReadDcpMetadata(TempDir() + "/no_such_checkpoint");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(), HasSubstr("is not a DCP checkpoint: no .metadata"));
}

}  // namespace
}  // namespace fsdp
