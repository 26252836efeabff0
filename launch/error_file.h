// A rank's last word, torchelastic's way: a launcher gives each rank a
// file to write (TORCHELASTIC_ERROR_FILE) and, when the rank fails, reads
// what it wrote: the message, when, and (ours) the step it was at. The
// restart logic (local_launcher.h) tells a failure that repeats from one
// that does not by it; torchrun reads the same files, and a Python rank's
// @record writes them.
//
// The format is torchelastic's:
//   {"message": {"message": "...", "extraInfo": {"timestamp": "<s>", ...}}}
// (an older form is {"message": "..."}). Ours adds "timestamp_ns" and
// "step" to extraInfo; readers that do not know them ignore them.
#ifndef FSDP_LAUNCH_ERROR_FILE_H_
#define FSDP_LAUNCH_ERROR_FILE_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace fsdp {

struct RankError {
  std::string message;
  std::optional<int64_t> step;  // Absent when the rank did not say.
  int64_t timestamp_ns = 0;     // Wall clock; 0 when the file gives none.
};

// Writes `message` (and `step`, when known) to $TORCHELASTIC_ERROR_FILE, if
// the launcher set it; returns false when it is not set or cannot be
// written (the rank's own stderr still has the message). Written whole
// and renamed into place, so a reader never sees half a file.
bool WriteRankErrorFile(const std::string& message, std::optional<int64_t> step);

// What the rank wrote; kNotFound when it wrote nothing, kInvalidArgument
// when the file is not one of the forms above.
absl::StatusOr<RankError> ReadRankErrorFile(const std::string& path);

}  // namespace fsdp

#endif  // FSDP_LAUNCH_ERROR_FILE_H_
