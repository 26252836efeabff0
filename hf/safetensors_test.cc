#include "hf/safetensors.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "testing/torch_python.h"

namespace fsdp::hf {
namespace {

namespace fs = std::filesystem;

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const fs::path dir = fs::path(base != nullptr ? base : "/tmp") / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

// A file with this header JSON (unpadded) followed by `data_bytes` zeros.
std::string WriteRaw(const std::string& path, const std::string& json, size_t data_bytes) {
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
  out << json << std::string(data_bytes, '\0');
  return path;
}

std::vector<std::pair<std::string, at::Tensor>> Tensors() {
  at::manual_seed(3);
  return {
      {"embed.weight", at::randn({7, 4})},
      {"q_proj.weight", at::randn({4, 4}).to(at::kBFloat16)},
      {"up_proj.weight", at::randn({3, 4}).to(at::kHalf)},
      {"bias", at::arange(5, at::kLong)},
      {"mask", at::tensor({1, 0, 1}).to(at::kBool)},
      {"scalar", at::scalar_tensor(2.5, at::kDouble)},
      {"empty", at::zeros({0, 3})},
  };
}

std::vector<SafetensorsTensorSpec> SpecsOf(
    const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<SafetensorsTensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  return specs;
}

void WriteFile(const std::string& path,
               const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  auto writer = SafetensorsWriter::Create(path, SpecsOf(tensors), {{"format", "pt"}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (const auto& [name, t] : tensors) ASSERT_TRUE(writer->Write(name, t).ok()) << name;
  ASSERT_TRUE(writer->Commit().ok());
}

TEST(SafetensorsTest, RoundTripsEveryDTypeWholeByRowsAndFlat) {
  const std::string path = TempDir("round_trip") + "/t.safetensors";
  const auto tensors = Tensors();
  WriteFile(path, tensors);
  {  // The header is padded so that the data starts 8-aligned, as the crate's.
    std::ifstream in(path, std::ios::binary);
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(in.get() & 0xff) << (8 * i);
    EXPECT_EQ((8 + n) % 8, 0u);
  }
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata().at("format"), "pt");
  ASSERT_EQ(file->entries().size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    auto read = file->Read(name);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(at::equal(*read, t)) << name;
  }
  const at::Tensor embed = tensors[0].second;
  auto rows = file->ReadRows("embed.weight", 2, 5);
  ASSERT_TRUE(rows.ok());
  EXPECT_TRUE(at::equal(*rows, embed.slice(0, 2, 5)));
  auto flat = file->ReadFlat("q_proj.weight", 3, 13);
  ASSERT_TRUE(flat.ok());
  EXPECT_TRUE(at::equal(*flat, tensors[1].second.flatten().slice(0, 3, 13)));
  EXPECT_EQ(file->ReadRows("embed.weight", 5, 8).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(file->ReadFlat("bias", -1, 2).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_FALSE(file->ReadRows("scalar", 0, 1).ok());
  EXPECT_EQ(file->Read("nope").status().code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, ReadsARangeIntoATensorDirectlyOrCastInChunks) {
  const std::string path = TempDir("read_into") + "/t.safetensors";
  // More elements than one chunk holds, so that the cast goes chunk by chunk.
  const int64_t numel = SafetensorsFile::kReadChunkBytes / 2 * 2 + 5;
  const at::Tensor big = at::randn({numel}).to(at::kBFloat16);
  const at::Tensor small = at::randn({3, 4});
  WriteFile(path, {{"big", big}, {"small", small}});
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();

  at::Tensor same = at::zeros({6});
  ASSERT_TRUE(file->ReadFlatInto("small", 3, 9, same).ok());
  EXPECT_TRUE(at::equal(same, small.flatten().slice(0, 3, 9)));

  const int64_t lo = 7, hi = numel - 2;
  at::Tensor cast = at::zeros({hi - lo});
  ASSERT_TRUE(file->ReadFlatInto("big", lo, hi, cast).ok());
  EXPECT_TRUE(at::equal(cast, big.slice(0, lo, hi).to(at::kFloat)));
  // Into a view of a larger tensor (a rank's part of a flat shard).
  at::Tensor shard = at::full({20}, -1.0);
  ASSERT_TRUE(file->ReadFlatInto("big", 0, 10, shard.narrow(0, 5, 10)).ok());
  EXPECT_TRUE(at::equal(shard.narrow(0, 5, 10), big.slice(0, 0, 10).to(at::kFloat)));
  EXPECT_EQ(shard[4].item<float>(), -1.0f);
  EXPECT_EQ(shard[15].item<float>(), -1.0f);

  EXPECT_EQ(file->ReadFlatInto("small", 0, 6, at::zeros({5})).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(file->ReadFlatInto("small", 0, 6, at::zeros({2, 3})).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(file->ReadFlatInto("small", 10, 13, at::zeros({3})).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(file->ReadFlatInto("nope", 0, 1, at::zeros({1})).code(),
            absl::StatusCode::kNotFound);

  // A file cut short after its header was read: the read names the file.
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 64);
  const absl::Status cut = file->ReadFlatInto("small", 0, 12, at::zeros({12}));
  EXPECT_EQ(cut.code(), absl::StatusCode::kDataLoss) << cut;
  EXPECT_NE(cut.message().find(path), std::string::npos) << cut;
}

TEST(SafetensorsTest, RefusesHeadersThatDoNotDescribeTheFile) {
  const std::string dir = TempDir("bad_headers");
  struct Case {
    std::string json;
    size_t data_bytes;
    std::string error;
  };
  std::string sixty_five_ones = "1";
  for (int i = 1; i < 65; ++i) sixty_five_ones += ",1";
  const std::vector<Case> cases = {
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, ""},
      {R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8, "has dtype \"Q4\""},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, "need 12"},
      {R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, "a dimension -2"},
      {R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8, "a dimension 2.5"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12, "(a hole)"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8, "(an overlap)"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4, "cover 8 bytes"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 12, "holds 12"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8, "not [begin, end]"},
      // Beyond the three fields, as the crate: ignored. A null metadata too.
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1},"__metadata__":null})", 8,
       ""},
      {R"({"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", 1, "not one the format"},
      {R"({"a":{"dtype":[[{"x":[1]}]],"shape":[2],"data_offsets":[0,8]}})", 8, "nests deeper"},
      {R"({"a":{"dtype":"F32","shape":[0,4611686018427387904,4],"data_offsets":[0,0]}})", 0,
       "overflows"},
      {absl::StrCat(R"({"a":{"dtype":"F32","shape":[)", sixty_five_ones,
                    R"(],"data_offsets":[0,4]}})"), 4, "at most 64 dimensions"},
      {R"({"a":{"dtype":"F32","shape":[2]}})", 8, "not {dtype, shape, data_offsets}"},
      {R"({"__metadata__":{"k":1}})", 0, "'k' is not a string"},
      {R"([1,2])", 0, "not a JSON object"},
      {R"({"a":)", 0, "not a JSON object"},
      {R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],)"
       R"("data_offsets":[0,8]}})", 8, "overflows"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = WriteRaw(absl::StrCat(dir, "/", i), cases[i].json, cases[i].data_bytes);
    auto file = SafetensorsFile::Open(path);
    if (cases[i].error.empty()) {
      EXPECT_TRUE(file.ok()) << file.status();
      continue;
    }
    ASSERT_FALSE(file.ok()) << cases[i].json;
    EXPECT_NE(file.status().ToString().find(cases[i].error), std::string::npos)
        << cases[i].json << " -> " << file.status();
    EXPECT_NE(file.status().ToString().find(path), std::string::npos) << file.status();
  }
}

TEST(SafetensorsTest, ListsDTypesThisLibtorchLacksAndRefusesToReadThem) {
  const std::string path = WriteRaw(TempDir("u16") + "/u16",
                                    R"({"a":{"dtype":"U16","shape":[2],"data_offsets":[0,4]},)"
                                    R"("b":{"dtype":"I16","shape":[2],"data_offsets":[4,8]}})",
                                    8);
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->Find("a")->dtype_name, "U16");
  EXPECT_EQ(file->Find("a")->dtype, at::ScalarType::Undefined);
  EXPECT_NE(file->Read("a").status().ToString().find("U16, a dtype this library does not read"),
            std::string::npos);
  EXPECT_TRUE(file->Read("b").ok());
}

TEST(SafetensorsTest, RefusesLengthPrefixesBeyondTheFileOrTheLimit) {
  const std::string dir = TempDir("bad_lengths");
  const std::string short_path = dir + "/short";
  std::ofstream(short_path, std::ios::binary) << "abc";
  EXPECT_NE(SafetensorsFile::Open(short_path).status().ToString().find("8-byte"),
            std::string::npos);
  for (const uint64_t n : {uint64_t{1} << 40, uint64_t{64}}) {
    const std::string path = absl::StrCat(dir, "/len", n);
    std::ofstream out(path, std::ios::binary);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
    out << "{}";
    out.close();
    const std::string error = SafetensorsFile::Open(path).status().ToString();
    EXPECT_NE(error.find(n > 100'000'000 ? "at most 100000000" : "shorter than its header"),
              std::string::npos)
        << error;
  }
  EXPECT_EQ(SafetensorsFile::Open(dir + "/missing").status().code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, WriterRefusesMisuseAndLeavesNothingUncommitted) {
  const std::string dir = TempDir("writer_misuse");
  const std::string path = dir + "/w.safetensors";
  std::vector<SafetensorsTensorSpec> specs = {{"a", at::kFloat, {2}}, {"b", at::kLong, {3}}};
  EXPECT_NE(SafetensorsWriter::Create(path, {specs[0], specs[0]}).status().ToString().find(
                "given twice"), std::string::npos);
  EXPECT_NE(SafetensorsWriter::Create(path, {{"__metadata__", at::kFloat, {1}}})
                .status().ToString().find("reserved"), std::string::npos);
  EXPECT_NE(SafetensorsWriter::Create(path, {{"c", at::kComplexFloat, {1}}})
                .status().ToString().find("cannot hold"), std::string::npos);
  {
    auto writer = SafetensorsWriter::Create(path, specs);
    ASSERT_TRUE(writer.ok());
    EXPECT_NE(writer->Write("b", at::zeros({3}, at::kLong)).ToString().find("out of order"),
              std::string::npos);
    EXPECT_NE(writer->Write("a", at::zeros({3})).ToString().find("declared"), std::string::npos);
    EXPECT_NE(writer->Write("a", at::zeros({2}, at::kDouble)).ToString().find("declared"),
              std::string::npos);
    ASSERT_TRUE(writer->Write("a", at::ones({2})).ok());
    EXPECT_NE(writer->Commit().ToString().find("'b'"), std::string::npos);
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(fs::is_empty(dir)) << "a temporary file was left behind";
  // Non-contiguous input is written in logical order.
  auto writer = SafetensorsWriter::Create(path, {{"t", at::kFloat, {3, 2}}});
  const at::Tensor t = at::arange(6, at::kFloat).reshape({2, 3}).t();
  ASSERT_TRUE(writer->Write("t", t).ok());
  ASSERT_TRUE(writer->Commit().ok());
  EXPECT_TRUE(at::equal(*SafetensorsFile::Open(path)->Read("t"), t));
}

TEST(SafetensorsTest, PlansShardsAsHuggingFaceHub) {
  const std::vector<SafetensorsTensorSpec> specs = {
      {"a", at::kFloat, {10}},  // 40 bytes
      {"b", at::kFloat, {10}},  // 40
      {"c", at::kFloat, {30}},  // 120: over the limit, a file of its own
      {"d", at::kFloat, {5}},   // 20
  };
  const SafetensorsShardPlan plan = PlanSafetensorsShards(specs, 100);
  ASSERT_EQ(plan.files.size(), 3u);
  EXPECT_EQ(plan.files[0].size(), 2u);
  EXPECT_EQ(plan.files[1][0].name, "c");
  EXPECT_EQ(plan.files[2][0].name, "d");
  EXPECT_EQ(plan.file_names[1], "model-00002-of-00003.safetensors");
  EXPECT_EQ(PlanSafetensorsShards(specs, 1000).file_names,
            std::vector<std::string>{"model.safetensors"});
}

TEST(SafetensorsTest, CheckpointDirectoryShardsIndexesAndReplacesAnEarlierExport) {
  const std::string dir = TempDir("checkpoint");
  const auto tensors = Tensors();
  auto write = [&](int64_t max_bytes) {
    auto writer = SafetensorsCheckpointWriter::Create(dir, SpecsOf(tensors), max_bytes);
    ASSERT_TRUE(writer.ok()) << writer.status();
    for (const auto& [name, t] : tensors) ASSERT_TRUE(writer->Write(name, t).ok()) << name;
    ASSERT_TRUE(writer->Commit().ok());
  };
  write(64);
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(dir + "/model-00001-of-00003.safetensors"));
  auto checkpoint = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ(checkpoint->names().size(), tensors.size());
  for (const auto& [name, t] : tensors) EXPECT_TRUE(at::equal(*checkpoint->Read(name), t)) << name;
  EXPECT_TRUE(at::equal(*checkpoint->ReadRows("embed.weight", 1, 3),
                        tensors[0].second.slice(0, 1, 3)));
  // Another export's files beside ours stay (a stem that starts like ours).
  std::ofstream(dir + "/model-ema-00001-of-00002.safetensors") << "other";
  write(1 << 20);  // One file now: the shards and the index of the first go.
  EXPECT_TRUE(fs::exists(dir + "/model-ema-00001-of-00002.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir + "/model-00001-of-00003.safetensors"));
  checkpoint = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_TRUE(at::equal(*checkpoint->Read("bias"), tensors[3].second));
  write(64);  // Sharded again: the single file goes.
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors.index.json"));
  EXPECT_TRUE(SafetensorsCheckpoint::Open(dir).ok());
}

TEST(SafetensorsTest, CheckpointRefusesIndexesThatDoNotMatchTheFiles) {
  const std::string dir = TempDir("bad_index");
  EXPECT_NE(SafetensorsCheckpoint::Open(dir).status().ToString().find("holds neither"),
            std::string::npos);
  WriteFile(dir + "/model-00001-of-00001.safetensors", Tensors());
  const std::string index = dir + "/model.safetensors.index.json";
  std::ofstream(index) << R"({"weight_map":{"bias":"model-00001-of-00001.safetensors",)"
                       << R"("ghost":"model-00001-of-00001.safetensors"}})";
  EXPECT_NE(SafetensorsCheckpoint::Open(dir).status().ToString().find("'ghost'"),
            std::string::npos);
  std::ofstream(index) << R"({"weight_map":{"bias":"../model.safetensors"}})";
  EXPECT_NE(SafetensorsCheckpoint::Open(dir).status().ToString().find("not a file name"),
            std::string::npos);
  std::ofstream(index) << R"({"metadata":{}})";
  EXPECT_NE(SafetensorsCheckpoint::Open(dir).status().ToString().find("weight_map"),
            std::string::npos);
}

int RunInterop(const std::string& mode, const std::string& dir) {
  const std::string command =
      absl::StrCat("timeout 120 ", ::fsdp::testing::TorchPython(), " ",
                   ::fsdp::testing::ScriptPath("hf/safetensors_interop.py"), " ", mode, " ", dir);
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(SafetensorsTest, ReadsAndWritesWhatThePythonPackageDoes) {
  const std::string dir = TempDir("interop");
  const int wrote = RunInterop("write_for_cpp", dir);
  if (wrote == 77) GTEST_SKIP() << "this Python has no safetensors package";
  ASSERT_EQ(wrote, 0);
  auto file = SafetensorsFile::Open(dir + "/python.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata().at("format"), "pt");
  // Python's generator made the values; these are checked on both sides.
  EXPECT_TRUE(at::equal(*file->Read("lm_head.bias"), at::arange(7, at::kLong)));
  EXPECT_EQ(file->Find("model.layers.0.self_attn.q_proj.weight")->dtype, at::kBFloat16);
  EXPECT_EQ(file->Find("model.layers.0.mlp.up_proj.weight")->dtype, at::kHalf);
  EXPECT_EQ(file->Find("empty")->shape, (std::vector<int64_t>{0, 3}));
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const SafetensorsEntry& e : file->entries()) tensors.emplace_back(e.name, *file->Read(e.name));
  auto writer = SafetensorsWriter::Create(dir + "/cpp.safetensors", SpecsOf(tensors),
                                          {{"format", "pt"}, {"writer", "fsdp_cpp"}});
  ASSERT_TRUE(writer.ok());
  for (const auto& [name, t] : tensors) ASSERT_TRUE(writer->Write(name, t).ok());
  ASSERT_TRUE(writer->Commit().ok());
  auto sharded = SafetensorsCheckpointWriter::Create(dir + "/sharded", SpecsOf(tensors), 200);
  ASSERT_TRUE(sharded.ok());
  for (const auto& [name, t] : tensors) ASSERT_TRUE(sharded->Write(name, t).ok());
  ASSERT_TRUE(sharded->Commit().ok());
  EXPECT_EQ(RunInterop("check_written_by_cpp", dir), 0);
}

}  // namespace
}  // namespace fsdp::hf
