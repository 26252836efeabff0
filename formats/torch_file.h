// State dicts in the file format of Python's torch.save (a zip archive with
// a pickle, data.pkl, and one record per tensor storage), so that
// checkpoints move between this project and PyTorch both ways:
//
//   C++ SaveTorchStateDict  ->  Python torch.load(path) -> dict of tensors
//   Python torch.save(model.state_dict(), path)  ->  C++ LoadTorchStateDict
//
// Writing uses libtorch's own pickler and archive writer, streaming into an
// atomically committed file (formats/atomic_file.h). Reading cannot use
// libtorch 1.13's unpickler, which rejects what Python's pickler writes for
// a state dict (an OrderedDict with a _metadata attribute, SETITEMS); it
// reads with formats/restricted_unpickler.h, which never executes
// anything: a pickle that calls any global but the few tensor and container
// constructors torch.save uses is an error naming it.
#ifndef FSDP_FORMATS_TORCH_FILE_H_
#define FSDP_FORMATS_TORCH_FILE_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ATen/core/Tensor.h"
#include "ATen/core/ivalue.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "c10/core/ScalarType.h"
#include "formats/restricted_unpickler.h"
#include "formats/state_dict_type.h"

namespace fsdp {

// Writes `state` as a dict {name: tensor}, readable by torch.load. Tensors
// must be on CPU (the caller offloads) and of a dtype the format names with
// a legacy Storage class: float8 and uint16/32/64 are refused by name.
absl::Status SaveTorchStateDict(const std::string& path, const StateDict& state);

// Writes any value made of dicts (string or int keys), lists, tuples,
// strings, ints, floats, bools, None and tensors (as SaveTorchStateDict's)
// as torch.save would write the same Python value: what torch.load reads,
// with weights_only too. Other values (objects, typed containers of other
// kinds) are an error naming where they are.
absl::Status SaveTorchObject(const std::string& path, const c10::IValue& object);
// The bytes SaveTorchObject would write, handed to `write` piece by piece
// (Distributed Checkpoint stores one such archive per value inside its data
// files): a tensor's elements come straight from its memory, uncopied; the
// first error `write` returns is returned.
absl::Status WriteTorchSave(const c10::IValue& object,
                            const std::function<absl::Status(const void*, size_t)>& write);

// Reads the dict of tensors at `path` (written by torch.save or by
// SaveTorchStateDict). `entry` selects a nested dict of tensors inside the
// top-level dict (e.g. "model" for nanoGPT's ckpt.pt); "" means the top
// level itself. Tensors come back contiguous, on CPU, not requiring grad.
// Fails, naming the file, on anything else: not a zip archive, a truncated
// or corrupt archive, a pickle feature or global outside the subset, a
// missing storage record or one whose size is not what the pickle says
// (checked before allocating), a non-tensor value in the selected dict.
// Every record is checked against the CRC-32 the zip records for it, except
// in files written with CRC-32s turned off
// (torch.serialization.set_crc32_options(False): every CRC is 0), which
// load unchecked.
absl::StatusOr<StateDict> LoadTorchStateDict(const std::string& path,
                                             const std::string& entry = "");

// For readers of formats built on torch.save (Distributed Checkpoint
// stores one archive per tensor chunk inside its .distcp files):

// Reads the torch.save archive at bytes [offset, offset + length) of `path`
// (to the end of the file without a length) with LoadTorchStateDict's
// checks, and returns the pickled object with its tensors.
absl::StatusOr<PyRef> ReadTorchSaveObject(const std::string& path, uint64_t offset = 0,
                                          std::optional<uint64_t> length = std::nullopt);

// The dtype a Python name stands for ("torch.float32", "torch.bfloat16",
// "torch.float8_e4m3fn"), or an error naming it.
absl::StatusOr<at::ScalarType> ScalarTypeFromPython(const std::string& name);

}  // namespace fsdp

#endif  // FSDP_FORMATS_TORCH_FILE_H_
