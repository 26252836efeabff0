// Output paths of a job, checked when it starts rather than when first
// written: a directory that cannot be created or written to fails the job
// before any training, naming the flag, the path and the real errno,
// instead of after hours, losing the work.
//
// Both functions create what is missing (with parents, mode 0755) and prove
// the directory writable by creating, writing and removing a file of their
// own in it; they never create or change the output file itself.
#ifndef FSDP_MODELS_OUTPUT_PATHS_H_
#define FSDP_MODELS_OUTPUT_PATHS_H_

#include <string>

#include "absl/status/status.h"

namespace fsdp {

// `dir` (named by `flag` in errors, e.g. "--checkpoint_dir") exists and is
// writable afterwards. kFailedPrecondition naming the path and errno.
absl::Status PrepareOutputDirectory(const std::string& flag, const std::string& dir);

// The directory that will hold the file `path` exists and is writable; a
// directory at `path` itself is refused.
absl::Status PrepareOutputFile(const std::string& flag, const std::string& path);

}  // namespace fsdp

#endif  // FSDP_MODELS_OUTPUT_PATHS_H_
