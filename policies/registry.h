// The wrap-policy registry: policies by name, built from spec strings
// (policies/policy_spec.h), registered statically by libraries linked into
// the program or at run time by plugins (policies/policy_plugin.h).
//
//   // In a library (its cc_library needs alwayslink = True, or the linker
//   // drops the registration):
//   FSDP_REGISTER_WRAP_POLICY(blocks, "every Block", [](const fsdp::PolicySpec& spec) {...});
//
//   // In a program:
//   FSDP_RETURN_IF_ERROR(fsdp::LoadPolicyPlugin("libmy_policy.so"));   // optional
//   FSDP_ASSIGN_OR_RETURN(auto policy,
//                         fsdp::PolicyRegistry::Global().Build("module:Block+size:min_numel=1000"));
//
// The built-in policies ("module", "size", "none") register from
// //policies:builtin_policies. Every failure is an error naming its cause:
// an unknown policy name (the error lists the registered ones), a bad spec,
// a duplicate name (a static duplicate is reported by every later Build),
// and for plugins a bad path, a library without the entry point, or an ABI
// version mismatch. A plugin's registrations are all-or-nothing.
//
// Thread safety: all methods may be called concurrently.
#ifndef FSDP_POLICIES_REGISTRY_H_
#define FSDP_POLICIES_REGISTRY_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "policies/policy_plugin.h"
#include "policies/wrap_policy.h"

namespace fsdp {

class PolicyRegistry {
 public:
  // The program-wide registry that static registrations and plugins fill.
  static PolicyRegistry& Global();

  PolicyRegistry() = default;
  PolicyRegistry(const PolicyRegistry&) = delete;
  PolicyRegistry& operator=(const PolicyRegistry&) = delete;

  // Fails with kAlreadyExists if `name` is taken, kInvalidArgument if it is
  // not a valid policy name.
  absl::Status Register(const std::string& name, const std::string& help, PolicyFactory factory);

  // Builds the policy a spec string describes; several policies joined by
  // "+" become a SequencePolicy.
  absl::StatusOr<std::unique_ptr<WrapPolicy>> Build(absl::string_view spec) const;

  struct Entry {
    std::string name;
    std::string help;
    std::string origin;  // "built in / linked in", or the plugin's path.
  };
  std::vector<Entry> List() const;  // Sorted by name.

  // For LoadPolicyPlugin: registers every policy of a plugin or none.
  absl::Status RegisterAll(const std::string& origin,
                           std::vector<std::pair<Entry, PolicyFactory>> entries);
  // A static registration that failed (a duplicate): every Build reports it.
  void RecordStartupError(const std::string& message);

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::pair<Entry, PolicyFactory>> policies_;
  std::vector<std::string> startup_errors_;
};

// dlopens the shared library at `path`, checks its entry point and ABI
// version, and registers its policies into `registry`. The library stays
// loaded for the life of the program.
absl::Status LoadPolicyPlugin(const std::string& path,
                              PolicyRegistry& registry = PolicyRegistry::Global());

namespace internal {
bool RegisterAtStartup(const char* name, const char* help, PolicyFactory factory);
}  // namespace internal

}  // namespace fsdp

#define FSDP_REGISTER_WRAP_POLICY(name, help, factory)                              \
  static const bool fsdp_wrap_policy_registered_##name [[maybe_unused]] =           \
      ::fsdp::internal::RegisterAtStartup(#name, help, factory)

#endif  // FSDP_POLICIES_REGISTRY_H_
