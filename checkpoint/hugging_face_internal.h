// Internal to checkpoint/: SaveCheckpoint and LoadCheckpoint's Hugging Face
// format (CheckpointFormat::kHuggingFace; checkpoint/checkpoint.h has the
// contract). A model's weights as transformers' save_pretrained writes them
// and from_pretrained reads them (with the default HuggingFaceFiles):
// config.json beside model.safetensors, or
// beside model-0000K-of-0000N.safetensors and model.safetensors.index.json
// (hf/safetensors.h), keyed by the unwrapped model's state_dict names.
// PyTorch's counterpart is DCP's HuggingFaceStorageReader / Writer.
//
// Loading: every rank reads, with positional reads, only the elements of
// each tensor that its shards hold (under NO_SHARD, all of it); every rank
// must see the same files (checked: the ranks compare what they read).
// Floating-point tensors are cast to the model's dtype. Every file's header
// and every tensor's name, dtype and shape are checked on every rank before
// any tensor is read; the reads then go straight into the shards (through
// an 8 MiB buffer when they cast or the shard is on a device), so a load
// costs no more memory than the model's shards. Only a read that fails
// after the checks (an I/O error, a file truncated meanwhile) leaves the
// model partly loaded, and every rank then returns an error that says so.
//
// Saving: the units are gathered one at a time (VisitFullStateDict) and one
// rank (rank 0 of the shard group and of the replicate group) streams each
// unit's tensors into the files; they are published only after every rank
// gathered every unit, the config after the weights. Tied parameters are
// written once, under their first name in state_dict order (save_pretrained
// keeps the embedding's); loading fills all names of a tensor from whichever
// the checkpoint has. CheckpointIoOptions::hugging_face selects the tensors
// (all, the trainable or the frozen ones), the names' prefix and the files' stem, for
// saving and loading alike (PEFT's adapters).
#ifndef FSDP_CHECKPOINT_HUGGING_FACE_INTERNAL_H_
#define FSDP_CHECKPOINT_HUGGING_FACE_INTERNAL_H_

#include <string>

#include "absl/status/status.h"
#include "checkpoint/checkpoint.h"
#include "fsdp/fully_shard.h"

namespace fsdp::checkpoint_internal {

// Whether `dir` holds a Hugging Face checkpoint's weights (an index or
// <stem>.safetensors), as this rank sees it.
bool IsHuggingFaceDirectory(const std::string& dir, const std::string& stem = "model");

absl::Status SaveHuggingFace(const std::string& dir, FullyShardedModel& model,
                             const CheckpointIoOptions& options);
absl::Status LoadHuggingFace(const std::string& dir, FullyShardedModel& model,
                             const CheckpointIoOptions& options);

}  // namespace fsdp::checkpoint_internal

#endif  // FSDP_CHECKPOINT_HUGGING_FACE_INTERNAL_H_
