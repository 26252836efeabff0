// Writes the SHARDED checkpoints whose manifests seed the sharded_manifest
// fuzzer: the model of sharded_manifest_model.h saved at world sizes 1, 2
// and 3 (threads, Gloo over loopback), with and without the saver's
// metadata and optimizer entries. Each checkpoint's shard files go to
// OUT_DIR/data/ (the fuzzer's data files), its manifest to
// OUT_DIR/manifests/<name>, and the same manifest without its checksum
// header (the format before checksums) to OUT_DIR/manifests/<name>-bare.
//
//   bazel run //statedict/fuzz:write_sharded_seeds -- OUT_DIR
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"
#include "comm/collectives.h"
#include "statedict/fuzz/sharded_manifest_model.h"
#include "statedict/sharded_checkpoint.h"
#include "testing/multi_rank.h"

namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size());
}

bool Save(const std::string& out, const std::string& name, int world, bool with_optim,
          const fsdp::CheckpointMetadata& metadata) {
  const std::string dir = absl::StrCat(out, "/", name);
  mkdir(dir.c_str(), 0755);
  const absl::Status status = fsdp::testing::RunOnThreadRanks(world, [&](fsdp::Collectives& g) {
    const absl::Status saved = fsdp::SaveCheckpointTensors(
        g, dir, fsdp::fuzz::ShardedManifestModel(g.rank(), world, with_optim), metadata);
    if (!saved.ok()) std::fprintf(stderr, "%s\n", saved.ToString().c_str());
  });
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    return false;
  }
  const std::string manifest = ReadFile(dir + "/manifest.pb");
  WriteFile(absl::StrCat(out, "/manifests/", name), manifest);
  WriteFile(absl::StrCat(out, "/manifests/", name, "-bare"), manifest.substr(12));
  return std::system(
             absl::StrCat("mv '", dir, "'/shard-*.bin '", out, "/data/' && rm -r '", dir, "'")
                 .c_str()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: write_sharded_seeds OUT_DIR\n");
    return 2;
  }
  const std::string out = argv[1];
  mkdir(out.c_str(), 0755);
  mkdir((out + "/data").c_str(), 0755);
  mkdir((out + "/manifests").c_str(), 0755);
  const bool ok = Save(out, "w1", 1, false, {}) &&
                  Save(out, "w2-optim-metadata", 2, true, {{"run", "fuzz-seed"}, {"step", "42"}}) &&
                  Save(out, "w3", 3, false, {{"step", "7"}});
  return ok ? 0 : 1;
}
