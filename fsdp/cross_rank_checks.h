// The checks that every rank wrapped, and runs, the same model. Ranks that
// disagree would pair collectives of different units and hang or exchange
// wrong shards, so each check is one collective over the shard group, run
// once, before the first collective it protects; on a mismatch every rank
// throws the same c10::Error, which names each rank's view.
//
// Callers: FullyShardedModel's lazy init (the wrap) and its first forward
// (the order). Every rank of `group` must call each check.
#ifndef FSDP_FSDP_CROSS_RANK_CHECKS_H_
#define FSDP_FSDP_CROSS_RANK_CHECKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "comm/collectives.h"
#include "fsdp/flat_layout.h"
#include "fsdp/fsdp_options.h"

namespace fsdp {

// What every rank must agree on about one unit.
struct UnitSignature {
  std::string fqn;
  int64_t flat_numel = 0;  // 0 for a unit without parameters.
  std::string trainable;   // Per parameter, '1' if it requires grad, else '0'.
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  MixedPrecision mixed_precision;
  CommQuantization all_gather_quantization = CommQuantization::kNone;
  CommQuantization reduce_quantization = CommQuantization::kNone;
};

// The signature of unit `fqn` with resolved `options` and, unless it has no
// parameters (null), the layout of its flat parameter.
UnitSignature SignatureOf(const std::string& fqn, const ResolvedUnitOptions& options,
                          const FlatLayout* layout);

// ProcessGroups::post_forward is every rank's block of k consecutive
// ranks of `shard_group`, in order (one all-gather over it, one all-reduce
// over the shard group); throws on every rank otherwise, naming the ranks
// this rank's group holds. Any k ranks would gather correct values (each
// keeps the piece of its place in the group); the layout is FSDP2's, and a
// group of other ranks (the replicate group passed by mistake, say) would
// carry backward's all-gathers outside the node they are meant for.
void CheckPostForwardGroup(Collectives& shard_group, Collectives& post_forward_group);

// The same units (pre-order), each with the same size, the same trainable
// parameters, strategy and precision, and the same options and group sizes
// (CrossRankOptionsKey) on every rank; one all-gather over the shard group.
void CheckSameWrapOnEveryRank(const ProcessGroups& groups, const FsdpOptions& options,
                              const std::vector<UnitSignature>& units);

// The same units, in the same order, finished their first forward on every
// rank. `order` holds unit indices; `unit_names[i]` names unit i in the
// error. REQUIRES: every rank has the same units (CheckSameWrapOnEveryRank
// passed), so that every rank's indices fall inside `unit_names`.
void CheckSameExecutionOrderOnEveryRank(Collectives& group, const std::vector<int>& order,
                                        const std::vector<std::string>& unit_names);

}  // namespace fsdp

#endif  // FSDP_FSDP_CROSS_RANK_CHECKS_H_
