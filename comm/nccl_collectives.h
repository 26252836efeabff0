// Collectives over NCCL, for ranks that compute on CUDA devices (one device
// per rank). Built only under --config=cuda, against a CUDA-enabled libtorch.
//
// Run on one GPU only (an H200, torch 2.11, 2026-11-26; docs/building.md, "GPU
// builds"): one-rank groups of both transports, where no collective reaches
// NCCL. UNVERIFIED: the data path between ranks, the waits, the timeout and
// abort, which need two GPUs. It is compiled in the --config=cuda build on
// CPU-only machines.
//
// Communicators are created through the job's rendezvous store (the same
// TCPStore the Gloo groups use): rank 0 makes the NCCL unique id and sets
// it under a key derived from the group name; every rank reads it and calls
// ncclCommInitRank. (With NcclTransport::kProcessGroup, libtorch's
// ProcessGroupNCCL does the same under a prefix of the group name.)
//
// Streams: a collective is issued on the calling thread's current CUDA
// stream for the group's device, which is how the FSDP runtime orders it
// (the all-gather stream for unshards, the reduce-scatter stream for
// gradients; fsdp/runtime_streams.h). Its work's Wait() makes the *current*
// stream wait for it, without blocking the host (as c10d's NCCL works do),
// unless NcclOptions::blocking_wait, where Wait() also waits on the host
// up to the timeout and aborts the communicator when it expires (a hung or
// dead peer then fails with an error naming the collective, instead of
// hanging the device). Asynchronous NCCL errors are checked at every issue
// and every Wait().
//
// Host tensors: the FSDP core's small control collectives (the wrap-plan
// check, the execution-order check, gradient-norm sums) use CPU tensors.
// They are staged through the device: copied there, reduced, copied back,
// and Wait() returns with the host tensor complete. Device tensors must be
// on the group's device.
//
// dtypes: float32, float64, float16, bfloat16 (NCCL >= 2.10 for bfloat16
// and for kAvg, which is ncclAvg).
#ifndef FSDP_COMM_NCCL_COLLECTIVES_H_
#define FSDP_COMM_NCCL_COLLECTIVES_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "c10/util/intrusive_ptr.h"
#include "comm/collectives.h"

namespace c10d {
class Store;
}  // namespace c10d

namespace fsdp {

// How collectives reach NCCL. The FSDP runtime works with either;
// //comm:nccl_collectives_benchmark measures both (docs/building.md, "GPU builds").
enum class NcclTransport {
  // ncclAllGather & co. on the caller's current stream: the FSDP runtime's
  // all-gather and reduce-scatter streams are the streams NCCL runs on, and
  // a collective costs one event; no threads of its own.
  kDirect,
  // c10d::ProcessGroupNCCL from libtorch: its own stream per device (made to
  // wait for the caller's), its watchdog thread, and its TORCH_NCCL_*
  // environment settings.
  kProcessGroup,
};

struct NcclOptions {
  NcclTransport transport = NcclTransport::kDirect;
  // Distinguishes groups on one store (the unique id's key, or the
  // process group's store prefix).
  std::string group_name = "default";
  // Wait() blocks the host until the collective is done, up to `timeout`.
  bool blocking_wait = false;
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
};

// Rank `rank` of `world_size` on CUDA device `device_index`. Every rank of
// the group must call it. Fails with a status naming the rank, the device
// and the NCCL or CUDA error.
absl::StatusOr<std::unique_ptr<Collectives>> CreateNcclCollectives(
    c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, int device_index,
    const NcclOptions& options = {});

// Connects groups on CUDA device `device_index` through `store` with
// `options`, each under its own name.
GroupConnector NcclGroupConnector(c10::intrusive_ptr<c10d::Store> store, int device_index,
                                  NcclOptions options);

}  // namespace fsdp

#endif  // FSDP_COMM_NCCL_COLLECTIVES_H_
