// Fully sharded training of a libtorch module: wrapping and the per-unit
// runtime (its hooks). The forward scope and the between-steps utilities
// have their own headers (below).
// fsdp/RUNTIME_DESIGN.md explains the design; in short:
//
//   struct BlockImpl : torch::nn::Module, fsdp::ShardableModule {
//     at::Tensor forward(at::Tensor x) {
//       fsdp::UnitForward unit(this);     // unshard this unit (unit_forward.h)
//       ...the block's math, unchanged...
//       return unit.Return(x);            // reshard, arm the backward hooks
//     }
//   };
//
//   auto wrapped = fsdp::FullyShardedModel::Wrap(
//       model.ptr(), group, options, *fsdp::ModuleTypePolicy::Of<BlockImpl>());
//   // group: a Collectives&, or fsdp::ProcessGroups with hybrid sharding's
//   // replicate group or a post-forward group (fsdp/fsdp_options.h).
//   torch::optim::AdamW optimizer(fsdp::UniqueParameters(*model), ...);  // the shards
//   ... loss = ...model->forward(x)...; loss.backward(); optimizer.step(); ...
//
// Each selected submodule becomes a *unit* with one FlatParamHandle over its
// parameters that no nested unit holds; the root holds the rest. In forward,
// a unit's scope all-gathers its parameters and, after its forward, frees
// them again (FULL_SHARD). In backward, a hook on the unit's outputs
// all-gathers them again before the unit's backward runs, hooks on the
// parameters' gradient accumulators reduce-scatter the gradients as soon as
// all of them are in, and a callback at the end of backward handles units
// whose parameters went unused and resets every state to IDLE.
//
// The forward scope is fsdp/unit_forward.h; the between-steps utilities
// (NoSync, SummonFullParams, ClipGradNorm, Apply, UniqueParameters) are
// fsdp/utilities.h.
// Traversal: FullyShardedModel::units() (PyTorch's fsdp_modules, pre-order,
// root first), GetModuleUnit(module) (the registry) and FsdpUnit::is_root().
//
// Errors: every function called before or between steps
// (DeferParameterAllocation, Wrap, the Set* controls, ClipGradNorm, Apply,
// RegisterCommHook, and the state functions of checkpoint/checkpoint.h) returns
// an absl::Status: kFailedPrecondition in the wrong state, naming it. The
// scopes NoSync and SummonFullParams, whose constructors cannot return one,
// throw c10::Error with the same messages; so do forward and backward,
// which run inside libtorch's autograd.
#ifndef FSDP_FSDP_FULLY_SHARD_H_
#define FSDP_FSDP_FULLY_SHARD_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ATen/core/Tensor.h"
#include "absl/status/statusor.h"
#include "comm/collectives.h"
#include "fsdp/comm_hooks.h"
#include "fsdp/fsdp_options.h"
#include "fsdp/trace.h"
#include "fsdp/unit_registry.h"
#include "fsdp/wrap_plan.h"
#include "policies/wrap_policy.h"
#include "torch/csrc/autograd/variable.h"
#include "torch/nn/module.h"

namespace fsdp {

// The core's own machinery (fsdp/flat_param_handle.h, fsdp/unit_scheduler.h)
// is not installed: code outside the core sees a unit's handle and the
// model's scheduler only as these names, as LevelDB's public headers name
// what db/ implements.
class FlatParamHandle;
class UnitScheduler;

// Releases the memory of every parameter and buffer of `module` and its
// submodules, keeping their shapes, dtypes and identities, so that Wrap
// allocates and initializes them unit by unit (FsdpOptions::param_init_fn)
// and no rank ever holds the whole unsharded model: call it on each block
// right after building it. This is the libtorch 1.13 stand-in for PyTorch's
// meta-device construction (libtorch 1.13 cannot move a parameter from the
// meta device to CPU in place). Until Wrap, the module must not be used.
// kInvalidArgument, naming the parameter and leaving the module untouched,
// unless every parameter is a contiguous CPU tensor.
absl::Status DeferParameterAllocation(torch::nn::Module& module);

// The arguments of FullyShardedModel's per-unit setters, one aggregate each
// (FSDP2's set_requires_gradient_sync(requires_gradient_sync, *, recurse=True)
// and its siblings, with the same names), so that a call says what it sets:
//
//   fsdp.SetRequiresGradientSync(block, {.requires_gradient_sync = false});
//   fsdp.SetReshardAfterBackward(*model, {.reshard_after_backward = false,
//                                         .recurse = false});
//
// Designated initializers are C++20; GCC and Clang accept them in C++17 as
// an extension, warning only under -Wpedantic (the Bazel build's C++17 has
// none), as SummonOptions' and StateDictOptions' callers do. Each default is
// a unit's state after Wrap, so a field left out means that state:
// `{.recurse = false}` alone sets one unit back to it.
// `recurse`: `module`'s unit and every unit in its subtree (true), or that
// unit alone (false).
struct RequiresGradientSyncOptions {
  bool requires_gradient_sync = true;
  bool recurse = true;
};
struct RequiresAllReduceOptions {
  bool requires_all_reduce = true;
  bool recurse = true;
};
struct ReshardAfterBackwardOptions {
  bool reshard_after_backward = true;
  bool recurse = true;
};
struct GradientDivideFactorOptions {
  std::optional<double> factor;  // nullopt: the average (FsdpOptions).
  bool recurse = true;
};

// Where the whole model is (per FSDP state in PyTorch's terms).
enum class ModelTrainingState { kIdle, kForwardBackward };

// What a call between steps does with the shards, for RequireIdle: one
// that may write them waits for a hold on them (FullyShardedModel::
// HoldShards) first.
enum class ShardAccess { kMayWrite, kReadsOnly };

const char* ModelTrainingStateName(ModelTrainingState state);  // "IDLE", ...

// One unit: a module, its handle (null if it holds no parameters of its
// own) and its place in the runtime.
class FsdpUnit {
 public:
  FsdpUnit();
  ~FsdpUnit();  // Where FlatParamHandle is complete.
  const std::string& fqn() const { return fqn_; }  // "" for the root.
  const torch::nn::Module& module() const { return *module_; }
  // The core's own; outside fsdp/, a unit's shard is read through
  // UnitShard::Of (fsdp/shard_placement.h).
  FlatParamHandle* handle() const { return handle_.get(); }
  bool is_root() const { return is_root_; }
  // The unit's options, resolved once at Wrap (fsdp/fsdp_options.h); its
  // handle holds a copy made then.
  const ResolvedUnitOptions& options() const { return options_; }
  // The root's strategy or the policy's override for this unit.
  ShardingStrategy strategy() const { return options_.strategy; }
  // The root's mixed precision or the policy's override for this unit.
  const MixedPrecision& mixed_precision() const { return options_.mixed_precision; }
  // FullyShardedModel::SetRequiresGradientSync.
  bool requires_gradient_sync() const { return requires_gradient_sync_; }
  // FullyShardedModel::SetRequiresAllReduce.
  bool requires_all_reduce() const { return requires_all_reduce_; }
  // FullyShardedModel::SetReshardAfterBackward.
  bool reshard_after_backward() const { return reshard_after_backward_; }

 private:
  friend class FullyShardedModel;
  friend class UnitForward;

  std::string fqn_;
  torch::nn::Module* module_ = nullptr;
  ResolvedUnitOptions options_;
  std::unique_ptr<FlatParamHandle> handle_;
  bool is_root_ = false;
  bool requires_gradient_sync_ = true;
  bool requires_all_reduce_ = true;
  bool reshard_after_backward_ = true;
  class FullyShardedModel* model_ = nullptr;
  // The units to prefetch (indices in FullyShardedModel::units_) in forward
  // and in backward: set explicitly (SetModulesToForwardPrefetch, ...), or
  // else the next unit of the first iteration's order.
  std::vector<int> forward_prefetch_;
  std::vector<int> backward_prefetch_;
  bool forward_prefetch_explicit_ = false;
  bool backward_prefetch_explicit_ = false;
  // Forward and backward as trace spans and profiler ranges, open from the
  // pre hook to the post hook.
  TraceSpan forward_span_;
  TraceSpan backward_span_;
  // Per backward pass.
  bool pre_backward_done_ = false;
  int gradients_ready_ = 0;
  // Holds a frozen parameter with elements (NOTE [Frozen parameters in
  // backward] in fully_shard.cc): set with the accumulators' hooks.
  bool holds_frozen_params_ = false;
  // Such a unit's forward inputs whose gradient backward has yet to
  // compute (UnitForward::Input counts them).
  int input_gradients_pending_ = 0;
  // The parameters' gradient accumulators, with the key of FSDP's post hook.
  // Owned here: a variable holds its accumulator weakly, and a new one would
  // not carry the hook. (libtorch's owning pointer to a node is a
  // std::shared_ptr in 1.13, a c10::intrusive_ptr in 2.15.)
  using AccumulatorPtr =
      decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<std::pair<AccumulatorPtr, uintptr_t>> accumulators_;
};

// An all-gather FullyShardedModel::Unshard issued (FSDP2's UnshardHandle).
// Copyable; valid while its model lives.
class UnshardHandle {
 public:
  // Waits for the all-gather, keeping its result for the unit's forward
  // (FullyShardedModel::Unshard). No-op when nothing is pending any more.
  void Wait();

 private:
  friend class FullyShardedModel;
  UnshardHandle(class FullyShardedModel* model, FsdpUnit* unit) : model_(model), unit_(unit) {}
  class FullyShardedModel* model_;
  FsdpUnit* unit_;
};

// The root's state: owns every unit's state (pre-order, root first) and
// the registry entries of the model's modules. Keep it alive while the model
// trains; destroying it unregisters the modules (their parameters stay
// sharded).
class FullyShardedModel {
 public:
  // Wraps `root` as the policy plans it (fsdp/wrap_plan.h has the rules):
  // the root and every module the policy chooses become units with their
  // options, and their parameters are sharded over `groups.shard`, with
  // the replicate and post-forward groups as ProcessGroups describes
  // (fsdp/fsdp_options.h); every group must outlive the model. A single
  // Collectives& converts: Wrap(root, *collectives, options, policy).
  // Fails, leaving the model untouched, with kInvalidArgument for options
  // or groups that do not fit (ValidateFsdpOptions, ValidateProcessGroups),
  // PlanWrap's errors, or when a handle cannot flatten its parameters.
  // Every rank must wrap the same plan (checked at the first forward or
  // Unshard).
  static absl::StatusOr<std::unique_ptr<FullyShardedModel>> Wrap(
      std::shared_ptr<torch::nn::Module> root, const ProcessGroups& groups,
      const FsdpOptions& options, const WrapPolicy& policy);

  FullyShardedModel(const FullyShardedModel&) = delete;
  FullyShardedModel& operator=(const FullyShardedModel&) = delete;
  ~FullyShardedModel();

  const std::vector<std::unique_ptr<FsdpUnit>>& units() const { return units_; }
  ModelTrainingState training_state() const { return training_state_; }
  // OK between steps; otherwise kFailedPrecondition naming `what`, this
  // rank and why: the model is in forward or backward, or a unit is inside
  // SummonFullParams. The one check of every call that runs between steps;
  // with kMayWrite (any call that might write the shards: loads, Apply,
  // SummonFullParams) it first waits for a hold on them (HoldShards).
  absl::Status RequireIdle(const std::string& what,
                           ShardAccess access = ShardAccess::kMayWrite) const;
  // For code that goes on reading this rank's shards (parameters and
  // optimizer state) after the call that started it has returned: a
  // checkpoint written in the background from the shards themselves
  // (checkpoint/async_checkpoint.h). Until `wait` has returned, whatever
  // writes the shards must wait: the end of the next backward pass (so
  // before the optimizer steps, also when that backward fails) and every
  // call that may write them (RequireIdle with kMayWrite: loads among them)
  // call `wait` first, once. A new hold waits for the one before. `wait`
  // may run on an autograd engine thread, while backward() blocks the
  // caller's. Code that writes the shards elsewhere between a hold and the
  // next backward (an in-place update by hand) is not held back.
  void HoldShards(std::function<void()> wait);
  const FsdpOptions& options() const { return options_; }
  // The plan the model was wrapped with (parameter lists without tensors).
  const WrapPlan& plan() const { return plan_; }
  // The groups given to Wrap.
  const ProcessGroups& groups() const { return groups_; }
  Collectives& group() const { return *groups_.shard; }  // The shard group.
  // Hybrid sharding's replicate group (ProcessGroups::replicate); null
  // otherwise.
  Collectives* replicate_group() const { return groups_.replicate; }
  // Where the units' parameters are unsharded, resharded and reduced
  // (fsdp/unit_scheduler.h): for code that needs a unit's full parameters
  // between steps (SummonFullParams, FULL state dicts).
  UnitScheduler& scheduler() const { return *scheduler_; }

  // Bytes of full (all-gathered) parameters allocated right now, over all
  // units: what the memory tests sample.
  int64_t FullParamBytes() const;

  // FSDP2's set_modules_to_forward_prefetch / set_modules_to_backward_
  // prefetch: when `unit_module`'s forward (backward) starts, right after its
  // own all-gather, the all-gathers of `modules`' units are issued in that
  // order, instead of the one next unit the first iteration's order chose,
  // and whatever FsdpOptions::forward_prefetch / backward_prefetch say (an
  // explicit backward list is issued from the pre-backward hook; a unit
  // without parameters of its own issues its lists too). A listed unit that
  // is unsharded, or in backward already ran, is skipped; in forward, one
  // that already ran is gathered again (as FSDP2 does) and holds its full
  // parameters until its backward. The listed all-gathers are issued one
  // after another (limit_all_gathers waits for an earlier reshard before the
  // first only), so a longer list holds more full parameters at once; an
  // empty list turns prefetching off for the unit. Every rank must set the
  // same lists (the collective headers stop a rank that does not). kFailedPrecondition
  // unless IDLE; kNotFound when `unit_module` or one of `modules` is not a
  // unit of this model.
  absl::Status SetModulesToForwardPrefetch(const torch::nn::Module& unit_module,
                                           const std::vector<const torch::nn::Module*>& modules);
  absl::Status SetModulesToBackwardPrefetch(const torch::nn::Module& unit_module,
                                            const std::vector<const torch::nn::Module*>& modules);

  // FSDP2's set_requires_gradient_sync, a persistent NoSync per unit: while
  // requires_gradient_sync is false for a unit, its backward passes keep
  // full gradients in .grad and add to them without communicating, and the
  // first backward after it is true again reduces their sum. `module` is the
  // root or a wrapped module; with `recurse`, every unit in its subtree is
  // set too. Every rank must set the same units alike (a rank that reduces
  // where another does not fails at the collective headers). kFailedPrecondition unless IDLE;
  // kNotFound when `module` is not a unit of this model.
  absl::Status SetRequiresGradientSync(const torch::nn::Module& module,
                                       const RequiresGradientSyncOptions& options);

  // FSDP2's set_requires_all_reduce, for hybrid sharding's gradient
  // accumulation: while requires_all_reduce is false for a unit, its
  // backward passes reduce-scatter within the shard group but leave out the
  // all-reduce across the replicate group, keeping the shard group's sum
  // aside (none of it reaches .grad); the next backward that reduces with it
  // true again adds that sum to its own before its all-reduce, so the
  // accumulated gradient crosses the replicate group once. The kept sum is in the reduction's dtype
  // (MixedPrecision::reduce_dtype) and nothing clears it but that
  // all-reduce: zero_grad does not, and ClipGradNorm refuses while one is
  // kept. Without a replicate group it changes nothing. `module` and
  // `recurse`, the errors, and that every rank must set the same units
  // alike: as SetRequiresGradientSync.
  absl::Status SetRequiresAllReduce(const torch::nn::Module& module,
                                    const RequiresAllReduceOptions& options);

  // FSDP2's set_reshard_after_backward, for gradient accumulation: while
  // reshard_after_backward is false for a unit, a backward pass that leaves
  // its gradients unreduced (requires_gradient_sync false, NoSync) or that
  // it has none for (all its parameters frozen) keeps its full parameters
  // aside, so that the next forward needs no all-gather for it (nor its
  // backward, unless the forward reshards it: FULL_SHARD). A backward that
  // reduces its gradients reshards it: the optimizer steps the shards next.
  // Kept full parameters (here and from Unshard) differ from FSDP2's in two
  // ways. Between steps the parameters point at their shards all the same,
  // so optimizers, state dicts and checkpoints see what they always see.
  // And they cannot go stale: the first forward hook of a step compares
  // each kept unit's own part of them with its shard on every rank (one
  // all-reduce of a flag per kept unit over the shard group; on CUDA, a
  // device sync per kept unit) and gathers again, on every rank, the units
  // whose shard was written anywhere since (an optimizer step, a load).
  // SummonFullParams and FULL state dicts drop them (they gather in full
  // precision). `module`, `recurse`, the
  // errors, and that every rank must set the same units alike: as
  // SetRequiresGradientSync.
  absl::Status SetReshardAfterBackward(const torch::nn::Module& module,
                                       const ReshardAfterBackwardOptions& options);

  // FSDP2's set_gradient_divide_factor per unit: `factor` becomes
  // FsdpOptions::gradient_divide_factor for `module`'s unit (and with `recurse` every
  // unit in its subtree) from its next reduction on; nullopt restores the
  // average. kInvalidArgument unless positive; otherwise as
  // SetRequiresGradientSync.
  absl::Status SetGradientDivideFactor(const torch::nn::Module& module,
                                       const GradientDivideFactorOptions& options);

  // FSDP2's unshard(async_op=True): issues the all-gather of `module`'s
  // unit alone (not its subtree), in the dtype its forward computes in and
  // from a copy of its shard made now, and returns at once. The result is
  // kept as SetReshardAfterBackward describes, for the unit's forward:
  // UnshardHandle::Wait waits for the all-gather (else the step's first
  // forward hook does), and the parameters point at the full values from
  // the unit's forward on, not before. Between steps (to overlap the first
  // all-gather with loading the batch) or inside forward for a unit that
  // has not run yet (a hand-made prefetch); every rank must unshard the
  // same units in the same order. No-op when the unit's full parameters are
  // in place or kept already. kFailedPrecondition while the unit runs or
  // the model is in backward; kNotFound as SetRequiresGradientSync.
  absl::StatusOr<UnshardHandle> Unshard(const torch::nn::Module& module);

  // FSDP2's reshard(): frees the full parameters `module`'s unit (with
  // `recurse`, every unit in its subtree) keeps, waiting for an all-gather
  // Unshard left pending. No communication of its own. Errors as
  // SetRequiresGradientSync.
  absl::Status Reshard(const torch::nn::Module& module, bool recurse = true);

  // Reduces every unit's gradients through `hook` from now on (PyTorch's
  // register_comm_hook on the root; the hook object carries its state). Once,
  // before the first forward. Fails with kInvalidArgument for a null hook or
  // under hybrid sharding (as PyTorch, which has no hook for the two-level
  // reduction), kFailedPrecondition after the first forward or when a hook
  // is already registered.
  absl::Status RegisterCommHook(std::shared_ptr<CommHook> hook);
  const CommHook* comm_hook() const { return comm_hook_.get(); }

  // The dtype `buffer` had before Wrap cast it to a buffer_dtype
  // (MixedPrecision); nullopt for buffers Wrap did not cast.
  std::optional<at::ScalarType> BufferFullPrecisionDtype(const at::Tensor& buffer) const;

 private:
  friend class UnitForward;
  friend class NoSync;
  friend class SummonFullParams;
  friend class UnshardHandle;
  // The between-steps utilities of fsdp/utilities.h.
  friend absl::StatusOr<at::Tensor> ClipGradNorm(FullyShardedModel& model, double max_norm,
                                                 double norm_type);
  friend absl::Status Apply(FullyShardedModel& model,
                            const std::function<void(torch::nn::Module&)>& fn);
  FullyShardedModel(std::shared_ptr<torch::nn::Module> root, const ProcessGroups& groups,
                    const FsdpOptions& options);

  // At the first forward or Unshard: checks that every rank wrapped the
  // same plan with the same options (one all-gather), and the post-forward
  // group (CheckPostForwardGroup).
  void LazyInit();
  void PreForward(FsdpUnit& unit);
  // At the start of a step's forward: finishes pending Unshards and drops
  // kept full parameters whose shard was written on any rank since
  // (SetReshardAfterBackward).
  void ValidateKeptFullParams();
  // Throws naming the parameter when one's requires_grad changed since Wrap.
  void CheckTrainableAsWrapped(const FsdpUnit& unit) const;
  // Puts PostBackward on the accumulators this forward's graph uses.
  void HookGradientAccumulators(FsdpUnit& unit);
  void PostForward(FsdpUnit& unit, const std::vector<at::Tensor>& outputs);
  void PreBackward(FsdpUnit& unit);
  void PostBackward(FsdpUnit& unit);
  // The gradient of one of a unit's forward inputs is computed (NOTE
  // [Frozen parameters in backward]).
  void InputGradientDone(FsdpUnit& unit);
  void FinishBackward();
  void ReduceOrKeep(FsdpUnit& unit);
  // After the unit's backward: frees its full parameters unless
  // SetReshardAfterBackward's reshard_after_backward = false keeps them.
  void ReshardAfterBackward(FsdpUnit& unit);
  // "backward" for an all-gather that serves backward, else "forward".
  std::string UnshardPhase(const FlatParamHandle& handle) const;
  // Ends the first forward: fixes the prefetch targets and checks the order
  // across ranks.
  void RecordExecutionOrder();
  void Prefetch(const std::vector<int>& unit_indices);
  // The unit of `module`, or null.
  FsdpUnit* UnitOf(const torch::nn::Module& module) const;
  // `module`'s unit, and with `recurse` every unit in its subtree; kNotFound
  // naming `caller` when `module` is not a unit.
  absl::StatusOr<std::vector<FsdpUnit*>> UnitsOf(const char* caller,
                                                 const torch::nn::Module& module, bool recurse);
  absl::Status SetModulesToPrefetch(const char* caller, const torch::nn::Module& unit_module,
                                    const std::vector<const torch::nn::Module*>& modules,
                                    bool forward);
  // Reported to FsdpOptions::debug_log.
  void SetModelState(ModelTrainingState to);
  int IndexOf(const FsdpUnit& unit) const;
  std::string Describe(const FsdpUnit& unit) const;

  std::shared_ptr<torch::nn::Module> root_;
  const ProcessGroups groups_;
  const FsdpOptions options_;
  std::vector<std::unique_ptr<FsdpUnit>> units_;
  WrapPlan plan_;
  std::unique_ptr<UnitScheduler> scheduler_;
  bool initialized_ = false;  // LazyInit ran (at the first forward or Unshard).
  bool forward_ran_ = false;
  bool order_recorded_ = false;
  std::vector<int> pre_forward_order_;   // First iteration, unit indices.
  std::vector<int> post_forward_order_;  // First iteration, unit indices.
  bool no_sync_ = false;
  bool backward_callback_queued_ = false;
  int64_t backward_passes_ = 0;
  // HoldShards' wait, called once (by const RequireIdle too).
  mutable std::function<void()> shard_hold_;
  void WaitForShardHold() const;
  std::shared_ptr<CommHook> comm_hook_;
  std::map<const c10::TensorImpl*, at::ScalarType> buffer_full_dtypes_;
  ModelTrainingState training_state_ = ModelTrainingState::kIdle;
};

}  // namespace fsdp

#endif  // FSDP_FSDP_FULLY_SHARD_H_
