#include "policies/registry.h"

#include <dlfcn.h>

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "policies/policy_spec.h"

namespace fsdp {
namespace {

constexpr char kLinkedIn[] = "linked in";

bool IsPolicyName(const std::string& name) {
  if (name.empty()) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-') {
      return false;
    }
  }
  return true;
}

// Collects a plugin's registrations so that they can be committed at once.
class CollectingRegistrar final : public PolicyRegistrar {
 public:
  void Register(const std::string& name, const std::string& help,
                PolicyFactory factory) override {
    entries.push_back({PolicyRegistry::Entry{name, help, ""}, std::move(factory)});
  }
  std::vector<std::pair<PolicyRegistry::Entry, PolicyFactory>> entries;
};

}  // namespace

PolicyRegistry& PolicyRegistry::Global() {
  static auto* registry = new PolicyRegistry();
  return *registry;
}

absl::Status PolicyRegistry::Register(const std::string& name, const std::string& help,
                                      PolicyFactory factory) {
  std::vector<std::pair<Entry, PolicyFactory>> one;
  one.push_back({Entry{name, help, kLinkedIn}, std::move(factory)});
  return RegisterAll(kLinkedIn, std::move(one));
}

absl::Status PolicyRegistry::RegisterAll(const std::string& origin,
                                         std::vector<std::pair<Entry, PolicyFactory>> entries) {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, size_t> names;
  for (size_t i = 0; i < entries.size(); ++i) {
    const std::string& name = entries[i].first.name;
    if (!IsPolicyName(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "wrap policy name '", name, "' from ", origin,
          " is not valid (letters, digits, '_', '.', '-')"));
    }
    if (!entries[i].second) {
      return absl::InvalidArgumentError(
          absl::StrCat("wrap policy '", name, "' from ", origin, " has no factory"));
    }
    auto it = policies_.find(name);
    if (it != policies_.end()) {
      return absl::AlreadyExistsError(absl::StrCat("wrap policy '", name, "' from ", origin,
                                                   " is already registered (from ",
                                                   it->second.first.origin, ")"));
    }
    if (!names.emplace(name, i).second) {
      return absl::AlreadyExistsError(
          absl::StrCat("wrap policy '", name, "' is registered twice by ", origin));
    }
  }
  for (auto& [entry, factory] : entries) {
    entry.origin = origin;
    const std::string name = entry.name;
    policies_.emplace(name, std::make_pair(std::move(entry), std::move(factory)));
  }
  return absl::OkStatus();
}

void PolicyRegistry::RecordStartupError(const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  startup_errors_.push_back(message);
}

std::vector<PolicyRegistry::Entry> PolicyRegistry::List() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Entry> list;
  for (const auto& [name, item] : policies_) list.push_back(item.first);
  return list;
}

absl::StatusOr<std::unique_ptr<WrapPolicy>> PolicyRegistry::Build(absl::string_view spec) const {
  absl::StatusOr<std::vector<PolicySpec>> parsed = ParsePolicySpecs(spec);
  if (!parsed.ok()) return parsed.status();
  std::vector<std::pair<PolicySpec, PolicyFactory>> resolved;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!startup_errors_.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the wrap policy registry is inconsistent: ", absl::StrJoin(startup_errors_, "; ")));
    }
    for (PolicySpec& one : *parsed) {
      auto it = policies_.find(one.name);
      if (it == policies_.end()) {
        std::vector<std::string> known;
        for (const auto& [name, item] : policies_) known.push_back(name);
        return absl::NotFoundError(absl::StrCat(
            "wrap policy spec '", spec, "': no policy named '", one.name, "' (registered: ",
            known.empty() ? "none" : absl::StrJoin(known, ", "),
            "; link //policies:builtin_policies for the built-ins, or load a plugin)"));
      }
      resolved.emplace_back(std::move(one), it->second.second);
    }
  }
  // Factories run outside the lock: they may be slow or consult the registry.
  std::vector<std::unique_ptr<WrapPolicy>> policies;
  for (const auto& [one, factory] : resolved) {
    absl::StatusOr<std::unique_ptr<WrapPolicy>> policy = factory(one);
    if (!policy.ok()) return policy.status();
    if (*policy == nullptr) {
      return absl::InternalError(
          absl::StrCat("wrap policy '", one.name, "' returned no policy for '", one.text, "'"));
    }
    policies.push_back(std::move(*policy));
  }
  if (policies.size() == 1) return std::move(policies.front());
  return std::unique_ptr<WrapPolicy>(new SequencePolicy(std::move(policies)));
}

absl::Status LoadPolicyPlugin(const std::string& path, PolicyRegistry& registry) {
  dlerror();
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    return absl::NotFoundError(absl::StrCat("cannot load wrap policy plugin '", path,
                                            "': ", why != nullptr ? why : "unknown error"));
  }
  using EntryPoint = const PolicyPluginInfo* (*)();
  auto entry = reinterpret_cast<EntryPoint>(dlsym(library, FSDP_POLICY_PLUGIN_ENTRY_POINT));
  if (entry == nullptr) {
    dlclose(library);
    return absl::InvalidArgumentError(absl::StrCat(
        "'", path, "' is not a wrap policy plugin: it has no entry point '",
        FSDP_POLICY_PLUGIN_ENTRY_POINT, "' (define one with FSDP_POLICY_PLUGIN, "
        "policies/policy_plugin.h)"));
  }
  const PolicyPluginInfo* info = entry();
  if (info == nullptr || info->abi_version != kPolicyPluginAbiVersion) {
    const int version = info == nullptr ? -1 : info->abi_version;
    dlclose(library);
    return absl::FailedPreconditionError(absl::StrCat(
        "wrap policy plugin '", path, "' was built for plugin ABI version ", version,
        ", but this program expects version ", kPolicyPluginAbiVersion,
        "; rebuild the plugin against this version of policies/policy_plugin.h"));
  }
  if (info->register_policies == nullptr) {
    dlclose(library);
    return absl::InvalidArgumentError(
        absl::StrCat("wrap policy plugin '", path, "' has no registration function"));
  }
  CollectingRegistrar registrar;
  info->register_policies(registrar);
  const std::string origin = absl::StrCat("plugin ", path);
  absl::Status status = registry.RegisterAll(origin, std::move(registrar.entries));
  if (!status.ok()) {
    // Nothing of it was registered; its factories are gone with `registrar`.
    dlclose(library);
    return status;
  }
  // Stays loaded: the registered factories and the policies they build
  // live in the library.
  return absl::OkStatus();
}

namespace internal {

bool RegisterAtStartup(const char* name, const char* help, PolicyFactory factory) {
  absl::Status status = PolicyRegistry::Global().Register(name, help, std::move(factory));
  if (!status.ok()) PolicyRegistry::Global().RecordStartupError(std::string(status.message()));
  return status.ok();
}

}  // namespace internal
}  // namespace fsdp
