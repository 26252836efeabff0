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
#ifndef FSDP_FORMATS_ATOMIC_FILE_H_
#define FSDP_FORMATS_ATOMIC_FILE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp {

class AtomicFileWriter {
 public:
  // Opens the temporary file; fails naming the path.
  static absl::StatusOr<AtomicFileWriter> Open(const std::string& path);

  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&&) = delete;
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  // Without Commit, removes the temporary file: the target is untouched.
  ~AtomicFileWriter();

  absl::Status Write(const void* data, size_t size);
  // fsync the temporary file, so that a writer of several files learns that
  // all are durable before it renames any. No Write after it. The file
  // stays open (and locked) until Commit or destruction.
  absl::Status Flush();
  // Flush (unless done), rename over the target, close, fsync the
  // directory.
  absl::Status Commit();

  int64_t bytes_written() const { return bytes_written_; }

 private:
  AtomicFileWriter(std::string path, std::string temp_path, int fd);

  std::string path_;
  std::string temp_path_;
  int fd_ = -1;
  int64_t bytes_written_ = 0;
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
