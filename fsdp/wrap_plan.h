// The wrap plan: which modules of a model become FSDP units, which
// parameters each holds, with which options, and how large each rank's
// shard is. FullyShardedModel::Wrap computes it and then applies it in one
// step; PlanWrap computes it alone (no process group, nothing changed), so
// a user can print and tune a policy before training:
//
//   auto plan = fsdp::PlanWrap(*model, /*world_size=*/8, options, *policy);
//   std::cout << plan->ToString();
//
// Rules (checked here, before anything is wrapped):
// * The root is always a unit; the policy's targets are the others, in
//   pre-order. A target must be a ShardableModule (FSDP can only hook such
//   a module's forward) inside the root, not ignored, not chosen twice.
// * A parameter belongs to the deepest unit that contains every module
//   registering it: a shared parameter (a tied embedding) goes to the
//   lowest unit holding all its users, which is unsharded whenever any of
//   them runs.
// * A unit may hold frozen and trainable parameters (requires_grad as it
//   is at wrap time): its flat parameter keeps them in two segments, and
//   only the trainable one is reduced (NOTE [Flat parameter],
//   fsdp/flat_param_handle.h). A wholly frozen unit is never reduced.
// * Ignored modules (FsdpOptions::ignored_modules) and subtrees already
//   wrapped by another FSDP model are left alone: no unit inside them, and
//   their parameters in no unit.
#ifndef FSDP_FSDP_WRAP_PLAN_H_
#define FSDP_FSDP_WRAP_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ATen/core/Tensor.h"
#include "absl/status/statusor.h"
#include "fsdp/fsdp_options.h"
#include "policies/wrap_policy.h"
#include "torch/nn/module.h"

namespace fsdp {

// Marks a module type whose forward opens a UnitForward scope
// (fsdp/unit_forward.h): only such modules can be units, since FSDP cannot
// interpose on a C++ forward call.
class ShardableModule {
 public:
  virtual ~ShardableModule() = default;
};

// How messages, traces and handles name a unit: its FQN, "<root>" for "".
std::string UnitName(const std::string& fqn);

struct PlannedUnit {
  std::string fqn;        // "" for the root.
  std::string type;       // torch::nn::Module::name().
  torch::nn::Module* module = nullptr;
  int depth = 0;          // Units above it.
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  MixedPrecision mixed_precision;  // The root's, or the policy's override.
  CommQuantization all_gather_quantization = CommQuantization::kNone;  // Likewise.
  CommQuantization reduce_quantization = CommQuantization::kNone;      // Likewise.
  UnitOptions overrides;  // What the policy set for this unit.
  std::vector<std::string> param_fqns;
  std::vector<at::Tensor> params;
  int64_t numel = 0;            // Unpadded.
  int64_t trainable_numel = 0;  // Of those, in parameters that require grad.
  // Per rank, padding included (NO_SHARD: numel): each of the trainable
  // and the frozen segment is padded (NOTE [Flat parameter]).
  int64_t shard_numel = 0;
};

struct WrapPlan {
  std::string policy;  // The policy's Describe().
  int world_size = 1;
  ShardingStrategy root_strategy = ShardingStrategy::kFullShard;
  std::vector<PlannedUnit> units;  // Pre-order, root first.
  std::vector<std::string> ignored_params;  // In ignored modules: not sharded.
  std::vector<std::string> left_alone;      // Subtrees wrapped by another model.

  // The index in `units` of the deepest unit whose module contains every
  // one of `names` (the FQNs of one parameter or buffer, several when
  // shared); 0, the root, when no other does.
  size_t OwnerOf(const std::vector<std::string>& names) const;

  // The module tree's units, indented by nesting, with their types,
  // strategies (overrides marked), parameter counts and shard sizes, and
  // totals: what the main job prints before training.
  std::string ToString() const;
};

// Fails with kInvalidArgument naming the module or parameters when a rule
// above is broken, kAlreadyExists when the root is already wrapped, or the
// policy's own error.
absl::StatusOr<WrapPlan> PlanWrap(torch::nn::Module& root, int world_size,
                                  const FsdpOptions& options, const WrapPolicy& policy);

// `unit`'s options, resolved once (Wrap keeps them in the unit): the
// plan's strategy and mixed precision (the root's or the policy's), the
// root's offload and divide factor, and which of `groups` the unit uses.
ResolvedUnitOptions ResolveUnitOptions(const PlannedUnit& unit, const FsdpOptions& options,
                                       const ProcessGroups& groups);

}  // namespace fsdp

#endif  // FSDP_FSDP_WRAP_PLAN_H_
