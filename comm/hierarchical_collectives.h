// Two-level all-gather and reduce-scatter for a job whose ranks sit on
// several hosts, so that the link between hosts carries each byte once.
//
// A flat all-gather over W ranks on H hosts sends, across the hosts' link,
// every shard to every rank of the other hosts: with Gloo's algorithms, a
// whole buffer's worth (S) each way per collective at H = 2, and a
// reduce-scatter the same. Two levels halve that at H = 2, (H-1)/H of S in
// general, which is the least an all-gather can move (each host must
// receive the other hosts' parts once):
//   * AllGather: the cross-host group (the ranks with this rank's local
//     index on every host) all-gathers the shards, so each rank holds the
//     H shards of its local index; then, once per host h, the host group
//     (loopback) all-gathers shard h of every local rank straight into the
//     output's rows for host h.
//   * ReduceScatter: once per host h, the host group reduce-scatters the
//     input's rows for host h (summing this host's ranks), so that local
//     rank l holds this host's sums of the chunks of the ranks with local
//     index l; the cross-host group reduce-scatters those (summing across
//     hosts).
//   H host-level collectives instead of one, and no rearranging copy: the
//   output and input are read and written in place (the transport stages
//   them as it does any collective's). Each of the H has its own header
//   exchange, so a host peer that died can cost up to H header timeouts
//   before the error.
// The reduce-scatter sums in another order than a flat one (a host's ranks
// first, then the hosts), so float32 sums can differ in the last bits, and
// 16-bit ones are rounded once per level (a flat Gloo reduction rounds
// once); the all-gather copies values and is exact. AllReduce, Broadcast
// and AllToAll are the world group's, unchanged; Barrier queues behind the
// issued collectives (at each level).
//
// Ranks are numbered host by host (rank = h * L + l for local index l of L
// ranks per host: torchrun, this project's launcher and SLURM do so), and
// the groups are comm/hybrid_groups.h's with shard_group_size = L:
//
//   HybridShardCollectives g = ...;  // shard: this host; replicate: across
//   auto group = fsdp::CreateHierarchicalCollectives(*world, *g.shard, *g.replicate);
//   fsdp::FullyShardedModel::Wrap(model, *group, options, policy);
//
// The three groups are not owned and must outlive this one; the host and
// cross-host groups must not be used by anyone else meanwhile, and the
// world group only from the thread that issues this group's collectives.
// Two worker threads, one per level, issue each level's stages in issue
// order (the order every rank issues them), so issuing does not block; a
// worker waits only for the first stage of a collective before it issues
// the second, never for the stages it issued itself, so the cross-host
// stages of the collectives in flight keep the link busy while a host
// gathers or sums, and the levels cannot wait on each other in a cycle.
// After a collective fails, the ones queued behind it, at either level,
// fail at once quoting it. Host (CPU) tensors only: on GPUs, NCCL's own
// algorithms see the topology.
#ifndef FSDP_COMM_HIERARCHICAL_COLLECTIVES_H_
#define FSDP_COMM_HIERARCHICAL_COLLECTIVES_H_

#include <memory>

#include "comm/collectives.h"

namespace fsdp {

// Every rank of the world must call it. Throws c10::Error, on every rank,
// naming the sizes or ranks, unless the three groups are distinct,
// host.world_size() x cross_host.world_size() == world.world_size() and
// every rank's world rank is cross_host.rank() * host.world_size() +
// host.rank() (one all-gather over the world checks this).
std::unique_ptr<Collectives> CreateHierarchicalCollectives(Collectives& world, Collectives& host,
                                                           Collectives& cross_host);

}  // namespace fsdp

#endif  // FSDP_COMM_HIERARCHICAL_COLLECTIVES_H_
