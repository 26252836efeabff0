// Hugging Face's safetensors format: one file, and the checkpoint directory
// that transformers' save_pretrained writes (model.safetensors, or
// model-0000K-of-0000N.safetensors with model.safetensors.index.json).
//
// A file is an 8-byte little-endian header length N, N bytes of JSON
// ({"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
// .., optionally "__metadata__": {string: string}}), then the tensors' bytes,
// little-endian and row-major, the offsets relative to the first of them.
//
// Reading. Open() reads and checks the header only, with the rules of the
// reference implementation (the safetensors crate): header at most 100 MB,
// every dtype one the format defines, every byte count equal to its
// shape's, the tensors tiling the data exactly (no hole, no overlap,
// nothing past the end of the file). Beyond the crate, so that a hostile
// header costs bounded time and memory: JSON nested at most as deep as a
// header is (3), at most 64 dimensions, every shape's element count (zero
// dimensions counted as one) within int64. A tensor whose dtype this
// libtorch lacks (F8 and the unsigned types above U8 on 1.13) is listed
// with dtype Undefined and refused when read. A tensor's bytes are read on
// demand with positional reads, whole or a part (rows of dim 0, or a range
// of the flattened tensor), so that a rank reads only what its shards need.
// Little-endian hosts only, as the format's bytes are.
//
// Writing. The writer is given every tensor's name, dtype and shape first
// (the header precedes the data), then takes the tensors one at a time in
// that order, so an export holds at most one tensor beyond the caller's
// state. A file appears only when Commit() has written all of it (atomic
// rename). A checkpoint directory's Commit flushes every file to disk
// first (a failure there leaves the earlier export whole), then removes the
// earlier index, renames the files into place and writes the new index;
// files of the earlier export with the stem's names that the new one does
// not list are removed, so that readers never combine two exports. Only a
// failure among the renames leaves the directory without an index.
//
// Errors are Status values naming the file and the tensor; nothing here
// throws except libtorch's allocation.
#ifndef FSDP_HF_SAFETENSORS_H_
#define FSDP_HF_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fsdp::hf {

// One tensor as a header describes it; offsets are relative to the data.
struct SafetensorsEntry {
  std::string name;
  std::string dtype_name;  // The format's ("BF16").
  // Undefined when this libtorch has no such dtype (see the top).
  at::ScalarType dtype = at::ScalarType::Undefined;
  int64_t element_size = 0;  // Bytes.
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;

  int64_t numel() const;
};

// A parsed header: the entries in offset order, the metadata, and where
// the data starts in the file (8 + N).
struct SafetensorsLayout {
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;
};

// The header's JSON (N bytes, without the length prefix) of a file of
// `file_size` bytes, checked as described at the top. `source` names the
// file in errors. What the fuzz target drives.
absl::StatusOr<SafetensorsLayout> ParseSafetensorsHeader(absl::string_view json,
                                                         uint64_t file_size,
                                                         absl::string_view source);

// safetensors' name of a dtype ("BF16"), or an error for a dtype the format
// cannot hold.
absl::StatusOr<std::string> SafetensorsDTypeName(at::ScalarType dtype);

class SafetensorsFile {
 public:
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return layout_.entries; }
  const std::map<std::string, std::string>& metadata() const { return layout_.metadata; }
  // Null when the file has no tensor of that name.
  const SafetensorsEntry* Find(absl::string_view name) const;

  // The whole tensor, on the CPU.
  absl::StatusOr<at::Tensor> Read(absl::string_view name) const;
  // Rows [lo, hi) of dim 0, shape {hi - lo, shape[1:]...}.
  absl::StatusOr<at::Tensor> ReadRows(absl::string_view name, int64_t lo, int64_t hi) const;
  // Elements [lo, hi) of the flattened tensor, 1-D.
  absl::StatusOr<at::Tensor> ReadFlat(absl::string_view name, int64_t lo, int64_t hi) const;
  // The same elements written into `out` (1-D, hi - lo elements, any dtype
  // the entry's casts to, any device), without holding them twice: read
  // straight into `out` when it is a contiguous CPU tensor of the entry's
  // dtype, else through a buffer of at most kReadChunkBytes. On an error,
  // part of `out` may have been written.
  absl::Status ReadFlatInto(absl::string_view name, int64_t lo, int64_t hi,
                            const at::Tensor& out) const;
  static constexpr uint64_t kReadChunkBytes = 8 << 20;

 private:
  class Descriptor;
  SafetensorsFile(std::string path, std::shared_ptr<Descriptor> fd, SafetensorsLayout layout);
  absl::StatusOr<const SafetensorsEntry*> Require(absl::string_view name) const;
  absl::StatusOr<at::Tensor> ReadBytes(const SafetensorsEntry& entry, uint64_t byte_offset,
                                       std::vector<int64_t> shape) const;

  std::string path_;
  std::shared_ptr<Descriptor> fd_;
  SafetensorsLayout layout_;
  std::map<std::string, size_t, std::less<>> index_;
};

// A tensor to be written: the header's view of it.
struct SafetensorsTensorSpec {
  std::string name;
  at::ScalarType dtype = at::ScalarType::Float;
  std::vector<int64_t> shape;
};

class SafetensorsWriter {
 public:
  // Checks the specs (names unique and not "__metadata__", dtypes the format
  // holds) and opens the temporary file with the header written.
  static absl::StatusOr<SafetensorsWriter> Create(
      const std::string& path, std::vector<SafetensorsTensorSpec> specs,
      const std::map<std::string, std::string>& metadata = {});

  SafetensorsWriter(SafetensorsWriter&&) noexcept;
  SafetensorsWriter& operator=(SafetensorsWriter&&) noexcept;
  // Without Commit, the temporary file is removed and `path` is untouched.
  ~SafetensorsWriter();

  // The next tensor in the specs' order: its name, dtype and shape must be
  // the spec's. Any device and layout; the bytes are copied out contiguous.
  absl::Status Write(absl::string_view name, const at::Tensor& value);
  // Every tensor written: to disk, not yet renamed (see the top).
  absl::Status Flush();
  // Every tensor written: flush, rename over `path`.
  absl::Status Commit();

  // The name the next Write must carry, or null when all were written.
  const SafetensorsTensorSpec* next() const;
  // After a failed Write the file is incomplete: every later call fails.
  bool failed() const;

 private:
  struct State;
  explicit SafetensorsWriter(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Where transformers puts a checkpoint's tensors: file names for a stem
// ("model": model.safetensors; model-00001-of-00002.safetensors, ...) and
// the split: tensors in order, a new file when the next tensor would take
// the current one past `max_file_bytes` (a tensor larger than that gets a
// file of its own), as huggingface_hub's split_torch_state_dict_into_shards.
struct SafetensorsShardPlan {
  std::vector<std::string> file_names;
  // The specs of each file, in order.
  std::vector<std::vector<SafetensorsTensorSpec>> files;
};
SafetensorsShardPlan PlanSafetensorsShards(const std::vector<SafetensorsTensorSpec>& specs,
                                           int64_t max_file_bytes,
                                           const std::string& stem = "model");

// A checkpoint directory as transformers reads it: the index's files, or the
// one file "<stem>.safetensors".
class SafetensorsCheckpoint {
 public:
  static absl::StatusOr<SafetensorsCheckpoint> Open(const std::string& directory,
                                                    const std::string& stem = "model");

  // Every tensor's name, sorted.
  std::vector<std::string> names() const;
  const SafetensorsEntry* Find(absl::string_view name) const;
  // The file that holds `name`; null when none does.
  const SafetensorsFile* FileOf(absl::string_view name) const;

  absl::StatusOr<at::Tensor> Read(absl::string_view name) const;
  absl::StatusOr<at::Tensor> ReadRows(absl::string_view name, int64_t lo, int64_t hi) const;
  absl::StatusOr<at::Tensor> ReadFlat(absl::string_view name, int64_t lo, int64_t hi) const;
  absl::Status ReadFlatInto(absl::string_view name, int64_t lo, int64_t hi,
                            const at::Tensor& out) const;

 private:
  absl::StatusOr<const SafetensorsFile*> Require(absl::string_view name) const;

  std::string directory_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t, std::less<>> file_of_;
};

// Writes a checkpoint directory (created if missing) file by file in the
// plan's order; see the top of this header for when files appear.
class SafetensorsCheckpointWriter {
 public:
  static absl::StatusOr<SafetensorsCheckpointWriter> Create(
      const std::string& directory, const std::vector<SafetensorsTensorSpec>& specs,
      int64_t max_file_bytes, const std::map<std::string, std::string>& metadata = {},
      const std::string& stem = "model");

  absl::Status Write(absl::string_view name, const at::Tensor& value);
  // Renames every file into place, writes the index (when there are two or
  // more files), and removes the stem's files the new index does not list.
  absl::Status Commit();

 private:
  SafetensorsCheckpointWriter() = default;

  std::string directory_;
  std::string stem_;
  SafetensorsShardPlan plan_;
  std::vector<SafetensorsWriter> writers_;
  size_t current_ = 0;
  int64_t total_bytes_ = 0;
};

}  // namespace fsdp::hf

#endif  // FSDP_HF_SAFETENSORS_H_
