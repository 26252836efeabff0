// Collectives on device tensors carried by a host group: every collective's
// input is copied into a host staging buffer (pinned for CUDA), the host
// group (Gloo) runs the collective there, and the result is copied back
// into the output. This is how several ranks share one GPU, which NCCL
// refuses ("invalid usage"), and how a device without a collective library
// trains at all; with one GPU per rank, NCCL is the faster transport.
//
// Ordering is NCCL's as the FSDP runtime relies on it (fsdp/runtime_streams.h):
//   * a collective reads its input as the caller's *current stream* has it
//     at issue: the staging copy runs on the group's own stream after an
//     event recorded there, so the runtime's all-gather and reduce-scatter
//     streams order it exactly as they order an NCCL collective;
//   * issuing does not block the host: one worker thread per group runs the
//     collectives in issue order (the order every rank issues them, which
//     the host group requires): wait for the input, copy it out, run the
//     host collective, copy the result back and wait for that copy;
//   * Wait() returns once all of that is done, so the output is complete on
//     the device for every stream. (NCCL's Wait() only makes the current
//     stream wait; this one also blocks the host until the collective has
//     run, as a Gloo collective's does.)
// The caller's tensors are held until their collective has run, so they
// may be freed after issue without record_stream.
//
// Host tensors take the same path (through unpinned staging buffers), so
// the transport is tested on machines without a GPU.
//
// The host group is not owned and must outlive this group, and must not be
// used by anyone else meanwhile (one thread issues a group's collectives).
// Each collective is labelled on the host group with this group's label,
// so the host group's failure explanations (comm/fingerprint.h) name the
// FSDP unit and phase. After a collective fails, the ones queued behind it
// fail at once, quoting the first failure, instead of each waiting for its
// own timeout. Counters count each collective once here (and once more on
// the host group).
#ifndef FSDP_COMM_STAGED_COLLECTIVES_H_
#define FSDP_COMM_STAGED_COLLECTIVES_H_

#include <memory>

#include "c10/core/Device.h"
#include "comm/collectives.h"

namespace fsdp {

// A group with the host group's ranks that handles tensors on `device` and
// on the host. Throws c10::Error if `device` is not a CPU or a device of
// this process (for CUDA: its index is out of range).
std::unique_ptr<Collectives> CreateStagedCollectives(Collectives& host_group,
                                                     c10::Device device);

}  // namespace fsdp

#endif  // FSDP_COMM_STAGED_COLLECTIVES_H_
