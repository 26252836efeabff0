#include "formats/crc32.h"

#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace fsdp {
namespace {

using crc32_internal::Crc32Fn;

// Straight from the definition, one bit at a time: too slow to be clever.
uint32_t Reference(const unsigned char* p, size_t n, uint32_t crc = 0) {
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1)));
  }
  return ~c;
}

// Random bytes starting at a 64-byte boundary, the widest alignment a path
// cares about, so that offsets from data() choose each head length.
class Bytes {
 public:
  Bytes(size_t n, uint64_t seed) : storage_(n + 64) {
    const size_t skew = reinterpret_cast<uintptr_t>(storage_.data()) % 64;
    data_ = storage_.data() + (64 - skew) % 64;
    std::mt19937_64 rng(seed);
    for (size_t i = 0; i < n; ++i) data_[i] = static_cast<unsigned char>(rng());
  }
  const unsigned char* data() const { return data_; }

 private:
  std::vector<unsigned char> storage_;
  unsigned char* data_;
};

enum class Path { kCrc32, kTable, kClmul };

const char* Name(Path path) {
  switch (path) {
    case Path::kCrc32:
      return "Crc32";
    case Path::kTable:
      return "Table";
    case Path::kClmul:
      return "Clmul";
  }
  return "Unknown";
}

// For gtest's failure messages, which otherwise print the enum's bytes.
void PrintTo(Path path, std::ostream* os) { *os << Name(path); }

Crc32Fn Get(Path path) {
  switch (path) {
    case Path::kCrc32:
      return [](const void* data, size_t size, uint32_t crc) { return Crc32(data, size, crc); };
    case Path::kTable:
      return &crc32_internal::Crc32Table;
    case Path::kClmul:
      return crc32_internal::Crc32Clmul();
  }
  return nullptr;
}

class Crc32PathTest : public ::testing::TestWithParam<Path> {
 protected:
  void SetUp() override {
    crc_ = Get(GetParam());
    if (crc_ == nullptr) GTEST_SKIP() << "this CPU or build has no such path";
  }

  Crc32Fn crc_ = nullptr;
};

TEST(Crc32ReferenceTest, MatchesZlib) {
  const std::string check = "123456789";
  EXPECT_EQ(Reference(reinterpret_cast<const unsigned char*>(check.data()), check.size()),
            0xCBF43926u);
}

TEST_P(Crc32PathTest, KnownVectors) {
  auto of = [&](const std::string& s) { return crc_(s.data(), s.size(), 0); };
  EXPECT_EQ(of(""), 0u);
  EXPECT_EQ(crc_(nullptr, 0, 0x12345678u), 0x12345678u);
  EXPECT_EQ(of("a"), 0xE8B7BE43u);
  EXPECT_EQ(of("123456789"), 0xCBF43926u);
  EXPECT_EQ(of("The quick brown fox jumps over the lazy dog"), 0x414FA339u);
  // Long enough to fold; the values are Python's zlib.crc32.
  EXPECT_EQ(of(std::string(1 << 20, '\0')), 0xA738EA1Cu);
  std::string pattern(100003, '\0');
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<char>(i * 31 + 7);
  EXPECT_EQ(of(pattern), 0x17340963u);
}

TEST_P(Crc32PathTest, EveryLengthTo600) {
  const Bytes bytes(600, 1);
  std::mt19937 rng(2);
  for (size_t n = 0; n <= 600; ++n) {
    const uint32_t init = rng();
    EXPECT_EQ(crc_(bytes.data(), n, 0), Reference(bytes.data(), n)) << n;
    EXPECT_EQ(crc_(bytes.data(), n, init), Reference(bytes.data(), n, init)) << n;
  }
}

TEST_P(Crc32PathTest, LargeBuffers) {
  const Bytes bytes((3 << 20) + 64, 3);
  for (size_t n : {(1 << 20) + 1, (1 << 20) + 15, (1 << 20) + 63, (3 << 20) + 37}) {
    for (size_t at : {0, 7}) {
      EXPECT_EQ(crc_(bytes.data() + at, n, 0), Reference(bytes.data() + at, n)) << n << "@" << at;
    }
  }
}

TEST_P(Crc32PathTest, EveryAlignment) {
  const Bytes bytes(70000, 4);
  for (size_t at = 0; at < 64; ++at) {
    for (size_t n : {1, 15, 63, 64, 65, 79, 80, 100, 255, 256, 511, 512, 513, 1000, 4099, 65543}) {
      EXPECT_EQ(crc_(bytes.data() + at, n, 0), Reference(bytes.data() + at, n)) << n << "@" << at;
    }
  }
}

TEST_P(Crc32PathTest, ChainsAtRandomSplits) {
  constexpr size_t kSize = 20000;
  const Bytes bytes(kSize, 5);
  const uint32_t whole = Reference(bytes.data(), kSize);
  std::mt19937 rng(6);
  for (int trial = 0; trial < 300; ++trial) {
    size_t a = rng() % (kSize + 1), b = rng() % (kSize + 1);
    if (a > b) std::swap(a, b);
    uint32_t crc = crc_(bytes.data(), a, 0);
    crc = crc_(bytes.data() + a, b - a, crc);
    crc = crc_(bytes.data() + b, kSize - b, crc);
    EXPECT_EQ(crc, whole) << a << "|" << b;
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, Crc32PathTest,
                         ::testing::Values(Path::kCrc32, Path::kTable, Path::kClmul),
                         [](const ::testing::TestParamInfo<Path>& info) -> std::string {
                           return Name(info.param);
                         });

// A detection that silently failed would leave every path test above green
// while Crc32 ran 20 times slower.
TEST(Crc32DispatchTest, ChoosesFoldingWhereTheCpuHasIt) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1")) {
    EXPECT_NE(crc32_internal::Crc32Clmul(), nullptr);
  }
#endif
  Crc32Fn widest = &crc32_internal::Crc32Table;
  if (crc32_internal::Crc32Clmul() != nullptr) widest = crc32_internal::Crc32Clmul();
  EXPECT_EQ(crc32_internal::Crc32Chosen(), widest);
}

}  // namespace
}  // namespace fsdp
