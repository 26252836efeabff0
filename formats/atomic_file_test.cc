#include "formats/atomic_file.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

std::string NewDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::vector<std::string> Names(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(AtomicFileWriter, CommitsWholeAndRefusesWritesAfterFlush) {
  const std::string dir = NewDir("atomic_commit");
  absl::StatusOr<AtomicFileWriter> writer = AtomicFileWriter::Open(dir + "/a.bin");
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE(writer->Write("abc", 3).ok());
  EXPECT_THAT(Names(dir), ElementsAre(HasSubstr("a.bin.tmp-")));
  ASSERT_TRUE(writer->Flush().ok());
  EXPECT_THAT(writer->Write("d", 1).ToString(), HasSubstr("was flushed or committed"));
  ASSERT_TRUE(writer->Commit().ok());
  EXPECT_THAT(Names(dir), ElementsAre("a.bin"));
  EXPECT_EQ(std::filesystem::file_size(dir + "/a.bin"), 3u);
  EXPECT_EQ(writer->direct_bytes(), 0);  // Less than a page.
  {
    absl::StatusOr<AtomicFileWriter> dropped = AtomicFileWriter::Open(dir + "/b.bin");
    ASSERT_TRUE(dropped.ok());
    ASSERT_TRUE(dropped->Write("x", 1).ok());
  }
  EXPECT_THAT(Names(dir), ElementsAre("a.bin"));
}

// Bytes as a checkpoint's writer hands them over: a small header, a tensor
// larger than the writer's buffer, then pieces of odd sizes at odd
// addresses; `total` in all.
std::string WriteOddPieces(AtomicFileWriter& writer, size_t total) {
  std::string expected(total, '\0');
  for (size_t i = 0; i < total; ++i) expected[i] = static_cast<char>((i * 2654435761u) >> 13);
  size_t at = 0;
  for (size_t piece : {size_t{3}, AtomicFileWriter::kDirectWriteBytes + 100}) {
    const size_t n = std::min(piece, total - at);
    EXPECT_TRUE(writer.Write(expected.data() + at, n).ok());
    at += n;
  }
  for (size_t piece = 7; at < total; piece = piece * 7 % 1000003 + 1) {
    const size_t n = std::min(piece, total - at);
    EXPECT_TRUE(writer.Write(expected.data() + at, n).ok());
    at += n;
  }
  return expected;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Whether direct writes to `dir` reach the device: tmpfs takes O_DIRECT
// (since Linux 6.6) but keeps the file in memory.
bool TakesDirectWrites(const std::string& dir) {
  struct statfs fs;
  if (::statfs(dir.c_str(), &fs) != 0 || fs.f_type == TMPFS_MAGIC) return false;
  const std::string probe = dir + "/probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_DIRECT, 0644);
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  return fd >= 0;
}

// How many of the file's first `bytes` are in the page cache.
int64_t CachedBytes(const std::string& path, size_t bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return -1;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((bytes + page - 1) / page);
  const int ok = ::mincore(map, bytes, resident.data());
  ::munmap(map, bytes);
  if (ok != 0) return -1;
  int64_t cached = 0;
  for (unsigned char r : resident) cached += (r & 1) != 0 ? static_cast<int64_t>(page) : 0;
  return cached;
}

// Every whole page goes to the device without the page cache, the last
// partial page through it, and the file is byte for byte what was written.
TEST(AtomicFileWriter, WritesWholeBuffersDirectly) {
  const std::string dir = NewDir("atomic_direct");
  if (!TakesDirectWrites(dir)) GTEST_SKIP() << dir << ": no direct writes to a device (tmpfs?)";
  const size_t buffer = AtomicFileWriter::kDirectWriteBytes;
  const size_t total = 2 * buffer + 12345;
  absl::StatusOr<AtomicFileWriter> writer = AtomicFileWriter::Open(dir + "/big.bin");
  ASSERT_TRUE(writer.ok()) << writer.status();
  const std::string expected = WriteOddPieces(*writer, total);
  EXPECT_EQ(writer->bytes_written(), static_cast<int64_t>(total));
  ASSERT_TRUE(writer->Commit().ok());
  const size_t whole_pages = total / 4096 * 4096;
  EXPECT_EQ(writer->direct_bytes(), static_cast<int64_t>(whole_pages));
  EXPECT_EQ(CachedBytes(dir + "/big.bin", whole_pages), 0);
  EXPECT_TRUE(ReadAll(dir + "/big.bin") == expected);
}

// A file size limit cuts a direct write short at an unaligned length: the
// writer goes on through the page cache up to the limit, then fails, and
// keeps failing.
TEST(AtomicFileWriter, FallsBackToThePageCacheAndKeepsItsError) {
  const std::string dir = NewDir("atomic_fallback");
  if (!TakesDirectWrites(dir)) GTEST_SKIP() << dir << ": no direct writes to a device (tmpfs?)";
  constexpr rlim_t kLimit = 5000;
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    const struct rlimit limit = {kLimit, kLimit};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(10);
    absl::StatusOr<AtomicFileWriter> writer = AtomicFileWriter::Open(dir + "/limited.bin");
    if (!writer.ok()) ::_exit(11);
    const std::string expected = WriteOddPieces(*writer, size_t{3} << 20);
    const absl::Status flushed = writer->Flush();
    if (flushed.message().find("File too large") == absl::string_view::npos) ::_exit(12);
    if (writer->Commit().message() != flushed.message()) ::_exit(13);
    if (writer->Write("x", 1).message() != flushed.message()) ::_exit(14);
    const std::vector<std::string> names = Names(dir);
    if (names.size() != 1) ::_exit(15);
    if (ReadAll(dir + "/" + names[0]) != expected.substr(0, kLimit)) ::_exit(16);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's check that failed (see the exit codes above)";
}

// A save killed mid-write leaves its temporary file; the next clean-up
// removes it, and never a live writer's: one of this process, or of another
// process until that process dies. Files that only look alike stay.
TEST(AtomicFileWriter, RemovesTheTempFilesOfDeadWritersOnly) {
  const std::string dir = NewDir("atomic_cleanup");
  std::ofstream(dir + "/crashed.bin.tmp-999999-3") << "half a file";
  for (const char* name : {"keep.tmp", "keep.tmp-1-", "keep.tmp-x-1", "keep.bin", ".tmp-1-2"}) {
    std::ofstream(dir + "/" + name) << "not a temporary file";
  }
  std::filesystem::create_directory(dir + "/dir.tmp-1-2");
  absl::StatusOr<AtomicFileWriter> live = AtomicFileWriter::Open(dir + "/live.bin");
  ASSERT_TRUE(live.ok()) << live.status();

  // Another process's writer, alive until killed.
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    absl::StatusOr<AtomicFileWriter> theirs = AtomicFileWriter::Open(dir + "/theirs.bin");
    const char byte = theirs.ok() ? 1 : 0;
    if (write(ready[1], &byte, 1) != 1) _exit(1);
    pause();
    _exit(0);
  }
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  ASSERT_EQ(byte, 1) << "the child could not open its writer";

  EXPECT_THAT(RemoveAbandonedTempFiles(dir), ElementsAre("crashed.bin.tmp-999999-3"));
  std::vector<std::string> after = Names(dir);
  EXPECT_EQ(std::count_if(after.begin(), after.end(),
                          [](const std::string& n) { return n.rfind("live.bin.tmp-", 0) == 0; }),
            1);
  EXPECT_EQ(std::count_if(after.begin(), after.end(),
                          [](const std::string& n) { return n.rfind("theirs.bin.tmp-", 0) == 0; }),
            1);

  ::kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  close(ready[0]);
  close(ready[1]);
  EXPECT_THAT(RemoveAbandonedTempFiles(dir), ElementsAre(HasSubstr("theirs.bin.tmp-")));
  ASSERT_TRUE(live->Write("x", 1).ok());
  ASSERT_TRUE(live->Commit().ok());
  EXPECT_THAT(RemoveAbandonedTempFiles(dir), ElementsAre());
  EXPECT_THAT(Names(dir), UnorderedElementsAre(".tmp-1-2", "dir.tmp-1-2", "keep.bin", "keep.tmp",
                                               "keep.tmp-1-", "keep.tmp-x-1", "live.bin"));
}

}  // namespace
}  // namespace fsdp
