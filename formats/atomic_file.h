// Writing a file so that readers see either nothing or all of it: the bytes
// go to a temporary file beside the target, which is flushed to disk and
// then renamed over the target (rename is atomic within a file system), and
// the directory entry is flushed too. An interrupted write leaves at most a
// stray "<target>.tmp-<pid>-<n>" file, never a truncated target.
//
// The writer holds an exclusive flock(2) on its temporary file until it is
// renamed or removed; the kernel drops the lock when the process dies. So a
// temporary file nobody holds locked is one whose writer is gone, whichever
// process it was (RemoveAbandonedTempFiles), on a local file system. Limits:
//   - a file created and not yet locked (between open and flock,
//     microseconds) looks abandoned: the savers clean up only once every
//     rank of their job has finished writing to the directory, and the
//     main job keeps other jobs out of its directories
//     (base/directory_lock.h); a program of its own that saves into one
//     directory from two jobs at once must not;
//   - on NFS, flock is emulated with POSIX record locks, which do not
//     conflict within one process and which any close() of the file
//     drops: there a rank's clean-up could take a live temporary file of
//     another thread of its own process (thread-ranks, as in tests).
//
// Files bypass the page cache. Writes gather in an aligned buffer of
// kDirectWriteBytes, and each full buffer goes to the file with O_DIRECT;
// at Flush, so do the whole pages of what is left, and only the last
// partial page goes through the page cache. On this project's VM, copying
// 20 MB into the page cache cost a core 10-20 ms, and writing them
// directly from an aligned buffer 1-2 ms (plus the copy into the buffer):
// a SHARDED checkpoint's writer went from 13-15 ms of CPU to 8-9 ms
// (models/async_checkpoint_benchmark_results.md). Where the file system
// refuses O_DIRECT (some network, FUSE and overlay mounts) or the device
// wants a larger alignment than a page, the writer uses the page cache:
// the file is the same either way (and tmpfs keeps it in memory either
// way). A reader soon after reads the direct part from the device, not
// from memory. Once it has written a file, a process keeps two buffers
// (8 MiB) for its next writers: a fresh buffer's first touch costs a page
// fault per page.
#ifndef FSDP_FORMATS_ATOMIC_FILE_H_
#define FSDP_FORMATS_ATOMIC_FILE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp {

class AtomicFileWriter {
 public:
  // The size of the aligned buffer, and so of each direct write.
  static constexpr size_t kDirectWriteBytes = size_t{4} << 20;

  // Opens the temporary file; fails naming the path.
  static absl::StatusOr<AtomicFileWriter> Open(const std::string& path);

  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&&) = delete;
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  // Without Commit, removes the temporary file: the target is untouched.
  ~AtomicFileWriter();

  // Appends; the bytes may stay in this writer's buffer until Flush. After
  // a failed write or fsync every later Write, Flush and Commit fails the
  // same way.
  absl::Status Write(const void* data, size_t size);
  // Writes what is buffered and fsyncs the temporary file, so that a
  // writer of several files learns that all are durable before it renames
  // any. No Write after it. The file stays open (and locked) until Commit
  // or destruction.
  absl::Status Flush();
  // Flush (unless done), rename over the target, close, fsync the
  // directory.
  absl::Status Commit();

  // The bytes accepted by Write: the offset in the file the next Write's
  // bytes will have.
  int64_t bytes_written() const { return bytes_written_; }
  // How many of them went to the file with O_DIRECT, so far.
  int64_t direct_bytes() const { return direct_bytes_; }

 private:
  enum class Direct { kUntried, kOn, kOff };
  // Gives the buffer back for the next writer of this process to reuse.
  struct ReturnBuffer {
    void operator()(char* buffer) const;
  };

  AtomicFileWriter(std::string path, std::string temp_path, int fd);
  // Writes the buffer to the file: its whole pages directly (every buffer
  // but the last is full, so the file offset stays aligned), the last
  // partial page through the page cache.
  absl::Status WriteBuffer();
  absl::Status WriteOut(const char* bytes, size_t size);
  void SetDirect(bool on);

  std::string path_;
  std::string temp_path_;
  int fd_ = -1;
  int64_t bytes_written_ = 0;
  int64_t direct_bytes_ = 0;
  absl::Status error_;  // The first failed write's.
  std::unique_ptr<char, ReturnBuffer> buffer_;
  size_t buffered_ = 0;
  Direct direct_ = Direct::kUntried;
  bool flushed_ = false;
  bool committed_ = false;
};

// The whole of `data` as the file at `path`, atomically.
absl::Status WriteFileAtomically(const std::string& path, const void* data, size_t size);

// Removes the temporary files in `dir` ("<name>.tmp-<pid>-<n>", regular
// files) that no live AtomicFileWriter holds: those of a save that was
// killed or crashed. Returns the names removed. Best effort: a file it
// cannot open or remove stays (for the next save to try), and so does every
// other file. Call it where no writer of this job is between creating a
// temporary file and locking it (see the top).
std::vector<std::string> RemoveAbandonedTempFiles(const std::string& dir);

}  // namespace fsdp

#endif  // FSDP_FORMATS_ATOMIC_FILE_H_
