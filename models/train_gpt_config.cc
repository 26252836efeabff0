#include "models/train_gpt_config.h"

#include <algorithm>
#include <optional>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "models/train_gpt_flags.h"
#include "policies/unit_options.h"
#include "torch/cuda.h"

namespace train_gpt {
namespace {

// FSDP_WITH_NCCL: the CMake build with -DFSDP_CUDA=ON (CMakeLists.txt).
constexpr bool kBuiltWithNccl =
#ifdef FSDP_WITH_NCCL
    true;
#else
    false;
#endif

}  // namespace

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

namespace {

// --shard_collectives against the transport `collectives` resolved to and
// the strategy: whether FSDP's group is two-level.
absl::StatusOr<bool> ResolveTwoLevel(const std::string& collectives) {
  const std::string levels = absl::GetFlag(FLAGS_shard_collectives);
  if (levels != "flat" && levels != "two_level") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shard_collectives=", fsdp::PrintableText(levels), ": must be flat or two_level"));
  }
  if (levels == "flat") return false;
  if (collectives != "gloo") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shard_collectives=two_level runs over Gloo's host groups; --collectives=", collectives,
        " is not (on GPUs, NCCL's own algorithms see the hosts)"));
  }
  const std::string strategy = absl::GetFlag(FLAGS_sharding_strategy);
  // An unknown strategy is the strategy flag's error, reported with it.
  const absl::StatusOr<fsdp::ShardingStrategy> parsed = fsdp::ParseShardingStrategy(strategy);
  if (parsed.ok() && *parsed != fsdp::ShardingStrategy::kFullShard &&
      *parsed != fsdp::ShardingStrategy::kShardGradOp) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shard_collectives=two_level with --sharding_strategy=", strategy,
        ": applies to full_shard and shard_grad_op, whose all-gathers and reduce-scatters "
        "span the hosts (no_shard has none; a hybrid strategy keeps them within a host)"));
  }
  return true;
}

}  // namespace

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
  FSDP_ASSIGN_OR_RETURN(placement.two_level, ResolveTwoLevel(chosen));
  return placement;
}

}  // namespace train_gpt
