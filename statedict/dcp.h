// PyTorch Distributed Checkpoint (DCP) directories without Python: reading
// what torch.distributed.checkpoint.save writes (FSDP2's get_state_dict at
// any world size, or a plain state dict), for loading into our models, and
// writing what its load reads (SaveDcpCheckpoint).
//
// A DCP directory holds `.metadata`, a pickle of DCP's metadata classes
// (every tensor's dtype, size and chunks, and where each chunk's bytes
// are), and data files (`__<rank>_<n>.distcp`) in which every chunk is a
// torch.save archive of one tensor at a byte range, and every non-tensor
// value a torch.save archive of that value.
//
// The metadata is read with statedict/restricted_unpickler.h against an
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
#ifndef FSDP_STATEDICT_DCP_H_
#define FSDP_STATEDICT_DCP_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ATen/core/ivalue.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "c10/core/ScalarType.h"
#include "statedict/torch_file.h"

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
// plain value SaveTorchObject writes (statedict/torch_file.h).
struct DcpItem {
  std::vector<DcpPathPart> path;
  c10::IValue value;
};
// Writes `items` as a Distributed Checkpoint in `dir` (created if absent),
// as dcp.save of the nested state dict from one rank writes it: each
// tensor whole as one chunk and every other value as a bytes entry, in one
// data file, stored under its path joined by "." with the paths in the
// metadata's planner_data, so that PyTorch's dcp.load reads it at any world
// size (each rank the part of each chunk it needs). Atomic: the data file
// has a new name and .metadata replaces the old one last; a checkpoint that
// was there stays whole until then, and its data files are removed after.
absl::Status SaveDcpCheckpoint(const std::string& dir, const std::vector<DcpItem>& items);
// Elements [offsets, offsets + sizes) of one tensor, read from only the
// chunks that overlap them (a sharded load's own part).
absl::StatusOr<at::Tensor> LoadDcpTensorRegion(const std::string& dir, const DcpTensorEntry& tensor,
                                               const std::vector<int64_t>& offsets,
                                               const std::vector<int64_t>& sizes);

}  // namespace fsdp

#endif  // FSDP_STATEDICT_DCP_H_
