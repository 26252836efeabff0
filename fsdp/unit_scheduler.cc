#include "fsdp/unit_scheduler.h"

#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "c10/core/StreamGuard.h"
#include "c10/core/impl/VirtualGuardImpl.h"
#include "fsdp/trace.h"

namespace fsdp {

UnitScheduler::UnitScheduler(const ProcessGroups& groups, const FsdpOptions& options,
                             c10::Device device)
    : groups_(groups),
      trace_(options.trace),
      debug_log_(options.debug_log),
      offload_params_(options.offload_params),
      streams_(device),
      limiter_(options.limit_all_gathers ? 2 : 0) {}

void UnitScheduler::IssueUnshard(FlatParamHandle& handle, const std::string& phase, bool snapshot) {
  if (!handle.layout().sharded() || handle.is_unsharded() || handle.holds_kept_full() ||
      handle.has_pending_unshard()) {
    return;
  }
  if (snapshot) {
    // On the compute stream, which the all-gather stream waits for below,
    // after what the caller's stream wrote to the shard so far.
    const c10::Device device = streams_.compute().device();
    RuntimeStreams::WaitStream(streams_.compute(),
                               c10::impl::VirtualGuardImpl(device.type()).getStream(device));
    c10::StreamGuard on_compute(streams_.compute());
    handle.SnapshotShard();
  }
  limiter_.BeforeAllGather();
  // The shard may have been written on the compute stream since its last
  // gather (the optimizer step, a state dict load): gather it after that.
  RuntimeStreams::WaitStream(streams_.all_gather(), streams_.compute());
  c10::StreamGuard on_all_gather(streams_.all_gather());
  CollectiveLabel label(*groups_.shard, groups_.post_forward, handle.unit_name(), phase);
  TraceSpan span(trace_, "all-gather issue", handle.unit_name());
  handle.StartUnshard();
}

void UnitScheduler::WaitForUnshard(FlatParamHandle& handle) {
  if (!handle.has_pending_unshard()) return;
  {
    c10::StreamGuard on_all_gather(streams_.all_gather());
    TraceSpan wait(trace_, "all-gather wait", handle.unit_name());
    handle.WaitForUnshard();
  }
  RuntimeStreams::WaitStream(streams_.compute(), streams_.all_gather());
}

void UnitScheduler::Prefetch(FlatParamHandle& handle, const std::string& phase) {
  const bool pending = handle.has_pending_unshard();
  IssueUnshard(handle, phase);
  if (debug_log_ && !pending && handle.has_pending_unshard()) {
    debug_log_(absl::StrCat("unit '", handle.unit_name(), "': all-gather prefetched (", phase,
                            ")"));
  }
}

void UnitScheduler::Unshard(FlatParamHandle& handle, const std::string& phase) {
  const bool gathers = handle.layout().sharded() && !handle.is_unsharded();
  TraceSpan unshard = gathers ? TraceSpan(trace_, "unshard", handle.unit_name()) : TraceSpan();
  IssueUnshard(handle, phase);
  if (!handle.layout().sharded() && handle.UnshardNeeded() && !handle.is_unsharded()) {
    // NO_SHARD's local copy (mixed precision, offload) reads the shard too.
    RuntimeStreams::WaitStream(streams_.all_gather(), streams_.compute());
  }
  {
    c10::StreamGuard on_all_gather(streams_.all_gather());
    TraceSpan wait = handle.has_pending_unshard()
                         ? TraceSpan(trace_, "all-gather wait", handle.unit_name())
                         : TraceSpan();
    handle.FinishUnshard();
  }
  RuntimeStreams::WaitStream(streams_.compute(), streams_.all_gather());
}

void UnitScheduler::DiscardPrefetch(FlatParamHandle& handle) { handle.DiscardPendingUnshard(); }

void UnitScheduler::Reshard(FlatParamHandle& handle) {
  const bool frees = handle.layout().sharded() && handle.is_unsharded();
  TraceSpan span = frees ? TraceSpan(trace_, "reshard", handle.unit_name()) : TraceSpan();
  handle.Reshard();
  if (frees) limiter_.OnReshard(DeviceEvent::RecordOn(streams_.compute()));
}

void UnitScheduler::ReshardKeepingFull(FlatParamHandle& handle) { handle.ReshardKeepingFull(); }

void UnitScheduler::ReshardAfterForward(FlatParamHandle& handle) {
  const bool frees = handle.layout().sharded() && handle.is_unsharded();
  TraceSpan span = frees ? TraceSpan(trace_, "reshard", handle.unit_name()) : TraceSpan();
  handle.ReshardAfterForward();
  if (frees) limiter_.OnReshard(DeviceEvent::RecordOn(streams_.compute()));
}

void UnitScheduler::UnshardGradients(FlatParamHandle& handle, const std::string& phase) {
  CollectiveLabel label(*groups_.shard, handle.unit_name(), phase);
  handle.UnshardGradients();
}

void UnitScheduler::ReshardGradients(FlatParamHandle& handle, bool writeback) {
  handle.ReshardGradients(writeback);
}

void UnitScheduler::ReduceGradients(FlatParamHandle& handle, bool all_reduce) {
  c10::StreamGuard on_reduce_scatter(streams_.reduce_scatter());
  // Before the wait on compute below: what an earlier reduction issues
  // next (hybrid's replicate all-reduce) needs nothing this backward
  // computed since. The one two back is advanced again first: a quantized
  // replicate sum's second stage (GradientReduction::Advance) waits for
  // the exchange its first stage issued one reduction ago, so that it
  // rarely waits, and its all-gather crosses the link during backward
  // instead of after it.
  if (reducing_.size() >= 2) {
    FlatParamHandle* earlier = reducing_[reducing_.size() - 2];
    CollectiveLabel label(*groups_.shard, groups_.replicate, earlier->unit_name(), "backward");
    earlier->AdvanceReduction();
  }
  for (; advanced_ < reducing_.size(); ++advanced_) {
    FlatParamHandle* earlier = reducing_[advanced_];
    CollectiveLabel label(*groups_.shard, groups_.replicate, earlier->unit_name(), "backward");
    earlier->AdvanceReduction();
  }
  RuntimeStreams::WaitStream(streams_.reduce_scatter(), streams_.compute());
  CollectiveLabel label(*groups_.shard, groups_.replicate, handle.unit_name(), "backward");
  TraceSpan span(trace_, handle.layout().sharded() ? "reduce-scatter" : "all-reduce",
                 handle.unit_name());
  handle.StartReduceGradients(all_reduce);
  reducing_.push_back(&handle);
}

void UnitScheduler::WaitForReductions() {
  std::vector<FlatParamHandle*> reducing = std::move(reducing_);
  reducing_.clear();
  advanced_ = 0;
  std::exception_ptr first_failure;
  {
    c10::StreamGuard on_reduce_scatter(streams_.reduce_scatter());
    for (FlatParamHandle* handle : reducing) {
      CollectiveLabel label(*groups_.shard, groups_.replicate, handle->unit_name(), "backward");
      TraceSpan span(trace_, "reduction wait", handle->unit_name());
      try {
        handle->FinishReduceGradients();
      } catch (...) {
        if (!first_failure) first_failure = std::current_exception();
      }
    }
  }
  RuntimeStreams::WaitStream(streams_.compute(), streams_.reduce_scatter());
  if (offload_params_) {
    // The host gradients are written by asynchronous device-to-host
    // copies; the optimizer reads them on the host right after this.
    DeviceEvent::RecordOn(streams_.compute()).Synchronize();
  }
  if (first_failure) std::rethrow_exception(first_failure);
}

void UnitScheduler::Move(FlatParamHandle& handle, HandleTrainingState from,
                         HandleTrainingState to) {
  if (to == HandleTrainingState::kSummonFullParams && handle.training_state() == from) {
    DiscardPrefetch(handle);
    if (handle.holds_kept_full() || handle.holds_post_forward_shard()) Reshard(handle);
  }
  handle.Transition(from, to);
  if (debug_log_) {
    debug_log_(absl::StrCat("unit '", handle.unit_name(), "': ", HandleTrainingStateName(from),
                            " -> ", HandleTrainingStateName(to)));
  }
}

}  // namespace fsdp
