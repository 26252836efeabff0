// CRC-32 (IEEE 802.3, the checksum of zip archives and zlib): verifies
// torch.save archives' records and checkpoint shards.
#ifndef FSDP_FORMATS_CRC32_H_
#define FSDP_FORMATS_CRC32_H_

#include <cstddef>
#include <cstdint>

namespace fsdp {

// Extends `crc` (0 to start) over `size` bytes.
uint32_t Crc32(const void* data, size_t size, uint32_t crc = 0);

// Not for callers: the implementations Crc32 chooses among, declared here so
// that formats/crc32_test.cc can check each one, whichever this CPU would pick.
namespace crc32_internal {

using Crc32Fn = uint32_t (*)(const void* data, size_t size, uint32_t crc);

// Slicing-by-8 tables: any CPU, about 2 GB/s.
uint32_t Crc32Table(const void* data, size_t size, uint32_t crc);

// Carry-less-multiplication folding, 16 bytes a step (PCLMULQDQ + SSE4.1);
// nullptr off x86-64 or where this CPU lacks them.
Crc32Fn Crc32Clmul();

// The implementation Crc32 calls: folding where this CPU has it (about
// 22 GB/s here; an AVX-512 variant was not kept: its speed is not needed,
// and 512-bit work can lower a shared core's clock), else the tables.
Crc32Fn Crc32Chosen();

}  // namespace crc32_internal
}  // namespace fsdp

#endif  // FSDP_FORMATS_CRC32_H_
