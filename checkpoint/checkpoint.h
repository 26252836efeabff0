// The state of an FSDP model and its optimizer, in the shape PyTorch users
// know: torch.distributed.checkpoint.state_dict's get/set functions and
// StateDictOptions, dcp.save / dcp.load, and torch.save / torch.load. These
// eight functions, with AsyncCheckpointer (checkpoint/async_checkpoint.h:
// SaveCheckpoint in the background, as dcp.async_save), are the package's
// whole interface to state: the file
// formats and per-format functions they are built on (statedict/, optim/)
// are internal, and their headers are not installed (docs/checkpoints.md).
//
//   fsdp::TrainState state;
//   absl::Status loaded = fsdp::LoadCheckpoint("ckpt", *sharded, &optimizer, &state);
//   if (!loaded.ok() && !absl::IsNotFound(loaded)) fsdp::ThrowIfError(loaded);
//   ... train, ++state.step ...
//   fsdp::ThrowIfError(fsdp::SaveCheckpoint("ckpt", *sharded, &optimizer, state));
//
// Checkpoints (SaveCheckpoint / LoadCheckpoint) come in two formats, as
// dcp.save / dcp.load take a storage writer / reader: a Distributed
// Checkpoint (the default; below) and a Hugging Face checkpoint (the
// model's weights as transformers' save_pretrained writes them, for open
// models: CheckpointFormat::kHuggingFace).
//
// Distributed Checkpoints are sharded: each rank
// writes and reads only its own part of every tensor, and no rank ever holds
// the whole model. The directory is a PyTorch Distributed Checkpoint laid
// out as an FSDP2 job's dcp.save of
//   {"model": get_model_state_dict(model),
//    "optim": get_optimizer_state_dict(model, optimizer),
//    "train_state": {"step": N, "data_position": P}}
// so PyTorch's dcp.load reads it at any world size, and a checkpoint that
// PyTorch wrote that way loads here at any world size. Saves are atomic
// (the checkpoint that was in the directory stays whole until the new one's
// .metadata lands); loads are all-or-nothing on every rank.
//
// State dicts in memory (Get/Set*StateDict) are full: every tensor whole,
// keyed by the FQNs the unwrapped model has, gathered one unit at a time.
// A sharded state dict in memory (PyTorch's DTensor values) is not offered:
// sharded state goes to disk through SaveCheckpoint, as dcp.save takes it.
//
// Every function but the torch.save ones (one process) is called by every
// rank of the model's group, with the model IDLE (between steps; else
// kFailedPrecondition). Errors are absl::Status values naming the file,
// entry or rank at fault, and every rank returns one when any rank fails.
// Loads check everything first: a bad file, directory or dict changes
// nothing on any rank. Only a failure while applying what was read (out of
// memory; for a Hugging Face checkpoint, which is read in place, a read
// error after the checks) can leave ranks apart (a Hugging Face one partly
// loaded); the ranks that loaded then return kAborted, saying that the
// ranks disagree.
#ifndef FSDP_CHECKPOINT_CHECKPOINT_H_
#define FSDP_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "formats/state_dict_type.h"
#include "fsdp/fully_shard.h"
#include "optim/optim_state_dict.h"
#include "torch/optim/optimizer.h"

namespace fsdp {

// PyTorch's StateDictOptions, for full state dicts.
struct StateDictOptions {
  // Get: the tensors in host memory, and (as PyTorch does for a full state
  // dict) only on rank 0 (under hybrid sharding, rank 0 of each shard
  // group): the other ranks get an empty dict and never hold a copy. Else
  // every rank gets every tensor on its own device.
  bool cpu_offload = false;
  // Get: parameters that do not require grad are left out of the model's
  // state dict. Set: the dict may lack them; they keep their values.
  bool ignore_frozen_params = false;
  // Set: every entry of the model must be in the dict and every entry of
  // the dict in the model. With false, entries the model lacks are
  // ignored and entries the dict lacks keep their values; shapes and dtypes
  // are still checked. The optimizer's state is always strict.
  bool strict = true;
  // Set: only rank 0's dict is read (the other ranks pass an empty one);
  // it is broadcast to the others. Without it, every rank must pass a dict
  // with the same entries (checked: else every rank fails).
  // Each rank holds a whole copy while loading, as it would have read one.
  bool broadcast_from_rank0 = false;
};

// The model's full state dict: the keys and order of the unwrapped model's
// state_dict().
absl::StatusOr<StateDict> GetModelStateDict(FullyShardedModel& model,
                                            const StateDictOptions& options = {});
// Loads a full state dict of any world size (or of the unwrapped model).
// Every rank passes the same dict, unless broadcast_from_rank0.
absl::Status SetModelStateDict(FullyShardedModel& model, const StateDict& state,
                               const StateDictOptions& options = {});

// The optimizer's full state, keyed by parameter FQN (PyTorch's
// get_optimizer_state_dict). `optimizer` is built over the wrapped model's
// parameters (fsdp::UniqueParameters).
absl::StatusOr<OptimStateDict> GetOptimizerStateDict(FullyShardedModel& model,
                                                     torch::optim::Optimizer& optimizer,
                                                     const StateDictOptions& options = {});
// Loads it at any world size; a fresh optimizer gets state for every
// parameter the dict has state for.
absl::Status SetOptimizerStateDict(FullyShardedModel& model, torch::optim::Optimizer& optimizer,
                                   const OptimStateDict& state,
                                   const StateDictOptions& options = {});

// Where a training run stands, saved with its checkpoint.
struct TrainState {
  int64_t step = 0;
  // Where the data stands (batches or samples consumed, a file offset): the
  // caller's to define.
  int64_t data_position = 0;
  // Strings a run keeps with its checkpoint (its id, its settings), saved
  // as train_state entries: a name is parts of [A-Za-z0-9_] joined by '.',
  // which nests ("settings.lr" is train_state["settings"]["lr"]); neither
  // "step" nor "data_position" (else kInvalidArgument). LoadCheckpoint sets
  // each that the checkpoint holds (of an older SHARDED checkpoint: its
  // manifest's metadata other than the step, by their own names).
  std::map<std::string, std::string> labels;
};

enum class CheckpointFormat {
  // PyTorch's Distributed Checkpoint: model, optimizer and train state,
  // each rank writing and reading its own part (see the top).
  kDistributed,
  // transformers' save_pretrained layout: config.json (when given),
  // model.safetensors or model-0000K-of-0000N.safetensors with
  // model.safetensors.index.json; the model's weights only, under the
  // unwrapped model's state_dict names (so a model whose modules carry
  // transformers' names reads the hub's files as they are). Saving gathers
  // one unit at a time and one rank streams it into the files, which are
  // published only when whole (the index last; files of an earlier export
  // under the same names are replaced); a tied tensor is written once, under
  // its first name, as save_pretrained does. Loading reads on each rank
  // only the elements its shards hold, straight into them, and casts
  // floating-point tensors to the model's dtypes (a bf16 checkpoint into a
  // float32 model), as from_pretrained does: a load holds no second copy
  // of the rank's share. Every file's header and every tensor's name, dtype
  // and shape are checked before the first read.
  kHuggingFace,
};

// Which of the model's tensors a Hugging Face checkpoint holds.
enum class HuggingFaceTensors {
  kAll,
  // The parameters that require grad (PEFT's adapters).
  kTrainable,
  // The others: the base of a model with adapters (models/lora.h), loaded
  // from transformers' checkpoint strictly, with the adapters left alone.
  kFrozen,
};

// Hugging Face checkpoints: which of the model's tensors, under which names
// and in which files. The defaults are transformers' save_pretrained of the
// whole model. PEFT's adapters (models/lora.h) are {"adapter_model",
// "base_model.model.", kTrainable, "adapter_config.json"}: the trainable
// parameters only, each under "base_model.model." + its name, in
// adapter_model.safetensors.
struct HuggingFaceFiles {
  // The files: "<stem>.safetensors", or "<stem>-0000K-of-0000N.safetensors"
  // and "<stem>.safetensors.index.json". LoadCheckpoint finds a Hugging Face
  // checkpoint in a directory by this stem.
  std::string stem = "model";
  // Put before every name in the files (and expected there on load).
  std::string name_prefix;
  // Only these are saved, and only these loaded (the others keep their
  // values; strict then means that the files hold exactly these).
  HuggingFaceTensors tensors = HuggingFaceTensors::kAll;
  // `stem` and `config_file` are file names inside the directory (not
  // empty, no '/', not . or ..: kInvalidArgument otherwise).
  // Save: the name under which CheckpointIoOptions::config_json is written;
  // load: the file CheckpointIoOptions::check_config reads.
  std::string config_file = "config.json";

  bool operator==(const HuggingFaceFiles& other) const {
    return stem == other.stem && name_prefix == other.name_prefix &&
           tensors == other.tensors && config_file == other.config_file;
  }
};

struct CheckpointIoOptions {
  // Save: the format written. Load finds it from the directory.
  CheckpointFormat format = CheckpointFormat::kDistributed;
  // Load, Hugging Face checkpoints: as StateDictOptions::strict. With
  // false, the checkpoint's extra tensors are ignored and the model's
  // missing ones keep their values (a new head, adapters); shapes and dtype
  // kinds are still checked. Distributed Checkpoints load strictly.
  bool strict = true;
  // Save, Hugging Face: a new file before one would pass this size
  // (save_pretrained's max_shard_size and its default, 5 GB); floating-point
  // tensors written in `dtype` when set (bf16, as the hub keeps them); and
  // `config_json`, the model's transformers config, as
  // hugging_face.config_file (config.json by default) when not empty.
  int64_t max_file_bytes = 5'000'000'000;
  std::optional<at::ScalarType> dtype;
  std::string config_json;
  // Hugging Face, save and load: which tensors, names and files.
  HuggingFaceFiles hugging_face;
  // Load, Hugging Face: when set, every rank reads hugging_face.config_file
  // and passes its text here before the load's one agreement; a file that
  // cannot be read (kDataLoss) or an error returned fails the load on every
  // rank, naming the file. models::LoadPeftAdapter checks that
  // adapter_config.json is the model's adapter this way. Refused for a
  // directory holding another format.
  std::function<absl::Status(const std::string& config_text)> check_config;
};

// Saves the model, the optimizer (when given) and `train_state` as a
// sharded checkpoint in `dir` (created if absent; the same directory on
// every rank); with format kHuggingFace, the model's weights only (an
// optimizer or a train state is refused). Requires optimizer state for
// every parameter that has had a gradient (save after a step). A directory
// holding a checkpoint of another format (or an older SHARDED one,
// manifest.pb) is refused: the two would make it ambiguous.
absl::Status SaveCheckpoint(const std::string& dir, FullyShardedModel& model,
                            torch::optim::Optimizer* optimizer = nullptr,
                            const TrainState& train_state = {},
                            const CheckpointIoOptions& options = {});
// Loads what SaveCheckpoint saved, at any world size; also a Distributed
// Checkpoint PyTorch saved as above, a Hugging Face checkpoint (the model's
// weights; an optimizer is refused), and this project's older SHARDED
// checkpoints (a manifest.pb; model and optimizer, step from its metadata).
// kNotFound when `dir` holds no checkpoint (absent, or none of .metadata,
// <hugging_face.stem>.safetensors[.index.json], manifest.pb): a new run
// starts there (a damaged checkpoint is kDataLoss, never kNotFound). A directory of the
// main job's step-NNNNNNNN checkpoints is refused, naming them.
// `train_state`, when given, is set from the checkpoint's (left as it is
// when the checkpoint has none).
absl::Status LoadCheckpoint(const std::string& dir, FullyShardedModel& model,
                            torch::optim::Optimizer* optimizer = nullptr,
                            TrainState* train_state = nullptr,
                            const CheckpointIoOptions& options = {});

// torch.save files, one process writing: what torch.load reads. Tensors
// must be on CPU (GetModelStateDict with cpu_offload, on rank 0). The
// optimizer's state is written keyed by FQN, as get_optimizer_state_dict's.
absl::Status SaveTorchFile(const std::string& path, const StateDict& state);
absl::Status SaveTorchFile(const std::string& path, const OptimStateDict& state);
// Reads a torch.save file without executing anything in it: a dict of
// tensors (StateDict, the default) or an optimizer's state dict keyed by
// FQN (OptimStateDict; one keyed by parameter index, a plain
// Optimizer.state_dict(), is refused: rekey it in Python with
// get_optimizer_state_dict). `entry` selects a nested dict ("model" of
// {"model": ..., "optimizer": ...}); "" the top level.
template <typename T = StateDict>
absl::StatusOr<T> LoadTorchFile(const std::string& path, const std::string& entry = "");
template <>
absl::StatusOr<StateDict> LoadTorchFile<StateDict>(const std::string& path,
                                                   const std::string& entry);
template <>
absl::StatusOr<OptimStateDict> LoadTorchFile<OptimStateDict>(const std::string& path,
                                                             const std::string& entry);

}  // namespace fsdp

#endif  // FSDP_CHECKPOINT_CHECKPOINT_H_
