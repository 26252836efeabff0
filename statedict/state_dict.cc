#include "statedict/state_dict.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "c10/core/GradMode.h"

namespace fsdp {
namespace {

std::mutex& SettingsMutex() {
  static std::mutex mu;
  return mu;
}

std::map<uint64_t, StateDictSettings>& Settings() {
  static auto* settings = new std::map<uint64_t, StateDictSettings>();
  return *settings;
}

// PyTorch's state_dict order: a module's own parameters, its own buffers,
// then its children's, recursively (a shared child under each of its
// names).
void CollectTensors(const torch::nn::Module& module, const std::string& prefix,
                    StateDict& out) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    out.emplace_back(prefix + item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    out.emplace_back(prefix + item.key(), item.value());
  }
  for (const auto& child : module.named_children()) {
    CollectTensors(*child.value(), prefix + child.key() + ".", out);
  }
}

StateDict NamedTensors(const torch::nn::Module& module) {
  StateDict out;
  CollectTensors(module, "", out);
  return out;
}

std::string ShapeString(at::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Checks `state` against the module's tensors (`expected`, with the shape
// and dtype each key must have) and returns, per expected key, the tensor
// to load; every problem is listed in one error.
absl::StatusOr<std::vector<at::Tensor>> MatchStateDict(
    const std::string& who, const StateDict& expected,
    const std::vector<std::vector<int64_t>>& shapes, const StateDict& state) {
  std::unordered_map<std::string, const at::Tensor*> given;
  std::vector<std::string> problems;
  for (const auto& [name, tensor] : state) {
    if (!given.emplace(name, &tensor).second) {
      problems.push_back(absl::StrCat("'", name, "' appears twice"));
    }
  }
  std::vector<at::Tensor> values(expected.size());
  std::unordered_map<const void*, size_t> first_name;  // Tied tensors: the first key.
  std::vector<std::string> missing;
  for (size_t k = 0; k < expected.size(); ++k) {
    const auto& [name, target] = expected[k];
    auto it = given.find(name);
    if (it == given.end()) {
      missing.push_back(name);
      continue;
    }
    const at::Tensor& value = *it->second;
    given.erase(it);
    if (!value.defined()) {
      problems.push_back(absl::StrCat("'", name, "' is an undefined tensor"));
      continue;
    }
    if (value.sizes() != at::IntArrayRef(shapes[k])) {
      problems.push_back(absl::StrCat("'", name, "' has shape ", ShapeString(value.sizes()),
                                      ", the model's is ", ShapeString(shapes[k])));
      continue;
    }
    if (value.scalar_type() != target.scalar_type()) {
      problems.push_back(absl::StrCat("'", name, "' has dtype ",
                                      c10::toString(value.scalar_type()), ", the model's is ",
                                      c10::toString(target.scalar_type())));
      continue;
    }
    values[k] = value;
    auto tied = first_name.emplace(target.unsafeGetTensorImpl(), k);
    if (!tied.second && values[tied.first->second].defined() &&
        !at::equal(values[tied.first->second].cpu(), value.cpu())) {
      problems.push_back(absl::StrCat("'", name, "' and '", expected[tied.first->second].first,
                                      "' are one tied tensor in the model but differ in the "
                                      "state dict"));
    }
  }
  if (!missing.empty()) {
    problems.push_back(absl::StrCat("missing keys: ", absl::StrJoin(missing, ", ")));
  }
  if (!given.empty()) {
    std::vector<std::string> unexpected;
    for (const auto& [name, tensor] : state) {
      if (given.count(name) != 0) unexpected.push_back(name);
    }
    problems.push_back(absl::StrCat("unexpected keys: ", absl::StrJoin(unexpected, ", ")));
  }
  if (!problems.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": cannot load the state dict (nothing "
                                                   "was changed): ",
                                                   absl::StrJoin(problems, "; ")));
  }
  return values;
}

// Where an original parameter lives: unit index and entry index.
struct Placement {
  FlatParamHandle* handle = nullptr;
  size_t entry = 0;
};

std::unordered_map<const void*, Placement> Placements(const FullyShardedModel& model) {
  std::unordered_map<const void*, Placement> placements;
  for (const auto& unit : model.units()) {
    FlatParamHandle* handle = unit->handle();
    if (handle == nullptr) continue;
    for (size_t i = 0; i < handle->entries().size(); ++i) {
      placements[handle->entries()[i].param.unsafeGetTensorImpl()] = {handle, i};
    }
  }
  return placements;
}

absl::Status RequireIdle(const FullyShardedModel& model, const char* what) {
  if (model.training_state() != ModelTrainingState::kIdle) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " on rank ", model.group().rank(),
                     ": the model is in forward or backward; call it between steps"));
  }
  for (const auto& unit : model.units()) {
    if (unit->handle() != nullptr && unit->handle()->training_state() != HandleTrainingState::kIdle) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, " on rank ", model.group().rank(), ": unit '",
          unit->fqn().empty() ? "<root>" : unit->fqn(), "' is in state ",
          HandleTrainingStateName(unit->handle()->training_state()),
          " (inside SummonFullParams?)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<StateDict> FullStateDict(FullyShardedModel& model, const StateDictSettings& settings,
                                        FullStateDictStats* stats) {
  FSDP_RETURN_IF_ERROR(RequireIdle(model, "FULL state dict"));
  const StateDict named = NamedTensors(model.units().front()->module());
  const std::unordered_map<const void*, Placement> placements = Placements(model);
  const bool keep = !settings.rank0_only || model.group().rank() == 0;
  std::vector<at::Tensor> values(named.size());
  std::unordered_map<const void*, at::Tensor> copies;  // Tied names share one copy.
  auto copy_of = [&](const at::Tensor& t) {
    auto it = copies.find(t.unsafeGetTensorImpl());
    if (it == copies.end()) {
      it = copies.emplace(t.unsafeGetTensorImpl(), t.detach().to(at::kCPU, /*non_blocking=*/false,
                                                                   /*copy=*/true)).first;
    }
    return it->second;
  };
  // Tensors outside every handle (buffers, ignored parameters) as they are.
  if (keep) {
    for (size_t k = 0; k < named.size(); ++k) {
      if (placements.count(named[k].second.unsafeGetTensorImpl()) == 0) {
        values[k] = copy_of(named[k].second);
      }
    }
  }
  try {
    at::NoGradGuard no_grad;
    for (const auto& unit : model.units()) {
      FlatParamHandle* handle = unit->handle();
      if (handle == nullptr) continue;
      handle->Transition(HandleTrainingState::kIdle, HandleTrainingState::kSummonFullParams);
      handle->Unshard();
      if (stats != nullptr) {
        stats->peak_full_param_bytes =
            std::max(stats->peak_full_param_bytes, model.FullParamBytes());
      }
      if (keep) {
        for (size_t k = 0; k < named.size(); ++k) {
          auto it = placements.find(named[k].second.unsafeGetTensorImpl());
          if (it != placements.end() && it->second.handle == handle) {
            values[k] = copy_of(named[k].second);
          }
        }
      }
      handle->Reshard();
      handle->Transition(HandleTrainingState::kSummonFullParams, HandleTrainingState::kIdle);
    }
  } catch (...) {
    return StatusFromCurrentException();
  }
  StateDict out;
  if (!keep) return out;
  for (size_t k = 0; k < named.size(); ++k) out.emplace_back(named[k].first, values[k]);
  return out;
}

absl::Status LoadFullStateDict(FullyShardedModel& model, const StateDict& state) {
  FSDP_RETURN_IF_ERROR(RequireIdle(model, "loading a FULL state dict"));
  const StateDict named = NamedTensors(model.units().front()->module());
  const std::unordered_map<const void*, Placement> placements = Placements(model);
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& [name, tensor] : named) {
    auto it = placements.find(tensor.unsafeGetTensorImpl());
    shapes.push_back(it == placements.end()
                         ? tensor.sizes().vec()
                         : it->second.handle->params_info()[it->second.entry].shape);
  }
  FSDP_ASSIGN_OR_RETURN(
      std::vector<at::Tensor> values,
      MatchStateDict(absl::StrCat("rank ", model.group().rank(), " of ",
                                  model.group().world_size()),
                     named, shapes, state));
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < named.size(); ++k) {
    const at::Tensor& target = named[k].second;
    auto it = placements.find(target.unsafeGetTensorImpl());
    if (it == placements.end()) {
      target.copy_(values[k]);
      continue;
    }
    const FlatParamHandle& handle = *it->second.handle;
    const FlatParamInfo& info = handle.params_info()[it->second.entry];
    at::Tensor shard = handle.LocalShardOf(it->second.entry);
    if (!handle.uses_sharded_views()) {
      shard.copy_(values[k]);
    } else if (info.shard_numel > 0) {
      shard.copy_(values[k].reshape({-1}).narrow(0, info.shard_offset, info.shard_numel));
    }
  }
  return absl::OkStatus();
}

}  // namespace

StateDictSettings GetStateDictSettings(const FullyShardedModel& model) {
  std::lock_guard<std::mutex> lock(SettingsMutex());
  auto it = Settings().find(model.id());
  return it == Settings().end() ? StateDictSettings{} : it->second;
}

void SetStateDictType(FullyShardedModel& model, const StateDictSettings& settings) {
  std::lock_guard<std::mutex> lock(SettingsMutex());
  Settings()[model.id()] = settings;
}

StateDictTypeScope::StateDictTypeScope(FullyShardedModel& model,
                                       const StateDictSettings& settings)
    : model_(model), previous_(GetStateDictSettings(model)) {
  SetStateDictType(model, settings);
}

StateDictTypeScope::~StateDictTypeScope() { SetStateDictType(model_, previous_); }

absl::StatusOr<StateDict> StateDictOf(FullyShardedModel& model, FullStateDictStats* stats) {
  const StateDictSettings settings = GetStateDictSettings(model);
  switch (settings.type) {
    case StateDictType::kFull:
      return FullStateDict(model, settings, stats);
    case StateDictType::kSharded:
    case StateDictType::kLocal:
      break;
  }
  return absl::UnimplementedError(
      "SHARDED and LOCAL state dicts are not implemented yet; use FULL");
}

absl::Status LoadStateDict(FullyShardedModel& model, const StateDict& state) {
  const StateDictSettings settings = GetStateDictSettings(model);
  if (settings.type == StateDictType::kFull) return LoadFullStateDict(model, state);
  return absl::UnimplementedError(
      "SHARDED and LOCAL state dicts are not implemented yet; use FULL");
}

StateDict ModuleStateDict(const torch::nn::Module& module) {
  StateDict out;
  std::unordered_map<const void*, at::Tensor> copies;
  for (const auto& [name, tensor] : NamedTensors(module)) {
    auto it = copies.find(tensor.unsafeGetTensorImpl());
    if (it == copies.end()) {
      it = copies.emplace(tensor.unsafeGetTensorImpl(), tensor.detach().clone()).first;
    }
    out.emplace_back(name, it->second);
  }
  return out;
}

absl::Status LoadModuleStateDict(torch::nn::Module& module, const StateDict& state) {
  const StateDict named = NamedTensors(module);
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& [name, tensor] : named) shapes.push_back(tensor.sizes().vec());
  FSDP_ASSIGN_OR_RETURN(std::vector<at::Tensor> values,
                        MatchStateDict(module.name(), named, shapes, state));
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < named.size(); ++k) named[k].second.copy_(values[k]);
  return absl::OkStatus();
}

}  // namespace fsdp
