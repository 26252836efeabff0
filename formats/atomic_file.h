// Writing a file so that readers see either nothing or all of it: the bytes
// go to a temporary file beside the target, which is flushed to disk and
// then renamed over the target (rename is atomic within a file system), and
// the directory entry is flushed too. An interrupted write leaves at most a
// stray "<target>.tmp-<pid>-<n>" file, never a truncated target.
#ifndef FSDP_FORMATS_ATOMIC_FILE_H_
#define FSDP_FORMATS_ATOMIC_FILE_H_

#include <cstddef>
#include <cstdint>
#include <string>

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
  // fsync and close the temporary file, so that a writer of several files
  // learns that all are durable before it renames any. No Write after it.
  absl::Status Flush();
  // Flush (unless done), rename over the target, fsync the directory.
  absl::Status Commit();

  int64_t bytes_written() const { return bytes_written_; }

 private:
  AtomicFileWriter(std::string path, std::string temp_path, int fd);

  std::string path_;
  std::string temp_path_;
  int fd_ = -1;
  int64_t bytes_written_ = 0;
  bool committed_ = false;
};

// The whole of `data` as the file at `path`, atomically.
absl::Status WriteFileAtomically(const std::string& path, const void* data, size_t size);

}  // namespace fsdp

#endif  // FSDP_FORMATS_ATOMIC_FILE_H_
