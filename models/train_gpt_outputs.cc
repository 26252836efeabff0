// TrainingRun's outputs (train_gpt_training_run.h): the periodic
// checkpoints and, at the end, the exports, traces and recorded batches,
// none of them written from weights that are not fit to be.
#include <unistd.h>

#include <cstdio>
#include <stdexcept>

#include "ATen/ATen.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "checkpoint/checkpoint.h"
#include "formats/torch_file.h"
#include "models/gpt.h"
#include "models/output_paths.h"
#include "models/train_gpt_flags.h"
#include "models/train_gpt_training_run.h"
#include "optim/dcp_checkpoint.h"
#include "optim/optim_state.h"
#include "optim/torch_optim_file.h"
#include "optim/training_checkpoint.h"
#include "statedict/state_dict.h"
#include "torch/optim/adamw.h"
#include "torch/optim/sgd.h"

namespace train_gpt {

std::string TrainingRun::BrokenWeights(int step) {
  // The last step's checkpoint and the exports ask alike.
  if (fitness_.has_value() && fitness_->first == step) return fitness_->second;
  std::string mine;
  {
    at::NoGradGuard no_grad;
    EvalMode eval(model_->module());
    const int64_t t = block_size_;
    const float loss = models::LanguageModelLoss(model_->Logits(last_batch_.narrow(1, 0, t)),
                                                 last_batch_.narrow(1, 1, t))
                           .item<float>();
    if (!std::isfinite(loss)) {
      mine = absl::StrFormat("the updated weights give a loss of %s on step %d's batch",
                             std::isnan(loss) ? "nan" : absl::StrCat(loss), step);
    }
  }
  const auto finite = [](const at::Tensor& t) {
    return !t.defined() || t.numel() == 0 || at::isfinite(t).all().item<bool>();
  };
  for (const auto& item : model_->module().named_parameters()) {
    if (mine.empty() && !finite(item.value())) {
      mine = absl::StrCat("the parameter '", item.key(), "' holds values that are not finite");
    }
  }
  for (const auto& [key, state] : optimizer_->state()) {
    std::vector<at::Tensor> tensors;
    if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(state.get())) {
      tensors = {adamw->exp_avg(), adamw->exp_avg_sq(), adamw->max_exp_avg_sq()};
    } else if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(state.get())) {
      tensors = {sgd->momentum_buffer()};
    }
    for (const at::Tensor& t : tensors) {
      if (mine.empty() && !finite(t)) {
        mine = "the optimizer's state holds values that are not finite";
      }
    }
  }
  const std::vector<std::string> all = fsdp::AllGatherBytes(world_, mine);
  fitness_.emplace(step, "");
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) {
      fitness_->second = absl::StrCat(all[r], " (rank ", r, ")");
      break;
    }
  }
  return fitness_->second;
}

void TrainingRun::StopForBrokenWeights(int step, const std::string& broken,
                                       const std::string& not_written) {
  throw std::runtime_error(absl::StrFormat(
      "step %d: %s: %s not written, and the run stops (%sa smaller --lr may help)", step,
      broken, not_written,
      checkpoints_.has_value() ? "the checkpoints already saved are intact; " : ""));
}

void TrainingRun::SaveCheckpoint(int step) {
  if (const std::string broken = BrokenWeights(step); !broken.empty()) {
    StopForBrokenWeights(step, broken, "its checkpoint was");
  }
  if (async_saver_ != nullptr) CollectAsyncCheckpoint(step, /*wait=*/true);
  const std::string path = checkpoints_->PathOf(step);
  fsdp::ThrowIfError(fsdp::PrepareOutputDirectory("--checkpoint_dir", path));
  const bool dcp = absl::GetFlag(FLAGS_checkpoint_format) == "dcp";
  // A step directory an overwritten run left in the other format: its
  // marker goes first, so that the two never mix (rank 0 writes the
  // save's own marker, last). Every rank removes a manifest.pb itself:
  // SaveCheckpoint refuses to write beside one, on any rank that sees it.
  if (dcp || rank_ == 0) unlink((path + (dcp ? "/manifest.pb" : "/.metadata")).c_str());
  // The data position is the batches consumed: a resumed run skips them.
  const fsdp::TrainState state{step, step, checkpoints_->DcpLabels()};
  if (async_saver_ != nullptr) {
    fsdp::ThrowIfError(
        dcp ? async_saver_->Save(path, *fsdp_model_, optimizer_.get(), state)
            : fsdp::checkpoint_internal::SaveShardedInBackground(
                  *async_saver_, path, *fsdp_model_, *optimizer_, checkpoints_->MetadataOf(step)));
    async_step_ = step;
    return;
  }
  if (dcp) {
    fsdp::ThrowIfError(fsdp::SaveCheckpoint(path, *fsdp_model_, optimizer_.get(), state));
  } else {
    fsdp::ThrowIfError(fsdp::SaveTrainingCheckpoint(*fsdp_model_, *optimizer_, path,
                                                    checkpoints_->MetadataOf(step)));
  }
  CheckpointLanded(step, "");
}

void TrainingRun::CheckpointLanded(int step, const std::string& how) {
  if (rank_ != 0) return;
  const fsdp::RunCheckpoints::Retired retired = checkpoints_->RetireOlderThan(step);
  for (const std::string& problem : retired.problems) {
    std::fprintf(stderr, "train_gpt: warning: checkpoint clean-up: %s\n", problem.c_str());
  }
  std::printf("checkpoint %s%s\n", checkpoints_->PathOf(step).c_str(), how.c_str());
}

void TrainingRun::CollectAsyncCheckpoint(int step, bool wait) {
  if (!async_saver_->in_flight()) return;
  const auto begin = Clock::now();
  const absl::Status outcome = wait ? async_saver_->Wait() : async_saver_->Poll();
  if (outcome.ok() && async_saver_->in_flight()) return;
  const double waited_ms =
      std::chrono::duration<double, std::milli>(Clock::now() - begin).count();
  // A failed write, or Poll's own agreement failing (a rank lost).
  if (!outcome.ok()) {
    throw std::runtime_error(absl::StrFormat(
        "step %d: the checkpoint of step %d, written in the background, failed: %s; the run "
        "stops (the checkpoints saved before it are intact)",
        step, async_step_, outcome.message()));
  }
  const fsdp::AsyncCheckpointTimes& times = async_saver_->last_times();
  std::string how = absl::StrFormat(
      " (in the background: staged in %.0f ms on rank %d, %.1f MB copied and %.1f MB written "
      "in place, which training waited %.0f ms for; written in %.0f ms)",
      times.staged.count() * 1e3, rank_, times.staged_bytes / 1e6, times.held_bytes / 1e6,
      times.held.count() * 1e3, times.written.count() * 1e3);
  if (wait && waited_ms >= 1 && step < steps_) {
    absl::StrAppendFormat(&how, "; step %d waited %.0f ms for it", step + 1, waited_ms);
  }
  CheckpointLanded(async_step_, how);
}

void TrainingRun::WriteOutputs() {
  // The run's own record first: it helps explain weights that broke.
  if (const std::string dir = absl::GetFlag(FLAGS_trace_dir); !dir.empty()) {
    fsdp::ThrowIfError(
        trace_.WriteChromeTrace(absl::StrFormat("%s/trace_rank%d.json", dir, rank_)));
    if (print_) std::printf("wrote FSDP traces to %s/trace_rank<r>.json\n", dir.c_str());
  }
  if (const std::string path = absl::GetFlag(FLAGS_record_batches);
      rank_ == 0 && !path.empty()) {
    fsdp::ThrowIfError(fsdp::SaveTorchStateDict(
        path, {{"tokens", at::stack(recorded_batches_)},
               {"first_step",
                at::scalar_tensor(static_cast<int64_t>(first_step_), at::kLong)}}));
    std::printf("wrote the batches of steps %d..%d to %s\n", first_step_, steps_,
                path.c_str());
  }
  const bool exports = !absl::GetFlag(FLAGS_export_state_dict).empty() ||
                       !absl::GetFlag(FLAGS_export_optim_state_dict).empty() ||
                       !absl::GetFlag(FLAGS_export_dcp).empty() ||
                       !absl::GetFlag(FLAGS_export_hf).empty() ||
                       !absl::GetFlag(FLAGS_export_peft).empty();
  if (const std::string broken = exports ? BrokenWeights(steps_) : ""; !broken.empty()) {
    StopForBrokenWeights(steps_, broken, "the exports were");
  }
  fsdp::FullStateDictOptions on_rank0;
  on_rank0.rank0_only = true;
  if (const std::string out = absl::GetFlag(FLAGS_export_state_dict); !out.empty()) {
    const fsdp::StateDict state =
        fsdp::ValueOrThrow(fsdp::FullStateDict(*fsdp_model_, on_rank0));
    if (rank_ == 0) {
      fsdp::ThrowIfError(fsdp::SaveTorchStateDict(out, state));
      std::printf("wrote the FULL state dict to %s\n", out.c_str());
    }
  }
  if (const std::string out = absl::GetFlag(FLAGS_export_optim_state_dict); !out.empty()) {
    const fsdp::OptimStateDict state =
        fsdp::ValueOrThrow(fsdp::FullOptimStateDict(*fsdp_model_, *optimizer_, on_rank0));
    if (rank_ == 0) {
      const bool by_index = absl::GetFlag(FLAGS_export_optim_state_dict_keys) == "index";
      fsdp::ThrowIfError(
          fsdp::SaveTorchOptimStateDict(out, state,
                                        by_index ? fsdp::OptimStateKeys::kParameterIndex
                                                 : fsdp::OptimStateKeys::kParameterFqn));
      std::printf("wrote the FULL optimizer state to %s\n", out.c_str());
    }
  }
  if (const std::string dir = absl::GetFlag(FLAGS_export_dcp); !dir.empty()) {
    fsdp::ThrowIfError(fsdp::SaveShardedDcpModelAndOptimizer(*fsdp_model_, *optimizer_, dir));
    if (print_) {
      std::printf("wrote model and optimizer as a Distributed Checkpoint to %s\n", dir.c_str());
    }
  }
  // Last: merging adapters for --export_hf changes the model.
  model_->Export(*fsdp_model_, print_);
}

}  // namespace train_gpt
