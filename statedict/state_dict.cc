#include "statedict/state_dict.h"

#include <algorithm>
#include <map>
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
#include "c10/core/GradMode.h"
#include "comm/collectives.h"
#include "fsdp/shard_placement.h"
#include "fsdp/utilities.h"
#include "statedict/load_check.h"
#include "statedict/model_tensors.h"

namespace fsdp {
namespace {

using statedict_internal::NamedTensors;

// Checks `state` against the module's tensors (`expected`, with the shape
// and dtype each key must have), adding every problem to `check`, and
// returns per expected key the tensor to load (undefined where a problem,
// or an allowed absence, leaves none). FULL, LOCAL and plain-module loads
// all check their keys here (LOCAL compares each unit's layout first).
std::vector<at::Tensor> MatchStateDict(LoadCheck& check, const StateDict& expected,
                                       const std::vector<std::vector<int64_t>>& shapes,
                                       const StateDict& state,
                                       const LoadFullStateDictOptions& options = {}) {
  std::unordered_map<std::string, const at::Tensor*> given;
  for (const auto& [name, tensor] : state) {
    if (!given.emplace(name, &tensor).second) {
      check.Problem(absl::StrCat(LoadCheck::Quoted(name), " appears twice"));
    }
  }
  std::vector<at::Tensor> values(expected.size());
  std::unordered_map<const void*, size_t> first_name;  // Tied tensors: the first key.
  for (size_t k = 0; k < expected.size(); ++k) {
    const auto& [name, target] = expected[k];
    auto it = given.find(name);
    if (it == given.end()) {
      // An entry that may be missing keeps its value (values[k] undefined).
      if (options.may_be_missing.count(name) == 0) check.Missing(name);
      continue;
    }
    const at::Tensor& value = *it->second;
    given.erase(it);
    const std::string subject = LoadCheck::Quoted(name);
    if (!value.defined()) {
      check.Problem(absl::StrCat(subject, " is an undefined tensor"));
      continue;
    }
    if (!check.ShapeMatches(subject, value.sizes(), shapes[k]) ||
        !check.DtypeMatches(subject, value.scalar_type(), target.scalar_type())) {
      continue;
    }
    values[k] = value;
    auto tied = first_name.emplace(target.unsafeGetTensorImpl(), k);
    if (!tied.second && values[tied.first->second].defined() &&
        !at::equal(values[tied.first->second].cpu(), value.cpu())) {
      check.Problem(absl::StrCat(subject, " and ",
                                 LoadCheck::Quoted(expected[tied.first->second].first),
                                 " are one tied tensor in the model but differ in the state "
                                 "dict"));
    }
  }
  for (const auto& [name, tensor] : state) {
    if (given.count(name) != 0 && !options.ignore_unexpected) check.NotInModel(name);
  }
  return values;
}

absl::Status CannotLoad(const LoadCheck& check, const std::string& who, const char* what) {
  return check.ToStatus(absl::StrCat(who, ": cannot load the ", what, " (nothing was changed)"));
}

// LOCAL: per unit, "<unit>.flat_param" (this rank's shard as it is) and
// "<unit>.flat_param_layout" (what the shard's layout depends on); buffers
// and ignored parameters under their own names.
std::string LocalKey(const FsdpUnit& unit) {
  return unit.fqn().empty() ? "flat_param" : unit.fqn() + ".flat_param";
}

at::Tensor LocalLayout(const FullyShardedModel& model, const UnitShard& shard) {
  std::vector<int64_t> layout = {model.group().world_size(),
                                 model.group().rank(),
                                 static_cast<int64_t>(shard.strategy()),
                                 shard.layout().flat_numel(),
                                 shard.layout().padded_numel(),
                                 static_cast<int64_t>(shard.layout().params().size())};
  for (const FlatParamInfo& info : shard.layout().params()) layout.push_back(info.numel);
  // A unit mixing frozen and trainable parameters lays them out in two
  // segments, trainable first: which parameter is which joins the layout
  // (only then, so that other units' layouts stay as they were).
  if (shard.layout().trainable_numel() != 0 &&
      shard.layout().trainable_numel() != shard.layout().flat_numel()) {
    for (const FlatParamInfo& info : shard.layout().params()) layout.push_back(info.trainable);
  }
  return at::tensor(layout, at::kLong);
}

std::string DescribeLayout(const at::Tensor& layout) {
  if (layout.dim() != 1 || layout.numel() < 6 || layout.scalar_type() != at::kLong) {
    return "an unreadable layout";
  }
  const int64_t* v = layout.data_ptr<int64_t>();
  std::string trainable;  // Which parameters train, for a mixed unit.
  if (v[5] >= 0 && layout.numel() == 6 + 2 * v[5]) {
    std::vector<int64_t> indices;
    for (int64_t i = 0; i < v[5]; ++i) {
      if (v[6 + v[5] + i] != 0) indices.push_back(i);
    }
    trainable = absl::StrCat(" (trainable: parameters ", absl::StrJoin(indices, ", "), ")");
  }
  return absl::StrCat("rank ", v[1], " of ", v[0], ", ",
                      ShardingStrategyName(static_cast<ShardingStrategy>(v[2])), ", ", v[5],
                      " parameters of ", v[3], " elements", trainable);
}

}  // namespace

namespace {

// Per state_dict index, the unit whose gathering makes it full (-1: none
// needs to, a tensor no unit holds).
std::vector<int> UnitOfEachTensor(const StateDict& named, const ShardPlacements& placements) {
  std::vector<int> units;
  for (const auto& [name, tensor] : named) {
    auto it = placements.find(tensor.unsafeGetTensorImpl());
    units.push_back(it == placements.end() ? -1 : it->second.unit);
  }
  return units;
}

// Tensors no unit holds first, then each unit's, state_dict order within.
std::vector<size_t> VisitOrder(const std::vector<int>& units) {
  std::vector<size_t> order(units.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return units[a] < units[b]; });
  return order;
}

}  // namespace

std::vector<size_t> FullStateDictVisitOrder(const FullyShardedModel& model) {
  return VisitOrder(UnitOfEachTensor(NamedTensors(model.units().front()->module()),
                                     ShardPlacementsOf(model)));
}

absl::Status VisitFullStateDict(FullyShardedModel& model, const FullStateDictOptions& options,
                                const FullTensorVisitor& visit, FullStateDictStats* stats) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("FULL state dict"));
  CollectiveLabel label(model.group(), model.replicate_group(), "", "FULL state dict");
  const StateDict named = NamedTensors(model.units().front()->module());
  const std::vector<int> units = UnitOfEachTensor(named, ShardPlacementsOf(model));
  const bool keep = !options.rank0_only || model.group().rank() == 0;
  // The first failed visit's error; the gathering goes on without visits
  // (a visit that throws counts as failed), so that this rank still takes
  // part in every unit's collectives.
  absl::Status visited;
  auto visit_one = [&](size_t k) {
    if (!keep || !visited.ok()) return;
    try {
      const at::Tensor& t = named[k].second;
      // Buffers that buffer_dtype cast, in their original dtype.
      auto dtype = units[k] < 0 ? model.BufferFullPrecisionDtype(t) : std::nullopt;
      visited = visit(k, dtype ? t.detach().to(*dtype) : t.detach());
    } catch (...) {
      visited = StatusFromCurrentException();
    }
  };
  const std::vector<size_t> order = VisitOrder(units);
  try {
    at::NoGradGuard no_grad;
    SummonOptions one_unit;  // Never more than one unit's full parameters at once.
    one_unit.writeback = false;
    one_unit.recurse = false;
    for (size_t i = 0; i < order.size();) {
      const int u = units[order[i]];
      std::optional<SummonFullParams> full;
      if (u >= 0) {
        full.emplace(model, model.units()[u]->module(), one_unit);
        if (stats != nullptr) {
          stats->peak_full_param_bytes =
              std::max(stats->peak_full_param_bytes, model.FullParamBytes());
        }
      }
      for (; i < order.size() && units[order[i]] == u; ++i) visit_one(order[i]);
    }
  } catch (...) {
    return StatusFromCurrentException();
  }
  return visited;
}

absl::StatusOr<StateDict> FullStateDict(FullyShardedModel& model,
                                        const FullStateDictOptions& options,
                                        FullStateDictStats* stats) {
  const StateDict named = NamedTensors(model.units().front()->module());
  std::vector<at::Tensor> values(named.size());
  std::unordered_map<const void*, at::Tensor> copies;  // Tied names share one copy.
  FSDP_RETURN_IF_ERROR(VisitFullStateDict(
      model, options,
      [&](size_t k, const at::Tensor& value) {
        const void* impl = named[k].second.unsafeGetTensorImpl();
        auto it = copies.find(impl);
        if (it == copies.end()) {
          const c10::Device to = options.offload_to_cpu ? c10::Device(at::kCPU) : value.device();
          it = copies.emplace(impl, value.to(to, /*non_blocking=*/false, /*copy=*/true)).first;
        }
        values[k] = it->second;
        return absl::OkStatus();
      },
      stats));
  StateDict out;
  if (options.rank0_only && model.group().rank() != 0) return out;
  for (size_t k = 0; k < named.size(); ++k) out.emplace_back(named[k].first, values[k]);
  return out;
}

absl::Status LoadFullStateDict(FullyShardedModel& model, const StateDict& state,
                               const LoadFullStateDictOptions& options) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("loading a FULL state dict"));
  CollectiveLabel label(model.group(), model.replicate_group(), "", "loading a FULL state dict");
  const StateDict named = NamedTensors(model.units().front()->module());
  const ShardPlacements placements = ShardPlacementsOf(model);
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& [name, tensor] : named) {
    shapes.push_back(PlacementOf(placements, tensor).full_shape);
  }
  LoadCheck check;
  const std::vector<at::Tensor> values = MatchStateDict(check, named, shapes, state, options);
  FSDP_RETURN_IF_ERROR(CannotLoad(
      check, absl::StrCat("rank ", model.group().rank(), " of ", model.group().world_size()),
      "state dict"));
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < named.size(); ++k) {
    if (!values[k].defined()) continue;  // Missing, as options allow: kept.
    const at::Tensor& target = named[k].second;
    const ShardPlacement p = PlacementOf(placements, target);
    if (p.unit < 0) {
      target.copy_(values[k]);  // Whole, and possibly not contiguous.
    } else if (p.hi > p.lo) {
      p.local.copy_(values[k].reshape({-1}).narrow(0, p.lo, p.hi - p.lo));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<StateDict> LocalStateDict(const FullyShardedModel& model) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("LOCAL state dict"));
  StateDict out;
  for (const auto& unit : model.units()) {
    const std::optional<UnitShard> shard = UnitShard::Of(*unit);
    if (!shard.has_value()) continue;
    out.emplace_back(LocalKey(*unit), shard->local().detach().clone());
    out.emplace_back(LocalKey(*unit) + "_layout", LocalLayout(model, *shard));
  }
  const ShardPlacements placements = ShardPlacementsOf(model);
  for (const auto& [name, tensor] : NamedTensors(model.units().front()->module())) {
    if (placements.count(tensor.unsafeGetTensorImpl()) == 0) {
      out.emplace_back(name, tensor.detach().clone());
    }
  }
  return out;
}

absl::Status LoadLocalStateDict(FullyShardedModel& model, const StateDict& state) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("loading a LOCAL state dict"));
  LoadCheck check;
  // A unit saved in another layout is reported once, by its layout, rather
  // than as a shard of the wrong shape: both its keys leave the key check.
  std::set<std::string> other_layout;
  StateDict expected;  // Each unit's shard and layout, then buffers and ignored parameters.
  std::vector<std::vector<int64_t>> shapes;
  std::vector<bool> is_layout;  // Compared, never copied.
  for (const auto& unit : model.units()) {
    const std::optional<UnitShard> shard = UnitShard::Of(*unit);
    if (!shard.has_value()) continue;
    const std::string key = LocalKey(*unit);
    const at::Tensor mine = LocalLayout(model, *shard);
    auto saved = std::find_if(state.begin(), state.end(),
                              [&](const auto& entry) { return entry.first == key + "_layout"; });
    if (saved != state.end()) {
      const at::Tensor& theirs = saved->second;
      if (!theirs.defined() || theirs.scalar_type() != at::kLong || !at::equal(theirs, mine)) {
        check.Problem(absl::StrCat(
            LoadCheck::Quoted(key), " was saved as ",
            theirs.defined() ? DescribeLayout(theirs) : std::string("nothing"),
            ", but here it is ", DescribeLayout(mine),
            "; a LOCAL state dict loads only into the same layout (use FULL or a SHARDED "
            "checkpoint to change the world size or wrapping)"));
        other_layout.insert({key, key + "_layout"});
        continue;
      }
    }
    expected.emplace_back(key, shard->local());
    shapes.push_back(shard->local().sizes().vec());
    is_layout.push_back(false);
    expected.emplace_back(key + "_layout", mine);
    shapes.push_back(mine.sizes().vec());
    is_layout.push_back(true);
  }
  const ShardPlacements placements = ShardPlacementsOf(model);
  for (const auto& [name, tensor] : NamedTensors(model.units().front()->module())) {
    if (placements.count(tensor.unsafeGetTensorImpl()) != 0) continue;
    expected.emplace_back(name, tensor);
    shapes.push_back(tensor.sizes().vec());
    is_layout.push_back(false);
  }
  StateDict checked;
  for (const auto& entry : state) {
    if (other_layout.count(entry.first) == 0) checked.push_back(entry);
  }
  const std::vector<at::Tensor> values = MatchStateDict(check, expected, shapes, checked);
  FSDP_RETURN_IF_ERROR(CannotLoad(
      check, absl::StrCat("rank ", model.group().rank(), " of ", model.group().world_size()),
      "LOCAL state dict"));
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < expected.size(); ++k) {
    if (!is_layout[k]) expected[k].second.copy_(values[k]);
  }
  return absl::OkStatus();
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
  LoadCheck check;
  const std::vector<at::Tensor> values = MatchStateDict(check, named, shapes, state);
  FSDP_RETURN_IF_ERROR(CannotLoad(check, module.name(), "state dict"));
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < named.size(); ++k) named[k].second.copy_(values[k]);
  return absl::OkStatus();
}

}  // namespace fsdp
