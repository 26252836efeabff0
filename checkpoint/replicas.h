// Silent-corruption checks: ranks that must hold the same bytes compare
// them, so that a replica whose weights or optimizer state drifted without
// any error (a flipped bit in memory, a faulty reduction) stops the job
// instead of training on.
//
//   // Every K steps, between steps, on every rank:
//   absl::Status same = fsdp::CheckReplicas(*sharded, optimizer.get());
//   if (!same.ok()) ...  // kDataLoss on every rank, naming what differs.
//
// Which ranks must agree, by a 64-bit hash of each tensor's bytes:
//   - under HYBRID_SHARD and _HYBRID_SHARD_ZERO2, the replicas of each
//     shard (the replicate group): every parameter's shard and its
//     optimizer state;
//   - under NO_SHARD, every rank of the shard group: every parameter of the
//     unit and its optimizer state (and across the replicate group too
//     when the root is hybrid);
//   - every rank's copy of every buffer (both groups), unless
//     ReplicaCheckOptions::compare_buffers is false: buffers a forward
//     updates from the rank's own batch (BatchNorm's running statistics)
//     differ by design, and FSDP does not synchronize them.
// FULL_SHARD and SHARD_GRAD_OP keep one copy of each shard: only their
// buffers have replicas. Tensors of ignored modules (FsdpOptions::
// ignored_modules) and their optimizer state are each rank's own and are
// not compared.
//
// Each step of the hash is a bijection of the 8-byte word it takes in, and
// of its state, so a tensor that differs in a single word (a single flipped
// bit) always hashes differently; the steps mix fully (splitmix64's
// finalizer), so wider damage goes unseen with a chance of about 2^-64.
#ifndef FSDP_CHECKPOINT_REPLICAS_H_
#define FSDP_CHECKPOINT_REPLICAS_H_

#include "absl/status/status.h"
#include "fsdp/fully_shard.h"
#include "torch/optim/optimizer.h"

namespace fsdp {

struct ReplicaCheckOptions {
  bool compare_buffers = true;
};

// Every rank of the model's shard group and, under hybrid sharding, of its
// replicate group must call it, with the model IDLE (between steps; else
// kFailedPrecondition, before any communication). `optimizer` (optional)
// must step the model's parameters after wrapping; its state is compared
// as its parameters are.
//
// OK when every replica agrees. Else kDataLoss on every rank: for each
// tensor that differs (the first 8), its name, what it is (parameter,
// buffer, optimizer state and key), its unit, the group and which of its
// ranks hold which hash; the ranks holding the hash most of them hold are
// listed first, so with three replicas or more the odd one is named last.
//
// Cost, when all agree: hashing this rank's shards, its buffers and the
// optimizer state of the parameters that have replicas (on a GPU, each
// tensor copied to the host first; state of libtorch's Adam, AdamW, SGD,
// Adagrad and RMSprop classes, and so of the flat-shard optimizers, read
// in place, any other through its serialize(), a copy, as
// ShardedOptimStateDict does), then three all-gathers of a few numbers
// per rank in each group (this rank's readiness, the digests, the
// outcome). A mismatch costs one more all-gather of every rank's hashes.
// models/replica_check_results.md has the price per step.
absl::Status CheckReplicas(FullyShardedModel& model,
                           torch::optim::Optimizer* optimizer = nullptr,
                           const ReplicaCheckOptions& options = {});

// Every rank of the model passes the global gradient norm ClipGradNorm
// returned to it: the all-reduce gave every rank the same value, so a rank
// whose value differs received or computed a corrupted one. OK when every
// rank's is bitwise equal (NaN included); else kDataLoss on every rank,
// naming each rank's value. One all-gather of two numbers per rank and
// group, and the agreement (one more).
absl::Status CheckGradientNormAgrees(FullyShardedModel& model, double norm);

}  // namespace fsdp

#endif  // FSDP_CHECKPOINT_REPLICAS_H_
