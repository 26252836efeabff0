#include "formats/crc32.h"

#include <array>

namespace fsdp {
namespace {

// Slicing-by-4 tables for the reflected polynomial 0xEDB88320.
std::array<std::array<uint32_t, 256>, 4> MakeTables() {
  std::array<std::array<uint32_t, 256>, 4> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i) {
    for (int s = 1; s < 4; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
  return t;
}

}  // namespace

uint32_t Crc32(const void* data, size_t size, uint32_t crc) {
  static const auto kTables = MakeTables();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  while (size >= 4) {
    c ^= static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
    c = kTables[3][c & 0xff] ^ kTables[2][(c >> 8) & 0xff] ^ kTables[1][(c >> 16) & 0xff] ^
        kTables[0][c >> 24];
    p += 4;
    size -= 4;
  }
  while (size-- > 0) c = kTables[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return ~c;
}

}  // namespace fsdp
