// An example wrap-policy plugin, built as its own shared object and loaded
// at run time (train_gpt --policy_plugin=...): "fqn_glob" makes every module
// whose FQN matches a glob a unit, e.g.
//
//   fqn_glob:transformer.h.*                     every block of the GPT
//   fqn_glob:transformer.h.*,strategy=NO_SHARD   ...replicated instead
//
// '*' matches any run of characters except '.', '**' any run at all, '?'
// one character. Several patterns may be given: fqn_glob:a.*,b.**
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "policies/policy_plugin.h"

namespace {

bool GlobMatches(const char* pattern, const char* text) {
  if (*pattern == '\0') return *text == '\0';
  if (pattern[0] == '*' && pattern[1] == '*') {
    for (const char* t = text;; ++t) {
      if (GlobMatches(pattern + 2, t)) return true;
      if (*t == '\0') return false;
    }
  }
  if (*pattern == '*') {
    for (const char* t = text;; ++t) {
      if (GlobMatches(pattern + 1, t)) return true;
      if (*t == '\0' || *t == '.') return false;
    }
  }
  if (*text == '\0') return false;
  if (*pattern == '?' || *pattern == *text) return GlobMatches(pattern + 1, text + 1);
  return false;
}

absl::StatusOr<std::unique_ptr<fsdp::WrapPolicy>> BuildFqnGlob(const fsdp::PolicySpec& spec) {
  if (absl::Status s = spec.CheckKeys({}); !s.ok()) return s;
  const std::vector<std::string> patterns = spec.positional;
  if (patterns.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "wrap policy spec '", spec.text, "': fqn_glob needs a pattern, e.g. fqn_glob:h.*"));
  }
  absl::StatusOr<fsdp::UnitOptions> options = spec.GetUnitOptions();
  if (!options.ok()) return options.status();
  return std::unique_ptr<fsdp::WrapPolicy>(new fsdp::LambdaPolicy(
      [patterns](const std::string& fqn, const torch::nn::Module&) {
        for (const std::string& p : patterns) {
          if (GlobMatches(p.c_str(), fqn.c_str())) return true;
        }
        return false;
      },
      *options, spec.text));
}

void RegisterPolicies(fsdp::PolicyRegistrar& registrar) {
  registrar.Register("fqn_glob", "modules whose FQN matches a glob: fqn_glob:transformer.h.*",
                     BuildFqnGlob);
}

}  // namespace

FSDP_POLICY_PLUGIN("example_policies", RegisterPolicies)
