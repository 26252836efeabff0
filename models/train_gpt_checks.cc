#include "models/train_gpt_checks.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <tuple>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "formats/dcp.h"
#include "hf/model_config.h"
#include "models/train_gpt_flags.h"
#include "models/train_gpt_model.h"
#include "optim/flat_shard_optimizers.h"
#include "policies/registry.h"
#include "policies/unit_options.h"
#include "torch/version.h"

namespace train_gpt {

// Abseil's parser records which flags it saw; 20220623 exposes that only
// through this internal call.
bool Given(const char* name) { return absl::flags_internal::WasPresentOnCommandLine(name); }

namespace {

absl::StatusOr<fsdp::BackwardPrefetch> ParseBackwardPrefetch(const std::string& name) {
  if (name == "none") return fsdp::BackwardPrefetch::kNone;
  if (name == "backward_pre") return fsdp::BackwardPrefetch::kBackwardPre;
  if (name == "backward_post") return fsdp::BackwardPrefetch::kBackwardPost;
  return absl::InvalidArgumentError("--backward_prefetch=" + name +
                                    ": expected none, backward_pre or backward_post");
}

// An input path a rank would fail to read: the flag and why. With
// `dcp_directory`, a Distributed Checkpoint's directory is an input too.
std::optional<std::string> InputProblem(const char* flag, const std::string& path,
                                        bool dcp_directory) {
  if (path.empty()) return std::nullopt;
  const std::string shown = absl::StrCat("--", flag, "=", path, ": ");
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return shown + std::strerror(errno);
  std::string readable = path;
  if (S_ISDIR(st.st_mode)) {
    if (!dcp_directory) return shown + "a directory, not a file";
    if (!fsdp::IsDcpDirectory(path)) {
      return shown + "a directory without .metadata, so not a Distributed Checkpoint";
    }
    readable = path + "/.metadata";
  } else if (!S_ISREG(st.st_mode)) {
    return shown + "not a regular file";
  }
  if (access(readable.c_str(), R_OK) != 0) {
    return absl::StrCat(shown, "cannot read '", readable, "': ", std::strerror(errno));
  }
  return std::nullopt;
}

// A resumed run reads no initial state: its state is its checkpoint's.
std::vector<std::string> InputProblems() {
  std::vector<std::string> problems;
  const bool resume = absl::GetFlag(FLAGS_resume);
  for (std::optional<std::string> problem :
       {resume ? std::nullopt
               : InputProblem("init_state_dict", absl::GetFlag(FLAGS_init_state_dict), true),
        resume ? std::nullopt
               : InputProblem("init_optim_state_dict", absl::GetFlag(FLAGS_init_optim_state_dict),
                              true),
        InputProblem("replay_batches", absl::GetFlag(FLAGS_replay_batches), false)}) {
    if (problem.has_value()) problems.push_back(*std::move(problem));
  }
  return problems;
}

// Flags given with a value of their own without the flag that gives it a
// meaning. `settings_pending`: a resumed run's --data and --on_nonfinite
// may still come from its checkpoint, so the flags that need them wait.
std::vector<std::string> DependentFlagProblems(bool settings_pending) {
  std::vector<std::string> problems;
  const auto needs = [&](const char* flag, bool present, const char* what) {
    const absl::CommandLineFlag* given = absl::FindCommandLineFlag(flag);
    // The default (or turning it off where off is the default) asks for
    // nothing that could be ignored.
    if (!Given(flag) || present || given->CurrentValue() == given->DefaultValue()) return;
    problems.push_back(
        absl::StrCat("--", flag, "=", given->CurrentValue(), ": applies only with ", what));
  };
  const bool checkpoints = !absl::GetFlag(FLAGS_checkpoint_dir).empty();
  for (const char* flag :
       {"checkpoint_format", "checkpoint_every", "keep_checkpoints", "async_checkpoint"}) {
    needs(flag, checkpoints, "--checkpoint_dir");
  }
  for (const char* flag : {"init_state_dict_key", "init_state_dict_ignore"}) {
    needs(flag, !absl::GetFlag(FLAGS_init_state_dict).empty(), "--init_state_dict");
  }
  needs("init_optim_state_dict_key", !absl::GetFlag(FLAGS_init_optim_state_dict).empty(),
        "--init_optim_state_dict");
  needs("export_optim_state_dict_keys", !absl::GetFlag(FLAGS_export_optim_state_dict).empty(),
        "--export_optim_state_dict");
  const bool data = !absl::GetFlag(FLAGS_data).empty();
  const bool data_tokens = !absl::GetFlag(FLAGS_data_tokens).empty();
  for (const char* flag : {"eval_every", "eval_batches"}) {
    needs(flag, settings_pending || data || data_tokens,
          "--data or --data_tokens (the held-out loss uses its last tenth)");
  }
  needs("sample_tokens", settings_pending || data,
        "--data (the sample is bytes, printed as text)");
  needs("data_tokens_dtype", settings_pending || data_tokens, "--data_tokens");
  needs("max_consecutive_skips", settings_pending || absl::GetFlag(FLAGS_on_nonfinite) == "skip",
        "--on_nonfinite=skip");
  needs("overwrite_exports",
        !absl::GetFlag(FLAGS_export_state_dict).empty() ||
            !absl::GetFlag(FLAGS_export_optim_state_dict).empty() ||
            !absl::GetFlag(FLAGS_export_dcp).empty() || !absl::GetFlag(FLAGS_export_hf).empty() ||
            !absl::GetFlag(FLAGS_export_peft).empty(),
        "an --export_* flag");
  needs("restart_backoff_s", absl::GetFlag(FLAGS_max_restarts) > 0, "--max_restarts > 0");
  const bool hf_model = settings_pending || !absl::GetFlag(FLAGS_hf_model).empty();
  for (const char* flag : {"export_hf", "lora_r", "init_peft"}) {
    needs(flag, hf_model, "--hf_model (a Hugging Face model's directory)");
  }
  const bool lora_r = settings_pending || absl::GetFlag(FLAGS_lora_r) > 0;
  for (const char* flag : {"lora_alpha", "lora_dropout", "lora_targets"}) {
    needs(flag, lora_r, "--lora_r > 0");
  }
  needs("export_peft", lora_r || !absl::GetFlag(FLAGS_init_peft).empty(),
        "LoRA adapters (--lora_r or --init_peft)");
  for (const auto& [name, step] :
       {std::pair<const char*, int>{"TEST_nan_loss_at_step",
                                    absl::GetFlag(FLAGS_TEST_nan_loss_at_step)},
        {"TEST_flip_bit_at_step", absl::GetFlag(FLAGS_TEST_flip_bit_at_step)},
        {"TEST_kill_at_step", absl::GetFlag(FLAGS_TEST_kill_at_step)}}) {
    if (step > absl::GetFlag(FLAGS_steps)) {
      problems.push_back(
          absl::StrFormat("--%s=%d: beyond --steps=%d", name, step, absl::GetFlag(FLAGS_steps)));
    }
  }
  if (const std::string in = absl::GetFlag(FLAGS_TEST_flip_bit_in);
      in != "parameter" && in != "optimizer") {
    problems.push_back(absl::StrCat("--TEST_flip_bit_in=", in, ": must be parameter or optimizer"));
  }
  return problems;
}

// Before any rank starts: one source, the file is there, it holds whole
// token ids, and both parts hold a sequence.
std::optional<std::string> DataProblem(int block_size) {
  const std::string bytes = absl::GetFlag(FLAGS_data), ids = absl::GetFlag(FLAGS_data_tokens);
  const std::string dtype = absl::GetFlag(FLAGS_data_tokens_dtype);
  if (dtype != "uint16" && dtype != "uint32") {
    return absl::StrCat("--data_tokens_dtype=", dtype, ": must be uint16 or uint32");
  }
  if (!bytes.empty() && !ids.empty()) {
    return absl::StrCat("--data=", bytes, " and --data_tokens=", ids,
                        ": the job trains on one source; give one of them");
  }
  if (bytes.empty() && ids.empty()) return std::nullopt;
  const std::string flag = bytes.empty() ? "--data_tokens" : "--data";
  const std::string path = bytes.empty() ? ids : bytes;
  const char* unit = bytes.empty() ? "tokens" : "bytes";
  struct stat info;
  if (stat(path.c_str(), &info) != 0 || !S_ISREG(info.st_mode)) {
    return absl::StrCat(flag, "=", path, ": not a readable file");
  }
  const int64_t width = bytes.empty() ? (dtype == "uint32" ? 4 : 2) : 1;
  if (info.st_size % width != 0) {
    return absl::StrFormat("%s=%s: %d bytes are not a whole number of %d-byte %s ids "
                           "(--data_tokens_dtype)",
                           flag, path, info.st_size, width, dtype);
  }
  const int64_t size = info.st_size / width, held_out = HeldOutBytes(size);
  // Sampling needs room for more than one sequence (TokenSampler).
  if (held_out < block_size + 2) {
    return absl::StrFormat("%s=%s: %d %s hold %d held-out %s (the last tenth), fewer than "
                           "--block_size + 2 = %d",
                           flag, path, size, unit, held_out, unit, block_size + 2);
  }
  return std::nullopt;
}

// --hf_model's: the byte-level GPT's shape flags are its config's there,
// its weights come from its directory, and --init_peft's config sets the
// adapters; the config itself is read before launch.
std::vector<std::string> HfModelProblems(bool settings_pending) {
  std::vector<std::string> problems;
  const auto not_with = [&](const char* flag, const char* with, const char* why) {
    if (Given(flag)) {
      problems.push_back(absl::StrCat("--", flag, ": not with --", with, " (", why, ")"));
    }
  };
  if (const std::string dir = absl::GetFlag(FLAGS_hf_model); !dir.empty()) {
    for (const char* flag : {"n_layer", "n_head", "n_embd", "dropout"}) {
      not_with(flag, "hf_model", "the model's config.json sets its shape");
    }
    not_with("init_state_dict", "hf_model", "the model's weights are its directory's");
    not_with("sample_tokens", "hf_model",
             "the sample prints bytes; the model's ids are its tokenizer's");
    // Bytes (--data, the generated corpus) are no tokenizer's ids.
    if (!settings_pending && absl::GetFlag(FLAGS_data_tokens).empty() &&
        absl::GetFlag(FLAGS_replay_batches).empty()) {
      problems.push_back(absl::StrCat("--hf_model=", dir, ": give its tokenizer's ids with "
                                      "--data_tokens (or --replay_batches); --data and the "
                                      "generated corpus are bytes"));
    }
    if (absl::StatusOr<fsdp::hf::CausalLmConfig> config = fsdp::hf::ReadCausalLmConfig(dir);
        !config.ok()) {
      problems.push_back(absl::StrCat("--hf_model=", dir, ": ", config.status().message()));
    }
  }
  if (!absl::GetFlag(FLAGS_init_peft).empty()) {
    for (const char* flag : {"lora_r", "lora_alpha", "lora_dropout", "lora_targets"}) {
      not_with(flag, "init_peft", "the adapter's adapter_config.json sets it");
    }
  }
  return problems;
}

// A rough upper bound of one rank's training memory: parameters, gradients
// and two optimizer moments unsharded (sharding only lowers it), and the
// activations autograd keeps for backward, dominated by the attention
// matrices (batch x heads x block_size^2 per layer, about four copies).
double EstimatedRankBytes() {
  const double b = absl::GetFlag(FLAGS_batch_size), t = absl::GetFlag(FLAGS_block_size),
               l = absl::GetFlag(FLAGS_n_layer), h = absl::GetFlag(FLAGS_n_head),
               c = absl::GetFlag(FLAGS_n_embd), vocab = 256;
  const double params = l * (12 * c * c + 13 * c) + (vocab + t + 2) * c;
  const double attention = l * b * h * t * t * 4 * 4;
  const double other_activations = l * b * t * c * 4 * 24 + b * t * vocab * 4 * 4;
  return params * 4 * 4 + attention + other_activations;
}

// The integer flags' ranges, the corpus, --world_size against the
// launcher's and the heads' split of the embedding.
std::vector<std::string> CountProblems(int world_size, std::optional<int> launcher_world_size,
                                       bool settings_pending) {
  std::vector<std::string> problems;
  auto at_least = [&](const char* flag, int64_t value, int64_t min) {
    if (value < min)
      problems.push_back(absl::StrFormat("--%s=%d: must be >= %d", flag, value, min));
  };
  at_least("world_size", world_size, 1);
  at_least("steps", absl::GetFlag(FLAGS_steps), 1);
  at_least("batch_size", absl::GetFlag(FLAGS_batch_size), 1);
  at_least("n_layer", absl::GetFlag(FLAGS_n_layer), 1);
  at_least("n_head", absl::GetFlag(FLAGS_n_head), 1);
  at_least("n_embd", absl::GetFlag(FLAGS_n_embd), 1);
  at_least("checkpoint_every", absl::GetFlag(FLAGS_checkpoint_every), 1);
  at_least("keep_checkpoints", absl::GetFlag(FLAGS_keep_checkpoints), 1);
  at_least("log_every", absl::GetFlag(FLAGS_log_every), 1);
  at_least("timeout_s", absl::GetFlag(FLAGS_timeout_s), 1);
  at_least("collective_timeout_s", absl::GetFlag(FLAGS_collective_timeout_s), 1);
  at_least("verify_collectives_every", absl::GetFlag(FLAGS_verify_collectives_every), 0);
  at_least("max_consecutive_skips", absl::GetFlag(FLAGS_max_consecutive_skips), 0);
  at_least("shard_group_size", absl::GetFlag(FLAGS_shard_group_size), 0);
  at_least("TEST_nan_loss_at_step", absl::GetFlag(FLAGS_TEST_nan_loss_at_step), 0);
  at_least("check_replicas_every", absl::GetFlag(FLAGS_check_replicas_every), 0);
  at_least("TEST_flip_bit_at_step", absl::GetFlag(FLAGS_TEST_flip_bit_at_step), 0);
  at_least("TEST_kill_at_step", absl::GetFlag(FLAGS_TEST_kill_at_step), 0);
  at_least("max_restarts", absl::GetFlag(FLAGS_max_restarts), 0);
  if (!(absl::GetFlag(FLAGS_restart_backoff_s) >= 0)) {
    problems.push_back(absl::StrCat("--restart_backoff_s=", absl::GetFlag(FLAGS_restart_backoff_s),
                                    ": must be >= 0"));
  }
  // Restarts are the launcher's: under our own the ranks see the flag and
  // the launcher's TORCHELASTIC_MAX_RESTARTS agree; another launcher must be
  // given it.
  if (const char* theirs = std::getenv("TORCHELASTIC_MAX_RESTARTS");
      launcher_world_size.has_value() && absl::GetFlag(FLAGS_max_restarts) > 0 &&
      (theirs == nullptr || std::to_string(absl::GetFlag(FLAGS_max_restarts)) != theirs)) {
    problems.push_back(absl::StrCat(
        "--max_restarts=", absl::GetFlag(FLAGS_max_restarts), ": this rank's launcher restarts "
        "the job at most ", theirs == nullptr ? "0" : theirs, " times "
        "(TORCHELASTIC_MAX_RESTARTS); give fsdp_launch or torchrun --max_restarts instead (a "
        "restarted rank resumes from the newest complete checkpoint)"));
  }
  const int block_size = absl::GetFlag(FLAGS_block_size);
  if (block_size < 2 || block_size > kGeneratedCorpusBytes - 2) {
    problems.push_back(absl::StrFormat("--block_size=%d: must be in [2, %d] (the corpus is %d "
                                       "bytes)",
                                       block_size, kGeneratedCorpusBytes - 2,
                                       kGeneratedCorpusBytes));
  }
  at_least("eval_every", absl::GetFlag(FLAGS_eval_every), 0);
  at_least("eval_batches", absl::GetFlag(FLAGS_eval_batches), 1);
  at_least("sample_tokens", absl::GetFlag(FLAGS_sample_tokens), 0);
  at_least("lora_r", absl::GetFlag(FLAGS_lora_r), 0);
  if (std::optional<std::string> problem = DataProblem(block_size)) problems.push_back(*problem);
  if (launcher_world_size.has_value() && Given("world_size") &&
      absl::GetFlag(FLAGS_world_size) != *launcher_world_size) {
    problems.push_back(absl::StrFormat(
        "--world_size=%d: this rank's launcher started %d ranks (WORLD_SIZE); --world_size "
        "applies only when train_gpt launches its own ranks",
        absl::GetFlag(FLAGS_world_size), *launcher_world_size));
  }
  const int n_head = absl::GetFlag(FLAGS_n_head), n_embd = absl::GetFlag(FLAGS_n_embd);
  if (!settings_pending && n_head >= 1 && n_embd >= 1 && n_embd % n_head != 0) {
    problems.push_back(absl::StrFormat("--n_embd=%d: must be a multiple of --n_head=%d", n_embd,
                                       n_head));
  }
  return problems;
}

// The real-valued flags given: each finite and in its range.
std::vector<std::string> RealValueProblems() {
  std::vector<std::string> problems;
  struct Real {
    const char* flag;
    std::optional<double> value;
    double min;
    bool min_inclusive;
    double below;  // Exclusive upper bound.
    const char* range;
  };
  constexpr double kInf = std::numeric_limits<double>::infinity();
  for (const Real& r :
       {Real{"lr", absl::GetFlag(FLAGS_lr), 0, true, kInf, ">= 0 and finite"},
        Real{"weight_decay", absl::GetFlag(FLAGS_weight_decay), 0, true, kInf, ">= 0 and finite"},
        Real{"beta1", absl::GetFlag(FLAGS_beta1), 0, true, 1, "in [0, 1)"},
        Real{"dropout", absl::GetFlag(FLAGS_dropout), 0, true, 1, "in [0, 1)"},
        Real{"beta2", absl::GetFlag(FLAGS_beta2), 0, true, 1, "in [0, 1)"},
        Real{"eps", absl::GetFlag(FLAGS_eps), 0, false, kInf, "> 0 and finite"},
        Real{"grad_clip", absl::GetFlag(FLAGS_grad_clip), 0, true, kInf,
             ">= 0 and finite (0: off)"},
        Real{"lora_alpha", absl::GetFlag(FLAGS_lora_alpha), 0, false, kInf, "> 0 and finite"},
        Real{"lora_dropout", absl::GetFlag(FLAGS_lora_dropout), 0, true, 1, "in [0, 1)"}}) {
    if (!r.value.has_value()) continue;
    const double v = *r.value;
    const bool ok = std::isfinite(v) && (r.min_inclusive ? v >= r.min : v > r.min) && v < r.below;
    if (!ok) problems.push_back(absl::StrFormat("--%s=%g: must be %s", r.flag, v, r.range));
  }
  return problems;
}

// The flags that name one of a few choices: the optimizer and its kernel,
// --on_nonfinite and the exports' keys.
std::vector<std::string> TrainingChoiceProblems() {
  std::vector<std::string> problems;
  if (const std::string k = absl::GetFlag(FLAGS_export_optim_state_dict_keys);
      k != "fqn" && k != "index") {
    problems.push_back("--export_optim_state_dict_keys=" + k + ": expected fqn or index");
  }
  if (const std::string o = absl::GetFlag(FLAGS_optimizer); o != "adamw" && o != "sgd") {
    problems.push_back("--optimizer=" + o + ": expected adamw or sgd");
  }
  if (const std::string k = absl::GetFlag(FLAGS_optimizer_kernel);
      k != "flat_exact" && k != "flat_fused" && k != "per_parameter") {
    problems.push_back("--optimizer_kernel=" + k +
                       ": expected flat_exact, flat_fused or per_parameter");
  } else if (k == "flat_fused" && !fsdp::kHaveFusedOptimizerKernels) {
    problems.push_back(absl::StrFormat(
        "--optimizer_kernel=flat_fused: needs libtorch >= 2.4 (PyTorch's fused optimizer "
        "kernels); this is libtorch %d.%d: use flat_exact",
        TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR));
  }
  if (const std::string n = absl::GetFlag(FLAGS_on_nonfinite); n != "stop" && n != "skip") {
    problems.push_back("--on_nonfinite=" + n + ": expected stop or skip");
  }
  return problems;
}

// --shard_group_size against the strategy and world size, the parameter
// groups, and the checkpoint flags against each other.
std::vector<std::string> LayoutAndCheckpointProblems(fsdp::ShardingStrategy strategy,
                                                     int world_size, bool settings_pending) {
  std::vector<std::string> problems;
  if (const int g = absl::GetFlag(FLAGS_shard_group_size); g > 0 && !settings_pending) {
    if (!fsdp::IsHybrid(strategy)) {
      problems.push_back(absl::StrFormat(
          "--shard_group_size=%d: applies only to --sharding_strategy=hybrid_shard or "
          "_hybrid_shard_zero2, not %s",
          g, fsdp::ShardingStrategyName(strategy)));
    } else if (world_size >= 1 && world_size % g != 0) {
      problems.push_back(absl::StrFormat(
          "--shard_group_size=%d: must divide the world size %d", g, world_size));
    }
  }
  const bool has_dir = !absl::GetFlag(FLAGS_checkpoint_dir).empty();
  if (const std::string groups = absl::GetFlag(FLAGS_weight_decay_groups);
      groups != "one" && groups != "nanogpt") {
    problems.push_back("--weight_decay_groups=" + groups + ": expected one or nanogpt");
  }
  if (const std::string format = absl::GetFlag(FLAGS_checkpoint_format);
      format != "sharded" && format != "dcp") {
    problems.push_back("--checkpoint_format=" + format + ": expected sharded or dcp");
  }
  if (absl::GetFlag(FLAGS_resume) && !has_dir) {
    problems.push_back("--resume: needs --checkpoint_dir");
  }
  if (absl::GetFlag(FLAGS_overwrite_checkpoints) &&
      (!has_dir || absl::GetFlag(FLAGS_resume))) {
    problems.push_back(
        "--overwrite_checkpoints: only for a new run (no --resume) with --checkpoint_dir");
  }
  return problems;
}

// The run too large for this host's memory, with `ranks_on_host` ranks.
std::optional<std::string> MemoryProblem(int ranks_on_host) {
  // The estimate is the byte-level GPT's; a --hf_model's size is its own.
  if (!absl::GetFlag(FLAGS_hf_model).empty()) return std::nullopt;
  const double need = EstimatedRankBytes() * ranks_on_host;
  const double have =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  if (need <= have) return std::nullopt;
  return absl::StrFormat(
      "--block_size=%d, --batch_size=%d, --n_layer=%d, --n_head=%d, --n_embd=%d: training "
      "needs about %.0f GiB on this host (%d ranks; attention matrices grow with "
      "block_size^2), which has %.0f GiB of memory",
      absl::GetFlag(FLAGS_block_size), absl::GetFlag(FLAGS_batch_size),
      absl::GetFlag(FLAGS_n_layer), absl::GetFlag(FLAGS_n_head), absl::GetFlag(FLAGS_n_embd),
      need / (1 << 30), ranks_on_host, have / (1 << 30));
}

}  // namespace

std::vector<std::string> FlagProblems(fsdp::ShardingStrategy strategy, int world_size,
                                      int ranks_on_host, std::optional<int> launcher_world_size,
                                      bool settings_pending) {
  std::vector<std::string> problems;
  const auto append = [&problems](std::vector<std::string> more) {
    for (std::string& problem : more) problems.push_back(std::move(problem));
  };
  append(CountProblems(world_size, launcher_world_size, settings_pending));
  append(RealValueProblems());
  append(TrainingChoiceProblems());
  append(HfModelProblems(settings_pending));
  append(LayoutAndCheckpointProblems(strategy, world_size, settings_pending));
  // What a flag's value is wrong with comes first; then which flags lack
  // the flag they need, and the inputs.
  append(DependentFlagProblems(settings_pending));
  append(InputProblems());
  if (problems.empty() && !settings_pending) {
    if (std::optional<std::string> problem = MemoryProblem(ranks_on_host)) {
      problems.push_back(*problem);
    }
  }
  return problems;
}

std::vector<fsdp::OutputPath> Outputs() {
  std::vector<fsdp::OutputPath> outputs;
  const auto add = [&](const char* flag, const std::string& path, bool directory,
                       std::vector<std::string> owns) {
    if (!path.empty()) outputs.push_back({flag, path, directory, std::move(owns)});
  };
  // What each directory's writer touches: run checkpoints their step
  // directories (optim/run_checkpoints.h), a DCP save every file.
  add("--checkpoint_dir", absl::GetFlag(FLAGS_checkpoint_dir), true,
      {"step-*", fsdp::DirectoryLock::kFileName});
  add("--export_dcp", absl::GetFlag(FLAGS_export_dcp), true, {});
  add("--export_hf", absl::GetFlag(FLAGS_export_hf), true, {});
  add("--export_peft", absl::GetFlag(FLAGS_export_peft), true, {});
  add("--trace_dir", absl::GetFlag(FLAGS_trace_dir), true,
      {"trace_rank*.json", fsdp::DirectoryLock::kFileName});
  add("--export_state_dict", absl::GetFlag(FLAGS_export_state_dict), false, {});
  add("--export_optim_state_dict", absl::GetFlag(FLAGS_export_optim_state_dict), false, {});
  add("--record_batches", absl::GetFlag(FLAGS_record_batches), false, {});
  add("--metrics_jsonl", absl::GetFlag(FLAGS_metrics_jsonl), false, {});
  return outputs;
}

absl::Status PrepareOutputs() {
  const std::vector<fsdp::OutputPath> outputs = Outputs();
  FSDP_RETURN_IF_ERROR(fsdp::CheckOutputsDisjoint(outputs));
  for (const fsdp::OutputPath& output : outputs) {
    FSDP_RETURN_IF_ERROR(output.directory ? fsdp::PrepareOutputDirectory(output.flag, output.path)
                                          : fsdp::PrepareOutputFile(output.flag, output.path));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<fsdp::DirectoryLock>> LockOutputDirectories() {
  std::vector<fsdp::DirectoryLock> locks;
  for (const fsdp::OutputPath& output : Outputs()) {
    if (!output.directory) continue;
    absl::StatusOr<fsdp::DirectoryLock> lock =
        fsdp::DirectoryLock::Acquire(output.path, "train_gpt");
    if (absl::IsUnimplemented(lock.status())) {
      // Refusing would shut such file systems out altogether; the user is
      // told that nothing keeps a second job out.
      std::fprintf(stderr, "train_gpt: warning: %s=%s: %s; nothing keeps another job out of it\n",
                   output.flag.c_str(), output.path.c_str(),
                   std::string(lock.status().message()).c_str());
      continue;
    }
    if (!lock.ok()) {
      return absl::Status(lock.status().code(), absl::StrCat(output.flag, "=", output.path, ": ",
                                                             lock.status().message()));
    }
    locks.push_back(*std::move(lock));
  }
  return locks;
}

absl::Status CheckExportsReplaceNothing() {
  if (absl::GetFlag(FLAGS_overwrite_exports)) return absl::OkStatus();
  for (const fsdp::OutputPath& output : Outputs()) {
    if (absl::StartsWith(output.flag, "--export_")) {
      FSDP_RETURN_IF_ERROR(fsdp::CheckNothingToReplace(output, "--overwrite_exports"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<fsdp::RunCheckpoints>> OpenCheckpoints(const std::string& run_id,
                                                                    int world_size) {
  const std::string dir = absl::GetFlag(FLAGS_checkpoint_dir);
  if (dir.empty()) return std::nullopt;
  fsdp::RunCheckpointsOptions options;
  options.resume = absl::GetFlag(FLAGS_resume);
  options.overwrite = absl::GetFlag(FLAGS_overwrite_checkpoints);
  options.keep = absl::GetFlag(FLAGS_keep_checkpoints);
  options.settings = RecordedSettings(world_size);
  absl::StatusOr<fsdp::RunCheckpoints> run = fsdp::RunCheckpoints::Open(dir, options, run_id);
  if (!run.ok()) {
    return absl::Status(run.status().code(),
                        absl::StrCat("--checkpoint_dir=", dir, ": ", run.status().message()));
  }
  const int steps = absl::GetFlag(FLAGS_steps);
  if (run->resume_from() && run->resume_from()->step >= steps) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--steps=%d: the run in '%s' has already reached step %d (%s); pass a larger --steps "
        "to train further",
        steps, dir, run->resume_from()->step, run->resume_from()->path));
  }
  return std::optional<fsdp::RunCheckpoints>(*std::move(run));
}

namespace {

// A setting the job records in its checkpoints. `fixed` says why a resumed
// run cannot change it (null: it can).
struct RecordedSetting {
  const char* flag;
  const char* fixed;
};

constexpr char kOptimizerState[] = "its optimizer state is of that optimizer and grouping";
constexpr char kModelShape[] = "its model has that shape";
constexpr char kTrainable[] = "its trainable parameters are those adapters, so scaled";

constexpr RecordedSetting kRecordedSettings[] = {
    {"optimizer", kOptimizerState},
    {"weight_decay_groups", kOptimizerState},
    {"n_layer", kModelShape},
    {"n_head", kModelShape},
    {"n_embd", kModelShape},
    {"block_size", kModelShape},
    {"hf_model", kModelShape},
    {"lora_r", kTrainable},
    {"lora_targets", kTrainable},
    {"init_peft", kTrainable},
    {"lora_alpha", kTrainable},
    {"lora_dropout", nullptr},
    {"world_size", nullptr},
    {"batch_size", nullptr},
    {"seed", nullptr},
    {"dropout", nullptr},
    {"grad_clip", nullptr},
    {"sharding_strategy", nullptr},
    {"shard_group_size", nullptr},
    {"param_dtype", nullptr},
    {"reduce_dtype", nullptr},
    {"all_gather_quantization", nullptr},
    {"reduce_quantization", nullptr},
    {"wrap_policy", nullptr},
    {"policy_plugin", nullptr},
    {"activation_checkpointing", nullptr},
    {"optimizer_kernel", nullptr},
    {"data", nullptr},
    {"data_tokens", nullptr},
    {"data_tokens_dtype", nullptr},
    {"replay_batches", nullptr},
    {"on_nonfinite", nullptr},
    {"max_consecutive_skips", nullptr},
    {"checkpoint_format", nullptr},
    {"checkpoint_every", nullptr},
    {"keep_checkpoints", nullptr},
};

const RecordedSetting* FindRecordedSetting(const std::string& name) {
  for (const RecordedSetting& setting : kRecordedSettings) {
    if (name == setting.flag) return &setting;
  }
  return nullptr;
}

std::string Shown(const std::string& value) { return value.empty() ? "''" : value; }

// The corpus is one choice of three flags: a run given any of them takes
// none from its checkpoint, so that --data_tokens given on resume meets
// neither the recorded --data nor a recorded dtype of another file.
constexpr const char* kDataSettings[] = {"data", "data_tokens", "data_tokens_dtype"};
bool CorpusGivenInstead(const std::string& name) {
  return std::find(std::begin(kDataSettings), std::end(kDataSettings), name) !=
             std::end(kDataSettings) &&
         std::any_of(std::begin(kDataSettings), std::end(kDataSettings),
                     [](const char* data) { return Given(data); });
}

}  // namespace

std::map<std::string, std::string> RecordedSettings(int world_size) {
  std::map<std::string, std::string> settings;
  for (const RecordedSetting& setting : kRecordedSettings) {
    settings[setting.flag] = std::string(setting.flag) == "world_size"
                                 ? absl::StrCat(world_size)
                                 : absl::FindCommandLineFlag(setting.flag)->CurrentValue();
  }
  return settings;
}

absl::StatusOr<std::vector<std::string>> TakeSettingsFromCheckpoint(
    const fsdp::StepCheckpoint& from, int world_size, std::optional<int> launcher_world_size) {
  if (from.settings.empty()) {
    return std::vector<std::string>{absl::StrCat(
        "'", from.path, "' records no settings (saved by PyTorch or an older train_gpt): the "
        "flags apply as given")};
  }
  // Those left out first, so that a refusal below describes the run as it
  // would be.
  std::vector<std::string> taken, changed, refused;
  for (const auto& [name, recorded] : from.settings) {
    const RecordedSetting* setting = FindRecordedSetting(name);
    // A setting of another version of the job: not this one's to judge.
    if (setting == nullptr) continue;
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    const bool launcher_decides = name == "world_size" && launcher_world_size.has_value();
    if (Given(name.c_str()) || launcher_decides || flag->CurrentValue() == recorded) continue;
    if (CorpusGivenInstead(name)) continue;
    std::string error;
    if (!flag->ParseFrom(recorded, &error)) {
      refused.push_back(absl::StrCat("the checkpoint '", from.path, "' records --", name, "=",
                                     fsdp::PrintableText(recorded), ", which is not valid: ",
                                     error));
      continue;
    }
    taken.push_back(absl::StrCat(name, "=", Shown(recorded)));
  }
  for (const auto& [name, recorded] : from.settings) {
    const RecordedSetting* setting = FindRecordedSetting(name);
    if (setting == nullptr) continue;
    const bool launcher_decides = name == "world_size" && launcher_world_size.has_value();
    if (!Given(name.c_str()) && !launcher_decides) continue;
    const std::string current = name == "world_size"
                                    ? absl::StrCat(world_size)
                                    : absl::FindCommandLineFlag(name)->CurrentValue();
    if (current == recorded) continue;
    if (setting->fixed == nullptr) {
      changed.push_back(absl::StrCat(name, "=", Shown(current), " (",
                                     Given(name.c_str()) ? "--" + name : "the launcher's",
                                     "; the checkpoint's was ", Shown(recorded), ")"));
      continue;
    }
    std::string what = absl::StrCat("--", name, "=", Shown(recorded));
    if (setting->fixed == kOptimizerState) {
      const auto pair = [&](const std::string& optimizer, const std::string& groups) {
        return absl::StrCat("--optimizer=", optimizer, " --weight_decay_groups=", groups);
      };
      const auto recorded_of = [&](const char* key) {
        auto it = from.settings.find(key);
        return it == from.settings.end() ? std::string("?") : it->second;
      };
      what = absl::StrCat(pair(recorded_of("optimizer"), recorded_of("weight_decay_groups")),
                          ", and this run asks for ",
                          pair(absl::GetFlag(FLAGS_optimizer),
                               absl::GetFlag(FLAGS_weight_decay_groups)));
    }
    refused.push_back(absl::StrCat(
        "--", name, "=", Shown(current), ": the checkpoint to resume, '", from.path,
        "', was saved by a run with ", what, "; ", setting->fixed,
        ", which a resumed run cannot change: leave --", name,
        " out to continue with the checkpoint's, or start a new run in another "
        "--checkpoint_dir"));
  }
  if (!refused.empty()) return absl::FailedPreconditionError(absl::StrJoin(refused, "\n"));
  std::vector<std::string> notes;
  if (!taken.empty()) {
    notes.push_back(absl::StrCat("settings from the checkpoint (flags left out): ",
                                 absl::StrJoin(taken, ", ")));
  }
  if (!changed.empty()) {
    notes.push_back(absl::StrCat("settings that differ from the checkpoint's: ",
                                 absl::StrJoin(changed, ", ")));
  }
  return notes;
}

absl::StatusOr<std::unique_ptr<fsdp::WrapPolicy>> BuildWrapPolicy() {
  const std::string plugin = absl::GetFlag(FLAGS_policy_plugin);
  if (!plugin.empty()) {
    if (absl::Status s = fsdp::LoadPolicyPlugin(plugin); !s.ok()) return s;
  }
  // A --hf_model's blocks are its decoder layers, not the GPT's Block.
  const absl::CommandLineFlag* wrap_policy = absl::FindCommandLineFlag("wrap_policy");
  if (!absl::GetFlag(FLAGS_hf_model).empty() &&
      wrap_policy->CurrentValue() == wrap_policy->DefaultValue()) {
    return HfModelLayerPolicy();
  }
  return fsdp::PolicyRegistry::Global().Build(absl::GetFlag(FLAGS_wrap_policy));
}

absl::StatusOr<fsdp::FsdpOptions> FsdpOptionsFromFlags() {
  fsdp::FsdpOptions options;
  FSDP_ASSIGN_OR_RETURN(options.strategy,
                        fsdp::ParseShardingStrategy(absl::GetFlag(FLAGS_sharding_strategy)));
  FSDP_ASSIGN_OR_RETURN(options.backward_prefetch,
                        ParseBackwardPrefetch(absl::GetFlag(FLAGS_backward_prefetch)));
  options.verify_collectives_every = absl::GetFlag(FLAGS_verify_collectives_every);
  options.forward_prefetch = absl::GetFlag(FLAGS_forward_prefetch);
  options.offload_params = absl::GetFlag(FLAGS_offload_params);
  for (auto [flag, field] :
       {std::pair<std::string, std::optional<at::ScalarType>*>{
            absl::GetFlag(FLAGS_param_dtype), &options.mixed_precision.param_dtype},
        {absl::GetFlag(FLAGS_reduce_dtype), &options.mixed_precision.reduce_dtype}}) {
    if (flag.empty()) continue;
    FSDP_ASSIGN_OR_RETURN(*field, fsdp::ParseDtypeFlag(flag));
  }
  // What the root unit would refuse at Wrap on every rank, refused here
  // before any rank starts (the GPT's parameters are float32).
  using Check =
      absl::Status (*)(const std::string&, fsdp::ShardingStrategy, const fsdp::MixedPrecision&,
                       fsdp::CommQuantization, at::ScalarType, const std::string&);
  for (auto [flag, value, field, check] :
       {std::tuple<const char*, std::string, fsdp::CommQuantization*, Check>{
            "all_gather_quantization", absl::GetFlag(FLAGS_all_gather_quantization),
            &options.all_gather_quantization, &fsdp::CheckAllGatherQuantization},
        {"reduce_quantization", absl::GetFlag(FLAGS_reduce_quantization),
         &options.reduce_quantization, &fsdp::CheckReduceQuantization}}) {
    absl::StatusOr<fsdp::CommQuantization> quantization = fsdp::ParseCommQuantization(value);
    if (!quantization.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": ", quantization.status().message()));
    }
    *field = *quantization;
    if (absl::Status applies =
            check("<root>", options.strategy, options.mixed_precision, *field, at::kFloat, "");
        !applies.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", flag, "=", value,
          " with --sharding_strategy=", absl::GetFlag(FLAGS_sharding_strategy), ", --param_dtype='",
          absl::GetFlag(FLAGS_param_dtype), "' and --reduce_dtype='",
          absl::GetFlag(FLAGS_reduce_dtype), "': ", applies.message()));
    }
  }
  return options;
}

}  // namespace train_gpt
