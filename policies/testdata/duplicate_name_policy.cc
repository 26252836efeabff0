// Registers "fresh_policy" and then "module", which the built-ins own: the
// loader must register neither.
#include <memory>

#include "policies/policy_plugin.h"

namespace {

absl::StatusOr<std::unique_ptr<fsdp::WrapPolicy>> Build(const fsdp::PolicySpec&) {
  return std::unique_ptr<fsdp::WrapPolicy>(new fsdp::NoUnitsPolicy());
}

void RegisterPolicies(fsdp::PolicyRegistrar& registrar) {
  registrar.Register("fresh_policy", "would be new", Build);
  registrar.Register("module", "clashes with the built-in", Build);
}

}  // namespace

FSDP_POLICY_PLUGIN("duplicates", RegisterPolicies)
