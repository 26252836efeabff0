// What safetensors.cc (one file) and safetensors_checkpoint.cc (a
// directory of files and their index) share: bounds on the JSON a file
// controls, and reads that name the file.
#ifndef FSDP_HF_SAFETENSORS_INTERNAL_H_
#define FSDP_HF_SAFETENSORS_INTERNAL_H_

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace fsdp::hf::safetensors_internal {

// The safetensors crate's limit; a longer header (or index) is refused
// before reading.
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// JSON nesting beyond a header's (object, entry, shape) is refused before
// parsing: messages and the parsed value then stay small.
inline constexpr int kMaxJsonDepth = 3;
bool NestedAtMost(absl::string_view text, int max_depth);

// A value the file controls, short, for a message.
std::string Shown(const nlohmann::json& value);

std::string Errno(int error);

// Reads exactly `size` bytes at `offset`; a short file is kDataLoss naming
// `path`.
absl::Status ReadAt(int fd, void* out, uint64_t size, uint64_t offset, absl::string_view path);

}  // namespace fsdp::hf::safetensors_internal

#endif  // FSDP_HF_SAFETENSORS_INTERNAL_H_
