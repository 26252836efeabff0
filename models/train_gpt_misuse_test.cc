// The main job misused as a new user would, round two: outputs that
// overlap or would replace a checkpoint, runs whose loss does not fall,
// resumed runs whose flags differ from the checkpoint's, skipped step
// directories, initial state dicts whose entries or keys do not fit,
// inputs that are not there, damaged checkpoint metadata, two data sources,
// and weights that blew up. Each case failed before the fix it tests:
// data lost, a run failing without a reason, or a message that misled.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/job_start_in_fork.h"
#include "models/job_test_util.h"

namespace {

using ::models::testing::CommandResult;
using ::models::testing::Exists;
using ::models::testing::LossesOf;
using ::models::testing::ReadText;
using ::models::testing::RunCommand;
using ::models::testing::StartJobInFork;
using ::models::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kTrainGpt[] = "models/train_gpt";
constexpr char kLaunch[] = "launch/fsdp_launch";
// Two ranks of a small model, bounded.
const std::string kJobFlags = " --world_size=2 --print_plan=false --timeout_s=120 --n_embd=32";
const std::string kJob = absl::StrCat(kTrainGpt, kJobFlags);

void Shell(const std::string& command) {
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
}

// Refused before any rank started, with exit code 2 and `message`.
void ExpectRefusedBeforeLaunch(const CommandResult& run, const std::string& message) {
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr(message));
  EXPECT_THAT(run.output, Not(HasSubstr("launched")));
}

// The job with `flags` refused by its start, so before any rank started,
// with exit code 2 and `message`: in a fork of the test, through main()'s
// path (models/job_start_in_fork.h), a launch's libtorch loading spared.
// Each test launches the binary for one of its refusals too.
CommandResult ExpectStartRefuses(const std::string& flags, const std::string& message) {
  CommandResult start = StartJobInFork(kJobFlags + flags);
  EXPECT_EQ(start.exit_code, 2) << start.output;
  EXPECT_THAT(start.output, HasSubstr(message));
  return start;
}

// Issue 40, case 2: the same file named twice lost the state dict (the
// optimizer's export replaced it); overlapping directories are the same.
TEST(TrainGptMisuse, OutputsThatOverlapAreRefusedBeforeLaunch) {
  const std::string dir = TempDir("overlap");
  // Another name of the same directory (beside it, so that nothing walking
  // the tree loops).
  const std::string alias = TempDir("overlap_alias") + "/to";
  ASSERT_EQ(symlink(dir.c_str(), alias.c_str()), 0);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" --export_state_dict=" + dir + "/x.pt --export_optim_state_dict=" + dir + "/x.pt",
       "--export_state_dict=" + dir + "/x.pt and --export_optim_state_dict=" + dir +
           "/x.pt name the same file: one would overwrite the other"},
      // The same file under another name.
      {" --export_state_dict=" + dir + "/y.pt --record_batches=" + alias + "/./y.pt",
       "--export_state_dict=" + dir + "/y.pt and --record_batches=" + alias +
           "/./y.pt name the same file"},
      {" --checkpoint_dir=" + dir + "/c --export_dcp=" + dir + "/c/step-00000002",
       "--export_dcp=" + dir + "/c/step-00000002 lies inside --checkpoint_dir=" + dir +
           "/c, in 'step-00000002', which this job writes there"},
      {" --checkpoint_dir=" + dir + "/d --export_dcp=" + alias + "/d",
       "--checkpoint_dir=" + dir + "/d and --export_dcp=" + alias + "/d name the same path"},
      {" --export_dcp=" + dir + "/e --metrics_jsonl=" + dir + "/e/sub/../m.jsonl",
       "--metrics_jsonl=" + dir + "/e/sub/../m.jsonl lies inside --export_dcp=" + dir +
           "/e, in a directory this job writes into"},
      {" --trace_dir=" + dir + "/t --record_batches=" + dir + "/t/trace_rank1.json",
       "--record_batches=" + dir + "/t/trace_rank1.json lies inside --trace_dir=" + dir +
           "/t, in 'trace_rank1.json'"},
  };
  for (const auto& [flags, message] : cases) {
    SCOPED_TRACE(flags);
    ExpectStartRefuses(" --steps=2" + flags, message);
  }
  ExpectRefusedBeforeLaunch(RunCommand(kJob + " --steps=2" + cases[0].first), cases[0].second);
  EXPECT_FALSE(Exists(dir + "/x.pt"));
  // Beside what a directory's writer touches, an output may live in it.
  const CommandResult beside = RunCommand(absl::StrCat(
      kJob, " --steps=2 --checkpoint_dir=", dir, "/run --metrics_jsonl=", dir,
      "/run/metrics.jsonl --export_dcp=", dir, "/run/final"));
  EXPECT_EQ(beside.exit_code, 0) << beside.output;
  EXPECT_TRUE(Exists(dir + "/run/metrics.jsonl"));
  EXPECT_TRUE(Exists(dir + "/run/final/.metadata"));
}

// Case 3: --export_dcp onto a checkpoint replaced it without a word (and
// removed PyTorch's data file); now it is refused unless told.
TEST(TrainGptMisuse, AnExportReplacesACheckpointOnlyWhenTold) {
  const std::string dir = TempDir("replace");
  const std::string dcp = dir + "/dcp", pt = dir + "/model.pt";
  const CommandResult first =
      RunCommand(absl::StrCat(kJob, " --steps=2 --export_dcp=", dcp, " --export_state_dict=", pt));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  // A data file of PyTorch's name beside ours, as dcp.save writes it.
  Shell(absl::StrCat("cp ", dcp, "/__0_*.distcp ", dcp, "/__0_0.distcp"));
  const std::string metadata = ReadText(dcp + "/.metadata"), model = ReadText(pt);
  const CommandResult again =
      RunCommand(absl::StrCat(kJob, " --steps=3 --export_dcp=", dcp));
  ExpectRefusedBeforeLaunch(again, "--export_dcp=" + dcp +
                                       ": it already holds a Distributed Checkpoint (.metadata), "
                                       "which this job would replace: --overwrite_exports "
                                       "replaces it");
  ExpectRefusedBeforeLaunch(RunCommand(absl::StrCat(kJob, " --steps=3 --export_state_dict=", pt)),
                            "--export_state_dict=" + pt + ": it already holds a file of ");
  EXPECT_EQ(ReadText(dcp + "/.metadata"), metadata);
  EXPECT_TRUE(Exists(dcp + "/__0_0.distcp"));
  EXPECT_EQ(ReadText(pt), model);
  // Told to, it replaces both.
  const CommandResult replaced = RunCommand(absl::StrCat(
      kJob, " --steps=3 --overwrite_exports --export_dcp=", dcp, " --export_state_dict=", pt));
  ASSERT_EQ(replaced.exit_code, 0) << replaced.output;
  EXPECT_NE(ReadText(dcp + "/.metadata"), metadata);
  EXPECT_FALSE(Exists(dcp + "/__0_0.distcp"));
  EXPECT_NE(ReadText(pt), model);
}

// Case 4: a run whose loss did not fall exited 1 with "DID NOT FALL" and no
// rank saying why. A run that trained and wrote its outputs succeeded.
TEST(TrainGptMisuse, ARunWhoseLossDoesNotFallSucceeds) {
  const std::string dir = TempDir("flat");
  for (const std::string& flags :
       {std::string(" --steps=1"), std::string(" --steps=2 --lr=0")}) {
    SCOPED_TRACE(flags);
    const CommandResult run = RunCommand(absl::StrCat(kJob, flags));
    EXPECT_EQ(run.exit_code, 0) << run.output;
    EXPECT_THAT(run.output, HasSubstr("over steps 1.."));
    EXPECT_THAT(run.output, Not(HasSubstr("DID NOT FALL")));
  }
  // Random bytes have nothing to learn; the exports are written all the same.
  Shell(absl::StrCat("head -c 200000 /dev/urandom > ", dir, "/random.bin"));
  const CommandResult random = RunCommand(absl::StrCat(
      kJob, " --steps=2 --data=", dir, "/random.bin --export_state_dict=", dir, "/model.pt"));
  EXPECT_EQ(random.exit_code, 0) << random.output;
  EXPECT_TRUE(Exists(dir + "/model.pt"));
}

// Cases 5 and 6: --resume with another optimizer printed about 13 KB of
// "missing" entries; other changed settings ran on without a note, and
// --checkpoint_every fell back to 100. A resumed run now continues as its
// checkpoint's run was set up, says what differs, and refuses what cannot.
TEST(TrainGptMisuse, AResumedRunTakesItsCheckpointsSettingsAndSaysWhatDiffers) {
  const std::string dir = TempDir("settings");
  const std::string run_flags =
      " --checkpoint_every=3 --seed=7 --batch_size=2 --dropout=0.1 --grad_clip=0.5 "
      "--sharding_strategy=shard_grad_op --keep_checkpoints=5";
  // The same run without a stop, for its losses.
  const CommandResult whole = RunCommand(absl::StrCat(
      kJob, run_flags, " --steps=9 --checkpoint_dir=", dir, "/whole --metrics_jsonl=", dir,
      "/whole.jsonl"));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const std::string ckpt = dir + "/ckpt";
  const std::string resume = absl::StrCat(kJob, " --resume --checkpoint_dir=", ckpt);
  const CommandResult first =
      RunCommand(absl::StrCat(kJob, run_flags, " --steps=3 --checkpoint_dir=", ckpt));
  ASSERT_EQ(first.exit_code, 0) << first.output;

  for (const char* format : {"sharded", "dcp"}) {
    SCOPED_TRACE(format);
    const std::string at = absl::StrCat(dir, "/", format);
    const CommandResult saved = RunCommand(absl::StrCat(
        kJob, " --steps=2 --checkpoint_format=", format, " --checkpoint_dir=", at));
    ASSERT_EQ(saved.exit_code, 0) << saved.output;
    // Which optimizer and grouping the checkpoint holds, and what the flags
    // ask for.
    const std::string sgd =
        absl::StrCat(" --resume --steps=4 --optimizer=sgd --checkpoint_dir=", at);
    const std::string sgd_refused = absl::StrCat(
        "--optimizer=sgd: the checkpoint to resume, '", at,
        "/step-00000002', was saved by a run with --optimizer=adamw "
        "--weight_decay_groups=one, and this run asks for --optimizer=sgd "
        "--weight_decay_groups=one; its optimizer state is of that optimizer and "
        "grouping, which a resumed run cannot change: leave --optimizer out");
    ExpectStartRefuses(sgd, sgd_refused);
    if (std::string(format) == "sharded") {
      ExpectRefusedBeforeLaunch(RunCommand(kJob + sgd), sgd_refused);
    }
    const CommandResult groups = ExpectStartRefuses(
        absl::StrCat(" --resume --steps=4 --weight_decay_groups=nanogpt --n_embd=64 "
                     "--checkpoint_dir=",
                     at),
        "--weight_decay_groups=nanogpt: the checkpoint to resume");
    EXPECT_THAT(groups.output,
                HasSubstr("and this run asks for --optimizer=adamw --weight_decay_groups=nanogpt"));
    EXPECT_THAT(groups.output,
                HasSubstr("--n_embd=64: the checkpoint to resume, '" + at +
                          "/step-00000002', was saved by a run with --n_embd=32; its model has "
                          "that shape"));
  }

  // Left out, every setting is the checkpoint's: checkpoints every 3 steps
  // (not 100), and the losses of the run that never stopped.
  const CommandResult resumed = RunCommand(absl::StrCat(
      resume, " --steps=9 --metrics_jsonl=", dir, "/resumed.jsonl"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output,
              HasSubstr("note: settings from the checkpoint (flags left out): batch_size=2, "
                        "checkpoint_every=3, dropout=0.1, grad_clip=0.5, keep_checkpoints=5, "
                        "seed=7, sharding_strategy=shard_grad_op\n"));
  EXPECT_THAT(resumed.output, HasSubstr("2 ranks, SHARD_GRAD_OP"));
  EXPECT_THAT(resumed.output, HasSubstr("checkpoint " + ckpt + "/step-00000006\n"));
  EXPECT_THAT(resumed.output, HasSubstr("checkpoint " + ckpt + "/step-00000009\n"));
  const std::vector<double> whole_losses = LossesOf(dir + "/whole.jsonl");
  const std::vector<double> resumed_losses = LossesOf(dir + "/resumed.jsonl");
  ASSERT_EQ(whole_losses.size(), 9u);
  ASSERT_EQ(resumed_losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(resumed_losses[i], whole_losses[i + 3]) << i;

  // Given, one that may change is used, and said so with the checkpoint's.
  const CommandResult changed =
      RunCommand(absl::StrCat(resume, " --steps=10 --batch_size=3 --world_size=1 --seed=8"));
  ASSERT_EQ(changed.exit_code, 0) << changed.output;
  EXPECT_THAT(changed.output,
              HasSubstr("note: settings that differ from the checkpoint's: batch_size=3 "
                        "(--batch_size; the checkpoint's was 2), seed=8 (--seed; the "
                        "checkpoint's was 7), world_size=1 (--world_size; the checkpoint's was "
                        "2)\n"));
  EXPECT_THAT(changed.output, HasSubstr("global batch 3 x 32 tokens"));
  // Under another launcher the world size is the launcher's, said so.
  const CommandResult launched = RunCommand(absl::StrCat(
      kLaunch, " --nproc_per_node=2 --timeout_s=120 -- ", kTrainGpt,
      " --print_plan=false --timeout_s=120 --resume --steps=11 --checkpoint_dir=", ckpt));
  ASSERT_EQ(launched.exit_code, 0) << launched.output;
  EXPECT_THAT(launched.output, HasSubstr("note: settings that differ from the checkpoint's: "
                                         "world_size=2 (the launcher's; the checkpoint's was "
                                         "1)\n"));
}

// Case 7: the note promised "step 4 is saved again when the run gets
// there", and it was not; a stale empty step directory was announced the
// same way, forever. Interrupted saves are now removed by the resumed run's
// first checkpoint, and the note says so.
TEST(TrainGptMisuse, InterruptedSavesAreRemovedByTheResumedRunAndTheNoteSaysSo) {
  for (const char* format : {"sharded", "dcp"}) {
    SCOPED_TRACE(format);
    const std::string dir = TempDir(absl::StrCat("interrupted_", format));
    const CommandResult run = RunCommand(absl::StrCat(
        kJob, " --steps=4 --checkpoint_every=2 --checkpoint_format=", format,
        " --checkpoint_dir=", dir));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    Shell(absl::StrCat("rm -f ", dir, "/step-00000004/manifest.pb ", dir,
                       "/step-00000004/.metadata && mkdir ", dir, "/step-00000099"));
    const CommandResult resumed =
        RunCommand(absl::StrCat(kJob, " --resume --steps=5 --checkpoint_dir=", dir));
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    for (const int step : {4, 99}) {
      EXPECT_THAT(resumed.output,
                  HasSubstr(absl::StrFormat(
                      "note: '%s/step-%08d' holds neither manifest.pb nor .metadata (an "
                      "interrupted save); resuming from step 2 instead; it is removed once this "
                      "run saves a checkpoint\n",
                      dir, step)));
    }
    EXPECT_THAT(resumed.output, Not(HasSubstr("no manifest")));
    EXPECT_THAT(resumed.output, Not(HasSubstr("saved again")));
    EXPECT_THAT(resumed.output, HasSubstr("checkpoint " + dir + "/step-00000004\n"));
    EXPECT_FALSE(Exists(dir + "/step-00000099"));
    EXPECT_TRUE(Exists(dir + "/step-00000005"));
  }
  // A checkpoint whose shard files another job removed is damaged, never
  // complete.
  const std::string dir = TempDir("shardless");
  const CommandResult run = RunCommand(
      absl::StrCat(kJob, " --steps=4 --checkpoint_every=2 --checkpoint_dir=", dir));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  Shell(absl::StrCat("rm ", dir, "/step-00000004/shard-*.bin"));
  const CommandResult damaged =
      RunCommand(absl::StrCat(kJob, " --resume --steps=5 --checkpoint_dir=", dir));
  ExpectRefusedBeforeLaunch(damaged, "the newest checkpoint, '" + dir +
                                         "/step-00000004', is damaged: the shard file '");
  EXPECT_THAT(damaged.output, HasSubstr("remove it to resume from step 2"));
}

// Cases 8 and 9: a Distributed Checkpoint's entries the model lacks were
// loaded without a word while the same in a torch.save file was refused;
// one under {"model", "optim"} listed 28 "missing" entries.
TEST(TrainGptMisuse, InitialStateOfEveryFormatFollowsOneRuleAndNamesTheKey) {
  const std::string dir = TempDir("init_rule");
  // A model of three blocks: two of them fit a model of two.
  const CommandResult three = RunCommand(absl::StrCat(
      kJob, " --steps=2 --n_layer=3 --export_dcp=", dir, "/dcp --export_state_dict=", dir,
      "/model.pt"));
  ASSERT_EQ(three.exit_code, 0) << three.output;
  for (const std::string& source :
       {absl::StrCat(dir, "/dcp --init_state_dict_key=model"), dir + "/model.pt"}) {
    SCOPED_TRACE(source);
    const std::string job = absl::StrCat(kJob, " --steps=2 --n_layer=2 --init_state_dict=", source);
    const CommandResult refused = RunCommand(job);
    EXPECT_EQ(refused.exit_code, 1) << refused.output;
    EXPECT_THAT(refused.output, HasSubstr("12 entries are not in the model: "
                                          "transformer.h.2.attn.c_attn.bias, "));
    EXPECT_THAT(refused.output, HasSubstr("can be dropped with --init_state_dict_ignore=GLOB"));
    const CommandResult dropped = RunCommand(job + " '--init_state_dict_ignore=transformer.h.2.*'");
    EXPECT_EQ(dropped.exit_code, 0) << dropped.output;
    EXPECT_THAT(dropped.output, HasSubstr("(dropped by --init_state_dict_ignore: "
                                          "transformer.h.2.attn.c_attn.bias, "));
  }
  const CommandResult model = RunCommand(
      absl::StrCat(kJob, " --steps=2 --n_layer=3 --init_state_dict=", dir, "/dcp"));
  EXPECT_EQ(model.exit_code, 1) << model.output;
  EXPECT_THAT(model.output, HasSubstr("(its entries lie under the top-level keys 'model', "
                                      "'optim': --init_state_dict_key=model takes those under "
                                      "'model')"));
  const CommandResult typo = RunCommand(absl::StrCat(
      kJob, " --steps=2 --n_layer=3 --init_state_dict=", dir, "/dcp --init_state_dict_key=modle"));
  EXPECT_EQ(typo.exit_code, 1) << typo.output;
  EXPECT_THAT(typo.output, HasSubstr("(no entry lies under --init_state_dict_key=modle; its "
                                     "top-level keys are 'model', 'optim')"));
  const CommandResult optim = RunCommand(
      absl::StrCat(kJob, " --steps=2 --n_layer=3 --init_optim_state_dict=", dir, "/dcp"));
  EXPECT_EQ(optim.exit_code, 1) << optim.output;
  EXPECT_THAT(optim.output, HasSubstr("--init_optim_state_dict_key=optim takes those under "
                                      "'optim'"));
}

// Case 10: a missing --init_state_dict or --replay_batches was found only
// inside the ranks (exit 1, the flag not named).
TEST(TrainGptMisuse, InputsThatCannotBeReadAreRefusedBeforeLaunch) {
  const std::string dir = TempDir("inputs");
  Shell(absl::StrCat("mkdir ", dir, "/plain && touch ", dir, "/locked && chmod 000 ", dir,
                     "/locked"));
  std::vector<std::pair<std::string, std::string>> cases = {
      {"--init_state_dict=" + dir + "/none.pt",
       "--init_state_dict=" + dir + "/none.pt: No such file or directory"},
      {"--init_optim_state_dict=" + dir + "/none.pt",
       "--init_optim_state_dict=" + dir + "/none.pt: No such file or directory"},
      {"--replay_batches=" + dir + "/none.pt",
       "--replay_batches=" + dir + "/none.pt: No such file or directory"},
      {"--init_state_dict=" + dir + "/plain",
       "--init_state_dict=" + dir + "/plain: a directory without .metadata, so not a "
                                    "Distributed Checkpoint"},
      {"--replay_batches=" + dir + "/plain", "--replay_batches=" + dir + "/plain: a directory"},
  };
  // Root reads any file.
  if (geteuid() != 0) {
    cases.push_back({"--init_state_dict=" + dir + "/locked",
                     "--init_state_dict=" + dir + "/locked: cannot read '"});
  }
  for (const auto& [flags, message] : cases) {
    SCOPED_TRACE(flags);
    ExpectStartRefuses(" --steps=2 " + flags, message);
  }
  ExpectRefusedBeforeLaunch(RunCommand(absl::StrCat(kJob, " --steps=2 ", cases[0].first)),
                            cases[0].second);
}

// Case 11: a byte flipped in a DCP checkpoint's .metadata gave a message cut
// at an embedded NUL, raw bytes printed, the way to resume lost.
TEST(TrainGptMisuse, DamageQuotedFromAFileIsEscapedAndTheMessageWhole) {
  const std::string dir = TempDir("flipped");
  const CommandResult run = RunCommand(absl::StrCat(
      kJob, " --steps=4 --checkpoint_every=2 --checkpoint_format=dcp --checkpoint_dir=", dir));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const std::string metadata = dir + "/step-00000004/.metadata";
  std::string bytes = ReadText(metadata);
  const size_t name = bytes.find("transformer.wte.weight");
  ASSERT_NE(name, std::string::npos);
  bytes[name + 3] = '\0';
  bytes[name + 5] = '\x96';
  std::ofstream(metadata, std::ios::binary | std::ios::trunc) << bytes;
  const CommandResult resumed =
      RunCommand(absl::StrCat(kJob, " --resume --steps=6 --checkpoint_dir=", dir));
  ExpectRefusedBeforeLaunch(resumed, "'model.tra\\x00s\\x96ormer.wte.weight'");
  EXPECT_THAT(resumed.output, HasSubstr("; remove it to resume from step 2\n"));
  for (const char c : resumed.output) {
    EXPECT_TRUE(c == '\n' || (c >= 0x20 && c < 0x7f)) << static_cast<int>(c);
  }
}

// Case 14: --replay_batches with --data trained on the recording and
// evaluated on the file without a word.
TEST(TrainGptMisuse, TheJobSaysWhichSourceEachPartOfTheRunUses) {
  const std::string dir = TempDir("sources");
  Shell(absl::StrCat("seq 1 20000 > ", dir, "/corpus.txt"));
  const CommandResult record = RunCommand(
      absl::StrCat(kJob, " --steps=2 --record_batches=", dir, "/batches.pt"));
  ASSERT_EQ(record.exit_code, 0) << record.output;
  EXPECT_THAT(record.output, HasSubstr("data: training batches from the generated corpus ("));
  const CommandResult both = RunCommand(absl::StrCat(
      kJob, " --steps=2 --replay_batches=", dir, "/batches.pt --data=", dir, "/corpus.txt"));
  ASSERT_EQ(both.exit_code, 0) << both.output;
  EXPECT_THAT(both.output,
              HasSubstr(absl::StrCat("data: training batches replayed from ", dir,
                                     "/batches.pt; the held-out loss and the sample from the "
                                     "last tenth of --data=",
                                     dir, "/corpus.txt (")));
  const CommandResult data =
      RunCommand(absl::StrCat(kJob, " --steps=2 --data=", dir, "/corpus.txt"));
  ASSERT_EQ(data.exit_code, 0) << data.output;
  EXPECT_THAT(data.output, HasSubstr(absl::StrCat("data: training batches from the first nine "
                                                  "tenths of --data=",
                                                  dir, "/corpus.txt (")));
}

// Writes `ids` to `path` as little-endian T (this host's order: x86).
template <typename T>
void WriteIds(const std::string& path, const std::vector<T>& ids) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(ids.data()),
            static_cast<std::streamsize>(ids.size() * sizeof(T)));
  ASSERT_TRUE(out.good()) << path;
}

// --data_tokens (nanoGPT's train.bin): ids equal to --data's bytes train
// exactly as --data does, as uint16 and as uint32, and a file that is not
// such ids, or ids the model has no embedding for, is refused naming it.
TEST(TrainGptMisuse, TokenFilesTrainAsTheirBytesAndBadOnesAreRefused) {
  const std::string dir = TempDir("data_tokens");
  Shell(absl::StrCat("seq 1 20000 > ", dir, "/corpus.txt"));
  const std::string text = ReadText(dir + "/corpus.txt");
  WriteIds(dir + "/u16.bin", std::vector<uint16_t>(text.begin(), text.end()));
  WriteIds(dir + "/u32.bin", std::vector<uint32_t>(text.begin(), text.end()));
  const std::string run = absl::StrCat(kJob, " --steps=3 --eval_every=2 --metrics_jsonl=", dir);
  for (const std::string& source :
       {"/bytes.jsonl --data=" + dir + "/corpus.txt", "/u16.jsonl --data_tokens=" + dir + "/u16.bin",
        "/u32.jsonl --data_tokens_dtype=uint32 --data_tokens=" + dir + "/u32.bin"}) {
    const CommandResult trained = RunCommand(run + source);
    ASSERT_EQ(trained.exit_code, 0) << trained.output;
  }
  const std::vector<double> bytes = LossesOf(dir + "/bytes.jsonl");
  ASSERT_EQ(bytes.size(), 3u);
  EXPECT_EQ(LossesOf(dir + "/u16.jsonl"), bytes);
  EXPECT_EQ(LossesOf(dir + "/u32.jsonl"), bytes);

  WriteIds(dir + "/odd.bin", std::vector<uint8_t>(4001, 1));
  ExpectRefusedBeforeLaunch(
      RunCommand(absl::StrCat(kJob, " --steps=2 --data_tokens=", dir, "/odd.bin")),
      absl::StrCat("--data_tokens=", dir,
                   "/odd.bin: 4001 bytes are not a whole number of 2-byte uint16 ids"));
  ExpectStartRefuses(absl::StrCat(" --data=", dir, "/corpus.txt --data_tokens=", dir, "/u16.bin"),
                     "the job trains on one source; give one of them");
  ExpectStartRefuses(absl::StrCat(" --sample_tokens=8 --data_tokens=", dir, "/u16.bin"),
                     "--sample_tokens=8: applies only with --data (the sample is bytes");
  ExpectStartRefuses(absl::StrCat(" --data_tokens_dtype=int8 --data_tokens=", dir, "/u16.bin"),
                     "--data_tokens_dtype=int8: must be uint16 or uint32");
  ExpectStartRefuses(" --data_tokens_dtype=uint32", "--data_tokens_dtype=uint32: applies only "
                                                    "with --data_tokens");
  // The corpus is one choice: a run resumed with --data_tokens takes
  // neither the recorded --data nor its dtype.
  const CommandResult first = RunCommand(absl::StrCat(
      kJob, " --steps=1 --checkpoint_every=1 --checkpoint_dir=", dir, "/ckpt --data=", dir,
      "/corpus.txt"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const CommandResult switched = RunCommand(absl::StrCat(
      kJob, " --steps=2 --resume --checkpoint_dir=", dir, "/ckpt --data_tokens=", dir, "/u16.bin"));
  EXPECT_EQ(switched.exit_code, 0) << switched.output;
  EXPECT_THAT(switched.output, HasSubstr(absl::StrCat("training batches from the first nine "
                                                      "tenths of --data_tokens=",
                                                      dir, "/u16.bin")));
  // 65535 read as uint16, not as -1: too large for the byte-level model's
  // 256 embeddings, and named before the batch reaches it.
  WriteIds(dir + "/large.bin", std::vector<uint16_t>(4000, 65535));
  const CommandResult large =
      RunCommand(absl::StrCat(kJob, " --steps=2 --data_tokens=", dir, "/large.bin"));
  EXPECT_EQ(large.exit_code, 1) << large.output;
  EXPECT_THAT(large.output,
              HasSubstr(absl::StrCat("--data_tokens=", dir, "/large.bin: token id 65535 (the "
                                     "file's token ")));
  EXPECT_THAT(large.output, HasSubstr("is not below the model's vocabulary size 256"));
}

// Case 15: --lr=1e30 stopped at step 2, but step 1's checkpoint already held
// the blown-up weights (finite, 1e30), so every resume stopped again.
TEST(TrainGptMisuse, WeightsThatBlewUpAreNeverCheckpointed) {
  const std::string dir = TempDir("blown_up");
  const CommandResult good =
      RunCommand(absl::StrCat(kJob, " --steps=2 --checkpoint_every=1 --checkpoint_dir=", dir));
  ASSERT_EQ(good.exit_code, 0) << good.output;
  const CommandResult blown = RunCommand(absl::StrCat(
      kJob, " --resume --steps=5 --lr=1e30 --checkpoint_dir=", dir, " --export_dcp=", dir,
      "_final"));
  EXPECT_EQ(blown.exit_code, 1) << blown.output;
  EXPECT_THAT(blown.output, HasSubstr("step 3: the updated weights give a loss of "));
  EXPECT_THAT(blown.output, HasSubstr(" on step 3's batch (rank "));
  EXPECT_THAT(blown.output, HasSubstr("its checkpoint was not written, and the run stops"));
  EXPECT_FALSE(Exists(dir + "/step-00000003"));
  EXPECT_FALSE(Exists(dir + "_final/.metadata"));
  // The newest checkpoint is still the good one, and resumes.
  const CommandResult resumed =
      RunCommand(absl::StrCat(kJob, " --resume --steps=3 --checkpoint_dir=", dir));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resumed from " + dir + "/step-00000002"));
  // With no checkpoint to fall back to, nothing is written at all.
  const std::string fresh = TempDir("blown_up_fresh");
  const CommandResult first = RunCommand(absl::StrCat(
      kJob, " --steps=3 --lr=1e30 --checkpoint_every=1 --checkpoint_dir=", fresh,
      " --export_state_dict=", fresh, "_model.pt"));
  EXPECT_EQ(first.exit_code, 1) << first.output;
  EXPECT_FALSE(Exists(fresh + "/step-00000001"));
  EXPECT_FALSE(Exists(fresh + "_model.pt"));
  // Exports alone, after the last step: not written either; the batches
  // recorded, which may explain it, are.
  const CommandResult exports = RunCommand(absl::StrCat(
      kJob, " --steps=1 --lr=1e30 --export_state_dict=", fresh, "_final.pt --export_dcp=", fresh,
      "_final --record_batches=", fresh, "_batches.pt"));
  EXPECT_EQ(exports.exit_code, 1) << exports.output;
  EXPECT_THAT(exports.output, HasSubstr("step 1: the updated weights give a loss of "));
  EXPECT_THAT(exports.output, HasSubstr(": the exports were not written, and the run stops (a "
                                        "smaller --lr may help)"));
  EXPECT_FALSE(Exists(fresh + "_final.pt"));
  EXPECT_FALSE(Exists(fresh + "_final/.metadata"));
  EXPECT_TRUE(Exists(fresh + "_batches.pt"));
}

}  // namespace
