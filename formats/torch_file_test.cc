#include "formats/torch_file.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "caffe2/serialize/inline_container.h"
#include "formats/atomic_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/torch_python.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;

constexpr char kScript[] = "formats/torch_file_interop.py";

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

// The script's exit status (-1 if it did not exit).
int RunPython(const std::string& mode, const std::string& path) {
  const std::string command = absl::StrCat("timeout 120 ", ::fsdp::testing::TorchPython(), " ",
                                           kScript, " ", mode, " '", path, "'");
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), bytes.size());
}

StateDict Sample() {
  at::Tensor w = at::arange(6, at::kFloat).view({2, 3});
  at::Tensor flat = at::arange(6, at::kFloat);
  return {{"a.weight", w},
          {"b.weight", w},  // Tied.
          {"c.bias", at::full({3}, 1.5, at::kBFloat16)},
          {"d.half", at::ones({2, 2}, at::kHalf)},
          {"e.shard", flat.narrow(0, 3, 2)}};  // A view into a larger buffer.
}

TEST(TorchFile, RoundTripKeepsNamesOrderDtypesAndValues) {
  const std::string path = TempDir() + "/round_trip.pt";
  ASSERT_TRUE(SaveTorchStateDict(path, Sample()).ok());
  auto loaded = LoadTorchStateDict(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const StateDict want = Sample();
  ASSERT_EQ(loaded->size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ((*loaded)[i].first, want[i].first);
    EXPECT_EQ((*loaded)[i].second.scalar_type(), want[i].second.scalar_type());
    EXPECT_TRUE(at::equal((*loaded)[i].second, want[i].second)) << want[i].first;
  }
}

TEST(TorchFile, PythonTorchLoadReadsWhatWeWrite) {
  const std::string path = TempDir() + "/for_python.pt";
  ASSERT_TRUE(SaveTorchStateDict(path, Sample()).ok());
  EXPECT_EQ(RunPython("check_written_by_cpp", path), 0);
}

TEST(TorchFile, WeReadWhatPythonTorchSaveWrites) {
  const std::string dir = TempDir();
  ASSERT_EQ(RunPython("write_for_cpp", dir), 0);

  auto sequential = LoadTorchStateDict(dir + "/sequential.pt");
  ASSERT_TRUE(sequential.ok()) << sequential.status();
  ASSERT_EQ(sequential->size(), 4u);
  EXPECT_EQ((*sequential)[0].first, "0.weight");
  EXPECT_EQ((*sequential)[3].first, "1.bias");
  EXPECT_TRUE(at::equal((*sequential)[0].second, at::arange(6, at::kFloat).view({2, 3})));
  EXPECT_TRUE(at::equal((*sequential)[3].second, at::arange(2, at::kFloat) + 30));

  auto model = LoadTorchStateDict(dir + "/checkpoint.pt", "model");
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ(model->size(), 6u);
  EXPECT_TRUE(at::equal((*model)[0].second,
                        at::arange(4, at::kDouble).view({2, 2}).t().contiguous()));
  EXPECT_EQ((*model)[1].second.scalar_type(), at::kHalf);
  EXPECT_TRUE(at::equal((*model)[2].second, at::full({2}, 2.5, at::kBFloat16)));
  EXPECT_EQ((*model)[3].second.item<int64_t>(), 7);
  EXPECT_EQ((*model)[4].second.scalar_type(), at::kBool);
  EXPECT_TRUE(at::equal((*model)[5].second, at::arange(100000, at::kFloat)));

  auto top = LoadTorchStateDict(dir + "/checkpoint.pt");
  ASSERT_FALSE(top.ok());
  EXPECT_THAT(top.status().message(), HasSubstr("is not a dict of tensors: 'model' is a dict; "
                                                "'iter_num' is a int"));
  auto no_entry = LoadTorchStateDict(dir + "/checkpoint.pt", "optimizer");
  EXPECT_THAT(no_entry.status().message(),
              HasSubstr("has no dict under 'optimizer' (top-level keys: model, iter_num, "
                        "best_val_loss, config, shapes)"));

  auto parameter = LoadTorchStateDict(dir + "/parameter.pt");
  ASSERT_TRUE(parameter.ok()) << parameter.status();
  EXPECT_FALSE((*parameter)[0].second.requires_grad());
}

TEST(TorchFile, BadFilesAreErrorsNamingTheFile) {
  const std::string dir = TempDir();
  auto missing = LoadTorchStateDict(dir + "/no_such.pt");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(), HasSubstr("no_such.pt"));

  WriteFile(dir + "/not_zip.pt", "this is not a zip archive at all");
  auto not_zip = LoadTorchStateDict(dir + "/not_zip.pt");
  ASSERT_FALSE(not_zip.ok());
  EXPECT_THAT(not_zip.status().message(),
              HasSubstr("cannot read '" + dir + "/not_zip.pt' as a torch.save archive"));

  const std::string good = dir + "/good.pt";
  ASSERT_TRUE(SaveTorchStateDict(good, Sample()).ok());
  const std::string bytes = ReadFile(good);
  WriteFile(dir + "/truncated.pt", bytes.substr(0, bytes.size() / 2));
  auto truncated = LoadTorchStateDict(dir + "/truncated.pt");
  ASSERT_FALSE(truncated.ok());
  EXPECT_THAT(truncated.status().message(), HasSubstr("truncated.pt"));

  // A pickle that would call something other than the tensor constructors.
  ASSERT_EQ(std::system(absl::StrCat(
                            "timeout 120 ", ::fsdp::testing::TorchPython(),
                            " -c \"import torch, os\n"
                            "class Evil:\n"
                            "  def __reduce__(self): return (os.system, ('echo pwned',))\n"
                            "torch.save({'x': Evil()}, '", dir, "/evil.pt')\"")
                            .c_str()),
            0);
  auto evil = LoadTorchStateDict(dir + "/evil.pt");
  ASSERT_FALSE(evil.ok());
  EXPECT_THAT(evil.status().message(),
              HasSubstr("the pickle calls posix.system, which a state dict file never needs"));

  // torch.save's legacy (non-zip) format is named, with how to convert it.
  ASSERT_EQ(std::system(absl::StrCat("timeout 120 ", ::fsdp::testing::TorchPython(),
                                     " -c \"import torch\n"
                                     "torch.save({'w': torch.ones(2)}, '", dir,
                                     "/legacy.pt', _use_new_zipfile_serialization=False)\"")
                            .c_str()),
            0);
  auto legacy = LoadTorchStateDict(dir + "/legacy.pt");
  ASSERT_FALSE(legacy.ok());
  EXPECT_THAT(legacy.status().message(),
              HasSubstr("legacy.pt' is in torch.save's legacy format (PyTorch before 1.6"));
  EXPECT_THAT(legacy.status().message(), HasSubstr("torch.save(torch.load('" + dir +
                                                   "/legacy.pt'), 'NEW.pt')"));
}

TEST(TorchFile, FlippedStorageBytesAreDetected) {
  const std::string dir = TempDir();
  const std::string good = dir + "/flip.pt";
  StateDict state = {{"x", at::arange(4096, at::kFloat)}};
  ASSERT_TRUE(SaveTorchStateDict(good, state).ok());
  std::string bytes = ReadFile(good);
  // The storage record sits after the pickle; flip a byte in its middle.
  const size_t at = bytes.find("data/0") + 64 + 8192;
  ASSERT_LT(at, bytes.size());
  bytes[at] = static_cast<char>(bytes[at] ^ 0x5a);
  WriteFile(dir + "/flipped.pt", bytes);
  auto flipped = LoadTorchStateDict(dir + "/flipped.pt");
  ASSERT_FALSE(flipped.ok()) << "a flipped byte in a storage went unnoticed";
  EXPECT_THAT(flipped.status().message(), HasSubstr("flipped.pt"));
}

// Pickle opcodes for hand-made torch.save files.
std::string PickleString(const std::string& s) {
  std::string out = "X";
  for (int k = 0; k < 4; ++k) out += static_cast<char>((s.size() >> (8 * k)) & 0xff);
  return out + s;
}
std::string PickleLong(int64_t v) {  // LONG1 with 8 bytes.
  std::string out = "\x8a\x08";
  for (int k = 0; k < 8; ++k)
    out += static_cast<char>((static_cast<uint64_t>(v) >> (8 * k)) & 0xff);
  return out;
}

// A torch.save file {'x': float tensor of `numel` elements} whose storage
// record holds `record_bytes` bytes, whatever `numel` claims.
// `view_numel` and `stride` shape the 1-D tensor over it (default: all of
// it, contiguous).
void WriteHandMadeFile(const std::string& path, int64_t numel, size_t record_bytes,
                       int64_t view_numel = -1, int64_t stride = 1) {
  const std::string pickle =
      std::string("\x80\x02}(") + PickleString("x") + "ctorch._utils\n_rebuild_tensor_v2\n((" +
      PickleString("storage") + "ctorch\nFloatStorage\n" + PickleString("0") + PickleString("cpu") +
      PickleLong(numel) + "tQ" + std::string("K\0", 2) +
      PickleLong(view_numel < 0 ? numel : view_numel) + "\x85" + PickleLong(stride) + "\x85" +
      "\x89" + "ccollections\nOrderedDict\n)RtRu.";
  std::string bytes;
  caffe2::serialize::PyTorchStreamWriter archive([&](const void* data, size_t n) -> size_t {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  archive.writeRecord("data.pkl", pickle.data(), pickle.size());
  const std::string storage(record_bytes, '\0');
  archive.writeRecord("data/0", storage.data(), storage.size());
  archive.writeEndOfFile();
  WriteFile(path, bytes);
}

TEST(TorchFile, HandMadeFilesLoad) {
  // The builder itself is right: an honest file loads.
  const std::string path = TempDir() + "/hand_made.pt";
  WriteHandMadeFile(path, 4, 16);
  auto loaded = LoadTorchStateDict(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(at::equal((*loaded)[0].second, at::zeros({4})));
}

// The element count comes from the pickle; nothing is allocated for it
// before the record is known to hold that many bytes.
TEST(TorchFile, AStorageCountTheRecordDoesNotHoldIsRefusedBeforeAllocating) {
  const std::string path = TempDir() + "/lying_count.pt";
  WriteHandMadeFile(path, int64_t{1} << 60, 16);  // 4 EiB claimed, 16 bytes stored.
  auto lying = LoadTorchStateDict(path);
  ASSERT_FALSE(lying.ok());
  EXPECT_THAT(lying.status().message(),
              HasSubstr("record 'data/0' has 16 bytes, expected 4611686018427387904"));
  WriteHandMadeFile(path, int64_t{1} << 62, 16);  // Bytes overflow int64.
  auto overflowing = LoadTorchStateDict(path);
  ASSERT_FALSE(overflowing.ok());
  EXPECT_THAT(overflowing.status().message(),
              HasSubstr("storage 'data/0' claims 4611686018427387904 elements"));
  WriteHandMadeFile(path, -3, 16);
  EXPECT_THAT(LoadTorchStateDict(path).status().message(), HasSubstr("claims -3 elements"));
}

// An expanded view (stride 0) may hold more elements than its storage, as
// torch.save keeps it; materializing it is bounded, so 4 bytes cannot
// claim 8 GiB.
TEST(TorchFile, AnExpandedViewIsBounded) {
  const std::string path = TempDir() + "/expanded.pt";
  WriteHandMadeFile(path, 1, 4, /*view_numel=*/1000, /*stride=*/0);
  auto small = LoadTorchStateDict(path);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_TRUE(at::equal((*small)[0].second, at::zeros({1000})));
  WriteHandMadeFile(path, 1, 4, /*view_numel=*/int64_t{1} << 31, /*stride=*/0);
  EXPECT_THAT(LoadTorchStateDict(path).status().message(),
              HasSubstr("a tensor of 2147483648 elements over a storage of 1 would expand beyond "
                        "1 GiB"));
}

// Sets every CRC-32 the zip records to 0, as torch.save does with
// torch.serialization.set_crc32_options(False).
std::string ZeroZipCrcs(std::string bytes) {
  for (size_t at = 0; at + 20 <= bytes.size(); ++at) {
    if (bytes.compare(at, 4, "PK\x03\x04") == 0) bytes.replace(at + 14, 4, 4, '\0');
    if (bytes.compare(at, 4, "PK\x01\x02") == 0) bytes.replace(at + 16, 4, 4, '\0');
  }
  return bytes;
}

TEST(TorchFile, FilesWrittenWithoutCrcsLoad) {
  const std::string path = TempDir() + "/ours_without_crcs.pt";
  ASSERT_TRUE(SaveTorchStateDict(path, Sample()).ok());
  WriteFile(path, ZeroZipCrcs(ReadFile(path)));
  auto loaded = LoadTorchStateDict(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(at::equal((*loaded)[0].second, Sample()[0].second));
}

TEST(TorchFile, FilesPythonWroteWithoutCrcsLoad) {
  const std::string path = TempDir() + "/python_without_crcs.pt";
  const int python = RunPython("write_without_crcs", path);
  if (python == 3) GTEST_SKIP() << "this torch cannot write files without CRC-32s";
  ASSERT_EQ(python, 0);
  auto loaded = LoadTorchStateDict(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(at::equal((*loaded)[0].second, at::arange(1000, at::kFloat).view({10, 100})));
}

TEST(TorchFile, WeReadDtypesPythonWritesWithoutAStorageClass) {
#ifndef AT_FORALL_FLOAT8_TYPES
  GTEST_SKIP() << "this libtorch has no float8 dtypes";
#else
  const std::string path = TempDir() + "/new_dtypes.pt";
  const int python = RunPython("write_new_dtypes", path);
  if (python == 3) GTEST_SKIP() << "this torch has no float8 dtypes";
  ASSERT_EQ(python, 0);
  auto loaded = LoadTorchStateDict(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->size(), 3u);
  EXPECT_EQ((*loaded)[0].second.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_TRUE(at::equal((*loaded)[0].second.to(at::kFloat), at::tensor({0.5f, -2.0f, 448.0f})));
  EXPECT_EQ((*loaded)[1].second.scalar_type(), at::kUInt16);
  EXPECT_TRUE(at::equal((*loaded)[1].second.to(at::kInt), at::tensor({1, 65535})));
  EXPECT_TRUE(at::equal((*loaded)[2].second, at::tensor({1.5f, 2.5f})));
#endif
}

// A dtype the format has no name for would make a file that neither
// torch.load nor LoadTorchStateDict can read; it is refused by name.
TEST(TorchFile, DtypesTheFormatCannotNameAreRefusedWhenSaving) {
  std::vector<at::ScalarType> unnamed = {at::kComplexHalf};
#ifdef AT_FORALL_FLOAT8_TYPES
  unnamed.push_back(at::kFloat8_e4m3fn);
  unnamed.push_back(at::kFloat8_e5m2);
#endif
  for (at::ScalarType dtype : unnamed) {
    SCOPED_TRACE(c10::toString(dtype));
    const absl::Status status = SaveTorchStateDict(
        TempDir() + "/unnamed_dtype.pt", {{"ok", at::ones({2})}, {"odd", at::zeros({2}, dtype)}});
    EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("'odd' has dtype ", c10::toString(dtype),
                                                         ", which torch.save's format cannot "
                                                         "name")));
  }
}

TEST(TorchFile, SaveIsAtomicAndRefusesBadInput) {
  const std::string dir = TempDir();
  const std::string path = dir + "/atomic.pt";
  ASSERT_TRUE(SaveTorchStateDict(path, Sample()).ok());
  const std::string before = ReadFile(path);
  // A failing save (duplicate name) leaves the previous file as it was.
  StateDict bad = Sample();
  bad.push_back(bad.front());
  absl::Status status = SaveTorchStateDict(path, bad);
  EXPECT_THAT(status.message(), HasSubstr("'a.weight' appears twice"));
  EXPECT_EQ(ReadFile(path), before);
  EXPECT_THAT(SaveTorchStateDict(path, {{"u", at::Tensor()}}).message(),
              HasSubstr("'u' is an undefined tensor"));
  EXPECT_FALSE(SaveTorchStateDict("/nonexistent_dir/x.pt", Sample()).ok());
  // No temporary file is left behind by a writer that never commits.
  {
    auto writer = AtomicFileWriter::Open(dir + "/uncommitted.bin");
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE(writer->Write("abc", 3).ok());
  }
  struct stat st;
  EXPECT_NE(stat((dir + "/uncommitted.bin").c_str(), &st), 0);
}

}  // namespace
}  // namespace fsdp
