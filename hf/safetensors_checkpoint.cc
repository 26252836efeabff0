// Checkpoint directories of safetensors files (transformers'
// save_pretrained layout: shards and their index): the half of
// safetensors.h that reads and writes directories rather than one file.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "formats/atomic_file.h"
#include "hf/safetensors.h"
#include "hf/safetensors_internal.h"

namespace fsdp::hf {
namespace {

using json = nlohmann::json;
using safetensors_internal::Errno;
using safetensors_internal::kMaxHeaderBytes;
using safetensors_internal::kMaxJsonDepth;
using safetensors_internal::NestedAtMost;
using safetensors_internal::ReadAt;
using safetensors_internal::Shown;

std::string IndexName(const std::string& stem) { return stem + ".safetensors.index.json"; }

std::string ShardName(const std::string& stem, size_t k, size_t n) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "-%05zu-of-%05zu.safetensors", k, n);
  return stem + buffer;
}

int64_t BytesOf(const SafetensorsTensorSpec& spec) {
  int64_t bytes = static_cast<int64_t>(c10::elementSize(spec.dtype));
  for (int64_t d : spec.shape) bytes *= d;
  return bytes;
}

// A weight_map file name must be a file of the directory, not a path.
bool PlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

// An index: small, and bounded as a header is.
absl::StatusOr<std::string> ReadIndexText(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", Errno(errno)));
  struct stat st {};
  std::string bytes;
  absl::Status status;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    status = absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  } else if (static_cast<uint64_t>(st.st_size) > kMaxHeaderBytes) {
    status = absl::InvalidArgumentError(
        absl::StrCat(path, " is over ", kMaxHeaderBytes, " bytes: not an index"));
  } else {
    bytes.resize(static_cast<size_t>(st.st_size));
    status = ReadAt(fd, bytes.data(), bytes.size(), 0, path);
  }
  ::close(fd);
  if (!status.ok()) return status;
  return bytes;
}

// The index's weight_map: tensor name -> file name.
absl::StatusOr<std::map<std::string, std::string>> ReadIndex(const std::string& path) {
  FSDP_ASSIGN_OR_RETURN(std::string text, ReadIndexText(path));
  // An index nests as deep as {"metadata": {..}, "weight_map": {..}}, and
  // newer writers' metadata one level more.
  const json index = NestedAtMost(text, kMaxJsonDepth)
                         ? json::parse(text, nullptr, /*allow_exceptions=*/false)
                         : json(json::value_t::discarded);
  if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
      !index["weight_map"].is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a safetensors index (a JSON object with a weight_map)"));
  }
  std::map<std::string, std::string> weight_map;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string() || !PlainFileName(file.get<std::string>())) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", name.substr(0, 200),
                                                     "' maps to ", Shown(file),
                                                     ", not a file name"));
    }
    weight_map[name] = file.get<std::string>();
  }
  return weight_map;
}

}  // namespace

SafetensorsShardPlan PlanSafetensorsShards(const std::vector<SafetensorsTensorSpec>& specs,
                                           int64_t max_file_bytes, const std::string& stem) {
  SafetensorsShardPlan plan;
  int64_t current = 0;
  for (const SafetensorsTensorSpec& spec : specs) {
    const int64_t bytes = BytesOf(spec);
    if (plan.files.empty() || (current > 0 && current + bytes > max_file_bytes)) {
      plan.files.emplace_back();
      current = 0;
    }
    plan.files.back().push_back(spec);
    current += bytes;
  }
  if (plan.files.empty()) plan.files.emplace_back();
  const size_t n = plan.files.size();
  for (size_t k = 1; k <= n; ++k) {
    plan.file_names.push_back(n == 1 ? stem + ".safetensors" : ShardName(stem, k, n));
  }
  return plan;
}

absl::StatusOr<SafetensorsCheckpoint> SafetensorsCheckpoint::Open(const std::string& directory,
                                                                  const std::string& stem) {
  namespace fs = std::filesystem;
  const std::string index_path = (fs::path(directory) / IndexName(stem)).string();
  const std::string single_path = (fs::path(directory) / (stem + ".safetensors")).string();
  SafetensorsCheckpoint checkpoint;
  checkpoint.directory_ = directory;
  std::error_code error;
  if (!fs::exists(index_path, error)) {
    if (!fs::exists(single_path, error)) {
      return absl::NotFoundError(absl::StrCat(directory, " holds neither ", IndexName(stem),
                                              " nor ", stem, ".safetensors"));
    }
    FSDP_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(single_path));
    for (const SafetensorsEntry& e : file.entries()) checkpoint.file_of_.emplace(e.name, 0);
    checkpoint.files_.push_back(std::move(file));
    return checkpoint;
  }
  FSDP_ASSIGN_OR_RETURN(auto weight_map, ReadIndex(index_path));
  std::map<std::string, size_t> opened;
  for (const auto& [name, file_name] : weight_map) {
    auto [it, inserted] = opened.emplace(file_name, checkpoint.files_.size());
    if (inserted) {
      FSDP_ASSIGN_OR_RETURN(SafetensorsFile file,
                            SafetensorsFile::Open((fs::path(directory) / file_name).string()));
      checkpoint.files_.push_back(std::move(file));
    }
    if (checkpoint.files_[it->second].Find(name) == nullptr) {
      return absl::DataLossError(absl::StrCat(index_path, " puts tensor '", name, "' in ",
                                              file_name, ", which has no such tensor"));
    }
    checkpoint.file_of_.emplace(name, it->second);
  }
  return checkpoint;
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> names;
  names.reserve(file_of_.size());
  for (const auto& [name, file] : file_of_) names.push_back(name);
  return names;
}

const SafetensorsFile* SafetensorsCheckpoint::FileOf(absl::string_view name) const {
  auto it = file_of_.find(name);
  return it == file_of_.end() ? nullptr : &files_[it->second];
}

const SafetensorsEntry* SafetensorsCheckpoint::Find(absl::string_view name) const {
  const SafetensorsFile* file = FileOf(name);
  return file == nullptr ? nullptr : file->Find(name);
}

absl::StatusOr<const SafetensorsFile*> SafetensorsCheckpoint::Require(
    absl::string_view name) const {
  const SafetensorsFile* file = FileOf(name);
  if (file == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("the checkpoint in ", directory_, " has no tensor '", name, "'"));
  }
  return file;
}

absl::StatusOr<at::Tensor> SafetensorsCheckpoint::Read(absl::string_view name) const {
  FSDP_ASSIGN_OR_RETURN(const SafetensorsFile* file, Require(name));
  return file->Read(name);
}

absl::StatusOr<at::Tensor> SafetensorsCheckpoint::ReadRows(absl::string_view name, int64_t lo,
                                                           int64_t hi) const {
  FSDP_ASSIGN_OR_RETURN(const SafetensorsFile* file, Require(name));
  return file->ReadRows(name, lo, hi);
}

absl::StatusOr<at::Tensor> SafetensorsCheckpoint::ReadFlat(absl::string_view name, int64_t lo,
                                                           int64_t hi) const {
  FSDP_ASSIGN_OR_RETURN(const SafetensorsFile* file, Require(name));
  return file->ReadFlat(name, lo, hi);
}

absl::Status SafetensorsCheckpoint::ReadFlatInto(absl::string_view name, int64_t lo, int64_t hi,
                                                 const at::Tensor& out) const {
  FSDP_ASSIGN_OR_RETURN(const SafetensorsFile* file, Require(name));
  return file->ReadFlatInto(name, lo, hi, out);
}

absl::StatusOr<SafetensorsCheckpointWriter> SafetensorsCheckpointWriter::Create(
    const std::string& directory, const std::vector<SafetensorsTensorSpec>& specs,
    int64_t max_file_bytes, const std::map<std::string, std::string>& metadata,
    const std::string& stem) {
  namespace fs = std::filesystem;
  if (max_file_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_file_bytes must be positive, not ", max_file_bytes));
  }
  std::error_code error;
  fs::create_directories(directory, error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("cannot create directory ", directory, ": ", error.message()));
  }
  SafetensorsCheckpointWriter writer;
  writer.directory_ = directory;
  writer.stem_ = stem;
  writer.plan_ = PlanSafetensorsShards(specs, max_file_bytes, stem);
  for (const SafetensorsTensorSpec& spec : specs) writer.total_bytes_ += BytesOf(spec);
  for (size_t k = 0; k < writer.plan_.files.size(); ++k) {
    FSDP_ASSIGN_OR_RETURN(
        SafetensorsWriter file,
        SafetensorsWriter::Create((fs::path(directory) / writer.plan_.file_names[k]).string(),
                                  writer.plan_.files[k], metadata));
    writer.writers_.push_back(std::move(file));
  }
  return writer;
}

absl::Status SafetensorsCheckpointWriter::Write(absl::string_view name, const at::Tensor& value) {
  while (current_ < writers_.size() && writers_[current_].next() == nullptr) {
    // A whole file goes to disk now, and its writer's buffer to the next.
    FSDP_RETURN_IF_ERROR(writers_[current_].Flush());
    ++current_;
  }
  if (current_ == writers_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        directory_, ": tensor '", name, "' written after every declared tensor was"));
  }
  return writers_[current_].Write(name, value);
}

namespace {

// The names an export under `stem` writes: <stem>.safetensors, its index,
// and <stem>-NNNNN-of-NNNNN.safetensors.
bool ExportFileName(const std::string& name, const std::string& stem) {
  if (name == stem + ".safetensors" || name == IndexName(stem)) return true;
  const std::string suffix = ".safetensors";
  const size_t digits = stem.size() + 1;  // After "<stem>-".
  if (name.size() != digits + 5 + 4 + 5 + suffix.size() || name.rfind(stem + "-", 0) != 0 ||
      name.compare(digits + 5, 4, "-of-") != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  for (size_t i : {digits, digits + 9}) {
    for (size_t j = i; j < i + 5; ++j) {
      if (name[j] < '0' || name[j] > '9') return false;
    }
  }
  return true;
}

}  // namespace

absl::Status SafetensorsCheckpointWriter::Commit() {
  namespace fs = std::filesystem;
  // Everything on disk before anything of the earlier export goes.
  for (SafetensorsWriter& writer : writers_) FSDP_RETURN_IF_ERROR(writer.Flush());
  // The old index goes next: new files may reuse old shard names, and an
  // old index over a half-renamed set would combine two exports.
  const std::string index_path = (fs::path(directory_) / IndexName(stem_)).string();
  std::error_code error;
  if (!fs::remove(index_path, error) && error) {
    return absl::UnavailableError(
        absl::StrCat("cannot remove the earlier ", index_path, ": ", error.message()));
  }
  for (SafetensorsWriter& writer : writers_) FSDP_RETURN_IF_ERROR(writer.Commit());
  std::set<std::string> keep(plan_.file_names.begin(), plan_.file_names.end());
  if (plan_.files.size() > 1) {
    std::map<std::string, std::string> weight_map;
    for (size_t k = 0; k < plan_.files.size(); ++k) {
      for (const SafetensorsTensorSpec& spec : plan_.files[k]) {
        weight_map[spec.name] = plan_.file_names[k];
      }
    }
    const json index = {{"metadata", {{"total_size", total_bytes_}}},
                        {"weight_map", weight_map}};
    const std::string text = index.dump(2) + "\n";
    FSDP_RETURN_IF_ERROR(WriteFileAtomically(index_path, text.data(), text.size()));
    keep.insert(IndexName(stem_));
  }
  // Files of an earlier export under the same stem would be read with ours;
  // the new set is complete, so they go.
  std::vector<std::string> stale;
  for (fs::directory_iterator it(directory_, error), end; !error && it != end;
       it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (ExportFileName(name, stem_) && keep.count(name) == 0) stale.push_back(name);
  }
  for (const std::string& name : stale) {
    if (!fs::remove(fs::path(directory_) / name, error) && error) break;
  }
  if (error) {
    return absl::UnavailableError(absl::StrCat(
        "the export to ", directory_, " is complete, but files of an earlier export could not be "
        "listed or removed: ", error.message()));
  }
  return absl::OkStatus();
}

}  // namespace fsdp::hf
