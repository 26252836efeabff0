#include "optim/torch_optim_file.h"

#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ATen/core/Dict.h"
#include "ATen/core/List.h"
#include "ATen/core/ivalue.h"
#include "ATen/ops/scalar_tensor.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "formats/dcp.h"
#include "formats/restricted_unpickler.h"
#include "formats/torch_file.h"

namespace fsdp {
namespace {

// PyTorch keeps a step count as a 0-d float32 tensor (exact up to 2^24
// steps); libtorch's optimizers as an integer.
constexpr const char kStep[] = "step";

// Group keys that say how PyTorch's optimizer kernel works, not what the
// state is: the optimizer on the reading side has its own.
const std::set<std::string>& ImplementationKeys() {
  static const auto* keys = new std::set<std::string>{"foreach", "fused", "capturable"};
  return *keys;
}
// Group keys libtorch's optimizers do not have and that change the update
// when set: refused unless false.
const std::set<std::string>& UnsupportedKeys() {
  static const auto* keys = new std::set<std::string>{"maximize", "differentiable"};
  return *keys;
}

absl::Status Invalid(const std::string& what, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", message));
}

// A real number held in a one-element tensor (PyTorch allows lr as a
// tensor, and keeps step counts as tensors).
std::optional<double> RealOf(const at::Tensor& t) {
  if (t.numel() != 1 || t.is_complex() || !t.device().is_cpu()) return std::nullopt;
  return t.to(at::kDouble).item<double>();
}

// A group option or a non-tensor state value, from the pickle: a scalar,
// or a flat tuple or list of them (betas).
absl::StatusOr<c10::IValue> ToIValue(const PyValue& v, const std::string& what, bool nested) {
  switch (v.kind) {
    case PyValue::Kind::kBool:
      return c10::IValue(v.i != 0);
    case PyValue::Kind::kInt:
      return c10::IValue(v.i);
    case PyValue::Kind::kFloat:
      return c10::IValue(v.f);
    case PyValue::Kind::kString:
      return c10::IValue(v.s);
    case PyValue::Kind::kTensor:
      if (std::optional<double> real = RealOf(v.tensor)) return c10::IValue(*real);
      return absl::InvalidArgumentError(
          absl::StrCat(what, " is a tensor of ", v.tensor.numel(), " elements of ",
                       c10::toString(v.tensor.scalar_type()), ", not one real number"));
    case PyValue::Kind::kTuple:
    case PyValue::Kind::kList: {  // betas; a list after some conversions.
      if (nested) break;
      std::vector<c10::IValue> items;
      for (const PyRef& item : v.items) {
        FSDP_ASSIGN_OR_RETURN(c10::IValue converted, ToIValue(*item, what, /*nested=*/true));
        items.push_back(std::move(converted));
      }
      return c10::IValue(c10::ivalue::Tuple::create(std::move(items)));
    }
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat(what, " holds a ", KindName(v.kind),
                                                 nested ? " inside a tuple or list" : "",
                                                 ", which no libtorch optimizer takes"));
}

// The dict's entries by string key, refusing other keys and a key given
// twice (Python would keep the last; a file that says two things is
// refused).
absl::StatusOr<std::vector<std::pair<std::string, PyRef>>> StringKeyed(const PyValue& dict,
                                                                       const std::string& what,
                                                                       const std::string& where) {
  std::vector<std::pair<std::string, PyRef>> out;
  std::set<std::string> seen;
  for (const auto& [key, value] : dict.entries) {
    if (key->kind != PyValue::Kind::kString) {
      return Invalid(what, absl::StrCat(where, " has a ", KindName(key->kind), " key"));
    }
    if (!seen.insert(key->s).second) {
      return Invalid(what, absl::StrCat(where, " has the key '", key->s, "' twice"));
    }
    out.emplace_back(key->s, value);
  }
  return out;
}

// How a state dict names its parameters: keys are all indices or all FQNs,
// in the groups and in the state. An index is an id whose meaning is its
// position in the groups' "params" lists, taken together (as
// Optimizer.load_state_dict maps them); `fqn_of_index` gives the FQN of
// each position. Errors name the state dict (`what`).
class ParamKeys {
 public:
  ParamKeys(const std::string& what, const std::vector<std::string>& fqn_of_index)
      : what_(what), fqn_of_index_(fqn_of_index) {}

  bool by_index() const { return keying_ == Keying::kIndex; }

  // The FQN of the next parameter a group lists (`param`, at `option`).
  absl::StatusOr<std::string> ListParam(const PyValue& param, const std::string& option) {
    FSDP_RETURN_IF_ERROR(Check(param, option));
    std::string fqn;
    if (keying_ == Keying::kFqn) {
      fqn = param.s;
    } else {
      if (listed_ >= fqn_of_index_.size()) {
        return Invalid(what_, absl::StrCat("the parameter groups list more parameters than "
                                           "the ",
                                           fqn_of_index_.size(), " FQNs given"));
      }
      if (!position_of_id_.emplace(param.i, listed_).second) {
        return Invalid(what_,
                       absl::StrCat(option, " lists parameter ", param.i, " a second time"));
      }
      fqn = fqn_of_index_[listed_];
    }
    ++listed_;
    return fqn;
  }

  // Once every group is read: an index for every FQN given.
  absl::Status CheckEveryIndexListed() const {
    if (keying_ == Keying::kIndex && listed_ != fqn_of_index_.size()) {
      return Invalid(what_, absl::StrCat("the parameter groups list ", listed_,
                                         " parameters, but ", fqn_of_index_.size(),
                                         " FQNs were given"));
    }
    return absl::OkStatus();
  }

  // The FQN a key of 'state' names.
  absl::StatusOr<std::string> StateKey(const PyValue& key) {
    FSDP_RETURN_IF_ERROR(Check(key, "a key of 'state'"));
    if (keying_ == Keying::kFqn) return key.s;
    auto it = position_of_id_.find(key.i);
    if (it == position_of_id_.end()) {
      return Invalid(
          what_, absl::StrCat("state for parameter ", key.i, ", which no parameter group lists"));
    }
    return fqn_of_index_[it->second];
  }

 private:
  enum class Keying { kUnknown, kIndex, kFqn };

  absl::Status Check(const PyValue& key, const std::string& where) {
    const Keying this_key = key.kind == PyValue::Kind::kInt      ? Keying::kIndex
                            : key.kind == PyValue::Kind::kString ? Keying::kFqn
                                                                 : Keying::kUnknown;
    if (this_key == Keying::kUnknown) {
      return Invalid(what_, absl::StrCat(where, " is a ", KindName(key.kind),
                                         ", neither a parameter index nor an FQN"));
    }
    if (keying_ != Keying::kUnknown && this_key != keying_) {
      return Invalid(what_, absl::StrCat(where, " mixes parameter indices and FQNs"));
    }
    keying_ = this_key;
    if (this_key == Keying::kIndex && fqn_of_index_.empty()) {
      return Invalid(what_,
                     "keyed by parameter index (Optimizer.state_dict()): give the FQN of "
                     "each index");
    }
    return absl::OkStatus();
  }

  const std::string& what_;
  const std::vector<std::string>& fqn_of_index_;
  Keying keying_ = Keying::kUnknown;
  std::map<int64_t, size_t> position_of_id_;
  size_t listed_ = 0;
};

// PyTorch >= 2.5 names the parameters of an optimizer built over
// named_parameters(): a check that index i means the same parameter.
absl::Status CheckParamNames(const PyValue& param_names, const std::vector<std::string>& params,
                             const std::string& what, const std::string& where) {
  if (param_names.kind != PyValue::Kind::kList || param_names.items.size() != params.size()) {
    return Invalid(what, absl::StrCat(where, "['param_names'] does not name each of its ",
                                      params.size(), " parameters"));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const PyValue& name = *param_names.items[i];
    if (name.kind != PyValue::Kind::kString || name.s != params[i]) {
      return Invalid(what, absl::StrCat(where, "['params'][", i, "] is named '",
                                        name.kind == PyValue::Kind::kString ? name.s : "?",
                                        "' in the file but is '", params[i],
                                        "' here: the names differ"));
    }
  }
  return absl::OkStatus();
}

// param_groups[g] of the state dict `what`: its parameters and options.
absl::StatusOr<ParamGroupState> ReadParamGroup(const PyValue& group, size_t g,
                                               const std::string& what, ParamKeys& keys) {
  const std::string where = absl::StrCat("param_groups[", g, "]");
  if (group.kind != PyValue::Kind::kDict) {
    return Invalid(what, absl::StrCat(where, " is a ", KindName(group.kind), ", not a dict"));
  }
  FSDP_ASSIGN_OR_RETURN(const auto options, StringKeyed(group, what, where));
  ParamGroupState state;
  bool has_params = false;
  PyRef param_names;
  for (const auto& [name, value] : options) {
    const std::string option = absl::StrCat(where, "['", name, "']");
    if (name == "params") {
      if (value->kind != PyValue::Kind::kList) {
        return Invalid(what,
                       absl::StrCat(option, " is a ", KindName(value->kind), ", not a list"));
      }
      for (const PyRef& param : value->items) {
        FSDP_ASSIGN_OR_RETURN(std::string fqn, keys.ListParam(*param, option));
        state.params.push_back(std::move(fqn));
      }
      has_params = true;
    } else if (name == "param_names") {
      param_names = value;
    } else if (ImplementationKeys().count(name) != 0 || value->kind == PyValue::Kind::kNone) {
      continue;
    } else if (UnsupportedKeys().count(name) != 0) {
      if (value->kind == PyValue::Kind::kBool && value->i == 0) continue;
      return Invalid(what, absl::StrCat(option, " is set, and libtorch's optimizers have no '",
                                        name, "': they would step differently"));
    } else {
      FSDP_ASSIGN_OR_RETURN(state.options[name],
                            ToIValue(*value, absl::StrCat(what, ": ", option), false));
    }
  }
  if (!has_params) return Invalid(what, absl::StrCat(where, " has no 'params'"));
  if (keys.by_index() && param_names != nullptr) {
    FSDP_RETURN_IF_ERROR(CheckParamNames(*param_names, state.params, what, where));
  }
  return state;
}

// A step count as PyTorch or libtorch store it (a one-element tensor, an
// int, a float), as an exact integer.
std::optional<int64_t> StepCountOf(const PyValue& item) {
  std::optional<double> step = item.kind == PyValue::Kind::kTensor ? RealOf(item.tensor)
                               : item.kind == PyValue::Kind::kInt
                                   ? std::optional<double>(static_cast<double>(item.i))
                               : item.kind == PyValue::Kind::kFloat
                                   ? std::optional<double>(item.f)
                                   : std::nullopt;
  if (!step.has_value() || !(*step >= 0) || *step != std::floor(*step) || *step > 9.0e15) {
    return std::nullopt;
  }
  return static_cast<int64_t>(*step);
}

// state[fqn] (`value`, at `where`) of the state dict `what`.
absl::StatusOr<ParamOptimState> ReadParamState(const PyValue& value, const std::string& what,
                                               const std::string& where) {
  if (value.kind != PyValue::Kind::kDict) {
    return Invalid(what, absl::StrCat(where, " is a ", KindName(value.kind), ", not a dict"));
  }
  FSDP_ASSIGN_OR_RETURN(const auto items, StringKeyed(value, what, where));
  ParamOptimState param;
  for (const auto& [name, item] : items) {
    const std::string at = absl::StrCat(where, "['", name, "']");
    if (name == kStep) {
      const std::optional<int64_t> step = StepCountOf(*item);
      if (!step.has_value()) return Invalid(what, absl::StrCat(at, " is not a step count"));
      param.values[name] = c10::IValue(*step);
    } else if (item->kind == PyValue::Kind::kTensor) {
      // Shaped like the parameter (a 0-d parameter's too); Load checks.
      param.tensors[name] = item->tensor;
    } else if (item->kind != PyValue::Kind::kNone) {
      FSDP_ASSIGN_OR_RETURN(param.values[name],
                            ToIValue(*item, absl::StrCat(what, ": ", at), false));
    }
  }
  return param;
}

// The optimizer's state dict `dict` ({"state": ..., "param_groups": ...},
// as PyTorch writes it), read as an OptimStateDict. `what` names it.
absl::StatusOr<OptimStateDict> OptimStateDictOf(const PyValue& dict, const std::string& what,
                                                const std::vector<std::string>& fqn_of_index) {
  PyRef states, groups;
  FSDP_ASSIGN_OR_RETURN(const auto top, StringKeyed(dict, what, "the state dict"));
  for (const auto& [name, value] : top) {
    if (name == "state") states = value;
    if (name == "param_groups") groups = value;
  }
  if (states == nullptr || states->kind != PyValue::Kind::kDict || groups == nullptr ||
      groups->kind != PyValue::Kind::kList) {
    return Invalid(what,
                   "not an optimizer's state dict (a dict 'state' and a list 'param_groups')");
  }
  ParamKeys keys(what, fqn_of_index);
  OptimStateDict out;
  for (size_t g = 0; g < groups->items.size(); ++g) {
    FSDP_ASSIGN_OR_RETURN(ParamGroupState group, ReadParamGroup(*groups->items[g], g, what, keys));
    out.param_groups.push_back(std::move(group));
  }
  FSDP_RETURN_IF_ERROR(keys.CheckEveryIndexListed());
  std::set<std::string> seen;
  for (const auto& [key, value] : states->entries) {
    FSDP_ASSIGN_OR_RETURN(const std::string fqn, keys.StateKey(*key));
    const std::string where = absl::StrCat("state['", fqn, "']");
    if (!seen.insert(fqn).second) return Invalid(what, absl::StrCat(where, " appears twice"));
    FSDP_ASSIGN_OR_RETURN(ParamOptimState param, ReadParamState(*value, what, where));
    out.state.emplace_back(fqn, std::move(param));
  }
  return out;
}

}  // namespace

absl::Status SaveTorchOptimStateDict(const std::string& path, const OptimStateDict& state,
                                     OptimStateKeys keys) {
  const bool by_index = keys == OptimStateKeys::kParameterIndex;
  std::map<std::string, int64_t> index_of;
  for (const ParamGroupState& group : state.param_groups) {
    for (const std::string& fqn : group.params) {
      const int64_t next = static_cast<int64_t>(index_of.size());
      if (!index_of.emplace(fqn, next).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("'", fqn, "' is listed twice in the parameter groups"));
      }
    }
  }
  const auto key_of = [&](const std::string& fqn) {
    return by_index ? c10::IValue(index_of.at(fqn)) : c10::IValue(fqn);
  };
  c10::impl::GenericDict states(
      by_index ? c10::TypePtr(c10::IntType::get()) : c10::TypePtr(c10::StringType::get()),
      c10::AnyType::get());
  for (const auto& [fqn, param] : state.state) {
    if (index_of.count(fqn) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("state for '", fqn, "', which no parameter group lists"));
    }
    c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
    for (const auto& [key, value] : param.values) {
      entry.insert(key, key == kStep && value.isInt()
                            ? c10::IValue(at::scalar_tensor(static_cast<double>(value.toInt()),
                                                            at::TensorOptions().dtype(at::kFloat)))
                            : value);
    }
    for (const auto& [key, tensor] : param.tensors) entry.insert(key, tensor);
    states.insert(key_of(fqn), entry);
  }
  c10::impl::GenericList groups(c10::AnyType::get());
  for (const ParamGroupState& group : state.param_groups) {
    c10::impl::GenericDict options(c10::StringType::get(), c10::AnyType::get());
    for (const auto& [key, value] : group.options) options.insert(key, value);
    c10::impl::GenericList params(c10::AnyType::get());
    for (const std::string& fqn : group.params) params.push_back(key_of(fqn));
    options.insert("params", params);
    groups.push_back(options);
  }
  c10::impl::GenericDict root(c10::StringType::get(), c10::AnyType::get());
  root.insert("state", states);
  root.insert("param_groups", groups);
  return SaveTorchObject(path, root);
}

std::vector<DcpItem> DcpItemsOfOptimState(const OptimStateDict& optim,
                                          const std::string& optim_key) {
  const auto key = [](const std::string& k) { return DcpPathPart{false, k, 0}; };
  std::vector<DcpItem> items;
  for (const auto& [fqn, param] : optim.state) {
    for (const auto& [name, value] : param.values) {
      items.push_back({{key(optim_key), key("state"), key(fqn), key(name)},
                       name == kStep && value.isInt()
                           ? c10::IValue(at::scalar_tensor(static_cast<double>(value.toInt()),
                                                           at::TensorOptions().dtype(at::kFloat)))
                           : value});
    }
    for (const auto& [name, tensor] : param.tensors) {
      items.push_back({{key(optim_key), key("state"), key(fqn), key(name)}, tensor});
    }
  }
  for (size_t g = 0; g < optim.param_groups.size(); ++g) {
    const ParamGroupState& group = optim.param_groups[g];
    std::map<std::string, c10::IValue> options = group.options;
    for (const auto& [name, value] :
         std::vector<std::pair<std::string, c10::IValue>>{{"maximize", false},
                                                          {"foreach", c10::IValue()},
                                                          {"capturable", false},
                                                          {"differentiable", false},
                                                          {"fused", c10::IValue()}}) {
      options.emplace(name, value);
    }
    c10::impl::GenericList params(c10::AnyType::get());
    for (const std::string& fqn : group.params) params.push_back(fqn);
    options["params"] = params;
    const DcpPathPart index{true, "", static_cast<int64_t>(g)};
    for (const auto& [name, value] : options) {
      items.push_back({{key(optim_key), key("param_groups"), index, key(name)}, value});
    }
  }
  return items;
}

absl::Status SaveDcpModelAndOptimizer(const std::string& dir, const StateDict& model,
                                      const OptimStateDict& optim, const std::string& model_key,
                                      const std::string& optim_key) {
  std::vector<DcpItem> items;
  for (const auto& [fqn, tensor] : model) {
    items.push_back({{{false, model_key, 0}, {false, fqn, 0}}, tensor});
  }
  for (DcpItem& item : DcpItemsOfOptimState(optim, optim_key)) items.push_back(std::move(item));
  return SaveDcpCheckpoint(dir, items);
}

absl::StatusOr<OptimStateDict> LoadTorchOptimStateDict(
    const std::string& path, const std::string& entry,
    const std::vector<std::string>& fqn_of_index) {
  const std::string what = entry.empty() ? absl::StrCat("'", path, "'")
                                         : absl::StrCat("'", path, "' entry '", entry, "'");
  FSDP_ASSIGN_OR_RETURN(const PyRef root, ReadTorchSaveObject(path));
  PyRef dict = root;
  if (!entry.empty()) {
    if (root->kind != PyValue::Kind::kDict) {
      return Invalid(
          absl::StrCat("'", path, "'"),
          absl::StrCat("a ", KindName(root->kind), ", which has no entry '", entry, "'"));
    }
    FSDP_ASSIGN_OR_RETURN(const auto entries, StringKeyed(*root, "'" + path + "'", "the file"));
    dict = nullptr;
    for (const auto& [name, value] : entries) {
      if (name == entry) dict = value;
    }
    if (dict == nullptr) {
      return Invalid(absl::StrCat("'", path, "'"), absl::StrCat("no entry '", entry, "'"));
    }
  }
  if (dict->kind != PyValue::Kind::kDict) {
    return Invalid(what,
                   absl::StrCat("a ", KindName(dict->kind), ", not an optimizer's state dict"));
  }
  return OptimStateDictOf(*dict, what, fqn_of_index);
}

namespace {

// The path of stored value `stored` in the saved state dict when it is the
// optimizer's: under `key`, or, with no key, under "state" or
// "param_groups" at the root. Null for anything else.
const std::vector<DcpPathPart>* OptimPathOf(const DcpMetadata& metadata, const std::string& key,
                                            const std::string& stored) {
  auto it = metadata.planner_data.find(stored);
  if (it == metadata.planner_data.end()) return nullptr;
  const std::vector<DcpPathPart>& path = it->second;
  if (!key.empty() && (path.empty() || path[0].is_index || path[0].key != key)) return nullptr;
  if (key.empty() && (path.empty() || path[0].is_index ||
                      (path[0].key != "state" && path[0].key != "param_groups"))) {
    return nullptr;
  }
  return &path;
}

// The optimizer's state dict rebuilt from the stored values' paths:
// (key, "state", fqn, name) and (key, "param_groups", i, option), as the
// pickled dict OptimStateDictOf reads.
class OptimDictBuilder {
 public:
  explicit OptimDictBuilder(const std::string& what) : what_(what) {}

  // Puts `value` where `path` (the optimizer's part of stored value
  // `stored`'s path) says.
  absl::Status Place(const std::string& stored, const std::vector<DcpPathPart>& path,
                     PyRef value) {
    const bool state =
        path.size() == 3 && !path[0].is_index && path[0].key == "state" && !path[2].is_index;
    const bool group = path.size() == 3 && !path[0].is_index && path[0].key == "param_groups" &&
                       path[1].is_index && !path[2].is_index;
    if (!state && !group) {
      return Invalid(what_, absl::StrCat("'", stored,
                                         "' is stored at a path an optimizer's state "
                                         "dict does not have"));
    }
    if (group && (path[1].index < 0 || path[1].index > 1000000)) {
      return Invalid(what_, absl::StrCat("'", stored, "' names parameter group ", path[1].index));
    }
    PyRef parent;
    if (state) {
      const std::string param = path[1].is_index ? absl::StrCat(path[1].index) : path[1].key;
      PyRef& entry = states_[param];
      if (entry == nullptr) {
        entry = MakePy(PyValue::Kind::kDict);
        state_order_.emplace_back(
            param, path[1].is_index ? MakePyInt(path[1].index) : MakePyString(path[1].key));
      }
      parent = entry;
    } else {
      PyRef& entry = groups_[path[1].index];
      if (entry == nullptr) entry = MakePy(PyValue::Kind::kDict);
      parent = entry;
    }
    parent->entries.emplace_back(MakePyString(path[2].key), std::move(value));
    return absl::OkStatus();
  }

  // The dict, once every value is placed; every parameter group from 0 on
  // must have been.
  absl::StatusOr<PyRef> Build() const {
    if (states_.empty() && groups_.empty()) {
      return Invalid(what_, "no optimizer state is stored under it");
    }
    PyRef dict = MakePy(PyValue::Kind::kDict);
    PyRef state_dict = MakePy(PyValue::Kind::kDict);
    for (const auto& [param, stored_key] : state_order_) {
      state_dict->entries.emplace_back(stored_key, states_.at(param));
    }
    PyRef group_list = MakePy(PyValue::Kind::kList);
    int64_t expected = 0;
    for (const auto& [index, group] : groups_) {
      if (index != expected++) {
        return Invalid(what_, absl::StrCat("parameter group ", expected - 1, " is missing"));
      }
      group_list->items.push_back(group);
    }
    dict->entries.emplace_back(MakePyString("state"), state_dict);
    dict->entries.emplace_back(MakePyString("param_groups"), group_list);
    return dict;
  }

 private:
  const std::string& what_;
  std::map<std::string, PyRef> states_;                     // By the state dict's key, printed.
  std::vector<std::pair<std::string, PyRef>> state_order_;  // And as stored: FQN or index.
  std::map<int64_t, PyRef> groups_;
};

// The parameter whose elementwise state a stored tensor is, when only
// this rank's part of it is wanted: one keyed by FQN and shaped like it.
// `full` is the tensor's path, `skip` the parts before the optimizer's own.
const ParamShardPlace* ShardPlaceOf(const DcpTensorEntry& tensor,
                                    const std::vector<DcpPathPart>& full, size_t skip,
                                    const std::map<std::string, ParamShardPlace>* places) {
  if (places == nullptr) return nullptr;
  if (full.size() != skip + 3 || full[skip + 1].is_index || full[skip + 2].key == kStep) {
    return nullptr;
  }
  auto it = places->find(full[skip + 1].key);
  if (it == places->end() || it->second.full_shape != tensor.size) return nullptr;
  return &it->second;
}

// LoadDcpOptimStateDict; with `places`, as LoadDcpOptimStateDictPart.
absl::StatusOr<OptimStateDict> ReadDcpOptimState(
    const std::string& dir, const std::string& key, const std::vector<std::string>& fqn_of_index,
    const std::map<std::string, ParamShardPlace>* places, int64_t* bytes_read) {
  const std::string what = key.empty()
                               ? absl::StrCat("DCP checkpoint '", dir, "'")
                               : absl::StrCat("DCP checkpoint '", dir, "' entry '", key, "'");
  FSDP_ASSIGN_OR_RETURN(const DcpMetadata metadata, ReadDcpMetadata(dir));
  // Path parts before the optimizer's own: (key) or none.
  const size_t skip = key.empty() ? 0 : 1;
  if (metadata.planner_data.empty()) {
    return Invalid(what,
                   "the checkpoint records no planner_data (dcp.save flattens nested "
                   "state dicts and records their paths there): cannot find the "
                   "optimizer's state in it");
  }
  OptimDictBuilder builder(what);
  const auto place = [&](const std::string& stored, const std::vector<DcpPathPart>& full,
                         PyRef value) {
    return builder.Place(stored, std::vector<DcpPathPart>(full.begin() + skip, full.end()),
                         std::move(value));
  };
  for (const DcpTensorEntry& tensor : metadata.tensors) {
    const std::vector<DcpPathPart>* full = OptimPathOf(metadata, key, tensor.fqn);
    if (full == nullptr) continue;  // Not the optimizer's: read nothing of it.
    int64_t numel = 1;
    for (int64_t d : tensor.size) numel *= d;
    const ParamShardPlace* part = ShardPlaceOf(tensor, *full, skip, places);
    const int64_t lo = part != nullptr && part->sharded ? part->lo : 0;
    const int64_t hi = part != nullptr && part->sharded ? part->hi : numel;
    FSDP_ASSIGN_OR_RETURN(at::Tensor read, ReadDcpFlatRange(dir, tensor, lo, hi, bytes_read));
    PyRef value = MakePy(PyValue::Kind::kTensor);
    // A whole tensor keeps its shape; a part stays 1-D.
    value->tensor = part != nullptr ? std::move(read) : read.view(tensor.size);
    FSDP_RETURN_IF_ERROR(place(tensor.fqn, *full, std::move(value)));
  }
  for (const DcpBytesEntry& bytes : metadata.bytes) {
    const std::vector<DcpPathPart>* full = OptimPathOf(metadata, key, bytes.fqn);
    if (full == nullptr) continue;
    FSDP_ASSIGN_OR_RETURN(PyRef value, ReadDcpBytes(dir, bytes));
    FSDP_RETURN_IF_ERROR(place(bytes.fqn, *full, std::move(value)));
  }
  FSDP_ASSIGN_OR_RETURN(const PyRef dict, builder.Build());
  return OptimStateDictOf(*dict, what, fqn_of_index);
}

}  // namespace

absl::StatusOr<OptimStateDict> LoadDcpOptimStateDict(const std::string& dir, const std::string& key,
                                                     const std::vector<std::string>& fqn_of_index) {
  return ReadDcpOptimState(dir, key, fqn_of_index, nullptr, nullptr);
}

absl::StatusOr<OptimStateDict> LoadDcpOptimStateDictPart(
    const std::string& dir, const std::string& key,
    const std::map<std::string, ParamShardPlace>& places,
    const std::vector<std::string>& fqn_of_index, int64_t* bytes_read) {
  return ReadDcpOptimState(dir, key, fqn_of_index, &places, bytes_read);
}

}  // namespace fsdp
