// Wrap policies: which submodules of a model become FSDP units, and with
// which per-unit options. A policy only decides; the core applies the
// decision in one separate step (as PyTorch's auto-wrap redesign separates
// target_module_to_kwargs from _post_order_apply), so policies stay small,
// may take several passes over the tree, and never touch the wrapping
// machinery. This package does not depend on the core.
//
// The built-ins:
//   ModuleTypePolicy  every module of given types (by C++ type, or by name
//                     for spec strings: see "Module types" below);
//   SizeBasedPolicy   PyTorch's size_based_auto_wrap_policy: in post-order,
//                     a module whose not-yet-wrapped parameters reach
//                     min_numel becomes a unit;
//   LambdaPolicy      a predicate on (FQN, module);
//   CustomPolicy      a function returning per-unit options, or nullopt to
//                     skip the module;
//   SequencePolicy    several policies in turn: each sees what the earlier
//                     ones chose ("blocks by type, then any leftover subtree
//                     above N parameters"); the first to choose a module
//                     sets its options.
//
// Module types. C++ has no run-time class objects, so a type is identified
// in one of two ways: by the C++ type itself (ModuleTypePolicy::Of<T...>,
// a dynamic_cast: it matches T and types derived from it, like Python's
// isinstance), or, where only a string is available (spec strings, plugins),
// by torch::nn::Module::name(): libtorch sets it to the demangled dynamic
// type ("gpt::BlockImpl", "torch::nn::LinearImpl") unless the module passed
// its own name to the Module constructor. A name pattern matches that name
// exactly, its last "::" component ("BlockImpl"), or that component without
// the "Impl" suffix of TORCH_MODULE holders ("Block"); by name, only the
// exact type matches, never derived ones.
#ifndef FSDP_POLICIES_WRAP_POLICY_H_
#define FSDP_POLICIES_WRAP_POLICY_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "c10/util/Type.h"
#include "policies/unit_options.h"
#include "torch/nn/module.h"

namespace fsdp {

// One submodule chosen to become a unit.
struct UnitTarget {
  std::string fqn;                          // Never "" (the root is always a unit).
  const torch::nn::Module* module = nullptr;
  UnitOptions options;                      // Overrides of the root's options.
};

// What a policy sees.
struct PolicyInput {
  const torch::nn::Module* root = nullptr;
  // The root's options (every field set).
  UnitOptions root_options;
  // Whether FSDP can make this module a unit (the core knows; a policy that
  // selects a module where this is false gets an error naming it). The
  // size-based policy only considers such modules.
  std::function<bool(const torch::nn::Module&)> can_be_unit;
  // Subtrees no policy may look into: ignored modules and subtrees already
  // wrapped by another FSDP model. Their parameters belong to no unit.
  std::function<bool(const torch::nn::Module&)> is_excluded;
  // Units chosen by earlier policies of a sequence; a policy must not
  // return them again.
  std::vector<UnitTarget> already_chosen;
};

class WrapPolicy {
 public:
  virtual ~WrapPolicy() = default;
  // A description for the wrap plan and error messages, e.g. the spec
  // string the policy was built from.
  virtual std::string Describe() const = 0;
  // The units this policy adds, in any order (the core sorts them into
  // pre-order). Fails with a message naming the policy on bad input.
  virtual absl::StatusOr<std::vector<UnitTarget>> Targets(const PolicyInput& input) const = 0;
};

// Calls fn(fqn, module) on every strict submodule of the root in pre-order,
// skipping excluded subtrees: the traversal every built-in uses.
void ForEachCandidate(const PolicyInput& input,
                      const std::function<void(const std::string&, const torch::nn::Module&)>& fn);

// True if `module`'s name() matches `pattern` as described at the top.
bool ModuleNameMatches(const torch::nn::Module& module, const std::string& pattern);

class ModuleTypePolicy final : public WrapPolicy {
 public:
  using Matcher = std::function<bool(const torch::nn::Module&)>;

  // Every module that is a T (or derives from it), for each T: the wrap
  // policy of the usual program,
  //   FullyShardedModel::Wrap(model.ptr(), group, options,
  //                           *ModuleTypePolicy::Of<BlockImpl>());
  // Describe() names the types ("modules of type gpt::BlockImpl").
  template <typename... T>
  static std::unique_ptr<ModuleTypePolicy> Of(UnitOptions options = {}) {
    static_assert(sizeof...(T) > 0, "ModuleTypePolicy::Of needs at least one type");
    std::vector<Matcher> matchers = {[](const torch::nn::Module& m) {
      return dynamic_cast<const T*>(&m) != nullptr;
    }...};
    return std::make_unique<ModuleTypePolicy>(std::move(matchers), options,
                                              DescribeTypes({c10::demangle_type<T>()...}, options));
  }
  // Every module whose name matches one of `names` (see "Module types").
  static std::unique_ptr<ModuleTypePolicy> Named(std::vector<std::string> names,
                                                 UnitOptions options = {});

  ModuleTypePolicy(std::vector<Matcher> matchers, UnitOptions options, std::string description);
  std::string Describe() const override { return description_; }
  absl::StatusOr<std::vector<UnitTarget>> Targets(const PolicyInput& input) const override;

 private:
  // "modules of type A, B", and the options unless empty.
  static std::string DescribeTypes(const std::vector<std::string>& type_names,
                                   const UnitOptions& options);

  std::vector<Matcher> matchers_;
  UnitOptions options_;
  std::string description_;
};

struct SizeBasedOptions {
  // A module becomes a unit when the parameters in its subtree that no
  // unit below it holds number at least this many elements.
  int64_t min_numel = 100000000;
  // Never units themselves, though their children may be (PyTorch's
  // exclude_wrap_modules; ModuleList and ModuleDict by default, as there).
  std::vector<std::string> exclude_names = {"torch::nn::ModuleListImpl",
                                            "torch::nn::ModuleDictImpl"};
  // May become units, but nothing below them is considered (PyTorch's
  // force_leaf_modules).
  std::vector<std::string> force_leaf_names;
  UnitOptions options;
};

class SizeBasedPolicy final : public WrapPolicy {
 public:
  explicit SizeBasedPolicy(SizeBasedOptions options);
  std::string Describe() const override;
  absl::StatusOr<std::vector<UnitTarget>> Targets(const PolicyInput& input) const override;

 private:
  SizeBasedOptions options_;
};

class LambdaPolicy final : public WrapPolicy {
 public:
  using Predicate = std::function<bool(const std::string& fqn, const torch::nn::Module& module)>;
  explicit LambdaPolicy(Predicate predicate, UnitOptions options = {},
                        std::string description = "lambda");
  std::string Describe() const override { return description_; }
  absl::StatusOr<std::vector<UnitTarget>> Targets(const PolicyInput& input) const override;

 private:
  Predicate predicate_;
  UnitOptions options_;
  std::string description_;
};

class CustomPolicy final : public WrapPolicy {
 public:
  // nullopt: not a unit; a value (possibly empty): a unit with those options.
  using Decide = std::function<std::optional<UnitOptions>(const std::string& fqn,
                                                          const torch::nn::Module& module)>;
  explicit CustomPolicy(Decide decide, std::string description = "custom");
  std::string Describe() const override { return description_; }
  absl::StatusOr<std::vector<UnitTarget>> Targets(const PolicyInput& input) const override;

 private:
  Decide decide_;
  std::string description_;
};

class SequencePolicy final : public WrapPolicy {
 public:
  explicit SequencePolicy(std::vector<std::unique_ptr<WrapPolicy>> policies);
  std::string Describe() const override;
  absl::StatusOr<std::vector<UnitTarget>> Targets(const PolicyInput& input) const override;

 private:
  std::vector<std::unique_ptr<WrapPolicy>> policies_;
};

// No submodule becomes a unit: the whole model is the root unit.
class NoUnitsPolicy final : public WrapPolicy {
 public:
  std::string Describe() const override { return "none"; }
  absl::StatusOr<std::vector<UnitTarget>> Targets(const PolicyInput&) const override {
    return std::vector<UnitTarget>{};
  }
};

}  // namespace fsdp

#endif  // FSDP_POLICIES_WRAP_POLICY_H_
