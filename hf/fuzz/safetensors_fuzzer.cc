// Fuzzes the safetensors reader with the bytes of a whole file: the header
// length, the header's JSON and the checks of every entry, then reads of
// every tensor the checks let through (whole, by rows and flat), so that an
// accepted header can never lead a read outside the file.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "hf/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memfd_create("safetensors_fuzz", MFD_CLOEXEC);
  if (fd < 0) return 0;
  size_t written = 0;
  while (written < size) {
    const ssize_t n = write(fd, data + written, size - written);
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
  auto file = fsdp::hf::SafetensorsFile::Open("/proc/self/fd/" + std::to_string(fd));
  if (file.ok()) {
    for (const fsdp::hf::SafetensorsEntry& entry : file->entries()) {
      // The checks bound every tensor by the input's size, which libFuzzer
      // keeps small; the reads must succeed.
      if (!file->Read(entry.name).ok()) __builtin_trap();
      const int64_t numel = entry.numel();
      if (!file->ReadFlat(entry.name, numel / 2, numel).ok()) __builtin_trap();
      if (!entry.shape.empty() && !file->ReadRows(entry.name, 0, entry.shape[0] / 2).ok()) {
        __builtin_trap();
      }
    }
  }
  close(fd);
  return 0;
}
