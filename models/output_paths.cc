#include "models/output_paths.h"

#include <dirent.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/directory_lock.h"
#include "base/status.h"

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

// `path` made absolute, with the symbolic links, "." and ".." of its
// longest existing prefix resolved and the rest normalized by name.
std::string CanonicalPath(const std::string& path) {
  std::string absolute = path;
  if (absolute.empty() || absolute[0] != '/') {
    char cwd[PATH_MAX];
    absolute = absl::StrCat(getcwd(cwd, sizeof(cwd)) != nullptr ? cwd : ".", "/", path);
  }
  const std::vector<std::string> parts = absl::StrSplit(absolute, '/', absl::SkipEmpty());
  for (size_t known = parts.size() + 1; known-- > 0;) {
    const std::string prefix =
        absl::StrCat("/", absl::StrJoin(parts.begin(), parts.begin() + known, "/"));
    char resolved[PATH_MAX];
    if (realpath(prefix.c_str(), resolved) == nullptr) continue;
    std::string out = resolved;
    for (size_t k = known; k < parts.size(); ++k) {
      if (parts[k] == ".") continue;
      if (parts[k] == "..") {
        const size_t slash = out.rfind('/');
        out.resize(slash == 0 ? 1 : slash);
        continue;
      }
      if (out.back() != '/') out += '/';
      out += parts[k];
    }
    return out;
  }
  return absolute;
}

std::string Shown(const OutputPath& output) { return absl::StrCat(output.flag, "=", output.path); }

}  // namespace

absl::Status CheckOutputsDisjoint(const std::vector<OutputPath>& outputs) {
  std::vector<std::string> canonical;
  for (const OutputPath& output : outputs) canonical.push_back(CanonicalPath(output.path));
  for (size_t a = 0; a < outputs.size(); ++a) {
    for (size_t b = 0; b < outputs.size(); ++b) {
      if (a == b) continue;
      struct stat sa, sb;
      const bool same_file = stat(outputs[a].path.c_str(), &sa) == 0 &&
                             stat(outputs[b].path.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
                             sa.st_ino == sb.st_ino;  // Hard links, bind mounts.
      if (a < b && (canonical[a] == canonical[b] || same_file)) {
        return absl::InvalidArgumentError(
            absl::StrCat(Shown(outputs[a]), " and ", Shown(outputs[b]), " name the same ",
                         outputs[a].directory || outputs[b].directory ? "path" : "file",
                         ": one would overwrite the other; give each output its own path"));
      }
      const std::string inside = canonical[b] == "/" ? "/" : canonical[b] + "/";
      if (!outputs[b].directory || !absl::StartsWith(canonical[a], inside)) continue;
      const std::string entry = canonical[a].substr(inside.size(),
                                                    canonical[a].find('/', inside.size()) -
                                                        inside.size());
      bool owned = outputs[b].owns.empty();
      for (const std::string& glob : outputs[b].owns) {
        owned = owned || fnmatch(glob.c_str(), entry.c_str(), 0) == 0;
      }
      if (owned) {
        return absl::InvalidArgumentError(absl::StrCat(
            Shown(outputs[a]), " lies inside ", Shown(outputs[b]), ", in ",
            outputs[b].owns.empty()
                ? std::string("a directory this job writes into")
                : absl::StrCat("'", PrintableText(entry), "', which this job writes there"),
            ": give each output its own path"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckNothingToReplace(const OutputPath& output, const std::string& overwrite_flag) {
  struct stat st;
  if (stat(output.path.c_str(), &st) != 0) return absl::OkStatus();
  std::string what;
  if (!output.directory) {
    what = absl::StrCat("a file of ", static_cast<int64_t>(st.st_size), " bytes");
  } else if (S_ISDIR(st.st_mode)) {
    DIR* d = opendir(output.path.c_str());
    // Unreadable: the job cannot write there either, as PrepareOutputDirectory
    // reports.
    if (d == nullptr) return absl::OkStatus();
    std::vector<std::string> names;
    bool dcp = false, sharded = false, steps = false;
    while (const dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name == "." || name == ".." || name == DirectoryLock::kFileName ||
          absl::StartsWith(name, ".write-probe-")) {
        continue;
      }
      names.push_back(name);
      dcp = dcp || name == ".metadata";
      sharded = sharded || name == "manifest.pb";
      steps = steps || absl::StartsWith(name, "step-");
    }
    closedir(d);
    if (names.empty()) return absl::OkStatus();
    what = dcp       ? std::string("a Distributed Checkpoint (.metadata)")
           : sharded ? std::string("a SHARDED checkpoint (manifest.pb)")
           : steps   ? std::string("a run's checkpoints (step-NNNNNNNN directories)")
                     : absl::StrCat(names.size(), " entries, among them '",
                                    PrintableText(names.front()), "'");
  } else {
    return absl::OkStatus();  // Not a directory: PrepareOutputDirectory refuses it.
  }
  return absl::AlreadyExistsError(
      absl::StrCat(Shown(output), ": it already holds ", what, ", which this job would replace: ",
                   overwrite_flag, " replaces it; or choose another path"));
}

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
