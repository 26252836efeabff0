// The project's main job: a small GPT language model trained with FSDP
// (one unit per transformer block) across W local processes on a byte-level
// corpus the program generates, printing the loss as it falls.
//
//   bazel run //models:train_gpt -- --world_size=2 --steps=400
//
// Run without launcher variables it launches --world_size copies of itself
// (comm/local_launcher.h); under torchrun or srun it is one rank of their
// job. Every rank draws the same global batch of
// world_size * batch_size sequences and trains on its slice, so the run
// matches single-process training on the global batch.
#include <dirent.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <optional>
#include <utility>
#include <stdexcept>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "comm/collectives.h"
#include "comm/launch_environment.h"
#include "comm/local_launcher.h"
#include "comm/rendezvous.h"
#include "fsdp/fully_shard.h"
#include "fsdp/trace.h"
#include "models/gpt.h"
#include "policies/registry.h"
#include "statedict/state_dict.h"
#include "statedict/torch_file.h"
#include "optim/training_checkpoint.h"
#include "torch/optim/adamw.h"
#include "torch/optim/sgd.h"

ABSL_FLAG(int, world_size, 2, "Ranks to launch on this host (launcher mode).");
ABSL_FLAG(int, steps, 400, "Optimizer steps.");
ABSL_FLAG(int, batch_size, 16, "Sequences per rank per step.");
ABSL_FLAG(int, block_size, 32, "Context length.");
ABSL_FLAG(int, n_layer, 2, "Transformer blocks (one FSDP unit each).");
ABSL_FLAG(int, n_head, 4, "Attention heads.");
ABSL_FLAG(int, n_embd, 64, "Model width.");
ABSL_FLAG(std::string, optimizer, "adamw", "adamw or sgd (with momentum --beta1).");
ABSL_FLAG(double, lr, 3e-3, "Learning rate.");
ABSL_FLAG(double, weight_decay, 0.01, "Weight decay (decoupled for AdamW).");
ABSL_FLAG(double, beta1, 0.9, "AdamW beta1; SGD momentum.");
ABSL_FLAG(double, beta2, 0.99, "AdamW beta2.");
ABSL_FLAG(double, eps, 1e-8, "AdamW epsilon.");
ABSL_FLAG(double, grad_clip, 1.0,
          "Clip the global gradient norm to this (across all ranks and units); 0: off.");
ABSL_FLAG(std::string, metrics_jsonl, "",
          "Append one JSON line per step here (rank 0): step, loss, tokens_per_s, grad_norm.");
ABSL_FLAG(std::string, sharding_strategy, "full_shard",
          "full_shard, shard_grad_op, no_shard, hybrid_shard or _hybrid_shard_zero2.");
ABSL_FLAG(int, shard_group_size, 0,
          "With hybrid_shard or _hybrid_shard_zero2: ranks per shard group (it must divide "
          "the world size); 0: LOCAL_WORLD_SIZE, one node each.");
ABSL_FLAG(std::string, param_dtype, "",
          "Mixed precision: compute and all-gather parameters in this dtype (bfloat16, "
          "float16, float32); the optimizer still steps float32 shards. Empty: float32.");
ABSL_FLAG(std::string, reduce_dtype, "",
          "Mixed precision: reduce gradients in this dtype (default: --param_dtype).");
ABSL_FLAG(std::string, backward_prefetch, "backward_pre",
          "none, backward_pre or backward_post.");
ABSL_FLAG(bool, forward_prefetch, false, "All-gather the next unit during forward.");
ABSL_FLAG(bool, offload_params, false,
          "CPU offload: shards, gradients and optimizer state in host memory; the optimizer "
          "steps on the host (a CPU run makes the copies and saves nothing).");
ABSL_FLAG(std::string, wrap_policy, "module:Block",
          "Which modules become FSDP units: a policy spec (policies/policy_spec.h), e.g. "
          "'module:Block', 'module:Block,strategy=shard_grad_op', 'none', or a plugin's "
          "policy such as 'fqn_glob:transformer.h.*'.");
ABSL_FLAG(std::string, policy_plugin, "",
          "Path of a wrap-policy plugin (a shared object, policies/policy_plugin.h) to load "
          "before building --wrap_policy.");
ABSL_FLAG(std::string, init_state_dict, "",
          "Start from this state dict: a torch.save file (e.g. torch.save(model.state_dict()) "
          "of a PyTorch GPT with nanoGPT's layout) or one written by --export_state_dict.");
ABSL_FLAG(std::string, init_state_dict_key, "",
          "Take the state dict from this key of the file's top-level dict (nanoGPT's ckpt.pt: "
          "'model').");
ABSL_FLAG(std::string, export_state_dict, "",
          "Write the final FULL state dict here (rank 0), readable by Python's torch.load.");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Save SHARDED training checkpoints (model and AdamW state) here, one subdirectory "
          "step-NNNNNNNN per checkpoint; the two newest are kept.");
ABSL_FLAG(int, checkpoint_every, 100, "Steps between checkpoints (with --checkpoint_dir).");
ABSL_FLAG(bool, resume, false,
          "Continue from the newest complete checkpoint in --checkpoint_dir (any world size).");
ABSL_FLAG(std::string, record_batches, "",
          "Write every step's global batch of token ids here (rank 0, at the end), readable "
          "by torch.load: {'tokens': int64 [steps, world_size * batch_size, block_size + 1], "
          "'first_step': int64}; inputs are tokens[..., :-1], targets tokens[..., 1:].");
ABSL_FLAG(std::string, replay_batches, "",
          "Train on the batches a --record_batches file holds instead of sampling (any "
          "world size whose world_size * batch_size matches the recorded global batch).");
ABSL_FLAG(std::string, trace_dir, "",
          "Write each rank's FSDP trace (Chrome trace-event JSON, for Perfetto) to "
          "<trace_dir>/trace_rank<r>.json at the end: forward, backward, unshard, reshard, "
          "all-gather and reduce-scatter of every unit (fsdp/trace.h).");
ABSL_FLAG(bool, fsdp_debug_log, false,
          "Print every FSDP training-state transition to stderr, prefixed by the rank.");
ABSL_FLAG(bool, list_policies, false,
          "Print the registered wrap policies (after loading --policy_plugin) and exit.");
ABSL_FLAG(bool, print_plan, true, "Print the wrap plan (rank 0) before training.");
ABSL_FLAG(uint64_t, seed, 1234, "Model initialization and batch sampling.");
ABSL_FLAG(int, log_every, 25, "Print progress every this many steps.");
ABSL_FLAG(int, timeout_s, 600, "Whole-job timeout (launcher mode).");
ABSL_FLAG(int, collective_timeout_s, 120,
          "Bound on every collective and on forming the groups: a rank that does not take part "
          "in time makes the others fail naming the collective, its unit and the ranks' "
          "fingerprints.");
ABSL_FLAG(bool, check_collective_headers, true,
          "Before every collective, check that every rank issues the same one (GlooOptions::"
          "check_collective_headers): a mismatch is an error naming both sides instead of a "
          "crash inside Gloo or silently mixed data; costs one small all-to-all each.");
ABSL_FLAG(int, verify_collectives_every, 0,
          "Every this many steps, compare every rank's collective fingerprints through the "
          "store (FsdpOptions::verify_collectives_every); 0: never.");

namespace {

using Clock = std::chrono::steady_clock;

// Loads --policy_plugin (if any) and builds --wrap_policy.
absl::StatusOr<std::unique_ptr<fsdp::WrapPolicy>> BuildWrapPolicy() {
  const std::string plugin = absl::GetFlag(FLAGS_policy_plugin);
  if (!plugin.empty()) {
    if (absl::Status s = fsdp::LoadPolicyPlugin(plugin); !s.ok()) return s;
  }
  return fsdp::PolicyRegistry::Global().Build(absl::GetFlag(FLAGS_wrap_policy));
}

// A byte-level corpus with structure to learn: lines of sums, "17+25=42".
std::string MakeCorpus(uint64_t seed, size_t bytes) {
  std::mt19937_64 rng(seed);
  std::string text;
  while (text.size() < bytes) {
    const int a = static_cast<int>(rng() % 100), b = static_cast<int>(rng() % 100);
    text += std::to_string(a) + "+" + std::to_string(b) + "=" + std::to_string(a + b) + "\n";
  }
  return text;
}

// Complete checkpoints (those with a manifest) in `dir`, by step.
std::map<int, std::string> CompleteCheckpoints(const std::string& dir) {
  std::map<int, std::string> found;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return found;
  while (dirent* e = readdir(d)) {
    int step = 0;
    const std::string name = e->d_name;
    if (name.rfind("step-", 0) != 0 || !absl::SimpleAtoi(name.substr(5), &step)) continue;
    const std::string path = dir + "/" + name;
    struct stat st;
    if (stat((path + "/manifest.pb").c_str(), &st) == 0) found[step] = path;
  }
  closedir(d);
  return found;
}

void RemoveCheckpoint(const std::string& path) {
  DIR* d = opendir(path.c_str());
  if (d == nullptr) return;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") unlink((path + "/" + name).c_str());
  }
  closedir(d);
  rmdir(path.c_str());
}

absl::StatusOr<fsdp::BackwardPrefetch> ParseBackwardPrefetch(const std::string& name) {
  if (name == "none") return fsdp::BackwardPrefetch::kNone;
  if (name == "backward_pre") return fsdp::BackwardPrefetch::kBackwardPre;
  if (name == "backward_post") return fsdp::BackwardPrefetch::kBackwardPost;
  return absl::InvalidArgumentError("--backward_prefetch=" + name +
                                    ": expected none, backward_pre or backward_post");
}

// What one rank held and sent, for the report at the end of the run.
struct RankReport {
  int64_t shard_param_bytes = 0, unsharded_param_bytes = 0;
  int64_t gradient_bytes = 0;  // Measured after the last backward.
  int64_t optimizer_state_bytes = 0, unsharded_optimizer_state_bytes = 0;
};

int64_t LocalGradientBytes(torch::nn::Module& model) {
  int64_t bytes = 0;
  for (const at::Tensor& p : fsdp::UniqueParameters(model)) {
    if (p.grad().defined()) bytes += p.grad().nbytes();
  }
  return bytes;
}

int64_t LocalOptimizerStateBytes(torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (const auto& [key, state] : optimizer.state()) {
    if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(state.get())) {
      for (const at::Tensor& t :
           {adamw->exp_avg(), adamw->exp_avg_sq(), adamw->max_exp_avg_sq()}) {
        if (t.defined()) bytes += t.nbytes();
      }
    } else if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(state.get())) {
      if (sgd->momentum_buffer().defined()) bytes += sgd->momentum_buffer().nbytes();
    }
  }
  return bytes;
}

// One line per rank; every figure is measured on that rank.
void PrintRankReport(int rank, const RankReport& r, const fsdp::CollectiveCounters& c) {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  constexpr double kMiB = 1048576.0;
  const std::string line = absl::StrFormat(
      "rank %d: peak RSS %.1f MiB; held / unsharded: parameters %.2f / %.2f MiB, gradients "
      "%.2f / %.2f MiB, optimizer state %.2f / %.2f MiB; all-gathered %.1f MiB in %d calls, "
      "reduce-scattered %.1f MiB in %d calls, all-reduced %.1f MiB in %d calls\n",
      rank, usage.ru_maxrss / 1024.0, r.shard_param_bytes / kMiB, r.unsharded_param_bytes / kMiB,
      r.gradient_bytes / kMiB, r.unsharded_param_bytes / kMiB, r.optimizer_state_bytes / kMiB,
      r.unsharded_optimizer_state_bytes / kMiB,
      c.Bytes(fsdp::CollectiveOp::kAllGather) / kMiB, c.Calls(fsdp::CollectiveOp::kAllGather),
      c.Bytes(fsdp::CollectiveOp::kReduceScatter) / kMiB,
      c.Calls(fsdp::CollectiveOp::kReduceScatter), c.Bytes(fsdp::CollectiveOp::kAllReduce) / kMiB,
      c.Calls(fsdp::CollectiveOp::kAllReduce));
  std::fputs(line.c_str(), stdout);
  std::fflush(stdout);
}

// Trains on groups already formed: `comm` the world, `hybrid` the shard and
// replicate groups under hybrid sharding (empty otherwise).
int TrainOnGroups(fsdp::FsdpOptions options, const fsdp::WrapPolicy& policy,
                  fsdp::Collectives* comm, fsdp::HybridShardCollectives& hybrid,
                  const std::string& layout_note) {
  fsdp::Collectives& fsdp_group = hybrid.shard ? *hybrid.shard : *comm;
  const int rank = comm->rank(), world = comm->world_size();
  const bool print = rank == 0;
  fsdp::TraceRecorder trace(rank);
  const std::string trace_dir = absl::GetFlag(FLAGS_trace_dir);
  if (!trace_dir.empty()) options.trace = &trace;
  if (absl::GetFlag(FLAGS_fsdp_debug_log)) {
    options.debug_log = [rank](const std::string& line) {
      std::fprintf(stderr, "[fsdp rank %d] %s\n", rank, line.c_str());
    };
  }

  models::GptConfig config;
  config.block_size = absl::GetFlag(FLAGS_block_size);
  config.n_layer = absl::GetFlag(FLAGS_n_layer);
  config.n_head = absl::GetFlag(FLAGS_n_head);
  config.n_embd = absl::GetFlag(FLAGS_n_embd);
  config.seed = absl::GetFlag(FLAGS_seed);
  models::Gpt model(config);
  int64_t unsharded_param_bytes = 0;
  for (const auto& p : model->parameters()) unsharded_param_bytes += p.nbytes();
  unsharded_param_bytes -= model->lm_head->weight.nbytes();  // Tied: counted once.

  std::unique_ptr<fsdp::FullyShardedModel> fsdp_model =
      fsdp::ValueOrThrow(fsdp::FullyShardedModel::Wrap(model.ptr(), fsdp_group, options, policy));
  if (print && absl::GetFlag(FLAGS_print_plan)) {
    std::printf("%s", fsdp_model->plan().ToString().c_str());
  }
  if (const std::string init = absl::GetFlag(FLAGS_init_state_dict); !init.empty()) {
    // Every rank reads the file and keeps its own shards.
    const fsdp::StateDict state = fsdp::ValueOrThrow(
        fsdp::LoadTorchStateDict(init, absl::GetFlag(FLAGS_init_state_dict_key)));
    fsdp::ThrowIfError(fsdp::LoadStateDict(*fsdp_model, state));
    if (print) std::printf("initialized from %s\n", init.c_str());
  }
  int64_t shard_param_bytes = 0;
  for (const auto& unit : fsdp_model->units()) {
    if (unit->handle() != nullptr) shard_param_bytes += unit->handle()->local_shard().nbytes();
  }
  std::unique_ptr<torch::optim::Optimizer> optimizer_holder;
  if (absl::GetFlag(FLAGS_optimizer) == "sgd") {
    optimizer_holder = std::make_unique<torch::optim::SGD>(
        fsdp::UniqueParameters(*model), torch::optim::SGDOptions(absl::GetFlag(FLAGS_lr))
                                            .momentum(absl::GetFlag(FLAGS_beta1))
                                            .weight_decay(absl::GetFlag(FLAGS_weight_decay)));
  } else {
    optimizer_holder = std::make_unique<torch::optim::AdamW>(
        fsdp::UniqueParameters(*model),
        torch::optim::AdamWOptions(absl::GetFlag(FLAGS_lr))
            .betas(std::make_tuple(absl::GetFlag(FLAGS_beta1), absl::GetFlag(FLAGS_beta2)))
            .eps(absl::GetFlag(FLAGS_eps))
            .weight_decay(absl::GetFlag(FLAGS_weight_decay)));
  }
  torch::optim::Optimizer& optimizer = *optimizer_holder;
  std::FILE* metrics = nullptr;
  if (rank == 0 && !absl::GetFlag(FLAGS_metrics_jsonl).empty()) {
    metrics = std::fopen(absl::GetFlag(FLAGS_metrics_jsonl).c_str(), "a");
    if (metrics == nullptr) {
      throw std::runtime_error("--metrics_jsonl: cannot open '" +
                               absl::GetFlag(FLAGS_metrics_jsonl) + "'");
    }
  }

  const std::string corpus = MakeCorpus(absl::GetFlag(FLAGS_seed), 1 << 20);
  const at::Tensor data =
      at::from_blob(const_cast<char*>(corpus.data()), {static_cast<int64_t>(corpus.size())},
                    at::kChar)
          .to(at::kLong)
          .remainder(256);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int64_t per_rank = absl::GetFlag(FLAGS_batch_size);
  const int64_t t = config.block_size;
  if (print) {
    std::printf(
        "GPT %lld layers x %lld heads x %lld wide, %.2f M parameters; %d ranks, %s%s%s, "
        "global batch %lld x %lld tokens\n",
        static_cast<long long>(config.n_layer), static_cast<long long>(config.n_head),
        static_cast<long long>(config.n_embd), unsharded_param_bytes / 4 / 1e6, world,
        fsdp::ShardingStrategyName(options.strategy), layout_note.c_str(),
        options.mixed_precision.enabled() ? (", " + options.mixed_precision.ToString()).c_str()
                                          : "",
        static_cast<long long>(per_rank * world),
        static_cast<long long>(t));
    std::fflush(stdout);
  }

  std::mt19937_64 sampler(absl::GetFlag(FLAGS_seed) + 1);  // Same on every rank.
  at::Tensor replay;  // [steps, global batch, t + 1], from --replay_batches.
  int64_t replay_first_step = 1;
  if (const std::string path = absl::GetFlag(FLAGS_replay_batches); !path.empty()) {
    const fsdp::StateDict recorded = fsdp::ValueOrThrow(fsdp::LoadTorchStateDict(path));
    for (const auto& [name, tensor] : recorded) {
      if (name == "tokens") replay = tensor;
      if (name == "first_step") replay_first_step = tensor.item<int64_t>();
    }
    if (!replay.defined() || replay.dim() != 3 || replay.scalar_type() != at::kLong ||
        replay.size(1) != per_rank * world || replay.size(2) != t + 1) {
      throw std::runtime_error(absl::StrFormat(
          "--replay_batches=%s: expected an int64 'tokens' tensor of shape [steps, %d, %d] "
          "(world_size * batch_size, block_size + 1), found %s",
          path, per_rank * world, t + 1,
          replay.defined() ? absl::StrCat(std::string(c10::toString(replay.scalar_type())),
                                          " of shape ", c10::str(replay.sizes()))
                           : std::string("no 'tokens' entry")));
    }
    const int64_t last = replay_first_step + replay.size(0) - 1;
    if (replay_first_step != 1 || steps > last) {
      throw std::runtime_error(absl::StrFormat(
          "--replay_batches=%s holds steps %d..%d; --steps=%d must be within them", path,
          replay_first_step, last, steps));
    }
  }
  std::vector<at::Tensor> recorded_batches;  // For --record_batches (rank 0).
  const std::string record_path = absl::GetFlag(FLAGS_record_batches);
  const std::string checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  int first_step = 1;
  if (absl::GetFlag(FLAGS_resume)) {
    const std::map<int, std::string> found = CompleteCheckpoints(checkpoint_dir);
    if (found.empty()) {
      throw std::runtime_error("--resume: no complete checkpoint in --checkpoint_dir='" +
                               checkpoint_dir + "'");
    }
    fsdp::ThrowIfError(
        fsdp::LoadTrainingCheckpoint(*fsdp_model, optimizer, found.rbegin()->second));
    first_step = found.rbegin()->first + 1;
    // The batches of the steps already taken, drawn and dropped.
    sampler.discard(static_cast<unsigned long long>(found.rbegin()->first) * per_rank * world);
    if (print) std::printf("resumed from %s\n", found.rbegin()->second.c_str());
  }
  RankReport report;
  const Clock::time_point start = Clock::now();
  float first_loss = 0, last_loss = 0;
  for (int step = first_step; step <= steps; ++step) {
    // The global batch, then this rank's slice of it.
    at::Tensor global_batch;
    if (replay.defined()) {
      global_batch = replay[step - replay_first_step];
    } else {
      std::vector<at::Tensor> rows;
      for (int64_t i = 0; i < per_rank * world; ++i) {
        const int64_t offset = static_cast<int64_t>(sampler() % (data.numel() - t - 1));
        rows.push_back(data.narrow(0, offset, t + 1));
      }
      global_batch = at::stack(rows);
    }
    if (rank == 0 && !record_path.empty()) recorded_batches.push_back(global_batch);
    at::Tensor batch = global_batch.narrow(0, rank * per_rank, per_rank);
    at::Tensor loss = models::LanguageModelLoss(model->forward(batch.narrow(1, 0, t)),
                                                batch.narrow(1, 1, t));
    loss.backward();
    if (step == steps) report.gradient_bytes = LocalGradientBytes(*model);
    const double clip = absl::GetFlag(FLAGS_grad_clip);
    const double grad_norm =
        clip > 0 ? fsdp_model->ClipGradNorm(clip).item<double>() : std::nan("");
    optimizer.step();
    optimizer.zero_grad();
    at::Tensor global = loss.detach().clone();
    comm->AllReduce(global, fsdp::ReduceOp::kAvg)->Wait();
    last_loss = global.item<float>();
    if (step == first_step) first_loss = last_loss;
    if (metrics != nullptr) {
      const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      std::fprintf(metrics, "{\"step\": %d, \"loss\": %.6f, \"tokens_per_s\": %.1f%s}\n", step,
                   last_loss, (step - first_step + 1) * per_rank * world * t / elapsed,
                   clip > 0 ? absl::StrFormat(", \"grad_norm\": %.6f", grad_norm).c_str() : "");
      std::fflush(metrics);
    }
    if (print &&
        (step % absl::GetFlag(FLAGS_log_every) == 0 || step == first_step || step == steps)) {
      const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      const int done = step - first_step + 1;
      std::printf("step %4d/%d  loss %.4f  %8.0f tokens/s  %5.1f s left\n", step, steps,
                  last_loss, done * per_rank * world * t / elapsed,
                  elapsed / done * (steps - step));
      std::fflush(stdout);
    }
    if (!checkpoint_dir.empty() &&
        (step % absl::GetFlag(FLAGS_checkpoint_every) == 0 || step == steps)) {
      const std::string path = absl::StrFormat("%s/step-%08d", checkpoint_dir, step);
      mkdir(checkpoint_dir.c_str(), 0755);
      mkdir(path.c_str(), 0755);
      fsdp::ThrowIfError(fsdp::SaveTrainingCheckpoint(*fsdp_model, optimizer, path));
      if (rank == 0) {
        std::map<int, std::string> found = CompleteCheckpoints(checkpoint_dir);
        while (found.size() > 2) {
          RemoveCheckpoint(found.begin()->second);
          found.erase(found.begin());
        }
        std::printf("checkpoint %s\n", path.c_str());
      }
    }
  }
  if (const std::string out = absl::GetFlag(FLAGS_export_state_dict); !out.empty()) {
    fsdp::StateDictTypeScope scope(*fsdp_model,
                                   {fsdp::StateDictType::kFull, /*rank0_only=*/true});
    const fsdp::StateDict state = fsdp::ValueOrThrow(fsdp::StateDictOf(*fsdp_model));
    if (rank == 0) {
      fsdp::ThrowIfError(fsdp::SaveTorchStateDict(out, state));
      std::printf("wrote the FULL state dict to %s\n", out.c_str());
    }
  }
  if (!trace_dir.empty()) {
    mkdir(trace_dir.c_str(), 0755);
    const std::string path = absl::StrFormat("%s/trace_rank%d.json", trace_dir, rank);
    fsdp::ThrowIfError(trace.WriteChromeTrace(path));
    if (print) std::printf("wrote FSDP traces to %s/trace_rank<r>.json\n", trace_dir.c_str());
  }
  if (rank == 0 && !record_path.empty()) {
    fsdp::ThrowIfError(fsdp::SaveTorchStateDict(
        record_path, {{"tokens", at::stack(recorded_batches)},
                      {"first_step", at::scalar_tensor(static_cast<int64_t>(first_step),
                                                       at::kLong)}}));
    std::printf("wrote the batches of steps %d..%d to %s\n", first_step, steps,
                record_path.c_str());
  }
  if (metrics != nullptr) std::fclose(metrics);
  report.shard_param_bytes = shard_param_bytes;
  report.unsharded_param_bytes = unsharded_param_bytes;
  report.optimizer_state_bytes = LocalOptimizerStateBytes(optimizer);
  report.unsharded_optimizer_state_bytes =
      unsharded_param_bytes * (absl::GetFlag(FLAGS_optimizer) == "sgd" ? 1 : 2);
  // FSDP's traffic, whichever groups carried it.
  fsdp::CollectiveCounters traffic = fsdp_group.counters();
  if (hybrid.replicate) {
    const fsdp::CollectiveCounters across = hybrid.replicate->counters();
    for (size_t op = 0; op < traffic.calls.size(); ++op) {
      traffic.calls[op] += across.calls[op];
      traffic.bytes[op] += across.bytes[op];
    }
  }
  PrintRankReport(rank, report, traffic);
  if (print) {
    std::printf("loss %.4f -> %.4f over steps %d..%d%s\n", first_loss, last_loss, first_step,
                steps, last_loss < first_loss || first_step > 1 ? "" : "  (DID NOT FALL)");
  }
  return last_loss < first_loss || first_step > 1 ? 0 : 1;
}

int RunRank(const fsdp::LaunchEnvironment& env, fsdp::FsdpOptions options,
            const fsdp::WrapPolicy& policy) {
  fsdp::GlooOptions gloo;
  gloo.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_collective_timeout_s));
  // Under the launcher's 10 s grace after a rank fails: the others must
  // finish explaining the failure before they are killed.
  gloo.fingerprints.report_timeout = std::chrono::seconds(5);
  gloo.check_collective_headers = absl::GetFlag(FLAGS_check_collective_headers);
  // The world group (data, loss) and the groups FSDP runs on: the world
  // itself, or hybrid sharding's shard and replicate groups.
  std::unique_ptr<fsdp::Collectives> comm;
  fsdp::HybridShardCollectives hybrid;
  std::string layout_note;
  if (fsdp::IsHybrid(options.strategy)) {
    fsdp::HybridGroupsFromEnvironment groups = fsdp::ValueOrThrow(
        fsdp::CreateHybridGlooCollectivesFromEnvironment(env, absl::GetFlag(FLAGS_shard_group_size),
                                                          gloo));
    comm = std::move(groups.world);
    hybrid = std::move(groups.hybrid);
    options.replicate_group = hybrid.replicate.get();
    layout_note = absl::StrFormat(" (%d shard groups of %d ranks)",
                                  groups.layout.num_shard_groups(),
                                  groups.layout.shard_group_size());
  } else {
    comm = fsdp::ValueOrThrow(fsdp::CreateGlooCollectivesFromEnvironment(env, gloo));
  }
  try {
    return TrainOnGroups(options, policy, comm.get(), hybrid, layout_note);
  } catch (...) {
    // The other ranks' collective errors then quote this one's reason.
    const std::string why(fsdp::StatusFromCurrentException().message());
    for (fsdp::Collectives* group : {comm.get(), hybrid.shard.get(), hybrid.replicate.get()}) {
      if (group != nullptr) group->ReportStopped(why.substr(0, why.find('\n')));
    }
    throw;
  }
}


}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<fsdp::ShardingStrategy> strategy =
      fsdp::ParseShardingStrategy(absl::GetFlag(FLAGS_sharding_strategy));
  absl::StatusOr<fsdp::BackwardPrefetch> prefetch =
      ParseBackwardPrefetch(absl::GetFlag(FLAGS_backward_prefetch));
  // Checked here too, so that a bad spec or plugin fails before any rank
  // starts.
  absl::StatusOr<std::unique_ptr<fsdp::WrapPolicy>> policy = BuildWrapPolicy();
  if (absl::GetFlag(FLAGS_list_policies)) {
    for (const auto& entry : fsdp::PolicyRegistry::Global().List()) {
      std::printf("%-10s %s (%s)\n", entry.name.c_str(), entry.help.c_str(),
                  entry.origin.c_str());
    }
    return policy.ok() ? 0 : 2;
  }
  for (const absl::Status& s : {strategy.status(), prefetch.status(), policy.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "train_gpt: %s\n", s.ToString().c_str());
      return 2;
    }
  }
  fsdp::FsdpOptions options;
  options.strategy = *strategy;
  options.verify_collectives_every = absl::GetFlag(FLAGS_verify_collectives_every);
  options.backward_prefetch = *prefetch;
  options.forward_prefetch = absl::GetFlag(FLAGS_forward_prefetch);
  options.offload_params = absl::GetFlag(FLAGS_offload_params);
  for (auto [flag, field] :
       {std::pair<std::string, std::optional<fsdp::DType>*>{
            absl::GetFlag(FLAGS_param_dtype), &options.mixed_precision.param_dtype},
        {absl::GetFlag(FLAGS_reduce_dtype), &options.mixed_precision.reduce_dtype}}) {
    if (flag.empty()) continue;
    absl::StatusOr<fsdp::DType> dtype = fsdp::ParseDType(flag);
    if (!dtype.ok()) {
      std::fprintf(stderr, "train_gpt: %s\n", dtype.status().ToString().c_str());
      return 2;
    }
    *field = *dtype;
  }
  if (absl::GetFlag(FLAGS_optimizer) != "adamw" && absl::GetFlag(FLAGS_optimizer) != "sgd") {
    std::fprintf(stderr, "train_gpt: --optimizer=%s: expected adamw or sgd\n",
                 absl::GetFlag(FLAGS_optimizer).c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_world_size) < 1 || absl::GetFlag(FLAGS_steps) < 1 ||
      absl::GetFlag(FLAGS_batch_size) < 1 || absl::GetFlag(FLAGS_block_size) < 2 ||
      absl::GetFlag(FLAGS_log_every) < 1 || absl::GetFlag(FLAGS_collective_timeout_s) < 1 ||
      absl::GetFlag(FLAGS_verify_collectives_every) < 0) {
    std::fprintf(stderr,
                 "train_gpt: --world_size, --steps, --batch_size, --log_every and "
                 "--collective_timeout_s must be >= 1, --block_size >= 2 and "
                 "--verify_collectives_every >= 0\n");
    return 2;
  }
  absl::StatusOr<fsdp::LaunchEnvironment> env = fsdp::ReadLaunchEnvironment();
  if (absl::IsNotFound(env.status())) {
    return fsdp::LaunchSelfAndReport(argc, argv, absl::GetFlag(FLAGS_world_size),
                                     std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s)),
                                     "train_gpt");
  }
  if (!env.ok()) {
    std::fprintf(stderr, "train_gpt: %s\n", env.status().ToString().c_str());
    return 2;
  }
  try {
    return RunRank(*env, options, **policy);
  } catch (...) {
    std::fprintf(stderr, "train_gpt rank %d: %s\n", env->rank,
                 std::string(fsdp::StatusFromCurrentException().message()).c_str());
    return 1;
  }
}
