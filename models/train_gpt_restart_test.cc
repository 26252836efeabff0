// The main job's restarts (--max_restarts, or torchrun's): a rank killed
// mid-run, the job restarted and resumed from its newest checkpoint with
// the uninterrupted run's losses; a failure that repeats at the same step
// ended as deterministic. The launcher's own restart rules are tested in
// //launch:local_launcher_test; across hosts in //models:multi_node_test.
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/job_test_util.h"
#include "testing/torch_python.h"

namespace {

using ::models::testing::CommandResult;
using ::models::testing::LossesOf;
using ::models::testing::RunCommand;
using ::models::testing::TempDir;
using ::testing::HasSubstr;

constexpr char kTrainGpt[] = "models/train_gpt";

// --max_restarts: the launcher restarts every rank after one dies, and the
// job resumes from its newest complete checkpoint by itself; its losses at
// every step are the uninterrupted run's, and the report names the restart
// and its cause. The last rank kills itself as step 7 begins, in the first
// attempt only.
TEST(TrainGpt, WithMaxRestartsAKilledRankRestartsTheJobFromItsLastCheckpoint) {
  const std::string dir = TempDir("restart_after_kill");
  const std::string common = absl::StrCat(
      kTrainGpt, " --world_size=2 --steps=10 --log_every=5 --print_plan=false --metrics_jsonl=");
  const CommandResult reference = RunCommand(absl::StrCat(common, dir, "/reference.jsonl"));
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const CommandResult restarted = RunCommand(absl::StrCat(
      common, dir, "/restarted.jsonl --checkpoint_dir=", dir,
      "/ckpt --checkpoint_every=3 --max_restarts=2 --restart_backoff_s=0.1 "
      "--TEST_kill_at_step=7"));
  ASSERT_EQ(restarted.exit_code, 0) << restarted.output;
  EXPECT_THAT(restarted.output, HasSubstr("rank 1: killing itself at step 7"));
  EXPECT_THAT(restarted.output, HasSubstr("train_gpt: restart 1 of 2 in 100 ms; the attempt "
                                          "before it failed: rank 1 died of signal 9 (Killed)"));
  EXPECT_THAT(restarted.output, HasSubstr("note: restart 1: resuming from " + dir +
                                          "/ckpt/step-00000006 (step 6)"));
  EXPECT_THAT(restarted.output, HasSubstr("resumed from " + dir + "/ckpt/step-00000006"));
  EXPECT_THAT(restarted.output, HasSubstr("all 2 ranks succeeded after 1 restart"));
  const std::vector<double> expected = LossesOf(dir + "/reference.jsonl");
  const std::vector<double> actual = LossesOf(dir + "/restarted.jsonl");
  ASSERT_EQ(expected.size(), 10u);
  ASSERT_EQ(actual.size(), 10u);
  for (int i = 0; i < 10; ++i) EXPECT_NEAR(actual[i], expected[i], 1e-6) << "step " << i + 1;
}

// Without a checkpoint to resume, a restart trains from step 1 again; the
// metrics file then holds each step once, the restarted attempt's, after a
// line of an earlier run the job appended to (kept).
TEST(TrainGpt, ARestartWithoutACheckpointStartsOverAndLogsEachStepOnce) {
  const std::string dir = TempDir("restart_start_over");
  const std::string common = absl::StrCat(
      kTrainGpt, " --world_size=2 --steps=4 --log_every=5 --print_plan=false --metrics_jsonl=");
  const CommandResult reference = RunCommand(absl::StrCat(common, dir, "/reference.jsonl"));
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  // The earlier run: the reference's last line, of step 4.
  ASSERT_EQ(std::system(absl::StrCat("tail -n 1 ", dir, "/reference.jsonl > ", dir,
                                     "/restarted.jsonl").c_str()),
            0);
  const CommandResult restarted = RunCommand(absl::StrCat(
      common, dir, "/restarted.jsonl --max_restarts=1 --restart_backoff_s=0.1 "
      "--TEST_kill_at_step=3"));
  ASSERT_EQ(restarted.exit_code, 0) << restarted.output;
  EXPECT_THAT(restarted.output, HasSubstr("note: restart 1: no --checkpoint_dir, so the job "
                                          "starts again from step 1"));
  const std::vector<double> expected = LossesOf(dir + "/reference.jsonl");
  std::vector<double> actual = LossesOf(dir + "/restarted.jsonl");
  ASSERT_EQ(expected.size(), 4u);
  ASSERT_EQ(actual.size(), 5u);
  EXPECT_EQ(actual[0], expected[3]);  // The earlier run's line.
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(actual[i + 1], expected[i], 1e-6) << "step " << i + 1;
}

// Under torchrun --max-restarts the job restarts the same way: torchrun
// starts every rank again with TORCHELASTIC_RESTART_COUNT = 1 and the job
// resumes from its newest checkpoint by itself. Needs a torchrun that
// starts workers and speaks this build's store protocol (the torch of the
// libtorch 2.x pass; a libtorch 1.13 client hangs on torch 2.x's store).
TEST(TrainGpt, UnderTorchrunMaxRestartsAKilledRankResumesFromTheLastCheckpoint) {
  const std::string dir = TempDir("torchrun_restart");
  const std::string python = ::fsdp::testing::TorchPython();
  const CommandResult probe = RunCommand(absl::StrCat(
      "timeout 60 ", python,
      " -c 'import sys, torch; sys.exit(0 if int(torch.__version__.split(\".\")[0]) == ",
      ::fsdp::testing::BuiltTorchMajorVersion(), " else 3)' && timeout 60 ", python,
      " -m torch.distributed.run --standalone --nproc_per_node=1 --no_python /bin/true"));
  if (probe.exit_code != 0) {
    GTEST_SKIP() << "no torchrun of this build's torch that starts workers: "
                 << probe.output.substr(0, 300);
  }
  const std::string job = absl::StrCat(
      " --steps=10 --log_every=5 --print_plan=false --max_restarts=2 --checkpoint_every=3 "
      "--checkpoint_dir=", dir, "/ckpt --TEST_kill_at_step=7 --metrics_jsonl=", dir,
      "/restarted.jsonl");
  const CommandResult restarted = RunCommand(absl::StrCat(
      "timeout 300 ", python,
      " -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=2 "
      "--monitor-interval=0.1 --no-python ", kTrainGpt, job));
  ASSERT_EQ(restarted.exit_code, 0) << restarted.output;
  EXPECT_THAT(restarted.output, HasSubstr("rank 1: killing itself at step 7"));
  EXPECT_THAT(restarted.output, HasSubstr("note: restart 1: resuming from " + dir +
                                          "/ckpt/step-00000006 (step 6)"));
  const CommandResult reference = RunCommand(absl::StrCat(
      kTrainGpt, " --world_size=2 --steps=10 --log_every=5 --print_plan=false --metrics_jsonl=",
      dir, "/reference.jsonl"));
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const std::vector<double> expected = LossesOf(dir + "/reference.jsonl");
  const std::vector<double> actual = LossesOf(dir + "/restarted.jsonl");
  ASSERT_EQ(expected.size(), 10u);
  ASSERT_EQ(actual.size(), 10u);
  for (int i = 0; i < 10; ++i) EXPECT_NEAR(actual[i], expected[i], 1e-6) << "step " << i + 1;
}

// A failure that every attempt meets at the same step with the same message
// (here a NaN loss the job stops for) is not retried once 3 attempts in a
// row met it, though restarts are left: the report calls it deterministic.
// Each attempt resumed from step 4's checkpoint, so each failed at step 5.
TEST(TrainGpt, AFailureAtTheSameStepEveryAttemptIsReportedDeterministic) {
  const std::string dir = TempDir("restart_deterministic");
  const CommandResult run = RunCommand(absl::StrCat(
      kTrainGpt, " --world_size=2 --steps=8 --print_plan=false --checkpoint_dir=", dir,
      "/ckpt --checkpoint_every=2 --max_restarts=4 --restart_backoff_s=0.1 "
      "--TEST_nan_loss_at_step=5"));
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("restart 2 of 4 in 200 ms"));
  // Restarts were left: the third identical failure ended the job.
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("restart 3 of 4")));
  EXPECT_THAT(run.output, HasSubstr("the job failed after 2 restarts; no restart: the same "
                                    "failure (rank "));
  EXPECT_THAT(run.output, HasSubstr(" at step 5: step 5: the loss is not finite"));
  EXPECT_THAT(run.output, HasSubstr("ended the last 3 attempts: it is deterministic"));
}

}  // namespace
