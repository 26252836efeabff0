#include "optim/run_checkpoints.h"

#include <sys/stat.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/collectives.h"
#include "formats/dcp.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "statedict/sharded_checkpoint.h"
#include "testing/multi_rank.h"

namespace fsdp {
namespace {

using ::fsdp::testing::RunOnThreadRanks;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string NewDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
  EXPECT_EQ(std::system(absl::StrCat("rm -rf '", dir, "'").c_str()), 0);
  return dir;
}

// A real (one-rank, one-tensor) checkpoint at `path` with `metadata`.
void SaveCheckpoint(const std::string& path, const CheckpointMetadata& metadata) {
  mkdir(path.substr(0, path.rfind('/')).c_str(), 0755);
  mkdir(path.c_str(), 0755);
  absl::Status status = RunOnThreadRanks(1, [&](Collectives& comm) {
    CheckpointTensor t;
    t.fqn = "w";
    t.shape = {3};
    t.local = at::arange(3, at::kFloat);
    t.hi = 3;
    absl::Status saved = SaveCheckpointTensors(comm, path, {t}, metadata);
    ASSERT_TRUE(saved.ok()) << saved;
  });
  ASSERT_TRUE(status.ok()) << status;
}

// Step `step` of `run`, saved the way a run saves it.
void SaveStep(const RunCheckpoints& run, int64_t step) {
  SaveCheckpoint(run.PathOf(step), run.MetadataOf(step));
}

std::vector<int64_t> StepsIn(const std::string& dir) {
  std::vector<int64_t> steps;
  absl::StatusOr<std::vector<StepCheckpoint>> entries = ListStepCheckpoints(dir);
  EXPECT_TRUE(entries.ok()) << entries.status();
  if (entries.ok()) {
    for (const StepCheckpoint& e : *entries) steps.push_back(e.step);
  }
  return steps;
}

RunCheckpointsOptions Resume() {
  RunCheckpointsOptions options;
  options.resume = true;
  return options;
}

RunCheckpointsOptions Overwrite() {
  RunCheckpointsOptions options;
  options.overwrite = true;
  return options;
}

RunCheckpoints OpenOrDie(const std::string& dir, const RunCheckpointsOptions& options,
                         const std::string& id) {
  absl::StatusOr<RunCheckpoints> run = RunCheckpoints::Open(dir, options, id);
  EXPECT_TRUE(run.ok()) << run.status();
  return *std::move(run);
}

TEST(RunCheckpoints, ANewRunRefusesADirectoryHoldingAnotherRunsCheckpoints) {
  const std::string dir = NewDir("refuse");
  RunCheckpoints old = OpenOrDie(dir, {}, "0123456789abcdef");
  SaveStep(old, 5);
  SaveStep(old, 10);
  mkdir(old.PathOf(12).c_str(), 0755);  // An interrupted save.
  absl::StatusOr<RunCheckpoints> fresh = RunCheckpoints::Open(dir, {}, "fedcba9876543210");
  ASSERT_FALSE(fresh.ok());
  EXPECT_EQ(fresh.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(fresh.status().message(),
              HasSubstr("already holds checkpoints of another run (run 0123456789abcdef: "
                        "step(s) 5, 10; interrupted saves (neither manifest.pb nor .metadata): "
                        "step(s) 12)"));
  EXPECT_THAT(fresh.status().message(), HasSubstr("--resume"));
  EXPECT_THAT(fresh.status().message(), HasSubstr("--overwrite_checkpoints"));
  EXPECT_THAT(StepsIn(dir), ElementsAre(5, 10, 12));
}

// The data-loss scenario of a new run in an old run's directory: told to
// overwrite, the new run's checkpoints all survive, the old ones stay until
// the new run's first checkpoint lands, and resuming continues the new run.
TEST(RunCheckpoints, AnOverwritingRunReplacesTheOldCheckpointsOnlyAfterItsFirstSave) {
  const std::string dir = NewDir("overwrite");
  RunCheckpoints old = OpenOrDie(dir, {}, "old");
  SaveStep(old, 5);
  SaveStep(old, 10);
  RunCheckpoints fresh = OpenOrDie(dir, Overwrite(), "new");
  EXPECT_EQ(fresh.run_id(), "new");
  EXPECT_FALSE(fresh.resume_from().has_value());
  ASSERT_EQ(fresh.notes().size(), 1u);
  EXPECT_THAT(fresh.notes()[0], HasSubstr("run old: step(s) 5, 10) will be removed once"));
  EXPECT_THAT(StepsIn(dir), ElementsAre(5, 10));

  SaveStep(fresh, 3);
  RunCheckpoints::Retired retired = fresh.RetireOlderThan(3);
  EXPECT_TRUE(retired.problems.empty()) << retired.problems[0];
  EXPECT_THAT(retired.removed, ElementsAre(old.PathOf(5), old.PathOf(10)));
  EXPECT_THAT(StepsIn(dir), ElementsAre(3));

  RunCheckpoints resumed = OpenOrDie(dir, Resume(), "unused");
  ASSERT_TRUE(resumed.resume_from().has_value());
  EXPECT_EQ(resumed.resume_from()->step, 3);
  EXPECT_EQ(resumed.run_id(), "new");
}

TEST(RunCheckpoints, AnOverwritingRunSavingTheSameStepKeepsItsOwn) {
  const std::string dir = NewDir("overwrite_same_step");
  RunCheckpoints old = OpenOrDie(dir, {}, "old");
  SaveStep(old, 4);
  RunCheckpoints fresh = OpenOrDie(dir, Overwrite(), "new");
  SaveStep(fresh, 4);
  EXPECT_TRUE(fresh.RetireOlderThan(4).removed.empty());
  absl::StatusOr<std::vector<StepCheckpoint>> entries = ListStepCheckpoints(dir);
  ASSERT_TRUE(entries.ok());
  ASSERT_EQ(entries->size(), 1u);
  EXPECT_EQ((*entries)[0].run_id, "new");
}

TEST(RunCheckpoints, CleanUpRemovesOnlyThisRunsOlderCheckpoints) {
  const std::string dir = NewDir("retire");
  // Not this run's: a checkpoint saved before run ids, another run's, an
  // interrupted save, all older than this run's.
  SaveCheckpoint(dir + "/step-00000001", {});
  SaveCheckpoint(dir + "/step-00000002", {{kRunIdMetadataKey, "other"}});
  mkdir((dir + "/step-00000003").c_str(), 0755);
  RunCheckpoints run = OpenOrDie(dir, Overwrite(), "mine");
  // Only the checkpoints that were there at Open are replaced.
  SaveStep(run, 4);
  EXPECT_THAT(run.RetireOlderThan(4).removed,
              ElementsAre(dir + "/step-00000001", dir + "/step-00000002",
                          dir + "/step-00000003"));
  // Others appearing later are never touched by clean-up.
  SaveCheckpoint(dir + "/step-00000000", {{kRunIdMetadataKey, "other"}});
  mkdir((dir + "/step-00000001").c_str(), 0755);
  SaveStep(run, 5);
  EXPECT_TRUE(run.RetireOlderThan(5).removed.empty());
  SaveStep(run, 6);
  EXPECT_THAT(run.RetireOlderThan(6).removed, ElementsAre(run.PathOf(4)));
  SaveStep(run, 7);
  EXPECT_THAT(run.RetireOlderThan(7).removed, ElementsAre(run.PathOf(5)));
  EXPECT_THAT(StepsIn(dir), ElementsAre(0, 1, 6, 7));
  // A checkpoint newer than the one just saved is kept too (a resumed run
  // that reached a step below it).
  SaveStep(run, 9);
  SaveStep(run, 8);
  EXPECT_THAT(run.RetireOlderThan(8).removed, ElementsAre(run.PathOf(6)));
  EXPECT_THAT(StepsIn(dir), ElementsAre(0, 1, 7, 8, 9));
}

TEST(RunCheckpoints, ResumingContinuesTheNewestCompleteCheckpointAndNamesSkippedOnes) {
  const std::string dir = NewDir("resume");
  RunCheckpoints run = OpenOrDie(dir, {}, "r1");
  SaveStep(run, 3);
  SaveStep(run, 6);
  mkdir(run.PathOf(9).c_str(), 0755);  // Killed while saving step 9.
  RunCheckpoints resumed = OpenOrDie(dir, Resume(), "unused");
  ASSERT_TRUE(resumed.resume_from().has_value());
  EXPECT_EQ(resumed.resume_from()->step, 6);
  EXPECT_EQ(resumed.resume_from()->path, run.PathOf(6));
  EXPECT_EQ(resumed.run_id(), "r1");
  ASSERT_EQ(resumed.notes().size(), 1u);
  EXPECT_THAT(resumed.notes()[0],
              HasSubstr("step-00000009' holds neither manifest.pb nor .metadata (an interrupted "
                        "save); resuming from step 6 instead; it is removed once this run saves "
                        "a checkpoint"));
  // The resumed run's first checkpoint lands; then the interrupted save goes.
  SaveStep(resumed, 7);
  EXPECT_THAT(resumed.RetireOlderThan(7).removed, ElementsAre(run.PathOf(9), run.PathOf(3)));
  EXPECT_THAT(StepsIn(dir), ElementsAre(6, 7));
  // A checkpoint saved before run ids resumes under the empty id.
  const std::string legacy = NewDir("resume_legacy");
  SaveCheckpoint(legacy + "/step-00000002", {});
  RunCheckpoints continued = OpenOrDie(legacy, Resume(), "unused");
  EXPECT_EQ(continued.run_id(), "");
  EXPECT_EQ(continued.resume_from()->step, 2);
}

TEST(RunCheckpoints, ResumingRefusesWhatIsAmbiguousOrDamaged) {
  const std::string empty = NewDir("resume_none");
  absl::StatusOr<RunCheckpoints> none = RunCheckpoints::Open(empty, Resume(), "x");
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(),
              HasSubstr("no complete checkpoint to resume from in '" + empty + "'"));

  const std::string mixed = NewDir("resume_mixed");
  SaveCheckpoint(mixed + "/step-00000005", {{kRunIdMetadataKey, "a"}});
  SaveCheckpoint(mixed + "/step-00000007", {{kRunIdMetadataKey, "b"}});
  absl::StatusOr<RunCheckpoints> ambiguous = RunCheckpoints::Open(mixed, Resume(), "x");
  ASSERT_FALSE(ambiguous.ok());
  EXPECT_THAT(ambiguous.status().message(),
              HasSubstr("holds complete checkpoints of 2 different runs (run a: step(s) 5; "
                        "run b: step(s) 7)"));

  const std::string damaged = NewDir("resume_damaged");
  SaveCheckpoint(damaged + "/step-00000005", {{kRunIdMetadataKey, "a"}});
  SaveCheckpoint(damaged + "/step-00000007", {{kRunIdMetadataKey, "a"}});
  ASSERT_EQ(std::system(absl::StrCat("printf garbage > '", damaged,
                                     "/step-00000007/manifest.pb'")
                            .c_str()),
            0);
  absl::StatusOr<RunCheckpoints> bad = RunCheckpoints::Open(damaged, Resume(), "x");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(bad.status().message(), HasSubstr("step-00000007', is damaged"));
  EXPECT_THAT(bad.status().message(), HasSubstr("remove it to resume from step 5"));
}

// A run's settings ride in every checkpoint it saves, and come back with
// the checkpoint a resumed run continues.
TEST(RunCheckpoints, TheRunsSettingsComeBackWithItsCheckpoints) {
  const std::string dir = NewDir("settings");
  RunCheckpointsOptions options;
  options.settings = {{"batch_size", "8"}, {"data", "/some where/corpus.txt"}, {"empty", ""}};
  RunCheckpoints run = OpenOrDie(dir, options, "r1");
  SaveStep(run, 2);
  RunCheckpoints resumed = OpenOrDie(dir, Resume(), "unused");
  ASSERT_TRUE(resumed.resume_from().has_value());
  EXPECT_EQ(resumed.resume_from()->settings, options.settings);
  // Checkpoints saved before runs recorded settings have none.
  const std::string legacy = NewDir("settings_legacy");
  SaveCheckpoint(legacy + "/step-00000002", {{kRunIdMetadataKey, "old"}});
  RunCheckpoints old = OpenOrDie(legacy, Resume(), "unused");
  EXPECT_TRUE(old.resume_from()->settings.empty());
}

// A manifest whose shard files are gone is not a checkpoint: two jobs in one
// directory once left manifests whose shards the other had removed, and
// resuming called them complete.
TEST(RunCheckpoints, ACheckpointMissingAShardFileIsDamaged) {
  const std::string dir = NewDir("missing_shard");
  RunCheckpoints run = OpenOrDie(dir, {}, "r1");
  SaveStep(run, 3);
  SaveStep(run, 6);
  ASSERT_EQ(std::system(absl::StrCat("rm '", run.PathOf(6), "'/shard-*.bin").c_str()), 0);
  absl::StatusOr<std::vector<StepCheckpoint>> entries = ListStepCheckpoints(dir);
  ASSERT_TRUE(entries.ok()) << entries.status();
  ASSERT_EQ(entries->size(), 2u);
  EXPECT_EQ((*entries)[0].state, StepCheckpoint::State::kComplete);
  EXPECT_EQ((*entries)[1].state, StepCheckpoint::State::kDamaged);
  EXPECT_THAT((*entries)[1].problem, HasSubstr("that the manifest names cannot be found"));
  absl::StatusOr<RunCheckpoints> resumed = RunCheckpoints::Open(dir, Resume(), "x");
  ASSERT_FALSE(resumed.ok());
  EXPECT_THAT(resumed.status().message(), HasSubstr("remove it to resume from step 3"));
  // A shard file cut short is damage too.
  ASSERT_EQ(std::system(absl::StrCat("truncate -s 10 '", run.PathOf(3), "'/shard-*.bin").c_str()),
            0);
  entries = ListStepCheckpoints(dir);
  ASSERT_TRUE(entries.ok());
  EXPECT_EQ((*entries)[0].state, StepCheckpoint::State::kDamaged);
  EXPECT_THAT((*entries)[0].problem, HasSubstr("has 10 bytes, the manifest records"));
}

TEST(RunCheckpoints, BadOptionsAreRefused) {
  EXPECT_EQ(RunCheckpoints::Open("", {}, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  RunCheckpointsOptions keep_none;
  keep_none.keep = 0;
  EXPECT_EQ(RunCheckpoints::Open("/tmp/x", keep_none, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RunCheckpoints::Open("/tmp/x", {}, "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NewRunId().size(), 16u);
  EXPECT_NE(NewRunId(), NewRunId());
}

}  // namespace
}  // namespace fsdp

namespace fsdp {
namespace {

// A Distributed Checkpoint at `path` holding a tensor and, when given, a
// train_state of {"step": step, "run_id": id}, as the job writes them.
void SaveDcpStep(const std::string& path, std::optional<int64_t> step, const std::string& id,
                 const std::map<std::string, std::string>& settings = {}) {
  mkdir(path.substr(0, path.rfind('/')).c_str(), 0755);
  std::vector<DcpItem> items = {
      {{{false, "model", 0}, {false, "w", 0}}, at::arange(3, at::kFloat)}};
  if (step.has_value()) {
    RunCheckpointsOptions options;
    options.settings = settings;
    absl::StatusOr<RunCheckpoints> run = RunCheckpoints::Open("/nonexistent", options, id);
    ASSERT_TRUE(run.ok()) << run.status();
    for (DcpItem& item : run->DcpTrainStateOf(*step)) items.push_back(std::move(item));
  }
  absl::Status saved = SaveDcpCheckpoint(path, items);
  ASSERT_TRUE(saved.ok()) << saved;
}

// DCP step directories are checkpoints of a run too: the job's (with
// train_state) and PyTorch's (without: the empty run id); one whose
// train_state names another step is damaged, one without .metadata an
// interrupted save; clean-up removes them like the others.
TEST(RunCheckpoints, DistributedCheckpointsAreStepsOfARun) {
  const std::string dir = NewDir("dcp_steps");
  SaveDcpStep(dir + "/step-00000002", 2, "run-a");
  SaveDcpStep(dir + "/step-00000004", 4, "run-a");
  SaveDcpStep(dir + "/step-00000006", std::nullopt, "");
  SaveDcpStep(dir + "/step-00000008", 7, "run-a");
  mkdir((dir + "/step-00000010").c_str(), 0755);
  absl::StatusOr<std::vector<StepCheckpoint>> entries = ListStepCheckpoints(dir);
  ASSERT_TRUE(entries.ok()) << entries.status();
  ASSERT_EQ(entries->size(), 5u);
  using State = StepCheckpoint::State;
  EXPECT_EQ((*entries)[0].state, State::kComplete);
  EXPECT_EQ((*entries)[0].format, StepCheckpoint::Format::kDcp);
  EXPECT_EQ((*entries)[0].run_id, "run-a");
  EXPECT_EQ((*entries)[2].state, State::kComplete);
  EXPECT_EQ((*entries)[2].run_id, "");
  EXPECT_EQ((*entries)[3].state, State::kDamaged);
  EXPECT_THAT((*entries)[3].problem, HasSubstr("'train_state.step' is not 8"));
  EXPECT_EQ((*entries)[4].state, State::kIncomplete);

  // Two runs' complete checkpoints: resuming is ambiguous.
  EXPECT_FALSE(RunCheckpoints::Open(dir, Resume(), "new").ok());
  ASSERT_EQ(std::system(
                absl::StrCat("rm -rf '", dir, "/step-00000006' '", dir, "/step-00000008'").c_str()),
            0);
  RunCheckpoints run = OpenOrDie(dir, Resume(), "new");
  ASSERT_TRUE(run.resume_from().has_value());
  EXPECT_EQ(run.resume_from()->step, 4);
  EXPECT_EQ(run.resume_from()->format, StepCheckpoint::Format::kDcp);
  EXPECT_EQ(run.run_id(), "run-a");
  SaveDcpStep(run.PathOf(6), 6, "run-a", {{"seed", "7"}});
  RunCheckpoints::Retired retired = run.RetireOlderThan(6);
  // The interrupted save the resumed run found, then the oldest.
  EXPECT_THAT(retired.removed, ElementsAre(dir + "/step-00000010", dir + "/step-00000002"));
  EXPECT_THAT(StepsIn(dir), ElementsAre(4, 6));
  RunCheckpoints again = OpenOrDie(dir, Resume(), "new");
  EXPECT_EQ(again.resume_from()->step, 6);
  EXPECT_EQ(again.resume_from()->settings, (std::map<std::string, std::string>{{"seed", "7"}}));
  // A data file gone: damaged.
  ASSERT_EQ(std::system(absl::StrCat("rm '", run.PathOf(6), "'/*.distcp").c_str()), 0);
  entries = ListStepCheckpoints(dir);
  ASSERT_TRUE(entries.ok());
  EXPECT_EQ(entries->back().state, State::kDamaged);
  EXPECT_THAT(entries->back().problem, HasSubstr("that .metadata names cannot be found"));
}

}  // namespace
}  // namespace fsdp
