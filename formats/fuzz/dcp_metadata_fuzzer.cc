// libFuzzer target: any bytes as a DCP checkpoint's .metadata, beside the
// data file of the plain fixture (formats/testdata/dcp/plain), through
// ReadDcpMetadata and LoadDcpStateDict, and, for what loads whole, parts
// read by ReadDcpFlatRange must be the whole's elements. tools/fuzz.sh runs it;
// //formats/fuzz:dcp_metadata_fuzz_regression_test replays its
// corpus.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>

#include "ATen/ATen.h"
#include "formats/dcp.h"

namespace {

std::string CheckpointDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir =
      std::string(tmp != nullptr ? tmp : "/tmp") + "/dcp_fuzz_" + std::to_string(getpid());
  const std::string data = "formats/testdata/dcp/plain/ckpt/__0_0.distcp";
  if (std::system(("mkdir -p '" + dir + "' && cp -L '" + data + "' '" + dir + "/'").c_str()) != 0) {
    std::abort();  // Run from the source root (or the test's runfiles).
  }
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = CheckpointDir();
  std::ofstream(dir + "/.metadata", std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  auto metadata = fsdp::ReadDcpMetadata(dir);
  if (!metadata.ok()) return 0;
  auto whole = fsdp::LoadDcpStateDict(dir);
  if (!whole.ok()) return 0;
  // A flat shard's part read from the chunks that hold it is the same
  // elements of the whole tensor (what a sharded load relies on).
  for (size_t t = 0; t < metadata->tensors.size() && t < whole->size(); ++t) {
    const fsdp::DcpTensorEntry& tensor = metadata->tensors[t];
    const at::Tensor flat = (*whole)[t].second.reshape({-1});
    const int64_t n = flat.numel();
    for (const auto& [lo, hi] :
         {std::pair<int64_t, int64_t>{0, n / 3}, std::pair<int64_t, int64_t>{n / 3, n - n / 5}}) {
      auto part = fsdp::ReadDcpFlatRange(dir, tensor, lo, hi);
      if (!part.ok()) std::abort();  // Whole, it was readable.
      if (!at::equal(*part, flat.narrow(0, lo, hi - lo))) std::abort();
    }
  }
  return 0;
}
