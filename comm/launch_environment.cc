#include "comm/launch_environment.h"

#include <cstdlib>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace fsdp {
namespace {

constexpr int kDefaultMasterPort = 29500;

// Reads an integer variable; `required` decides whether absence is an error.
absl::StatusOr<std::optional<int>> ReadInt(const EnvLookup& lookup,
                                           const std::string& name, bool required,
                                           const std::string& source) {
  std::optional<std::string> text = lookup(name);
  if (!text.has_value()) {
    if (!required) return std::optional<int>();
    return absl::InvalidArgumentError(
        absl::StrCat(source, " launch environment: ", name, " is not set"));
  }
  int value = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &value)) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, " launch environment: ", name, "='", *text, "' is not an integer"));
  }
  return std::optional<int>(value);
}

absl::Status CheckRanks(const LaunchEnvironment& env, const std::string& rank_var,
                        const std::string& world_var, const std::string& local_var,
                        const std::string& local_world_var) {
  const std::string& src = env.source;
  if (env.world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(src, " launch environment: ", world_var,
                                                   "=", env.world_size, " must be >= 1"));
  }
  if (env.rank < 0 || env.rank >= env.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(src, " launch environment: ", rank_var, "=", env.rank,
                     " is not in [0, ", world_var, "=", env.world_size, ")"));
  }
  if (env.local_world_size < 1 || env.local_world_size > env.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        src, " launch environment: ", local_world_var, "=", env.local_world_size,
        " is not in [1, ", world_var, "=", env.world_size, "]"));
  }
  if (env.local_rank < 0 || env.local_rank >= env.local_world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(src, " launch environment: ", local_var, "=", env.local_rank,
                     " is not in [0, ", local_world_var, "=", env.local_world_size, ")"));
  }
  if (env.master_port < 1 || env.master_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        src, " launch environment: MASTER_PORT=", env.master_port, " is not a TCP port"));
  }
  if (env.master_addr.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(src, " launch environment: MASTER_ADDR is empty"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LaunchEnvironment> ReadTorchrun(const EnvLookup& lookup) {
  LaunchEnvironment env;
  env.source = "torchrun";
  const std::string& src = env.source;
  FSDP_ASSIGN_OR_RETURN(auto rank, ReadInt(lookup, "RANK", true, src));
  FSDP_ASSIGN_OR_RETURN(auto world, ReadInt(lookup, "WORLD_SIZE", true, src));
  FSDP_ASSIGN_OR_RETURN(auto local_rank, ReadInt(lookup, "LOCAL_RANK", false, src));
  FSDP_ASSIGN_OR_RETURN(auto local_world, ReadInt(lookup, "LOCAL_WORLD_SIZE", false, src));
  FSDP_ASSIGN_OR_RETURN(auto port, ReadInt(lookup, "MASTER_PORT", true, src));
  std::optional<std::string> addr = lookup("MASTER_ADDR");
  if (!addr.has_value()) {
    return absl::InvalidArgumentError("torchrun launch environment: MASTER_ADDR is not set");
  }
  env.rank = *rank;
  env.world_size = *world;
  // Without LOCAL_* (torch.distributed.launch without --use_env, hand-made
  // environments), assume a single node.
  env.local_rank = local_rank.value_or(*rank);
  env.local_world_size = local_world.value_or(*world);
  env.master_addr = *addr;
  env.master_port = *port;
  std::optional<std::string> agent_store = lookup("TORCHELASTIC_USE_AGENT_STORE");
  env.store_hosted_by_launcher =
      agent_store.has_value() && absl::AsciiStrToLower(*agent_store) == "true";
  FSDP_ASSIGN_OR_RETURN(auto restarts, ReadInt(lookup, "TORCHELASTIC_RESTART_COUNT", false, src));
  if (restarts.value_or(0) < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "torchrun launch environment: TORCHELASTIC_RESTART_COUNT=", *restarts, " is negative"));
  }
  env.restart_count = restarts.value_or(0);
  FSDP_RETURN_IF_ERROR(
      CheckRanks(env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"));
  return env;
}

absl::StatusOr<LaunchEnvironment> ReadSlurm(const EnvLookup& lookup) {
  LaunchEnvironment env;
  env.source = "slurm";
  const std::string& src = env.source;
  FSDP_ASSIGN_OR_RETURN(auto rank, ReadInt(lookup, "SLURM_PROCID", true, src));
  FSDP_ASSIGN_OR_RETURN(auto world, ReadInt(lookup, "SLURM_NTASKS", true, src));
  FSDP_ASSIGN_OR_RETURN(auto local_rank, ReadInt(lookup, "SLURM_LOCALID", true, src));
  env.rank = *rank;
  env.world_size = *world;
  env.local_rank = *local_rank;

  FSDP_ASSIGN_OR_RETURN(auto per_node,
                        ReadInt(lookup, "SLURM_NTASKS_PER_NODE", false, src));
  if (per_node.has_value()) {
    env.local_world_size = *per_node;
  } else if (std::optional<std::string> tasks = lookup("SLURM_TASKS_PER_NODE")) {
    absl::StatusOr<int> first = FirstCountOfSlurmTasksPerNode(*tasks);
    if (!first.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("slurm launch environment: SLURM_TASKS_PER_NODE: ",
                       first.status().message()));
    }
    env.local_world_size = *first;
  } else {
    return absl::InvalidArgumentError(
        "slurm launch environment: neither SLURM_NTASKS_PER_NODE nor "
        "SLURM_TASKS_PER_NODE is set");
  }

  if (std::optional<std::string> addr = lookup("MASTER_ADDR")) {
    env.master_addr = *addr;
  } else {
    std::optional<std::string> nodelist = lookup("SLURM_JOB_NODELIST");
    if (!nodelist.has_value()) nodelist = lookup("SLURM_NODELIST");
    if (!nodelist.has_value()) {
      return absl::InvalidArgumentError(
          "slurm launch environment: MASTER_ADDR is not set and there is no "
          "SLURM_JOB_NODELIST to take the first host from");
    }
    absl::StatusOr<std::string> host = FirstHostOfSlurmNodeList(*nodelist);
    if (!host.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "slurm launch environment: SLURM_JOB_NODELIST: ", host.status().message()));
    }
    env.master_addr = *host;
  }
  FSDP_ASSIGN_OR_RETURN(auto port, ReadInt(lookup, "MASTER_PORT", false, src));
  env.master_port = port.value_or(kDefaultMasterPort);
  FSDP_RETURN_IF_ERROR(CheckRanks(env, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                                  "SLURM_NTASKS_PER_NODE"));
  return env;
}

}  // namespace

std::optional<std::string> ProcessEnv(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

absl::StatusOr<std::string> FirstHostOfSlurmNodeList(const std::string& nodelist) {
  const std::string list(absl::StripAsciiWhitespace(nodelist));
  if (list.empty()) return absl::InvalidArgumentError("empty host list");
  // The first entry ends at the first comma outside brackets.
  size_t end = 0;
  int depth = 0;
  for (; end < list.size(); ++end) {
    if (list[end] == '[') ++depth;
    if (list[end] == ']') --depth;
    if (depth < 0) break;
    if (list[end] == ',' && depth == 0) break;
  }
  if (depth != 0) {
    return absl::InvalidArgumentError(absl::StrCat("unbalanced brackets in '", list, "'"));
  }
  const std::string first = list.substr(0, end);
  const size_t open = first.find('[');
  if (open == std::string::npos) return first;
  const size_t close = first.find(']', open);
  if (close == std::string::npos || open == 0) {
    return absl::InvalidArgumentError(absl::StrCat("malformed host entry '", first, "'"));
  }
  // "node[07-09,12]suffix": the first range's low end, zero padding kept.
  std::string range = first.substr(open + 1, close - open - 1);
  const size_t stop = range.find_first_of(",-");
  const std::string low = range.substr(0, stop);
  if (low.empty() || low.find_first_not_of("0123456789") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("malformed host range '[", range, "]'"));
  }
  return first.substr(0, open) + low + first.substr(close + 1);
}

absl::StatusOr<int> FirstCountOfSlurmTasksPerNode(const std::string& value) {
  const std::string text(absl::StripAsciiWhitespace(value));
  const size_t stop = text.find_first_of("(,");
  int count = 0;
  if (!absl::SimpleAtoi(text.substr(0, stop), &count) || count < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", value, "' does not start with a task count"));
  }
  return count;
}

absl::StatusOr<LaunchEnvironment> ReadLaunchEnvironment(const EnvLookup& lookup) {
  if (lookup("RANK").has_value() || lookup("WORLD_SIZE").has_value()) {
    return ReadTorchrun(lookup);
  }
  if (lookup("SLURM_PROCID").has_value()) return ReadSlurm(lookup);
  return absl::NotFoundError(
      "no launch environment: set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
      "(torchrun-style) or run under srun (SLURM_PROCID, SLURM_NTASKS, ...)");
}

}  // namespace fsdp
