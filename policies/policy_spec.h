// Spec strings: how a wrap policy is named on a command line or in a
// config file, and what a policy factory receives.
//
// Grammar (whitespace around tokens is ignored):
//   spec    := policy ( "+" policy )*          policies applied in sequence
//   policy  := name [ ":" arg ( "," arg )* ]
//   arg     := key "=" value | value           named or positional
//   name, key := [A-Za-z0-9_.-]+
//   value   := any characters but "," and "+"; lists inside a value use "|"
//
// Examples:
//   module:Block                         every Block (see wrap_policy.h, "Module types")
//   module:Block,Embedding,strategy=SHARD_GRAD_OP
//   size:min_numel=1000000,force_leaf=MultiheadAttention
//   module:Block+size:min_numel=100000   blocks, then leftover subtrees
//   none                                 the whole model is one unit
//
// Every policy accepts strategy=<FULL_SHARD|SHARD_GRAD_OP|NO_SHARD>, the
// mixed-precision keys (param_dtype=bf16, ...),
// all_gather_quantization=<none|bf16|int8> and
// reduce_quantization=<none|bf16|int8>: the per-unit overrides for the
// units it chooses. A key a policy does not know,
// a missing value or an empty part is an error naming the spec.
#ifndef FSDP_POLICIES_POLICY_SPEC_H_
#define FSDP_POLICIES_POLICY_SPEC_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "policies/unit_options.h"

namespace fsdp {

// One policy of a spec, parsed.
struct PolicySpec {
  std::string text;  // As written, for messages.
  std::string name;
  std::vector<std::string> positional;
  std::vector<std::pair<std::string, std::string>> named;  // In order written.

  // Fails naming the spec if a named argument is not in `known` (plus
  // "strategy", which every policy takes) or appears twice.
  absl::Status CheckKeys(const std::vector<std::string>& known) const;
  // Fails if there are positional arguments.
  absl::Status CheckNoPositional() const;
  // The value of `key`, if given.
  const std::string* Find(const std::string& key) const;
  absl::StatusOr<int64_t> GetInt(const std::string& key, int64_t default_value) const;
  // "a|b|c" as a list; `default_value` when the key is absent.
  std::vector<std::string> GetList(const std::string& key,
                                   std::vector<std::string> default_value) const;
  // strategy=..., the mixed-precision keys, all_gather_quantization=...
  // and reduce_quantization=..., if given.
  absl::StatusOr<UnitOptions> GetUnitOptions() const;
};

// Splits a spec into its policies (at least one).
absl::StatusOr<std::vector<PolicySpec>> ParsePolicySpecs(absl::string_view spec);

}  // namespace fsdp

#endif  // FSDP_POLICIES_POLICY_SPEC_H_
