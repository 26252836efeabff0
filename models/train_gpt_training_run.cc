#include "models/train_gpt_training_run.h"

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <stdexcept>

#include "ATen/ATen.h"
#include "ATen/CPUGeneratorImpl.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/replicas.h"
#include "fsdp/activation_checkpointing.h"
#include "fsdp/shard_placement.h"
#include "fsdp/utilities.h"
#include "models/gpt.h"
#include "models/train_gpt_checks.h"
#include "models/train_gpt_config.h"
#include "models/train_gpt_flags.h"
#include "models/train_gpt_initial_state.h"
#include "models/train_gpt_optimizer.h"
#include "models/train_gpt_restart.h"
#include "policies/wrap_policy.h"
#include "statedict/state_dict.h"
#include "torch/optim/adamw.h"
#include "torch/optim/sgd.h"

namespace train_gpt {

TrainingRun::TrainingRun(fsdp::FsdpOptions options, const fsdp::WrapPolicy& policy,
                         fsdp::Collectives& world, fsdp::HybridShardCollectives& hybrid,
                         c10::Device device, const fsdp::GroupConnector& checkpoint_groups)
    : device_(device),
      world_(world),
      hybrid_(hybrid),
      fsdp_group_(hybrid.shard ? *hybrid.shard : world),
      rank_(world.rank()),
      world_size_(world.world_size()),
      print_(rank_ == 0),
      trace_(rank_),
      model_(fsdp::ValueOrThrow(JobModelFromFlags())),
      block_size_(absl::GetFlag(FLAGS_block_size)),
      steps_(absl::GetFlag(FLAGS_steps)),
      per_rank_(absl::GetFlag(FLAGS_batch_size)),
      corpus_(fsdp::ValueOrThrow(LoadCorpus())) {
  if (corpus_.held_out.defined()) {
    TokenSampler held_out(corpus_.held_out, per_rank_ * world_size_, block_size_,
                          absl::GetFlag(FLAGS_seed) + 2, model_->vocab_size(), corpus_.source);
    for (int i = 0; i < absl::GetFlag(FLAGS_eval_batches); ++i) {
      eval_batches_.push_back(held_out.Next());
    }
  }
  OpenRunCheckpoints();
  Wrap(std::move(options), policy);
  if (checkpoints_.has_value() && absl::GetFlag(FLAGS_async_checkpoint)) {
    async_saver_ =
        fsdp::ValueOrThrow(fsdp::AsyncCheckpointer::Create(*fsdp_model_, checkpoint_groups));
  }
  if (rank_ == 0 && !absl::GetFlag(FLAGS_metrics_jsonl).empty()) {
    metrics_ = std::fopen(absl::GetFlag(FLAGS_metrics_jsonl).c_str(), "a");
    if (metrics_ == nullptr) {
      throw std::runtime_error("--metrics_jsonl=" + absl::GetFlag(FLAGS_metrics_jsonl) +
                               ": cannot open it: " + std::strerror(errno));
    }
  }
}

TrainingRun::~TrainingRun() {
  if (metrics_ != nullptr) std::fclose(metrics_);
}

int TrainingRun::Run(const std::string& layout_note, const std::vector<std::string>& notes) {
  if (print_) {
    for (const std::string& note : notes) std::printf("note: %s\n", note.c_str());
  }
  PrintHeader(layout_note);
  batches_.emplace(corpus_, per_rank_ * world_size_, block_size_, model_->vocab_size(), steps_);
  ResumeIfAsked();
  EndModelBuild();
  report_.rss_before_steps = CurrentRssBytes();
  report_.peak_rss_before_steps = PeakRssBytes();
  start_ = Clock::now();
  report_.seconds_before_steps = std::chrono::duration<double>(start_ - created_).count();
  for (int step = first_step_; step <= steps_; ++step) {
    NoteStepInProgress(step);
    MaybeKillForTest(step, rank_, world_size_);
    const StepResult result = Step(step);
    CheckReplicas(step, result);
    const int eval_every = absl::GetFlag(FLAGS_eval_every);
    const bool eval = !eval_batches_.empty() &&
                      (step == steps_ || (eval_every > 0 && step % eval_every == 0));
    Log(step, result, eval ? std::optional<float>(HeldOutLoss()) : std::nullopt);
    if (async_saver_ != nullptr) CollectAsyncCheckpoint(step, /*wait=*/false);
    if (checkpoints_.has_value() &&
        (step % absl::GetFlag(FLAGS_checkpoint_every) == 0 || step == steps_)) {
      SaveCheckpoint(step);
    }
  }
  if (async_saver_ != nullptr) CollectAsyncCheckpoint(steps_, /*wait=*/true);
  // The sample prints bytes: --data's, not --data_tokens' ids, and only
  // from a model whose ids are bytes.
  if (corpus_.held_out.defined() && corpus_.held_out.scalar_type() == at::kLong &&
      model_->ids_are_bytes() && absl::GetFlag(FLAGS_sample_tokens) > 0) {
    PrintSample();
  }
  WriteOutputs();
  return Summarize();
}

void TrainingRun::Wrap(fsdp::FsdpOptions options, const fsdp::WrapPolicy& policy) {
  if (!absl::GetFlag(FLAGS_trace_dir).empty()) options.trace = &trace_;
  if (absl::GetFlag(FLAGS_fsdp_debug_log)) {
    options.debug_log = [rank = rank_](const std::string& line) {
      std::fprintf(stderr, "[fsdp rank %d] %s\n", rank, line.c_str());
    };
  }
  options.param_init_fn = model_->param_init_fn();
  strategy_ = options.strategy;
  mixed_precision_ = options.mixed_precision;
  torch::nn::Module& module = model_->module();
  // Tied parameters (the GPT's head and embedding) count once.
  for (const at::Tensor& p : fsdp::UniqueParameters(module)) {
    report_.unsharded_param_bytes += p.nbytes();
    if (p.requires_grad()) trainable_param_bytes_ += p.nbytes();
  }
  std::set<std::string> model_keys;
  // Names only: the tensors may have no memory yet (a --hf_model's).
  for (const auto& item : module.named_parameters()) model_keys.insert(item.key());
  for (const auto& item : module.named_buffers()) model_keys.insert(item.key());
  // Wrapping makes the parameters 1-D views of flat shards: nanoGPT's
  // grouping goes by their dimensions before.
  std::set<std::string> matrices;
  for (const auto& item : module.named_parameters()) {
    if (item.value().dim() >= 2) matrices.insert(item.key());
  }
  fsdp::ProcessGroups fsdp_groups(fsdp_group_);
  fsdp_groups.replicate = hybrid_.replicate.get();  // Null unless hybrid.
  fsdp_model_ = fsdp::ValueOrThrow(
      fsdp::FullyShardedModel::Wrap(model_->shared_module(), fsdp_groups, options, policy));
  if (absl::GetFlag(FLAGS_activation_checkpointing)) {
    const std::vector<std::string> checkpointed =
        fsdp::ValueOrThrow(fsdp::ApplyActivationCheckpointing(module, *model_->BlockPolicy()));
    if (print_) {
      std::printf("activation checkpointing: %s\n", absl::StrJoin(checkpointed, ", ").c_str());
    }
  }
  if (print_ && absl::GetFlag(FLAGS_print_plan)) {
    std::printf("%s", fsdp_model_->plan().ToString().c_str());
  }
  // A resumed run's state is its checkpoint's.
  if (!Resuming()) {
    model_->LoadStartingWeights(*fsdp_model_, print_);
    if (!absl::GetFlag(FLAGS_init_state_dict).empty()) {
      LoadInitialState(*fsdp_model_, model_keys, print_);
    }
  }
  for (const auto& unit : fsdp_model_->units()) {
    if (const std::optional<fsdp::UnitShard> shard = fsdp::UnitShard::Of(*unit)) {
      report_.shard_param_bytes += shard->local().nbytes();
    }
  }
  // The trainable parameters only (a LoRA base is frozen), as peft's and
  // PyTorch's optimizers are given them: a frozen one never has state, and
  // a checkpoint or export of the optimizer's would list it.
  std::vector<std::vector<at::Tensor>> groups(1);
  if (absl::GetFlag(FLAGS_weight_decay_groups) == "nanogpt") {
    groups.resize(2);
    std::set<const void*> seen;
    for (const auto& item : module.named_parameters()) {
      if (!item.value().requires_grad()) continue;
      if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // Tied.
      groups[matrices.count(item.key()) != 0 ? 0 : 1].push_back(item.value());
    }
  } else {
    for (const at::Tensor& p : fsdp::UniqueParameters(module)) {
      if (p.requires_grad()) groups[0].push_back(p);
    }
  }
  optimizer_ = MakeOptimizer(groups);
  if (!absl::GetFlag(FLAGS_init_optim_state_dict).empty() && !Resuming()) {
    LoadInitialOptimizerState(module, *fsdp_model_, *optimizer_, print_);
  }
}

void TrainingRun::OpenRunCheckpoints() {
  if (absl::GetFlag(FLAGS_checkpoint_dir).empty()) return;
  std::string run_id = rank_ == 0 ? NewJobRunId() : std::string();
  fsdp::BroadcastBytes(world_, run_id, /*root=*/0);
  checkpoints_ = fsdp::ValueOrThrow(OpenCheckpoints(run_id, world_size_));
}

void TrainingRun::PrintHeader(const std::string& layout_note) const {
  if (!print_) return;
  const std::string trainable =
      trainable_param_bytes_ == report_.unsharded_param_bytes
          ? std::string()
          : absl::StrFormat(" (%.3f%% trainable)",
                            100.0 * trainable_param_bytes_ / report_.unsharded_param_bytes);
  std::printf("%s, %.2f M parameters%s; %d ranks, %s%s%s, global batch %lld x %lld tokens\n",
              model_->Description().c_str(), report_.unsharded_param_bytes / 4 / 1e6,
              trainable.c_str(),
              world_size_, fsdp::ShardingStrategyName(strategy_), layout_note.c_str(),
              mixed_precision_.enabled() ? (", " + mixed_precision_.ToString()).c_str() : "",
              static_cast<long long>(per_rank_ * world_size_),
              static_cast<long long>(block_size_));
  // With both --replay_batches and a corpus file, each part of the run has
  // its own source: say which.
  const std::string replay = absl::GetFlag(FLAGS_replay_batches);
  const bool sample = corpus_.held_out.scalar_type() == at::kLong && model_->ids_are_bytes();
  const char* uses = sample ? "the held-out loss and the sample" : "the held-out loss";
  const std::string held_out =
      corpus_.source.empty()
          ? std::string()
          : absl::StrFormat("%s from the last tenth of %s (%d %s)", uses, corpus_.source,
                            corpus_.held_out.numel(), corpus_.unit);
  if (!replay.empty()) {
    std::printf("data: training batches replayed from %s%s\n", replay.c_str(),
                held_out.empty() ? "" : absl::StrCat("; ", held_out).c_str());
  } else if (!corpus_.source.empty()) {
    std::printf("data: training batches from the first nine tenths of %s (%lld %s); %s\n",
                corpus_.source.c_str(), static_cast<long long>(corpus_.train.numel()),
                corpus_.unit, held_out.c_str());
  } else {
    std::printf("data: training batches from the generated corpus (%lld bytes of sums)\n",
                static_cast<long long>(corpus_.train.numel()));
  }
  std::fflush(stdout);
}

void TrainingRun::ResumeIfAsked() {
  if (metrics_ != nullptr && !Resuming() && RestartCount() > 0) DropMetricsAfter(std::nullopt);
  if (!checkpoints_.has_value()) return;
  if (print_) {
    for (const std::string& note : checkpoints_->notes()) std::printf("note: %s\n", note.c_str());
  }
  if (!checkpoints_->resume_from().has_value()) return;
  if (print_) {
    for (const char* flag : {"init_state_dict", "init_optim_state_dict"}) {
      if (!absl::FindCommandLineFlag(flag)->CurrentValue().empty()) {
        std::printf("note: --%s is not read: a resumed run's state is its checkpoint's\n",
                    flag);
      }
    }
  }
  const fsdp::StepCheckpoint& from = *checkpoints_->resume_from();
  // Either format: LoadCheckpoint tells a Distributed Checkpoint from an
  // older SHARDED one by what the directory holds.
  fsdp::ThrowIfError(fsdp::LoadCheckpoint(from.path, *fsdp_model_, optimizer_.get()));
  const std::string hyperparameters = ApplyGivenHyperparameters(*optimizer_);
  first_step_ = static_cast<int>(from.step) + 1;
  batches_->Skip(from.step);
  if (metrics_ != nullptr) DropMetricsAfter(static_cast<int64_t>(from.step));
  if (print_) {
    std::printf("resumed from %s (step %lld of run %s); optimizer: %s\n", from.path.c_str(),
                static_cast<long long>(from.step),
                from.run_id.empty() ? "<no id>" : from.run_id.c_str(), hyperparameters.c_str());
  }
}

void TrainingRun::DropMetricsAfter(std::optional<int64_t> step) {
  const std::string path = absl::GetFlag(FLAGS_metrics_jsonl);
  std::fclose(metrics_);
  metrics_ = nullptr;
  const std::string temporary = path + ".resumed";
  const auto fail = [&](const std::string& why) {
    std::remove(temporary.c_str());
    throw std::runtime_error(
        "--metrics_jsonl=" + path + ": cannot drop the steps " +
        (step ? "after " + std::to_string(*step) : std::string("a restart trains again")) + ": " +
        why);
  };
  std::ifstream in(path);
  if (!in.is_open()) fail("cannot read it");
  std::vector<std::string> lines;
  std::vector<int64_t> steps;  // Per line; -1 for lines of another shape.
  std::string line;
  // A last line without its newline is a write the failed attempt did not
  // finish.
  while (std::getline(in, line) && !in.eof()) {
    int64_t logged = -1;
    if (std::sscanf(line.c_str(), "{\"step\": %" SCNd64, &logged) != 1) logged = -1;
    lines.push_back(std::move(line));
    steps.push_back(logged);
  }
  if (in.bad()) fail("reading it failed");
  in.close();
  size_t end = lines.size();
  if (!step.has_value()) {
    // From the last step 1 on; all kept when there is none.
    for (size_t i = 0; i < lines.size(); ++i) {
      if (steps[i] == 1) end = i;
    }
  }
  std::string kept;
  for (size_t i = 0; i < end; ++i) {
    // Lines of another shape are not ours to drop.
    if (step.has_value() && steps[i] > *step) continue;
    kept += lines[i] + "\n";
  }
  std::ofstream out(temporary, std::ios::trunc);
  out << kept;
  out.close();
  if (!out) fail("writing " + temporary + " failed");
  if (std::rename(temporary.c_str(), path.c_str()) != 0) fail(std::strerror(errno));
  metrics_ = std::fopen(path.c_str(), "a");
  if (metrics_ == nullptr) {
    throw std::runtime_error("--metrics_jsonl=" + path + ": cannot open it: " +
                             std::strerror(errno));
  }
}

StepResult TrainingRun::Step(int step) {
  const int64_t t = block_size_;
  const at::Tensor global_batch = batches_->Next(step);
  if (model_->draws_random_numbers()) {
    // libtorch seeds its default generator at random; a seed of the run's,
    // the rank's and the step's makes the masks reproducible, different
    // on each rank, and the same after --resume as without a stop.
    const uint64_t mixed = absl::GetFlag(FLAGS_seed) * 0x9E3779B97F4A7C15ULL +
                           static_cast<uint64_t>(rank_) * 0xC2B2AE3D27D4EB4FULL +
                           static_cast<uint64_t>(step);
    at::manual_seed(mixed);
  }
  if (rank_ == 0 && !absl::GetFlag(FLAGS_record_batches).empty()) {
    recorded_batches_.push_back(global_batch);
  }
  at::Tensor batch = global_batch.narrow(0, rank_ * per_rank_, per_rank_).to(device_);
  last_batch_ = batch;
  at::Tensor loss =
      models::LanguageModelLoss(model_->Logits(batch.narrow(1, 0, t)), batch.narrow(1, 1, t));
  if (step == absl::GetFlag(FLAGS_TEST_nan_loss_at_step) && rank_ == world_size_ - 1) {
    loss = loss * std::numeric_limits<float>::quiet_NaN();
  }
  loss.backward();
  if (step == steps_) report_.gradient_bytes = LocalGradientBytes(model_->module());
  const double clip = absl::GetFlag(FLAGS_grad_clip);
  StepResult result;
  result.grad_norm =
      fsdp::ValueOrThrow(
          fsdp::ClipGradNorm(*fsdp_model_,
                             clip > 0 ? clip : std::numeric_limits<double>::infinity()))
          .item<double>();
  at::Tensor global = loss.detach().clone();
  world_.AllReduce(global, fsdp::ReduceOp::kAvg)->Wait();
  result.loss = global.item<float>();
  if (result.finite()) {
    optimizer_->step();
    skipped_in_a_row_ = 0;
    last_loss_ = result.loss;
    if (!first_loss_) first_loss_ = result.loss;
  } else {
    SkipNonFinite(step, result);
  }
  optimizer_->zero_grad();
  return result;
}

void TrainingRun::CheckReplicas(int step, const StepResult& result) {
  if (step == absl::GetFlag(FLAGS_TEST_flip_bit_at_step) && rank_ == world_size_ - 1) {
    FlipTestBit();
  }
  const int every = absl::GetFlag(FLAGS_check_replicas_every);
  if (every <= 0) return;
  const auto stop_unless = [step](const absl::Status& status) {
    if (status.ok()) return;
    throw std::runtime_error(absl::StrFormat(
        "step %d: %s; stopped before this step's checkpoint (--resume continues from the last "
        "one)",
        step, status.message()));
  };
  if (absl::GetFlag(FLAGS_grad_clip) > 0) {
    stop_unless(fsdp::CheckGradientNormAgrees(*fsdp_model_, result.grad_norm));
  }
  // Also before every checkpoint: none is written from replicas that
  // were not found to agree.
  const bool saves = checkpoints_.has_value() &&
                     (step % absl::GetFlag(FLAGS_checkpoint_every) == 0 || step == steps_);
  if (step % every == 0 || step == steps_ || saves) {
    stop_unless(fsdp::CheckReplicas(*fsdp_model_, optimizer_.get()));
    ++replica_checks_;
  }
}

void TrainingRun::FlipTestBit() {
  at::NoGradGuard no_grad;
  at::Tensor target;
  if (absl::GetFlag(FLAGS_TEST_flip_bit_in) == "optimizer") {
    // Any parameter's state will do; the check names whose it was.
    for (const auto& entry : optimizer_->state()) {
      const torch::optim::OptimizerParamState* state = entry.second.get();
      if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state)) {
        target = adamw->exp_avg();
      } else if (const auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(state)) {
        target = sgd->momentum_buffer();
      }
      if (target.defined() && target.numel() > 0) break;
      target = at::Tensor();
    }
  } else {
    for (const at::Tensor& p : model_->module().parameters()) {
      if (p.numel() > 0) {
        target = p;
        break;
      }
    }
  }
  // Nothing to flip is not an error here (no rank must stop alone): the
  // test that expects the check to fail sees that it did not.
  if (!target.defined()) {
    std::printf("rank %d: --TEST_flip_bit_at_step: no %s tensor to flip\n", rank_,
                absl::GetFlag(FLAGS_TEST_flip_bit_in).c_str());
    return;
  }
  at::Tensor host = target.cpu();
  static_cast<unsigned char*>(host.data_ptr())[1] ^= 0x04;
  target.copy_(host);
  std::printf("rank %d: flipped a bit of %s after step %d (--TEST_flip_bit_at_step)\n", rank_,
              absl::GetFlag(FLAGS_TEST_flip_bit_in).c_str(),
              absl::GetFlag(FLAGS_TEST_flip_bit_at_step));
}

void TrainingRun::SkipNonFinite(int step, const StepResult& result) {
  const std::string what = absl::StrFormat(
      "step %d: the %s is not finite (loss %g, gradient norm %g)", step,
      std::isfinite(result.loss) ? "gradient norm" : "loss", result.loss, result.grad_norm);
  if (absl::GetFlag(FLAGS_on_nonfinite) != "skip") {
    throw std::runtime_error(what + "; stopped (--on_nonfinite=skip skips such steps)");
  }
  ++skipped_;
  if (++skipped_in_a_row_ > absl::GetFlag(FLAGS_max_consecutive_skips)) {
    throw std::runtime_error(absl::StrFormat(
        "%s; stopped: %d steps in a row were not finite (--max_consecutive_skips=%d)", what,
        skipped_in_a_row_, absl::GetFlag(FLAGS_max_consecutive_skips)));
  }
  if (print_) std::printf("%s; skipped (no update)\n", what.c_str());
}

void TrainingRun::Log(int step, const StepResult& result, std::optional<float> held_out_loss) {
  const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  const int done = step - first_step_ + 1;
  const double tokens_per_s = done * per_rank_ * world_size_ * block_size_ / elapsed;
  if (metrics_ != nullptr) {
    std::fprintf(
        metrics_, "{\"step\": %d, \"loss\": %s, \"tokens_per_s\": %.1f, \"grad_norm\": %s%s%s}\n",
        step, std::isfinite(result.loss) ? absl::StrFormat("%.6f", result.loss).c_str() : "null",
        tokens_per_s,
        std::isfinite(result.grad_norm) ? absl::StrFormat("%.6f", result.grad_norm).c_str()
                                        : "null",
        result.finite() ? "" : ", \"skipped\": true",
        held_out_loss ? absl::StrCat(", \"eval_loss\": ",
                                     std::isfinite(*held_out_loss)
                                         ? absl::StrFormat("%.6f", *held_out_loss)
                                         : std::string("null"))
                            .c_str()
                      : "");
    std::fflush(metrics_);
  }
  if (print_ &&
      (step % absl::GetFlag(FLAGS_log_every) == 0 || step == first_step_ || step == steps_)) {
    std::printf("step %4d/%d  loss %.4f  %8.0f tokens/s  %5.1f s left\n", step, steps_,
                result.loss, tokens_per_s, elapsed / done * (steps_ - step));
  }
  if (print_ && held_out_loss) {
    std::printf("step %4d/%d  held-out loss %.4f\n", step, steps_, *held_out_loss);
  }
  std::fflush(stdout);
}

float TrainingRun::HeldOutLoss() {
  at::NoGradGuard no_grad;
  EvalMode eval(model_->module());
  const int64_t t = block_size_;
  at::Tensor sum = at::zeros({1}, at::TensorOptions().device(device_));
  for (const at::Tensor& global : eval_batches_) {
    const at::Tensor batch = global.narrow(0, rank_ * per_rank_, per_rank_).to(device_);
    sum += models::LanguageModelLoss(model_->Logits(batch.narrow(1, 0, t)), batch.narrow(1, 1, t))
               .to(at::kFloat);
  }
  at::Tensor mean = sum / static_cast<double>(eval_batches_.size());
  world_.AllReduce(mean, fsdp::ReduceOp::kAvg)->Wait();
  return mean.item<float>();
}

void TrainingRun::PrintSample() {
  at::NoGradGuard no_grad;
  EvalMode eval(model_->module());
  const int64_t t = block_size_;
  const int64_t prompt = std::min<int64_t>({t, 32, corpus_.held_out.numel()});
  std::vector<int64_t> tokens(corpus_.held_out.data_ptr<int64_t>(),
                              corpus_.held_out.data_ptr<int64_t>() + prompt);
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(absl::GetFlag(FLAGS_seed));
  for (int i = 0; i < absl::GetFlag(FLAGS_sample_tokens); ++i) {
    const int64_t n = std::min<int64_t>(t, static_cast<int64_t>(tokens.size()));
    const at::Tensor context =
        at::tensor(std::vector<int64_t>(tokens.end() - n, tokens.end()), at::kLong)
            .view({1, n})
            .to(device_);
    const at::Tensor logits = model_->Logits(context)[0][n - 1].to(at::kCPU, at::kFloat);
    // Temperature 0.8: most of the distribution's shape, fewer stray bytes.
    at::Tensor next = at::multinomial((logits / 0.8).softmax(0), 1, false, generator)
                          .to(at::kDouble);
    world_.Broadcast(next, /*root=*/0)->Wait();
    tokens.push_back(static_cast<int64_t>(next.item<double>()));
  }
  if (!print_) return;
  auto text = [&](size_t begin, size_t end) {
    std::string out;
    for (size_t i = begin; i < end; ++i) {
      const int c = static_cast<int>(tokens[i]);
      out += (c == '\n' || (c >= 32 && c < 127)) ? std::string(1, static_cast<char>(c))
                                                 : absl::StrFormat("\\x%02x", c);
    }
    return out;
  };
  std::printf("sample (prompt | %d generated bytes):\n%s|%s\n", absl::GetFlag(FLAGS_sample_tokens),
              text(0, prompt).c_str(), text(prompt, tokens.size()).c_str());
  std::fflush(stdout);
}

int TrainingRun::Summarize() {
  report_.optimizer_state_bytes = LocalOptimizerStateBytes(*optimizer_);
  report_.peak_device_bytes = PeakDeviceBytes(device_);
  report_.device = device_.str();
  report_.unsharded_optimizer_state_bytes =
      trainable_param_bytes_ * (absl::GetFlag(FLAGS_optimizer) == "sgd" ? 1 : 2);
  // FSDP's traffic, whichever groups carried it.
  fsdp::CollectiveCounters traffic = fsdp_group_.counters();
  if (hybrid_.replicate) {
    const fsdp::CollectiveCounters across = hybrid_.replicate->counters();
    for (size_t op = 0; op < traffic.calls.size(); ++op) {
      traffic.calls[op] += across.calls[op];
      traffic.bytes[op] += across.bytes[op];
    }
  }
  PrintRankReport(rank_, report_, traffic);
  if (print_) {
    if (const int every = absl::GetFlag(FLAGS_check_replicas_every); every > 0) {
      std::printf("replicas agreed at all %d checks (every %d steps%s)\n", replica_checks_,
                  every, absl::GetFlag(FLAGS_grad_clip) > 0 ? "; gradient norms every step" : "");
    }
    std::printf("loss %.4f -> %.4f over steps %d..%d%s\n", first_loss_.value_or(NAN),
                last_loss_.value_or(NAN), first_step_, steps_,
                skipped_ > 0 ? absl::StrFormat(" (%d skipped: not finite)", skipped_).c_str()
                             : "");
  }
  return 0;
}

}  // namespace train_gpt
