#include "formats/crc32.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fsdp {
namespace crc32_internal {
namespace {

// The generator polynomial P = x^32 + x^26 + ... + 1 without its x^32 term,
// reflected as zip and zlib use it: bit i holds the coefficient of x^(31-i).
// Every function below works on the CRC register between the initial and the
// final inversion.
constexpr uint32_t kPoly = 0xEDB88320u;

struct Tables {
  uint32_t t[8][256];
};

// t[0][b] is the register after byte b from zero; t[k][b] that register
// advanced over k more zero bytes, so that one step takes 8 bytes with 8
// independent lookups instead of a chain of 8 dependent ones.
constexpr Tables MakeTables() {
  Tables tables{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? kPoly ^ (c >> 1) : c >> 1;
    tables.t[0][i] = c;
  }
  for (int s = 1; s < 8; ++s) {
    for (uint32_t i = 0; i < 256; ++i) {
      const uint32_t prev = tables.t[s - 1][i];
      tables.t[s][i] = (prev >> 8) ^ tables.t[0][prev & 0xff];
    }
  }
  return tables;
}

// Computed by the compiler: no start-up cost, and no guard on each call.
constexpr Tables kTables = MakeTables();

// Byte by byte, so that big-endian hosts read the same stream.
inline uint32_t LoadLe32(const unsigned char* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

uint32_t TableUpdate(const unsigned char* p, size_t size, uint32_t c) {
  const auto& t = kTables.t;
  for (; size >= 8; p += 8, size -= 8) {
    const uint32_t lo = LoadLe32(p) ^ c;
    const uint32_t hi = LoadLe32(p + 4);
    c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
        t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
  }
  for (; size > 0; ++p, --size) c = t[0][(c ^ *p) & 0xff] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)

// Folding (Intel, "Fast CRC Computation for Generic Polynomials Using
// PCLMULQDQ", 2009), in the reflected domain: a 16-byte block loaded little-
// endian holds in bit j the coefficient of x^(127-j) of its polynomial, so its
// low qword is the block's high-degree half. The CRC of a stream only depends
// on the stream's polynomial mod P, so a block B that lies d bits before a
// later block may be replaced by B * x^d mod P, added into that later block:
// with B = H * x^64 + L, that is H * (x^(d+64) mod P) + L * (x^d mod P), each
// product under 96 bits. PCLMULQDQ of two reflected 64-bit operands returns
// the reflected product shifted one bit (the product has 127 bits, not 128),
// and a 33-bit constant k stored reflected in a qword stands for k * x^31;
// together they multiply by x^32 more, hence the constants x^(d+32) mod P (for
// H) and x^(d-32) mod P (for L). XPowModP derives them here by stepping the
// reflected register (multiplying by x, reducing by P) from x^0, and the
// static_asserts below pin them to values computed independently (a Python
// script with integer polynomials; they also match the values published for
// this polynomial). The last 128 bits become the register in three steps
// (Reduce128).
constexpr uint64_t XPowModP(int n) {
  uint32_t r = 0x80000000u;  // x^0
  for (int i = 0; i < n; ++i) r = (r & 1) ? (r >> 1) ^ kPoly : r >> 1;
  return uint64_t{r} << 1;  // The 33-bit reflection, whose x^32 bit is 0.
}

constexpr uint64_t Reflect(uint64_t v, int bits) {
  uint64_t r = 0;
  for (int i = 0; i < bits; ++i) r |= ((v >> i) & 1) << (bits - 1 - i);
  return r;
}

// floor(x^64 / P) by long division, reflected to 33 bits (Barrett's mu).
constexpr uint64_t BarrettMu() {
  const uint64_t p = uint64_t{1} << 32 | Reflect(kPoly, 32);
  uint64_t rem = 0, quo = 0;
  for (int i = 64; i >= 0; --i) {
    rem = rem << 1 | (i == 64 ? 1 : 0);
    quo <<= 1;
    if (rem >> 32) {
      rem ^= p;
      quo |= 1;
    }
  }
  return Reflect(quo, 33);
}

constexpr uint64_t kFold512Lo = XPowModP(512 + 32), kFold512Hi = XPowModP(512 - 32);
constexpr uint64_t kFold128Lo = XPowModP(128 + 32), kFold128Hi = XPowModP(128 - 32);
constexpr uint64_t kFold64 = XPowModP(64);
constexpr uint64_t kMu = BarrettMu();
constexpr uint64_t kPolyFull = uint64_t{kPoly} << 1 | 1;  // P, x^32 included, reflected.
static_assert(kFold512Lo == 0x154442bd4 && kFold512Hi == 0x1c6e41596, "x^544, x^480");
static_assert(kFold128Lo == 0x1751997d0 && kFold128Hi == 0xccaa009e, "x^160, x^96");
static_assert(kFold64 == 0x163cd6124 && kMu == 0x1f7011641, "x^64, floor(x^64 / P)");
static_assert(kPolyFull == 0x1db710641, "P");

#define FSDP_CRC32_CLMUL __attribute__((target("pclmul,sse4.1")))

FSDP_CRC32_CLMUL inline __m128i Pair(uint64_t lo, uint64_t hi) {
  return _mm_set_epi64x(static_cast<int64_t>(hi), static_cast<int64_t>(lo));
}

// `k` is Pair(x^(d+32), x^(d-32)) for the distance d from `x` to `next`.
FSDP_CRC32_CLMUL inline __m128i Fold(__m128i x, __m128i k, __m128i next) {
  const __m128i hi_half = _mm_clmulepi64_si128(x, k, 0x00);
  const __m128i lo_half = _mm_clmulepi64_si128(x, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(hi_half, lo_half), next);
}

// The register after a stream whose polynomial is congruent to the block
// `x`: x * x^32 mod P.
FSDP_CRC32_CLMUL uint32_t Reduce128(__m128i x) {
  const __m128i low32 = _mm_set_epi32(0, 0, 0, -1);
  const __m128i k = Pair(kFold128Hi, kFold64);
  // 128 -> 96 bits, times x^32 (which the register needs): the high half
  // moves 64 bits on, and the low half shifts into its place.
  x = _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_srli_si128(x, 8));
  // 96 -> 64 bits: the top 32 bits move 64 bits on.
  x = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x, low32), k, 0x10), _mm_srli_si128(x, 4));
  // Barrett: t = floor(floor(x / x^32) * mu / x^32), then x - t * P < x^32.
  const __m128i b = Pair(kMu, kPolyFull);
  __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x, low32), b, 0x00);
  t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), b, 0x10);
  return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(x, t), 1));
}

// `n` >= 4 blocks of 16 bytes at 16-byte aligned `p`; four independent
// chains hide PCLMULQDQ's latency.
FSDP_CRC32_CLMUL uint32_t ClmulBlocks(const unsigned char* p, size_t n, uint32_t c) {
  const auto* v = reinterpret_cast<const __m128i*>(p);
  __m128i x0 = _mm_xor_si128(_mm_load_si128(v), _mm_cvtsi32_si128(static_cast<int>(c)));
  __m128i x1 = _mm_load_si128(v + 1);
  __m128i x2 = _mm_load_si128(v + 2);
  __m128i x3 = _mm_load_si128(v + 3);
  const __m128i k512 = Pair(kFold512Lo, kFold512Hi);
  size_t i = 4;
  for (; i + 4 <= n; i += 4) {
    x0 = Fold(x0, k512, _mm_load_si128(v + i));
    x1 = Fold(x1, k512, _mm_load_si128(v + i + 1));
    x2 = Fold(x2, k512, _mm_load_si128(v + i + 2));
    x3 = Fold(x3, k512, _mm_load_si128(v + i + 3));
  }
  const __m128i k128 = Pair(kFold128Lo, kFold128Hi);
  __m128i x = Fold(Fold(Fold(x0, k128, x1), k128, x2), k128, x3);
  for (; i < n; ++i) x = Fold(x, k128, _mm_load_si128(v + i));
  return Reduce128(x);
}

// The unaligned head, the tail under 16 bytes and inputs too short to fold
// go through the tables.
template <size_t kAlign, size_t kMinBlocks,
          uint32_t (*Blocks)(const unsigned char*, size_t, uint32_t)>
uint32_t Folding(const void* data, size_t size, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  const size_t head = (0 - reinterpret_cast<uintptr_t>(p)) & (kAlign - 1);
  if (size < head + kMinBlocks * 16) return ~TableUpdate(p, size, c);
  c = TableUpdate(p, head, c);
  p += head;
  size -= head;
  const size_t n = size / 16;
  c = Blocks(p, n, c);
  return ~TableUpdate(p + n * 16, size % 16, c);
}

uint32_t ClmulCrc32(const void* data, size_t size, uint32_t crc) {
  return Folding<16, 4, ClmulBlocks>(data, size, crc);
}

bool HasClmul() {
  __builtin_cpu_init();  // In case of a call from another file's static initializer.
  return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
}

#endif  // defined(__x86_64__)

}  // namespace

uint32_t Crc32Table(const void* data, size_t size, uint32_t crc) {
  return ~TableUpdate(static_cast<const unsigned char*>(data), size, ~crc);
}

Crc32Fn Crc32Clmul() {
#if defined(__x86_64__)
  static const bool supported = HasClmul();
  if (supported) return &ClmulCrc32;
#endif
  return nullptr;
}

Crc32Fn Crc32Chosen() {
  static const Crc32Fn chosen = [] {
    if (Crc32Fn f = Crc32Clmul()) return f;
    return &Crc32Table;
  }();
  return chosen;
}

}  // namespace crc32_internal

uint32_t Crc32(const void* data, size_t size, uint32_t crc) {
  return crc32_internal::Crc32Chosen()(data, size, crc);
}

}  // namespace fsdp
