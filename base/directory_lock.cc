#include "base/directory_lock.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <map>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status.h"

namespace fsdp {
namespace {

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

std::string UtcNow() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%d %H:%M:%S UTC", &utc);
  return text;
}

// The holder's key=value lines, as Acquire writes them.
std::map<std::string, std::string> ReadHolder(int fd) {
  std::string text;
  char buffer[512];
  for (off_t at = 0;;) {
    const ssize_t n = pread(fd, buffer, sizeof(buffer), at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || text.size() > 4096) break;
    text.append(buffer, static_cast<size_t>(n));
    at += n;
  }
  std::map<std::string, std::string> holder;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(line, absl::MaxSplits('=', 1));
    holder[kv.first] = kv.second;
  }
  return holder;
}

}  // namespace

absl::StatusOr<DirectoryLock> DirectoryLock::Acquire(const std::string& dir,
                                                     const std::string& program) {
  const std::string path = absl::StrCat(dir, "/", kFileName);
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot open the lock file '", path, "': ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("the lock file '", path, "' is not a regular file"));
  }
  int locked;
  do {
    locked = flock(fd, LOCK_EX | LOCK_NB);
  } while (locked != 0 && errno == EINTR);
  if (locked == 0) {
    const std::string holder = absl::StrCat("program=", program, "\npid=", getpid(),
                                            "\nhost=", HostName(), "\nsince=", UtcNow(), "\n");
    if (ftruncate(fd, 0) != 0 ||
        pwrite(fd, holder.data(), holder.size(), 0) != static_cast<ssize_t>(holder.size())) {
      const int error = errno;
      close(fd);
      return absl::UnavailableError(
          absl::StrCat("cannot write the lock file '", path, "': ", std::strerror(error)));
    }
    return DirectoryLock(dir, fd);
  }
  if (errno != EWOULDBLOCK) {
    const int error = errno;
    close(fd);
    const std::string why = absl::StrCat("cannot lock '", path, "': ", std::strerror(error));
    if (error == ENOLCK || error == EOPNOTSUPP || error == ENOSYS) {
      return absl::UnimplementedError(
          absl::StrCat(why, " (its file system does not support flock)"));
    }
    return absl::UnavailableError(why);
  }
  // The holder writes who it is right after taking the lock: a job that
  // lost a race by microseconds may read the file before that, empty or
  // still naming an earlier holder, which has ended.
  const std::string host = HostName();
  std::map<std::string, std::string> holder;
  int pid = 0;
  bool known = false;
  for (int attempt = 0; attempt < 50; ++attempt) {
    holder = ReadHolder(fd);
    known = absl::SimpleAtoi(holder["pid"], &pid) && pid > 0;
    const bool ended = known && holder["host"] == host && kill(pid, 0) != 0 && errno == ESRCH;
    if (known && !ended) break;
    known = false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  close(fd);
  if (known && pid == getppid() && holder["host"] == host) {
    return DirectoryLock(dir, -1);
  }
  const auto shown = [](const std::string& value) { return PrintableText(value); };
  return absl::FailedPreconditionError(absl::StrCat(
      "'", dir, "' is in use by another job: ",
      known ? absl::StrCat(shown(holder["program"]), ", pid ", pid, " on host ",
                           shown(holder["host"]), " (since ", shown(holder["since"]), ")")
            : absl::StrCat("its lock file '", path, "' does not name it yet"),
      "; one job writes to a directory at a time: wait for it to finish, or use another "
      "directory"));
}

DirectoryLock::DirectoryLock(DirectoryLock&& other) noexcept
    : dir_(std::move(other.dir_)), fd_(std::exchange(other.fd_, -1)) {}

DirectoryLock& DirectoryLock::operator=(DirectoryLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    dir_ = std::move(other.dir_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) close(fd_);
}

}  // namespace fsdp
