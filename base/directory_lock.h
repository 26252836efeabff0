// One job owns an output directory at a time: an exclusive lock on
// `<dir>/.lock` (flock), taken before anything is written there and held
// for the job's life. The kernel releases it when its holder exits, however
// it exits, so a crashed job never leaves a stale lock; the file itself
// stays (removing it would let two jobs lock two different files).
//
// The holder writes who it is into the file (program, pid, host, start
// time), so that a job refused the lock can name the job that has it.
//
// A job's ranks and its launcher are one job: a process whose parent holds
// the lock (a launcher that took it for the ranks it starts) shares it
// rather than being refused. The lock lives as long as the process that
// took it: a launcher's outlives its ranks; under torchrun or srun, rank 0
// takes it, and the other ranks of a job whose rank 0 died may write on
// until their collectives time out.
//
// Each lock is one open file description, not inherited across exec. It
// covers the processes of one host, and of hosts sharing a network file
// system as far as that implements flock: NFS does, as a whole-file POSIX
// lock, which any close() of another descriptor of the file in the holding
// process releases (nothing here opens the file again). A file system that
// refuses flock altogether is reported as such (kUnimplemented), for the
// caller to decide whether to go on unlocked.
//
// Thread-compatible: Acquire is safe from any thread; one DirectoryLock is
// not shared between threads.
#ifndef FSDP_BASE_DIRECTORY_LOCK_H_
#define FSDP_BASE_DIRECTORY_LOCK_H_

#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace fsdp {

class DirectoryLock {
 public:
  // The lock file's name inside a locked directory.
  static constexpr char kFileName[] = ".lock";

  // Takes `dir`'s lock for this process (`program` names it to whoever is
  // refused), or shares the parent process's. `dir` must exist. Never
  // waits: kFailedPrecondition at once when another job holds it, naming
  // the holder (after at most 1 s for a holder that took it a moment ago to
  // write its name); kUnimplemented when the file system has no flock;
  // kUnavailable when the lock file cannot be made or locked.
  static absl::StatusOr<DirectoryLock> Acquire(const std::string& dir, const std::string& program);

  DirectoryLock(DirectoryLock&& other) noexcept;
  DirectoryLock& operator=(DirectoryLock&& other) noexcept;
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;
  ~DirectoryLock();  // Releases the lock when this process took it.

  const std::string& dir() const { return dir_; }
  // Whether the parent process holds it (this one shares it).
  bool shared_with_parent() const { return fd_ < 0; }

 private:
  DirectoryLock(std::string dir, int fd) : dir_(std::move(dir)), fd_(fd) {}

  std::string dir_;
  int fd_ = -1;  // The locked file; -1 when shared with the parent.
};

}  // namespace fsdp

#endif  // FSDP_BASE_DIRECTORY_LOCK_H_
