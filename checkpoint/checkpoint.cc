// SaveCheckpoint, LoadCheckpoint, SaveTorchFile and LoadTorchFile
// (checkpoint/checkpoint.h), over the sharded DCP checkpoints of
// optim/dcp_checkpoint.h and statedict/dcp_sharded.h, the older SHARDED
// format's loaders, and the torch.save readers and writers.
#include "checkpoint/checkpoint.h"

#include <dirent.h>
#include <sys/stat.h>

#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/fnv1a.h"
#include "base/status.h"
#include "checkpoint/agree.h"
#include "checkpoint/hugging_face_internal.h"
#include "checkpoint/save_internal.h"
#include "comm/collectives.h"
#include "formats/dcp.h"
#include "optim/dcp_checkpoint.h"
#include "optim/run_checkpoints.h"
#include "optim/torch_optim_file.h"
#include "optim/training_checkpoint.h"
#include "statedict/dcp_sharded.h"
#include "statedict/sharded_checkpoint.h"

namespace fsdp {
namespace {

using checkpoint_internal::AgreeAcrossRanks;
using checkpoint_internal::IsHuggingFaceDirectory;

constexpr char kModelKey[] = "model";
constexpr char kDataPositionKey[] = "data_position";

std::vector<DcpPathPart> TrainStatePath(const std::string& name) {
  std::vector<DcpPathPart> path = {{false, kDcpTrainStateKey, 0}};
  for (absl::string_view part : absl::StrSplit(name, '.')) {
    path.push_back({false, std::string(part), 0});
  }
  return path;
}

// A label's name must nest cleanly and leave step and data_position alone.
absl::Status CheckLabelName(const std::string& name) {
  bool ok = !name.empty();
  for (absl::string_view part : absl::StrSplit(name, '.')) {
    ok = ok && !part.empty();
    for (char c : part) ok = ok && (absl::ascii_isalnum(c) || c == '_');
  }
  const std::string first = name.substr(0, name.find('.'));
  if (ok && first != kStepMetadataKey && first != kDataPositionKey) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "TrainState label '", PrintableText(name),
      "': expected parts of [A-Za-z0-9_] joined by '.', neither step nor data_position"));
}

absl::StatusOr<std::vector<DcpItem>> TrainStateItems(const TrainState& state) {
  std::vector<DcpItem> items = {
      {TrainStatePath(kStepMetadataKey), c10::IValue(state.step)},
      {TrainStatePath(kDataPositionKey), c10::IValue(state.data_position)}};
  for (auto it = state.labels.begin(); it != state.labels.end(); ++it) {
    FSDP_RETURN_IF_ERROR(CheckLabelName(it->first));
    // "a" beside "a.b" would make train_state["a"] both a string and a
    // dict, which dcp.load cannot rebuild. '.' sorts first among the
    // allowed characters, so such a name follows right after.
    auto next = std::next(it);
    if (next != state.labels.end() && absl::StartsWith(next->first, it->first + ".")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "TrainState labels '", PrintableText(it->first), "' and '", PrintableText(next->first),
          "': a label cannot also be the prefix of another"));
    }
    items.push_back({TrainStatePath(it->first), c10::IValue(it->second)});
  }
  return items;
}

// The train_state a DCP checkpoint holds; what it lacks stays as `state`
// has it.
absl::Status ReadDcpTrainState(const std::string& dir, TrainState& state) {
  FSDP_ASSIGN_OR_RETURN(const DcpMetadata metadata, ReadDcpMetadata(dir));
  const std::string prefix = absl::StrCat(kDcpTrainStateKey, ".");
  for (const DcpBytesEntry& bytes : metadata.bytes) {
    if (!absl::StartsWith(bytes.fqn, prefix)) continue;
    int64_t* field = nullptr;
    if (bytes.fqn == prefix + kStepMetadataKey) field = &state.step;
    if (bytes.fqn == prefix + kDataPositionKey) field = &state.data_position;
    FSDP_ASSIGN_OR_RETURN(const PyRef value, ReadDcpBytes(dir, bytes));
    if (field == nullptr) {
      // A label; a PyTorch job's other train_state values are not ours.
      if (value->kind == PyValue::Kind::kString) {
        state.labels[bytes.fqn.substr(prefix.size())] = value->s;
      }
      continue;
    }
    if (value->kind != PyValue::Kind::kInt) {
      return absl::DataLossError(absl::StrCat("the checkpoint '", dir, "': its '", bytes.fqn,
                                              "' is not an integer"));
    }
    *field = value->i;
  }
  return absl::OkStatus();
}

// The step an older SHARDED checkpoint's manifest records, if any.
absl::Status ReadShardedTrainState(const std::string& dir, TrainState& state) {
  FSDP_ASSIGN_OR_RETURN(const CheckpointMetadata metadata, ReadCheckpointMetadata(dir));
  for (const auto& [name, value] : metadata) {
    if (name != kStepMetadataKey) state.labels[name] = value;
  }
  const auto step = metadata.find(kStepMetadataKey);
  if (step == metadata.end()) return absl::OkStatus();
  if (!absl::SimpleAtoi(step->second, &state.step)) {
    return absl::DataLossError(absl::StrCat("the checkpoint '", dir, "': its step '",
                                            PrintableText(step->second),
                                            "' is not an integer"));
  }
  return absl::OkStatus();
}

bool IsFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Whether `dir` holds step-NNNNNNNN directories (a run's checkpoints, as
// the main job keeps them).
bool HoldsStepDirectories(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return false;
  bool found = false;
  while (dirent* e = readdir(d)) {
    if (absl::StartsWith(e->d_name, "step-")) found = true;
  }
  closedir(d);
  return found;
}

// A safetensors file of a Hugging Face checkpoint in `dir`, of any stem
// (transformers' model, PEFT's adapter_model, ...), or "" when none: beside
// a Distributed Checkpoint it makes the directory ambiguous.
std::string SafetensorsFile(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return "";
  std::string found;
  while (dirent* e = readdir(d)) {
    const absl::string_view name = e->d_name;
    if (found.empty() && (absl::EndsWith(name, ".safetensors") ||
                          absl::EndsWith(name, ".safetensors.index.json"))) {
      found = std::string(name);
    }
  }
  closedir(d);
  return found;
}

// HuggingFaceFiles' file names: each a plain name inside the directory.
absl::Status CheckHuggingFaceFiles(const HuggingFaceFiles& files) {
  for (const auto& [field, name] : {std::pair<const char*, const std::string*>{"stem", &files.stem},
                                    {"config_file", &files.config_file}}) {
    if (name->empty() || *name == "." || *name == ".." ||
        name->find('/') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "CheckpointIoOptions::hugging_face.", field, " '", PrintableText(*name),
          "': expected a file name inside the directory (not empty, no '/', not . or ..)"));
    }
  }
  return absl::OkStatus();
}

enum class Format { kNone, kDcp, kSharded, kHuggingFace };

// Which checkpoint `dir` holds, as this rank sees it.
// `hf_stem`: the Hugging Face files' (HuggingFaceFiles::stem).
absl::StatusOr<Format> FormatOf(const std::string& dir, const std::string& hf_stem) {
  const bool dcp = IsDcpDirectory(dir);
  const bool sharded = IsFile(dir + "/manifest.pb");
  const bool hugging_face = IsHuggingFaceDirectory(dir, hf_stem);
  // Beside another format, a safetensors file of any stem is ambiguous.
  const std::string safetensors = hugging_face || dcp || sharded ? SafetensorsFile(dir) : "";
  if (dcp + sharded + !safetensors.empty() > 1) {
    return absl::DataLossError(absl::StrCat(
        "'", dir, "' holds more than one checkpoint (", dcp ? "a Distributed Checkpoint's "
        ".metadata, " : "", sharded ? "a SHARDED manifest.pb, " : "",
        safetensors.empty() ? "" : absl::StrCat("a Hugging Face checkpoint's ", safetensors, ", "),
        "): which one is the checkpoint is unclear; remove the others"));
  }
  if (dcp) return Format::kDcp;
  if (sharded) return Format::kSharded;
  if (hugging_face) return Format::kHuggingFace;
  if (HoldsStepDirectories(dir)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "'", dir, "' holds no checkpoint itself but step-NNNNNNNN directories, as a run of the "
        "main job keeps them: pass one of those"));
  }
  return Format::kNone;
}

// A loader's kNotFound (a shard file that cannot be opened, on the rank
// reading it) is damage, not the absence of a checkpoint, which callers
// take kNotFound to mean.
absl::Status NotFoundIsDamage(absl::Status status) {
  if (!absl::IsNotFound(status)) return status;
  return absl::DataLossError(status.message());
}

const char* FormatName(Format format) {
  switch (format) {
    case Format::kNone:
      return "no checkpoint";
    case Format::kDcp:
      return "a Distributed Checkpoint";
    case Format::kSharded:
      return "a SHARDED checkpoint";
    case Format::kHuggingFace:
      return "a Hugging Face checkpoint";
  }
  return "?";
}

// What a DCP load reads before any rank changes anything: this rank's part
// of the model and of the optimizer state, checked.
struct StagedDcp {
  StagedDcpLoad model;
  StagedDcpOptimizer optim;
};

absl::Status StageDcp(const std::string& dir, FullyShardedModel& model,
                      torch::optim::Optimizer* optimizer, StagedDcp& staged) {
  if (optimizer != nullptr) {
    FSDP_RETURN_IF_ERROR(StageShardedDcpOptimizer(model, *optimizer, dir,
                                                  DcpCheckpointKeys().optim, staged.optim));
  }
  return StageShardedDcp(dir, ModelDcpShards(model, kModelKey, /*every_name=*/false),
                         staged.model);
}

// This rank's half of a load, before the one agreement: its train state
// into `read` and, from a DCP checkpoint, this rank's parts. Changes
// nothing; no collective.
absl::Status ReadBeforeAgreeing(const std::string& dir, Format format, FullyShardedModel& model,
                                torch::optim::Optimizer* optimizer, TrainState* read,
                                StagedDcp& staged) {
  if (format == Format::kSharded) {
    return read != nullptr ? ReadShardedTrainState(dir, *read) : absl::OkStatus();
  }
  if (format != Format::kDcp) return absl::OkStatus();
  if (read != nullptr) FSDP_RETURN_IF_ERROR(ReadDcpTrainState(dir, *read));
  const absl::Status stage = NotFoundIsDamage(StageDcp(dir, model, optimizer, staged));
  if (stage.ok()) return stage;
  return absl::Status(stage.code(), absl::StrCat("nothing was loaded: ", stage.message()));
}

// CheckpointIoOptions::check_config on the config file `dir` holds.
absl::Status CheckConfigFile(const std::string& dir, Format format,
                             const CheckpointIoOptions& options) {
  const std::string path = dir + "/" + options.hugging_face.config_file;
  if (format != Format::kHuggingFace) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LoadCheckpoint: '", dir, "' is ", FormatName(format), ", not a Hugging Face checkpoint "
        "with '", options.hugging_face.config_file, "', which the options check"));
  }
  std::ifstream in(path);
  if (!in) return absl::DataLossError(absl::StrCat("cannot open '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  const absl::Status checked = options.check_config(text.str());
  if (checked.ok()) return checked;
  return absl::Status(checked.code(), absl::StrCat("'", path, "': ", checked.message()));
}

// What the ranks must agree on of the options: the Hugging Face files'
// (ranks passing other `tensors` would each load another set).
std::string HuggingFaceFilesSeen(const CheckpointIoOptions& options) {
  const HuggingFaceFiles& files = options.hugging_face;
  return absl::StrCat("; Hugging Face files '", PrintableText(files.stem), "', prefix '",
                      PrintableText(files.name_prefix), "', tensors ",
                      static_cast<int>(files.tensors), ", config '",
                      PrintableText(files.config_file), "' ",
                      options.check_config ? "checked" : "unchecked", ", strict ",
                      options.strict);
}

// A checkpoint of `format` beside one of another format would make the
// directory ambiguous to LoadCheckpoint; the other is not ours to remove.
absl::Status NoOtherFormat(const std::string& dir, const CheckpointIoOptions& options) {
  const CheckpointFormat format = options.format;
  const char* other = nullptr;
  if (IsFile(dir + "/manifest.pb")) other = "a SHARDED checkpoint (manifest.pb) of an earlier version";
  std::string safetensors;
  if (format == CheckpointFormat::kDistributed) safetensors = SafetensorsFile(dir);
  if (!safetensors.empty()) {
    safetensors = absl::StrCat("a Hugging Face checkpoint (", safetensors, ")");
    other = safetensors.c_str();
  }
  if (format == CheckpointFormat::kHuggingFace && IsDcpDirectory(dir)) {
    other = "a Distributed Checkpoint (.metadata)";
  }
  if (other == nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "'", dir, "' holds ", other, "; save to another directory (LoadCheckpoint reads this one)"));
}

}  // namespace

// NOTE [One round per call]: a save and a load each agree across ranks once
// (the save's round is its commit: every rank's file reported to rank 0
// before it writes .metadata, then the outcome to all). What a save checks
// first (a SHARDED checkpoint in the way) travels in that report round; a
// load reads and checks everything, what the directory holds and the train
// state it resolved included, before its single agreement, after which each
// rank only copies what it staged and confirms that it did (AgreeAfterLoad:
// one small all-gather, so that a copy failing on some ranks is not seen
// as a landed load on the others). Under hybrid sharding only the writers'
// shard group reports, so there the check before a save is agreed in a
// round of its own.
absl::Status SaveCheckpoint(const std::string& dir, FullyShardedModel& model,
                            torch::optim::Optimizer* optimizer, const TrainState& train_state,
                            const CheckpointIoOptions& options) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("saving a checkpoint"));
  if (options.format == CheckpointFormat::kHuggingFace) {
    if (optimizer != nullptr || train_state.step != 0 || train_state.data_position != 0 ||
        !train_state.labels.empty()) {
      return absl::InvalidArgumentError(
          "SaveCheckpoint: a Hugging Face checkpoint holds the model's weights only; pass no "
          "optimizer and no train state (a Distributed Checkpoint keeps them)");
    }
    absl::Status ready = CheckHuggingFaceFiles(options.hugging_face);
    if (ready.ok()) ready = NoOtherFormat(dir, options);
    FSDP_RETURN_IF_ERROR(AgreeAcrossRanks(model, ready));
    return checkpoint_internal::SaveHuggingFace(dir, model, options);
  }
  FSDP_ASSIGN_OR_RETURN(checkpoint_internal::DistributedSave save,
                        checkpoint_internal::PrepareDistributedSave(dir, model, optimizer,
                                                                    train_state, options));
  return SaveModelShardedDcp(model, dir, save.shards, save.values, save.ready);
}

namespace checkpoint_internal {

absl::StatusOr<DistributedSave> PrepareDistributedSave(const std::string& dir,
                                                       FullyShardedModel& model,
                                                       torch::optim::Optimizer* optimizer,
                                                       const TrainState& train_state,
                                                       const CheckpointIoOptions& options) {
  DistributedSave save;
  absl::StatusOr<std::vector<DcpItem>> items = TrainStateItems(train_state);
  save.ready = items.status();
  if (save.ready.ok()) save.ready = CheckHuggingFaceFiles(options.hugging_face);
  if (save.ready.ok()) save.ready = NoOtherFormat(dir, options);
  if (model.replicate_group() != nullptr) {
    FSDP_RETURN_IF_ERROR(AgreeAcrossRanks(model, save.ready));
  }
  if (!save.ready.ok()) return save;
  save.values = *std::move(items);
  save.ready = CatchAsStatus([&]() -> absl::Status {
    if (optimizer == nullptr) {
      save.shards = ModelDcpShards(model, kModelKey, /*every_name=*/true);
      return absl::OkStatus();
    }
    FSDP_ASSIGN_OR_RETURN(DcpModelAndOptimizer state,
                          DcpShardsOfModelAndOptimizer(model, *optimizer, {}, save.values));
    save.shards = std::move(state.shards);
    save.values = std::move(state.values);
    return absl::OkStatus();
  });
  return save;
}

}  // namespace checkpoint_internal

absl::Status LoadCheckpoint(const std::string& dir, FullyShardedModel& model,
                            torch::optim::Optimizer* optimizer, TrainState* train_state,
                            const CheckpointIoOptions& options) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("loading a checkpoint"));
  // What each rank saw is part of the agreement: ranks that see the
  // directory differently (a network file system's cache) fail together
  // instead of waiting for each other in different loads.
  TrainState read = train_state != nullptr ? *train_state : TrainState{};
  const absl::Status files = CheckHuggingFaceFiles(options.hugging_face);
  const absl::StatusOr<Format> format =
      files.ok() ? FormatOf(dir, options.hugging_face.stem) : absl::StatusOr<Format>(files);
  StagedDcp staged;
  absl::Status local = format.status();
  if (local.ok()) {
    try {
      local = ReadBeforeAgreeing(dir, *format, model, optimizer,
                                 train_state != nullptr ? &read : nullptr, staged);
      if (local.ok() && options.check_config && *format != Format::kNone) {
        local = CheckConfigFile(dir, *format, options);
      }
    } catch (...) {
      local = StatusFromCurrentException();
    }
  }
  // What this rank read, train state included: ranks that resolved another
  // step or read another .metadata must not each load their own.
  std::string seen = format.ok() ? FormatName(*format) : "an unreadable directory";
  if (local.ok() && train_state != nullptr) {
    uint64_t labels = kFnv1aOffsetBasis;
    for (const auto& [name, value] : read.labels) {
      labels = Fnv1aString(Fnv1aString(labels, name), value);
    }
    absl::StrAppend(&seen, " at step ", read.step, ", data position ", read.data_position,
                    ", labels ", labels);
  }
  absl::StrAppend(&seen, HuggingFaceFilesSeen(options));
  FSDP_RETURN_IF_ERROR(AgreeAcrossRanks(model, local, seen, dir));
  if (*format == Format::kNone) {
    return absl::NotFoundError(absl::StrCat("'", dir, "' holds no checkpoint (none of .metadata, ",
                                            options.hugging_face.stem,
                                            ".safetensors[.index.json], manifest.pb)"));
  }
  if (*format == Format::kHuggingFace) {
    if (optimizer != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "LoadCheckpoint: '", dir, "' is a Hugging Face checkpoint, which holds no optimizer "
          "state; pass no optimizer"));
    }
    return NotFoundIsDamage(checkpoint_internal::LoadHuggingFace(dir, model, options));
  }
  if (!options.strict) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LoadCheckpoint: '", dir, "' is ", FormatName(*format), ", which loads strictly "
        "(strict = false is for Hugging Face checkpoints)"));
  }
  // A failure while applying (out of memory) on some ranks only leaves the
  // ranks apart: every rank learns it (kAborted where the load landed).
  absl::Status applied;
  try {
    if (*format == Format::kDcp) {
      applied = ApplyStagedDcp(staged.model);
      if (applied.ok() && optimizer != nullptr) {
        applied = ApplyStagedDcpOptimizer(model, *optimizer, dir, staged.optim);
      }
    } else if (optimizer != nullptr) {
      applied = NotFoundIsDamage(LoadTrainingCheckpoint(model, *optimizer, dir));
    } else {
      applied = NotFoundIsDamage(LoadShardedCheckpoint(model, dir));
    }
  } catch (...) {
    applied = StatusFromCurrentException();
  }
  FSDP_RETURN_IF_ERROR(checkpoint_internal::AgreeAfterLoad(model, applied, "checkpoint"));
  if (train_state != nullptr) *train_state = read;
  return absl::OkStatus();
}

absl::Status SaveTorchFile(const std::string& path, const StateDict& state) {
  return SaveTorchStateDict(path, state);
}

absl::Status SaveTorchFile(const std::string& path, const OptimStateDict& state) {
  return SaveTorchOptimStateDict(path, state, OptimStateKeys::kParameterFqn);
}

template <>
absl::StatusOr<StateDict> LoadTorchFile<StateDict>(const std::string& path,
                                                   const std::string& entry) {
  return LoadTorchStateDict(path, entry);
}

template <>
absl::StatusOr<OptimStateDict> LoadTorchFile<OptimStateDict>(const std::string& path,
                                                             const std::string& entry) {
  return LoadTorchOptimStateDict(path, entry);
}

}  // namespace fsdp
