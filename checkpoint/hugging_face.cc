#include "checkpoint/hugging_face_internal.h"

#include <sys/stat.h>

#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "base/fnv1a.h"
#include "base/status.h"
#include "c10/core/GradMode.h"
#include "checkpoint/agree.h"
#include "comm/collectives.h"
#include "formats/atomic_file.h"
#include "fsdp/shard_placement.h"
#include "hf/safetensors.h"
#include "statedict/load_check.h"
#include "statedict/model_tensors.h"
#include "statedict/state_dict.h"

namespace fsdp::checkpoint_internal {
namespace {

using statedict_internal::NamedTensors;

// The model's tensors under all their names: a tied tensor is one entry
// with several names, in state_dict order.
struct ModelTensor {
  std::vector<std::string> names;
  at::Tensor tensor;       // The module's own.
  size_t first_index = 0;  // Of names[0] in state_dict order.
};

// Whether `files` selects the tensor (HuggingFaceFiles::tensors).
bool Selected(const HuggingFaceFiles& files, const at::Tensor& t) {
  switch (files.tensors) {
    case HuggingFaceTensors::kAll:
      return true;
    case HuggingFaceTensors::kTrainable:
      return t.requires_grad();
    case HuggingFaceTensors::kFrozen:
      return !t.requires_grad();
  }
  return true;
}

// Only those `files` selects, each name with the files' prefix.
std::vector<ModelTensor> ModelTensors(const StateDict& named, const HuggingFaceFiles& files) {
  std::vector<ModelTensor> tensors;
  std::unordered_map<const void*, size_t> seen;
  for (size_t k = 0; k < named.size(); ++k) {
    if (!Selected(files, named[k].second)) continue;
    auto [it, inserted] = seen.emplace(named[k].second.unsafeGetTensorImpl(), tensors.size());
    if (inserted) tensors.push_back({{}, named[k].second, k});
    tensors[it->second].names.push_back(files.name_prefix + named[k].first);
  }
  return tensors;
}

bool IsFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// What a load will read: the open files, and for each tensor it fills
// the checkpoint's name and this rank's elements of the model's tensor.
struct LoadPlan {
  hf::SafetensorsCheckpoint checkpoint;
  std::vector<std::pair<std::string, ShardPlacement>> sources;
};

// Which checkpoint name fills `tensor` (the first of its names the checkpoint
// has), checked against the model; nullopt, with the problem recorded or an
// allowed absence, when nothing will.
std::optional<std::string> SourceName(const ModelTensor& tensor, const ShardPlacement& placement,
                                      const hf::SafetensorsCheckpoint& checkpoint, bool strict,
                                      LoadCheck& check) {
  const hf::SafetensorsEntry* entry = nullptr;
  for (const std::string& name : tensor.names) {
    if ((entry = checkpoint.Find(name)) != nullptr) break;
  }
  if (entry == nullptr) {
    if (strict) check.Missing(tensor.names.front());
    return std::nullopt;
  }
  const std::string subject = LoadCheck::Quoted(entry->name);
  const at::ScalarType model_dtype = placement.local.scalar_type();
  if (entry->dtype == at::ScalarType::Undefined) {
    check.Problem(absl::StrCat(subject, " is ", entry->dtype_name,
                               ", a dtype this library does not read"));
    return std::nullopt;
  }
  const bool cast = at::isFloatingType(entry->dtype) && at::isFloatingType(model_dtype);
  if (!check.ShapeMatches(subject, entry->shape, placement.full_shape) ||
      (!cast && !check.DtypeMatches(subject, entry->dtype, model_dtype))) {
    return std::nullopt;
  }
  if (!placement.in_place) {
    check.Problem(absl::StrCat(subject, " is not contiguous in the model: it cannot be loaded in "
                               "place"));
    return std::nullopt;
  }
  return entry->name;
}

// What this rank read, for the ranks to compare: ranks that see different
// files (a network file system's cache, an export in progress) must not
// each load their own.
std::string Fingerprint(const hf::SafetensorsCheckpoint& checkpoint) {
  uint64_t hash = kFnv1aOffsetBasis;
  for (const std::string& name : checkpoint.names()) {
    const hf::SafetensorsEntry& e = *checkpoint.Find(name);
    hash = Fnv1aString(hash, name);
    hash = Fnv1aString(hash, e.dtype_name);
    for (int64_t d : e.shape) hash = Fnv1a(hash, &d, sizeof(d));
    hash = Fnv1a(hash, &e.begin, sizeof(e.begin));
    hash = Fnv1a(hash, &e.end, sizeof(e.end));
  }
  return absl::StrCat("a checkpoint of ", checkpoint.names().size(), " tensors (fingerprint ",
                      hash, ")");
}

// Opens the checkpoint (every file's header, checked against the file) and
// checks it against the model; reads no tensor and changes nothing. `seen`
// says what this rank found, for SameOnEveryRank.
absl::StatusOr<LoadPlan> PlanLoad(const std::string& dir, FullyShardedModel& model,
                                  const CheckpointIoOptions& options, std::string& seen) {
  const bool strict = options.strict;
  FSDP_ASSIGN_OR_RETURN(hf::SafetensorsCheckpoint checkpoint,
                        hf::SafetensorsCheckpoint::Open(dir, options.hugging_face.stem));
  seen = Fingerprint(checkpoint);
  const std::vector<ModelTensor> tensors =
      ModelTensors(NamedTensors(model.units().front()->module()), options.hugging_face);
  const ShardPlacements placements = ShardPlacementsOf(model);
  LoadCheck check;
  std::set<std::string> model_names;
  std::vector<std::pair<std::string, ShardPlacement>> sources;
  for (const ModelTensor& tensor : tensors) {
    model_names.insert(tensor.names.begin(), tensor.names.end());
    ShardPlacement placement = PlacementOf(placements, tensor.tensor);
    if (auto name = SourceName(tensor, placement, checkpoint, strict, check)) {
      sources.emplace_back(*name, std::move(placement));
    }
  }
  if (strict) {
    for (const std::string& name : checkpoint.names()) {
      if (model_names.count(name) == 0) check.NotInModel(name);
    }
  }
  FSDP_RETURN_IF_ERROR(check.ToStatus(
      absl::StrCat("the Hugging Face checkpoint '", dir, "' does not fit the model (nothing was "
                   "changed)")));
  return LoadPlan{std::move(checkpoint), std::move(sources)};
}

// Reads this rank's elements of every planned tensor straight into its
// shard (cast to the model's dtype on the way), one tensor at a time.
absl::Status ApplyLoad(const LoadPlan& plan) {
  at::NoGradGuard no_grad;
  for (const auto& [name, placement] : plan.sources) {
    absl::Status read =
        plan.checkpoint.ReadFlatInto(name, placement.lo, placement.hi, placement.local);
    if (!read.ok()) {
      return absl::Status(read.code(), absl::StrCat(read.message(), "; the model may now be "
                                                                    "partly loaded"));
    }
  }
  return absl::OkStatus();
}

// Every rank of the shard group and of the replicate group compares `seen`.
absl::Status SameOnEveryRank(FullyShardedModel& model, const std::string& dir,
                             const std::string& seen) {
  std::vector<Collectives*> groups = {&model.group()};
  if (model.replicate_group() != nullptr) groups.push_back(model.replicate_group());
  for (Collectives* group : groups) {
    const std::vector<std::string> all = AllGatherBytes(*group, seen);
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r] != seen) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the ranks read different things at '", dir, "': this rank ", seen, ", rank ", r,
            " of its group ", all[r], "; every rank must see the same files"));
      }
    }
  }
  return absl::OkStatus();
}

// The tensors in the order the units are gathered, so that one rank can
// stream them: per state_dict index, the spec (null for a tied tensor's
// second name, written once).
struct SavePlan {
  std::vector<hf::SafetensorsTensorSpec> specs;
  std::vector<std::optional<at::ScalarType>> dtype_by_index;
};

SavePlan PlanSave(FullyShardedModel& model, const StateDict& named,
                  const CheckpointIoOptions& options) {
  const ShardPlacements placements = ShardPlacementsOf(model);
  SavePlan plan;
  plan.dtype_by_index.resize(named.size());
  for (const ModelTensor& tensor : ModelTensors(named, options.hugging_face)) {
    const at::ScalarType own =
        model.BufferFullPrecisionDtype(tensor.tensor).value_or(tensor.tensor.scalar_type());
    plan.dtype_by_index[tensor.first_index] =
        options.dtype && at::isFloatingType(own) ? *options.dtype : own;
  }
  for (size_t k : FullStateDictVisitOrder(model)) {
    if (!plan.dtype_by_index[k]) continue;
    const at::Tensor& t = named[k].second;
    plan.specs.push_back({options.hugging_face.name_prefix + named[k].first,
                          *plan.dtype_by_index[k], PlacementOf(placements, t).full_shape});
  }
  return plan;
}

}  // namespace

bool IsHuggingFaceDirectory(const std::string& dir, const std::string& stem) {
  return IsFile(dir + "/" + stem + ".safetensors.index.json") ||
         IsFile(dir + "/" + stem + ".safetensors");
}

absl::Status LoadHuggingFace(const std::string& dir, FullyShardedModel& model,
                             const CheckpointIoOptions& options) {
  CollectiveLabel label(model.group(), model.replicate_group(), "",
                        "loading a Hugging Face checkpoint");
  std::string seen = "an unreadable checkpoint";
  absl::StatusOr<LoadPlan> plan = absl::UnknownError("not planned");
  try {
    plan = PlanLoad(dir, model, options, seen);
  } catch (...) {
    plan = StatusFromCurrentException();
  }
  absl::Status planned = plan.status();
  try {
    absl::Status same = SameOnEveryRank(model, dir, seen);
    if (planned.ok()) planned = same;
  } catch (...) {
    if (planned.ok()) planned = StatusFromCurrentException();
  }
  FSDP_RETURN_IF_ERROR(AgreeAcrossRanks(model, planned));
  // Read in place rather than staged: a rank's whole share held twice is
  // what a load must not cost (a 1.1 B model at W = 1 would need 8 GiB, not
  // 4). Everything but the reads themselves was checked above.
  absl::Status applied;
  try {
    applied = ApplyLoad(*plan);
  } catch (...) {
    const absl::Status thrown = StatusFromCurrentException();
    applied = absl::Status(thrown.code(), absl::StrCat(thrown.message(), "; the model may "
                                                       "now be partly loaded"));
  }
  return AgreeAfterLoad(model, applied, "model's parameters");
}

absl::Status SaveHuggingFace(const std::string& dir, FullyShardedModel& model,
                             const CheckpointIoOptions& options) {
  if (options.dtype && !at::isFloatingType(*options.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SaveCheckpoint: CheckpointIoOptions::dtype ", c10::toString(*options.dtype),
        " is not a floating-point dtype"));
  }
  const StateDict named = NamedTensors(model.units().front()->module());
  const SavePlan plan = PlanSave(model, named, options);
  // One writer for the whole job: rank 0 of the shard group and, under
  // hybrid sharding, of the replicate group (the other replicas hold the
  // same shards).
  Collectives* replicas = model.replicate_group();
  const bool writes = model.group().rank() == 0 && (replicas == nullptr || replicas->rank() == 0);
  std::optional<hf::SafetensorsCheckpointWriter> writer;
  absl::Status written;
  if (writes) {
    try {
      auto created = hf::SafetensorsCheckpointWriter::Create(
          dir, plan.specs, options.max_file_bytes, {{"format", "pt"}}, options.hugging_face.stem);
      written = created.status();
      if (created.ok()) writer.emplace(std::move(*created));
    } catch (...) {
      written = StatusFromCurrentException();
    }
  }
  FullStateDictOptions gather;
  gather.rank0_only = true;
  absl::Status visited = VisitFullStateDict(model, gather, [&](size_t k, const at::Tensor& value) {
    FSDP_RETURN_IF_ERROR(written);
    if (!writes || !plan.dtype_by_index[k]) return absl::OkStatus();
    return writer->Write(options.hugging_face.name_prefix + named[k].first,
                         value.to(*plan.dtype_by_index[k]));
  });
  if (written.ok()) written = visited;
  // Published only once every rank gathered every unit: a failure anywhere
  // leaves the earlier export as it was.
  FSDP_RETURN_IF_ERROR(AgreeAcrossRanks(model, written));
  if (writes) {
    written = CatchAsStatus([&] {
      FSDP_RETURN_IF_ERROR(writer->Commit());
      if (!options.config_json.empty()) {
        FSDP_RETURN_IF_ERROR(WriteFileAtomically(dir + "/" + options.hugging_face.config_file,
                                                 options.config_json.data(),
                                                 options.config_json.size()));
      }
      // The job's one writer is done: what temporary files remain are
      // those of saves that were killed.
      RemoveAbandonedTempFiles(dir);
      return absl::OkStatus();
    });
  }
  return AgreeAcrossRanks(model, written);
}

}  // namespace fsdp::checkpoint_internal
