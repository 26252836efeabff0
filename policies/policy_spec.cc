#include "policies/policy_spec.h"

#include <optional>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace fsdp {
namespace {

bool IsIdentifier(absl::string_view text) {
  if (text.empty()) return false;
  for (char c : text) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-') {
      return false;
    }
  }
  return true;
}

absl::Status SpecError(absl::string_view spec, absl::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("wrap policy spec '", spec, "': ", problem,
                   " (grammar: name[:arg,key=value,...][+name...]; see policies/policy_spec.h)"));
}

}  // namespace

absl::StatusOr<std::vector<PolicySpec>> ParsePolicySpecs(absl::string_view spec) {
  std::vector<PolicySpec> specs;
  if (absl::StripAsciiWhitespace(spec).empty()) return SpecError(spec, "empty spec");
  for (absl::string_view part : absl::StrSplit(spec, '+')) {
    part = absl::StripAsciiWhitespace(part);
    if (part.empty()) return SpecError(spec, "empty policy between '+'");
    PolicySpec parsed;
    parsed.text = std::string(part);
    const size_t colon = part.find(':');
    parsed.name = std::string(absl::StripAsciiWhitespace(part.substr(0, colon)));
    if (!IsIdentifier(parsed.name)) {
      return SpecError(spec, absl::StrCat("bad policy name '", parsed.name, "'"));
    }
    if (colon != absl::string_view::npos) {
      for (absl::string_view arg : absl::StrSplit(part.substr(colon + 1), ',')) {
        arg = absl::StripAsciiWhitespace(arg);
        if (arg.empty()) {
          return SpecError(spec, absl::StrCat("empty argument in '", part, "'"));
        }
        const size_t eq = arg.find('=');
        if (eq == absl::string_view::npos) {
          parsed.positional.emplace_back(arg);
          continue;
        }
        absl::string_view key = absl::StripAsciiWhitespace(arg.substr(0, eq));
        absl::string_view value = absl::StripAsciiWhitespace(arg.substr(eq + 1));
        if (!IsIdentifier(key)) return SpecError(spec, absl::StrCat("bad key in '", arg, "'"));
        if (value.empty()) return SpecError(spec, absl::StrCat("no value in '", arg, "'"));
        parsed.named.emplace_back(std::string(key), std::string(value));
      }
    }
    specs.push_back(std::move(parsed));
  }
  return specs;
}

namespace {
// The per-unit option keys every policy takes (GetUnitOptions).
constexpr const char* kUnitOptionKeys[] = {"strategy",
                                           "param_dtype",
                                           "reduce_dtype",
                                           "buffer_dtype",
                                           "output_dtype",
                                           "keep_low_precision_grads",
                                           "cast_forward_inputs",
                                           "all_gather_quantization",
                                           "reduce_quantization"};
}  // namespace

absl::Status PolicySpec::CheckKeys(const std::vector<std::string>& known) const {
  std::set<std::string> seen;
  for (const auto& [key, value] : named) {
    if (!seen.insert(key).second) {
      return SpecError(text, absl::StrCat("'", key, "' given twice"));
    }
    bool ok = false;
    for (const char* k : kUnitOptionKeys) ok = ok || key == k;
    for (const std::string& k : known) ok = ok || k == key;
    if (!ok) {
      std::string valid = absl::StrJoin(kUnitOptionKeys, ", ");
      for (const std::string& k : known) absl::StrAppend(&valid, ", ", k);
      return SpecError(text, absl::StrCat("policy '", name, "' has no argument '", key,
                                          "' (it takes: ", valid, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status PolicySpec::CheckNoPositional() const {
  if (positional.empty()) return absl::OkStatus();
  return SpecError(text, absl::StrCat("policy '", name, "' takes only key=value arguments, got '",
                                      positional.front(), "'"));
}

const std::string* PolicySpec::Find(const std::string& key) const {
  for (const auto& [k, v] : named) {
    if (k == key) return &v;
  }
  return nullptr;
}

absl::StatusOr<int64_t> PolicySpec::GetInt(const std::string& key, int64_t default_value) const {
  const std::string* value = Find(key);
  if (value == nullptr) return default_value;
  int64_t parsed = 0;
  if (!absl::SimpleAtoi(*value, &parsed)) {
    return SpecError(text, absl::StrCat("'", key, "' must be an integer, got '", *value, "'"));
  }
  return parsed;
}

std::vector<std::string> PolicySpec::GetList(const std::string& key,
                                             std::vector<std::string> default_value) const {
  const std::string* value = Find(key);
  if (value == nullptr) return default_value;
  std::vector<std::string> items;
  for (absl::string_view item : absl::StrSplit(*value, '|', absl::SkipWhitespace())) {
    items.emplace_back(absl::StripAsciiWhitespace(item));
  }
  return items;
}

absl::StatusOr<UnitOptions> PolicySpec::GetUnitOptions() const {
  UnitOptions options;
  if (const std::string* value = Find("strategy")) {
    absl::StatusOr<ShardingStrategy> strategy = ParseShardingStrategy(*value);
    if (!strategy.ok()) return SpecError(text, strategy.status().message());
    options.strategy = *strategy;
  }
  if (const std::string* value = Find("all_gather_quantization")) {
    absl::StatusOr<CommQuantization> quantization = ParseCommQuantization(*value);
    if (!quantization.ok()) return SpecError(text, quantization.status().message());
    options.all_gather_quantization = *quantization;
  }
  if (const std::string* value = Find("reduce_quantization")) {
    absl::StatusOr<CommQuantization> quantization = ParseCommQuantization(*value);
    if (!quantization.ok()) return SpecError(text, quantization.status().message());
    options.reduce_quantization = *quantization;
  }
  // Any mixed-precision key gives the unit a MixedPrecision of its own.
  MixedPrecision mp;
  bool any = false;
  for (auto [key, field] :
       {std::pair<const char*, std::optional<at::ScalarType>*>{"param_dtype", &mp.param_dtype},
        {"reduce_dtype", &mp.reduce_dtype},
        {"buffer_dtype", &mp.buffer_dtype},
        {"output_dtype", &mp.output_dtype}}) {
    const std::string* value = Find(key);
    if (value == nullptr) continue;
    any = true;
    absl::StatusOr<at::ScalarType> dtype = ParseDtypeFlag(*value);
    if (!dtype.ok()) return SpecError(text, absl::StrCat(key, ": ", dtype.status().message()));
    *field = *dtype;
  }
  for (auto [key, field] : {std::pair<const char*, bool*>{"keep_low_precision_grads",
                                                          &mp.keep_low_precision_grads},
                            {"cast_forward_inputs", &mp.cast_forward_inputs}}) {
    const std::string* value = Find(key);
    if (value == nullptr) continue;
    any = true;
    if (*value != "true" && *value != "false") {
      return SpecError(text, absl::StrCat("'", key, "' must be true or false, got '", *value,
                                          "'"));
    }
    *field = *value == "true";
  }
  if (any) options.mixed_precision = mp;
  return options;
}

}  // namespace fsdp
