// libFuzzer target: any bytes as a DCP checkpoint's .metadata, beside the
// data file of the plain fixture (statedict/testdata/dcp/plain), through
// ReadDcpMetadata and LoadDcpStateDict. tools/fuzz.sh runs it;
// //statedict/fuzz:dcp_metadata_fuzz_regression_test replays its
// corpus.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "statedict/dcp.h"

namespace {

std::string CheckpointDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir =
      std::string(tmp != nullptr ? tmp : "/tmp") + "/dcp_fuzz_" + std::to_string(getpid());
  const std::string data = "statedict/testdata/dcp/plain/ckpt/__0_0.distcp";
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
  if (metadata.ok()) (void)fsdp::LoadDcpStateDict(dir);
  return 0;
}
