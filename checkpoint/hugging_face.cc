#include "checkpoint/hugging_face.h"

#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "c10/core/GradMode.h"
#include "checkpoint/agree.h"
#include "fsdp/shard_placement.h"
#include "hf/safetensors.h"
#include "statedict/atomic_file.h"
#include "statedict/load_check.h"
#include "statedict/model_tensors.h"
#include "statedict/state_dict.h"

namespace fsdp {
namespace {

using checkpoint_internal::AgreeAcrossRanks;
using checkpoint_internal::AgreeAfterLoad;
using statedict_internal::NamedTensors;

// The model's tensors under all their names: a tied tensor is one entry
// with several names, in state_dict order.
struct ModelTensor {
  std::vector<std::string> names;
  at::Tensor tensor;  // The module's own.
  size_t first_index = 0;  // Of names[0] in state_dict order.
};

std::vector<ModelTensor> ModelTensors(const StateDict& named) {
  std::vector<ModelTensor> tensors;
  std::unordered_map<const void*, size_t> seen;
  for (size_t k = 0; k < named.size(); ++k) {
    auto [it, inserted] = seen.emplace(named[k].second.unsafeGetTensorImpl(), tensors.size());
    if (inserted) tensors.push_back({{}, named[k].second, k});
    tensors[it->second].names.push_back(named[k].first);
  }
  return tensors;
}

// What a load will copy into one tensor's local elements.
struct PlannedRead {
  at::Tensor local;
  at::Tensor value;
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

// Checks the checkpoint against the model and reads this rank's elements
// of every tensor it fills; changes nothing.
absl::StatusOr<std::vector<PlannedRead>> PlanLoad(const std::string& dir,
                                                  FullyShardedModel& model,
                                                  const HuggingFaceLoadOptions& options) {
  FSDP_ASSIGN_OR_RETURN(const hf::SafetensorsCheckpoint checkpoint,
                        hf::SafetensorsCheckpoint::Open(dir));
  const std::vector<ModelTensor> tensors =
      ModelTensors(NamedTensors(model.units().front()->module()));
  const ShardPlacements placements = ShardPlacementsOf(model);
  LoadCheck check;
  std::set<std::string> model_names;
  std::vector<std::pair<std::string, ShardPlacement>> sources;
  for (const ModelTensor& tensor : tensors) {
    model_names.insert(tensor.names.begin(), tensor.names.end());
    ShardPlacement placement = PlacementOf(placements, tensor.tensor);
    if (auto name = SourceName(tensor, placement, checkpoint, options.strict, check)) {
      sources.emplace_back(*name, std::move(placement));
    }
  }
  if (options.strict) {
    for (const std::string& name : checkpoint.names()) {
      if (model_names.count(name) == 0) check.NotInModel(name);
    }
  }
  FSDP_RETURN_IF_ERROR(check.ToStatus(
      absl::StrCat("the Hugging Face checkpoint '", dir, "' does not fit the model (nothing was "
                   "changed)")));
  std::vector<PlannedRead> reads;
  for (const auto& [name, placement] : sources) {
    FSDP_ASSIGN_OR_RETURN(at::Tensor value, checkpoint.ReadFlat(name, placement.lo, placement.hi));
    reads.push_back({placement.local, value.to(placement.local.scalar_type())});
  }
  return reads;
}

}  // namespace

absl::Status LoadHuggingFaceCheckpoint(const std::string& dir, FullyShardedModel& model,
                                       const HuggingFaceLoadOptions& options) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("LoadHuggingFaceCheckpoint"));
  absl::StatusOr<std::vector<PlannedRead>> reads = PlanLoad(dir, model, options);
  FSDP_RETURN_IF_ERROR(AgreeAcrossRanks(model, reads.status()));
  absl::Status applied;
  try {
    at::NoGradGuard no_grad;
    for (PlannedRead& read : *reads) read.local.copy_(read.value);
  } catch (...) {
    applied = StatusFromCurrentException();
  }
  return AgreeAfterLoad(model, applied, "the model's parameters");
}

absl::Status SaveHuggingFaceCheckpoint(const std::string& dir, FullyShardedModel& model,
                                       const HuggingFaceSaveOptions& options) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("SaveHuggingFaceCheckpoint"));
  const StateDict named = NamedTensors(model.units().front()->module());
  const ShardPlacements placements = ShardPlacementsOf(model);
  std::vector<const ModelTensor*> written_by_index(named.size(), nullptr);
  const std::vector<ModelTensor> tensors = ModelTensors(named);
  for (const ModelTensor& tensor : tensors) written_by_index[tensor.first_index] = &tensor;
  // The specs in the order the units are gathered, so that rank 0 streams.
  std::vector<hf::SafetensorsTensorSpec> specs;
  std::vector<at::ScalarType> dtypes(named.size());
  for (size_t k : FullStateDictVisitOrder(model)) {
    const ModelTensor* tensor = written_by_index[k];
    if (tensor == nullptr) continue;  // A tied tensor's second name.
    const at::ScalarType own =
        model.BufferFullPrecisionDtype(tensor->tensor).value_or(tensor->tensor.scalar_type());
    dtypes[k] = options.dtype && at::isFloatingType(own) ? *options.dtype : own;
    specs.push_back({named[k].first, dtypes[k], PlacementOf(placements, tensor->tensor).full_shape});
  }
  const bool writes = model.group().rank() == 0;
  std::optional<hf::SafetensorsCheckpointWriter> writer;
  absl::Status written;
  if (writes) {
    auto created = hf::SafetensorsCheckpointWriter::Create(dir, specs, options.max_file_bytes,
                                                           {{"format", "pt"}});
    if (created.ok()) writer.emplace(std::move(*created));
    written = created.status();
  }
  FullStateDictOptions rank0;
  rank0.rank0_only = true;
  absl::Status visited = VisitFullStateDict(model, rank0, [&](size_t k, const at::Tensor& value) {
    FSDP_RETURN_IF_ERROR(written);
    if (written_by_index[k] == nullptr) return absl::OkStatus();
    return writer->Write(named[k].first, value.to(dtypes[k]));
  });
  if (writes && written.ok()) written = visited;
  if (writes && written.ok() && !options.config_json.empty()) {
    written = WriteFileAtomically(dir + "/config.json", options.config_json.data(),
                                  options.config_json.size());
  }
  if (writes && written.ok()) written = writer->Commit();
  if (!writes) written = visited;
  return AgreeAcrossRanks(model, written);
}

}  // namespace fsdp
