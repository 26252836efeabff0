// The main job fine-tuning open-weight models (--hf_model): random-
// initialized Llama and Qwen3 models and a PEFT adapter written by
// transformers and peft (models/hf_job_interop.py), trained by the job for
// 8 steps, and the same steps replayed by transformers / peft on the
// batches the job recorded: every step's loss within 1e-4, and the job's
// --export_hf (from_pretrained) and --export_peft (PeftModel.from_pretrained)
// equal to what they trained within 1e-3. Also a LoRA run resumed from its
// checkpoint, and the flags' refusals. Without transformers and peft in the
// test's Python (Debian's), the cases that need their files are skipped.
#include <algorithm>
#include <cmath>
#include <cstdio>
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
constexpr int kSkip = 77;

class TrainGptHf : public ::testing::Test {
 protected:
  // The models, the adapter and the token file, written once.
  static void SetUpTestSuite() {
    dir_ = new std::string(TempDir("hf_job"));
    const CommandResult written = RunCommand(absl::StrCat(
        "timeout 300 ", ::fsdp::testing::TorchPython(), " models/hf_job_interop.py write ", *dir_));
    written_ = written.exit_code;
    std::printf("%s", written.output.c_str());
  }
  static void TearDownTestSuite() { delete dir_; }

  void SetUp() override {
    if (written_ == kSkip) GTEST_SKIP() << "this Python has no transformers or peft";
    ASSERT_EQ(written_, 0) << "hf_job_interop.py write failed";
  }

  // The job's flags shared by every case: 8 steps of 2 sequences of 16
  // tokens per rank from the token file.
  static std::string Job(const std::string& flags) {
    return absl::StrCat(kTrainGpt, " --data_tokens=", *dir_,
                        "/tokens.bin --steps=8 --log_every=8 --batch_size=2 --block_size=16 "
                        "--print_plan=false ",
                        flags);
  }

  // Runs the job with `flags` (recording its batches and losses under
  // `name`), then replays them in transformers / peft with `replay_flags`.
  static void TrainAndReplay(const std::string& name, const std::string& model,
                             const std::string& flags, const std::string& replay_flags) {
    const std::string out = absl::StrCat(*dir_, "/", name);
    const CommandResult job = RunCommand(Job(absl::StrCat(
        "--hf_model=", *dir_, "/", model, " --record_batches=", out, ".pt --metrics_jsonl=", out,
        ".jsonl ", flags)));
    ASSERT_EQ(job.exit_code, 0) << job.output;
    const std::vector<double> losses = LossesOf(out + ".jsonl");
    ASSERT_EQ(losses.size(), 8u);
    // Steps on other batches give other losses: the comparison can fail.
    EXPECT_GT(std::abs(losses[0] - losses[5]) + std::abs(losses[3] - losses[7]), 1e-3);
    const CommandResult replay = RunCommand(
        absl::StrCat("timeout 300 ", ::fsdp::testing::TorchPython(),
                     " models/hf_job_interop.py replay ", *dir_, "/", model, " ", out, ".pt ", out,
                     ".jsonl ", replay_flags));
    std::printf("%s", replay.output.c_str());
    EXPECT_EQ(replay.exit_code, 0) << replay.output;
  }

  static std::string* dir_;
  static int written_;
};

std::string* TrainGptHf::dir_ = nullptr;
int TrainGptHf::written_ = -1;

TEST_F(TrainGptHf, LlamaTrainsAsTransformersAndItsExportLoadsWithFromPretrained) {
  const std::string exported = *dir_ + "/llama_w2.hf";
  TrainAndReplay("llama_w2", "llama", absl::StrCat("--world_size=2 --export_hf=", exported),
                 absl::StrCat("--export_hf=", exported));
}

TEST_F(TrainGptHf, Qwen3WithTiedEmbeddingsTrainsAsTransformersAtThreeRanks) {
  const std::string exported = *dir_ + "/qwen3_w3.hf";
  TrainAndReplay("qwen3_w3", "qwen3", absl::StrCat("--world_size=3 --export_hf=", exported),
                 absl::StrCat("--export_hf=", exported));
}

// peft's adapter continued under hybrid sharding (a replicate group of
// two), the base frozen in the same units; exported both as PEFT's files
// and merged into a transformers checkpoint.
TEST_F(TrainGptHf, APeftAdapterContinuesAsPeftTrainsItAndExportsBothWays) {
  const std::string peft = *dir_ + "/lora_w2.peft", merged = *dir_ + "/lora_w2.hf";
  TrainAndReplay("lora_w2", "llama",
                 absl::StrCat("--world_size=2 --sharding_strategy=hybrid_shard "
                              "--shard_group_size=1 --init_peft=",
                              *dir_, "/adapter0 --export_peft=", peft, " --export_hf=", merged),
                 absl::StrCat("--peft=", *dir_, "/adapter0 --export_peft=", peft,
                              " --export_hf=", merged));
}

// A LoRA run stopped at step 4 and resumed gives the uninterrupted run's
// losses, from either checkpoint format: the checkpoint holds the adapters,
// their optimizer state and the frozen base, and the resumed run takes
// --hf_model and the adapter's settings from it.
TEST_F(TrainGptHf, ALoraRunResumesExactlyFromEitherCheckpointFormat) {
  const std::string lora = absl::StrCat("--world_size=2 --lora_r=4 --lora_alpha=16 "
                                        "--lora_targets=q_proj,o_proj,up_proj --hf_model=",
                                        *dir_, "/llama");
  const CommandResult whole = RunCommand(
      Job(absl::StrCat(lora, " --metrics_jsonl=", *dir_, "/whole.jsonl")));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  EXPECT_THAT(whole.output, HasSubstr("LoRA r=4 alpha=16 on q_proj,o_proj,up_proj"));
  EXPECT_THAT(whole.output, HasSubstr("% trainable)"));
  const std::vector<double> want = LossesOf(*dir_ + "/whole.jsonl");
  ASSERT_EQ(want.size(), 8u);
  for (const std::string format : {"sharded", "dcp"}) {
    const std::string checkpoints = absl::StrCat(*dir_, "/lora_checkpoints_", format);
    const std::string parts = absl::StrCat(*dir_, "/parts_", format, ".jsonl");
    const CommandResult first = RunCommand(
        Job(absl::StrCat(lora, " --steps=4 --checkpoint_format=", format,
                         " --checkpoint_dir=", checkpoints, " --metrics_jsonl=", parts)));
    ASSERT_EQ(first.exit_code, 0) << first.output;
    const CommandResult resumed = RunCommand(absl::StrCat(
        kTrainGpt, " --steps=8 --resume --checkpoint_dir=", checkpoints, " --metrics_jsonl=",
        parts));
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    const std::vector<double> got = LossesOf(parts);
    ASSERT_EQ(got.size(), want.size()) << format;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 1e-6) << format << ", step " << i + 1;
    }
  }
}

// Activation checkpointing runs each decoder layer's forward (hidden
// states, rotary tables, mask) again in backward: the same losses as
// without it. With bfloat16 parameters (mixed precision) on top, the same
// steps to within bfloat16's rounding, and not exactly: the flag acts.
TEST_F(TrainGptHf, LoraTrainsAlikeWithActivationCheckpointingAndInBfloat16) {
  const std::string lora =
      absl::StrCat("--world_size=2 --lora_r=4 --lora_targets=q_proj,v_proj,down_proj --hf_model=",
                   *dir_, "/llama --metrics_jsonl=", *dir_, "/");
  const CommandResult plain = RunCommand(Job(lora + "plain.jsonl"));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const CommandResult checkpointed =
      RunCommand(Job(lora + "checkpointed.jsonl --activation_checkpointing"));
  ASSERT_EQ(checkpointed.exit_code, 0) << checkpointed.output;
  EXPECT_THAT(checkpointed.output,
              HasSubstr("activation checkpointing: model.layers.0, model.layers.1"));
  const CommandResult bf16 = RunCommand(
      Job(lora + "bf16.jsonl --activation_checkpointing --param_dtype=bfloat16"));
  ASSERT_EQ(bf16.exit_code, 0) << bf16.output;
  const std::vector<double> want = LossesOf(*dir_ + "/plain.jsonl");
  const std::vector<double> got = LossesOf(*dir_ + "/checkpointed.jsonl");
  const std::vector<double> rounded = LossesOf(*dir_ + "/bf16.jsonl");
  ASSERT_EQ(want.size(), 8u);
  ASSERT_EQ(got.size(), want.size());
  ASSERT_EQ(rounded.size(), want.size());
  double largest = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-6) << "step " << i + 1;
    EXPECT_NEAR(rounded[i], want[i], 2e-3) << "step " << i + 1;
    largest = std::max(largest, std::abs(rounded[i] - want[i]));
  }
  EXPECT_GT(largest, 1e-6) << "--param_dtype=bfloat16 changed no loss";
}

TEST_F(TrainGptHf, FlagsThatDoNotFitAreRefusedBeforeLaunch) {
  const std::string llama = absl::StrCat(" --hf_model=", *dir_, "/llama");
  struct Case {
    std::string flags;
    std::string error;
  };
  for (const Case& c : std::vector<Case>{
           {llama + " --n_layer=4",
            "--n_layer: not with --hf_model (the model's config.json sets its shape)"},
           {llama + " --init_state_dict=x.pt",
            "--init_state_dict: not with --hf_model (the model's weights are its directory's)"},
           {llama + " --init_peft=" + *dir_ + "/adapter0 --lora_r=8",
            "--lora_r: not with --init_peft (the adapter's adapter_config.json sets it)"},
           {llama + " --export_peft=" + *dir_ + "/no_adapters",
            "--export_peft=" + *dir_ + "/no_adapters: applies only with LoRA adapters"},
           {llama + " --lora_r=4 --lora_dropout=1", "--lora_dropout=1: must be in [0, 1)"},
           {" --lora_r=4", "--lora_r=4: applies only with --hf_model"},
           {" --export_hf=" + *dir_ + "/gpt.hf", "applies only with --hf_model"},
           {" --hf_model=" + *dir_ + "/absent", "--hf_model=" + *dir_ + "/absent: "},
           {llama + " --lora_r=4 --lora_targets=qkv_proj", "LoRA: "},
       }) {
    const CommandResult run = RunCommand(Job(absl::StrCat("--world_size=2", c.flags)));
    EXPECT_NE(run.exit_code, 0) << c.flags;
    EXPECT_THAT(run.output, HasSubstr(c.error)) << c.flags;
  }
  // Bytes are no tokenizer's ids: the generated corpus is refused.
  const CommandResult bytes = RunCommand(absl::StrCat(kTrainGpt, llama, " --steps=1"));
  EXPECT_NE(bytes.exit_code, 0);
  EXPECT_THAT(bytes.output, HasSubstr("give its tokenizer's ids with --data_tokens"));
}

}  // namespace
