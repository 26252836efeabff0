// A wrapped model's weights as a Hugging Face checkpoint directory: what
// transformers' save_pretrained writes and from_pretrained reads
// (config.json beside model.safetensors, or beside model-0000K-of-0000N
// .safetensors files and model.safetensors.index.json). The names are the
// unwrapped model's state_dict keys, so a model whose modules carry
// transformers' names reads and writes the hub's files with no renaming.
// PyTorch's counterpart is DCP's HuggingFaceStorageReader / Writer.
//
//   FSDP_RETURN_IF_ERROR(fsdp::LoadHuggingFaceCheckpoint("Llama-3.2-1B", *sharded));
//   ... fine-tune ...
//   FSDP_RETURN_IF_ERROR(fsdp::SaveHuggingFaceCheckpoint("out", *sharded, {.config_json = config}));
//
// Loading: every rank reads, with positional reads, only the elements of
// each tensor that its shards hold (no rank reads or holds the whole model);
// floating-point tensors are cast to the model's dtype, as from_pretrained
// casts to the model's torch_dtype. All-or-nothing on every rank: names,
// shapes and dtypes are checked, and every rank's bytes read, before any
// rank changes a parameter.
//
// Saving: the units are gathered one at a time (the model's full parameters
// are never all in memory) and rank 0 streams each unit's tensors into the
// files, which appear only when all are written (hf/safetensors.h: each
// file renamed into place, the index last; files of an earlier export under
// the same names are replaced). Tied parameters (an embedding shared with
// the output head) are written once, under their first name, as
// save_pretrained does; loading fills the other names from it.
//
// Every rank of the model's group calls these, with the model IDLE; every
// rank returns the same outcome. Optimizer state and training progress are
// not part of a Hugging Face checkpoint: SaveCheckpoint (checkpoint.h)
// keeps those.
#ifndef FSDP_CHECKPOINT_HUGGING_FACE_H_
#define FSDP_CHECKPOINT_HUGGING_FACE_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "c10/core/ScalarType.h"
#include "fsdp/fully_shard.h"

namespace fsdp {

struct HuggingFaceSaveOptions {
  // Start a new file before one would pass this size (save_pretrained's
  // max_shard_size; its default, 5 GB). One file needs no index.
  int64_t max_file_bytes = 5'000'000'000;
  // Floating-point tensors are written in this dtype (bf16 for the hub);
  // unset: each in its own.
  std::optional<at::ScalarType> dtype;
  // Written as config.json when not empty (the model's transformers config).
  std::string config_json;
};

// Writes `dir` (created if absent).
absl::Status SaveHuggingFaceCheckpoint(const std::string& dir, FullyShardedModel& model,
                                       const HuggingFaceSaveOptions& options = {});

struct HuggingFaceLoadOptions {
  // Every tensor of the model must be in the checkpoint and every tensor of
  // the checkpoint in the model. With false, the checkpoint's extra tensors
  // are ignored and the model's missing ones keep their values (a new head,
  // adapters); shapes and dtypes are still checked.
  bool strict = true;
};

// Loads `dir` into the model: the checkpoint's tensors, at any world size.
absl::Status LoadHuggingFaceCheckpoint(const std::string& dir, FullyShardedModel& model,
                                       const HuggingFaceLoadOptions& options = {});

}  // namespace fsdp

#endif  // FSDP_CHECKPOINT_HUGGING_FACE_H_
