// A plugin built against a different (future) plugin ABI.
#include "policies/policy_plugin.h"

namespace {
void RegisterNothing(fsdp::PolicyRegistrar&) {}
}  // namespace

extern "C" __attribute__((visibility("default"))) const fsdp::PolicyPluginInfo*
fsdp_policy_plugin_info() {
  static const fsdp::PolicyPluginInfo info = {fsdp::kPolicyPluginAbiVersion + 998, "future",
                                              &RegisterNothing};
  return &info;
}
