// PyTorch Distributed Checkpoint (DCP) directories without Python: reading
// what torch.distributed.checkpoint.save writes (FSDP2's get_state_dict at
// any world size, or a plain state dict), for loading into our models, and
// writing what its load reads (SaveDcpCheckpoint). This file is one
// process's view; statedict/dcp_sharded.h has every rank save and load its
// own shards with these pieces.
//
// A DCP directory holds `.metadata`, a pickle of DCP's metadata classes
// (every tensor's dtype, size and chunks, and where each chunk's bytes
// are), and data files (`__<rank>_<n>.distcp`) in which every chunk is a
// torch.save archive of one tensor at a byte range, and every non-tensor
// value a torch.save archive of that value.
//
// The metadata is read with formats/restricted_unpickler.h against an
// allow-list of the globals DCP writes (its metadata dataclasses, torch.Size,
// dtypes, layouts, memory formats, pathlib paths); a pickle that names any
// other global is refused, naming it, before anything is built from it, and
// nothing in it ever runs. Everything the metadata claims is checked before
// data is read: chunks lie inside their tensor and cover it exactly once,
// every chunk has a storage entry, data file names stay inside the
// directory, and each chunk read back has the size and dtype the metadata
// gives it.
//
// Loads are all-or-nothing: an error leaves nothing half-read for the
// caller. Thread-compatible.
#ifndef FSDP_FORMATS_DCP_H_
#define FSDP_FORMATS_DCP_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ATen/core/ivalue.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "c10/core/ScalarType.h"
#include "formats/torch_file.h"

namespace fsdp {

// Where a stored item's bytes are: a torch.save archive at
// [offset, offset + length) of `relative_path` in the checkpoint directory.
struct DcpStorageLocation {
  std::string relative_path;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// One stored piece of a tensor: elements [offsets, offsets + sizes).
struct DcpChunk {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  DcpStorageLocation location;
};

struct DcpTensorEntry {
  std::string fqn;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> size;
  std::vector<DcpChunk> chunks;
};

// A non-tensor value (an optimizer step count, a param group's learning
// rate), stored as a torch.save archive of that value.
struct DcpBytesEntry {
  std::string fqn;
  DcpStorageLocation location;
};

// One step of the path from a saved state dict's root to a value: a dict
// key or a list index.
struct DcpPathPart {
  bool is_index = false;
  std::string key;    // When !is_index.
  int64_t index = 0;  // When is_index.
};
struct DcpMetadata {
  std::vector<DcpTensorEntry> tensors;  // In the order of the file.
  std::vector<DcpBytesEntry> bytes;
  std::string version;  // DCP's metadata version ("1.0.0"); "" if absent.
  // dcp.save flattens nested state dicts ({"optim": {"state": {fqn: ...}}}
  // is stored as "optim.state.<fqn>.exp_avg"); this is each stored name's
  // path in the original, where FQNs keep their dots. Empty when the
  // checkpoint was not flattened.
  std::map<std::string, std::vector<DcpPathPart>> planner_data;
};

// Whether `path` is a DCP directory (a directory holding `.metadata`).
bool IsDcpDirectory(const std::string& path);

// Reads and checks `dir`/.metadata. Errors name the directory and, for a
// refused global, the global.
absl::StatusOr<DcpMetadata> ReadDcpMetadata(const std::string& dir);

// Every data file `metadata` (read from `dir`) names is a regular file
// holding the byte ranges it names; their contents are not read.
// kDataLoss naming the first file that is missing or too short.
absl::Status CheckDcpDataFiles(const std::string& dir, const DcpMetadata& metadata);

// The full tensors of `dir`, in the metadata's order, contiguous on CPU.
// Non-tensor entries are left out (see DcpMetadata::bytes). `prefix`, when
// not empty, keeps only the entries under it and strips it ("model." for a
// checkpoint of {"model": ..., "optim": ...}).
absl::StatusOr<StateDict> LoadDcpStateDict(const std::string& dir, const std::string& prefix = "");

// The value a bytes entry holds (a torch.save archive of a Python value),
// read with LoadTorchStateDict's checks.
absl::StatusOr<PyRef> ReadDcpBytes(const std::string& dir, const DcpBytesEntry& entry);
// One value to write: where it sits in the nested state dict ({"model":
// {fqn: tensor}} -> ("model", fqn)) and the value, a tensor on CPU or a
// plain value SaveTorchObject writes (formats/torch_file.h). A tensor is
// whole, or one chunk of a larger one: then `chunk_offsets` says where the
// chunk starts in it and `tensor_size` is its size.
struct DcpItem {
  std::vector<DcpPathPart> path;
  c10::IValue value;
  std::vector<int64_t> chunk_offsets;
  std::vector<int64_t> tensor_size;
};
// Writes `items` as a Distributed Checkpoint in `dir` (created if absent),
// as dcp.save of the nested state dict from one rank writes it: every
// value in one data file, stored under its path joined by "." with the
// paths in the metadata's planner_data, so that PyTorch's dcp.load reads it
// at any world size (each rank the chunks it needs). The chunks of a tensor
// must cover it exactly once. Atomic: the data file has a new name and
// .metadata replaces the old one last; a checkpoint that was there stays
// whole until then, and its data files are removed after.
absl::Status SaveDcpCheckpoint(const std::string& dir, const std::vector<DcpItem>& items);

// The building blocks of a save by many writers (statedict/dcp_sharded.h):
// each writes its items into a data file of its own, and one writer then
// commits the metadata of them all.
//
// What .metadata records of one written item.
struct DcpStoredEntry {
  std::vector<DcpPathPart> path;
  bool is_tensor = false;
  at::ScalarType dtype = at::kFloat;                // Tensors only, as the
  std::vector<int64_t> tensor_size;                 // whole tensor's size
  std::vector<int64_t> chunk_offsets, chunk_sizes;  // and this chunk's place.
  DcpStorageLocation location;
};
// The name a path is stored under: its parts joined by ".".
std::string DcpStoredName(const std::vector<DcpPathPart>& path);
// A data file name of writer `rank` for the save `save_id`: __<rank>_<id>.distcp.
std::string NewDcpDataFileName(int rank, uint64_t save_id);
// Writes `items` into `dir`/`file_name` (atomically; a name of
// NewDcpDataFileName's form) and says where each went.
absl::StatusOr<std::vector<DcpStoredEntry>> WriteDcpDataFile(const std::string& dir,
                                                             const std::string& file_name,
                                                             const std::vector<DcpItem>& items);
// Checks `entries` (every writer's) as ReadDcpMetadata checks what it
// reads, then replaces `dir`/.metadata with theirs (atomically) and removes
// the data files it does not name.
absl::Status CommitDcpMetadata(const std::string& dir, const std::vector<DcpStoredEntry>& entries);

// A box of a tensor: elements [offsets, offsets + sizes), which are the
// flattened tensor's elements [flat_begin, flat_begin + their number) in
// order.
struct DcpBox {
  std::vector<int64_t> offsets, sizes;
  int64_t flat_begin = 0;
};
// Boxes that make up elements [lo, hi) of a flattened tensor of `size`, in
// order, as few as boxes whose elements are consecutive can be (at most
// 2 * dims - 1): how a rank's part of a flat shard becomes DCP chunks, and
// how it is found in them.
std::vector<DcpBox> DcpBoxesOfFlatRange(const std::vector<int64_t>& size, int64_t lo, int64_t hi);

// Elements [lo, hi) of the flattened tensor, 1-D: a flat shard's part of
// it, read from only the chunks that hold some of it, each once. Adds
// the bytes read to `*bytes_read` when given.
absl::StatusOr<at::Tensor> ReadDcpFlatRange(const std::string& dir, const DcpTensorEntry& tensor,
                                            int64_t lo, int64_t hi, int64_t* bytes_read = nullptr);

}  // namespace fsdp

#endif  // FSDP_FORMATS_DCP_H_
