#include "models/output_paths.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace fsdp {
namespace {

absl::Status Refuse(const std::string& flag, const std::string& path, const std::string& what,
                    const std::string& target, int error) {
  return absl::FailedPreconditionError(absl::StrCat(flag, "=", path, ": cannot ", what, " '",
                                                    target, "': ", std::strerror(error)));
}

// mkdir -p, reporting the component that failed.
absl::Status MakeDirectories(const std::string& flag, const std::string& shown,
                             const std::string& dir) {
  for (size_t end = dir.find('/', 1);; end = dir.find('/', end + 1)) {
    const std::string prefix = dir.substr(0, end);
    if (!prefix.empty() && mkdir(prefix.c_str(), 0755) != 0) {
      const int error = errno;
      struct stat st;
      if (error != EEXIST) return Refuse(flag, shown, "create", prefix, error);
      if (stat(prefix.c_str(), &st) != 0) return Refuse(flag, shown, "examine", prefix, errno);
      if (!S_ISDIR(st.st_mode)) return Refuse(flag, shown, "create", prefix, ENOTDIR);
    }
    if (end == std::string::npos) return absl::OkStatus();
  }
}

// Creates, writes, syncs and removes a file in `dir`: permissions,
// read-only and immutable directories, and a full disk all show here.
absl::Status ProbeWritable(const std::string& flag, const std::string& shown,
                           const std::string& dir) {
  const std::string probe = absl::StrCat(dir, "/.write-probe-", getpid());
  const int fd = open(probe.c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Refuse(flag, shown, "write to", dir, errno);
  const char byte = 0;
  int error = 0;
  if (write(fd, &byte, 1) != 1 || fsync(fd) != 0) error = errno;
  close(fd);
  unlink(probe.c_str());
  if (error != 0) return Refuse(flag, shown, "write to", dir, error);
  return absl::OkStatus();
}

}  // namespace

absl::Status PrepareOutputDirectory(const std::string& flag, const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError(flag + ": empty path");
  if (absl::Status made = MakeDirectories(flag, dir, dir); !made.ok()) return made;
  return ProbeWritable(flag, dir, dir);
}

absl::Status PrepareOutputFile(const std::string& flag, const std::string& path) {
  if (path.empty() || path.back() == '/') {
    return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, ": not a file path"));
  }
  struct stat st;
  if (stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, "=", path, ": is a directory, not a file"));
  }
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash);
  if (absl::Status made = MakeDirectories(flag, path, dir); !made.ok()) return made;
  return ProbeWritable(flag, path, dir);
}

}  // namespace fsdp
