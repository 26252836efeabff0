// The one place where a unit's parameters are unsharded and resharded and
// its gradients reduced: the counterpart of FSDP2's FSDPParamGroup
// (unshard, reshard, post_backward). Every caller goes through a model's
// UnitScheduler — the runtime's forward and backward hooks
// (fsdp/fully_shard.cc), SummonFullParams, the FULL state dict
// (statedict/) — and the scheduler
//   * orders the work on the runtime's streams (fsdp/runtime_streams.h):
//     all-gathers on the all-gather stream after what compute last wrote
//     to the shard, reductions on the reduction stream after the
//     gradients, and compute after both;
//   * admits each all-gather through the rate limiter (limit_all_gathers);
//   * labels every collective with the unit and the phase it serves
//     (CollectiveLabel, comm/collectives.h), so fingerprints and errors
//     name them, and traces it (FsdpOptions::trace);
//   * reports every training-state change to FsdpOptions::debug_log.
// FlatParamHandle does the tensor and collective work; it never chooses a
// stream or a label, and nothing else calls its unshard, reshard or
// reduction.
//
// One per model; used only by the thread that runs the model.
#ifndef FSDP_FSDP_UNIT_SCHEDULER_H_
#define FSDP_FSDP_UNIT_SCHEDULER_H_

#include <string>
#include <vector>

#include "c10/core/Device.h"
#include "comm/collectives.h"
#include "fsdp/flat_param_handle.h"
#include "fsdp/fsdp_options.h"
#include "fsdp/runtime_streams.h"

namespace fsdp {

class UnitScheduler {
 public:
  // Streams on `device` (where the units compute); throws c10::Error when
  // the device has none to give. `groups` and the options' trace recorder
  // and debug log must outlive the scheduler.
  UnitScheduler(const ProcessGroups& groups, const FsdpOptions& options, c10::Device device);
  UnitScheduler(const UnitScheduler&) = delete;
  UnitScheduler& operator=(const UnitScheduler&) = delete;

  const RuntimeStreams& streams() const { return streams_; }
  const AllGatherRateLimiter& rate_limiter() const { return limiter_; }

  // Issues the all-gather of the handle's shard, labelled with `phase`
  // ("forward", "backward", "summon_full_params", ...), unless its
  // parameters are full already, an all-gather is pending, or there is
  // nothing to gather (NO_SHARD), or a kept full parameter serves: a
  // prefetch, or the first half of Unshard. With `snapshot`, the shard is
  // copied on the compute stream first (FlatParamHandle::SnapshotShard), so
  // that work issued on it later (an optimizer step) cannot reach the
  // all-gather.
  void IssueUnshard(FlatParamHandle& handle, const std::string& phase, bool snapshot = false);
  // Waits for the handle's pending all-gather and keeps its result aside,
  // the parameters still on their shards (FlatParamHandle::WaitForUnshard).
  void WaitForUnshard(FlatParamHandle& handle);
  // IssueUnshard ahead of the unit's own hook (forward and backward
  // prefetch); the debug log says so when an all-gather was issued.
  void Prefetch(FlatParamHandle& handle, const std::string& phase);
  // The handle's full parameters in place, ready for work issued on the
  // compute stream from now on (waits for its all-gather, issuing it first
  // if needed). What gets gathered (the compute dtype, or full precision
  // under kSummonFullParams) is the handle's state's choice.
  void Unshard(FlatParamHandle& handle, const std::string& phase);
  // Drops an all-gather issued as a prefetch for a unit that did not run.
  void DiscardPrefetch(FlatParamHandle& handle);
  // Frees the handle's full parameters (if it holds any) once compute is
  // done with them, and tells the rate limiter.
  void Reshard(FlatParamHandle& handle);
  // Reshard keeping the full parameters for the next Unshard
  // (FlatParamHandle::ReshardKeepingFull).
  void ReshardKeepingFull(FlatParamHandle& handle);
  // Reshard after forward: FlatParamHandle::ReshardAfterForward, which
  // keeps this rank's piece for ProcessGroups::post_forward.
  void ReshardAfterForward(FlatParamHandle& handle);
  // Between steps: the handle's full gradients in .grad, all-gathered
  // from its sharded ones on the compute stream (FlatParamHandle::
  // UnshardGradients), labelled `phase`; and back, writing this rank's part
  // into the sharded gradient first when `writeback`.
  void UnshardGradients(FlatParamHandle& handle, const std::string& phase);
  void ReshardGradients(FlatParamHandle& handle, bool writeback);
  // Issues the reduction of the handle's gradients (its comm hook,
  // fsdp/comm_hooks.h) on the reduction stream, after the compute stream
  // produced them, and returns with it in flight: backward goes on beside
  // it. First advances the reduction issued before it (each is advanced
  // once, labelled with its own unit), which bounds the flat gradients
  // reductions in flight hold to one (NO_SHARD, which reduces in place,
  // holds its flat gradients until WaitForReductions).
  // `all_reduce`: FlatParamHandle::StartReduceGradients's.
  void ReduceGradients(FlatParamHandle& handle, bool all_reduce = true);
  // Finishes every reduction in flight, in issue order, then makes compute
  // wait for them; with offload_params the host waits too, since the
  // optimizer reads host gradients next. The first failure is thrown after
  // every reduction was waited for.
  void WaitForReductions();
  // Checks that the handle is in `from` and moves it to `to`. Entering
  // kSummonFullParams first drops a pending all-gather, a kept full
  // parameter and post-forward pieces: all are in the compute dtype, and
  // the summon gathers in full precision.
  void Move(FlatParamHandle& handle, HandleTrainingState from, HandleTrainingState to);

 private:
  const ProcessGroups groups_;
  TraceRecorder* const trace_;
  const DebugLog debug_log_;
  const bool offload_params_;
  RuntimeStreams streams_;
  AllGatherRateLimiter limiter_;
  std::vector<FlatParamHandle*> reducing_;  // Reductions in flight, in issue order.
  size_t advanced_ = 0;                     // reducing_[0, advanced_) were advanced.
};

}  // namespace fsdp

#endif  // FSDP_FSDP_UNIT_SCHEDULER_H_
