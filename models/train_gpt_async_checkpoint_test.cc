// The main job's --async_checkpoint: checkpoints written in the background
// change no loss and resume exactly; ranks and launchers killed while a
// background write is in progress leave the newest complete checkpoint to
// resume from; a disk that fills during a background write stops the run
// at the next step boundary with the checkpoint before it intact. The
// checkpointer itself is tested in //checkpoint:async_checkpoint_test.
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/job_test_util.h"

namespace {

using ::models::testing::CommandResult;
using ::models::testing::Exists;
using ::models::testing::LossesOf;
using ::models::testing::RunCommand;
using ::models::testing::TempDir;
using ::testing::HasSubstr;

constexpr char kTrainGpt[] = "models/train_gpt";
constexpr char kCommon[] = " --world_size=2 --print_plan=false --log_every=100 ";

// The step-NNNNNNNN directories of `dir`, and whether each is complete
// (holds its format's marker), by step.
struct StepDir {
  int step;
  bool complete;
  bool holds_temp;  // An AtomicFileWriter's file that was never renamed.
};
std::vector<StepDir> StepDirs(const std::string& dir) {
  std::vector<StepDir> found;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return found;
  while (dirent* e = readdir(d)) {
    int step = 0;
    const std::string name = e->d_name;
    if (!absl::StartsWith(name, "step-") || !absl::SimpleAtoi(name.substr(5), &step)) continue;
    const std::string path = dir + "/" + name;
    StepDir s{step, Exists(path + "/.metadata") || Exists(path + "/manifest.pb"), false};
    if (DIR* inner = opendir(path.c_str())) {
      while (dirent* f = readdir(inner)) {
        if (std::string(f->d_name).find(".tmp-") != std::string::npos) s.holds_temp = true;
      }
      closedir(inner);
    }
    found.push_back(s);
  }
  closedir(d);
  std::sort(found.begin(), found.end(), [](auto& a, auto& b) { return a.step < b.step; });
  return found;
}

// Checkpoints in the background change no loss, each lands (said with its
// copy and write times), and the last one resumes the run exactly; in both
// formats.
TEST(TrainGptAsyncCheckpoint, ChangesNoLossAndResumesExactly) {
  const std::string dir = TempDir("async_resume");
  const CommandResult reference = RunCommand(
      absl::StrCat(kTrainGpt, kCommon, "--steps=10 --metrics_jsonl=", dir, "/reference.jsonl"));
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const std::vector<double> want = LossesOf(dir + "/reference.jsonl");
  ASSERT_EQ(want.size(), 10u);
  for (const char* format : {"sharded", "dcp"}) {
    const std::string ckpt = absl::StrCat(dir, "/", format);
    const std::string flags = absl::StrCat(kCommon,
                                           "--async_checkpoint --checkpoint_every=2 "
                                           "--checkpoint_format=",
                                           format, " --checkpoint_dir=", ckpt);
    const CommandResult run =
        RunCommand(absl::StrCat(kTrainGpt, flags, " --steps=8 --metrics_jsonl=", ckpt, ".jsonl"));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    for (int step : {6, 8}) {
      EXPECT_THAT(run.output,
                  HasSubstr(absl::StrFormat(
                      "checkpoint %s/step-%08d (in the background: staged in ", ckpt, step)));
    }
    const std::vector<double> got = LossesOf(ckpt + ".jsonl");
    ASSERT_EQ(got.size(), 8u);
    for (int i = 0; i < 8; ++i) EXPECT_EQ(got[i], want[i]) << format << " step " << i + 1;
    const CommandResult resumed = RunCommand(
        absl::StrCat(kTrainGpt, flags, " --steps=10 --resume --metrics_jsonl=", ckpt, ".jsonl"));
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    EXPECT_THAT(resumed.output, HasSubstr("resumed from " + ckpt + "/step-00000008"));
    const std::vector<double> all = LossesOf(ckpt + ".jsonl");
    ASSERT_EQ(all.size(), 10u);
    for (int i = 8; i < 10; ++i) EXPECT_NEAR(all[i], want[i], 1e-6) << format << " step " << i + 1;
  }
}

// One run of the job, killed with SIGKILL once a background write is in
// progress after step 2 (a temporary file is in a step directory): the
// victim is rank 0, rank 1 or the launcher; the kill lands `delay_us`
// after the write was seen. Returns whether a kill was sent.
struct KilledRun {
  bool killed = false;
  std::string output;
};
KilledRun RunAndKillDuringAWrite(const std::string& command, const std::string& ckpt, int victim,
                                 int delay_us) {
  KilledRun run;
  std::FILE* pipe = ::popen(absl::StrCat("exec ", command, " 2>&1").c_str(), "r");
  if (pipe == nullptr) return run;
  std::atomic<int> ranks[2] = {0, 0};
  std::atomic<bool> past_step_2{false}, finished{false};
  std::thread watcher([&] {
    while (!finished) {
      if (past_step_2 && ranks[1] != 0) {
        for (const StepDir& s : StepDirs(ckpt)) {
          if (!s.holds_temp || run.killed) continue;
          std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
          int pid = ranks[victim == 2 ? 0 : victim];
          if (victim == 2) {  // The launcher is the ranks' parent.
            std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
            std::string field;
            for (int i = 0; i < 4 && stat >> field;) ++i;
            pid = std::atoi(field.c_str());
          }
          run.killed = pid > 1 && ::kill(pid, SIGKILL) == 0;
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  char buffer[4096];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) {
    const std::string line = buffer;
    run.output += line;
    if (line.find("launched 2 local ranks:") != std::string::npos) {
      std::vector<int> pids;
      for (absl::string_view part : absl::StrSplit(line, " pid ")) {
        int pid = 0;
        if (absl::SimpleAtoi(part.substr(0, part.find_first_of(",\n")), &pid)) pids.push_back(pid);
      }
      if (pids.size() == 2) {
        ranks[0] = pids[0];
        ranks[1] = pids[1];
      }
    }
    if (absl::StartsWith(line, "checkpoint ") && line.find("step-00000002") != std::string::npos) {
      past_step_2 = true;
    }
  }
  finished = true;
  watcher.join();
  ::pclose(pipe);
  return run;
}

// 20 kills at random points of background writes (rank 0, rank 1 or the
// launcher, 0-2 ms after a write was seen under way): every resume starts
// from the newest complete checkpoint, skipping the interrupted one, and
// the resumed steps' losses equal the uninterrupted run's.
TEST(TrainGptAsyncCheckpoint, KilledDuringBackgroundWritesResumesFromTheNewestComplete) {
  const std::string dir = TempDir("async_kills");
  constexpr int kSteps = 14;
  const CommandResult reference = RunCommand(absl::StrCat(
      kTrainGpt, kCommon, "--steps=", kSteps, " --metrics_jsonl=", dir, "/reference.jsonl"));
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const std::vector<double> want = LossesOf(dir + "/reference.jsonl");
  ASSERT_EQ(want.size(), static_cast<size_t>(kSteps));
  std::mt19937 random(20261206);
  int mid_write = 0, killed = 0;
  for (int i = 0; i < 20; ++i) {
    const std::string ckpt = absl::StrCat(dir, "/run", i);
    const std::string flags = absl::StrCat(
        kCommon, "--async_checkpoint --checkpoint_every=1 --checkpoint_format=",
        i % 2 == 0 ? "sharded" : "dcp", " --checkpoint_dir=", ckpt, " --steps=", kSteps);
    const int victim = i % 3;
    const int delay_us = std::uniform_int_distribution<int>(0, 2000)(random);
    const KilledRun run =
        RunAndKillDuringAWrite(absl::StrCat(kTrainGpt, flags), ckpt, victim, delay_us);
    if (!run.killed) {
      // The run ended before a write was seen: it must have finished.
      EXPECT_THAT(run.output, HasSubstr("ranks succeeded")) << "run " << i;
      continue;
    }
    ++killed;
    const std::vector<StepDir> steps = StepDirs(ckpt);
    int newest = 0;
    bool interrupted = false;
    for (const StepDir& s : steps) {
      if (s.complete) newest = s.step;
      interrupted = interrupted || !s.complete || s.holds_temp;
    }
    mid_write += interrupted;
    ASSERT_GE(newest, 2) << "run " << i << ": " << run.output;
    const std::string metrics = absl::StrCat(ckpt, ".jsonl");
    const CommandResult resumed =
        RunCommand(absl::StrCat(kTrainGpt, flags, " --resume --metrics_jsonl=", metrics));
    ASSERT_EQ(resumed.exit_code, 0) << "run " << i << ": " << resumed.output;
    EXPECT_THAT(resumed.output,
                HasSubstr(absl::StrFormat("resumed from %s/step-%08d", ckpt, newest)))
        << "run " << i << " (victim " << victim << ", " << delay_us << " us)";
    const std::vector<double> got = LossesOf(metrics);
    ASSERT_EQ(got.size(), static_cast<size_t>(kSteps - newest)) << "run " << i;
    for (int s = newest; s < kSteps; ++s) {
      EXPECT_NEAR(got[s - newest], want[s], 1e-6) << "run " << i << " step " << s + 1;
    }
  }
  std::printf(
      "%d of 20 runs killed during a background write; %d of them left an interrupted "
      "checkpoint behind\n",
      killed, mid_write);
  EXPECT_GE(killed, 15);
  EXPECT_GE(mid_write, 1) << "no kill landed inside a write";
}

// A disk that fills during a background write (a tmpfs with room for one
// checkpoint and a half): the run stops at a later step boundary naming the
// checkpoint and the error, and the checkpoint before it resumes exactly.
TEST(TrainGptAsyncCheckpoint, DiskFullDuringABackgroundWriteStopsTheRunAndKeepsTheLast) {
  if (RunCommand("unshare -m true").exit_code != 0) {
    GTEST_SKIP() << "no mount namespace here (unshare -m needs root): cannot make a small disk";
  }
  const std::string dir = TempDir("async_disk_full");
  const std::string common = absl::StrCat(kTrainGpt, kCommon);
  // One checkpoint's size, measured.
  const CommandResult sized = RunCommand(
      absl::StrCat(common, "--steps=2 --checkpoint_every=2 --checkpoint_dir=", dir, "/sized"));
  ASSERT_EQ(sized.exit_code, 0) << sized.output;
  const CommandResult du = RunCommand(absl::StrCat("du -sk ", dir, "/sized/step-00000002"));
  int64_t kib = 0;
  ASSERT_TRUE(absl::SimpleAtoi(du.output.substr(0, du.output.find('\t')), &kib)) << du.output;
  const CommandResult reference =
      RunCommand(absl::StrCat(common, "--steps=8 --metrics_jsonl=", dir, "/reference.jsonl"));
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const std::string disk = dir + "/disk";
  ASSERT_EQ(RunCommand("mkdir -p " + disk).exit_code, 0);
  const CommandResult full = RunCommand(absl::StrCat(
      "unshare -m sh -c 'mount -t tmpfs -o size=", kib * 3 / 2 + 64, "k tmpfs ", disk, " && ",
      common, "--async_checkpoint --checkpoint_every=2 --steps=8 --checkpoint_dir=", disk,
      "/ckpt; rc=$?; cp -a ", disk, "/ckpt ", dir, "/kept; exit $rc'"));
  EXPECT_NE(full.exit_code, 0) << full.output;
  EXPECT_THAT(full.output, HasSubstr("checkpoint " + disk + "/ckpt/step-00000002 (in the"));
  EXPECT_THAT(full.output, HasSubstr("the checkpoint of step 4, written in the background, "
                                     "failed: "));
  EXPECT_THAT(full.output, HasSubstr("No space left on device"));
  EXPECT_THAT(full.output, HasSubstr("the checkpoints saved before it are intact"));
  // The run stopped at a step boundary after step 4's save began.
  EXPECT_THAT(full.output, ::testing::ContainsRegex("step [5-8]: the checkpoint of step 4"));
  const CommandResult resumed = RunCommand(
      absl::StrCat(common, "--steps=8 --checkpoint_every=2 --resume --checkpoint_dir=", dir,
                   "/kept --metrics_jsonl=", dir, "/resumed.jsonl"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resumed from " + dir + "/kept/step-00000002"));
  const std::vector<double> want = LossesOf(dir + "/reference.jsonl");
  const std::vector<double> got = LossesOf(dir + "/resumed.jsonl");
  ASSERT_EQ(got.size(), 6u);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(got[i], want[i + 2], 1e-6) << "step " << i + 3;
}

}  // namespace
