#include "optim/optim_internal.h"

#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <typeindex>
#include <typeinfo>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "fsdp/shard_placement.h"
#include "torch/optim/adam.h"
#include "torch/optim/adamw.h"
#include "torch/optim/sgd.h"

namespace fsdp::optim_internal {
namespace {

torch::serialize::InputArchive Reopen(torch::serialize::OutputArchive& out) {
  std::ostringstream bytes;
  out.save_to(bytes);
  const std::string data = bytes.str();
  torch::serialize::InputArchive in;
  in.load_from(data.data(), data.size());
  return in;
}

// ReadStateAsItsBase's types; optimizers on several threads register them.
struct StatesReadAsTheirBase {
  std::mutex mu;
  std::map<std::type_index, std::type_index> base_of;  // Guarded by mu.
};
StatesReadAsTheirBase& StatesReadAsBase() {
  static auto* types = new StatesReadAsTheirBase();
  return *types;
}

// The state of the optimizers most runs use, read as their serialize()
// writes it (undefined tensors left out) without the archive's round trip
// through bytes: that took 17 ms of every save of the benchmark GPT's AdamW
// state. Exact types only: a subclass may write more.
std::optional<RawState> ReadKnownState(const torch::optim::OptimizerParamState& state,
                                       StateRead read) {
  RawState raw;
  const auto tensor = [&](const char* key, const at::Tensor& t) {
    if (!t.defined()) return;
    raw.tensors.emplace_back(key, read == StateRead::kViews ? t.detach() : t.detach().clone());
  };
  const auto adam = [&](const auto& s) {
    raw.values.emplace_back("step", c10::IValue(s.step()));
    tensor("exp_avg", s.exp_avg());
    tensor("exp_avg_sq", s.exp_avg_sq());
    tensor("max_exp_avg_sq", s.max_exp_avg_sq());
  };
  std::type_index type = typeid(state);
  {
    StatesReadAsTheirBase& registered = StatesReadAsBase();
    std::lock_guard<std::mutex> lock(registered.mu);
    auto it = registered.base_of.find(type);
    if (it != registered.base_of.end()) type = it->second;
  }
  if (type == typeid(torch::optim::AdamWParamState)) {
    adam(static_cast<const torch::optim::AdamWParamState&>(state));
  } else if (type == typeid(torch::optim::AdamParamState)) {
    adam(static_cast<const torch::optim::AdamParamState&>(state));
  } else if (type == typeid(torch::optim::SGDParamState)) {
    tensor("momentum_buffer", static_cast<const torch::optim::SGDParamState&>(state)
                                  .momentum_buffer());
  } else {
    return std::nullopt;
  }
  return raw;
}

// A tensor goes in as one, or the reader's serialize() would not find it.
void AddValues(const std::map<std::string, c10::IValue>& values, RawState& raw) {
  for (const auto& [key, v] : values) {
    if (v.isTensor()) {
      raw.tensors.emplace_back(key, v.toTensor());
    } else {
      raw.values.emplace_back(key, v);
    }
  }
}

}  // namespace

void ReadStateAsItsBase(const std::type_info& type, const std::type_info& base) {
  StatesReadAsTheirBase& registered = StatesReadAsBase();
  std::lock_guard<std::mutex> lock(registered.mu);
  registered.base_of.emplace(type, base);
}

RawState ReadOptimizerState(const torch::optim::OptimizerParamState& state, StateRead read) {
  if (std::optional<RawState> known = ReadKnownState(state, read)) return *std::move(known);
  return ReadRaw([&](torch::serialize::OutputArchive& a) { state.serialize(a); });
}

RawState ReadRaw(const std::function<void(torch::serialize::OutputArchive&)>& serialize) {
  torch::serialize::OutputArchive out;
  serialize(out);
  torch::serialize::InputArchive in = Reopen(out);
  RawState raw;
  for (const std::string& key : in.keys()) {
    at::Tensor t;
    if (in.try_read(key, t)) {
      raw.tensors.emplace_back(key, t);
    } else {
      c10::IValue v;
      in.read(key, v);
      raw.values.emplace_back(key, v);
    }
  }
  return raw;
}

torch::serialize::InputArchive ArchiveOf(const RawState& raw) {
  torch::serialize::OutputArchive out;
  for (const auto& [key, t] : raw.tensors) out.write(key, t);
  for (const auto& [key, v] : raw.values) out.write(key, v);
  return Reopen(out);
}

namespace {

// One specialization per libtorch generation; both compile under either.
template <typename Key>
Key KeyOfImpl(c10::TensorImpl* impl);

template <>
[[maybe_unused]] std::string KeyOfImpl<std::string>(c10::TensorImpl* impl) {
  std::ostringstream out;  // What libtorch 1.x's c10::guts::to_string writes.
  out << impl;
  return out.str();
}

template <>
[[maybe_unused]] void* KeyOfImpl<void*>(c10::TensorImpl* impl) {
  return impl;
}

}  // namespace

OptimizerStateKey StateKey(const at::Tensor& param) {
  return KeyOfImpl<OptimizerStateKey>(param.unsafeGetTensorImpl());
}

std::map<std::string, c10::IValue> OptionsOf(const torch::optim::OptimizerOptions& options) {
  RawState raw = ReadRaw([&](torch::serialize::OutputArchive& a) { options.serialize(a); });
  std::map<std::string, c10::IValue> out;
  for (auto& [key, v] : raw.values) out[key] = v;
  for (auto& [key, t] : raw.tensors) out[key] = t;
  return out;
}

namespace {

// `value` as the type `like` has where they differ only in int, float and
// bool: Python writes weight_decay=0 as an int, and libtorch reads a
// double.
c10::IValue AsTypeOf(const c10::IValue& value, const c10::IValue& like) {
  if (like.isDouble() && value.isInt()) return c10::IValue(static_cast<double>(value.toInt()));
  if (like.isBool() && value.isInt()) return c10::IValue(value.toInt() != 0);
  if (like.isTuple() && value.isTuple() &&
      like.toTupleRef().elements().size() == value.toTupleRef().elements().size()) {
    std::vector<c10::IValue> items;
    for (size_t i = 0; i < like.toTupleRef().elements().size(); ++i) {
      items.push_back(AsTypeOf(value.toTupleRef().elements()[i], like.toTupleRef().elements()[i]));
    }
    return c10::IValue(c10::ivalue::Tuple::create(std::move(items)));
  }
  return value;
}

}  // namespace

void WriteOptions(torch::optim::OptimizerOptions& options,
                  const std::map<std::string, c10::IValue>& values) {
  const std::map<std::string, c10::IValue> current = OptionsOf(options);
  std::map<std::string, c10::IValue> typed;
  for (const auto& [key, value] : values) {
    auto it = current.find(key);
    typed[key] = it == current.end() ? value : AsTypeOf(value, it->second);
  }
  RawState raw;
  AddValues(typed, raw);
  torch::serialize::InputArchive in = ArchiveOf(raw);
  options.serialize(in);
}

Places PlacesOf(const torch::nn::Module& root, const FullyShardedModel* model) {
  const ShardPlacements placements =
      model != nullptr ? ShardPlacementsOf(*model) : ShardPlacements{};
  Places places;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    const void* impl = item.value().unsafeGetTensorImpl();
    if (places.count(impl) != 0) continue;  // Tied: the first name.
    const ShardPlacement p = PlacementOf(placements, item.value());
    ParamPlace place;
    place.fqn = item.key();
    place.param = item.value();
    place.full_shape = p.full_shape;
    place.sharded = p.sharded;
    place.lo = p.lo;
    place.hi = p.hi;
    places.emplace(impl, std::move(place));
  }
  return places;
}

std::optional<ParamState> ReadParamState(torch::optim::Optimizer& optimizer,
                                         const ParamPlace& place, StateRead read) {
  auto it = optimizer.state().find(StateKey(place.param));
  if (it == optimizer.state().end()) return std::nullopt;
  RawState raw = ReadOptimizerState(*it->second, read);
  ParamState state;
  for (auto& [key, t] : raw.tensors) {
    if (t.sizes() == place.param.sizes()) {
      state.elementwise.emplace(key, std::move(t));
    } else {
      state.values.emplace(key, std::move(t));
    }
  }
  for (auto& [key, v] : raw.values) state.values.emplace(key, std::move(v));
  return state;
}

void WriteParamState(torch::optim::Optimizer& optimizer, const ParamPlace& place,
                     const ParamState& state) {
  RawState raw;
  for (const auto& [key, t] : state.elementwise) {
    raw.tensors.emplace_back(key, t.view(place.param.sizes()));
  }
  AddValues(state.values, raw);
  torch::serialize::InputArchive in = ArchiveOf(raw);
  optimizer.state().at(StateKey(place.param))->serialize(in);
}

absl::StatusOr<std::vector<std::vector<const ParamPlace*>>> GroupsOf(
    const torch::optim::Optimizer& optimizer, const Places& places) {
  std::vector<std::vector<const ParamPlace*>> groups;
  std::set<const void*> seen;
  for (const auto& group : optimizer.param_groups()) {
    groups.emplace_back();
    for (const at::Tensor& p : group.params()) {
      auto it = places.find(p.unsafeGetTensorImpl());
      if (it == places.end()) {
        return absl::InvalidArgumentError(
            "the optimizer holds a tensor that is not a parameter of the model (build the "
            "optimizer over the model's parameters, after wrapping)");
      }
      if (!seen.insert(p.unsafeGetTensorImpl()).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the optimizer holds parameter '", it->second.fqn,
            "' twice (a tied weight?), so it steps it twice; build it over "
            "fsdp::UniqueParameters(model)"));
      }
      groups.back().push_back(&it->second);
    }
  }
  return groups;
}

std::vector<OptimizerStateKey> PrimeMissingState(
    torch::optim::Optimizer& optimizer, const std::vector<std::vector<const ParamPlace*>>& groups,
    const std::vector<const ParamPlace*>& wanted) {
  std::vector<const ParamPlace*> unprimed;
  for (const ParamPlace* place : wanted) {
    if (optimizer.state().count(StateKey(place->param)) == 0) unprimed.push_back(place);
  }
  std::vector<OptimizerStateKey> created;
  if (unprimed.empty()) return created;
  at::NoGradGuard no_grad;
  std::vector<std::pair<at::Tensor, at::Tensor>> saved_grads;
  for (const auto& group : groups) {
    for (const ParamPlace* place : group) {
      saved_grads.emplace_back(place->param, place->param.grad());
      place->param.mutable_grad() = at::Tensor();
    }
  }
  for (const ParamPlace* place : unprimed) {
    place->param.mutable_grad() = at::zeros_like(place->param);
    created.push_back(StateKey(place->param));
  }
  std::vector<double> lrs;
  for (auto& group : optimizer.param_groups()) {
    lrs.push_back(group.options().get_lr());
    group.options().set_lr(0.0);
  }
  optimizer.step();
  for (size_t g = 0; g < lrs.size(); ++g) optimizer.param_groups()[g].options().set_lr(lrs[g]);
  for (auto& [param, grad] : saved_grads) param.mutable_grad() = grad;
  return created;
}

void UndoPriming(torch::optim::Optimizer& optimizer,
                 const std::vector<OptimizerStateKey>& created) {
  for (const OptimizerStateKey& key : created) optimizer.state().erase(key);
}

}  // namespace fsdp::optim_internal
