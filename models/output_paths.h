// Output paths of a job, checked when it starts rather than when first
// written: a directory that cannot be created or written to fails the job
// before any training, naming the flag, the path and the real errno,
// instead of after hours, losing the work.
//
// The Prepare functions create what is missing (with parents, mode 0755)
// and prove the directory writable by creating, writing and removing a file
// of their own in it; they never create or change the output file itself.
// The Check functions only look.
#ifndef FSDP_MODELS_OUTPUT_PATHS_H_
#define FSDP_MODELS_OUTPUT_PATHS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace fsdp {

// `dir` (named by `flag` in errors, e.g. "--checkpoint_dir") exists and is
// writable afterwards. kFailedPrecondition naming the path and errno.
absl::Status PrepareOutputDirectory(const std::string& flag, const std::string& dir);

// The directory that will hold the file `path` exists and is writable; a
// directory at `path` itself is refused.
absl::Status PrepareOutputFile(const std::string& flag, const std::string& path);

// One output of a job: the flag that names it, its path, and whether it is
// a directory the job writes into (else a file). `owns`: the names
// (fnmatch globs) of the entries the job makes, replaces or removes
// directly in that directory; empty: all of them.
struct OutputPath {
  std::string flag;
  std::string path;
  bool directory = false;
  std::vector<std::string> owns;
};

// Outputs of one job must not overlap: no two name the same path (after
// symbolic links, "." and "..", or as hard links and bind mounts of what
// exists), and none lies in an entry an output directory owns. kInvalidArgument naming both flags of the first overlap.
// Paths need not exist.
absl::Status CheckOutputsDisjoint(const std::vector<OutputPath>& outputs);

// `output` must be absent, an empty directory, or (told so by the caller)
// replaceable: kAlreadyExists naming the flag, what is there (a file of N
// bytes, a checkpoint, other entries) and `overwrite_flag`, the way to
// replace it anyway. A directory's lock file (base/directory_lock.h) does
// not count.
absl::Status CheckNothingToReplace(const OutputPath& output, const std::string& overwrite_flag);

}  // namespace fsdp

#endif  // FSDP_MODELS_OUTPUT_PATHS_H_
