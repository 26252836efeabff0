// libFuzzer target: any bytes as the manifest.pb of a SHARDED checkpoint
// (statedict/sharded_checkpoint.cc), in a directory that holds the shard
// files of real checkpoints (testdata/sharded_manifest: the seeds' own,
// written by write_sharded_seeds), through ReadCheckpointMetadata and the
// whole of LoadCheckpointTensors: the manifest's checksum and parse, its
// check against a model (names, aliases, shapes, dtypes, the pieces'
// tiling), the shard files it names (size, header), and the chunked,
// CRC-checked reads. A world-1 group stands in for the process group (its
// collectives complete locally), so this one rank reads every piece, of
// every rank's file. The manifest is the one file a loader trusts to say
// where to read and how much, so it must never make a load crash, read
// out of bounds, hang or allocate without bound. tools/fuzz.sh runs it;
// //statedict/fuzz:sharded_manifest_fuzz_regression_test replays its
// corpus.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "comm/collectives.h"
#include "google/protobuf/stubs/logging.h"
#include "statedict/fuzz/sharded_manifest_model.h"
#include "statedict/sharded_checkpoint.h"

namespace {

// World size 1: Collectives completes every collective itself.
class SelfGroup final : public fsdp::Collectives {
 public:
  SelfGroup() : Collectives(/*rank=*/0, /*world_size=*/1) {}

 protected:
  std::unique_ptr<fsdp::CollectiveWork> DoAllGather(const at::Tensor&, const at::Tensor&) override {
    std::abort();
  }
  std::unique_ptr<fsdp::CollectiveWork> DoReduceScatter(const at::Tensor&, const at::Tensor&,
                                                        fsdp::ReduceOp) override {
    std::abort();
  }
  std::unique_ptr<fsdp::CollectiveWork> DoAllReduce(const at::Tensor&, fsdp::ReduceOp) override {
    std::abort();
  }
  std::unique_ptr<fsdp::CollectiveWork> DoBroadcast(const at::Tensor&, int) override {
    std::abort();
  }
  std::unique_ptr<fsdp::CollectiveWork> DoAllToAll(const at::Tensor&, const at::Tensor&) override {
    std::abort();
  }
  void DoBarrier() override { std::abort(); }
};

std::string CheckpointDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/sharded_manifest_fuzz_" +
                          std::to_string(getpid());
  const std::string data = "statedict/fuzz/testdata/sharded_manifest";
  if (std::system(
          ("mkdir -p '" + dir + "' && cp -L '" + data + "'/shard-*.bin '" + dir + "/'").c_str()) !=
      0) {
    std::abort();  // Run from the source root (or the test's runfiles).
  }
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = CheckpointDir();
  // Protobuf logs every string field that is not UTF-8; the parse fails
  // either way.
  static const bool quiet = (google::protobuf::SetLogHandler(nullptr), true);
  (void)quiet;
  std::ofstream(dir + "/manifest.pb", std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  // Both readers see every input: the metadata reader's refusal (a shard
  // file of another size, say) must not keep the loader's own checks from
  // the fuzzer.
  (void)fsdp::ReadCheckpointMetadata(dir);
  // The whole model, every element on this rank (lo = 0, hi = numel).
  std::vector<fsdp::CheckpointTensor> tensors =
      fsdp::fuzz::ShardedManifestModel(/*rank=*/0, /*world=*/1, /*with_optim=*/false);
  for (auto& t : tensors) t.local.zero_();
  SelfGroup group;
  fsdp::ShardedLoadStats stats;
  (void)fsdp::LoadCheckpointTensors(group, dir, tensors, {"optim/"}, &stats);
  return 0;
}
