// Internal to checkpoint/: every rank of a model learns every rank's
// outcome of a step, so that all go on or all stop (and none is left waiting
// in a collective the others skipped).
#ifndef FSDP_CHECKPOINT_AGREE_H_
#define FSDP_CHECKPOINT_AGREE_H_

#include <string>

#include "absl/status/status.h"
#include "fsdp/fully_shard.h"

namespace fsdp::checkpoint_internal {

// Every rank of the model's shard group and, under hybrid sharding, of its
// replicate group calls it with its own outcome. OK when every rank's is;
// else this rank's error, or the first failed rank's, naming it.
absl::Status AgreeAcrossRanks(FullyShardedModel& model, const absl::Status& local);

// As AgreeAcrossRanks, in the same single round, and every rank must also
// have seen the same `seen` (say, what the directory `where` holds): when
// they differ, every rank without an error of its own returns
// kFailedPrecondition naming what it and another rank saw. One round lets
// a caller check what it read and agree on the outcome at once.
absl::Status AgreeAcrossRanks(FullyShardedModel& model, const absl::Status& local,
                              const std::string& seen, const std::string& where);

// As AgreeAcrossRanks, after a step that changed this rank's state: a rank
// that succeeded while another failed gets kAborted, saying that the ranks
// now disagree about `what` and must load again.
absl::Status AgreeAfterLoad(FullyShardedModel& model, const absl::Status& local,
                            const char* what);

}  // namespace fsdp::checkpoint_internal

#endif  // FSDP_CHECKPOINT_AGREE_H_
