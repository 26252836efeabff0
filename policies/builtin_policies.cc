// Registers the built-in policies under the names spec strings use. Linked
// with alwayslink: nothing references these symbols.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "policies/registry.h"
#include "policies/wrap_policy.h"

namespace fsdp {
namespace {

absl::StatusOr<std::unique_ptr<WrapPolicy>> BuildModulePolicy(const PolicySpec& spec) {
  if (absl::Status s = spec.CheckKeys({}); !s.ok()) return s;
  if (spec.positional.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "wrap policy spec '", spec.text,
        "': 'module' needs at least one module type name, e.g. module:Block,Embedding"));
  }
  absl::StatusOr<UnitOptions> options = spec.GetUnitOptions();
  if (!options.ok()) return options.status();
  return std::unique_ptr<WrapPolicy>(ModuleTypePolicy::Named(spec.positional, *options));
}

absl::StatusOr<std::unique_ptr<WrapPolicy>> BuildSizePolicy(const PolicySpec& spec) {
  if (absl::Status s = spec.CheckKeys({"min_numel", "exclude", "force_leaf"}); !s.ok()) return s;
  if (absl::Status s = spec.CheckNoPositional(); !s.ok()) return s;
  SizeBasedOptions size;
  absl::StatusOr<int64_t> min_numel = spec.GetInt("min_numel", size.min_numel);
  if (!min_numel.ok()) return min_numel.status();
  if (*min_numel < 1) {
    return absl::InvalidArgumentError(absl::StrCat("wrap policy spec '", spec.text,
                                                   "': min_numel must be at least 1"));
  }
  size.min_numel = *min_numel;
  size.exclude_names = spec.GetList("exclude", size.exclude_names);
  size.force_leaf_names = spec.GetList("force_leaf", size.force_leaf_names);
  absl::StatusOr<UnitOptions> options = spec.GetUnitOptions();
  if (!options.ok()) return options.status();
  size.options = *options;
  return std::unique_ptr<WrapPolicy>(new SizeBasedPolicy(std::move(size)));
}

absl::StatusOr<std::unique_ptr<WrapPolicy>> BuildNoUnitsPolicy(const PolicySpec& spec) {
  if (!spec.positional.empty() || !spec.named.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("wrap policy spec '", spec.text, "': 'none' takes no arguments"));
  }
  return std::unique_ptr<WrapPolicy>(new NoUnitsPolicy());
}

}  // namespace

FSDP_REGISTER_WRAP_POLICY(module, "every module of the named types: module:Block,Embedding",
                          BuildModulePolicy);
FSDP_REGISTER_WRAP_POLICY(size,
                          "post-order by unwrapped parameter count: "
                          "size:min_numel=N[,exclude=A|B][,force_leaf=C|D]",
                          BuildSizePolicy);
FSDP_REGISTER_WRAP_POLICY(none, "no submodule is a unit: the whole model is one unit",
                          BuildNoUnitsPolicy);

}  // namespace fsdp
