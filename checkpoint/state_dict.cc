// GetModelStateDict, SetModelStateDict, GetOptimizerStateDict and
// SetOptimizerStateDict (checkpoint/checkpoint.h): StateDictOptions mapped
// onto the FULL state dicts of statedict/state_dict.h and
// optim/optim_state.h.
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "base/fnv1a.h"
#include "base/status.h"
#include "checkpoint/agree.h"
#include "checkpoint/checkpoint.h"
#include "comm/collectives.h"
#include "optim/optim_state.h"
#include "statedict/state_dict.h"
#include "torch/csrc/jit/serialization/pickle.h"

namespace fsdp {
namespace {

using checkpoint_internal::AgreeAcrossRanks;
using checkpoint_internal::AgreeAfterLoad;

const torch::nn::Module& RootModule(const FullyShardedModel& model) {
  return model.units().front()->module();
}

// The names of the parameters that do not require grad.
std::set<std::string> FrozenParameterNames(const FullyShardedModel& model) {
  std::set<std::string> frozen;
  for (const auto& item : RootModule(model).named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) frozen.insert(item.key());
  }
  return frozen;
}

std::set<std::string> ModelEntryNames(const FullyShardedModel& model) {
  std::set<std::string> names;
  for (const auto& item : RootModule(model).named_parameters(/*recurse=*/true)) {
    names.insert(item.key());
  }
  for (const auto& item : RootModule(model).named_buffers(/*recurse=*/true)) {
    names.insert(item.key());
  }
  return names;
}

// Rank 0's state dict on every rank of the job, in its order; or rank 0's
// error in making it transportable, on every rank. Every rank takes part in
// every broadcast, whatever it carries.
absl::StatusOr<StateDict> BroadcastFromRank0(FullyShardedModel& model, const StateDict& state) {
  Collectives* replicas = model.replicate_group();
  const bool rank0 = model.group().rank() == 0 && (replicas == nullptr || replicas->rank() == 0);
  std::string bytes;
  if (rank0) {
    try {
      c10::impl::GenericList entries(c10::AnyType::get());
      for (const auto& [name, tensor] : state) {
        entries.push_back(c10::ivalue::Tuple::create(
            {c10::IValue(name), c10::IValue(tensor.detach().to(at::kCPU).contiguous())}));
      }
      const std::vector<char> pickled = torch::jit::pickle_save(c10::IValue(entries));
      bytes = "P";
      bytes.append(pickled.begin(), pickled.end());
    } catch (...) {
      bytes = absl::StrCat("E", StatusFromCurrentException().message());
    }
  }
  BroadcastBytesFromRank0(model.group(), replicas, bytes);
  if (bytes.empty() || bytes[0] != 'P') {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank 0's state dict could not be broadcast: ", bytes.empty() ? "" : bytes.substr(1)));
  }
  if (rank0) return state;
  const c10::IValue root = torch::jit::pickle_load(std::vector<char>(bytes.begin() + 1, bytes.end()));
  StateDict received;
  for (const c10::IValue& entry : root.toListRef()) {
    const auto& parts = entry.toTupleRef().elements();
    received.emplace_back(parts[0].toStringRef(), parts[1].toTensor());
  }
  return received;
}

// What identifies a state dict's entries: names, shapes and dtypes.
std::string Digest(const StateDict& state) {
  std::string text;
  for (const auto& [name, tensor] : state) {
    absl::StrAppend(&text, name, ":", tensor.defined() ? tensor.sizes().vec().size() : -1);
    if (tensor.defined()) {
      for (int64_t size : tensor.sizes()) absl::StrAppend(&text, ",", size);
      absl::StrAppend(&text, ",", static_cast<int>(tensor.scalar_type()));
    }
    text += ';';
  }
  return absl::StrCat(state.size(), " entries, ", Fnv1aString(kFnv1aOffsetBasis, text));
}

// Every rank holds a dict with the same entries (a load from rank 0's alone
// needs broadcast_from_rank0); else every rank fails, before any change.
absl::Status CheckSameEntries(FullyShardedModel& model, const StateDict& state) {
  const std::string mine = Digest(state);
  std::vector<std::string> all = AllGatherBytes(model.group(), mine);
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r] != mine) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the ranks passed different state dicts (rank ", model.group().rank(), ": ", mine,
          "; rank ", r, ": ", all[r], "); pass the same dict on every rank, or rank 0's alone "
          "with StateDictOptions::broadcast_from_rank0"));
    }
  }
  return absl::OkStatus();
}

// What the load may leave out or ignore under `options`.
LoadFullStateDictOptions LoadOptionsOf(const FullyShardedModel& model,
                                       const StateDictOptions& options) {
  LoadFullStateDictOptions load;
  load.ignore_unexpected = !options.strict;
  if (!options.strict) {
    load.may_be_missing = ModelEntryNames(model);
  } else if (options.ignore_frozen_params) {
    load.may_be_missing = FrozenParameterNames(model);
  }
  return load;
}

}  // namespace

absl::StatusOr<StateDict> GetModelStateDict(FullyShardedModel& model,
                                            const StateDictOptions& options) {
  FullStateDictOptions full;
  full.rank0_only = options.cpu_offload;
  full.offload_to_cpu = options.cpu_offload;
  FSDP_ASSIGN_OR_RETURN(StateDict state, FullStateDict(model, full));
  if (!options.ignore_frozen_params) return state;
  const std::set<std::string> frozen = FrozenParameterNames(model);
  StateDict trainable;
  for (auto& entry : state) {
    if (frozen.count(entry.first) == 0) trainable.push_back(std::move(entry));
  }
  return trainable;
}

absl::Status SetModelStateDict(FullyShardedModel& model, const StateDict& state,
                               const StateDictOptions& options) {
  // Checked before communicating: ranks in the wrong state (all of them,
  // when they run the same program) return without a collective.
  FSDP_RETURN_IF_ERROR(model.RequireIdle("loading a model state dict"));
  CollectiveLabel label(model.group(), model.replicate_group(), "", "loading a model state dict");
  absl::Status local;
  try {
    absl::StatusOr<StateDict> given = state;
    if (options.broadcast_from_rank0) {
      given = BroadcastFromRank0(model, state);
    } else {
      FSDP_RETURN_IF_ERROR(AgreeAcrossRanks(model, CheckSameEntries(model, state)));
    }
    local = given.ok() ? LoadFullStateDict(model, *given, LoadOptionsOf(model, options))
                       : given.status();
  } catch (...) {
    local = StatusFromCurrentException();
  }
  return AgreeAfterLoad(model, local, "model state dict");
}

absl::StatusOr<OptimStateDict> GetOptimizerStateDict(FullyShardedModel& model,
                                                     torch::optim::Optimizer& optimizer,
                                                     const StateDictOptions& options) {
  FullStateDictOptions full;
  full.rank0_only = options.cpu_offload;
  full.offload_to_cpu = options.cpu_offload;
  return FullOptimStateDict(model, optimizer, full);
}

absl::Status SetOptimizerStateDict(FullyShardedModel& model, torch::optim::Optimizer& optimizer,
                                   const OptimStateDict& state,
                                   const StateDictOptions& options) {
  if (options.broadcast_from_rank0) {
    return LoadFullOptimStateDictFromRank0(model, optimizer, state);
  }
  FSDP_RETURN_IF_ERROR(model.RequireIdle("loading an optimizer state dict"));
  absl::Status local;
  try {
    local = LoadFullOptimStateDict(model, optimizer, state);
  } catch (...) {
    local = StatusFromCurrentException();
  }
  return AgreeAfterLoad(model, local, "optimizer state");
}

}  // namespace fsdp
