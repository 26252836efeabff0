// FNV-1a (64-bit): the project's one hash for values that ranks compute
// apart and then compare (collective histories, wrap plans). Unlike
// std::hash it is the same in every process, build and host.
//
//   uint64_t h = fsdp::kFnv1aOffsetBasis;
//   h = fsdp::Fnv1aString(h, "blocks.0");
//   h = fsdp::Fnv1a(h, &numel, sizeof(numel));
//
// Not for adversarial input: collisions are easy to construct on purpose.
#ifndef FSDP_BASE_FNV1A_H_
#define FSDP_BASE_FNV1A_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace fsdp {

inline constexpr uint64_t kFnv1aOffsetBasis = 14695981039346656037ull;

// `hash` extended by `size` bytes at `data`.
inline uint64_t Fnv1a(uint64_t hash, const void* data, size_t size) {
  constexpr uint64_t kPrime = 1099511628211ull;
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) {
    hash ^= bytes[i];
    hash *= kPrime;
  }
  return hash;
}

// `hash` extended by a string's length, then its bytes: the length makes a
// sequence of strings hash by its elements ("ab","c" differs from "a","bc").
inline uint64_t Fnv1aString(uint64_t hash, std::string_view text) {
  const uint64_t size = text.size();
  hash = Fnv1a(hash, &size, sizeof(size));
  return Fnv1a(hash, text.data(), text.size());
}

}  // namespace fsdp

#endif  // FSDP_BASE_FNV1A_H_
