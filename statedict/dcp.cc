#include "statedict/dcp.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "statedict/atomic_file.h"
#include "statedict/restricted_unpickler.h"

namespace fsdp {
namespace {

constexpr char kMetadataModule[] = "torch.distributed.checkpoint.metadata.";

// The classes DCP pickles into .metadata (dataclasses: NEWOBJ, then BUILD
// with their fields).
bool IsMetadataClass(const std::string& global) {
  static const auto* kClasses = new std::set<std::string>{
      absl::StrCat(kMetadataModule, "Metadata"),
      absl::StrCat(kMetadataModule, "TensorStorageMetadata"),
      absl::StrCat(kMetadataModule, "BytesStorageMetadata"),
      absl::StrCat(kMetadataModule, "ChunkStorageMetadata"),
      absl::StrCat(kMetadataModule, "TensorProperties"),
      absl::StrCat(kMetadataModule, "MetadataIndex"),
      absl::StrCat(kMetadataModule, "StorageMeta"),
      "torch.distributed.checkpoint.filesystem._StorageInfo",
  };
  return kClasses->count(global) > 0;
}

// Globals DCP's metadata names as values or calls, besides its classes and
// dtypes: a tensor property's layout and memory format, torch.Size, the
// checkpoint's path.
bool IsMetadataHelper(const std::string& global) {
  static const auto* kHelpers = new std::set<std::string>{
      absl::StrCat(kMetadataModule, "_MEM_FORMAT_ENCODING"),
      "builtins.getattr",  // Only as getattr(_MEM_FORMAT_ENCODING, name).
      "torch.Size",
      "torch.serialization._get_layout",
      "torch.strided",
      "torch.sparse_coo",
      "torch.contiguous_format",
      "torch.channels_last",
      "torch.channels_last_3d",
      "torch.preserve_format",
      "pathlib.Path",
      "pathlib.PosixPath",
      "pathlib.WindowsPath",
      "pathlib._local.PosixPath",  // Python 3.13's name for it.
      "pathlib._local.WindowsPath",
      "collections.OrderedDict",
  };
  return kHelpers->count(global) > 0;
}

absl::Status AllowGlobal(const std::string& global) {
  if (IsMetadataClass(global) || IsMetadataHelper(global)) return absl::OkStatus();
  if (global.rfind("torch.", 0) == 0 && ScalarTypeFromPython(global).ok()) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("the metadata names ", global,
                   ", which DCP's metadata never holds; refusing it (nothing in the file ran)"));
}

bool AllStrings(const std::vector<PyRef>& values) {
  for (const PyRef& v : values) {
    if (v->kind != PyValue::Kind::kString) return false;
  }
  return true;
}

absl::StatusOr<PyRef> Call(const std::string& global, const std::vector<PyRef>& args, bool newobj) {
  const auto bad_arguments = [&global] {
    return absl::InvalidArgumentError(absl::StrCat("unexpected arguments to ", global));
  };
  if (IsMetadataClass(global)) {
    if (!newobj || !args.empty()) return bad_arguments();
    PyRef object = MakePy(PyValue::Kind::kObject);
    object->s = global;
    return object;
  }
  if (global == "torch.Size") {
    if (args.size() != 1 || args[0]->kind != PyValue::Kind::kTuple) return bad_arguments();
    return args[0];
  }
  if (global == "torch.serialization._get_layout") {  // ("torch.strided",) -> the layout
    if (args.size() != 1 || !AllStrings(args)) return bad_arguments();
    return args[0];
  }
  if (global == absl::StrCat(kMetadataModule, "_MEM_FORMAT_ENCODING")) {
    // An enum member by value, as Python 3.12 and later pickle them:
    // _MEM_FORMAT_ENCODING(0..2).
    if (args.size() != 1 || args[0]->kind != PyValue::Kind::kInt || args[0]->i < 0 ||
        args[0]->i > 2) {
      return bad_arguments();
    }
    return args[0];
  }
  if (global == "builtins.getattr") {  // getattr(_MEM_FORMAT_ENCODING, "TORCH_...")
    if (args.size() != 2 || args[0]->kind != PyValue::Kind::kGlobal ||
        args[0]->s != absl::StrCat(kMetadataModule, "_MEM_FORMAT_ENCODING") ||
        args[1]->kind != PyValue::Kind::kString) {
      return absl::InvalidArgumentError(
          "the metadata calls builtins.getattr on something other than DCP's memory formats");
    }
    return args[1];
  }
  if (global.rfind("pathlib.", 0) == 0) {  // The checkpoint's path, for information only.
    if (!AllStrings(args)) return bad_arguments();
    std::vector<std::string> parts;
    for (const PyRef& a : args) parts.push_back(a->s);
    return MakePyString(absl::StrJoin(parts, "/"));
  }
  if (global == "collections.OrderedDict") {
    if (!args.empty()) return bad_arguments();
    return MakePy(PyValue::Kind::kDict);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("the metadata calls ", global, ", which DCP's metadata never does"));
}

// The checks below report through this: "DCP checkpoint 'dir': ...".
class MetadataParser {
 public:
  explicit MetadataParser(std::string dir) : dir_(std::move(dir)) {}

  absl::Status Error(const std::string& what) const {
    // `what` quotes names read from the file, which may be damaged.
    return absl::InvalidArgumentError(
        absl::StrCat("DCP checkpoint '", dir_, "': ", PrintableText(what)));
  }

  absl::StatusOr<std::vector<int64_t>> Ints(const PyRef& v, const std::string& what) const {
    if (v == nullptr || (v->kind != PyValue::Kind::kTuple && v->kind != PyValue::Kind::kList)) {
      return Error(absl::StrCat(what, " is not a sequence of ints"));
    }
    std::vector<int64_t> out;
    for (const PyRef& item : v->items) {
      if (item->kind != PyValue::Kind::kInt) {
        return Error(absl::StrCat(what, " holds a ", KindName(item->kind)));
      }
      out.push_back(item->i);
    }
    return out;
  }

  absl::StatusOr<int64_t> NonNegative(const PyRef& v, const std::string& what) const {
    if (v == nullptr || v->kind != PyValue::Kind::kInt || v->i < 0) {
      return Error(absl::StrCat(what, " is not a non-negative int"));
    }
    return v->i;
  }

  static bool IsObject(const PyRef& v, const char* cls) {
    return v != nullptr && v->kind == PyValue::Kind::kObject && v->s == cls;
  }
  static bool IsMetadataObject(const PyRef& v, const char* name) {
    return v != nullptr && v->kind == PyValue::Kind::kObject &&
           v->s == absl::StrCat(kMetadataModule, name);
  }

  absl::StatusOr<DcpStorageLocation> Location(const PyRef& info, const std::string& fqn) const {
    if (!IsObject(info, "torch.distributed.checkpoint.filesystem._StorageInfo")) {
      return Error(absl::StrCat("the storage entry of '", fqn, "' is not a _StorageInfo"));
    }
    DcpStorageLocation location;
    PyRef path = info->Get("relative_path");
    if (path == nullptr || path->kind != PyValue::Kind::kString || path->s.empty() ||
        path->s.find('/') != std::string::npos || path->s.find('\0') != std::string::npos ||
        path->s == "." || path->s == "..") {
      return Error(absl::StrCat("the data file of '", fqn,
                                "' is not a file name inside the checkpoint directory"));
    }
    location.relative_path = path->s;
    FSDP_ASSIGN_OR_RETURN(int64_t offset,
                          NonNegative(info->Get("offset"), absl::StrCat("'", fqn, "''s offset")));
    FSDP_ASSIGN_OR_RETURN(int64_t length,
                          NonNegative(info->Get("length"), absl::StrCat("'", fqn, "''s length")));
    location.offset = static_cast<uint64_t>(offset);
    location.length = static_cast<uint64_t>(length);
    PyRef transforms = info->Get("transform_descriptors");
    if (transforms != nullptr && transforms->kind != PyValue::Kind::kNone &&
        !transforms->items.empty()) {
      std::vector<std::string> names;
      for (const PyRef& t : transforms->items) {
        names.push_back(t->kind == PyValue::Kind::kString ? t->s : KindName(t->kind));
      }
      return Error(absl::StrCat("'", fqn, "' is stored through transforms [",
                                absl::StrJoin(names, ", "),
                                "] (a DCP extension such as compression), which this reader "
                                "does not support"));
    }
    return location;
  }

  // storage_data: MetadataIndex(fqn, offset) -> _StorageInfo.
  absl::Status ReadStorage(const PyRef& storage_data) {
    if (storage_data == nullptr || storage_data->kind != PyValue::Kind::kDict) {
      return Error("the metadata has no storage_data dict");
    }
    for (const auto& [index, info] : storage_data->entries) {
      if (!IsMetadataObject(index, "MetadataIndex")) {
        return Error("a storage_data key is not a MetadataIndex");
      }
      PyRef fqn = index->Get("fqn");
      if (fqn == nullptr || fqn->kind != PyValue::Kind::kString) {
        return Error("a MetadataIndex has no fqn");
      }
      std::vector<int64_t> offsets;
      PyRef offset = index->Get("offset");
      if (offset != nullptr && offset->kind != PyValue::Kind::kNone) {
        FSDP_ASSIGN_OR_RETURN(offsets, Ints(offset, absl::StrCat("'", fqn->s, "''s index offset")));
      }
      FSDP_ASSIGN_OR_RETURN(DcpStorageLocation location, Location(info, fqn->s));
      if (!locations_.emplace(std::make_pair(fqn->s, offsets), location).second) {
        return Error(absl::StrCat("'", fqn->s, "' has two storage entries at offsets [",
                                  absl::StrJoin(offsets, ", "), "]"));
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<DcpStorageLocation> Find(const std::string& fqn,
                                          const std::vector<int64_t>& offsets) const {
    auto it = locations_.find({fqn, offsets});
    if (it == locations_.end()) {
      return Error(absl::StrCat("'", fqn, "' has no storage entry for its chunk at [",
                                absl::StrJoin(offsets, ", "), "]"));
    }
    return it->second;
  }

  absl::StatusOr<at::ScalarType> Dtype(const PyRef& properties, const std::string& fqn) const {
    if (!IsMetadataObject(properties, "TensorProperties") || properties->state == nullptr) {
      return Error(absl::StrCat("'", fqn, "' has no TensorProperties"));
    }
    // Its state is a tuple starting with the dtype (TensorProperties'
    // __getstate__), or a plain dataclass's field dict.
    PyRef dtype = properties->state->kind == PyValue::Kind::kTuple
                      ? (properties->state->items.empty() ? nullptr : properties->state->items[0])
                      : properties->Get("dtype");
    if (dtype == nullptr || dtype->kind != PyValue::Kind::kGlobal) {
      return Error(absl::StrCat("'", fqn, "' has no dtype"));
    }
    absl::StatusOr<at::ScalarType> type = ScalarTypeFromPython(dtype->s);
    if (!type.ok()) return Error(absl::StrCat("'", fqn, "': ", type.status().message()));
    return *type;
  }

  // Chunks inside the tensor, covering it exactly once.
  absl::Status CheckChunks(const DcpTensorEntry& t) const {
    int64_t numel = 1;
    for (int64_t s : t.size) {
      if (s < 0 || __builtin_mul_overflow(numel, s, &numel)) {
        return Error(absl::StrCat("'", t.fqn, "' has size [", absl::StrJoin(t.size, ", "), "]"));
      }
    }
    int64_t covered = 0;
    for (const DcpChunk& c : t.chunks) {
      if (c.offsets.size() != t.size.size() || c.sizes.size() != t.size.size()) {
        return Error(absl::StrCat("a chunk of '", t.fqn, "' has ", c.sizes.size(),
                                  " dimensions, the tensor ", t.size.size()));
      }
      int64_t chunk_numel = 1;
      for (size_t d = 0; d < t.size.size(); ++d) {
        if (c.offsets[d] < 0 || c.sizes[d] < 0 || c.offsets[d] > t.size[d] ||
            c.sizes[d] > t.size[d] - c.offsets[d]) {
          return Error(absl::StrCat("a chunk of '", t.fqn, "' at [", absl::StrJoin(c.offsets, ", "),
                                    "] of size [", absl::StrJoin(c.sizes, ", "),
                                    "] lies outside its size [", absl::StrJoin(t.size, ", "), "]"));
        }
        chunk_numel *= c.sizes[d];  // Bounded by numel, which did not overflow.
      }
      // Its archive stores the chunk's elements uncompressed: a chunk larger
      // than its bytes is a lie, refused before anything is allocated for it.
      if (static_cast<uint64_t>(chunk_numel) >
          c.location.length / static_cast<uint64_t>(c10::elementSize(t.dtype))) {
        return Error(absl::StrCat("a chunk of '", t.fqn, "' at [", absl::StrJoin(c.offsets, ", "),
                                  "] claims ", chunk_numel, " elements from ", c.location.length,
                                  " bytes"));
      }
      if (__builtin_add_overflow(covered, chunk_numel, &covered)) {
        return Error(absl::StrCat("the chunks of '", t.fqn, "' hold more than its elements"));
      }
    }
    // Disjointness, by a sweep along dim 0: only chunks whose rows meet
    // are compared (FSDP2's Shard(0) chunks never do), so a checkpoint of
    // many ranks is not checked in quadratic time.
    std::vector<size_t> order(t.chunks.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    const auto begin = [&](size_t i) { return t.size.empty() ? 0 : t.chunks[i].offsets[0]; };
    const auto end = [&](size_t i) {
      return t.size.empty() ? 1 : t.chunks[i].offsets[0] + t.chunks[i].sizes[0];
    };
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return begin(a) < begin(b); });
    for (size_t x = 0; x < order.size(); ++x) {
      const DcpChunk& a = t.chunks[order[x]];
      for (size_t y = x + 1; y < order.size() && begin(order[y]) < end(order[x]); ++y) {
        const DcpChunk& b = t.chunks[order[y]];
        bool overlap = true;
        for (size_t d = 0; d < t.size.size(); ++d) {
          const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
          const int64_t hi = std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d]);
          overlap = overlap && hi > lo;
        }
        if (overlap) {
          return Error(absl::StrCat("two chunks of '", t.fqn, "' overlap (at [",
                                    absl::StrJoin(a.offsets, ", "), "] and [",
                                    absl::StrJoin(b.offsets, ", "), "])"));
        }
      }
    }
    if (covered != numel) {
      return Error(absl::StrCat("the chunks of '", t.fqn, "' hold ", covered, " of its ", numel,
                                " elements"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<DcpMetadata> Parse(const PyRef& root) {
    if (!IsMetadataObject(root, "Metadata")) {
      return Error(absl::StrCat(".metadata holds a ", KindName(root->kind),
                                root->kind == PyValue::Kind::kObject ? " " + root->s : "",
                                ", not DCP's Metadata"));
    }
    FSDP_RETURN_IF_ERROR(ReadStorage(root->Get("storage_data")));
    DcpMetadata metadata;
    PyRef version = root->Get("version");
    if (version != nullptr && version->kind == PyValue::Kind::kString)
      metadata.version = version->s;
    FSDP_RETURN_IF_ERROR(ReadPlannerData(root->Get("planner_data"), metadata));
    PyRef entries = root->Get("state_dict_metadata");
    if (entries == nullptr || entries->kind != PyValue::Kind::kDict) {
      return Error("the metadata has no state_dict_metadata dict");
    }
    for (const auto& [key, entry] : entries->entries) {
      if (key->kind != PyValue::Kind::kString) return Error("a state dict key is not a string");
      const std::string& fqn = key->s;
      if (IsMetadataObject(entry, "BytesStorageMetadata")) {
        FSDP_ASSIGN_OR_RETURN(DcpStorageLocation location, Find(fqn, {}));
        metadata.bytes.push_back({fqn, location});
        continue;
      }
      if (!IsMetadataObject(entry, "TensorStorageMetadata")) {
        return Error(absl::StrCat("'", fqn, "' is neither a tensor nor a bytes entry"));
      }
      DcpTensorEntry tensor;
      tensor.fqn = fqn;
      FSDP_ASSIGN_OR_RETURN(tensor.dtype, Dtype(entry->Get("properties"), fqn));
      FSDP_ASSIGN_OR_RETURN(tensor.size,
                            Ints(entry->Get("size"), absl::StrCat("'", fqn, "''s size")));
      PyRef chunks = entry->Get("chunks");
      if (chunks == nullptr || chunks->kind != PyValue::Kind::kList) {
        return Error(absl::StrCat("'", fqn, "' has no chunk list"));
      }
      for (const PyRef& c : chunks->items) {
        if (!IsMetadataObject(c, "ChunkStorageMetadata")) {
          return Error(absl::StrCat("a chunk of '", fqn, "' is not a ChunkStorageMetadata"));
        }
        DcpChunk chunk;
        FSDP_ASSIGN_OR_RETURN(chunk.offsets,
                              Ints(c->Get("offsets"), absl::StrCat("'", fqn, "''s chunk offsets")));
        FSDP_ASSIGN_OR_RETURN(chunk.sizes,
                              Ints(c->Get("sizes"), absl::StrCat("'", fqn, "''s chunk sizes")));
        FSDP_ASSIGN_OR_RETURN(chunk.location, Find(fqn, chunk.offsets));
        tensor.chunks.push_back(std::move(chunk));
      }
      FSDP_RETURN_IF_ERROR(CheckChunks(tensor));
      metadata.tensors.push_back(std::move(tensor));
    }
    return metadata;
  }

  // planner_data: {stored name: (key or index, ...)}, or None.
  absl::Status ReadPlannerData(const PyRef& planner_data, DcpMetadata& metadata) {
    if (planner_data == nullptr || planner_data->kind == PyValue::Kind::kNone) {
      return absl::OkStatus();
    }
    if (planner_data->kind != PyValue::Kind::kDict) {
      return Error(
          absl::StrCat("planner_data is a ", KindName(planner_data->kind), ", not a dict"));
    }
    for (const auto& [key, path] : planner_data->entries) {
      if (key->kind != PyValue::Kind::kString ||
          (path->kind != PyValue::Kind::kTuple && path->kind != PyValue::Kind::kList)) {
        return Error("a planner_data entry is not a name and a path");
      }
      std::vector<DcpPathPart> parts;
      for (const PyRef& part : path->items) {
        if (part->kind == PyValue::Kind::kString) {
          parts.push_back({false, part->s, 0});
        } else if (part->kind == PyValue::Kind::kInt) {
          parts.push_back({true, "", part->i});
        } else {
          return Error(absl::StrCat("the path of '", key->s, "' in planner_data holds a ",
                                    KindName(part->kind)));
        }
      }
      if (!metadata.planner_data.emplace(key->s, std::move(parts)).second) {
        return Error(absl::StrCat("planner_data names '", key->s, "' twice"));
      }
    }
    return absl::OkStatus();
  }

 private:
  const std::string dir_;
  std::map<std::pair<std::string, std::vector<int64_t>>, DcpStorageLocation> locations_;
};

// One chunk's tensor, checked against what the metadata says of it.
absl::StatusOr<at::Tensor> ReadChunk(const std::string& dir, const DcpTensorEntry& tensor,
                                     const DcpChunk& chunk) {
  const std::string path = absl::StrCat(dir, "/", chunk.location.relative_path);
  FSDP_ASSIGN_OR_RETURN(PyRef value,
                        ReadTorchSaveObject(path, chunk.location.offset, chunk.location.length));
  const auto error = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DCP checkpoint '", dir, "': the chunk of '", tensor.fqn, "' at [",
        absl::StrJoin(chunk.offsets, ", "), "] in ", chunk.location.relative_path, " ", what));
  };
  if (value->kind != PyValue::Kind::kTensor) {
    return error(absl::StrCat("holds a ", KindName(value->kind), ", not a tensor"));
  }
  const at::Tensor& t = value->tensor;
  if (t.sizes().vec() != chunk.sizes) {
    return error(absl::StrCat("has size [", absl::StrJoin(t.sizes(), ", "),
                              "], the metadata says [", absl::StrJoin(chunk.sizes, ", "), "]"));
  }
  if (t.scalar_type() != tensor.dtype) {
    return error(absl::StrCat("is ", c10::toString(t.scalar_type()), ", the metadata says ",
                              c10::toString(tensor.dtype)));
  }
  return t;
}

}  // namespace

bool IsDcpDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode) &&
         stat((path + "/.metadata").c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

absl::Status CheckDcpDataFiles(const std::string& dir, const DcpMetadata& metadata) {
  std::map<std::string, uint64_t> ends;  // Each data file's last byte needed.
  const auto need = [&](const DcpStorageLocation& at) {
    uint64_t& end = ends[at.relative_path];
    end = std::max(end, at.offset + at.length);
  };
  for (const DcpTensorEntry& tensor : metadata.tensors) {
    for (const DcpChunk& chunk : tensor.chunks) need(chunk.location);
  }
  for (const DcpBytesEntry& bytes : metadata.bytes) need(bytes.location);
  for (const auto& [file, end] : ends) {
    const std::string path = absl::StrCat(dir, "/", file);
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
      return absl::DataLossError(absl::StrCat("the data file '", path,
                                              "' that .metadata names cannot be found: ",
                                              std::strerror(errno)));
    }
    if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) < end) {
      return absl::DataLossError(absl::StrCat(
          "the data file '", path, "' has ", static_cast<int64_t>(st.st_size),
          " bytes; .metadata names bytes up to ", end,
          S_ISREG(st.st_mode) ? " (truncated or replaced)" : " (not a regular file)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DcpMetadata> ReadDcpMetadata(const std::string& dir) {
  const std::string path = dir + "/.metadata";
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("'", dir, "' is not a DCP checkpoint: no .metadata"));
  }
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  UnpicklerHooks hooks;
  hooks.allow_global = AllowGlobal;
  hooks.call = Call;
  FSDP_ASSIGN_OR_RETURN(PyRef root,
                        Unpickle(bytes.data(), bytes.size(),
                                 absl::StrCat("DCP checkpoint '", dir, "': .metadata"), hooks));
  return MetadataParser(dir).Parse(root);
}

// --- Writing -------------------------------------------------------------------

namespace {

// The pickle opcodes (protocol 2) that .metadata needs, as Python's pickler
// writes DCP's dataclasses: NEWOBJ of the class, then BUILD with its state.
class PickleWriter {
 public:
  PickleWriter() { out_ += "\x80\x02"; }
  void Global(const std::string& module, const std::string& name) {
    out_ += 'c';
    out_ += module + "\n" + name + "\n";
  }
  void Str(const std::string& s) {
    out_ += 'X';
    Le(s.size(), 4);
    out_ += s;
  }
  void Int(int64_t v) {
    if (v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max()) {
      out_ += 'J';
      Le(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
    } else {
      out_ += "\x8a\x08";  // LONG1 of 8 bytes, two's complement.
      Le(static_cast<uint64_t>(v), 8);
    }
  }
  void Bool(bool b) { out_ += b ? '\x88' : '\x89'; }
  void None() { out_ += 'N'; }
  void Mark() { out_ += '('; }
  void Tuple() { out_ += 't'; }  // Of the values since the mark.
  void Tuple1() { out_ += '\x85'; }
  void EmptyTuple() { out_ += ')'; }
  void EmptyDict() { out_ += '}'; }
  void SetItems() { out_ += 'u'; }
  void EmptyList() { out_ += ']'; }
  void Appends() { out_ += 'e'; }
  void Append() { out_ += 'a'; }
  void NewObj() { out_ += '\x81'; }
  void Build() { out_ += 'b'; }
  void Reduce() { out_ += 'R'; }
  std::string Finish() {
    out_ += '.';
    return std::move(out_);
  }

  // An instance of a DCP dataclass with no constructor arguments; BUILD
  // follows once its state is pushed.
  void Object(const std::string& module, const std::string& name) {
    Global(module, name);
    EmptyTuple();
    NewObj();
  }
  void Size(const std::vector<int64_t>& dims) {
    Global("torch", "Size");  // torch.Size((d0, d1, ...)), as Python reduces it.
    Mark();
    for (int64_t d : dims) Int(d);
    Tuple();
    Tuple1();
    Reduce();
  }

 private:
  void Le(uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  std::string out_;
};

constexpr char kMetadataPackage[] = "torch.distributed.checkpoint.metadata";

absl::StatusOr<std::string> PythonDtypeName(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return std::string("float32");
    case at::kDouble:
      return std::string("float64");
    case at::kHalf:
      return std::string("float16");
    case at::kBFloat16:
      return std::string("bfloat16");
    case at::kLong:
      return std::string("int64");
    case at::kInt:
      return std::string("int32");
    case at::kShort:
      return std::string("int16");
    case at::kChar:
      return std::string("int8");
    case at::kByte:
      return std::string("uint8");
    case at::kBool:
      return std::string("bool");
    case at::kComplexFloat:
      return std::string("complex64");
    case at::kComplexDouble:
      return std::string("complex128");
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "dtype ", c10::toString(type), " is not written to Distributed Checkpoints here"));
  }
}

// One tensor's or value's metadata: its stored pieces in order.
struct StoredGroup {
  std::string name;
  std::vector<const DcpStoredEntry*> pieces;
};

void TensorProperties(PickleWriter& p, const std::string& dtype) {
  p.Object(kMetadataPackage, "TensorProperties");
  p.Mark();  // (dtype, layout, requires_grad, memory format, pin_memory)
  p.Global("torch", dtype);
  p.Global("torch.serialization", "_get_layout");
  p.Str("torch.strided");
  p.Tuple1();
  p.Reduce();
  p.Bool(false);
  p.Global(kMetadataPackage, "_MEM_FORMAT_ENCODING");
  p.Int(0);  // TORCH_CONTIGUOUS_FORMAT.
  p.Tuple1();
  p.Reduce();
  p.Bool(false);
  p.Tuple();
  p.Build();
}

absl::StatusOr<std::string> MetadataPickle(const std::vector<StoredGroup>& groups) {
  PickleWriter p;
  p.Object(kMetadataPackage, "Metadata");
  p.EmptyDict();
  p.Mark();
  p.Str("state_dict_metadata");
  p.EmptyDict();
  p.Mark();
  for (const StoredGroup& group : groups) {
    p.Str(group.name);
    const DcpStoredEntry& first = *group.pieces.front();
    if (!first.is_tensor) {
      p.Object(kMetadataPackage, "BytesStorageMetadata");
      continue;
    }
    FSDP_ASSIGN_OR_RETURN(const std::string dtype, PythonDtypeName(first.dtype));
    p.Object(kMetadataPackage, "TensorStorageMetadata");
    p.EmptyDict();
    p.Mark();
    p.Str("properties");
    TensorProperties(p, dtype);
    p.Str("size");
    p.Size(first.tensor_size);
    p.Str("chunks");
    p.EmptyList();
    p.Mark();
    for (const DcpStoredEntry* piece : group.pieces) {
      p.Object(kMetadataPackage, "ChunkStorageMetadata");
      p.EmptyDict();
      p.Mark();
      p.Str("offsets");
      p.Size(piece->chunk_offsets);
      p.Str("sizes");
      p.Size(piece->chunk_sizes);
      p.SetItems();
      p.Build();
    }
    p.Appends();
    p.SetItems();
    p.Build();
  }
  p.SetItems();
  p.Str("planner_data");
  p.EmptyDict();
  p.Mark();
  for (const StoredGroup& group : groups) {
    p.Str(group.name);
    p.Mark();
    for (const DcpPathPart& part : group.pieces.front()->path) {
      if (part.is_index) {
        p.Int(part.index);
      } else {
        p.Str(part.key);
      }
    }
    p.Tuple();
  }
  p.SetItems();
  p.Str("storage_data");
  p.EmptyDict();
  p.Mark();
  for (const StoredGroup& group : groups) {
    for (size_t i = 0; i < group.pieces.size(); ++i) {
      const DcpStoredEntry& piece = *group.pieces[i];
      p.Object(kMetadataPackage, "MetadataIndex");
      p.EmptyDict();
      p.Mark();
      p.Str("fqn");
      p.Str(group.name);
      p.Str("offset");
      if (piece.is_tensor) {
        p.Size(piece.chunk_offsets);
      } else {
        p.None();
      }
      p.Str("index");
      if (piece.is_tensor) {
        p.Int(static_cast<int64_t>(i));  // A hint only: an index is found by fqn and offset.
      } else {
        p.None();
      }
      p.SetItems();
      p.Build();
      p.Object("torch.distributed.checkpoint.filesystem", "_StorageInfo");
      p.EmptyDict();
      p.Mark();
      p.Str("relative_path");
      p.Str(piece.location.relative_path);
      p.Str("offset");
      p.Int(static_cast<int64_t>(piece.location.offset));
      p.Str("length");
      p.Int(static_cast<int64_t>(piece.location.length));
      p.Str("transform_descriptors");
      p.None();
      p.SetItems();
      p.Build();
    }
  }
  p.SetItems();
  p.Str("storage_meta");
  p.None();
  p.Str("version");
  p.Str("1.0.0");
  p.SetItems();
  p.Build();
  return p.Finish();
}

bool IsDataFileName(const std::string& name) {
  return name.size() > 9 && name.rfind("__", 0) == 0 &&
         name.compare(name.size() - 7, 7, ".distcp") == 0 && name.find('/') == std::string::npos;
}

}  // namespace

std::string DcpStoredName(const std::vector<DcpPathPart>& path) {
  std::vector<std::string> parts;
  for (const DcpPathPart& part : path) {
    parts.push_back(part.is_index ? absl::StrCat(part.index) : part.key);
  }
  return absl::StrJoin(parts, ".");
}

absl::StatusOr<std::vector<DcpStoredEntry>> WriteDcpDataFile(const std::string& dir,
                                                             const std::string& file_name,
                                                             const std::vector<DcpItem>& items) {
  if (!IsDataFileName(file_name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", file_name, "' is not a DCP data file name (__<rank>_<n>.distcp)"));
  }
  std::vector<DcpStoredEntry> stored;
  FSDP_ASSIGN_OR_RETURN(AtomicFileWriter data, AtomicFileWriter::Open(dir + "/" + file_name));
  uint64_t offset = 0;
  for (const DcpItem& item : items) {
    DcpStoredEntry entry;
    entry.path = item.path;
    entry.is_tensor = item.value.isTensor();
    c10::IValue value = item.value;
    if (entry.is_tensor) {
      // A view would store its whole storage, and a chunk is read back
      // as a whole archive: each chunk is written compact.
      const at::Tensor& t = item.value.toTensor();
      entry.dtype = t.scalar_type();
      FSDP_RETURN_IF_ERROR(PythonDtypeName(entry.dtype).status());
      entry.chunk_sizes = t.sizes().vec();
      entry.tensor_size = item.tensor_size.empty() ? entry.chunk_sizes : item.tensor_size;
      entry.chunk_offsets = item.chunk_offsets.empty()
                                ? std::vector<int64_t>(entry.chunk_sizes.size(), 0)
                                : item.chunk_offsets;
      if (entry.chunk_offsets.size() != entry.chunk_sizes.size() ||
          entry.tensor_size.size() != entry.chunk_sizes.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the chunk of '", DcpStoredName(item.path), "' at [",
            absl::StrJoin(entry.chunk_offsets, ", "), "] has ", entry.chunk_sizes.size(),
            " dimensions, its tensor ", entry.tensor_size.size()));
      }
      value = t.is_cpu() ? t.detach().clone(at::MemoryFormat::Contiguous)
                         : t.detach().contiguous().cpu();
    } else if (!item.chunk_offsets.empty() || !item.tensor_size.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", DcpStoredName(item.path), "' is a chunk but not a tensor"));
    }
    FSDP_ASSIGN_OR_RETURN(const std::string bytes, TorchSaveBytes(value));
    if (!bytes.empty()) FSDP_RETURN_IF_ERROR(data.Write(bytes.data(), bytes.size()));
    entry.location = {file_name, offset, bytes.size()};
    offset += bytes.size();
    stored.push_back(std::move(entry));
  }
  FSDP_RETURN_IF_ERROR(data.Commit());
  return stored;
}

absl::Status CommitDcpMetadata(const std::string& dir, const std::vector<DcpStoredEntry>& entries) {
  std::vector<StoredGroup> groups;
  std::map<std::string, size_t> group_of;
  std::set<std::string> data_files;
  for (const DcpStoredEntry& entry : entries) {
    const std::string name = DcpStoredName(entry.path);
    if (entry.path.empty()) return absl::InvalidArgumentError("a value to write has no path");
    auto [it, added] = group_of.emplace(name, groups.size());
    if (added) {
      groups.push_back({name, {}});
    } else {
      const DcpStoredEntry& first = *groups[it->second].pieces.front();
      if (!entry.is_tensor || !first.is_tensor || entry.dtype != first.dtype ||
          entry.tensor_size != first.tensor_size || entry.path.size() != first.path.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("'", name, "' is written twice, not as chunks of one tensor"));
      }
    }
    groups[it->second].pieces.push_back(&entry);
    data_files.insert(entry.location.relative_path);
  }
  FSDP_ASSIGN_OR_RETURN(const std::string pickle, MetadataPickle(groups));
  // What is committed must read back: the reader's checks (chunks inside
  // their tensor, covering it once, each with its storage) run on it first.
  {
    UnpicklerHooks hooks;
    hooks.allow_global = AllowGlobal;
    hooks.call = Call;
    FSDP_ASSIGN_OR_RETURN(
        PyRef root, Unpickle(pickle.data(), pickle.size(),
                             absl::StrCat("DCP checkpoint '", dir, "': new .metadata"), hooks));
    absl::StatusOr<DcpMetadata> check = MetadataParser(dir).Parse(root);
    if (!check.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("not writing DCP checkpoint '", dir, "': ", check.status().message()));
    }
  }
  FSDP_ASSIGN_OR_RETURN(AtomicFileWriter metadata, AtomicFileWriter::Open(dir + "/.metadata"));
  FSDP_RETURN_IF_ERROR(metadata.Write(pickle.data(), pickle.size()));
  FSDP_RETURN_IF_ERROR(metadata.Commit());
  // The replaced checkpoint's data files.
  if (DIR* d = opendir(dir.c_str())) {
    while (const dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (IsDataFileName(name) && data_files.count(name) == 0) unlink((dir + "/" + name).c_str());
    }
    closedir(d);
  }
  return absl::OkStatus();
}

std::string NewDcpDataFileName(int rank, uint64_t save_id) {
  return absl::StrCat("__", rank, "_", save_id, ".distcp");
}

absl::Status SaveDcpCheckpoint(const std::string& dir, const std::vector<DcpItem>& items) {
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot create '", dir, "': ", std::strerror(errno)));
  }
  // A new data file name each time: the checkpoint there stays whole until
  // the new .metadata lands.
  const std::string data_file = NewDcpDataFileName(
      0, static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()));
  FSDP_ASSIGN_OR_RETURN(const std::vector<DcpStoredEntry> stored,
                        WriteDcpDataFile(dir, data_file, items));
  absl::Status committed = CommitDcpMetadata(dir, stored);
  if (!committed.ok()) unlink((dir + "/" + data_file).c_str());
  return committed;
}

absl::StatusOr<PyRef> ReadDcpBytes(const std::string& dir, const DcpBytesEntry& entry) {
  return ReadTorchSaveObject(absl::StrCat(dir, "/", entry.location.relative_path),
                             entry.location.offset, entry.location.length);
}

namespace {

// Boxes of [lo, hi) within the sub-tensor at `prefix` (indices fixed for
// the dimensions before `dim`), whose first element has flat index `base`.
void AddBoxes(const std::vector<int64_t>& size, size_t dim, std::vector<int64_t>& prefix,
              int64_t base, int64_t lo, int64_t hi, std::vector<DcpBox>& out) {
  if (lo >= hi) return;
  int64_t stride = 1;  // Elements per index of `dim`.
  for (size_t d = dim + 1; d < size.size(); ++d) stride *= size[d];
  const auto box = [&](int64_t first, int64_t count) {
    DcpBox b;
    b.offsets = prefix;
    b.sizes.assign(prefix.size(), 1);
    b.offsets.push_back(first);
    b.sizes.push_back(count);
    for (size_t d = dim + 1; d < size.size(); ++d) {
      b.offsets.push_back(0);
      b.sizes.push_back(size[d]);
    }
    b.flat_begin = base + first * stride;
    out.push_back(std::move(b));
  };
  const auto inner = [&](int64_t index, int64_t from, int64_t to) {
    prefix.push_back(index);
    AddBoxes(size, dim + 1, prefix, base + index * stride, from, to, out);
    prefix.pop_back();
  };
  int64_t first = lo / stride;
  const int64_t last = hi / stride;  // Whole indices end here.
  if (first == last) {               // Within one index of `dim`, so stride > 1.
    inner(first, lo - first * stride, hi - first * stride);
    return;
  }
  if (lo % stride != 0) {
    inner(first, lo % stride, stride);
    ++first;
  }
  if (last > first) box(first, last - first);
  if (hi % stride != 0) inner(last, 0, hi % stride);
}

}  // namespace

std::vector<DcpBox> DcpBoxesOfFlatRange(const std::vector<int64_t>& size, int64_t lo, int64_t hi) {
  std::vector<DcpBox> out;
  if (lo >= hi) return out;
  if (size.empty()) {
    out.push_back(DcpBox{{}, {}, 0});
    return out;
  }
  std::vector<int64_t> prefix;
  AddBoxes(size, 0, prefix, 0, lo, hi, out);
  return out;
}

absl::StatusOr<at::Tensor> ReadDcpFlatRange(const std::string& dir, const DcpTensorEntry& tensor,
                                            int64_t lo, int64_t hi, int64_t* bytes_read) {
  int64_t numel = 1;
  for (int64_t d : tensor.size) numel *= d;  // Checked not to overflow when read.
  if (lo < 0 || hi < lo || hi > numel) {
    return absl::InvalidArgumentError(absl::StrCat("elements [", lo, ", ", hi, ") lie outside '",
                                                   tensor.fqn, "' of ", numel, " elements"));
  }
  for (const DcpChunk& chunk : tensor.chunks) {
    if (chunk.offsets.size() != tensor.size.size() || chunk.sizes.size() != tensor.size.size()) {
      return absl::InvalidArgumentError(absl::StrCat("a chunk of '", tensor.fqn, "' has ",
                                                     chunk.sizes.size(), " dimensions, not ",
                                                     tensor.size.size()));
    }
  }
  try {
    at::Tensor out = at::empty({hi - lo}, at::TensorOptions().dtype(tensor.dtype));
    const std::vector<DcpBox> boxes = DcpBoxesOfFlatRange(tensor.size, lo, hi);
    // Each chunk that meets a box is read once, however many boxes it meets.
    for (const DcpChunk& chunk : tensor.chunks) {
      std::vector<const DcpBox*> met;
      for (const DcpBox& box : boxes) {
        bool meets = true;
        for (size_t d = 0; d < box.offsets.size(); ++d) {
          meets = meets &&
                  std::max(box.offsets[d], chunk.offsets[d]) <
                      std::min(box.offsets[d] + box.sizes[d], chunk.offsets[d] + chunk.sizes[d]);
        }
        if (meets) met.push_back(&box);
      }
      if (met.empty()) continue;
      FSDP_ASSIGN_OR_RETURN(at::Tensor stored, ReadChunk(dir, tensor, chunk));
      if (bytes_read != nullptr) *bytes_read += static_cast<int64_t>(chunk.location.length);
      for (const DcpBox* box : met) {
        int64_t box_numel = 1;
        for (int64_t s : box->sizes) box_numel *= s;
        at::Tensor target = out.narrow(0, box->flat_begin - lo, box_numel).view(box->sizes);
        at::Tensor source = stored;
        for (size_t d = 0; d < box->offsets.size(); ++d) {
          const int64_t dim = static_cast<int64_t>(d);
          const int64_t from = std::max(box->offsets[d], chunk.offsets[d]);
          const int64_t to =
              std::min(box->offsets[d] + box->sizes[d], chunk.offsets[d] + chunk.sizes[d]);
          source = source.narrow(dim, from - chunk.offsets[d], to - from);
          target = target.narrow(dim, from - box->offsets[d], to - from);
        }
        target.copy_(source);
      }
    }
    return out;  // The metadata's chunks cover the tensor (checked when read).
  } catch (const std::exception& e) {
    std::string what = e.what();
    return absl::InternalError(absl::StrCat("DCP checkpoint '", dir, "': reading '", tensor.fqn,
                                            "': ", what.substr(0, what.find('\n'))));
  }
}

absl::StatusOr<StateDict> LoadDcpStateDict(const std::string& dir, const std::string& prefix) {
  FSDP_ASSIGN_OR_RETURN(DcpMetadata metadata, ReadDcpMetadata(dir));
  StateDict state;
  for (const DcpTensorEntry& tensor : metadata.tensors) {
    if (tensor.fqn.rfind(prefix, 0) != 0) continue;
    int64_t numel = 1;
    for (int64_t d : tensor.size) numel *= d;
    FSDP_ASSIGN_OR_RETURN(at::Tensor flat, ReadDcpFlatRange(dir, tensor, 0, numel));
    state.emplace_back(tensor.fqn.substr(prefix.size()), flat.view(tensor.size));
  }
  if (state.empty() && !prefix.empty()) {
    std::vector<std::string> names;
    for (const DcpTensorEntry& tensor : metadata.tensors) names.push_back(tensor.fqn);
    if (names.size() > 5) names.resize(5);
    return absl::NotFoundError(
        absl::StrCat("DCP checkpoint '", dir, "' has no tensor under '", prefix,
                     "' (its tensors start: ", absl::StrJoin(names, ", "), ")"));
  }
  return state;
}

}  // namespace fsdp
