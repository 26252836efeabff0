#include "policies/wrap_policy.h"

#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace fsdp {
namespace {

bool IsChosen(const PolicyInput& input, const torch::nn::Module* module) {
  for (const UnitTarget& t : input.already_chosen) {
    if (t.module == module) return true;
  }
  return false;
}

bool MatchesAny(const torch::nn::Module& module, const std::vector<std::string>& names) {
  for (const std::string& name : names) {
    if (ModuleNameMatches(module, name)) return true;
  }
  return false;
}

void Walk(const std::string& fqn, const torch::nn::Module& module, const PolicyInput& input,
          const std::function<void(const std::string&, const torch::nn::Module&)>& fn) {
  for (const auto& child : module.named_children()) {
    const std::string child_fqn = fqn.empty() ? child.key() : absl::StrCat(fqn, ".", child.key());
    if (input.is_excluded && input.is_excluded(*child.value())) continue;
    fn(child_fqn, *child.value());
    Walk(child_fqn, *child.value(), input, fn);
  }
}

}  // namespace

void ForEachCandidate(const PolicyInput& input,
                      const std::function<void(const std::string&, const torch::nn::Module&)>& fn) {
  Walk("", *input.root, input, fn);
}

bool ModuleNameMatches(const torch::nn::Module& module, const std::string& pattern) {
  const std::string& name = module.name();
  if (name == pattern) return true;
  absl::string_view last = name;
  const size_t colon = last.rfind("::");
  if (colon != absl::string_view::npos) last.remove_prefix(colon + 2);
  if (last == pattern) return true;
  return absl::StripSuffix(last, "Impl") == pattern && absl::EndsWith(last, "Impl");
}

// --- ModuleTypePolicy ------------------------------------------------------

ModuleTypePolicy::ModuleTypePolicy(std::vector<Matcher> matchers, UnitOptions options,
                                   std::string description)
    : matchers_(std::move(matchers)),
      options_(options),
      description_(std::move(description)) {}

std::unique_ptr<ModuleTypePolicy> ModuleTypePolicy::Named(std::vector<std::string> names,
                                                          UnitOptions options) {
  std::vector<Matcher> matchers;
  for (const std::string& name : names) {
    matchers.push_back([name](const torch::nn::Module& m) { return ModuleNameMatches(m, name); });
  }
  std::string description = absl::StrCat("module:", absl::StrJoin(names, ","));
  if (!options.empty()) absl::StrAppend(&description, ",", options.ToString());
  return std::make_unique<ModuleTypePolicy>(std::move(matchers), options, std::move(description));
}

std::string ModuleTypePolicy::DescribeTypes(const std::vector<std::string>& type_names,
                                            const UnitOptions& options) {
  std::string description = absl::StrCat("modules of type ", absl::StrJoin(type_names, ", "));
  if (!options.empty()) absl::StrAppend(&description, ",", options.ToString());
  return description;
}

absl::StatusOr<std::vector<UnitTarget>> ModuleTypePolicy::Targets(
    const PolicyInput& input) const {
  std::vector<UnitTarget> targets;
  ForEachCandidate(input, [&](const std::string& fqn, const torch::nn::Module& module) {
    if (IsChosen(input, &module)) return;
    for (const Matcher& matches : matchers_) {
      if (matches(module)) {
        targets.push_back({fqn, &module, options_});
        return;
      }
    }
  });
  return targets;
}

// --- SizeBasedPolicy -------------------------------------------------------

SizeBasedPolicy::SizeBasedPolicy(SizeBasedOptions options) : options_(std::move(options)) {}

std::string SizeBasedPolicy::Describe() const {
  std::string text = absl::StrCat("size:min_numel=", options_.min_numel);
  if (!options_.exclude_names.empty()) {
    absl::StrAppend(&text, ",exclude=", absl::StrJoin(options_.exclude_names, "|"));
  }
  if (!options_.force_leaf_names.empty()) {
    absl::StrAppend(&text, ",force_leaf=", absl::StrJoin(options_.force_leaf_names, "|"));
  }
  if (!options_.options.empty()) absl::StrAppend(&text, ",", options_.options.ToString());
  return text;
}

absl::StatusOr<std::vector<UnitTarget>> SizeBasedPolicy::Targets(const PolicyInput& input) const {
  if (options_.min_numel < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(Describe(), ": min_numel must be at least 1, got ", options_.min_numel));
  }
  std::vector<UnitTarget> targets;
  std::set<const void*> counted;  // A shared parameter counts once, where first met.
  auto subtree_numel = [&](const torch::nn::Module& module) {
    int64_t numel = 0;
    for (const at::Tensor& p : module.parameters(/*recurse=*/true)) {
      if (counted.insert(p.unsafeGetTensorImpl()).second) numel += p.numel();
    }
    return numel;
  };
  // Post-order: returns the parameters of the subtree that no unit chosen
  // so far holds.
  std::function<int64_t(const std::string&, const torch::nn::Module&, bool)> visit =
      [&](const std::string& fqn, const torch::nn::Module& module, bool is_root) -> int64_t {
    if (IsChosen(input, &module)) {
      subtree_numel(module);  // Held by that unit: not the parent's.
      return 0;
    }
    int64_t numel = 0;
    for (const at::Tensor& p : module.parameters(/*recurse=*/false)) {
      if (counted.insert(p.unsafeGetTensorImpl()).second) numel += p.numel();
    }
    if (MatchesAny(module, options_.force_leaf_names)) {
      numel += subtree_numel(module);
    } else {
      for (const auto& child : module.named_children()) {
        if (input.is_excluded && input.is_excluded(*child.value())) continue;
        const std::string child_fqn =
            fqn.empty() ? child.key() : absl::StrCat(fqn, ".", child.key());
        numel += visit(child_fqn, *child.value(), false);
      }
    }
    const bool may_wrap = !is_root && !MatchesAny(module, options_.exclude_names) &&
                          (!input.can_be_unit || input.can_be_unit(module));
    if (may_wrap && numel >= options_.min_numel) {
      targets.push_back({fqn, &module, options_.options});
      return 0;
    }
    return numel;
  };
  visit("", *input.root, true);
  return targets;
}

// --- LambdaPolicy, CustomPolicy --------------------------------------------

LambdaPolicy::LambdaPolicy(Predicate predicate, UnitOptions options, std::string description)
    : predicate_(std::move(predicate)), options_(options), description_(std::move(description)) {}

absl::StatusOr<std::vector<UnitTarget>> LambdaPolicy::Targets(const PolicyInput& input) const {
  std::vector<UnitTarget> targets;
  ForEachCandidate(input, [&](const std::string& fqn, const torch::nn::Module& module) {
    if (!IsChosen(input, &module) && predicate_(fqn, module)) {
      targets.push_back({fqn, &module, options_});
    }
  });
  return targets;
}

CustomPolicy::CustomPolicy(Decide decide, std::string description)
    : decide_(std::move(decide)), description_(std::move(description)) {}

absl::StatusOr<std::vector<UnitTarget>> CustomPolicy::Targets(const PolicyInput& input) const {
  std::vector<UnitTarget> targets;
  ForEachCandidate(input, [&](const std::string& fqn, const torch::nn::Module& module) {
    if (IsChosen(input, &module)) return;
    std::optional<UnitOptions> options = decide_(fqn, module);
    if (options) targets.push_back({fqn, &module, *options});
  });
  return targets;
}

// --- SequencePolicy ----------------------------------------------------------

SequencePolicy::SequencePolicy(std::vector<std::unique_ptr<WrapPolicy>> policies)
    : policies_(std::move(policies)) {}

std::string SequencePolicy::Describe() const {
  std::vector<std::string> parts;
  for (const auto& policy : policies_) parts.push_back(policy->Describe());
  return absl::StrJoin(parts, "+");
}

absl::StatusOr<std::vector<UnitTarget>> SequencePolicy::Targets(const PolicyInput& input) const {
  PolicyInput step = input;
  std::vector<UnitTarget> added;
  for (const auto& policy : policies_) {
    absl::StatusOr<std::vector<UnitTarget>> targets = policy->Targets(step);
    if (!targets.ok()) return targets.status();
    for (UnitTarget& target : *targets) {
      if (IsChosen(step, target.module)) continue;  // The first choice stands.
      step.already_chosen.push_back(target);
      added.push_back(std::move(target));
    }
  }
  return added;
}

}  // namespace fsdp
