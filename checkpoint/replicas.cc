#include "checkpoint/replicas.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "checkpoint/agree.h"
#include "comm/collectives.h"
#include "fsdp/shard_placement.h"
#include "optim/optim_state.h"
#include "statedict/model_tensors.h"
#include "torch/optim/adagrad.h"
#include "torch/optim/adam.h"
#include "torch/optim/adamw.h"
#include "torch/optim/rmsprop.h"
#include "torch/optim/sgd.h"

namespace fsdp {
namespace {

using checkpoint_internal::AgreeAcrossRanks;

constexpr int kMaxListed = 8;

// One step of the hash: splitmix64's finalizer of `state ^ word`. Every
// part (xor-shift, multiply by an odd number) is a bijection, so for a
// fixed `state` the step is a bijection of `word` and for a fixed `word` of
// `state`; and every input bit reaches every output bit, so that two
// changed words do not cancel any more often than chance.
uint64_t Mix(uint64_t state, uint64_t word) {
  uint64_t x = state ^ word;
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Four independent lanes of eight bytes, so that the multiplies overlap;
// one word changed changes its lane and so the result (see replicas.h).
uint64_t HashBytes(const unsigned char* data, size_t size) {
  uint64_t lane[4] = {0xcbf29ce484222325ULL, 0x84222325cbf29ce4ULL, 0x27d4eb2f165667c5ULL,
                      0x165667c527d4eb2fULL};
  size_t i = 0;
  for (; i + 32 <= size; i += 32) {
    for (int k = 0; k < 4; ++k) {
      uint64_t word;
      std::memcpy(&word, data + i + 8 * k, 8);
      lane[k] = Mix(lane[k], word);
    }
  }
  uint64_t h = size;
  for (uint64_t l : lane) h = Mix(h, l);
  for (; i < size; ++i) h = Mix(h, data[i]);
  return h;
}

uint64_t HashTensor(const at::Tensor& tensor) {
  const at::Tensor host = tensor.is_cpu() ? tensor.contiguous() : tensor.cpu().contiguous();
  return HashBytes(static_cast<const unsigned char*>(host.data_ptr()), host.nbytes());
}

// A tensor that some ranks must hold alike.
struct Item {
  std::string name;
  std::string kind;  // "parameter", "buffer", "optimizer state 'exp_avg'".
  std::string unit;  // "unit 'blocks.1'", "the root unit", "in no unit".
  uint64_t hash = 0;
};

// The items to compare across the shard group (every rank holds all of
// them) and across the replicate group (every item: a replica holds the
// same shards).
struct Items {
  std::vector<Item> shard_group;
  std::vector<Item> replicate_group;
  void Add(Item item, bool whole_on_every_rank, bool hybrid) {
    if (hybrid) replicate_group.push_back(item);
    if (whole_on_every_rank) shard_group.push_back(std::move(item));
  }
};

std::unordered_set<const void*> IgnoredTensors(const FullyShardedModel& model) {
  std::unordered_set<const void*> ignored;
  for (const torch::nn::Module* module : model.options().ignored_modules) {
    for (const at::Tensor& p : module->parameters()) ignored.insert(p.unsafeGetTensorImpl());
    for (const at::Tensor& b : module->buffers()) ignored.insert(b.unsafeGetTensorImpl());
  }
  return ignored;
}

std::string UnitName(const FullyShardedModel& model, int unit) {
  if (unit < 0) return "in no unit";
  const std::string& fqn = model.units()[unit]->fqn();
  return fqn.empty() ? "the root unit" : absl::StrCat("unit '", fqn, "'");
}

// Hashes of an IValue that is a number, a flag or a tensor (Adam's step
// count); nullopt for anything else.
std::optional<uint64_t> HashValue(const c10::IValue& value) {
  uint64_t bits = 0;
  if (value.isTensor()) return HashTensor(value.toTensor());
  if (value.isDouble()) {
    const double d = value.toDouble();
    std::memcpy(&bits, &d, 8);
  } else if (value.isInt()) {
    bits = static_cast<uint64_t>(value.toInt());
  } else if (value.isBool()) {
    bits = value.toBool() ? 1 : 0;
  } else {
    return std::nullopt;
  }
  return Mix(0, bits);
}

using NamedValues = std::vector<std::pair<std::string, c10::IValue>>;

// libtorch's own optimizer state classes, read in place (no copy), under
// the names their serialize() writes; nullopt for any other class.
std::optional<NamedValues> StateInPlace(const torch::optim::OptimizerParamState& state) {
  NamedValues out;
  const auto tensor = [&out](const char* key, const at::Tensor& t) {
    if (t.defined()) out.emplace_back(key, t);
  };
  const auto adam_like = [&](const auto& s) {
    out.emplace_back("step", s.step());
    tensor("exp_avg", s.exp_avg());
    tensor("exp_avg_sq", s.exp_avg_sq());
    tensor("max_exp_avg_sq", s.max_exp_avg_sq());
  };
  if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    adam_like(*adamw);
  } else if (const auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(&state)) {
    adam_like(*adam);
  } else if (const auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(&state)) {
    tensor("momentum_buffer", sgd->momentum_buffer());
  } else if (const auto* adagrad = dynamic_cast<const torch::optim::AdagradParamState*>(&state)) {
    out.emplace_back("step", adagrad->step());
    tensor("sum", adagrad->sum());
  } else if (const auto* rms = dynamic_cast<const torch::optim::RMSpropParamState*>(&state)) {
    out.emplace_back("step", rms->step());
    tensor("square_avg", rms->square_avg());
    tensor("momentum_buffer", rms->momentum_buffer());
    tensor("grad_avg", rms->grad_avg());
  } else {
    return std::nullopt;
  }
  return out;
}

// libtorch 1.x keys optimizer state by the TensorImpl's address as text,
// 2.x by the address.
template <typename StateMap>
auto FindState(StateMap& state, const at::Tensor& param) {
  if constexpr (std::is_same_v<typename StateMap::key_type, std::string>) {
    std::ostringstream key;
    key << param.unsafeGetTensorImpl();
    return state.find(key.str());
  } else {
    return state.find(param.unsafeGetTensorImpl());
  }
}

// This rank's optimizer state, by parameter name (ignored modules' left
// out): in place where every state is of libtorch's own classes, else
// through ShardedOptimStateDict (a copy, by serialize()).
absl::StatusOr<std::vector<std::pair<std::string, NamedValues>>> OptimizerState(
    FullyShardedModel& model, torch::optim::Optimizer& optimizer,
    const std::unordered_map<const void*, std::string>& name_of) {
  std::vector<std::pair<std::string, NamedValues>> states;
  bool in_place = true;
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      const auto name = name_of.find(p.unsafeGetTensorImpl());
      const auto found = FindState(optimizer.state(), p);
      if (name == name_of.end() || found == optimizer.state().end()) continue;
      std::optional<NamedValues> values = StateInPlace(*found->second);
      in_place = in_place && values.has_value();
      if (!in_place) break;
      states.emplace_back(name->second, std::move(*values));
    }
  }
  if (in_place) return states;
  states.clear();
  FSDP_ASSIGN_OR_RETURN(const OptimStateDict dict, ShardedOptimStateDict(model, optimizer));
  std::unordered_set<std::string> names;
  for (const auto& [impl, name] : name_of) names.insert(name);
  for (const auto& [name, state] : dict.state) {
    if (names.count(name) == 0) continue;
    NamedValues values(state.values.begin(), state.values.end());
    for (const auto& [key, t] : state.tensors) values.emplace_back(key, t);
    states.emplace_back(name, std::move(values));
  }
  return states;
}

absl::Status CollectItems(FullyShardedModel& model, torch::optim::Optimizer* optimizer,
                          const ReplicaCheckOptions& options, Items& items) {
  const bool hybrid = model.replicate_group() != nullptr;
  const ShardPlacements placements = ShardPlacementsOf(model);
  const std::unordered_set<const void*> ignored = IgnoredTensors(model);
  std::unordered_set<const void*> parameters;
  for (const at::Tensor& p : model.units().front()->module().parameters()) {
    parameters.insert(p.unsafeGetTensorImpl());
  }
  std::unordered_map<const void*, std::string> name_of;  // A tied tensor's first name.
  std::unordered_map<std::string, int> unit_of;
  for (const auto& [name, tensor] :
       statedict_internal::NamedTensors(model.units().front()->module())) {
    const void* impl = tensor.unsafeGetTensorImpl();
    if (ignored.count(impl) != 0) continue;
    const ShardPlacement p = PlacementOf(placements, tensor);
    unit_of[name] = p.unit;  // Every name of a tied tensor.
    if (!name_of.emplace(impl, name).second) continue;
    if (p.sharded && !hybrid) continue;  // No replicas.
    const bool parameter = parameters.count(impl) != 0;
    if (!parameter && !options.compare_buffers) continue;
    items.Add({name, parameter ? "parameter" : "buffer", UnitName(model, p.unit),
               HashTensor(p.local)},
              !p.sharded, hybrid);
  }
  if (optimizer == nullptr) return absl::OkStatus();
  FSDP_ASSIGN_OR_RETURN(const auto places, OptimizerShardPlaces(model, *optimizer));
  // Without a replicate group only NO_SHARD units' state has replicas.
  bool replicated = hybrid;
  for (const auto& [name, place] : places) replicated = replicated || !place.sharded;
  if (!replicated) return absl::OkStatus();
  FSDP_ASSIGN_OR_RETURN(const auto states, OptimizerState(model, *optimizer, name_of));
  for (const auto& [name, values] : states) {
    const auto place = places.find(name);
    if (place == places.end()) {
      return absl::InternalError(absl::StrCat("CheckReplicas: the optimizer's parameter '", name,
                                              "' has no place in the model"));
    }
    if (place->second.sharded && !hybrid) continue;
    const std::string unit_name = UnitName(model, unit_of.at(name));
    for (const auto& [key, value] : values) {
      if (const std::optional<uint64_t> hash = HashValue(value)) {
        items.Add({name, absl::StrCat("optimizer state '", key, "'"), unit_name, *hash},
                  !place->second.sharded, hybrid);
      }
    }
  }
  return absl::OkStatus();
}

// "rank 1", "replicas 0, 2".
std::string MemberList(const char* noun, const std::vector<int>& ranks) {
  return absl::StrCat(noun, ranks.size() == 1 ? " " : "s ", absl::StrJoin(ranks, ", "));
}

// Which ranks of a group hold which hash of one item, the most common first.
std::string DescribeHolders(const char* noun,
                            const std::map<uint64_t, std::vector<int>>& holders) {
  std::vector<std::pair<uint64_t, std::vector<int>>> sorted(holders.begin(), holders.end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
    return a.second.size() != b.second.size() ? a.second.size() > b.second.size()
                                              : a.second.front() < b.second.front();
  });
  std::vector<std::string> parts;
  for (const auto& [hash, ranks] : sorted) {
    parts.push_back(absl::StrFormat("%s %s %016x", MemberList(noun, ranks),
                                    ranks.size() == 1 ? "holds" : "hold", hash));
  }
  return absl::StrJoin(parts, ", ");
}

// The items that differ across `group`, described; empty when all agree.
// `where` names the group ("among the replicas of shard 0"), `noun` its
// members ("replica"). Every member computes the same answer from the same
// gathered data, so all of them take the second round or none.
std::vector<std::string> Differences(Collectives& group, const std::string& where,
                                     const char* noun, const std::vector<Item>& items) {
  uint64_t digest = items.size();
  for (const Item& item : items) digest = Mix(digest, item.hash);
  const int world = group.world_size();
  at::Tensor own = at::empty({3}, at::kDouble);
  own[0] = static_cast<double>(digest >> 32);
  own[1] = static_cast<double>(digest & 0xffffffffu);
  own[2] = static_cast<double>(items.size());
  at::Tensor all = at::empty({3 * world}, at::kDouble);
  group.AllGatherIntoTensor(all, own)->Wait();
  const double* v = all.data_ptr<double>();
  bool agree = true;
  for (int r = 1; r < world; ++r) {
    agree = agree && v[3 * r] == v[0] && v[3 * r + 1] == v[1] && v[3 * r + 2] == v[2];
  }
  if (agree) return {};
  std::string mine(items.size() * 8, '\0');
  for (size_t i = 0; i < items.size(); ++i) std::memcpy(&mine[8 * i], &items[i].hash, 8);
  const std::vector<std::string> theirs = AllGatherBytes(group, mine);
  for (int r = 0; r < world; ++r) {
    if (theirs[r].size() != mine.size()) {
      return {absl::StrCat(where, ", ", noun, " ", r, " has ", theirs[r].size() / 8,
                           " tensors to compare and ", noun, " ", group.rank(), " has ",
                           items.size(), " (do all ranks step the same optimizer?)")};
    }
  }
  std::vector<std::string> differences;
  int differing = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    std::map<uint64_t, std::vector<int>> holders;
    for (int r = 0; r < world; ++r) {
      uint64_t hash;
      std::memcpy(&hash, &theirs[r][8 * i], 8);
      holders[hash].push_back(r);
    }
    if (holders.size() == 1) continue;
    if (++differing > kMaxListed) continue;
    const Item& item = items[i];
    differences.push_back(absl::StrCat("'", item.name, "' (", item.kind, ", ", item.unit, "): ",
                                       where, ", ", DescribeHolders(noun, holders)));
  }
  if (differing > kMaxListed) {
    differences.push_back(absl::StrCat("and ", differing - kMaxListed, " more tensors"));
  }
  return differences;
}

}  // namespace

absl::Status CheckReplicas(FullyShardedModel& model, torch::optim::Optimizer* optimizer,
                           const ReplicaCheckOptions& options) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("checking the replicas", ShardAccess::kReadsOnly));
  CollectiveLabel label(model.group(), model.replicate_group(), "", "checking the replicas");
  Items items;
  FSDP_RETURN_IF_ERROR(AgreeAcrossRanks(
      model, CatchAsStatus([&] { return CollectItems(model, optimizer, options, items); })));
  std::vector<std::string> differences;
  absl::Status local;
  try {
    Collectives* replicas = model.replicate_group();
    differences = Differences(
        model.group(),
        replicas == nullptr ? std::string("across the ranks")
                            : absl::StrCat("across the shard group of replica ", replicas->rank()),
        "rank", items.shard_group);
    if (replicas != nullptr) {
      for (std::string& d :
           Differences(*replicas, absl::StrCat("among the replicas of shard ",
                                               model.group().rank()),
                       "replica", items.replicate_group)) {
        differences.push_back(std::move(d));
      }
    }
  } catch (...) {
    // Still agreed on below: the others must not wait for this rank.
    local = StatusFromCurrentException();
  }
  if (local.ok() && !differences.empty()) {
    local = absl::DataLossError(absl::StrCat(
        "the replicas disagree (silent data corruption, or ranks that did not step alike): ",
        absl::StrJoin(differences, "; ")));
  }
  return AgreeAcrossRanks(model, local);
}

absl::Status CheckGradientNormAgrees(FullyShardedModel& model, double norm) {
  CollectiveLabel label(model.group(), model.replicate_group(), "", "checking the gradient norm");
  uint64_t bits;
  std::memcpy(&bits, &norm, 8);
  std::vector<std::string> differences;
  absl::Status local;
  try {
    std::vector<Collectives*> groups = {&model.group()};
    if (model.replicate_group() != nullptr) groups.push_back(model.replicate_group());
    for (Collectives* group : groups) {
      const int world = group->world_size();
      at::Tensor own = at::empty({2}, at::kDouble);
      own[0] = static_cast<double>(bits >> 32);
      own[1] = static_cast<double>(bits & 0xffffffffu);
      at::Tensor all = at::empty({2 * world}, at::kDouble);
      group->AllGatherIntoTensor(all, own)->Wait();
      const double* v = all.data_ptr<double>();
      std::map<uint64_t, std::vector<int>> holders;
      for (int r = 0; r < world; ++r) {
        holders[static_cast<uint64_t>(v[2 * r]) << 32 | static_cast<uint64_t>(v[2 * r + 1])]
            .push_back(r);
      }
      if (holders.size() == 1) continue;
      std::vector<std::string> values;
      for (const auto& [held, ranks] : holders) {
        double value;
        std::memcpy(&value, &held, 8);
        values.push_back(
            absl::StrFormat("%s %.17g", MemberList(group == &model.group() ? "rank" : "replica",
                                                   ranks),
                            value));
      }
      differences.push_back(
          absl::StrCat(group == &model.group() ? "across the shard group" : "across the replicas",
                       ", ", absl::StrJoin(values, ", ")));
    }
  } catch (...) {
    local = StatusFromCurrentException();
  }
  if (local.ok() && !differences.empty()) {
    local = absl::DataLossError(absl::StrCat(
        "the ranks computed different global gradient norms (a corrupted reduction or "
        "gradient): ",
        absl::StrJoin(differences, "; ")));
  }
  return AgreeAcrossRanks(model, local);
}

}  // namespace fsdp
