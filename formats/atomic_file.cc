#include "formats/atomic_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

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

constexpr size_t kPage = 4096;

// Buffers of finished writers. Never destroyed: writers may finish during
// static destruction.
struct BufferPool {
  std::mutex mu;
  std::vector<char*> free;
};

BufferPool& Pool() {
  static BufferPool* pool = new BufferPool;
  return *pool;
}

char* TakeBuffer() {
  BufferPool& pool = Pool();
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    if (!pool.free.empty()) {
      char* buffer = pool.free.back();
      pool.free.pop_back();
      return buffer;
    }
  }
  // O_DIRECT wants the memory, the file offset and the length aligned to
  // the device's logical block; a page covers every common device.
  return static_cast<char*>(std::aligned_alloc(kPage, AtomicFileWriter::kDirectWriteBytes));
}

}  // namespace

void AtomicFileWriter::ReturnBuffer::operator()(char* buffer) const {
  BufferPool& pool = Pool();
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    if (pool.free.size() < 2) {
      pool.free.push_back(buffer);
      return;
    }
  }
  std::free(buffer);
}

absl::StatusOr<AtomicFileWriter> AtomicFileWriter::Open(const std::string& path) {
  static std::atomic<int> counter{0};
  // A name of its own: another process with this pid (another container on
  // a shared directory) may be writing one of the same name.
  std::string temp;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    temp = absl::StrCat(path, ".tmp-", getpid(), "-", counter++);
    fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) return ErrnoError("cannot create", temp);
  // Marks the file as this live writer's (RemoveAbandonedTempFiles). A file
  // system without flock (some network mounts) still gets atomic writes.
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno != ENOLCK && errno != EOPNOTSUPP) {
    const absl::Status locked = ErrnoError("cannot lock", temp);
    ::unlink(temp.c_str());
    ::close(fd);
    return locked;
  }
  return AtomicFileWriter(path, std::move(temp), fd);
}

AtomicFileWriter::AtomicFileWriter(std::string path, std::string temp_path, int fd)
    : path_(std::move(path)), temp_path_(std::move(temp_path)), fd_(fd) {}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& other) noexcept
    : path_(std::move(other.path_)),
      temp_path_(std::move(other.temp_path_)),
      fd_(std::exchange(other.fd_, -1)),
      bytes_written_(other.bytes_written_),
      direct_bytes_(other.direct_bytes_),
      error_(std::move(other.error_)),
      buffer_(std::move(other.buffer_)),
      buffered_(std::exchange(other.buffered_, 0)),
      direct_(other.direct_),
      flushed_(other.flushed_),
      committed_(std::exchange(other.committed_, true)) {}

AtomicFileWriter::~AtomicFileWriter() {
  // Removed while still locked: no clean-up mistakes it for abandoned.
  if (!committed_ && !temp_path_.empty()) ::unlink(temp_path_.c_str());
  if (fd_ >= 0) ::close(fd_);
}

absl::Status AtomicFileWriter::Write(const void* data, size_t size) {
  if (!error_.ok()) return error_;
  if (flushed_ || fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write '", temp_path_, "': the file was flushed or committed"));
  }
  const char* bytes = static_cast<const char*>(data);
  if (buffer_ == nullptr && size > 0) {
    buffer_.reset(TakeBuffer());
    if (buffer_ == nullptr) {  // No memory to spare: the page cache it is.
      direct_ = Direct::kOff;
      bytes_written_ += static_cast<int64_t>(size);
      return WriteOut(bytes, size);
    }
  }
  while (size > 0) {
    const size_t n = std::min(size, kDirectWriteBytes - buffered_);
    std::memcpy(buffer_.get() + buffered_, bytes, n);
    buffered_ += n;
    bytes += n;
    size -= n;
    bytes_written_ += static_cast<int64_t>(n);
    if (buffered_ == kDirectWriteBytes) {
      if (absl::Status written = WriteBuffer(); !written.ok()) return written;
    }
  }
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::WriteBuffer() {
  const size_t size = std::exchange(buffered_, 0);
  const size_t whole_pages = size / kPage * kPage;
  if (whole_pages > 0) {
    SetDirect(true);
    if (absl::Status written = WriteOut(buffer_.get(), whole_pages); !written.ok()) return written;
  }
  if (whole_pages == size) return absl::OkStatus();
  SetDirect(false);
  return WriteOut(buffer_.get() + whole_pages, size - whole_pages);
}

void AtomicFileWriter::SetDirect(bool on) {
  if (on) {
    if (direct_ != Direct::kUntried) return;
    const int flags = ::fcntl(fd_, F_GETFL);
    direct_ =
        flags >= 0 && ::fcntl(fd_, F_SETFL, flags | O_DIRECT) == 0 ? Direct::kOn : Direct::kOff;
    return;
  }
  // Once off, never on again: the file offset need not stay aligned. Stays
  // on where the flag cannot be cleared (WriteOut then fails, naming it).
  if (direct_ == Direct::kOn) {
    const int flags = ::fcntl(fd_, F_GETFL);
    if (flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT) != 0) return;
  }
  direct_ = Direct::kOff;
}

absl::Status AtomicFileWriter::WriteOut(const char* bytes, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd_, bytes, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      // The device wants a larger alignment than a page, the file system
      // refuses direct writes to this file, or a file size limit cut a
      // direct write to an unaligned length: the page cache takes it.
      if (errno == EINVAL && direct_ == Direct::kOn) {
        SetDirect(false);
        if (direct_ == Direct::kOff) continue;
      }
      // Sticky: the bytes that did not reach the file are gone, so no later
      // Write, Flush or Commit may succeed.
      error_ = ErrnoError("cannot write", temp_path_);
      return error_;
    }
    if (direct_ == Direct::kOn) direct_bytes_ += n;
    bytes += n;
    size -= static_cast<size_t>(n);
    // A short direct write leaves the offset unaligned.
    if (size > 0) SetDirect(false);
  }
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Flush() {
  if (!error_.ok()) return error_;
  if (flushed_ || fd_ < 0) return absl::OkStatus();
  if (absl::Status written = WriteBuffer(); !written.ok()) return written;
  // Sticky too: after a failed fsync, Linux may report the next one clean
  // although the data never reached the disk.
  if (::fsync(fd_) != 0) {
    error_ = ErrnoError("cannot flush", temp_path_);
    return error_;
  }
  flushed_ = true;
  buffer_.reset();
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Commit() {
  if (absl::Status flushed = Flush(); !flushed.ok()) return flushed;
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    return ErrnoError(absl::StrCat("cannot rename '", temp_path_, "' to"), path_);
  }
  committed_ = true;
  // Closed after the rename, so that the temporary name is locked as long
  // as it exists. fsync reported any write error already.
  ::close(std::exchange(fd_, -1));
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

namespace {

// "<name>.tmp-<digits>-<digits>", as AtomicFileWriter::Open names them.
bool IsTempFileName(const std::string& name) {
  const size_t at = name.rfind(".tmp-");
  if (at == std::string::npos || at == 0) return false;
  const std::string rest = name.substr(at + 5);
  const size_t dash = rest.find('-');
  if (dash == std::string::npos || dash == 0 || dash + 1 == rest.size()) return false;
  for (size_t i = 0; i < rest.size(); ++i) {
    if (i != dash && (rest[i] < '0' || rest[i] > '9')) return false;
  }
  return true;
}

}  // namespace

std::vector<std::string> RemoveAbandonedTempFiles(const std::string& dir) {
  std::vector<std::string> removed;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return removed;
  // Never throws (the savers call it between collectives): out of memory
  // ends the clean-up, for the next save to finish.
  try {
    while (const dirent* entry = ::readdir(d)) {
      const std::string name = entry->d_name;
      if (!IsTempFileName(name)) continue;
      const std::string path = dir + "/" + name;
      const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
      if (fd < 0) continue;
      struct stat st;
      // Locked by another open file: its writer lives. Where flock does
      // not work at all, nothing is removed.
      if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
          ::flock(fd, LOCK_EX | LOCK_NB) == 0 && ::unlink(path.c_str()) == 0) {
        removed.push_back(name);
      }
      ::close(fd);
    }
  } catch (...) {
  }
  ::closedir(d);
  return removed;
}

}  // namespace fsdp
