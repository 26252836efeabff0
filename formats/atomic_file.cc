#include "formats/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fsdp {
namespace {

absl::Status ErrnoError(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " '", path, "': ", std::strerror(errno)));
}

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

absl::StatusOr<AtomicFileWriter> AtomicFileWriter::Open(const std::string& path) {
  static std::atomic<int> counter{0};
  std::string temp = absl::StrCat(path, ".tmp-", getpid(), "-", counter++);
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError("cannot create", temp);
  return AtomicFileWriter(path, std::move(temp), fd);
}

AtomicFileWriter::AtomicFileWriter(std::string path, std::string temp_path, int fd)
    : path_(std::move(path)), temp_path_(std::move(temp_path)), fd_(fd) {}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& other) noexcept
    : path_(std::move(other.path_)),
      temp_path_(std::move(other.temp_path_)),
      fd_(std::exchange(other.fd_, -1)),
      bytes_written_(other.bytes_written_),
      committed_(std::exchange(other.committed_, true)) {}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_path_.empty()) ::unlink(temp_path_.c_str());
}

absl::Status AtomicFileWriter::Write(const void* data, size_t size) {
  const char* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_, bytes, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("cannot write", temp_path_);
    }
    bytes += n;
    size -= static_cast<size_t>(n);
    bytes_written_ += n;
  }
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Flush() {
  if (fd_ < 0) return absl::OkStatus();
  if (::fsync(fd_) != 0) return ErrnoError("cannot flush", temp_path_);
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) return ErrnoError("cannot close", temp_path_);
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Commit() {
  if (absl::Status flushed = Flush(); !flushed.ok()) return flushed;
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    return ErrnoError(absl::StrCat("cannot rename '", temp_path_, "' to"), path_);
  }
  committed_ = true;
  const std::string dir = DirectoryOf(path_);
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);  // Best effort: the rename is durable once this returns.
    ::close(dir_fd);
  }
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, const void* data, size_t size) {
  absl::StatusOr<AtomicFileWriter> writer = AtomicFileWriter::Open(path);
  if (!writer.ok()) return writer.status();
  if (absl::Status s = writer->Write(data, size); !s.ok()) return s;
  return writer->Commit();
}

}  // namespace fsdp
