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
#include <fnmatch.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "ATen/ATen.h"
#include "ATen/CPUGeneratorImpl.h"
#if __has_include("ATen/DeviceAccelerator.h")
#include "ATen/DeviceAccelerator.h"
#endif
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "comm/collectives.h"
#include "comm/launch_environment.h"
#include "comm/local_launcher.h"
#include "comm/rendezvous.h"
#include "comm/staged_collectives.h"
#include "fsdp/activation_checkpointing.h"
#include "fsdp/fully_shard.h"
#include "fsdp/trace.h"
#include "fsdp/utilities.h"
#include "models/gpt.h"
#include "models/output_paths.h"
#include "models/train_gpt_checks.h"
#include "models/train_gpt_flags.h"
#include "optim/dcp_checkpoint.h"
#include "optim/flat_shard_optimizers.h"
#include "optim/optim_state.h"
#include "optim/run_checkpoints.h"
#include "optim/torch_optim_file.h"
#include "optim/training_checkpoint.h"
#include "policies/registry.h"
#include "statedict/dcp.h"
#include "statedict/dcp_sharded.h"
#include "statedict/state_dict.h"
#include "statedict/torch_file.h"
#ifdef FSDP_WITH_NCCL
#include "comm/nccl_collectives.h"
#endif
#include "torch/cuda.h"
#include "torch/version.h"
#include "torch/optim/adamw.h"
#include "torch/optim/sgd.h"

namespace {

using Clock = std::chrono::steady_clock;

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

// What one rank held and sent, for the report at the end of the run.
struct RankReport {
  int64_t shard_param_bytes = 0, unsharded_param_bytes = 0;
  int64_t gradient_bytes = 0;  // Measured after the last backward.
  int64_t optimizer_state_bytes = 0, unsharded_optimizer_state_bytes = 0;
  // The caching allocator's peak on the rank's GPU; none on the host.
  std::optional<int64_t> peak_device_bytes;
  // Resident memory once the model is wrapped and the optimizer built,
  // before the first step: what the peak adds to it is the steps' own.
  int64_t rss_before_steps = 0;
  std::string device;
};

// The device caching allocator's peak of allocated bytes on `device`; none
// on the host, or with a libtorch older than 2.10 (no device-generic stats).
std::optional<int64_t> PeakDeviceBytes(const c10::Device& device) {
  if (device.is_cpu()) return std::nullopt;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10)
  const auto stats = at::accelerator::getDeviceStats(device.index());
  return stats.allocated_bytes[static_cast<size_t>(
                                   c10::CachingDeviceAllocator::StatType::AGGREGATE)]
      .peak;
#else
  return std::nullopt;
#endif
}

// The process's resident set now (/proc/self/statm); 0 where unreadable.
int64_t CurrentRssBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size_pages = 0, resident_pages = 0;
  if (!(statm >> size_pages >> resident_pages)) return 0;
  return resident_pages * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

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
      "rank %d: peak RSS %.1f MiB (%.1f before the first step)%s; held / unsharded: parameters "
      "%.2f / %.2f MiB, gradients "
      "%.2f / %.2f MiB, optimizer state %.2f / %.2f MiB; all-gathered %.1f MiB in %d calls, "
      "reduce-scattered %.1f MiB in %d calls, all-reduced %.1f MiB in %d calls\n",
      rank, usage.ru_maxrss / 1024.0, r.rss_before_steps / kMiB,
      r.peak_device_bytes
          ? absl::StrFormat(", peak %s memory %.1f MiB", r.device, *r.peak_device_bytes / kMiB)
          : "",
      r.shard_param_bytes / kMiB, r.unsharded_param_bytes / kMiB, r.gradient_bytes / kMiB,
      r.unsharded_param_bytes / kMiB, r.optimizer_state_bytes / kMiB,
      r.unsharded_optimizer_state_bytes / kMiB, c.Bytes(fsdp::CollectiveOp::kAllGather) / kMiB,
      c.Calls(fsdp::CollectiveOp::kAllGather), c.Bytes(fsdp::CollectiveOp::kReduceScatter) / kMiB,
      c.Calls(fsdp::CollectiveOp::kReduceScatter), c.Bytes(fsdp::CollectiveOp::kAllReduce) / kMiB,
      c.Calls(fsdp::CollectiveOp::kAllReduce));
  std::fputs(line.c_str(), stdout);
  std::fflush(stdout);
}

// The tokens the run trains on and, with --data, the held-out tenth.
struct Corpus {
  at::Tensor train;     // int64 [n]
  at::Tensor held_out;  // int64 [m]; undefined without --data.
};

at::Tensor TokensOf(const std::string& bytes) {
  return at::from_blob(const_cast<char*>(bytes.data()), {static_cast<int64_t>(bytes.size())},
                       at::kByte)
      .to(at::kLong);
}

absl::StatusOr<Corpus> LoadCorpus() {
  Corpus corpus;
  const std::string path = absl::GetFlag(FLAGS_data);
  if (path.empty()) {
    const std::string generated =
        MakeCorpus(absl::GetFlag(FLAGS_seed), train_gpt::kGeneratedCorpusBytes);
    // The generator's bytes as signed chars, folded into 0..255 as before.
    corpus.train = at::from_blob(const_cast<char*>(generated.data()),
                                 {static_cast<int64_t>(generated.size())}, at::kChar)
                       .to(at::kLong)
                       .remainder(256);
    return corpus;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--data=", path, ": cannot open it"));
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::DataLossError(absl::StrCat("--data=", path, ": cannot read it"));
  const at::Tensor tokens = TokensOf(bytes);
  const int64_t held_out = train_gpt::HeldOutBytes(tokens.numel());
  corpus.train = tokens.narrow(0, 0, tokens.numel() - held_out);
  corpus.held_out = tokens.narrow(0, tokens.numel() - held_out, held_out);
  return corpus;
}

// One optimizer hyper-parameter: its flag, and its value in a group.
struct Hyperparameter {
  const char* name;
  std::optional<double> flag;
  double fresh_default;
  double current;
  std::function<void(double)> set;
};

// Whether parameter group `g` is decayed: all are, but nanoGPT's second.
bool GroupDecays(size_t g) {
  return !(absl::GetFlag(FLAGS_weight_decay_groups) == "nanogpt" && g == 1);
}

// The hyper-parameters of group `g` (a group without decay has no weight
// decay to set: it stays 0).
std::vector<Hyperparameter> HyperparametersOf(torch::optim::OptimizerOptions& options, size_t g) {
  std::vector<Hyperparameter> all;
  if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
    all = {{"lr", absl::GetFlag(FLAGS_lr), 3e-3, o->lr(), [o](double v) { o->lr(v); }},
           {"weight_decay", absl::GetFlag(FLAGS_weight_decay), 0.01, o->weight_decay(),
            [o](double v) { o->weight_decay(v); }},
           {"beta1", absl::GetFlag(FLAGS_beta1), 0.9, std::get<0>(o->betas()),
            [o](double v) { o->betas(std::make_tuple(v, std::get<1>(o->betas()))); }},
           {"beta2", absl::GetFlag(FLAGS_beta2), 0.99, std::get<1>(o->betas()),
            [o](double v) { o->betas(std::make_tuple(std::get<0>(o->betas()), v)); }},
           {"eps", absl::GetFlag(FLAGS_eps), 1e-8, o->eps(), [o](double v) { o->eps(v); }}};
  } else {
    auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(&options);
    TORCH_CHECK(sgd != nullptr, "train_gpt: an optimizer of neither AdamW nor SGD");
    all = {{"lr", absl::GetFlag(FLAGS_lr), 3e-3, sgd->lr(), [sgd](double v) { sgd->lr(v); }},
           {"weight_decay", absl::GetFlag(FLAGS_weight_decay), 0.01, sgd->weight_decay(),
            [sgd](double v) { sgd->weight_decay(v); }},
           {"beta1", absl::GetFlag(FLAGS_beta1), 0.9, sgd->momentum(),
            [sgd](double v) { sgd->momentum(v); }}};
  }
  if (!GroupDecays(g)) {
    all.erase(std::remove_if(
                  all.begin(), all.end(),
                  [](const Hyperparameter& h) { return std::string(h.name) == "weight_decay"; }),
              all.end());
  }
  return all;
}

// The optimizer the flags ask for over `groups` of parameters, each
// hyper-parameter not given at its default (a group without decay at 0).
std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
    const std::vector<std::vector<at::Tensor>>& groups) {
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  const std::string kernel = absl::GetFlag(FLAGS_optimizer_kernel);
  const fsdp::FlatShardKernel flat_kernel =
      kernel == "flat_fused" ? fsdp::FlatShardKernel::kFused : fsdp::FlatShardKernel::kExact;
  if (absl::GetFlag(FLAGS_optimizer) == "sgd") {
    const auto options = torch::optim::SGDOptions(3e-3);
    std::vector<torch::optim::OptimizerParamGroup> param_groups;
    for (const auto& params : groups) {
      param_groups.emplace_back(params, std::make_unique<torch::optim::SGDOptions>(options));
    }
    if (kernel == "per_parameter") {
      optimizer = std::make_unique<torch::optim::SGD>(std::move(param_groups), options);
    } else {
      optimizer =
          std::make_unique<fsdp::FlatShardSGD>(std::move(param_groups), options, flat_kernel);
    }
  } else {
    const auto options = torch::optim::AdamWOptions(3e-3);
    std::vector<torch::optim::OptimizerParamGroup> param_groups;
    for (const auto& params : groups) {
      param_groups.emplace_back(params, std::make_unique<torch::optim::AdamWOptions>(options));
    }
    if (kernel == "per_parameter") {
      optimizer = std::make_unique<torch::optim::AdamW>(std::move(param_groups), options);
    } else {
      optimizer =
          std::make_unique<fsdp::FlatShardAdamW>(std::move(param_groups), options, flat_kernel);
    }
  }
  for (size_t g = 0; g < optimizer->param_groups().size(); ++g) {
    auto& options = optimizer->param_groups()[g].options();
    for (const Hyperparameter& h : HyperparametersOf(options, g)) {
      h.set(h.flag.value_or(h.fresh_default));
    }
    if (!GroupDecays(g)) {
      if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) o->weight_decay(0);
      if (auto* o = dynamic_cast<torch::optim::SGDOptions*>(&options)) o->weight_decay(0);
    }
  }
  return optimizer;
}

// After loading a checkpoint: every hyper-parameter given on the command
// line replaces the checkpoint's; the others keep the checkpoint's. Returns
// what the optimizer now uses, and where each value came from.
std::string ApplyGivenHyperparameters(torch::optim::Optimizer& optimizer) {
  std::vector<std::string> described;
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    for (const Hyperparameter& h : HyperparametersOf(optimizer.param_groups()[g].options(), g)) {
      if (h.flag.has_value() && *h.flag != h.current) {
        h.set(*h.flag);
        if (g == 0) {
          described.push_back(absl::StrFormat("%s %g (--%s; the checkpoint's was %g)", h.name,
                                              *h.flag, h.name, h.current));
        }
      } else if (g == 0) {
        described.push_back(absl::StrFormat("%s %g (the checkpoint's)", h.name, h.current));
      }
    }
  }
  return absl::StrJoin(described, ", ");
}

// The first path parts of a Distributed Checkpoint's entries (as dcp.save
// saw the nested state dict: {"model": ..., "optim": ...} -> model, optim).
std::set<std::string> DcpTopLevelKeys(const fsdp::DcpMetadata& metadata) {
  std::set<std::string> keys;
  const auto add = [&](const std::string& name) {
    auto path = metadata.planner_data.find(name);
    if (path != metadata.planner_data.end() && !path->second.empty() &&
        !path->second.front().is_index) {
      keys.insert(path->second.front().key);
    } else {
      keys.insert(name.substr(0, name.find('.')));
    }
  };
  for (const fsdp::DcpTensorEntry& t : metadata.tensors) add(t.fqn);
  for (const fsdp::DcpBytesEntry& b : metadata.bytes) add(b.fqn);
  return keys;
}

// "'model', 'optim'".
std::string Quoted(const std::set<std::string>& names) {
  return absl::StrJoin(names, ", ", [](std::string* out, const std::string& name) {
    absl::StrAppend(out, "'", fsdp::PrintableText(name), "'");
  });
}

// What to say when --init_state_dict's (or --init_optim_state_dict's)
// entries lie under top-level keys: with no key given, which key
// `key_flag` should name (the first of `wanted` among `top_level`); with
// one given that is not among them, which there are. "" otherwise.
std::string KeyHint(const std::string& given_key, const std::set<std::string>& top_level,
                    const char* key_flag, const std::vector<std::string>& wanted) {
  if (!given_key.empty()) {
    if (top_level.count(given_key) != 0) return "";
    return absl::StrCat(" (no entry lies under --", key_flag, "=",
                        fsdp::PrintableText(given_key), "; its top-level keys are ",
                        Quoted(top_level), ")");
  }
  for (const std::string& key : wanted) {
    if (top_level.count(key) != 0) {
      return absl::StrCat(" (its entries lie under the top-level keys ", Quoted(top_level),
                          ": --", key_flag, "=", key, " takes those under '", key, "')");
    }
  }
  return "";
}

// --init_state_dict into the wrapped model; `model_keys` are its state
// dict's names. One rule for every format: an entry the model lacks is
// refused unless --init_state_dict_ignore drops it. Errors name the file.
void LoadInitialState(fsdp::FullyShardedModel& fsdp_model, const std::set<std::string>& model_keys,
                      bool print) {
  const std::string path = absl::GetFlag(FLAGS_init_state_dict);
  const std::vector<std::string> ignore = absl::GetFlag(FLAGS_init_state_dict_ignore);
  const std::string key = absl::GetFlag(FLAGS_init_state_dict_key);
  const bool dcp = fsdp::IsDcpDirectory(path);
  const auto fail = [&](absl::string_view why, const std::string& hint) {
    throw std::runtime_error(absl::StrCat("--init_state_dict=", path, ": ", why, hint));
  };
  // The names the source holds, and a hint when they lie under a key.
  std::vector<std::string> names;
  std::string hint;
  fsdp::StateDict state;  // A torch.save file's, read whole by every rank.
  if (dcp) {
    const fsdp::DcpMetadata metadata = fsdp::ValueOrThrow(fsdp::ReadDcpMetadata(path));
    const std::string prefix = key.empty() ? "" : key + ".";
    for (const fsdp::DcpTensorEntry& t : metadata.tensors) {
      if (absl::StartsWith(t.fqn, prefix)) names.push_back(t.fqn.substr(prefix.size()));
    }
    hint = KeyHint(key, DcpTopLevelKeys(metadata), "init_state_dict_key", {"model"});
  } else {
    state = fsdp::ValueOrThrow(fsdp::LoadTorchStateDict(path, key));
    for (const auto& [name, tensor] : state) names.push_back(name);
  }
  std::set<std::string> dropped, unexpected;
  for (const std::string& name : names) {
    if (model_keys.count(name) != 0) continue;
    bool matched = false;
    for (const std::string& glob : ignore) {
      matched = matched || fnmatch(glob.c_str(), name.c_str(), 0) == 0;
    }
    (matched ? dropped : unexpected).insert(name);
  }
  if (!unexpected.empty()) {
    std::vector<std::string> shown(unexpected.begin(), unexpected.end());
    const size_t more = shown.size() > 8 ? shown.size() - 8 : 0;
    shown.resize(shown.size() - more);
    fail(absl::StrCat(unexpected.size(), " entries are not in the model: ",
                      fsdp::PrintableText(absl::StrJoin(shown, ", ")),
                      more > 0 ? absl::StrCat(" and ", more, " more") : ""),
         hint.empty() ? " (entries the model does not have can be dropped with "
                        "--init_state_dict_ignore=GLOB,...; nanoGPT checkpoints from torch < 2 "
                        "carry their causal masks as '*.attn.bias')"
                      : hint);
  }
  if (dcp) {
    // Every rank reads only the chunks that hold its own shards.
    fsdp::ShardedLoadStats stats;
    if (absl::Status loaded = fsdp::LoadShardedDcpModel(fsdp_model, path, key, &stats);
        !loaded.ok()) {
      fail(loaded.message(), hint);
    }
    if (print) {
      std::printf("initialized from %s (rank 0 read %.2f MiB for its %.2f MiB of shards)%s\n",
                  path.c_str(), stats.bytes_read / 1048576.0, stats.bytes_needed / 1048576.0,
                  dropped.empty() ? ""
                                  : absl::StrCat(" (dropped by --init_state_dict_ignore: ",
                                                 absl::StrJoin(dropped, ", "), ")")
                                        .c_str());
    }
    return;
  }
  // Every rank keeps its own shards of what it read.
  fsdp::StateDict kept;
  for (auto& [name, tensor] : state) {
    if (dropped.count(name) == 0) kept.emplace_back(name, std::move(tensor));
  }
  if (absl::Status loaded = fsdp::LoadFullStateDict(fsdp_model, kept); !loaded.ok()) {
    fail(loaded.message(), "");
  }
  if (print) {
    std::printf("initialized from %s%s\n", path.c_str(),
                dropped.empty() ? ""
                                : absl::StrCat(" (dropped by --init_state_dict_ignore: ",
                                               absl::StrJoin(dropped, ", "), ")")
                                      .c_str());
  }
}

// Global batches of `block_size` + 1 tokens drawn from `tokens` with a
// generator every rank seeds alike.
class TokenSampler {
 public:
  TokenSampler(at::Tensor tokens, int64_t global_batch, int64_t block_size, uint64_t seed)
      : tokens_(std::move(tokens)), global_batch_(global_batch), t_(block_size), sampler_(seed) {
    TORCH_CHECK(tokens_.numel() >= t_ + 2, "TokenSampler: ", tokens_.numel(),
                " tokens hold fewer than block_size + 2 = ", t_ + 2);
  }

  // [global batch, block_size + 1] token ids.
  at::Tensor Next() {
    std::vector<at::Tensor> rows;
    for (int64_t i = 0; i < global_batch_; ++i) {
      const int64_t offset = static_cast<int64_t>(sampler_() % (tokens_.numel() - t_ - 1));
      rows.push_back(tokens_.narrow(0, offset, t_ + 1));
    }
    return at::stack(rows);
  }
  // Drops the next `batches` batches.
  void Skip(int64_t batches) {
    sampler_.discard(static_cast<unsigned long long>(batches) * global_batch_);
  }

 private:
  at::Tensor tokens_;
  int64_t global_batch_, t_;
  std::mt19937_64 sampler_;
};

// The batches the run trains on: --replay_batches' recorded ones, or drawn
// from the training tokens.
class BatchSource {
 public:
  BatchSource(const at::Tensor& tokens, int64_t global_batch, int64_t block_size, int steps)
      : t_(block_size),
        sampler_(tokens, global_batch, block_size, absl::GetFlag(FLAGS_seed) + 1) {
    const std::string path = absl::GetFlag(FLAGS_replay_batches);
    if (path.empty()) return;
    const fsdp::StateDict recorded = fsdp::ValueOrThrow(fsdp::LoadTorchStateDict(path));
    for (const auto& [name, tensor] : recorded) {
      if (name == "tokens") replay_ = tensor;
      if (name == "first_step") replay_first_step_ = tensor.item<int64_t>();
    }
    if (!replay_.defined() || replay_.dim() != 3 || replay_.scalar_type() != at::kLong ||
        replay_.size(1) != global_batch || replay_.size(2) != t_ + 1) {
      throw std::runtime_error(absl::StrFormat(
          "--replay_batches=%s: expected an int64 'tokens' tensor of shape [steps, %d, %d] "
          "(world_size * batch_size, block_size + 1), found %s",
          path, global_batch, t_ + 1,
          replay_.defined() ? absl::StrCat(std::string(c10::toString(replay_.scalar_type())),
                                           " of shape ", c10::str(replay_.sizes()))
                            : std::string("no 'tokens' entry")));
    }
    const int64_t last = replay_first_step_ + replay_.size(0) - 1;
    if (replay_first_step_ != 1 || steps > last) {
      throw std::runtime_error(absl::StrFormat(
          "--replay_batches=%s holds steps %d..%d; --steps=%d must be within them", path,
          replay_first_step_, last, steps));
    }
  }

  // Drops the batches of steps 1..`steps` (already taken by a resumed run).
  void Skip(int64_t steps) { sampler_.Skip(steps); }

  // The global batch of `step`: [global batch, block_size + 1] token ids.
  at::Tensor Next(int step) {
    if (replay_.defined()) return replay_[step - replay_first_step_];
    return sampler_.Next();
  }

 private:
  int64_t t_;
  TokenSampler sampler_;
  at::Tensor replay_;  // [steps, global batch, t + 1], from --replay_batches.
  int64_t replay_first_step_ = 1;
};

models::GptConfig GptConfigFromFlags() {
  models::GptConfig config;
  config.block_size = absl::GetFlag(FLAGS_block_size);
  config.n_layer = absl::GetFlag(FLAGS_n_layer);
  config.n_head = absl::GetFlag(FLAGS_n_head);
  config.n_embd = absl::GetFlag(FLAGS_n_embd);
  config.seed = absl::GetFlag(FLAGS_seed);
  config.dropout = absl::GetFlag(FLAGS_dropout);
  return config;
}

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
class TrainingRun {
 public:
  TrainingRun(fsdp::FsdpOptions options, const fsdp::WrapPolicy& policy, fsdp::Collectives& world,
              fsdp::HybridShardCollectives& hybrid, c10::Device device)
      : device_(device),
        world_(world),
        hybrid_(hybrid),
        fsdp_group_(hybrid.shard ? *hybrid.shard : world),
        rank_(world.rank()),
        world_size_(world.world_size()),
        print_(rank_ == 0),
        trace_(rank_),
        config_(GptConfigFromFlags()),
        model_(config_),
        steps_(absl::GetFlag(FLAGS_steps)),
        per_rank_(absl::GetFlag(FLAGS_batch_size)),
        corpus_(fsdp::ValueOrThrow(LoadCorpus())) {
    if (corpus_.held_out.defined()) {
      TokenSampler held_out(corpus_.held_out, per_rank_ * world_size_, config_.block_size,
                            absl::GetFlag(FLAGS_seed) + 2);
      for (int i = 0; i < absl::GetFlag(FLAGS_eval_batches); ++i) {
        eval_batches_.push_back(held_out.Next());
      }
    }
    OpenRunCheckpoints();
    Wrap(std::move(options), policy);
    if (rank_ == 0 && !absl::GetFlag(FLAGS_metrics_jsonl).empty()) {
      metrics_ = std::fopen(absl::GetFlag(FLAGS_metrics_jsonl).c_str(), "a");
      if (metrics_ == nullptr) {
        throw std::runtime_error("--metrics_jsonl=" + absl::GetFlag(FLAGS_metrics_jsonl) +
                                 ": cannot open it: " + std::strerror(errno));
      }
    }
  }
  ~TrainingRun() {
    if (metrics_ != nullptr) std::fclose(metrics_);
  }

  // The process's exit code: 0 once every step ran and every output was
  // written (whether the loss fell is for the user to judge: it is printed).
  // `notes` are printed first (rank 0).
  int Run(const std::string& layout_note, const std::vector<std::string>& notes) {
    if (print_) {
      for (const std::string& note : notes) std::printf("note: %s\n", note.c_str());
    }
    PrintHeader(layout_note);
    batches_.emplace(corpus_.train, per_rank_ * world_size_, config_.block_size, steps_);
    ResumeIfAsked();
    report_.rss_before_steps = CurrentRssBytes();
    start_ = Clock::now();
    for (int step = first_step_; step <= steps_; ++step) {
      const StepResult result = Step(step);
      const int eval_every = absl::GetFlag(FLAGS_eval_every);
      const bool eval = !eval_batches_.empty() &&
                        (step == steps_ || (eval_every > 0 && step % eval_every == 0));
      Log(step, result, eval ? std::optional<float>(HeldOutLoss()) : std::nullopt);
      if (checkpoints_.has_value() &&
          (step % absl::GetFlag(FLAGS_checkpoint_every) == 0 || step == steps_)) {
        SaveCheckpoint(step);
      }
    }
    if (corpus_.held_out.defined() && absl::GetFlag(FLAGS_sample_tokens) > 0) PrintSample();
    WriteOutputs();
    return Summarize();
  }

 private:
  // Builds the model's FSDP units and the optimizer over their shards.
  void Wrap(fsdp::FsdpOptions options, const fsdp::WrapPolicy& policy) {
    if (!absl::GetFlag(FLAGS_trace_dir).empty()) options.trace = &trace_;
    if (absl::GetFlag(FLAGS_fsdp_debug_log)) {
      options.debug_log = [rank = rank_](const std::string& line) {
        std::fprintf(stderr, "[fsdp rank %d] %s\n", rank, line.c_str());
      };
    }
    strategy_ = options.strategy;
    mixed_precision_ = options.mixed_precision;
    for (const auto& p : model_->parameters()) report_.unsharded_param_bytes += p.nbytes();
    // Tied: counted once.
    report_.unsharded_param_bytes -= model_->lm_head->weight.nbytes();
    std::set<std::string> model_keys;
    for (const auto& [name, tensor] : fsdp::ModuleStateDict(*model_)) model_keys.insert(name);
    // Wrapping makes the parameters 1-D views of flat shards: nanoGPT's
    // grouping goes by their dimensions before.
    std::set<std::string> matrices;
    for (const auto& item : model_->named_parameters()) {
      if (item.value().dim() >= 2) matrices.insert(item.key());
    }
    fsdp_model_ = fsdp::ValueOrThrow(
        fsdp::FullyShardedModel::Wrap(model_.ptr(), fsdp_group_, options, policy));
    if (absl::GetFlag(FLAGS_activation_checkpointing)) {
      const std::vector<std::string> checkpointed =
          fsdp::ValueOrThrow(fsdp::ApplyActivationCheckpointing(
              *model_, *fsdp::ModuleTypePolicy::Of<models::BlockImpl>()));
      if (print_) {
        std::printf("activation checkpointing: %s\n", absl::StrJoin(checkpointed, ", ").c_str());
      }
    }
    if (print_ && absl::GetFlag(FLAGS_print_plan)) {
      std::printf("%s", fsdp_model_->plan().ToString().c_str());
    }
    // A resumed run's state is its checkpoint's.
    if (!absl::GetFlag(FLAGS_init_state_dict).empty() && !Resuming()) {
      LoadInitialState(*fsdp_model_, model_keys, print_);
    }
    for (const auto& unit : fsdp_model_->units()) {
      if (unit->handle() != nullptr) {
        report_.shard_param_bytes += unit->handle()->local_shard().nbytes();
      }
    }
    std::vector<std::vector<at::Tensor>> groups(1);
    if (absl::GetFlag(FLAGS_weight_decay_groups) == "nanogpt") {
      groups.resize(2);
      std::set<const void*> seen;
      for (const auto& item : model_->named_parameters()) {
        if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // Tied.
        groups[matrices.count(item.key()) != 0 ? 0 : 1].push_back(item.value());
      }
    } else {
      groups[0] = fsdp::UniqueParameters(*model_);
    }
    optimizer_ = MakeOptimizer(groups);
    if (!absl::GetFlag(FLAGS_init_optim_state_dict).empty() && !Resuming()) {
      LoadInitialOptimizerState();
    }
  }

  // --init_optim_state_dict into the optimizer. Errors name the file.
  void LoadInitialOptimizerState() {
    const std::string path = absl::GetFlag(FLAGS_init_optim_state_dict);
    // An index-keyed file names the optimizer's parameters by position
    // across its groups.
    std::map<const void*, std::string> fqn_of;
    for (const auto& item : model_->named_parameters()) {
      fqn_of.emplace(item.value().unsafeGetTensorImpl(), item.key());  // A tied one's first.
    }
    std::vector<std::string> fqn_of_index;
    for (const auto& group : optimizer_->param_groups()) {
      for (const at::Tensor& param : group.params()) {
        fqn_of_index.push_back(fqn_of.at(param.unsafeGetTensorImpl()));
      }
    }
    const std::string key = absl::GetFlag(FLAGS_init_optim_state_dict_key);
    absl::Status loaded;
    if (fsdp::IsDcpDirectory(path)) {
      // Every rank reads only its own part of the elementwise state.
      absl::StatusOr<std::map<std::string, fsdp::ParamShardPlace>> places =
          fsdp::OptimizerShardPlaces(*fsdp_model_, *optimizer_);
      absl::StatusOr<fsdp::OptimStateDict> state =
          places.ok() ? fsdp::LoadDcpOptimStateDictPart(path, key, *places, fqn_of_index)
                      : places.status();
      loaded = state.ok() ? fsdp::LoadShardedOptimStateDict(*fsdp_model_, *optimizer_, *state)
                          : state.status();
    } else {
      absl::StatusOr<fsdp::OptimStateDict> state =
          fsdp::LoadTorchOptimStateDict(path, key, fqn_of_index);
      loaded = state.ok() ? fsdp::LoadFullOptimStateDict(*fsdp_model_, *optimizer_, *state)
                          : state.status();
    }
    if (!loaded.ok()) {
      const bool groups_differ =
          absl::StrContains(loaded.message(), "parameter groups, the optimizer");
      std::string hint;
      if (fsdp::IsDcpDirectory(path)) {
        if (absl::StatusOr<fsdp::DcpMetadata> metadata = fsdp::ReadDcpMetadata(path);
            metadata.ok()) {
          hint = KeyHint(key, DcpTopLevelKeys(*metadata), "init_optim_state_dict_key",
                         {"optim", "optimizer"});
        }
      }
      throw std::runtime_error(absl::StrCat(
          "--init_optim_state_dict=", path, ": ", loaded.message(),
          groups_differ ? " (nanoGPT's optimizer has two: --weight_decay_groups=nanogpt)" : "",
          hint));
    }
    const std::string hyperparameters = ApplyGivenHyperparameters(*optimizer_);
    if (print_) {
      std::printf("optimizer state from %s; optimizer: %s\n", path.c_str(),
                  hyperparameters.c_str());
    }
  }

  // Rank 0's run id is the one its manifests record; every rank uses it.
  void OpenRunCheckpoints() {
    if (absl::GetFlag(FLAGS_checkpoint_dir).empty()) return;
    std::string run_id = rank_ == 0 ? fsdp::NewRunId() : std::string();
    fsdp::BroadcastBytes(world_, run_id, /*root=*/0);
    checkpoints_ = fsdp::ValueOrThrow(train_gpt::OpenCheckpoints(run_id, world_size_));
  }

  bool Resuming() const { return checkpoints_.has_value() && checkpoints_->resume_from(); }

  void PrintHeader(const std::string& layout_note) const {
    if (!print_) return;
    std::printf(
        "GPT %lld layers x %lld heads x %lld wide, %.2f M parameters; %d ranks, %s%s%s, "
        "global batch %lld x %lld tokens\n",
        static_cast<long long>(config_.n_layer), static_cast<long long>(config_.n_head),
        static_cast<long long>(config_.n_embd), report_.unsharded_param_bytes / 4 / 1e6,
        world_size_, fsdp::ShardingStrategyName(strategy_), layout_note.c_str(),
        mixed_precision_.enabled() ? (", " + mixed_precision_.ToString()).c_str() : "",
        static_cast<long long>(per_rank_ * world_size_),
        static_cast<long long>(config_.block_size));
    // With both --replay_batches and --data, each part of the run has its
    // own source: say which.
    const std::string replay = absl::GetFlag(FLAGS_replay_batches);
    const std::string data = absl::GetFlag(FLAGS_data);
    const std::string held_out =
        absl::StrFormat("the last tenth of %s (%d bytes)", data, corpus_.held_out.defined()
                                                                      ? corpus_.held_out.numel()
                                                                      : 0);
    if (!replay.empty()) {
      std::printf("data: training batches replayed from %s%s\n", replay.c_str(),
                  data.empty() ? ""
                               : absl::StrCat("; the held-out loss and the sample from ",
                                              held_out, " (--data)")
                                     .c_str());
    } else if (!data.empty()) {
      std::printf("data: training batches from the first nine tenths of %s (%lld bytes); the "
                  "held-out loss and the sample from %s\n",
                  data.c_str(), static_cast<long long>(corpus_.train.numel()),
                  held_out.c_str());
    } else {
      std::printf("data: training batches from the generated corpus (%lld bytes of sums)\n",
                  static_cast<long long>(corpus_.train.numel()));
    }
    std::fflush(stdout);
  }

  void ResumeIfAsked() {
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
    fsdp::ThrowIfError(
        from.format == fsdp::StepCheckpoint::Format::kDcp
            ? fsdp::LoadShardedDcpModelAndOptimizer(*fsdp_model_, *optimizer_, from.path)
            : fsdp::LoadTrainingCheckpoint(*fsdp_model_, *optimizer_, from.path));
    const std::string hyperparameters = ApplyGivenHyperparameters(*optimizer_);
    first_step_ = static_cast<int>(from.step) + 1;
    batches_->Skip(from.step);
    if (print_) {
      std::printf("resumed from %s (step %lld of run %s); optimizer: %s\n", from.path.c_str(),
                  static_cast<long long>(from.step),
                  from.run_id.empty() ? "<no id>" : from.run_id.c_str(), hyperparameters.c_str());
    }
  }

  // Forward, backward, the global gradient norm (clipped when asked) and
  // loss, then the optimizer step, or none when either is not finite.
  StepResult Step(int step) {
    const int64_t t = config_.block_size;
    const at::Tensor global_batch = batches_->Next(step);
    if (config_.dropout > 0) {
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
    at::Tensor loss = models::LanguageModelLoss(model_->forward(batch.narrow(1, 0, t)),
                                                batch.narrow(1, 1, t));
    if (step == absl::GetFlag(FLAGS_TEST_nan_loss_at_step) && rank_ == world_size_ - 1) {
      loss = loss * std::numeric_limits<float>::quiet_NaN();
    }
    loss.backward();
    if (step == steps_) report_.gradient_bytes = LocalGradientBytes(*model_);
    const double clip = absl::GetFlag(FLAGS_grad_clip);
    StepResult result;
    result.grad_norm = fsdp::ValueOrThrow(fsdp_model_->ClipGradNorm(
                                              clip > 0 ? clip
                                                       : std::numeric_limits<double>::infinity()))
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

  // Throws unless --on_nonfinite=skip and the skips in a row are allowed.
  void SkipNonFinite(int step, const StepResult& result) {
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

  // --metrics_jsonl's line and the progress line (and the held-out loss,
  // when measured at this step).
  void Log(int step, const StepResult& result, std::optional<float> held_out_loss) {
    const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
    const int done = step - first_step_ + 1;
    const double tokens_per_s = done * per_rank_ * world_size_ * config_.block_size / elapsed;
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

  // The mean loss over the held-out batches (the same ones every time),
  // across ranks. Under no_grad: FSDP reshards after each forward.
  float HeldOutLoss() {
    at::NoGradGuard no_grad;
    EvalMode eval(*model_);
    const int64_t t = config_.block_size;
    at::Tensor sum = at::zeros({1}, at::TensorOptions().device(device_));
    for (const at::Tensor& global : eval_batches_) {
      const at::Tensor batch = global.narrow(0, rank_ * per_rank_, per_rank_).to(device_);
      sum += models::LanguageModelLoss(model_->forward(batch.narrow(1, 0, t)),
                                       batch.narrow(1, 1, t))
                 .to(at::kFloat);
    }
    at::Tensor mean = sum / static_cast<double>(eval_batches_.size());
    world_.AllReduce(mean, fsdp::ReduceOp::kAvg)->Wait();
    return mean.item<float>();
  }

  // --sample_tokens bytes generated after a held-out prompt, printed by
  // rank 0. Every rank runs the same forwards (FSDP gathers through them);
  // rank 0's draw is broadcast, so the ranks cannot drift apart.
  void PrintSample() {
    at::NoGradGuard no_grad;
    EvalMode eval(*model_);
    const int64_t t = config_.block_size;
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
      const at::Tensor logits = model_->forward(context)[0][n - 1].to(at::kCPU, at::kFloat);
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

  // Whether the weights are fit to be saved after `step`'s update: every
  // parameter and optimizer state finite, and the loss of the step's own
  // batch under the updated weights finite too (weights blown up to 1e30
  // are finite, but no step from them is). "" when fit, else what is
  // broken and where, the same on every rank. Every rank must call: each
  // runs one forward (no gradients, no dropout).
  std::string BrokenWeights(int step) {
    // The last step's checkpoint and the exports ask alike.
    if (fitness_.has_value() && fitness_->first == step) return fitness_->second;
    std::string mine;
    {
      at::NoGradGuard no_grad;
      EvalMode eval(*model_);
      const int64_t t = config_.block_size;
      const float loss = models::LanguageModelLoss(model_->forward(last_batch_.narrow(1, 0, t)),
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
    for (const auto& item : model_->named_parameters()) {
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

  // Nothing is written from weights that broke in `step`'s update, and no
  // later step can repair them: the run stops.
  [[noreturn]] void StopForBrokenWeights(int step, const std::string& broken,
                                         const std::string& not_written) {
    throw std::runtime_error(absl::StrFormat(
        "step %d: %s: %s not written, and the run stops (%sa smaller --lr may help)", step,
        broken, not_written,
        checkpoints_.has_value() ? "the checkpoints already saved are intact; " : ""));
  }

  void SaveCheckpoint(int step) {
    if (const std::string broken = BrokenWeights(step); !broken.empty()) {
      StopForBrokenWeights(step, broken, "its checkpoint was");
    }
    const std::string path = checkpoints_->PathOf(step);
    fsdp::ThrowIfError(fsdp::PrepareOutputDirectory("--checkpoint_dir", path));
    const bool dcp = absl::GetFlag(FLAGS_checkpoint_format) == "dcp";
    // A step directory an overwritten run left in the other format: its
    // marker goes first, so that the two never mix (rank 0 writes the
    // save's own marker, last).
    if (rank_ == 0) unlink((path + (dcp ? "/manifest.pb" : "/.metadata")).c_str());
    if (dcp) {
      fsdp::ThrowIfError(fsdp::SaveShardedDcpModelAndOptimizer(
          *fsdp_model_, *optimizer_, path, {}, checkpoints_->DcpTrainStateOf(step)));
    } else {
      fsdp::ThrowIfError(fsdp::SaveTrainingCheckpoint(*fsdp_model_, *optimizer_, path,
                                                      checkpoints_->MetadataOf(step)));
    }
    if (rank_ != 0) return;
    const fsdp::RunCheckpoints::Retired retired = checkpoints_->RetireOlderThan(step);
    for (const std::string& problem : retired.problems) {
      std::fprintf(stderr, "train_gpt: warning: checkpoint clean-up: %s\n", problem.c_str());
    }
    std::printf("checkpoint %s\n", path.c_str());
  }

  // --export_state_dict, --export_optim_state_dict, --export_dcp,
  // --trace_dir and --record_batches.
  void WriteOutputs() {
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
                         !absl::GetFlag(FLAGS_export_dcp).empty();
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
  }

  // The rank's memory and traffic report and the loss summary; the exit
  // code of a run that got here, 0.
  int Summarize() {
    report_.optimizer_state_bytes = LocalOptimizerStateBytes(*optimizer_);
    report_.peak_device_bytes = PeakDeviceBytes(device_);
    report_.device = device_.str();
    report_.unsharded_optimizer_state_bytes =
        report_.unsharded_param_bytes * (absl::GetFlag(FLAGS_optimizer) == "sgd" ? 1 : 2);
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
      std::printf("loss %.4f -> %.4f over steps %d..%d%s\n", first_loss_.value_or(NAN),
                  last_loss_.value_or(NAN), first_step_, steps_,
                  skipped_ > 0 ? absl::StrFormat(" (%d skipped: not finite)", skipped_).c_str()
                               : "");
    }
    return 0;
  }

  const c10::Device device_;
  fsdp::Collectives& world_;
  fsdp::HybridShardCollectives& hybrid_;
  fsdp::Collectives& fsdp_group_;
  const int rank_, world_size_;
  const bool print_;
  fsdp::TraceRecorder trace_;
  const models::GptConfig config_;
  models::Gpt model_;
  fsdp::ShardingStrategy strategy_{};
  fsdp::MixedPrecision mixed_precision_;
  std::unique_ptr<fsdp::FullyShardedModel> fsdp_model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::optional<fsdp::RunCheckpoints> checkpoints_;
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
  std::optional<float> first_loss_, last_loss_;
  int skipped_ = 0, skipped_in_a_row_ = 0;
};

// Where this rank computes and how it talks: --device and --collectives
// resolved for it. Checked once before any rank starts (ResolvePlacement
// with the host's ranks), then per rank.
struct Placement {
  c10::Device device = c10::Device(c10::kCPU);
  std::string collectives;  // gloo, nccl or staged.
};

constexpr bool kBuiltWithNccl =
#ifdef FSDP_WITH_NCCL
    true;
#else
    false;
#endif

absl::StatusOr<Placement> ResolvePlacement(int local_rank, int ranks_on_host) {
  const std::string device_flag = absl::GetFlag(FLAGS_device);
  const std::string wanted = absl::GetFlag(FLAGS_collectives);
  Placement placement;
  const bool cuda = absl::StartsWith(device_flag, "cuda");
  bool own_gpu = false;  // Every rank of this host has a GPU to itself.
  // The value's form first: a malformed one is wrong on any host.
  std::optional<int> named_index;  // cuda:N's N.
  if (cuda && device_flag != "cuda") {
    const std::string digits = device_flag.size() > 5 ? device_flag.substr(5) : "";
    int index = -1;
    if (device_flag[4] != ':' || digits.empty() ||
        !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
        !absl::SimpleAtoi(digits, &index)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--device=", fsdp::PrintableText(device_flag),
          ": must be cpu, cuda or cuda:N, N a GPU's index (0, 1, ...)"));
    }
    named_index = index;
  }
  if (device_flag != "cpu" && !cuda) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device=", fsdp::PrintableText(device_flag), ": must be cpu, cuda or cuda:N"));
  }
  if (cuda) {
    const int gpus = static_cast<int>(torch::cuda::device_count());
    if (gpus == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--device=", device_flag, ": no GPU is visible to this process, or this libtorch "
          "was built without CUDA"));
    }
    int index = named_index.value_or(local_rank % gpus);
    if (index >= gpus) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--device=", device_flag, ": not a GPU of this host (", gpus, " visible: cuda:0..",
          gpus - 1, ")"));
    }
    placement.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
    own_gpu = device_flag == "cuda" ? ranks_on_host <= gpus : ranks_on_host == 1;
    placement.collectives =
        wanted != "auto" ? wanted : (kBuiltWithNccl && own_gpu ? "nccl" : "staged");
  } else {
    placement.collectives = wanted == "auto" ? "gloo" : wanted;
  }
  const std::string& chosen = placement.collectives;
  if (chosen != "gloo" && chosen != "nccl" && chosen != "staged") {
    return absl::InvalidArgumentError(
        absl::StrCat("--collectives=", wanted, ": must be auto, gloo, nccl or staged"));
  }
  if (chosen == "gloo" && cuda) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--collectives=gloo carries host tensors only; with --device=", device_flag,
        " use staged (or nccl)"));
  }
  if (chosen == "nccl" && !cuda) {
    return absl::InvalidArgumentError("--collectives=nccl needs --device=cuda or cuda:N");
  }
  if (chosen == "nccl" && cuda && !own_gpu) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--collectives=nccl with --device=", device_flag, ": ", ranks_on_host,
        " ranks of this host would share a GPU, which NCCL refuses; use staged"));
  }
  if (chosen == "nccl" && !kBuiltWithNccl) {
    return absl::FailedPreconditionError(
        "--collectives=nccl: this build has no NCCL (the CMake build with -DFSDP_CUDA=ON has "
        "it); --collectives=staged works without");
  }
  return placement;
}

// The groups one rank trains on: the world (data split, loss) and, under
// hybrid sharding, the shard and replicate groups FSDP runs on. Under
// staged collectives, `host` holds the Gloo groups that carry them;
// declared first, they are destroyed last.
struct RankGroups {
  std::vector<std::unique_ptr<fsdp::Collectives>> host;
  std::unique_ptr<fsdp::Collectives> world;
  fsdp::HybridShardCollectives hybrid;
  std::string layout_note;
};

#ifdef FSDP_WITH_NCCL
void ConnectNccl(const fsdp::LaunchEnvironment& env, const Placement& placement,
                 fsdp::HybridShardLayout* layout, RankGroups& groups) {
  fsdp::NcclOptions nccl;
  nccl.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_collective_timeout_s));
  nccl.blocking_wait = true;  // A dead peer fails the job instead of hanging the device.
  c10::intrusive_ptr<c10d::Store> store =
      fsdp::ValueOrThrow(fsdp::ConnectRendezvousStore(env, nccl.timeout));
  nccl.group_name = "world";
  groups.world = fsdp::ValueOrThrow(fsdp::CreateNcclCollectives(
      store, env.rank, env.world_size, placement.device.index(), nccl));
  if (layout != nullptr) {
    groups.hybrid = fsdp::ValueOrThrow(fsdp::CreateHybridShardCollectives(
        env.rank, *layout, "world",
        fsdp::NcclGroupConnector(store, placement.device.index(), nccl)));
  }
}
#endif

RankGroups ConnectGroups(const fsdp::LaunchEnvironment& env, const Placement& placement,
                         bool hybrid) {
  RankGroups groups;
  auto note = [&](const fsdp::HybridShardLayout& layout) {
    groups.layout_note = absl::StrFormat(" (%d shard groups of %d ranks)",
                                         layout.num_shard_groups(), layout.shard_group_size());
  };
#ifdef FSDP_WITH_NCCL
  if (placement.collectives == "nccl") {
    std::optional<fsdp::HybridShardLayout> layout;
    if (hybrid) {
      const int size = absl::GetFlag(FLAGS_shard_group_size);
      layout = fsdp::ValueOrThrow(fsdp::HybridShardLayout::Create(
          env.world_size, size > 0 ? size : env.local_world_size));
      note(*layout);
    }
    ConnectNccl(env, placement, layout ? &*layout : nullptr, groups);
    return groups;
  }
#endif
  fsdp::GlooOptions gloo;
  gloo.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_collective_timeout_s));
  // Under the launcher's 10 s grace after a rank fails: the others must
  // finish explaining the failure before they are killed.
  gloo.fingerprints.report_timeout = std::chrono::seconds(5);
  gloo.check_collective_headers = absl::GetFlag(FLAGS_check_collective_headers);
  if (hybrid) {
    fsdp::HybridGroupsFromEnvironment made = fsdp::ValueOrThrow(
        fsdp::CreateHybridGlooCollectivesFromEnvironment(
            env, absl::GetFlag(FLAGS_shard_group_size), gloo));
    groups.world = std::move(made.world);
    groups.hybrid = std::move(made.hybrid);
    note(made.layout);
  } else {
    groups.world = fsdp::ValueOrThrow(fsdp::CreateGlooCollectivesFromEnvironment(env, gloo));
  }
  if (placement.collectives == "staged") {
    for (std::unique_ptr<fsdp::Collectives>* group :
         {&groups.world, &groups.hybrid.shard, &groups.hybrid.replicate}) {
      if (*group == nullptr) continue;
      groups.host.push_back(std::move(*group));
      *group = fsdp::CreateStagedCollectives(*groups.host.back(), placement.device);
    }
  }
  return groups;
}

int RunRank(const fsdp::LaunchEnvironment& env, fsdp::FsdpOptions options,
            const fsdp::WrapPolicy& policy, const std::vector<std::string>& notes) {
  const Placement placement =
      fsdp::ValueOrThrow(ResolvePlacement(env.local_rank, env.local_world_size));
  RankGroups groups = ConnectGroups(env, placement, fsdp::IsHybrid(options.strategy));
  options.replicate_group = groups.hybrid.replicate.get();
  if (!placement.device.is_cpu()) options.device_id = placement.device;
  try {
    return TrainingRun(options, policy, *groups.world, groups.hybrid, placement.device)
        .Run(groups.layout_note, notes);
  } catch (...) {
    // The other ranks' collective errors then quote this one's reason.
    const std::string why(fsdp::StatusFromCurrentException().message());
    std::vector<fsdp::Collectives*> all = {groups.world.get(), groups.hybrid.shard.get(),
                                           groups.hybrid.replicate.get()};
    for (const auto& host : groups.host) all.push_back(host.get());
    for (fsdp::Collectives* group : all) {
      if (group != nullptr) group->ReportStopped(why.substr(0, why.find('\n')));
    }
    throw;
  }
}

// Prints each line of `problems` as the job's refusal; the exit code 2.
int Refuse(const std::vector<std::string>& problems, const std::string& preface = "") {
  if (!preface.empty()) {
    std::fprintf(stderr, "train_gpt: %s\n", fsdp::PrintableText(preface).c_str());
  }
  for (const std::string& problem : problems) {
    for (absl::string_view line : absl::StrSplit(problem, '\n')) {
      std::fprintf(stderr, "train_gpt: %s\n", fsdp::PrintableText(line).c_str());
    }
  }
  return 2;
}

// What a job starts with, once nothing was refused.
struct JobStart {
  int world_size = 0;
  fsdp::FsdpOptions options;
  std::unique_ptr<fsdp::WrapPolicy> policy;
  std::vector<fsdp::DirectoryLock> locks;  // Held for the job's life.
  std::vector<std::string> notes;          // Rank 0 prints them.
};

// Everything that can be refused is refused here, once, before a rank
// starts (under torchrun or srun, by every rank alike): the flags, the
// paths, the output directories' owner, the checkpoint to resume and the
// settings it records. `env` is none in launcher mode. Returns the exit
// code of a refusal, else the job's start.
std::variant<int, JobStart> StartJob(const std::optional<fsdp::LaunchEnvironment>& env) {
  JobStart job;
  const bool launcher = !env.has_value();
  const bool resume = absl::GetFlag(FLAGS_resume);
  const std::optional<int> launcher_world_size =
      launcher ? std::nullopt : std::optional<int>(env->world_size);
  const auto flag_problems = [&](bool settings_pending) {
    job.world_size = launcher ? absl::GetFlag(FLAGS_world_size) : env->world_size;
    absl::StatusOr<fsdp::FsdpOptions> options = train_gpt::FsdpOptionsFromFlags();
    if (!options.ok()) return std::vector<std::string>{options.status().ToString()};
    return train_gpt::FlagProblems(options->strategy, job.world_size,
                                   launcher ? job.world_size : env->local_world_size,
                                   launcher_world_size, settings_pending);
  };
  // The options, the wrap policy (loading its plugin) and the placement,
  // once the settings are final: before anything is created for a new run,
  // after the checkpoint's settings are taken for a resumed one.
  const auto settle = [&]() -> std::optional<int> {
    absl::StatusOr<fsdp::FsdpOptions> options = train_gpt::FsdpOptionsFromFlags();
    absl::StatusOr<std::unique_ptr<fsdp::WrapPolicy>> policy = train_gpt::BuildWrapPolicy();
    for (const absl::Status& s : {options.status(), policy.status()}) {
      if (!s.ok()) return Refuse({s.ToString()});
    }
    job.options = *std::move(options);
    job.policy = *std::move(policy);
    if (absl::StatusOr<Placement> placement =
            ResolvePlacement(launcher ? 0 : env->local_rank,
                             launcher ? job.world_size : env->local_world_size);
        !placement.ok()) {
      return Refuse({std::string(placement.status().message())});
    }
    return std::nullopt;
  };
  if (std::vector<std::string> problems = flag_problems(/*settings_pending=*/resume);
      !problems.empty()) {
    return Refuse(problems);
  }
  if (!resume) {
    if (std::optional<int> refused = settle()) return *refused;
  }
  if (absl::Status ready = train_gpt::PrepareOutputs(); !ready.ok()) {
    return Refuse({std::string(ready.message())});
  }
  // The job's launcher, or its rank 0 when another launcher started it,
  // owns the output directories before anything is read or written there.
  if (launcher || env->rank == 0) {
    absl::StatusOr<std::vector<fsdp::DirectoryLock>> locks = train_gpt::LockOutputDirectories();
    if (!locks.ok()) return Refuse({std::string(locks.status().message())});
    job.locks = *std::move(locks);
  }
  if (absl::Status nothing = train_gpt::CheckExportsReplaceNothing(); !nothing.ok()) {
    return Refuse({std::string(nothing.message())});
  }
  absl::StatusOr<std::optional<fsdp::RunCheckpoints>> run =
      train_gpt::OpenCheckpoints(fsdp::NewRunId(), job.world_size);
  if (!run.ok()) return Refuse({std::string(run.status().message())});
  if (resume) {
    // --resume without a checkpoint to resume is refused by OpenCheckpoints.
    const fsdp::StepCheckpoint& from = *(*run)->resume_from();
    absl::StatusOr<std::vector<std::string>> notes =
        train_gpt::TakeSettingsFromCheckpoint(from, job.world_size, launcher_world_size);
    if (!notes.ok()) return Refuse({std::string(notes.status().message())});
    job.notes = *std::move(notes);
    if (std::vector<std::string> problems = flag_problems(/*settings_pending=*/false);
        !problems.empty()) {
      return Refuse(problems, absl::StrCat("with the settings of the checkpoint '", from.path,
                                           "' (", absl::StrJoin(job.notes, "; "), "):"));
    }
    if (std::optional<int> refused = settle()) return *refused;
  }
  return job;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_list_policies)) {
    absl::StatusOr<std::unique_ptr<fsdp::WrapPolicy>> policy = train_gpt::BuildWrapPolicy();
    for (const auto& entry : fsdp::PolicyRegistry::Global().List()) {
      std::printf("%-10s %s (%s)\n", entry.name.c_str(), entry.help.c_str(),
                  entry.origin.c_str());
    }
    if (!policy.ok()) return Refuse({policy.status().ToString()});
    return 0;
  }
  absl::StatusOr<fsdp::LaunchEnvironment> env = fsdp::ReadLaunchEnvironment();
  const bool launcher = absl::IsNotFound(env.status());
  if (!launcher && !env.ok()) return Refuse({env.status().ToString()});
  std::variant<int, JobStart> started =
      StartJob(launcher ? std::nullopt : std::optional<fsdp::LaunchEnvironment>(*env));
  if (const int* refused = std::get_if<int>(&started)) return *refused;
  JobStart& job = std::get<JobStart>(started);
  if (launcher) {
    const unsigned cores = std::thread::hardware_concurrency();
    if (cores > 0 && static_cast<unsigned>(job.world_size) > 2 * cores) {
      std::fprintf(stderr,
                   "train_gpt: warning: --world_size=%d is far above this host's %u cores: the "
                   "ranks will time-share them, slowly, and collectives may reach "
                   "--collective_timeout_s\n",
                   job.world_size, cores);
    }
    for (const std::string& note : job.notes) std::printf("note: %s\n", note.c_str());
    std::fflush(stdout);
    return fsdp::LaunchSelfAndReport(argc, argv, job.world_size,
                                     std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s)),
                                     "train_gpt");
  }
  // Under its own launcher, which printed them, rank 0 shares the
  // launcher's locks.
  const bool noted = !job.locks.empty() && job.locks.front().shared_with_parent();
  try {
    return RunRank(*env, job.options, *job.policy,
                   noted ? std::vector<std::string>() : job.notes);
  } catch (...) {
    std::fprintf(stderr, "train_gpt rank %d: %s\n", env->rank,
                 fsdp::PrintableText(fsdp::StatusFromCurrentException().message()).c_str());
    return 1;
  }
}
