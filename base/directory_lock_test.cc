#include "base/directory_lock.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;

std::string TempDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(root != nullptr ? root : "/tmp", "/", name, "-", getpid());
  mkdir(dir.c_str(), 0755);
  return dir;
}

std::string LockFileText(const std::string& dir) {
  std::ifstream in(absl::StrCat(dir, "/", DirectoryLock::kFileName));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A process that is not this one's child takes the lock, says so through a
// pipe, and holds it until killed.
pid_t HolderProcess(const std::string& dir) {
  int ready[2];
  if (pipe(ready) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    close(ready[0]);
    absl::StatusOr<DirectoryLock> lock = DirectoryLock::Acquire(dir, "holder_job");
    const char byte = lock.ok() && !lock->shared_with_parent() ? 'y' : 'n';
    if (write(ready[1], &byte, 1) != 1) _exit(3);
    pause();
    _exit(0);
  }
  close(ready[1]);
  char byte = 0;
  const bool ok = read(ready[0], &byte, 1) == 1 && byte == 'y';
  close(ready[0]);
  if (!ok) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    return -1;
  }
  return pid;
}

TEST(DirectoryLock, TakesTheLockAndNamesItsHolder) {
  const std::string dir = TempDir("lock_takes");
  absl::StatusOr<DirectoryLock> lock = DirectoryLock::Acquire(dir, "my_job");
  ASSERT_TRUE(lock.ok()) << lock.status();
  EXPECT_FALSE(lock->shared_with_parent());
  const std::string text = LockFileText(dir);
  EXPECT_THAT(text, HasSubstr("program=my_job\n"));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("pid=", getpid(), "\n")));
  EXPECT_THAT(text, HasSubstr("since="));
}

TEST(DirectoryLock, AnotherJobIsRefusedAtOnceNamingTheHolder) {
  const std::string dir = TempDir("lock_refused");
  const pid_t holder = HolderProcess(dir);
  ASSERT_GT(holder, 0);
  absl::StatusOr<DirectoryLock> lock = DirectoryLock::Acquire(dir, "late_job");
  kill(holder, SIGKILL);
  waitpid(holder, nullptr, 0);
  ASSERT_FALSE(lock.ok());
  EXPECT_EQ(lock.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(lock.status().message(),
              HasSubstr(absl::StrCat("'", dir, "' is in use by another job: holder_job, pid ",
                                     holder, " on host ")));
  EXPECT_THAT(lock.status().message(), HasSubstr("one job writes to a directory at a time"));
}

TEST(DirectoryLock, TheKernelReleasesTheLockOfAKilledHolder) {
  const std::string dir = TempDir("lock_released");
  const pid_t holder = HolderProcess(dir);
  ASSERT_GT(holder, 0);
  ASSERT_FALSE(DirectoryLock::Acquire(dir, "second").ok());
  kill(holder, SIGKILL);
  waitpid(holder, nullptr, 0);
  absl::StatusOr<DirectoryLock> lock = DirectoryLock::Acquire(dir, "second");
  ASSERT_TRUE(lock.ok()) << lock.status();
  EXPECT_FALSE(lock->shared_with_parent());
  EXPECT_THAT(LockFileText(dir), HasSubstr("program=second\n"));
}

TEST(DirectoryLock, AChildSharesItsParentsLockAndAnUnrelatedJobDoesNot) {
  const std::string dir = TempDir("lock_shared");
  absl::StatusOr<DirectoryLock> lock = DirectoryLock::Acquire(dir, "launcher");
  ASSERT_TRUE(lock.ok()) << lock.status();
  const pid_t child = fork();
  if (child == 0) {
    absl::StatusOr<DirectoryLock> mine = DirectoryLock::Acquire(dir, "rank");
    _exit(mine.ok() && mine->shared_with_parent() ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  // A grandchild is not the holder's child: refused.
  const pid_t middle = fork();
  if (middle == 0) {
    const pid_t grandchild = fork();
    if (grandchild == 0) _exit(DirectoryLock::Acquire(dir, "other").ok() ? 1 : 0);
    int inner = 0;
    waitpid(grandchild, &inner, 0);
    _exit(WIFEXITED(inner) ? WEXITSTATUS(inner) : 2);
  }
  ASSERT_EQ(waitpid(middle, &status, 0), middle);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  // Released with the object: the next job takes it.
  lock = absl::UnavailableError("released");
  EXPECT_TRUE(DirectoryLock::Acquire(dir, "next").ok());
}

// The window between a holder's flock and its writing its name: the file
// may still name an earlier holder, which has ended. That one is not named.
TEST(DirectoryLock, AnEndedEarlierHolderIsNeverNamed) {
  const std::string dir = TempDir("lock_stale");
  const pid_t ended = fork();
  if (ended == 0) _exit(0);
  waitpid(ended, nullptr, 0);
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  const std::string path = absl::StrCat(dir, "/", DirectoryLock::kFileName);
  std::ofstream(path) << "program=earlier\npid=" << ended << "\nhost=" << host << "\n";
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t silent = fork();
  if (silent == 0) {
    // Holds the lock without writing its name.
    const int fd = open(path.c_str(), O_RDWR);
    const char byte = fd >= 0 && flock(fd, LOCK_EX) == 0 ? 'y' : 'n';
    if (write(ready[1], &byte, 1) != 1) _exit(3);
    pause();
    _exit(0);
  }
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  ASSERT_EQ(byte, 'y');
  absl::StatusOr<DirectoryLock> lock = DirectoryLock::Acquire(dir, "late");
  kill(silent, SIGKILL);
  waitpid(silent, nullptr, 0);
  ASSERT_FALSE(lock.ok());
  EXPECT_THAT(lock.status().message(), HasSubstr("does not name it yet"));
  EXPECT_THAT(lock.status().message(), ::testing::Not(HasSubstr("earlier")));
}

TEST(DirectoryLock, ALockFileThatIsNotAFileIsReported) {
  const std::string dir = TempDir("lock_not_file");
  ASSERT_EQ(mkdir(absl::StrCat(dir, "/", DirectoryLock::kFileName).c_str(), 0755), 0);
  absl::StatusOr<DirectoryLock> lock = DirectoryLock::Acquire(dir, "job");
  ASSERT_FALSE(lock.ok());
  EXPECT_EQ(lock.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(lock.status().message(), HasSubstr(absl::StrCat(dir, "/.lock")));
  // A FIFO opens (without blocking) but is no file to lock.
  const std::string fifo_dir = TempDir("lock_fifo");
  ASSERT_EQ(mkfifo(absl::StrCat(fifo_dir, "/", DirectoryLock::kFileName).c_str(), 0644), 0);
  absl::StatusOr<DirectoryLock> fifo = DirectoryLock::Acquire(fifo_dir, "job");
  ASSERT_FALSE(fifo.ok());
  EXPECT_THAT(fifo.status().message(), HasSubstr("is not a regular file"));
  const absl::StatusOr<DirectoryLock> missing = DirectoryLock::Acquire(dir + "/none", "job");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(), HasSubstr("No such file or directory"));
}

}  // namespace
}  // namespace fsdp
