#include "optim/optim_state.h"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "comm/collectives.h"
#include "fsdp/shard_placement.h"
#include "optim/optim_internal.h"
#include "statedict/load_check.h"
#include "torch/csrc/jit/serialization/pickle.h"
#include "torch/optim/adam.h"
#include "torch/optim/adamw.h"

namespace fsdp {
namespace {

using optim_internal::GroupsOf;
using optim_internal::OptionsOf;
using optim_internal::ParamPlace;
using optim_internal::ParamState;
using optim_internal::Places;
using optim_internal::PlacesOf;
using optim_internal::PrimeMissingState;
using optim_internal::ReadParamState;
using optim_internal::WriteOptions;
using optim_internal::WriteParamState;

// PyTorch's group option that tells Adam from AdamW (torch.optim.AdamW is
// Adam with it set): written with the options of either, checked on load.
constexpr char kDecoupledWeightDecay[] = "decoupled_weight_decay";

std::optional<bool> DecoupledWeightDecayOf(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr) return true;
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr) return false;
  return std::nullopt;
}

// --- Gathering ---------------------------------------------------------------

using LocalStates = std::unordered_map<const void*, ParamState>;  // By TensorImpl.
using FullTensors = std::unordered_map<const void*, std::map<std::string, at::Tensor>>;

// The full elementwise tensors of the parameters of a sharded unit, one
// state key at a time, each as one all-gather of a buffer laid out like the
// unit's shard: its trainable segment alone, unless a frozen parameter has
// the state too (Adagrad makes its `sum` for every parameter it is given).
// Added to `full` only when `keep`.
void GatherUnitState(const UnitShard& shard, const LocalStates& locals, bool keep,
                     FullTensors& full) {
  const FlatLayout& layout = shard.layout();
  const size_t count = layout.params().size();
  auto local_of = [&](size_t i) -> const ParamState* {
    auto it = locals.find(shard.param(i).unsafeGetTensorImpl());
    return it == locals.end() ? nullptr : &it->second;
  };
  std::map<std::string, at::TensorOptions> keys;  // Dtype and device of each state key.
  std::set<std::string> frozen_keys;  // Held by a frozen parameter too.
  for (size_t i = 0; i < count; ++i) {
    const ParamState* local = local_of(i);
    if (local == nullptr) continue;
    for (const auto& [key, t] : local->elementwise) {
      keys.emplace(key, t.options());
      if (!layout.params()[i].trainable) frozen_keys.insert(key);
    }
  }
  for (const auto& [key, options] : keys) {
    const int64_t numel = frozen_keys.count(key) != 0 ? layout.shard_numel()
                                                      : layout.trainable_shard_numel();
    at::Tensor flat = at::zeros({numel}, options);
    for (size_t i = 0; i < count; ++i) {
      const ParamState* local = local_of(i);
      if (local == nullptr || local->elementwise.count(key) == 0) continue;
      layout.ShardViewOf(flat, i).copy_(local->elementwise.at(key).reshape({-1}));
    }
    const at::Tensor gathered = shard.AllGather(flat);
    if (!keep) continue;
    for (size_t i = 0; i < count; ++i) {
      const ParamState* local = local_of(i);
      if (local == nullptr || local->elementwise.count(key) == 0) continue;
      full[shard.param(i).unsafeGetTensorImpl()][key] = layout.FullViewOf(gathered, i).clone();
    }
  }
}

// `keep`: this rank returns the result (else an empty dict, after taking
// part in the gathering); `to_cpu`: elementwise tensors in host memory.
absl::StatusOr<OptimStateDict> GatherOptimState(const torch::nn::Module& root,
                                                FullyShardedModel* model,
                                                torch::optim::Optimizer& optimizer, bool keep,
                                                bool to_cpu) {
  const Places places = PlacesOf(root, model);
  FSDP_ASSIGN_OR_RETURN(auto groups, GroupsOf(optimizer, places));
  LocalStates locals;
  std::vector<const ParamPlace*> order;
  for (const auto& group : groups) {
    for (const ParamPlace* place : group) {
      std::optional<ParamState> local = ReadParamState(optimizer, *place);
      if (!local.has_value()) continue;
      locals[place->param.unsafeGetTensorImpl()] = std::move(*local);
      order.push_back(place);
    }
  }
  FullTensors full;
  if (model != nullptr) {
    for (const auto& unit : model->units()) {
      const std::optional<UnitShard> shard = UnitShard::Of(*unit);
      if (shard.has_value() && shard->layout().sharded()) {
        GatherUnitState(*shard, locals, keep, full);
      }
    }
  }
  OptimStateDict out;
  if (!keep) return out;
  for (const ParamPlace* place : order) {
    const ParamState& local = locals.at(place->param.unsafeGetTensorImpl());
    ParamOptimState state;
    state.values = local.values;
    auto gathered = full.find(place->param.unsafeGetTensorImpl());
    for (const auto& [key, t] : local.elementwise) {
      const at::Tensor full = place->sharded ? gathered->second.at(key)
                                             : t.detach().clone().view(place->full_shape);
      state.tensors[key] = to_cpu ? full.to(at::kCPU) : full;
    }
    out.state.emplace_back(place->fqn, std::move(state));
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    ParamGroupState group;
    for (const ParamPlace* place : groups[g]) group.params.push_back(place->fqn);
    group.options = OptionsOf(optimizer.param_groups()[g].options());
    if (std::optional<bool> decoupled = DecoupledWeightDecayOf(optimizer)) {
      group.options[kDecoupledWeightDecay] = *decoupled;
    }
    out.param_groups.push_back(std::move(group));
  }
  return out;
}

// --- Loading -------------------------------------------------------------------

// Whether group `g` of `optimizer` can take `options`: every option it has
// is there, of a type it reads (tried on a copy), and Adam's and AdamW's
// weight decay is not mixed up.
void CheckGroupOptions(torch::optim::Optimizer& optimizer, size_t g,
                       const std::map<std::string, c10::IValue>& options, LoadCheck& check) {
  const torch::optim::OptimizerOptions& current = optimizer.param_groups()[g].options();
  std::vector<std::string> missing;
  for (const auto& [key, value] : OptionsOf(current)) {
    if (options.count(key) == 0) missing.push_back(key);
  }
  if (!missing.empty()) {
    check.Problem(absl::StrCat("parameter group ", g, " of the state has no ",
                               absl::StrJoin(missing, ", "),
                               ", which this optimizer has: is it another optimizer's state?"));
    return;
  }
  if (auto it = options.find(kDecoupledWeightDecay); it != options.end() && it->second.isBool()) {
    const std::optional<bool> mine = DecoupledWeightDecayOf(optimizer);
    auto decay = options.find("weight_decay");
    bool decays = false;
    if (decay != options.end()) {
      decays = decay->second.isDouble() ? decay->second.toDouble() != 0
               : decay->second.isInt()  ? decay->second.toInt() != 0
                                        : true;
    }
    if (mine.has_value() && *mine != it->second.toBool() && decays) {
      check.Problem(absl::StrCat(
          "parameter group ", g, " of the state is ", it->second.toBool() ? "AdamW's" : "Adam's",
          " (decoupled_weight_decay=", it->second.toBool() ? "True" : "False",
          "), this optimizer is ", *mine ? "AdamW" : "Adam",
          ": its weight decay would apply differently"));
    }
  }
  try {
    std::unique_ptr<torch::optim::OptimizerOptions> copy = current.clone();
    WriteOptions(*copy, options);
  } catch (const std::exception& e) {
    check.Problem(
        absl::StrCat("parameter group ", g, "'s options do not fit this optimizer: ", e.what()));
  }
}

// How a dict's elementwise tensors are laid out: the parameters' full
// shapes, or this rank's parts of them (SHARDED: 1-D, elements [lo, hi)
// of the flattened parameter; a full-shaped one is taken as whole).
enum class Layout { kFull, kRankParts };

absl::Status Load(const torch::nn::Module& root, const FullyShardedModel* model,
                  torch::optim::Optimizer& optimizer, const OptimStateDict& dict,
                  const std::string& who, Layout layout = Layout::kFull, bool apply = true) {
  const Places places = PlacesOf(root, model);
  FSDP_ASSIGN_OR_RETURN(auto groups, GroupsOf(optimizer, places));
  std::unordered_map<std::string, const ParamPlace*> by_fqn;
  for (const auto& group : groups) {
    for (const ParamPlace* place : group) by_fqn[place->fqn] = place;
  }
  LoadCheck check;
  if (dict.param_groups.size() != groups.size()) {
    // Nothing else is comparable: an index-keyed state's FQNs came from
    // the optimizer's groups.
    check.Problem(absl::StrCat("the state has ", dict.param_groups.size(),
                               " parameter groups, the optimizer ", groups.size()));
    return check.ToStatus(
        absl::StrCat(who, ": cannot load the optimizer state (nothing was changed)"));
  } else {
    for (size_t g = 0; g < groups.size(); ++g) {
      std::vector<std::string> mine;
      for (const ParamPlace* place : groups[g]) mine.push_back(place->fqn);
      if (mine != dict.param_groups[g].params) {
        check.Problem(absl::StrCat(
            "parameter group ", g, " holds [", absl::StrJoin(dict.param_groups[g].params, ", "),
            "] in the state but [", absl::StrJoin(mine, ", "), "] in the optimizer"));
      }
      CheckGroupOptions(optimizer, g, dict.param_groups[g].options, check);
    }
  }
  for (const auto& [fqn, state] : dict.state) {
    auto it = by_fqn.find(fqn);
    if (it == by_fqn.end()) {
      check.Problem(absl::StrCat("state for ", LoadCheck::Quoted(fqn),
                                 ", which is not a parameter of the optimizer"));
      continue;
    }
    const ParamPlace& place = *it->second;
    for (const auto& [key, t] : state.tensors) {
      const std::string subject =
          absl::StrCat(LoadCheck::Quoted(fqn), " state ", LoadCheck::Quoted(key));
      if (layout == Layout::kFull || t.sizes().vec() == place.full_shape) {
        check.ShapeMatches(subject, t.sizes(), place.full_shape);
      } else {
        check.ShapeMatches(absl::StrCat(subject, " (this rank's part)"), t.sizes(),
                           {place.hi - place.lo});
      }
    }
  }
  FSDP_RETURN_IF_ERROR(
      check.ToStatus(absl::StrCat(who, ": cannot load the optimizer state (nothing was changed)")));
  if (!apply) return absl::OkStatus();

  // Options first: state is made (PrimeMissingState) by a step under them
  // (libtorch's SGD keeps no momentum buffer while its momentum is 0).
  for (size_t g = 0; g < groups.size(); ++g) {
    WriteOptions(optimizer.param_groups()[g].options(), dict.param_groups[g].options);
  }
  std::vector<const ParamPlace*> wanted;
  for (const auto& [fqn, state] : dict.state) wanted.push_back(by_fqn.at(fqn));
  PrimeMissingState(optimizer, groups, wanted);

  for (const auto& [fqn, state] : dict.state) {
    const ParamPlace* place = by_fqn.at(fqn);
    ParamState local;
    for (const auto& [key, t] : state.tensors) {
      // A part, or a whole tensor to take this rank's part of (the two
      // agree where they cannot be told apart: the part is all of it).
      const bool whole = layout == Layout::kFull || t.sizes().vec() == place->full_shape;
      const at::Tensor part =
          whole ? t.reshape({-1}).narrow(0, place->lo, place->hi - place->lo) : t;
      local.elementwise[key] = part.clone().to(place->param.device());
    }
    local.values = state.values;
    WriteParamState(optimizer, *place, local);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<OptimStateDict> FullOptimStateDict(FullyShardedModel& model,
                                                  torch::optim::Optimizer& optimizer,
                                                  const FullStateDictOptions& options) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("FullOptimStateDict"));
  CollectiveLabel label(model.group(), model.replicate_group(), "", "FULL optimizer state dict");
  try {
    return GatherOptimState(model.units().front()->module(), &model, optimizer,
                            !options.rank0_only || model.group().rank() == 0,
                            options.offload_to_cpu);
  } catch (...) {
    return StatusFromCurrentException();
  }
}

absl::Status LoadFullOptimStateDict(FullyShardedModel& model, torch::optim::Optimizer& optimizer,
                                    const OptimStateDict& state) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("loading a FULL optimizer state dict"));
  CollectiveLabel label(model.group(), model.replicate_group(), "",
                        "loading a FULL optimizer state dict");
  try {
    return Load(model.units().front()->module(), &model, optimizer, state,
                absl::StrCat("rank ", model.group().rank(), " of ", model.group().world_size()));
  } catch (...) {
    return StatusFromCurrentException();
  }
}

absl::StatusOr<std::map<std::string, ParamShardPlace>> OptimizerShardPlaces(
    const FullyShardedModel& model, torch::optim::Optimizer& optimizer) {
  const Places places = PlacesOf(model.units().front()->module(), &model);
  std::map<std::string, ParamShardPlace> out;
  FSDP_ASSIGN_OR_RETURN(auto groups, GroupsOf(optimizer, places));
  for (const auto& group : groups) {
    for (const ParamPlace* place : group) {
      out[place->fqn] = ParamShardPlace{place->full_shape, place->sharded, place->lo, place->hi};
    }
  }
  return out;
}

absl::StatusOr<OptimStateDict> ShardedOptimStateDict(FullyShardedModel& model,
                                                     torch::optim::Optimizer& optimizer) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("ShardedOptimStateDict"));
  try {
    const Places places = PlacesOf(model.units().front()->module(), &model);
    FSDP_ASSIGN_OR_RETURN(auto groups, GroupsOf(optimizer, places));
    OptimStateDict out;
    for (size_t g = 0; g < groups.size(); ++g) {
      ParamGroupState group;
      for (const ParamPlace* place : groups[g]) {
        group.params.push_back(place->fqn);
        std::optional<ParamState> local =
            ReadParamState(optimizer, *place, optim_internal::StateRead::kViews);
        if (!local.has_value()) continue;
        ParamOptimState state;
        state.values = local->values;
        for (const auto& [key, t] : local->elementwise) state.tensors[key] = t.reshape({-1});
        out.state.emplace_back(place->fqn, std::move(state));
      }
      group.options = OptionsOf(optimizer.param_groups()[g].options());
      if (std::optional<bool> decoupled = DecoupledWeightDecayOf(optimizer)) {
        group.options[kDecoupledWeightDecay] = *decoupled;
      }
      out.param_groups.push_back(std::move(group));
    }
    return out;
  } catch (...) {
    return StatusFromCurrentException();
  }
}

absl::Status CheckShardedOptimStateDict(FullyShardedModel& model,
                                        torch::optim::Optimizer& optimizer,
                                        const OptimStateDict& state) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("checking a SHARDED optimizer state dict"));
  try {
    return Load(model.units().front()->module(), &model, optimizer, state,
                absl::StrCat("rank ", model.group().rank(), " of ", model.group().world_size()),
                Layout::kRankParts, /*apply=*/false);
  } catch (...) {
    return StatusFromCurrentException();
  }
}

absl::Status LoadShardedOptimStateDict(FullyShardedModel& model, torch::optim::Optimizer& optimizer,
                                       const OptimStateDict& state) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("loading a SHARDED optimizer state dict"));
  try {
    return Load(model.units().front()->module(), &model, optimizer, state,
                absl::StrCat("rank ", model.group().rank(), " of ", model.group().world_size()),
                Layout::kRankParts);
  } catch (...) {
    return StatusFromCurrentException();
  }
}

namespace {

// OptimStateDict <-> bytes, through libtorch's pickler.
std::string Serialize(const OptimStateDict& dict) {
  c10::impl::GenericList state(c10::AnyType::get());
  for (const auto& [fqn, param] : dict.state) {
    c10::impl::GenericDict tensors(c10::StringType::get(), c10::AnyType::get());
    for (const auto& [key, t] : param.tensors) tensors.insert(key, t);
    c10::impl::GenericDict values(c10::StringType::get(), c10::AnyType::get());
    for (const auto& [key, v] : param.values) values.insert(key, v);
    state.push_back(c10::ivalue::Tuple::create({fqn, tensors, values}));
  }
  c10::impl::GenericList groups(c10::AnyType::get());
  for (const ParamGroupState& group : dict.param_groups) {
    c10::impl::GenericList params(c10::StringType::get());
    for (const std::string& fqn : group.params) params.push_back(fqn);
    c10::impl::GenericDict options(c10::StringType::get(), c10::AnyType::get());
    for (const auto& [key, v] : group.options) options.insert(key, v);
    groups.push_back(c10::ivalue::Tuple::create({params, options}));
  }
  const std::vector<char> bytes =
      torch::jit::pickle_save(c10::ivalue::Tuple::create({state, groups}));
  return std::string(bytes.begin(), bytes.end());
}

OptimStateDict Deserialize(const std::string& bytes) {
  const c10::IValue root = torch::jit::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
  const auto& parts = root.toTupleRef().elements();
  OptimStateDict dict;
  for (const c10::IValue& item : parts[0].toListRef()) {
    const auto& fields = item.toTupleRef().elements();
    ParamOptimState param;
    for (const auto& e : fields[1].toGenericDict()) {
      param.tensors[e.key().toStringRef()] = e.value().toTensor();
    }
    for (const auto& e : fields[2].toGenericDict()) param.values[e.key().toStringRef()] = e.value();
    dict.state.emplace_back(fields[0].toStringRef(), std::move(param));
  }
  for (const c10::IValue& item : parts[1].toListRef()) {
    const auto& fields = item.toTupleRef().elements();
    ParamGroupState group;
    for (const c10::IValue& fqn : fields[0].toListRef()) group.params.push_back(fqn.toStringRef());
    for (const auto& e : fields[1].toGenericDict()) group.options[e.key().toStringRef()] = e.value();
    dict.param_groups.push_back(std::move(group));
  }
  return dict;
}

}  // namespace

absl::Status LoadFullOptimStateDictFromRank0(FullyShardedModel& model,
                                             torch::optim::Optimizer& optimizer,
                                             const OptimStateDict& state) {
  // Checked before the broadcast: ranks in the wrong state (all of them,
  // when they run the same program) return without communicating.
  FSDP_RETURN_IF_ERROR(model.RequireIdle("loading a FULL optimizer state dict"));
  Collectives& group = model.group();
  Collectives* replicas = model.replicate_group();
  CollectiveLabel label(group, replicas, "", "loading a FULL optimizer state dict from rank 0");
  absl::Status local;
  try {
    // Under hybrid sharding rank 0 is its shard group's rank 0 in the first
    // replica. Every rank takes part in every collective below, whatever
    // failed before it: a rank that skipped one would leave the others
    // waiting.
    const bool global_rank0 = group.rank() == 0 && (replicas == nullptr || replicas->rank() == 0);
    std::string bytes;
    if (global_rank0) {
      try {
        bytes = "P" + Serialize(state);
      } catch (...) {
        bytes = absl::StrCat("E", StatusFromCurrentException().message());
      }
    }
    BroadcastBytesFromRank0(group, replicas, bytes);
    if (bytes.empty() || bytes[0] != 'P') {
      local = absl::InvalidArgumentError(
          absl::StrCat("rank 0's optimizer state could not be broadcast: ",
                       bytes.empty() ? "" : bytes.substr(1)));
    } else {
      try {
        local = LoadFullOptimStateDict(model, optimizer,
                                       global_rank0 ? state : Deserialize(bytes.substr(1)));
      } catch (...) {
        local = StatusFromCurrentException();
      }
    }
    // Every rank learns whether every rank loaded.
    at::Tensor failed = at::full({1}, local.ok() ? 0.0 : 1.0, at::kDouble);
    group.AllReduce(failed, ReduceOp::kSum)->Wait();
    if (replicas != nullptr) replicas->AllReduce(failed, ReduceOp::kSum)->Wait();
    if (local.ok() && failed.item<double>() > 0) {
      return absl::AbortedError(absl::StrCat(
          "rank ", group.rank(), " of ", group.world_size(),
          replicas != nullptr ? absl::StrCat(" in replica ", replicas->rank()) : std::string(),
          ": another rank could not load the optimizer state from rank 0 (its error says why); "
          "this rank did, so the ranks now disagree: load again or restart"));
    }
  } catch (...) {
    return StatusFromCurrentException();
  }
  return local;
}

absl::StatusOr<OptimStateDict> ModuleOptimStateDict(const torch::nn::Module& module,
                                                    torch::optim::Optimizer& optimizer) {
  try {
    return GatherOptimState(module, nullptr, optimizer, /*keep=*/true, /*to_cpu=*/false);
  } catch (...) {
    return StatusFromCurrentException();
  }
}

absl::Status LoadModuleOptimStateDict(const torch::nn::Module& module,
                                      torch::optim::Optimizer& optimizer,
                                      const OptimStateDict& state) {
  try {
    return Load(module, nullptr, optimizer, state, module.name());
  } catch (...) {
    return StatusFromCurrentException();
  }
}

}  // namespace fsdp
