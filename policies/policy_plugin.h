// The contract between the policy registry and a wrap-policy plugin: a
// shared library, loaded at run time by path (LoadPolicyPlugin in
// policies/registry.h), that registers its policies through one versioned
// entry point. A plugin:
//
//   #include "policies/policy_plugin.h"
//   namespace {
//   void RegisterPolicies(fsdp::PolicyRegistrar& registrar) {
//     registrar.Register("fqn_glob", "modules whose FQN matches a glob",
//                        [](const fsdp::PolicySpec& spec) { ...build the policy... });
//   }
//   }  // namespace
//   FSDP_POLICY_PLUGIN("example_policies", RegisterPolicies)
//
// It is built as its own shared object (cc_binary with linkshared = True)
// against the same libtorch and headers as the program loading it: the
// interface below passes C++ types across the boundary, and
// kPolicyPluginAbiVersion changes whenever it, PolicySpec, UnitOptions or
// WrapPolicy change. A plugin registers only through the registrar it is
// given, never through PolicyRegistry::Global() or the static registration
// macro (the program's registry symbols are not exported to it).
#ifndef FSDP_POLICIES_POLICY_PLUGIN_H_
#define FSDP_POLICIES_POLICY_PLUGIN_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "policies/policy_spec.h"
#include "policies/wrap_policy.h"

namespace fsdp {

inline constexpr int kPolicyPluginAbiVersion = 1;

// Builds a policy from its parsed spec; fails naming the spec on bad
// arguments.
using PolicyFactory =
    std::function<absl::StatusOr<std::unique_ptr<WrapPolicy>>(const PolicySpec& spec)>;

// What a plugin registers into. Virtual so that calls need no symbol of the
// loading program.
class PolicyRegistrar {
 public:
  virtual ~PolicyRegistrar() = default;
  virtual void Register(const std::string& name, const std::string& help,
                        PolicyFactory factory) = 0;
};

// What the entry point returns. abi_version stays the first member in
// every version, so a loader can always read it.
struct PolicyPluginInfo {
  int abi_version;
  const char* plugin_name;
  void (*register_policies)(PolicyRegistrar& registrar);
};

}  // namespace fsdp

// The entry point's name; a library without it is not a policy plugin.
#define FSDP_POLICY_PLUGIN_ENTRY_POINT "fsdp_policy_plugin_info"

#define FSDP_POLICY_PLUGIN(plugin_name, register_fn)                              \
  extern "C" __attribute__((visibility("default"))) const ::fsdp::PolicyPluginInfo* \
  fsdp_policy_plugin_info() {                                                     \
    static const ::fsdp::PolicyPluginInfo info = {::fsdp::kPolicyPluginAbiVersion,  \
                                                  plugin_name, &register_fn};     \
    return &info;                                                                 \
  }

#endif  // FSDP_POLICIES_POLICY_PLUGIN_H_
