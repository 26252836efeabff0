#include "formats/atomic_file.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
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
  {
    absl::StatusOr<AtomicFileWriter> dropped = AtomicFileWriter::Open(dir + "/b.bin");
    ASSERT_TRUE(dropped.ok());
    ASSERT_TRUE(dropped->Write("x", 1).ok());
  }
  EXPECT_THAT(Names(dir), ElementsAre("a.bin"));
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
