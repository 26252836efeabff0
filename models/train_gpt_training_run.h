// One rank's training run of the main job, for the files of the job's
// library only (train_gpt_run.h is the door): the class, its loop and
// logging in train_gpt_training_run.cc, what it writes (checkpoints,
// exports, traces, recorded batches, and the check that the weights are
// fit to be written) in train_gpt_outputs.cc. Split by what a reader looks
// for; the class stays one, as the steps and the outputs share its state.
#ifndef FSDP_MODELS_TRAIN_GPT_TRAINING_RUN_H_
#define FSDP_MODELS_TRAIN_GPT_TRAINING_RUN_H_

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ATen/core/Tensor.h"
#include "c10/core/Device.h"
#include "checkpoint/async_checkpoint.h"
#include "comm/collectives.h"
#include "comm/hybrid_groups.h"
#include "fsdp/fsdp_options.h"
#include "fsdp/fully_shard.h"
#include "fsdp/trace.h"
#include "models/train_gpt_data.h"
#include "models/train_gpt_model.h"
#include "models/train_gpt_report.h"
#include "optim/run_checkpoints.h"
#include "policies/wrap_policy.h"
#include "torch/nn/module.h"
#include "torch/optim/optimizer.h"

namespace train_gpt {

// Evaluation mode (no dropout) for the scope's forwards.
class EvalMode {
 public:
  explicit EvalMode(torch::nn::Module& model) : model_(model), was_training_(model.is_training()) {
    model_.eval();
  }
  ~EvalMode() { model_.train(was_training_); }
  EvalMode(const EvalMode&) = delete;
  EvalMode& operator=(const EvalMode&) = delete;

 private:
  torch::nn::Module& model_;
  bool was_training_;
};

// One step's global figures, the same on every rank.
struct StepResult {
  float loss = 0;
  double grad_norm = 0;
  bool finite() const { return std::isfinite(loss) && std::isfinite(grad_norm); }
};

// One rank's training run on groups already formed: `world` carries the
// data split and the loss; FSDP runs on hybrid's shard and replicate
// groups under hybrid sharding (`hybrid` empty otherwise: the world). The
// model is built on the host (the same on every rank and device) and
// computes on `device`, where FsdpOptions::device_id moves its units.
// `checkpoint_groups` connects the groups of --async_checkpoint's writer.
class TrainingRun {
 public:
  TrainingRun(fsdp::FsdpOptions options, const fsdp::WrapPolicy& policy, fsdp::Collectives& world,
              fsdp::HybridShardCollectives& hybrid, c10::Device device,
              const fsdp::GroupConnector& checkpoint_groups);
  ~TrainingRun();
  TrainingRun(const TrainingRun&) = delete;
  TrainingRun& operator=(const TrainingRun&) = delete;

  // The process's exit code: 0 once every step ran and every output was
  // written (whether the loss fell is for the user to judge: it is printed).
  // `notes` are printed first (rank 0).
  int Run(const std::string& layout_note, const std::vector<std::string>& notes);

 private:
  using Clock = std::chrono::steady_clock;

  // Builds the model's FSDP units and the optimizer over their shards.
  void Wrap(fsdp::FsdpOptions options, const fsdp::WrapPolicy& policy);
  // Rank 0's run id is the one its manifests record; every rank uses it.
  void OpenRunCheckpoints();
  bool Resuming() const { return checkpoints_.has_value() && checkpoints_->resume_from(); }
  void PrintHeader(const std::string& layout_note) const;
  void ResumeIfAsked();
  // --metrics_jsonl without the steps trained again, so that each step is
  // there once: a resumed run's keeps the lines of the steps up to `step`;
  // a restart that starts over (nullopt) drops the lines from the last
  // step 1 on, the failed attempts'. A torn last line goes too.
  void DropMetricsAfter(std::optional<int64_t> step);
  // Forward, backward, the global gradient norm (clipped when asked) and
  // loss, then the optimizer step, or none when either is not finite.
  StepResult Step(int step);
  // Throws unless --on_nonfinite=skip and the skips in a row are allowed.
  void SkipNonFinite(int step, const StepResult& result);
  // --metrics_jsonl's line and the progress line (and the held-out loss,
  // when measured at this step).
  void Log(int step, const StepResult& result, std::optional<float> held_out_loss);
  // The mean loss over the held-out batches (the same ones every time),
  // across ranks. Under no_grad: FSDP reshards after each forward.
  float HeldOutLoss();
  // --sample_tokens bytes generated after a held-out prompt, printed by
  // rank 0. Every rank runs the same forwards (FSDP gathers through them);
  // rank 0's draw is broadcast, so the ranks cannot drift apart.
  void PrintSample();
  // The rank's memory and traffic report and the loss summary; the exit
  // code of a run that got here, 0.
  int Summarize();

  // In train_gpt_outputs.cc.

  // Whether the weights are fit to be saved after `step`'s update: every
  // parameter and optimizer state finite, and the loss of the step's own
  // batch under the updated weights finite too (weights blown up to 1e30
  // are finite, but no step from them is). "" when fit, else what is
  // broken and where, the same on every rank. Every rank must call: each
  // runs one forward (no gradients, no dropout).
  std::string BrokenWeights(int step);
  // Nothing is written from weights that broke in `step`'s update, and no
  // later step can repair them: the run stops.
  [[noreturn]] void StopForBrokenWeights(int step, const std::string& broken,
                                         const std::string& not_written);
  void SaveCheckpoint(int step);
  // A checkpoint of `step` that landed: rank 0 retires the older ones and
  // prints its path, with `how` after it.
  void CheckpointLanded(int step, const std::string& how);
  // --async_checkpoint: the outcome of the checkpoint in the background, at
  // the boundary after `step`: taken if every rank's write has ended, or
  // waited for (`wait`: before the next save, and at the end). Throws when
  // it failed. Every rank must call.
  void CollectAsyncCheckpoint(int step, bool wait);
  // --check_replicas_every (and --TEST_flip_bit_at_step before it): after
  // `step`'s update, before anything of it is saved; stops the run on a
  // mismatch. Every rank must call.
  void CheckReplicas(int step, const StepResult& result);
  // The last rank flips one bit of its first parameter's shard or of that
  // parameter's optimizer state (--TEST_flip_bit_in).
  void FlipTestBit();
  // --export_state_dict, --export_optim_state_dict, --export_dcp,
  // --trace_dir and --record_batches.
  void WriteOutputs();

  const c10::Device device_;
  fsdp::Collectives& world_;
  fsdp::HybridShardCollectives& hybrid_;
  fsdp::Collectives& fsdp_group_;
  const int rank_, world_size_;
  const bool print_;
  fsdp::TraceRecorder trace_;
  const Clock::time_point created_ = Clock::now();  // Before the model is built.
  const std::unique_ptr<JobModel> model_;
  const int64_t block_size_;
  fsdp::ShardingStrategy strategy_{};
  fsdp::MixedPrecision mixed_precision_;
  std::unique_ptr<fsdp::FullyShardedModel> fsdp_model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::optional<fsdp::RunCheckpoints> checkpoints_;
  std::unique_ptr<fsdp::AsyncCheckpointer> async_saver_;  // --async_checkpoint.
  int async_step_ = 0;  // The step of the checkpoint in the background.

  std::FILE* metrics_ = nullptr;
  const int steps_;
  const int64_t per_rank_;
  const Corpus corpus_;
  std::vector<at::Tensor> eval_batches_;  // Global batches of the held-out tokens.
  std::optional<BatchSource> batches_;
  std::vector<at::Tensor> recorded_batches_;  // For --record_batches (rank 0).
  at::Tensor last_batch_;  // This rank's part of the last step's batch, on the device.
  std::optional<std::pair<int, std::string>> fitness_;  // BrokenWeights' last step and answer.
  int first_step_ = 1;
  Clock::time_point start_;
  RankReport report_;
  int64_t trainable_param_bytes_ = 0;  // Unsharded; tied parameters once.
  std::optional<float> first_loss_, last_loss_;
  int skipped_ = 0, skipped_in_a_row_ = 0;
  int replica_checks_ = 0;  // --check_replicas_every's checks that passed.
};

}  // namespace train_gpt

#endif  // FSDP_MODELS_TRAIN_GPT_TRAINING_RUN_H_
