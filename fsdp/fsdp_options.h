// Options shared by every layer of FSDP; the bottom of the fsdp package.
// ShardingStrategy itself lives in policies/unit_options.h, since policies
// choose it per unit without depending on the core.
#ifndef FSDP_FSDP_FSDP_OPTIONS_H_
#define FSDP_FSDP_FSDP_OPTIONS_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "c10/core/Device.h"
#include "c10/core/ScalarType.h"
#include "comm/collectives.h"
#include "fsdp/trace.h"
#include "policies/unit_options.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace fsdp {

// When, in backward, the next unit's all-gather is issued (PyTorch's
// BackwardPrefetch): at the start of the current unit's backward, or after
// its gradients are reduced.
enum class BackwardPrefetch { kNone, kBackwardPre, kBackwardPost };

// The process groups a model runs over (FSDP2's device mesh, as groups),
// passed to FullyShardedModel::Wrap. Every group must outlive the model.
//  * shard: the ranks a unit's parameters are sharded over. Never null.
//  * replicate: hybrid sharding's replicate group; required by (and only
//    allowed with) HYBRID_SHARD and _HYBRID_SHARD_ZERO2 as the root's
//    strategy. The shard group is then this rank's shard group and this its
//    replicate group (comm/hybrid_groups.h makes both); every unit's reduced
//    gradients are all-reduced over it, whatever the unit's own strategy,
//    and averaged over all shard x replicate ranks. Compared across ranks by
//    its size. Null otherwise.
//  * post_forward: FSDP2's reshard_after_forward as an int k: after
//    forward, a unit that frees its full parameters then (FULL_SHARD,
//    HYBRID_SHARD; not the root) keeps 1/k of them instead, the part this
//    rank stands for in this group of k ranks, and its backward all-gathers
//    over this group alone (within a node, say), not the whole shard group:
//    k times the memory of a shard held between forward and backward, for a
//    backward all-gather over k ranks. The group must be this rank's block
//    of k consecutive ranks of the shard group (ranks (r / k) * k ... + k-1
//    in it; HybridShardLayout(W, k)'s shard group, comm/hybrid_groups.h),
//    with 1 < k < W and k dividing W: checked at Wrap (sizes) and at the
//    first forward or Unshard (which ranks, on every rank). Numbers are
//    unchanged: the all-gathers copy values. Compared across ranks by its
//    size. Null: free everything (reshard_after_forward=True).
//
//   fsdp::ProcessGroups groups(*hybrid.shard);  // or just *collectives
//   groups.replicate = hybrid.replicate.get();
//   auto model = fsdp::FullyShardedModel::Wrap(root, groups, options, policy);
struct ProcessGroups {
  // Implicit on purpose: Wrap(module, *collectives, options, policy), the
  // plain case of one group, reads as it always did.
  ProcessGroups(Collectives& shard_group) : shard(&shard_group) {}  // NOLINT(runtime/explicit)

  Collectives* shard;
  Collectives* replicate = nullptr;
  Collectives* post_forward = nullptr;
};

// The root's options; a wrap policy may override the per-unit ones
// (policies/unit_options.h) for the units it chooses. The process groups
// are not options: they are ProcessGroups, given to Wrap beside these.
struct FsdpOptions {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  // PyTorch's mixed_precision (policies/unit_options.h); a policy may
  // replace it per unit. Off by default.
  MixedPrecision mixed_precision;
  // How parameters travel in all-gathers (policies/unit_options.h,
  // CommQuantization: bf16 or int8 instead of the compute dtype); a policy
  // may replace it per unit. Summoned full parameters and full state dicts
  // always gather exactly.
  CommQuantization all_gather_quantization = CommQuantization::kNone;
  // How gradients travel in the reductions of sharded units (CommQuantization:
  // bf16 or int8 chunks through an all-to-all, summed in float32); a policy
  // may replace it per unit.
  CommQuantization reduce_quantization = CommQuantization::kNone;
  // Prefetching follows the order units ran in on the first iteration; at
  // most one unit is prefetched at a time, unless a unit is given its own
  // list (FullyShardedModel::SetModulesToForwardPrefetch, ...).
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  bool forward_prefetch = false;
  // PyTorch's limit_all_gathers: before issuing an all-gather, wait on the
  // host until at most one earlier reshard is still pending on the device,
  // so that at most two units' all-gathers are in flight
  // (fsdp/runtime_streams.h). Free on CPU, where frees are synchronous.
  bool limit_all_gathers = true;
  // At the end of the first forward, compare the order units ran in across
  // ranks (two all-gathers, once) and fail on every rank, naming the first
  // diverging unit and the ranks, if it differs: otherwise equal-sized units
  // run in different orders exchange the wrong shards without any error.
  // If the root's forward opens no UnitForward scope, the check runs at the
  // end of the first backward instead.
  bool check_execution_order = true;
  // Every this many backward passes, at the end of backward, the ranks
  // compare the fingerprints of every collective they issued so far
  // (Collectives::VerifyConsistency, through the store for Gloo groups:
  // about a millisecond) and fail on every rank, naming the first diverging
  // collective and its unit, if they differ. Catches what no timeout does:
  // equal-sized collectives of different units paired silently. 0: never.
  int verify_collectives_every = 0;
  // PyTorch's CPUOffload(offload_params=True): every unit's shard and
  // sharded gradient live in host memory (pinned when computing on CUDA),
  // so an optimizer over the model's parameters steps on the host, with its
  // state there too; each unshard copies the shard to the compute device
  // (where the parameters were at Wrap) and each reduction copies its result
  // back (fsdp/flat_param_handle.h, "CPU offload"). Gradient accumulation
  // works with it, inside NoSync (the full gradients then stay on the
  // compute device until the reducing backward) and outside.
  bool offload_params = false;
  // FSDP2's set_gradient_divide_factor, for every unit: the built-in
  // reduction divides the summed gradients by this instead of by the
  // number of ranks they are averaged over (shard x replicate group), all
  // of it before the sum. 1 reduces to the sum (a loss already divided by
  // the global batch, say). Unset: the average, with PyTorch's split of the
  // division before and after the sum. Must be positive.
  std::optional<double> gradient_divide_factor;
  // PyTorch's device_id: the device the units compute on. Wrap moves each
  // unit's parameters there just before sharding it (set_data: the tensors
  // keep their identities), deferred ones (DeferParameterAllocation) after
  // param_init_fn filled them on the host, and then every buffer outside
  // ignored modules. A model built on the host that does not fit on the
  // device whole can be wrapped so: beyond the shards made so far (none
  // with offload_params), the device holds one unit at a time, twice while
  // it is flattened. Unset: the parameters stay where they are, all on one
  // device. Must name a device with its index (cuda:0, not cuda);
  // parameters already on another accelerator are an error. If a move fails
  // (out of memory), the units before it stay sharded on the device.
  std::optional<c10::Device> device_id;
  // Subtrees FSDP leaves alone: no policy looks into them and their
  // parameters are neither sharded nor reduced (each rank keeps and trains
  // its own copy, as PyTorch's ignored_modules). They must outlive the
  // model.
  std::vector<const torch::nn::Module*> ignored_modules;
  // PyTorch's sync_module_states: at Wrap, before sharding, every rank takes
  // rank 0's parameters (one unit at a time) and buffers (outside ignored
  // modules); under hybrid sharding, global rank 0's. For models whose ranks
  // initialize differently. Every rank must set it alike.
  bool sync_module_states = false;
  // Unit-by-unit initialization (PyTorch's param_init_fn). Parameters (and
  // buffers) released by DeferParameterAllocation (fsdp/fully_shard.h) get
  // memory one unit at a time, in pre-order, and this is called once on each
  // module that directly holds some of them, to fill them in place (e.g.
  // Linear::reset_parameters()); the unit is sharded before the next gets
  // memory, so that no rank holds more than one unit's full parameters.
  // Deferred parameters without it are an error naming them.
  std::function<void(torch::nn::Module&)> param_init_fn;
  // Observability (fsdp/trace.h); neither changes what is computed, and
  // neither is compared across ranks. The recorder must outlive the model.
  TraceRecorder* trace = nullptr;
  DebugLog debug_log;
};

// One unit's options, resolved once at Wrap (ResolveUnitOptions,
// fsdp/wrap_plan.h) from the root's FsdpOptions, the policy's UnitOptions
// override and the model's ProcessGroups, and kept by the unit
// (FsdpUnit::options()); its FlatParamHandle reads a copy made then.
struct ResolvedUnitOptions {
  // The root's strategy, or the policy's override.
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  // The root's mixed precision, or the policy's override, as a whole.
  MixedPrecision mixed_precision;
  // The root's, or the policy's override; likewise.
  CommQuantization all_gather_quantization = CommQuantization::kNone;
  CommQuantization reduce_quantization = CommQuantization::kNone;
  // FsdpOptions::offload_params and the initial gradient_divide_factor
  // (FullyShardedModel::SetGradientDivideFactor changes the handle's, not
  // this).
  bool offload_params = false;
  std::optional<double> gradient_divide_factor;
  // The groups it uses besides the shard group (ProcessGroups): the
  // replicate group under a hybrid root, whatever the unit's own strategy;
  // the post-forward group only for strategies that reshard after forward
  // (ReshardsAfterForward). Null otherwise.
  Collectives* replicate = nullptr;
  Collectives* post_forward = nullptr;

  // The dtype gradients are reduced in: reduce_dtype, or param_dtype when
  // only that is set (PyTorch's default); unset: the gradients' own dtype.
  std::optional<at::ScalarType> reduce_dtype() const {
    return mixed_precision.reduce_dtype ? mixed_precision.reduce_dtype
                                        : mixed_precision.param_dtype;
  }
};

// The options every rank must set alike, as text
// ("strategy=FULL_SHARD,...;"): a wrapped model's ranks compare its hash
// with their wrap plans' before the first collective of training, and fail
// naming the ranks if they differ. It holds every field but the ones that
// may differ between ranks: trace and debug_log, device_id's index (each
// rank computes on its own device; the type is in), and which modules
// ignored_modules points to (their count is in; the plan compares what they
// leave). The replicate and post-forward groups count by their sizes
// (0 when unset). A new field of FsdpOptions or ProcessGroups does not
// compile until it is added here (fsdp_options.cc).
std::string CrossRankOptionsKey(const FsdpOptions& options, const ProcessGroups& groups);

// Whether a unit's all_gather_quantization can apply (policies/
// unit_options.h, CommQuantization): not under NO_SHARD, which all-gathers
// nothing; not for parameters of a non-floating `param_dtype`; bf16 not
// where the unit gathers in a 16-bit dtype already. The error names the unit
// and, for the dtype, `first_param`. Wrap checks every unit before sharding
// any; FlatParamHandle::Create checks its own.
absl::Status CheckAllGatherQuantization(const std::string& unit, ShardingStrategy strategy,
                                        const MixedPrecision& mixed_precision,
                                        CommQuantization quantization, at::ScalarType param_dtype,
                                        const std::string& first_param);
// The same for reduce_quantization: not under NO_SHARD, which
// reduce-scatters nothing; not for non-floating parameters; bf16 not where
// the unit reduces in a 16-bit dtype already.
absl::Status CheckReduceQuantization(const std::string& unit, ShardingStrategy strategy,
                                     const MixedPrecision& mixed_precision,
                                     CommQuantization quantization, at::ScalarType param_dtype,
                                     const std::string& first_param);

// Options that contradict each other or are out of range: the first such,
// named. Wrap refuses them.
absl::Status ValidateFsdpOptions(const FsdpOptions& options);

// Groups that do not fit the options or each other: no shard group, a
// replicate group without a hybrid root strategy or the reverse, the shard
// group passed as the replicate group too, a post-forward group whose size k is not 1 < k < W with k dividing the
// shard group's size W. The first such, named. Wrap refuses them; which
// ranks the post-forward group holds is checked at the first forward.
absl::Status ValidateProcessGroups(const ProcessGroups& groups, const FsdpOptions& options);

}  // namespace fsdp

#endif  // FSDP_FSDP_FSDP_OPTIONS_H_
