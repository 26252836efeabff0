// libFuzzer target: any bytes as a torch.save file through
// LoadTorchStateDict (zip directory, libtorch's archive reader, the
// pickle, storages and tensor views). tools/fuzz.sh runs it;
// //formats/fuzz:torch_file_fuzz_regression_test replays its
// corpus.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "formats/torch_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  static const std::string path =
      std::string(tmp != nullptr ? tmp : "/tmp") + "/torch_file_fuzz_" + std::to_string(getpid());
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  auto state = fsdp::LoadTorchStateDict(path);
  if (state.ok()) {
    // Touch every byte, so a tensor past its storage shows under ASan.
    volatile uint8_t sink = 0;
    for (const auto& [name, tensor] : *state) {
      const auto* bytes = static_cast<const uint8_t*>(tensor.data_ptr());
      for (size_t i = 0; i < tensor.nbytes(); ++i) sink = sink ^ bytes[i];
    }
  }
  return 0;
}
