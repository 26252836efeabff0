// Collectives for CPU tensors over Gloo, through libtorch's c10d process group.
//
// Gloo in libtorch 1.13 has no reduce-scatter and no all-gather into one
// tensor, and rejects bfloat16 tensors. This implementation provides all of
// them on top of Gloo's all-to-all (NOTE [Gloo algorithms] in the .cc):
//   all-gather      all-to-all of W copies of the input, received in place;
//   reduce-scatter  all-to-all of the input, then a local sum of the W
//                   received chunks (float32 accumulation for 16-bit types);
//                   (W-1)/W of the buffer crosses the wire per rank, as in a
//                   ring reduce-scatter, instead of 2(W-1)/W for an
//                   all-reduce of the whole buffer;
//   all-reduce      Gloo's ring for float32/float64; reduce-scatter then
//                   all-gather for float16/bfloat16;
//   broadcast       Gloo broadcast of a byte view.
// Every collective is preceded by a 40-byte header exchange that stops all
// ranks, before any data moves, when they do not issue the same collective
// (GlooOptions::check_collective_headers), and the group compares the ranks'
// fingerprints through the store when a collective fails
// (comm/fingerprint.h).
// By default the group keeps its all-gather send buffer and reduce-scatter
// receive buffer, each as large as the largest call so far (the full size of
// the largest FSDP unit), and reuses them (GlooOptions::reuse_staging_buffers).
//
// This is an adapter file: c10d's types appear only here and in the other
// comm adapters (rendezvous.h, nccl_collectives.h), never above comm/.
// Every rank of a group calls CreateGlooCollectives with the same store and
// group name; creation blocks until all ranks have connected.
// Creating a group installs a no-op SIGPIPE handler when SIGPIPE is at its
// default action (terminate): a peer that closed its connection then fails
// the collective with an error instead of killing this process. A handler
// or SIG_IGN the program set is left alone (NOTE [Broken connections]).
#ifndef FSDP_COMM_GLOO_COLLECTIVES_H_
#define FSDP_COMM_GLOO_COLLECTIVES_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/collectives.h"
#include "torch/csrc/distributed/c10d/Store.hpp"

namespace fsdp {

struct GlooOptions {
  // Bound on every collective and on the connection of the group. A rank
  // that does not take part in time makes the others fail with an error
  // that names the operation, instead of hanging.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);

  // Which local address Gloo listens on: a network interface ("lo",
  // "eth0"; what GLOO_SOCKET_IFNAME names for PyTorch), else a hostname or
  // address ("127.0.0.1"); with neither, the address this host's name
  // resolves to.
  std::string interface;
  std::string hostname;

  // Gloo worker threads of this group (each runs one collective at a time).
  int threads = 2;

  // Prefix of this group's keys in the store; groups sharing a store (the
  // shard and replicate groups of hybrid sharding) need distinct names, and
  // a name connects one group per store (its membership keys stay behind).
  std::string group_name = "world";

  // Keep the all-gather and reduce-scatter staging buffers between calls.
  // Faster (a fresh 64 MiB buffer costs ~25 ms of page faults on a 2-core
  // VM, more than the transfer's local work) but holds up to twice the
  // largest full buffer for the group's life; turn off to trade speed for
  // memory.
  bool reuse_staging_buffers = true;

  // Record every collective's fingerprint and compare them through the
  // store when a collective fails or VerifyConsistency is called
  // (comm/fingerprint.h); the failure's error then says where the ranks
  // diverged and which ones went silent.
  bool exchange_fingerprints = true;
  // Before every collective, check that every rank issues the same one
  // with the same history (one 40-byte all-to-all; NOTE [Collective
  // headers] in the .cc). Without it, a rank that issues a larger
  // collective than its peers kills their processes inside Gloo, and
  // equal-sized different collectives exchange the wrong data silently.
  bool check_collective_headers = true;
  FingerprintOptions fingerprints;
};

// Connects rank `rank` of a group of `world_size` through `store`.
// Fails with kInvalidArgument for bad arguments and kDeadlineExceeded /
// kUnavailable when the other ranks do not connect in time.
absl::StatusOr<std::unique_ptr<Collectives>> CreateGlooCollectives(
    c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
    const GlooOptions& options);

// Connects groups through `store` with `options`, each under its own name.
GroupConnector GlooGroupConnector(c10::intrusive_ptr<c10d::Store> store, GlooOptions options);

}  // namespace fsdp

#endif  // FSDP_COMM_GLOO_COLLECTIVES_H_
