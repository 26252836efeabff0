// FlatParamHandle: the parameters of one FSDP unit as one flat, sharded
// tensor. NOTE [Flat parameter] below is the layout; everything else in FSDP
// (the runtime's hooks, state dicts, optimizer state) works through it. Its
// unshard, reshard and gradient reduction are called by one class only,
// the model's UnitScheduler (fsdp/unit_scheduler.h), which chooses streams,
// labels and rate limits; this class does the tensor and collective work.
// It is split by question, as FSDP2 splits FSDPParam / FSDPParamGroup /
// foreach_reduce:
//   * fsdp/flat_layout.h (FlatLayout): where each parameter lies in the
//     flat parameter and in a rank's shard; pure arithmetic, no tensors.
//   * this class: the storage (the shard, the full parameter and which of
//     them the parameters point at: FullParamState) and the unshard and
//     reshard collectives.
//   * fsdp/gradient_reduction.h (GradientReduction): the gradient
//     reduction pipeline, from .grad to the accumulated sharded gradient.
// Internal to the core: not installed, not a public target.
//
// NOTE [Flat parameter]
// The unit's parameters p_0 .. p_{k-1} (module registration order) are laid
// end to end in one flat buffer, in up to two *segments*: the trainable
// parameters (requires_grad at Create) first, then the frozen ones, each
// group in registration order (a group without elements has no segment; its
// empty parameters lie in the other, taking no room). A segment of F_s
// elements is padded with zeros to P_s = W * S_s elements, where W is the
// shard group's size and S_s = ceil(F_s / W); the flat buffer has
// P = sum P_s elements. Rank r owns elements [r*S_s, (r+1)*S_s) of every
// segment; its *shard* is those parts end to end (S = sum S_s elements,
// padding included), the only persistent parameter storage the unit has on
// that rank. A unit whose parameters are all trainable (or all frozen) has
// one segment, and the layout is the plain "parameters end to end, padded,
// split in W".
//
//   unsharded:  a full buffer of P elements is all-gathered (one all-gather
//               per segment); p_i's data is the view full[o_i, o_i + n_i)
//               in p_i's shape, where o_i (FlatParamInfo::offset) is its
//               segment's first element plus the elements of the same
//               segment's parameters before it.
//   resharded:  the full buffer's storage is freed (resized to 0 bytes, the
//               storage object kept, so every view of it, including views
//               autograd saved during forward, is valid again after the next
//               unshard); p_i's data is the 1-D view of the shard that
//               intersects [o_i, o_i + n_i) — possibly empty. Each
//               parameter lies in one segment, so the part of it a rank
//               owns is contiguous.
//
// Segments exist so that a unit can hold frozen and trainable parameters
// together (a frozen base layer and its trainable low-rank adapter) and
// still reduce, and keep gradients for, only the trainable segment: the
// frozen one is all-gathered for compute and never reduced.
//
// The parameter tensors keep their identity (set_data swaps their data), so
// modules still hold them, their names stay those of the unwrapped model,
// and an optimizer built over them after wrapping steps this rank's shard.
//
// Gradients (trainable parameters only): after backward, ReduceGradients
// flattens the parameters' full gradients into the trainable segment's
// layout and reduce-scatters them (sum, divided by W in two steps — a
// pre-divide before and a post-divide after the collective, as PyTorch does,
// so that low-precision sums neither overflow nor underflow), adding the
// result to the unit's *sharded gradient*: one flat buffer laid out like the
// trainable segment's part of the shard (the shard's first S_0 elements),
// which accumulates across backward passes until the optimizer steps (all
// of it GradientReduction's work, fsdp/gradient_reduction.h).
// From the next Reshard on, p_i.grad is p_i's part of it, shaped like p_i's
// data. These gradients share the buffer's memory but are not autograd views
// (they are made with set_): libtorch's Optimizer::zero_grad() detaches
// gradients in place, which views forbid, and zeroes them — the buffer
// with them. PrepareGradientsForBackward sets the accumulated gradients
// aside so that autograd accumulates fresh full-shape ones; what the user
// did to p_i.grad in between (zeroed it, cleared it, replaced it) is what
// accumulation continues from.
//
// NO_SHARD: the shard is the whole unpadded flat buffer (W = 1, so the
// segments are unpadded), the parameters always view it, and gradients are
// all-reduced instead.
//
// Options: the unit's ResolvedUnitOptions (fsdp/fsdp_options.h), copied
// once at Create. Hybrid sharding: the group passed to Create is the shard
// group and `replicate` the replicate group (the ranks holding the same
// shard); reduced gradients are then all-reduced over it and averaged over
// both groups' ranks. Required by the hybrid strategies, allowed with any;
// like `post_forward` (ReshardAfterForward), it must outlive the handle.
//
// Mixed precision (ResolvedUnitOptions::mixed_precision): unset param_dtype
// computes in the parameters' dtype; an unset reduce_dtype() reduces in the
// dtype of the gradients autograd produced.
//  * param_dtype: the shard is cast to it and all-gathered in it (NO_SHARD:
//    cast), and the parameters point at that low-precision copy between
//    Unshard and Reshard — except under kSummonFullParams, which always
//    unshards in full precision (summon_full_params, FULL state dicts).
//  * reduce_dtype(): the gradient reduction runs in it.
//  * keep_low_precision_grads: the reduced gradient stays in reduce_dtype;
//    otherwise it is upcast to the parameters' dtype.
// gradient_divide_factor is handed to the comm hook.
//
// All-gather quantization (ResolvedUnitOptions::all_gather_quantization,
// sharded strategies only): StartUnshard codes the shard (the snapshot, or
// its copy on the compute device when offloading) in bf16 or int8 and
// all-gathers the messages (fsdp/quantized_gather.h); the wait decodes
// them into the full parameter in the compute dtype. Every rank decodes
// its own part too, so all compute with the same values. Not under
// kSummonFullParams, which gathers exactly; ReshardAfterForward's pieces
// are the decoded values, all-gathered as they are. reduce_quantization:
// the reduction sums through a QuantizedReduceScatter instead of the
// reduce-scatter (GradientReductionOptions::sum_scatter).
//
// CPU offload (ResolvedUnitOptions::offload_params): the *compute
// device* is the device the parameters are on at Create. The shard and the
// sharded gradient live in host memory (pinned when the compute device is
// CUDA), so the parameters point at host tensors between Reshard and the
// next Unshard and an optimizer over them steps on the host. Unshard copies
// the shard to the compute device (cast to param_dtype on the way) and
// all-gathers it there; ReduceGradients reduces on the compute device and
// copies the result to the host. Accumulation across backward passes is
// done on the compute device, stream-ordered (the accumulated host gradient
// is copied in, added to, copied back), so no reduction waits on the host;
// on a device with streams the host copy is therefore complete only once
// the current stream is: FullyShardedModel synchronizes at the end of
// backward, and a caller driving a handle directly must do the same before
// reading the gradients. NO_SHARD offloads alike (its "shard" is the whole
// flat parameter) except under kSummonFullParams, where its parameters
// point at the host copy itself. With the compute device CPU every copy is
// still made (same code path, nothing saved): that is what the CPU tests
// run.
//
// Thread safety: none; the runtime drives a handle from one thread.
#ifndef FSDP_FSDP_FLAT_PARAM_HANDLE_H_
#define FSDP_FSDP_FLAT_PARAM_HANDLE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ATen/core/Tensor.h"
#include "absl/status/statusor.h"
#include "comm/collectives.h"
#include "fsdp/comm_hooks.h"
#include "fsdp/flat_layout.h"
#include "fsdp/fsdp_options.h"
#include "fsdp/gradient_reduction.h"

namespace fsdp {

class QuantizedGather;         // fsdp/quantized_gather.h
class QuantizedReduceScatter;  // Likewise.
class QuantizedAllReduce;      // Likewise.

// Which buffer the parameters point at. Sharded and unsharded as NOTE [Flat
// parameter] says; kShardedKeepingFull: on their shards, with the full
// parameter still allocated and valid (ReshardKeepingFull, WaitForUnshard),
// so that the next unshard needs no all-gather.
enum class FullParamState { kSharded, kUnsharded, kShardedKeepingFull };

// Where the runtime is with one handle (checked at every transition).
enum class HandleTrainingState {
  kIdle,
  kForward,
  kBackwardPre,
  kBackwardPost,
  kSummonFullParams,
};

const char* HandleTrainingStateName(HandleTrainingState state);

class FlatParamHandle {
 public:
  // Flattens `params` into this rank's shard of `unit_name`. `group` is the
  // shard group (its size is W); it must outlive the handle. Fails with
  // kInvalidArgument naming the parameters when they are empty, repeated,
  // not leaves, or of mixed dtype or device. Which parameters are
  // trainable is read here, once: it fixes the segments.
  // All ranks of the group must call it with the same parameter layout.
  static absl::StatusOr<std::unique_ptr<FlatParamHandle>> Create(
      std::string unit_name, std::vector<FlatParamEntry> params, Collectives& group,
      const ResolvedUnitOptions& options = {});

  // The checks of Create, without touching the parameters: lets a caller
  // that creates several handles fail before changing any.
  static absl::Status CheckParams(const std::string& unit_name,
                                  const std::vector<FlatParamEntry>& params,
                                  const Collectives& group);

  FlatParamHandle(const FlatParamHandle&) = delete;
  FlatParamHandle& operator=(const FlatParamHandle&) = delete;
  ~FlatParamHandle();

  // All-gathers the full parameter and points the parameters at it.
  // StartUnshard issues the all-gather; FinishUnshard waits for it and
  // swaps the parameters' data (so another unit's compute can run between
  // them). No-ops when already unsharded or under NO_SHARD; with a kept
  // full parameter (below), StartUnshard issues nothing and FinishUnshard
  // points the parameters at it.
  void StartUnshard();
  // Throws the all-gather's error, leaving the handle sharded with nothing
  // allocated.
  void FinishUnshard();
  void Unshard();

  // Kept full parameters: the full parameter stays allocated and valid
  // while the parameters point at their shards as after Reshard, so that
  // between steps optimizers, state dicts and checkpoints see the shards as
  // always, and the next Unshard needs no all-gather.
  //  * ReshardKeepingFull: Reshard, but keeps the full parameter.
  //    REQUIRES: unsharded, not under kSummonFullParams.
  //  * WaitForUnshard: waits for the pending all-gather and keeps its
  //    result so (no-op without one).
  //  * SnapshotShard: the next StartUnshard sends a copy of the shard made
  //    now rather than the shard itself, so that a write to the shard
  //    before the all-gather reads it reaches no rank's result (for an
  //    all-gather issued ahead of its forward).
  //  * KeptFullMatchesShard: whether this rank's part of the kept full
  //    parameter still equals its shard as the all-gather delivered it
  //    (cast to the compute dtype, or coded and decoded under all-gather
  //    quantization); false once an optimizer step, a load or a
  //    writeback changed the shard since. The kept full parameter is valid
  //    only if this holds on every rank of the shard group (this rank's
  //    answer alone does not say so). Reads both (a device sync on CUDA).
  //    True without a kept full parameter.
  // Reshard frees a kept full parameter.
  void ReshardKeepingFull();
  void WaitForUnshard();
  void SnapshotShard();
  bool holds_kept_full() const { return full_state_ == FullParamState::kShardedKeepingFull; }
  bool KeptFullMatchesShard() const;

  // Waits for a pending StartUnshard (a prefetch that turned out not to be
  // needed) and frees its buffer; no-op without one.
  void DiscardPendingUnshard();
  bool has_pending_unshard() const { return !pending_unshard_.empty(); }

  // Frees the full parameter, points the parameters at this rank's shard
  // and, after ReduceGradients, their gradients at this rank's part of the
  // reduced gradient. No-op when already resharded and nothing is pending.
  void Reshard();
  // Reshard, keeping a copy of the part of every segment of the full
  // parameter (in its compute dtype, on the compute device) that this
  // rank's place j in the k-rank post-forward group (ProcessGroups::
  // post_forward) stands for: elements [j * P_s / k, (j + 1) * P_s / k) of
  // segment s. The next StartUnshard all-gathers those pieces over that
  // group instead of the shards over the shard group, and the copy goes
  // once it has. Without a post-forward group, or not unsharded: Reshard.
  void ReshardAfterForward();
  bool holds_post_forward_shard() const { return post_forward_shard_.defined(); }

  // Once before each backward pass through this unit: sets the parameters'
  // accumulated .grad aside and clears them, so that autograd accumulates
  // fresh full-shape gradients. REQUIRES: unsharded (or NO_SHARD).
  void PrepareGradientsForBackward();

  // After that backward: reduce-scatters (all-reduces for NO_SHARD) the
  // trainable parameters' full gradients, missing ones counting as zero.
  // StartReduceGradients copies the gradients into a flat buffer, clears
  // .grad and issues the reduction through the comm hook;
  // FinishReduceGradients waits for it and adds the result into the
  // sharded gradient, which reaches .grad then if the unit is resharded
  // (or NO_SHARD without offload), else at the next Reshard. Between them
  // the unit may be resharded and other units may run;
  // AdvanceReduction lets the hook move its reduction on
  // (PendingReduction::Advance, fsdp/comm_hooks.h). Start REQUIRES:
  // unsharded (or NO_SHARD), trainable parameters, no reduction pending.
  // Finish throws the reduction's error, leaving none pending.
  // `all_reduce` false (hybrid sharding, FullyShardedModel::
  // SetRequiresAllReduce): GradientReduction::Start's.
  void StartReduceGradients(bool all_reduce = true);
  void AdvanceReduction() { reduction_->Advance(); }
  void FinishReduceGradients();
  void ReduceGradients();
  bool has_pending_reduction() const { return reduction_->pending(); }
  // Reduced within the shard group, kept aside for the replicate group's
  // next all-reduce (StartReduceGradients(false)).
  bool has_partial_reduction() const { return reduction_->has_partial(); }

  // Instead of ReduceGradients, under no_sync: the full gradients stay in
  // .grad (full shape, even after Reshard) and later backward passes add to
  // them, until a ReduceGradients reduces their sum. No communication.
  void KeepGradientsUnreduced();
  bool holds_unreduced_gradients() const { return grad_state_ == GradState::kUnreduced; }

  // For summon_full_params. WritebackShard copies this rank's part of the
  // full parameter (which the caller may have modified in place) into the
  // shard. REQUIRES: unsharded.
  void WritebackShard();
  // Points .grad of every parameter at its full gradient, all-gathered from
  // the sharded gradients (no-op without gradients, and under NO_SHARD).
  // REQUIRES: gradients reduced.
  void UnshardGradients();
  // Undoes UnshardGradients, first copying this rank's part of the full
  // gradients back into the sharded gradient when `writeback`.
  void ReshardGradients(bool writeback);

  // Reduce gradients through `hook` (fsdp/comm_hooks.h) instead of the
  // built-in reduction (DefaultCommHook); null restores it. The hook must
  // outlive its use.
  void SetCommHook(CommHook* hook) { reduction_->SetCommHook(hook); }
  // Replaces ResolvedUnitOptions::gradient_divide_factor from the next
  // reduction on (unset: the average). Must be positive.
  void SetGradientDivideFactor(std::optional<double> factor) {
    reduction_->SetDivideFactor(factor);
  }
  std::optional<double> gradient_divide_factor() const { return reduction_->divide_factor(); }

  HandleTrainingState training_state() const { return training_state_; }
  // Moves to `to`, checking that `from` is the current state; the error
  // names the unit, the rank and both states.
  void Transition(HandleTrainingState from, HandleTrainingState to);

  const std::string& unit_name() const { return unit_name_; }
  ShardingStrategy strategy() const { return options_.strategy; }
  bool is_unsharded() const { return full_state_ == FullParamState::kUnsharded; }
  // Whether Unshard has anything to do now: a strategy that shards, or a
  // low-precision or offload copy to make (not under kSummonFullParams).
  bool UnshardNeeded() const;
  // Where each parameter lies in the flat parameter and in this rank's
  // shard; sharded() is false under NO_SHARD.
  const FlatLayout& layout() const { return layout_; }
  const std::vector<FlatParamEntry>& entries() const { return params_; }

  // This rank's shard (S elements, padding included).
  const at::Tensor& local_shard() const { return local_shard_; }
  // Parameter i's part of this rank's shard: 1-D and possibly empty (the
  // elements [shard_offset, shard_offset + shard_numel) of the flattened
  // parameter), or under NO_SHARD the whole parameter in its shape. Writing
  // into it writes the shard (what state dict loading does).
  at::Tensor LocalShardOf(size_t i) const { return layout_.ShardViewOf(local_shard_, i); }
  // For state laid out like the shard (an optimizer's elementwise state):
  // all-gathers `flat` from every rank of the shard group and returns it
  // laid out like the flat parameter, where layout().FullViewOf finds each
  // parameter's part. `flat` has layout().shard_numel() elements, or
  // layout().trainable_shard_numel() for state of the trainable
  // parameters only (the sharded gradient's layout; only the trainable
  // segment is gathered then, and the result is that segment). Blocking;
  // every rank of the group must call it.
  at::Tensor AllGatherShardLike(const at::Tensor& flat) const;

  // Bytes currently allocated for the full parameter (0 when resharded),
  // with the pieces ReshardAfterForward keeps: what the memory tests sample.
  int64_t full_param_bytes() const;
  // Where the unit computes (the parameters' device at Create) and where
  // its shard and sharded gradient live (the host when offloading).
  c10::Device compute_device() const { return placement_.compute_device; }
  bool offloads_params() const { return options_.offload_params; }
  // Bytes of the shard and of the sharded gradient (0 before the first
  // reduction) by where they live: what the offload tests measure.
  int64_t ShardBytesOn(c10::DeviceType type) const;

 private:
  // Where .grad is with respect to the sharded gradient.
  enum class GradState {
    kSettled,    // .grad is what it was left as (the sharded gradient's parts, or none).
    kToPublish,  // Reduced into the sharded gradient, not yet in .grad.
    kUnreduced,  // .grad holds full, unreduced gradients (no_sync).
  };

  FlatParamHandle(std::string unit_name, std::vector<FlatParamEntry> params,
                  Collectives& group, const ResolvedUnitOptions& options);

  // Issues one all-gather per segment among the first `count`: each rank's
  // part of `shard` (laid out like the shard) into `full` (laid out like
  // the flat parameter). If issuing one throws, waits for those issued
  // before rethrowing.
  std::vector<std::unique_ptr<CollectiveWork>> AllGatherSegments(const at::Tensor& full,
                                                                 const at::Tensor& shard,
                                                                 size_t count) const;
  // Waits for the pending all-gather; if it failed, frees what it was
  // filling and rethrows, leaving the handle sharded. `decode` false: a
  // quantized all-gather's messages are dropped, not decoded (a discarded
  // prefetch).
  void WaitForPendingUnshard(bool decode = true);
  void PointParamsAtFull();
  void PointParamsAtShard();
  // Points the parameters' .grad at their parts of the sharded gradient.
  void PublishGradients();
  std::string Describe() const;  // "unit 'h.0' on rank 1 of 4"

  const std::string unit_name_;
  std::vector<FlatParamEntry> params_;
  Collectives& group_;
  const ResolvedUnitOptions options_;  // The unit's, copied once at Create.
  const UnitPlacement placement_;
  const FlatLayout layout_;
  // Sharded units with trainable parameters and reduce_quantization; read
  // by reduction_'s works, so declared before it.
  std::unique_ptr<QuantizedReduceScatter> quantized_reduce_;
  // The same under hybrid sharding, for the replicate group's sum.
  std::unique_ptr<QuantizedAllReduce> quantized_replicate_sum_;
  // Declared after layout_, which it reads.
  std::unique_ptr<GradientReduction> reduction_;
  // Sharded units with all_gather_quantization; before pending_unshard_,
  // whose works write into its buffer and are destroyed first.
  std::unique_ptr<QuantizedGather> quantized_;

  at::Tensor local_shard_;   // S elements; NO_SHARD: F elements. Host when offloading.
  // P elements in compute_dtype_ on the compute device; storage freed while
  // resharded. Only for strategies that shard, with a param_dtype, or when
  // offloading.
  at::Tensor full_;
  std::vector<at::Tensor> full_views_;   // Parameter i's view of full_.
  std::vector<at::Tensor> shard_views_;  // Parameter i's view of local_shard_.
  at::ScalarType compute_dtype_ = at::kFloat;  // param_dtype, or the shard's.
  bool low_precision_ = false;                 // compute_dtype_ != the shard's.
  at::Tensor summon_full_;   // Full precision, while a summon is unsharded.
  // The cast or device copy of the shard a pending all-gather sends.
  at::Tensor send_buffer_;
  at::Tensor shard_snapshot_;  // SnapshotShard's copy, until its all-gather is done.
  // ReshardAfterForward's pieces, P / k elements in compute_dtype_.
  at::Tensor post_forward_shard_;
  at::Tensor full_grad_;  // The trainable segment, while UnshardGradients is in effect.
  // One per segment (one for a quantized all-gather).
  std::vector<std::unique_ptr<CollectiveWork>> pending_unshard_;
  FullParamState full_state_ = FullParamState::kSharded;
  GradState grad_state_ = GradState::kSettled;
  HandleTrainingState training_state_ = HandleTrainingState::kIdle;
};

}  // namespace fsdp

#endif  // FSDP_FSDP_FLAT_PARAM_HANDLE_H_
