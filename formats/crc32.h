// CRC-32 (IEEE 802.3, the checksum of zip archives and zlib): verifies
// torch.save archives' records and checkpoint shards.
#ifndef FSDP_FORMATS_CRC32_H_
#define FSDP_FORMATS_CRC32_H_

#include <cstddef>
#include <cstdint>

namespace fsdp {

// Extends `crc` (0 to start) over `size` bytes.
uint32_t Crc32(const void* data, size_t size, uint32_t crc = 0);

}  // namespace fsdp

#endif  // FSDP_FORMATS_CRC32_H_
