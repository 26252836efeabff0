#include "optim/training_checkpoint.h"

#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "optim/optim_internal.h"
#include "statedict/sharded_checkpoint.h"

namespace fsdp {
namespace {

using optim_internal::GroupsOf;
using optim_internal::OptionsOf;
using optim_internal::ParamPlace;
using optim_internal::ParamState;
using optim_internal::Places;
using optim_internal::PlacesOf;
using optim_internal::ReadParamState;
using optim_internal::WriteOptions;
using optim_internal::WriteParamState;

// A replicated checkpoint tensor holding `value` (1-D).
CheckpointTensor Replicated(std::string name, at::Tensor value) {
  CheckpointTensor t;
  t.fqn = std::move(name);
  t.local = value.reshape({-1});
  t.shape = {t.local.numel()};
  t.dtype = t.local.scalar_type();
  t.hi = t.local.numel();
  return t;
}

// A non-tensor value as a small tensor, and back. Ints, doubles, bools and
// tuples of doubles (betas) are what libtorch's optimizers hold.
absl::StatusOr<at::Tensor> Encode(const std::string& name, const c10::IValue& v) {
  if (v.isInt()) return at::full({1}, v.toInt(), at::kLong);
  if (v.isDouble()) return at::full({1}, v.toDouble(), at::kDouble);
  if (v.isBool()) return at::full({1}, v.toBool(), at::kBool);
  if (v.isTensor()) return v.toTensor().detach().clone();
  if (v.isTuple()) {
    std::vector<double> items;
    for (const c10::IValue& item : v.toTupleRef().elements()) {
      if (!item.isDouble()) break;
      items.push_back(item.toDouble());
    }
    if (items.size() == v.toTupleRef().elements().size()) return at::tensor(items, at::kDouble);
  }
  return absl::UnimplementedError(
      absl::StrCat("optimizer value '", name, "' of type ", v.tagKind(),
                   " cannot go into a checkpoint"));
}

c10::IValue Decode(const c10::IValue& like, const at::Tensor& t) {
  if (like.isInt()) return c10::IValue(t.item<int64_t>());
  if (like.isDouble()) return c10::IValue(t.item<double>());
  if (like.isBool()) return c10::IValue(t.item<bool>());
  if (like.isTensor()) return c10::IValue(t.view(like.toTensor().sizes()));
  std::vector<c10::IValue> items;
  for (int64_t i = 0; i < t.numel(); ++i) items.emplace_back(t[i].item<double>());
  return c10::ivalue::Tuple::create(std::move(items));
}

// One optimizer state or option entry: where its checkpoint tensor comes
// from or goes to, and how to turn it back into the optimizer's value.
struct Entry {
  const ParamPlace* place = nullptr;  // Null for group options.
  size_t group = 0;
  std::string key;
  bool elementwise = false;
  c10::IValue like;   // The current value (kind and shape), for Decode.
  size_t tensor = 0;  // Index into the checkpoint tensors.
};

struct OptimizerTensors {
  std::vector<CheckpointTensor> tensors;
  std::vector<Entry> entries;
};

// The optimizer's checkpoint tensors. For saving, `local` holds the
// values; for loading (fresh = true), empty tensors to be filled.
absl::StatusOr<OptimizerTensors> OptimizerCheckpointTensors(
    torch::optim::Optimizer& optimizer, const std::vector<std::vector<const ParamPlace*>>& groups,
    bool fresh) {
  OptimizerTensors out;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].size(); ++i) {
      const ParamPlace* place = groups[g][i];
      out.tensors.push_back(Replicated(absl::StrCat("optim/group/", g, "/param/", place->fqn),
                                       at::full({1}, static_cast<int64_t>(i), at::kLong)));
      std::optional<ParamState> state =
          ReadParamState(optimizer, *place, optim_internal::StateRead::kViews);
      if (!state.has_value()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "parameter '", place->fqn, "' has no optimizer state yet; save a training "
            "checkpoint after the first optimizer step"));
      }
      for (const auto& [key, t] : state->elementwise) {
        out.entries.push_back(Entry{place, g, key, true, c10::IValue(t), out.tensors.size()});
        CheckpointTensor c;
        c.fqn = absl::StrCat("optim/state/", place->fqn, "/", key);
        c.shape = place->full_shape;
        c.dtype = t.scalar_type();
        c.sharded = place->sharded;
        c.lo = place->lo;
        c.hi = place->hi;
        c.local = fresh ? at::empty({place->hi - place->lo}, t.options()) : t.reshape({-1});
        out.tensors.push_back(std::move(c));
      }
      for (const auto& [key, v] : state->values) {
        const std::string name = absl::StrCat("optim/state/", place->fqn, "/", key);
        FSDP_ASSIGN_OR_RETURN(at::Tensor encoded, Encode(name, v));
        out.entries.push_back(Entry{place, g, key, false, v, out.tensors.size()});
        out.tensors.push_back(Replicated(name, fresh ? at::empty_like(encoded) : encoded));
      }
    }
    for (const auto& [key, v] : OptionsOf(optimizer.param_groups()[g].options())) {
      const std::string name = absl::StrCat("optim/group/", g, "/", key);
      FSDP_ASSIGN_OR_RETURN(at::Tensor encoded, Encode(name, v));
      out.entries.push_back(Entry{nullptr, g, key, false, v, out.tensors.size()});
      out.tensors.push_back(Replicated(name, fresh ? at::empty_like(encoded) : encoded));
    }
  }
  return out;
}

}  // namespace

std::set<const void*> OptimizerStateStorages(const torch::optim::Optimizer& optimizer) {
  std::set<const void*> storages;
  for (const auto& [key, state] : optimizer.state()) {
    const optim_internal::RawState raw =
        optim_internal::ReadOptimizerState(*state, optim_internal::StateRead::kViews);
    for (const auto& [name, t] : raw.tensors) {
      if (t.has_storage()) storages.insert(t.storage().unsafeGetStorageImpl());
    }
  }
  return storages;
}

absl::StatusOr<std::vector<CheckpointTensor>> TrainingCheckpointTensors(
    FullyShardedModel& model, torch::optim::Optimizer& optimizer) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("a training checkpoint"));
  const Places places = PlacesOf(model.units().front()->module(), &model);
  FSDP_ASSIGN_OR_RETURN(auto groups, GroupsOf(optimizer, places));
  FSDP_ASSIGN_OR_RETURN(OptimizerTensors optim,
                        OptimizerCheckpointTensors(optimizer, groups, false));
  std::vector<CheckpointTensor> tensors = ModelCheckpointTensors(model);
  for (CheckpointTensor& t : optim.tensors) tensors.push_back(std::move(t));
  return tensors;
}

absl::Status SaveTrainingCheckpoint(FullyShardedModel& model, torch::optim::Optimizer& optimizer,
                                    const std::string& dir, const CheckpointMetadata& metadata) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("SaveTrainingCheckpoint"));
  try {
    // A parameter without state is so on every rank (the same steps ran
    // everywhere), so returning here does not leave other ranks waiting.
    FSDP_ASSIGN_OR_RETURN(std::vector<CheckpointTensor> tensors,
                          TrainingCheckpointTensors(model, optimizer));
    return SaveModelCheckpointTensors(model, dir, tensors, metadata);
  } catch (...) {
    return StatusFromCurrentException();
  }
}

absl::Status LoadTrainingCheckpoint(FullyShardedModel& model, torch::optim::Optimizer& optimizer,
                                    const std::string& dir) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("LoadTrainingCheckpoint"));
  try {
    const Places places = PlacesOf(model.units().front()->module(), &model);
    FSDP_ASSIGN_OR_RETURN(auto groups, GroupsOf(optimizer, places));
    std::vector<const ParamPlace*> all;
    for (const auto& group : groups) all.insert(all.end(), group.begin(), group.end());
    const std::vector<optim_internal::OptimizerStateKey> created =
        optim_internal::PrimeMissingState(optimizer, groups, all);
    absl::StatusOr<OptimizerTensors> optim = OptimizerCheckpointTensors(optimizer, groups, true);
    if (!optim.ok()) {
      optim_internal::UndoPriming(optimizer, created);
      return optim.status();
    }
    std::vector<CheckpointTensor> tensors = ModelCheckpointTensors(model);
    const size_t first_optim = tensors.size();
    for (const CheckpointTensor& t : optim->tensors) tensors.push_back(t);
    absl::Status loaded = LoadCheckpointTensors(model.group(), dir, tensors, {});
    if (!loaded.ok()) {
      optim_internal::UndoPriming(optimizer, created);
      return loaded;
    }
    // Every rank read everything: write the optimizer's values.
    std::map<const ParamPlace*, ParamState> states;
    std::map<size_t, std::map<std::string, c10::IValue>> options;
    for (const Entry& e : optim->entries) {
      const at::Tensor& value = tensors[first_optim + e.tensor].local;
      if (e.place == nullptr) {
        options[e.group][e.key] = Decode(e.like, value);
      } else if (e.elementwise) {
        states[e.place].elementwise[e.key] = value;
      } else {
        states[e.place].values[e.key] = Decode(e.like, value);
      }
    }
    for (const auto& [place, state] : states) WriteParamState(optimizer, *place, state);
    for (const auto& [g, values] : options) {
      WriteOptions(optimizer.param_groups()[g].options(), values);
    }
    return absl::OkStatus();
  } catch (...) {
    return StatusFromCurrentException();
  }
}

}  // namespace fsdp
