// SHARDED checkpoints: every rank writes only its own shards, rank 0 writes a
// manifest (formats/checkpoint_manifest.proto) last, and a load at any
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
//                          and a CRC-32 per 1 MiB chunk; the saver's
//                          metadata (string labels); a CRC-32 of its own,
//                          so a damaged manifest is reported as such.
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
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "ATen/core/Tensor.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp/fully_shard.h"

namespace fsdp {

// String labels a saver stores in the manifest (e.g. a training run's id),
// written atomically with it: a checkpoint that exists has them.
using CheckpointMetadata = std::map<std::string, std::string>;

// One tensor of a SHARDED checkpoint as this rank holds it: the elements
// [lo, hi) of the flattened tensor, in `local` (1-D, the rank's part; for a
// replicated tensor, all of it). Replicated tensors are written by rank 0.
// The model's tensors come from ModelCheckpointTensors; layers above add
// their own under a prefix of their own (the optimizer's: "optim/").
struct CheckpointTensor {
  std::string fqn;
  std::vector<std::string> aliases;  // Other names of a tied tensor.
  std::vector<int64_t> shape;        // Global.
  at::ScalarType dtype = at::kFloat;
  bool sharded = false;
  int64_t lo = 0, hi = 0;
  at::Tensor local;  // Saving: read from it. Loading: written into it...
  bool in_place = true;  // ...so a load refuses one that is a copy (ShardPlacement).
};

struct ShardedLoadStats {
  int64_t bytes_read = 0;    // From shard files, by this rank (chunks it needed).
  int64_t bytes_needed = 0;  // The elements this rank's model state needs.
};

// `dir` must exist (every rank must see the same directory). A model-only
// load ignores entries under "optim/".
absl::Status SaveShardedCheckpoint(FullyShardedModel& model, const std::string& dir,
                                   const CheckpointMetadata& metadata = {});
absl::Status LoadShardedCheckpoint(FullyShardedModel& model, const std::string& dir,
                                   ShardedLoadStats* stats = nullptr);

// The model's state-dict tensors as checkpoint tensors (`local` views the
// model's own storage). REQUIRES: the model IDLE.
std::vector<CheckpointTensor> ModelCheckpointTensors(const FullyShardedModel& model);

// The groups a model's checkpoint is saved over: the model's own
// (ModelSaveGroups), or groups with the same ranks that carry nothing else,
// for a save that runs beside training (checkpoint/async_checkpoint.h).
// `replicate` is null unless the model is hybrid-sharded.
struct SaveGroups {
  Collectives* shard = nullptr;
  Collectives* replicate = nullptr;
};
SaveGroups ModelSaveGroups(FullyShardedModel& model);
// Called on each writing rank once its own file is written and synced,
// before the rounds that commit the checkpoint: a save that read the
// model's live shards releases them here and checks that they did not
// change while it read them. An error fails the save on every rank.
using AfterLocalWrite = std::function<absl::Status()>;

// SaveCheckpointTensors over the model's shard group. Under hybrid sharding
// the shard groups hold identical shards: only the replicate group's rank 0
// writes, and the others return once it has, with its outcome.
absl::Status SaveModelCheckpointTensors(FullyShardedModel& model, const std::string& dir,
                                        const std::vector<CheckpointTensor>& tensors,
                                        const CheckpointMetadata& metadata = {});
// The same over `groups`; it touches no model, so the tensors may be
// copies taken earlier. `ready` and `after_write`: as SaveCheckpointTensors'.
absl::Status SaveModelCheckpointTensors(const SaveGroups& groups, const std::string& dir,
                                        const std::vector<CheckpointTensor>& tensors,
                                        const CheckpointMetadata& metadata = {},
                                        const absl::Status& ready = absl::OkStatus(),
                                        const AfterLocalWrite& after_write = nullptr);

// The general forms, for checkpoints that hold more than the model: every
// rank of `group` calls them with its tensors, in the same order on every
// rank. Loading checks every tensor first and fills every `local` only if
// every rank could read its part; entries of the checkpoint whose names
// start with one of `ignore_prefixes` may be absent from `tensors`.
// `ready` is this rank's outcome of any preparation the caller did first:
// an error there fails the save on every rank, in the save's own round.
// `after_write`, if given, runs once this rank has written its file or
// failed to, and its error fails the save likewise (a save that fails
// before any rank writes does not run it).
absl::Status SaveCheckpointTensors(Collectives& group, const std::string& dir,
                                   const std::vector<CheckpointTensor>& tensors,
                                   const CheckpointMetadata& metadata = {},
                                   const absl::Status& ready = absl::OkStatus(),
                                   const AfterLocalWrite& after_write = nullptr);
absl::Status LoadCheckpointTensors(Collectives& group, const std::string& dir,
                                   const std::vector<CheckpointTensor>& tensors,
                                   const std::vector<std::string>& ignore_prefixes,
                                   ShardedLoadStats* stats = nullptr);

// The metadata of the checkpoint in `dir`, from its manifest (read and
// checked, and every shard file it names present at its recorded size,
// their contents unread; no communication). kNotFound when `dir` has no
// manifest (no checkpoint, or an interrupted save), kDataLoss when the
// manifest is damaged or a shard file is missing or of another size, naming
// the file.
absl::StatusOr<CheckpointMetadata> ReadCheckpointMetadata(const std::string& dir);

// Why a load refuses `name`, a tensor no unit holds that is not contiguous.
std::string NotLoadableInPlace(const std::string& name);

}  // namespace fsdp

#endif  // FSDP_STATEDICT_SHARDED_CHECKPOINT_H_
