// The main job under bad input: flags and output paths refused before any
// rank starts, checkpoint directories that belong to one run, non-finite
// losses, and initial state dicts that do not fit.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/job_start_in_fork.h"
#include "models/job_test_util.h"
#include "testing/torch_python.h"

namespace {

using ::models::testing::CommandResult;
using ::models::testing::Exists;
using ::models::testing::LossesOf;
using ::models::testing::ReadText;
using ::models::testing::RunCommand;
using ::models::testing::StartJobInFork;
using ::models::testing::TempDir;
using ::testing::HasSubstr;

constexpr char kTrainGpt[] = "models/train_gpt";
constexpr char kLaunch[] = "launch/fsdp_launch";

// Each bad flag of the main job and of the launcher is refused with an error
// naming it and the valid values, before any rank starts. Each is checked
// through main()'s path in a fork of this process; a few, one of each kind,
// are launched as well, and a flag absl cannot parse only is.
TEST(TrainGpt, BadFlagsAreRefusedNamingTheProblem) {
  enum Check { kForked, kAlsoLaunched, kOnlyLaunched };
  struct BadFlags {
    std::string flags;
    int exit_code;
    std::string message;
    Check check = kForked;
  };
  const std::string dir = TempDir("bad_flags");
  const std::vector<BadFlags> cases = {
      {"--world_size=0", 2, "--world_size=0: must be >= 1", kAlsoLaunched},
      {"--steps=0", 2, "--steps=0: must be >= 1"},
      {"--batch_size=0", 2, "--batch_size=0: must be >= 1"},
      {"--n_head=0", 2, "--n_head=0: must be >= 1"},
      {"--n_embd=0", 2, "--n_embd=0: must be >= 1"},
      {"--n_layer=0", 2, "--n_layer=0: must be >= 1"},
      {"--n_embd=30", 2, "--n_embd=30: must be a multiple of --n_head=4"},
      {"--block_size=1", 2, "--block_size=1: must be in [2, 1048574]"},
      {"--block_size=100000", 2,
       "--block_size=100000, --batch_size=16, --n_layer=2, --n_head=4, --n_embd=64: training "
       "needs about "},
      {"--checkpoint_every=0", 2, "--checkpoint_every=0: must be >= 1"},
      {"--checkpoint_every=-3", 2, "--checkpoint_every=-3: must be >= 1"},
      {"--keep_checkpoints=0", 2, "--keep_checkpoints=0: must be >= 1"},
      {"--shard_group_size=-1", 2, "--shard_group_size=-1: must be >= 0"},
      {"--shard_group_size=2", 2,
       "--shard_group_size=2: applies only to --sharding_strategy=hybrid_shard or "
       "_hybrid_shard_zero2, not FULL_SHARD"},
      {"--sharding_strategy=hybrid_shard --shard_group_size=3", 2,
       "--shard_group_size=3: must divide the world size 2"},
      {"--log_every=0", 2, "--log_every=0: must be >= 1"},
      {"--timeout_s=0", 2, "--timeout_s=0: must be >= 1"},
      {"--collective_timeout_s=0", 2, "--collective_timeout_s=0: must be >= 1"},
      {"--verify_collectives_every=-1", 2, "--verify_collectives_every=-1: must be >= 0"},
      {"--max_consecutive_skips=-1", 2, "--max_consecutive_skips=-1: must be >= 0"},
      {"--lr=-1", 2, "--lr=-1: must be >= 0 and finite"},
      {"--lr=nan", 2, "--lr=nan: must be >= 0 and finite"},
      {"--weight_decay=inf", 2, "--weight_decay=inf: must be >= 0 and finite"},
      {"--beta1=-0.1", 2, "--beta1=-0.1: must be in [0, 1)"},
      {"--dropout=1", 2, "--dropout=1: must be in [0, 1)"},
      {"--beta2=1", 2, "--beta2=1: must be in [0, 1)"},
      {"--eps=0", 2, "--eps=0: must be > 0 and finite"},
      {"--grad_clip=-1", 2, "--grad_clip=-1: must be >= 0 and finite (0: off)"},
      {"--optimizer=adam", 2, "--optimizer=adam: expected adamw or sgd"},
      {"--export_optim_state_dict_keys=name", 2,
       "--export_optim_state_dict_keys=name: expected fqn or index"},
      {"--optimizer_kernel=foreach", 2,
       "--optimizer_kernel=foreach: expected flat_exact, flat_fused or per_parameter"},
      {"--on_nonfinite=ignore", 2, "--on_nonfinite=ignore: expected stop or skip"},
      {"--weight_decay_groups=two", 2, "--weight_decay_groups=two: expected one or nanogpt"},
      {"--checkpoint_format=zip", 2, "--checkpoint_format=zip: expected sharded or dcp"},
      {"--sharding_strategy=ful_shard", 2, "unknown sharding strategy 'ful_shard' (valid: "},
      {"--param_dtype=int8", 2, "unknown dtype 'int8' (valid: float32/fp32"},
      {"--all_gather_quantization=int4", 2,
       "--all_gather_quantization: unknown quantization 'int4'; valid: none, bf16, "
       "int8"},
      {"--all_gather_quantization=int8 --sharding_strategy=no_shard", 2,
       "--all_gather_quantization=int8 with --sharding_strategy=no_shard, --param_dtype='' and "
       "--reduce_dtype='': "
       "unit '<root>' has all_gather_quantization=int8 but its strategy is NO_SHARD"},
      {"--all_gather_quantization=bf16 --param_dtype=bf16", 2,
       "it already all-gathers in BFloat16 (mixed precision or the parameters' dtype): bf16 "
       "would save nothing"},
      {"--reduce_quantization=bf16 --reduce_dtype=bf16", 2,
       "--reduce_quantization=bf16 with --sharding_strategy=full_shard, --param_dtype='' and "
       "--reduce_dtype='bf16': unit '<root>' has reduce_quantization=bf16 but it already "
       "reduce-scatters in BFloat16"},
      {"--backward_prefetch=sideways", 2,
       "--backward_prefetch=sideways: expected none, backward_pre or backward_post"},
      {"--wrap_policy=nonsense", 2, "no policy named 'nonsense' (registered: "},
      {"--policy_plugin=/nonexistent.so", 2, "cannot load wrap policy plugin '/nonexistent.so'",
       kAlsoLaunched},
      {"--steps=abc", 1, "Illegal value 'abc' specified for flag 'steps'", kOnlyLaunched},
      {"--device=tpu", 2, "--device=tpu: must be cpu, cuda or cuda:N"},
      {"--data=" + dir + "/none", 2, "--data=" + dir + "/none: not a readable file"},
      {"--data=" + dir + "/file", 2,
       "--data=" + dir +
           "/file: 0 bytes hold 0 held-out bytes (the last tenth), fewer than "
           "--block_size + 2 = 34"},
      {"--eval_batches=0", 2, "--eval_batches=0: must be >= 1"},
      {"--device=cuda:x", 2, "--device=cuda:x: "},
      // A malformed device is named as such before any GPU is looked for.
      {"--device=cuda:abc", 2,
       "--device=cuda:abc: must be cpu, cuda or cuda:N, N a GPU's index (0, 1, ...)"},
      {"--device=cuda:-1", 2, "--device=cuda:-1: must be cpu, cuda or cuda:N"},
      // Flags that mean something only beside another.
      {"--checkpoint_format=dcp", 2, "--checkpoint_format=dcp: applies only with --checkpoint_dir"},
      {"--checkpoint_every=5", 2, "--checkpoint_every=5: applies only with --checkpoint_dir"},
      {"--keep_checkpoints=3", 2, "--keep_checkpoints=3: applies only with --checkpoint_dir"},
      {"--async_checkpoint", 2, "--async_checkpoint=true: applies only with --checkpoint_dir"},
      {"--init_state_dict_key=model", 2,
       "--init_state_dict_key=model: applies only with --init_state_dict"},
      {"--init_state_dict_ignore=*.bias", 2,
       "--init_state_dict_ignore=*.bias: applies only with --init_state_dict"},
      {"--init_optim_state_dict_key=optim", 2,
       "--init_optim_state_dict_key=optim: applies only with --init_optim_state_dict"},
      {"--export_optim_state_dict_keys=index", 2,
       "--export_optim_state_dict_keys=index: applies only with --export_optim_state_dict"},
      {"--eval_every=5", 2, "--eval_every=5: applies only with --data"},
      {"--eval_batches=2", 2, "--eval_batches=2: applies only with --data"},
      {"--sample_tokens=8", 2, "--sample_tokens=8: applies only with --data"},
      {"--max_consecutive_skips=3", 2,
       "--max_consecutive_skips=3: applies only with --on_nonfinite=skip"},
      {"--overwrite_exports", 2, "--overwrite_exports=true: applies only with an --export_* flag"},
      {"--TEST_nan_loss_at_step=-1", 2, "--TEST_nan_loss_at_step=-1: must be >= 0"},
      {"--TEST_nan_loss_at_step=9", 2, "--TEST_nan_loss_at_step=9: beyond --steps=3"},
      {"--check_replicas_every=-1", 2, "--check_replicas_every=-1: must be >= 0"},
      {"--max_restarts=-1", 2, "--max_restarts=-1: must be >= 0"},
      {"--max_restarts=1 --restart_backoff_s=-2", 2, "--restart_backoff_s=-2: must be >= 0"},
      {"--restart_backoff_s=5", 2, "--restart_backoff_s=5: applies only with --max_restarts > 0"},
      {"--TEST_kill_at_step=9", 2, "--TEST_kill_at_step=9: beyond --steps=3"},
      {"--TEST_flip_bit_at_step=9", 2, "--TEST_flip_bit_at_step=9: beyond --steps=3"},
      {"--TEST_flip_bit_in=gradient", 2,
       "--TEST_flip_bit_in=gradient: must be parameter or optimizer"},
      {"--collectives=pigeon", 2, "--collectives=pigeon: must be auto, gloo, nccl or staged"},
      {"--collectives=nccl", 2, "--collectives=nccl needs --device=cuda or cuda:N"},
      {"--shard_collectives=tree", 2, "--shard_collectives=tree: must be flat or two_level"},
      {"--shard_collectives=two_level --sharding_strategy=hybrid_shard", 2,
       "--shard_collectives=two_level with --sharding_strategy=hybrid_shard: applies to "
       "full_shard and shard_grad_op"},
      {"--shard_collectives=two_level --sharding_strategy=no_shard", 2,
       "--shard_collectives=two_level with --sharding_strategy=no_shard: applies to "
       "full_shard and shard_grad_op"},
      {"--resume", 2, "--resume: needs --checkpoint_dir"},
      {"--overwrite_checkpoints", 2,
       "--overwrite_checkpoints: only for a new run (no --resume) with --checkpoint_dir"},
      {"--resume --checkpoint_dir=" + dir + "/none", 2,
       "--checkpoint_dir=" + dir + "/none: no complete checkpoint to resume from in '" + dir +
           "/none'",
       kAlsoLaunched},
      // Output paths are created and test-written before anything runs
      // (a regular file where a directory must be: even root cannot).
      {"--checkpoint_dir=" + dir + "/file/ckpt", 2,
       "--checkpoint_dir=" + dir + "/file/ckpt: cannot create '" + dir + "/file': Not a directory",
       kAlsoLaunched},
      {"--export_state_dict=" + dir + "/file/final.pt", 2,
       "--export_state_dict=" + dir + "/file/final.pt: cannot create '" + dir +
           "/file': Not a directory"},
      {"--export_state_dict=" + dir, 2,
       "--export_state_dict=" + dir + ": is a directory, not a file"},
      {"--trace_dir=" + dir + "/file/traces", 2,
       "--trace_dir=" + dir + "/file/traces: cannot create '" + dir + "/file': Not a directory"},
      {"--metrics_jsonl=" + dir + "/file/m.jsonl", 2,
       "--metrics_jsonl=" + dir + "/file/m.jsonl: cannot create '" + dir +
           "/file': Not a directory"},
      {"--export_dcp=" + dir + "/file/ckpt", 2,
       "--export_dcp=" + dir + "/file/ckpt: cannot create '" + dir + "/file': Not a directory"},
      {"--export_optim_state_dict=" + dir + "/file/o.pt", 2,
       "--export_optim_state_dict=" + dir + "/file/o.pt: cannot create '" + dir +
           "/file': Not a directory"},
      {"--record_batches=" + dir + "/file/b.pt", 2,
       "--record_batches=" + dir + "/file/b.pt: cannot create '" + dir + "/file': Not a directory"},
  };
  ASSERT_EQ(std::system(absl::StrCat("touch '", dir, "/file'").c_str()), 0);
  // The sweep's table (docs/main_job.md, "Bad input"): flag, exit code,
  // time to fail without the launch, message.
  std::string table = "| flags | exit | time | message |\n|---|---|---|---|\n";
  for (const BadFlags& bad : cases) {
    SCOPED_TRACE(bad.flags);
    const std::string flags = absl::StrCat("--steps=3 --print_plan=false ", bad.flags);
    if (bad.check != kForked) {
      const CommandResult run = RunCommand(absl::StrCat(kTrainGpt, " ", flags));
      EXPECT_EQ(run.exit_code, bad.exit_code) << run.output;
      EXPECT_THAT(run.output, HasSubstr(bad.message));
      // Refused before any rank started.
      EXPECT_THAT(run.output, ::testing::Not(HasSubstr("launched")));
    }
    if (bad.check == kOnlyLaunched) continue;
    const auto start = std::chrono::steady_clock::now();
    const CommandResult run = StartJobInFork(flags);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // Refused by StartJob, so before any rank started.
    EXPECT_EQ(run.exit_code, bad.exit_code) << run.output;
    EXPECT_THAT(run.output, HasSubstr(bad.message));
    std::string shown = run.output.substr(0, run.output.find('\n'));
    absl::StrReplaceAll({{dir, "DIR"}, {"|", "\\|"}}, &shown);
    std::string shown_flags = bad.flags;
    absl::StrReplaceAll({{dir, "DIR"}}, &shown_flags);
    table += absl::StrFormat("| `%s` | %d | %.3f s | %s |\n", shown_flags, run.exit_code,
                             seconds, shown);
  }
  std::printf("%s", table.c_str());
  const std::vector<BadFlags> launcher_cases = {
      {"--nproc_per_node=0 -- /bin/true", 2, "launcher: nproc_per_node 0 must be >= 1"},
      {"--nproc_per_node=2", 2, "fsdp_launch: no program given"},
      {"--nproc_per_node=2 -- /nonexistent/prog", 2,
       "launcher: '/nonexistent/prog' is not an executable file"},
      {"--timeout_s=0 -- /bin/true", 2, "launcher: timeout must be positive"},
  };
  for (const BadFlags& bad : launcher_cases) {
    SCOPED_TRACE(bad.flags);
    const CommandResult run = RunCommand(absl::StrCat(kLaunch, " ", bad.flags));
    EXPECT_EQ(run.exit_code, bad.exit_code) << run.output;
    EXPECT_THAT(run.output, HasSubstr(bad.message));
  }
}

// Under another launcher, the ranks' number is the launcher's: a
// --world_size that disagrees is refused rather than ignored.
TEST(TrainGpt, AWorldSizeOtherThanTheLaunchersIsRefused) {
  const CommandResult run = RunCommand(absl::StrCat(
      "env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 "
      "MASTER_PORT=1 ",
      kTrainGpt, " --world_size=3 --steps=1"));
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("--world_size=3: this rank's launcher started 1 ranks "
                                    "(WORLD_SIZE); --world_size applies only when train_gpt "
                                    "launches its own ranks"));
}

// Restarts are the launcher's: a rank that another launcher started and
// that is told --max_restarts the launcher was not given refuses, rather
// than promise restarts nobody will make.
TEST(TrainGpt, MaxRestartsOtherThanTheLaunchersIsRefused) {
  const CommandResult run = RunCommand(absl::StrCat(
      "env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 "
      "MASTER_PORT=1 TORCHELASTIC_MAX_RESTARTS=1 ",
      kTrainGpt, " --max_restarts=2 --steps=1"));
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("--max_restarts=2: this rank's launcher restarts the job at "
                                    "most 1 times (TORCHELASTIC_MAX_RESTARTS); give fsdp_launch "
                                    "or torchrun --max_restarts instead"));
}

// The data-loss scenario: a new run started in a directory that holds an
// older run's checkpoints (steps 5 and 10). Before, clean-up deleted the new
// run's step-3 checkpoint right after reporting it (the other run's count as
// newer), and a 7-step run left step 7 beside the old step 10, which a later
// --resume loaded. Now the start is refused unless told to overwrite, and
// then every checkpoint the new run reports survives and --resume continues
// the new run.
TEST(TrainGpt, ANewRunNeverDeletesOrResumesAnotherRunsCheckpoints) {
  const std::string dir = TempDir("two_runs");
  const std::string ckpt = dir + "/parents/made/ckpt";  // Created with its parents.
  const std::string common = " --world_size=2 --print_plan=false --checkpoint_dir=" + ckpt;
  const CommandResult old_run =
      RunCommand(absl::StrCat(kTrainGpt, common, " --steps=10 --checkpoint_every=5"));
  ASSERT_EQ(old_run.exit_code, 0) << old_run.output;
  const std::string old_manifest = ReadText(ckpt + "/step-00000010/manifest.pb");
  ASSERT_FALSE(old_manifest.empty());

  for (const char* steps : {" --steps=3", " --steps=7"}) {
    const CommandResult refused =
        RunCommand(absl::StrCat(kTrainGpt, common, steps, " --checkpoint_every=3"));
    EXPECT_EQ(refused.exit_code, 2) << refused.output;
    EXPECT_THAT(refused.output, HasSubstr("' already holds checkpoints of another run (run "));
    EXPECT_THAT(refused.output, HasSubstr(": step(s) 5, 10); a new run would mix with them"));
    EXPECT_THAT(refused.output, ::testing::Not(HasSubstr("launched")));
  }
  EXPECT_TRUE(Exists(ckpt + "/step-00000005/manifest.pb"));
  EXPECT_EQ(ReadText(ckpt + "/step-00000010/manifest.pb"), old_manifest);

  const CommandResult fresh = RunCommand(absl::StrCat(
      kTrainGpt, common,
      " --steps=7 --checkpoint_every=3 --keep_checkpoints=3 --overwrite_checkpoints"));
  ASSERT_EQ(fresh.exit_code, 0) << fresh.output;
  EXPECT_THAT(fresh.output, HasSubstr("will be removed once this run's first checkpoint is saved"));
  for (const char* step : {"3", "6", "7"}) {
    const std::string path = absl::StrCat(ckpt, "/step-0000000", step);
    EXPECT_THAT(fresh.output, HasSubstr("checkpoint " + path + "\n"));
    EXPECT_TRUE(Exists(path + "/manifest.pb")) << path;
  }
  EXPECT_FALSE(Exists(ckpt + "/step-00000005"));
  EXPECT_FALSE(Exists(ckpt + "/step-00000010"));

  const CommandResult resumed = RunCommand(absl::StrCat(kTrainGpt, common, " --steps=9 --resume"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resumed from " + ckpt + "/step-00000007 (step 7 of run "));
  // --steps at or below the step reached is refused before launch.
  const CommandResult nothing_to_do =
      RunCommand(absl::StrCat(kTrainGpt, common, " --steps=9 --resume"));
  EXPECT_EQ(nothing_to_do.exit_code, 2) << nothing_to_do.output;
  EXPECT_THAT(nothing_to_do.output,
              HasSubstr("--steps=9: the run in '" + ckpt + "' has already reached step 9"));
}

TEST(TrainGpt, ResumingNamesTheNewerCheckpointItCannotUse) {
  const std::string dir = TempDir("skipped_newest");
  const std::string common = " --world_size=2 --print_plan=false --checkpoint_dir=" + dir;
  const CommandResult run =
      RunCommand(absl::StrCat(kTrainGpt, common, " --steps=6 --checkpoint_every=3"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  // Step 6's save was interrupted before its manifest landed.
  ASSERT_EQ(::unlink((dir + "/step-00000006/manifest.pb").c_str()), 0);
  const CommandResult resumed = RunCommand(
      absl::StrCat(kTrainGpt, common, " --steps=8 --checkpoint_every=3 --resume"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output,
              HasSubstr("note: '" + dir + "/step-00000006' holds neither manifest.pb nor "
                        ".metadata (an interrupted save); resuming from step 3 instead; it is "
                        "removed once this run saves a checkpoint"));
  EXPECT_THAT(resumed.output, HasSubstr("resumed from " + dir + "/step-00000003"));
  // The resumed run saved step 6 again, then step 8, and removed step 3.
  EXPECT_TRUE(Exists(dir + "/step-00000006/manifest.pb"));
  EXPECT_TRUE(Exists(dir + "/step-00000008/manifest.pb"));
  EXPECT_FALSE(Exists(dir + "/step-00000003"));
}

// On --resume, a hyper-parameter given on the command line replaces the
// checkpoint's (and says so); one not given keeps the checkpoint's.
TEST(TrainGpt, ResumingAppliesTheGivenHyperparametersAndSaysSo) {
  const std::string dir = TempDir("resume_lr");
  const CommandResult run = RunCommand(absl::StrCat(
      kTrainGpt, " --world_size=2 --print_plan=false --steps=3 --lr=0.002 --checkpoint_dir=",
      dir, "/a"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_EQ(std::system(absl::StrCat("cp -r '", dir, "/a' '", dir, "/b'").c_str()), 0);
  const std::string resume = " --world_size=2 --print_plan=false --steps=5 --resume";
  const CommandResult kept = RunCommand(absl::StrCat(kTrainGpt, resume, " --checkpoint_dir=",
                                                     dir, "/a --metrics_jsonl=", dir, "/a.jsonl"));
  ASSERT_EQ(kept.exit_code, 0) << kept.output;
  EXPECT_THAT(kept.output, HasSubstr("optimizer: lr 0.002 (the checkpoint's), weight_decay 0.01 "
                                     "(the checkpoint's)"));
  const CommandResult changed = RunCommand(
      absl::StrCat(kTrainGpt, resume, " --lr=0.0005 --checkpoint_dir=", dir,
                   "/b --metrics_jsonl=", dir, "/b.jsonl"));
  ASSERT_EQ(changed.exit_code, 0) << changed.output;
  EXPECT_THAT(changed.output, HasSubstr("optimizer: lr 0.0005 (--lr; the checkpoint's was 0.002)"));
  // The same first resumed step; the update it makes differs.
  const std::vector<double> a = LossesOf(dir + "/a.jsonl"), b = LossesOf(dir + "/b.jsonl");
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(a[0], b[0]);
  EXPECT_NE(a[1], b[1]);
}

// A loss or gradient norm that is not finite stops the job at once, naming
// the step; before, it trained on and failed at the end with "DID NOT FALL".
TEST(TrainGpt, ANonFiniteLossStopsTheJobNamingTheStep) {
  // An absurd learning rate breaks the weights in step 1's update.
  const CommandResult run = RunCommand(absl::StrCat(
      kTrainGpt, " --world_size=2 --print_plan=false --steps=50 --lr=1e30"));
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("train_gpt rank 0: step 2: the loss is not finite"));
  EXPECT_THAT(run.output, HasSubstr("; stopped (--on_nonfinite=skip skips such steps)"));
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("step    3/")));
  // Skipping cannot help weights that are already broken: it gives up after
  // --max_consecutive_skips.
  const CommandResult skipping = RunCommand(absl::StrCat(
      kTrainGpt, " --world_size=2 --print_plan=false --steps=50 --lr=1e30 --on_nonfinite=skip "
      "--max_consecutive_skips=3"));
  EXPECT_EQ(skipping.exit_code, 1) << skipping.output;
  EXPECT_THAT(skipping.output, HasSubstr("step 4: the loss is not finite (loss "));
  EXPECT_THAT(skipping.output, HasSubstr("stopped: 4 steps in a row were not finite "
                                         "(--max_consecutive_skips=3)"));
}

// --on_nonfinite=skip drops exactly the bad step's update: the run equals
// one that never saw that step's batch (replayed without it).
TEST(TrainGpt, ASkippedStepLeavesTheModelAsIfItsBatchNeverCame) {
  const std::string dir = TempDir("skip");
  const CommandResult run = RunCommand(absl::StrCat(
      kTrainGpt, " --world_size=2 --batch_size=4 --print_plan=false --steps=6 "
      "--on_nonfinite=skip --TEST_nan_loss_at_step=3 --record_batches=", dir,
      "/batches.pt --metrics_jsonl=", dir, "/skipped.jsonl"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("step 3: the loss is not finite (loss nan, gradient norm "
                                    "nan); skipped (no update)"));
  EXPECT_THAT(run.output, HasSubstr("over steps 1..6 (1 skipped: not finite)"));
  const std::string metrics = ReadText(dir + "/skipped.jsonl");
  EXPECT_THAT(metrics, HasSubstr("{\"step\": 3, \"loss\": null,"));
  EXPECT_THAT(metrics, HasSubstr("\"grad_norm\": null, \"skipped\": true}"));
  ASSERT_EQ(std::system(absl::StrCat(
                            "timeout 120 ", ::fsdp::testing::TorchPython(), " -c \"import torch\n"
                            "r = torch.load('", dir, "/batches.pt', weights_only=True)\n"
                            "keep = [0, 1, 3, 4, 5]\n"
                            "torch.save({'tokens': r['tokens'][keep].contiguous(), "
                            "'first_step': r['first_step']}, '", dir, "/without3.pt')\"")
                            .c_str()),
            0);
  const CommandResult replay = RunCommand(absl::StrCat(
      kTrainGpt, " --world_size=2 --batch_size=4 --print_plan=false --steps=5 --replay_batches=",
      dir, "/without3.pt --metrics_jsonl=", dir, "/replayed.jsonl"));
  ASSERT_EQ(replay.exit_code, 0) << replay.output;
  std::vector<double> skipped_run;
  {
    std::ifstream in(dir + "/skipped.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      if (line.find("\"skipped\": true") != std::string::npos) continue;
      std::ofstream(dir + "/finite.jsonl", std::ios::app) << line << "\n";
    }
    skipped_run = LossesOf(dir + "/finite.jsonl");
  }
  const std::vector<double> replayed = LossesOf(dir + "/replayed.jsonl");
  ASSERT_EQ(skipped_run.size(), 5u);
  ASSERT_EQ(replayed.size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_NEAR(replayed[i], skipped_run[i], 1e-6) << i;
}

// --init_state_dict: errors name the file; nanoGPT's causal-mask buffers
// can be dropped by name; the legacy torch.save format is named.
TEST(TrainGpt, InitialStateDictProblemsNameTheFileAndTheWayOut) {
  const std::string dir = TempDir("init");
  ASSERT_EQ(std::system(absl::StrCat("timeout 120 ", ::fsdp::testing::TorchPython(),
                                     " models/replay_gpt.py init ", dir, "/init.pt")
                            .c_str()),
            0);
  ASSERT_EQ(std::system(absl::StrCat(
                            "timeout 120 ", ::fsdp::testing::TorchPython(), " -c \"import torch\n"
                            "sd = torch.load('", dir, "/init.pt', weights_only=True)\n"
                            "torch.save(sd, '", dir, "/legacy.pt', "
                            "_use_new_zipfile_serialization=False)\n"
                            "for i in range(2):\n"
                            "  sd[f'transformer.h.{i}.attn.bias'] = "
                            "torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32)\n"
                            "torch.save(sd, '", dir, "/with_bias.pt')\"")
                            .c_str()),
            0);
  const std::string job = absl::StrCat(kTrainGpt, " --world_size=2 --print_plan=false --steps=2");
  const CommandResult with_bias =
      RunCommand(absl::StrCat(job, " --init_state_dict=", dir, "/with_bias.pt"));
  EXPECT_EQ(with_bias.exit_code, 1) << with_bias.output;
  EXPECT_THAT(with_bias.output,
              HasSubstr("--init_state_dict=" + dir + "/with_bias.pt: "));
  EXPECT_THAT(with_bias.output,
              HasSubstr("not in the model: transformer.h.0.attn.bias, transformer.h.1.attn.bias"));
  EXPECT_THAT(with_bias.output, HasSubstr("can be dropped with --init_state_dict_ignore=GLOB"));

  const CommandResult dropped = RunCommand(absl::StrCat(
      job, " --init_state_dict=", dir, "/with_bias.pt --init_state_dict_ignore=*.attn.bias"));
  EXPECT_EQ(dropped.exit_code, 0) << dropped.output;
  EXPECT_THAT(dropped.output, HasSubstr("(dropped by --init_state_dict_ignore: "
                                        "transformer.h.0.attn.bias, transformer.h.1.attn.bias)"));

  const CommandResult legacy =
      RunCommand(absl::StrCat(job, " --init_state_dict=", dir, "/legacy.pt"));
  EXPECT_EQ(legacy.exit_code, 1) << legacy.output;
  EXPECT_THAT(legacy.output, HasSubstr("legacy.pt' is in torch.save's legacy format"));

  const CommandResult shape =
      RunCommand(absl::StrCat(job, " --n_embd=32 --init_state_dict=", dir, "/init.pt"));
  EXPECT_EQ(shape.exit_code, 1) << shape.output;
  EXPECT_THAT(shape.output, HasSubstr("--init_state_dict=" + dir + "/init.pt: "));
  EXPECT_THAT(shape.output, HasSubstr("'transformer.wte.weight' has shape [256, 64], the "
                                      "model's is [256, 32]"));
  EXPECT_THAT(shape.output, ::testing::Not(HasSubstr("can be dropped")));

  // A file that is not there is found before any rank starts.
  const CommandResult missing =
      RunCommand(absl::StrCat(job, " --init_state_dict=", dir, "/missing.pt"));
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_THAT(missing.output,
              HasSubstr("--init_state_dict=" + dir + "/missing.pt: No such file or directory"));
  EXPECT_THAT(missing.output, ::testing::Not(HasSubstr("launched")));

  // --init_optim_state_dict: a model's state dict given as the optimizer's
  // is named as such, with the flag and the file.
  const CommandResult model_as_optim =
      RunCommand(absl::StrCat(job, " --init_optim_state_dict=", dir, "/init.pt"));
  EXPECT_EQ(model_as_optim.exit_code, 1) << model_as_optim.output;
  EXPECT_THAT(model_as_optim.output, HasSubstr("--init_optim_state_dict=" + dir + "/init.pt: '" +
                                               dir + "/init.pt': not an optimizer's state dict"));
}

}  // namespace
