#include "fsdp/wrap_plan.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "fsdp/unit_registry.h"

namespace fsdp {
namespace {

bool IsPrefixOf(const std::string& unit_fqn, const std::string& fqn) {
  return unit_fqn.empty() || fqn == unit_fqn || fqn.rfind(unit_fqn + ".", 0) == 0;
}

}  // namespace

std::string UnitName(const std::string& fqn) { return fqn.empty() ? "<root>" : fqn; }

size_t WrapPlan::OwnerOf(const std::vector<std::string>& names) const {
  size_t best = 0;
  for (size_t u = 1; u < units.size(); ++u) {
    bool holds_all = true;
    for (const std::string& name : names) holds_all = holds_all && IsPrefixOf(units[u].fqn, name);
    if (holds_all && units[u].fqn.size() > units[best].fqn.size()) best = u;
  }
  return best;
}

namespace {

// Subtrees left alone: ignored modules and modules another model wraps.
struct Excluded {
  std::vector<std::string> fqns;  // Their roots.
  std::set<const torch::nn::Module*> modules;  // Their roots and everything below.
};

// Every submodule's FQN (a module reachable twice keeps its first name),
// and the excluded subtrees; modules another model wraps are also listed in
// `left_alone`.
absl::Status FindSubmodules(torch::nn::Module& root, const FsdpOptions& options,
                            std::map<const torch::nn::Module*, std::string>& fqn_of,
                            Excluded& excluded, std::vector<std::string>& left_alone) {
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    const torch::nn::Module* module = item.value().get();
    if (fqn_of.count(module) != 0) continue;
    fqn_of[module] = item.key();
    bool under = false;
    for (const std::string& e : excluded.fqns) under = under || IsPrefixOf(e, item.key());
    if (under) {
      excluded.modules.insert(module);
      continue;
    }
    const bool ignored = std::find(options.ignored_modules.begin(), options.ignored_modules.end(),
                                   module) != options.ignored_modules.end();
    if (ignored || GetModuleUnit(module) != nullptr) {
      excluded.fqns.push_back(item.key());
      excluded.modules.insert(module);
      if (!ignored) left_alone.push_back(item.key());
    }
  }
  for (const torch::nn::Module* module : options.ignored_modules) {
    if (module == &root) {
      return absl::InvalidArgumentError("the root module cannot be an ignored module");
    }
    if (fqn_of.count(module) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "an ignored module (", module == nullptr ? "null" : module->name(),
          ") is not a submodule of the root"));
    }
  }
  return absl::OkStatus();
}

// The submodules the policy makes units, with its options for each; every
// choice checked.
absl::StatusOr<std::map<const torch::nn::Module*, UnitOptions>> ChooseUnits(
    torch::nn::Module& root, const FsdpOptions& options, const WrapPolicy& policy,
    const std::string& policy_name,
    const std::map<const torch::nn::Module*, std::string>& fqn_of, const Excluded& excluded) {
  PolicyInput input;
  input.root = &root;
  input.root_options.strategy = options.strategy;
  if (options.mixed_precision.enabled()) input.root_options.mixed_precision = options.mixed_precision;
  input.root_options.all_gather_quantization = options.all_gather_quantization;
  input.root_options.reduce_quantization = options.reduce_quantization;
  input.can_be_unit = [](const torch::nn::Module& m) {
    return dynamic_cast<const ShardableModule*>(&m) != nullptr;
  };
  input.is_excluded = [&excluded](const torch::nn::Module& m) {
    return excluded.modules.count(&m) != 0;
  };
  absl::StatusOr<std::vector<UnitTarget>> targets = policy.Targets(input);
  if (!targets.ok()) return targets.status();

  std::map<const torch::nn::Module*, UnitOptions> chosen;
  for (const UnitTarget& target : *targets) {
    const std::string where = absl::StrCat("wrap policy '", policy_name, "' chose ");
    if (target.module == &root) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "the root, which is always a unit; return only submodules"));
    }
    auto it = fqn_of.find(target.module);
    if (target.module == nullptr || it == fqn_of.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "module '", target.fqn, "', which is not a submodule of the root"));
    }
    if (excluded.modules.count(target.module) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "module '", it->second, "', which is ignored or inside an ignored or "
          "already wrapped subtree"));
    }
    if (!chosen.emplace(target.module, target.options).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "module '", it->second, "' twice"));
    }
    // A hybrid unit needs the replicate group, which Wrap takes only
    // with a hybrid root (ValidateProcessGroups).
    if (target.options.strategy && IsHybrid(*target.options.strategy) &&
        !IsHybrid(options.strategy)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "module '", it->second, "' with strategy ",
          ShardingStrategyName(*target.options.strategy), " but the root's strategy is ",
          ShardingStrategyName(options.strategy),
          ": a unit can be hybrid only when the root is (FsdpOptions::strategy hybrid, with "
          "ProcessGroups::replicate)"));
    }
    if (target.options.mixed_precision) {
      if (absl::Status mp = ValidateMixedPrecision(*target.options.mixed_precision); !mp.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, "module '", it->second, "' with ", mp.message()));
      }
    }
    if (dynamic_cast<const ShardableModule*>(target.module) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "module '", it->second, "' (", target.module->name(),
          ") as an FSDP unit but FSDP cannot hook its forward: derive its type from "
          "fsdp::ShardableModule and open a fsdp::UnitForward scope in its forward "
          "(fsdp/unit_forward.h), or hold it in a fsdp::UnitModule (fsdp/unit_module.h)"));
    }
  }
  return chosen;
}

// The root and the chosen units, in pre-order, root first.
void AddUnits(torch::nn::Module& root, const FsdpOptions& options,
              const std::map<const torch::nn::Module*, UnitOptions>& chosen,
              const std::map<const torch::nn::Module*, std::string>& fqn_of, WrapPlan& plan) {
  PlannedUnit root_unit;
  root_unit.type = root.name();
  root_unit.module = &root;
  root_unit.strategy = options.strategy;
  root_unit.mixed_precision = options.mixed_precision;
  root_unit.all_gather_quantization = options.all_gather_quantization;
  root_unit.reduce_quantization = options.reduce_quantization;
  plan.units.push_back(std::move(root_unit));
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    auto it = chosen.find(item.value().get());
    if (it == chosen.end() || fqn_of.at(it->first) != item.key()) continue;
    PlannedUnit unit;
    unit.fqn = item.key();
    unit.type = item.value()->name();
    unit.module = item.value().get();
    unit.overrides = it->second;
    unit.strategy = it->second.strategy.value_or(options.strategy);
    unit.mixed_precision = it->second.mixed_precision.value_or(options.mixed_precision);
    unit.all_gather_quantization =
        it->second.all_gather_quantization.value_or(options.all_gather_quantization);
    unit.reduce_quantization = it->second.reduce_quantization.value_or(options.reduce_quantization);
    for (const PlannedUnit& other : plan.units) {
      if (!other.fqn.empty() && IsPrefixOf(other.fqn, unit.fqn)) ++unit.depth;
    }
    ++unit.depth;  // Below the root.
    plan.units.push_back(std::move(unit));
  }
}

// Each parameter goes to the deepest unit containing all its names;
// parameters in excluded subtrees go to none.
void AssignParams(torch::nn::Module& root, const Excluded& excluded, WrapPlan& plan) {
  std::map<const void*, std::vector<std::string>> names;
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    auto& list = names[item.value().unsafeGetTensorImpl()];
    if (list.empty()) params.emplace_back(item.key(), item.value());
    list.push_back(item.key());
  }
  for (const auto& [fqn, param] : params) {
    const std::vector<std::string>& all = names[param.unsafeGetTensorImpl()];
    bool skip = false;
    for (const std::string& name : all) {
      for (const std::string& e : excluded.fqns) skip = skip || IsPrefixOf(e, name);
    }
    if (skip) {
      // Under an ignored module (or another model, which reports its own).
      bool in_ignored = false;
      for (const std::string& name : all) {
        for (const std::string& e : excluded.fqns) {
          const bool left_alone = std::find(plan.left_alone.begin(), plan.left_alone.end(),
                                            e) != plan.left_alone.end();
          in_ignored = in_ignored || (!left_alone && IsPrefixOf(e, name));
        }
      }
      if (in_ignored) plan.ignored_params.push_back(absl::StrJoin(all, " = "));
      continue;
    }
    const size_t best = plan.OwnerOf(all);
    plan.units[best].param_fqns.push_back(fqn);
    plan.units[best].params.push_back(param);
  }
}

// A unit whose all_gather_quantization or reduce_quantization cannot
// apply: the first, named.
absl::Status CheckQuantization(const WrapPlan& plan) {
  for (const PlannedUnit& unit : plan.units) {
    if (unit.params.empty()) continue;
    FSDP_RETURN_IF_ERROR(CheckAllGatherQuantization(
        UnitName(unit.fqn), unit.strategy, unit.mixed_precision, unit.all_gather_quantization,
        unit.params.front().scalar_type(), unit.param_fqns.front()));
    FSDP_RETURN_IF_ERROR(CheckReduceQuantization(
        UnitName(unit.fqn), unit.strategy, unit.mixed_precision, unit.reduce_quantization,
        unit.params.front().scalar_type(), unit.param_fqns.front()));
  }
  return absl::OkStatus();
}

// Sizes and shard sizes, the trainable and the frozen segment each padded.
void SizeUnits(int world_size, WrapPlan& plan) {
  for (PlannedUnit& unit : plan.units) {
    for (const at::Tensor& param : unit.params) {
      unit.numel += param.numel();
      if (param.requires_grad()) unit.trainable_numel += param.numel();
    }
    const int64_t w = unit.strategy == ShardingStrategy::kNoShard ? 1 : world_size;
    const int64_t frozen_numel = unit.numel - unit.trainable_numel;
    unit.shard_numel = (unit.trainable_numel + w - 1) / w + (frozen_numel + w - 1) / w;
  }
}

}  // namespace

absl::StatusOr<WrapPlan> PlanWrap(torch::nn::Module& root, int world_size,
                                  const FsdpOptions& options, const WrapPolicy& policy) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("PlanWrap: world size ", world_size));
  }
  // Wrap validates all of the root's options first; a plan made on its own
  // must not print dtypes Wrap would refuse.
  if (absl::Status mp = ValidateMixedPrecision(options.mixed_precision); !mp.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("mixed_precision: ", mp.message()));
  }
  if (GetModuleUnit(&root) != nullptr) {
    return absl::AlreadyExistsError(
        absl::StrCat("the root module (", root.name(), ") is already part of a wrapped model"));
  }
  WrapPlan plan;
  plan.policy = policy.Describe();
  plan.world_size = world_size;
  plan.root_strategy = options.strategy;
  std::map<const torch::nn::Module*, std::string> fqn_of;
  Excluded excluded;
  if (absl::Status found = FindSubmodules(root, options, fqn_of, excluded, plan.left_alone);
      !found.ok()) {
    return found;
  }
  absl::StatusOr<std::map<const torch::nn::Module*, UnitOptions>> chosen =
      ChooseUnits(root, options, policy, plan.policy, fqn_of, excluded);
  if (!chosen.ok()) return chosen.status();
  AddUnits(root, options, *chosen, fqn_of, plan);
  AssignParams(root, excluded, plan);
  SizeUnits(world_size, plan);
  if (absl::Status quantization = CheckQuantization(plan); !quantization.ok()) {
    return quantization;
  }
  if (!plan.units.front().params.empty() &&
      dynamic_cast<ShardableModule*>(&root) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the root module (", root.name(), ") holds parameters of its own ('",
        plan.units.front().param_fqns.front(),
        "', ...) but FSDP cannot hook its forward to unshard them: derive its type from "
        "fsdp::ShardableModule and open a fsdp::UnitForward scope in its forward, hold "
        "it in a fsdp::UnitModule, or choose the submodules that hold them as units"));
  }
  return plan;
}

ResolvedUnitOptions ResolveUnitOptions(const PlannedUnit& unit, const FsdpOptions& options,
                                       const ProcessGroups& groups) {
  ResolvedUnitOptions resolved;
  resolved.strategy = unit.strategy;
  resolved.mixed_precision = unit.mixed_precision;
  resolved.all_gather_quantization = unit.all_gather_quantization;
  resolved.reduce_quantization = unit.reduce_quantization;
  resolved.offload_params = options.offload_params;
  resolved.gradient_divide_factor = options.gradient_divide_factor;
  resolved.replicate = groups.replicate;
  if (ReshardsAfterForward(unit.strategy)) resolved.post_forward = groups.post_forward;
  return resolved;
}

std::string WrapPlan::ToString() const {
  std::string out = absl::StrCat("FSDP wrap plan: policy '", policy, "', world size ",
                                 world_size, ", root strategy ",
                                 ShardingStrategyName(root_strategy), "\n");
  int64_t total = 0, per_rank = 0;
  for (const PlannedUnit& unit : units) {
    total += unit.numel;
    per_rank += unit.shard_numel;
    absl::StrAppend(
        &out, std::string(2 + 2 * unit.depth, ' '), UnitName(unit.fqn), " (", unit.type,
        "): ", ShardingStrategyName(unit.strategy), unit.overrides.empty() ? "" : " (override)",
        unit.mixed_precision.enabled() ? ", " + unit.mixed_precision.ToString() : "",
        unit.all_gather_quantization != CommQuantization::kNone
            ? absl::StrCat(", all-gather ", CommQuantizationName(unit.all_gather_quantization))
            : "",
        unit.reduce_quantization != CommQuantization::kNone
            ? absl::StrCat(", reduce ", CommQuantizationName(unit.reduce_quantization))
            : "",
        unit.numel > 0 && unit.trainable_numel == 0 ? ", frozen" : "", ", ", unit.param_fqns.size(),
        " params, ", unit.numel, " elements",
        unit.trainable_numel > 0 && unit.trainable_numel < unit.numel
            ? absl::StrCat(" (", unit.trainable_numel, " trainable)")
            : "",
        ", shard ", unit.shard_numel, " per rank\n");
  }
  for (const std::string& p : ignored_params) absl::StrAppend(&out, "  ignored: ", p, "\n");
  for (const std::string& m : left_alone) {
    absl::StrAppend(&out, "  left alone (wrapped by another model): ", m, "\n");
  }
  absl::StrAppend(&out, "  total: ", units.size(), " units, ", total,
                  " elements; persistent per rank: ", per_rank, " elements (",
                  absl::StrFormat("%.1f", total > 0 ? 100.0 * per_rank / total : 0.0),
                  "% of unsharded)\n");
  return out;
}

}  // namespace fsdp
