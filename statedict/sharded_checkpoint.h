// SHARDED checkpoints: every rank writes only its own shards, rank 0 writes a
// manifest (statedict/checkpoint_manifest.proto) last, and a load at any
// world size reads only the byte ranges each rank needs — never a full
// gather on one rank.
//
// A checkpoint directory holds:
//   shard-<r>-of-<W>.bin   rank r's pieces: a 32-byte header (magic
//                          "FSDPSHD1", the checkpoint id, r, W), then the
//                          raw bytes of each piece;
//   manifest.pb            for every state-dict tensor: FQN (and tied
//                          aliases), global shape, dtype, and each piece's
//                          rank, element offset and length, byte offset,
//                          and a CRC-32 per 1 MiB chunk.
// Which rank writes what: a sharded unit's parameter is written by every
// rank as the part its shard holds; replicated tensors (NO_SHARD units'
// parameters, buffers, ignored parameters) are written once, by rank 0.
//
// Saving: every rank must call; each writes its file atomically (temporary
// name, then rename), reports its pieces to rank 0, and rank 0 writes the
// manifest atomically once every file is complete; a failure on any rank
// fails the save on every rank, naming the rank, and leaves no manifest, so
// an interrupted or failed save never looks like a checkpoint. An existing
// checkpoint in the directory is replaced only when the new manifest lands.
//
// Loading: every rank must call. Each reads the manifest, checks it against
// the model (missing and unexpected names, shapes, dtypes, pieces that do
// not tile their tensor), checks the shard files it needs (present, of the
// recorded size, of this checkpoint), then reads the chunks that overlap the
// elements it needs and verifies their CRCs, into staging memory. Only if
// every rank succeeded (one all-reduce) does each copy its staging into the
// model: a load changes every rank or none, and on failure every rank gets
// an error listing the problems (its own, or naming the ranks that failed).
#ifndef FSDP_STATEDICT_SHARDED_CHECKPOINT_H_
#define FSDP_STATEDICT_SHARDED_CHECKPOINT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "fsdp/fully_shard.h"

namespace fsdp {

struct ShardedLoadStats {
  int64_t bytes_read = 0;    // From shard files, by this rank (chunks it needed).
  int64_t bytes_needed = 0;  // The elements this rank's model state needs.
};

// `dir` must exist (every rank must see the same directory).
absl::Status SaveShardedCheckpoint(FullyShardedModel& model, const std::string& dir);
absl::Status LoadShardedCheckpoint(FullyShardedModel& model, const std::string& dir,
                                   ShardedLoadStats* stats = nullptr);

}  // namespace fsdp

#endif  // FSDP_STATEDICT_SHARDED_CHECKPOINT_H_
