// Reading a DCP checkpoint's .metadata: the allow-list of the globals DCP's
// pickle names, what each call among them may build, and the parser that
// turns the unpickled Metadata into a DcpMetadata, checking every claim it
// makes (chunks inside their tensor and covering it once, a storage entry
// for every chunk, data file names inside the directory) before anything
// reads data on its word. The tensor data is read in formats/dcp.cc; the
// pickle is written in formats/dcp_writer.cc, which runs this parser on
// it before committing it (formats/dcp_internal.h).
#include "formats/dcp.h"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "formats/dcp_internal.h"
#include "formats/restricted_unpickler.h"

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

}  // namespace

namespace dcp_internal {

absl::StatusOr<PyRef> UnpickleDcpMetadata(const std::string& bytes, const std::string& what) {
  UnpicklerHooks hooks;
  hooks.allow_global = AllowGlobal;
  hooks.call = Call;
  return Unpickle(bytes.data(), bytes.size(), what, hooks);
}

absl::StatusOr<DcpMetadata> ParseDcpMetadata(const std::string& dir, const PyRef& root) {
  return MetadataParser(dir).Parse(root);
}

}  // namespace dcp_internal

namespace {

// Loading one checkpoint reads its .metadata up to three times (the train
// state, the optimizer's part, the model's part), and unpickling it was
// most of a DCP load's CPU time (models/checkpoint_format_benchmark_results.md).
// The last one parsed is kept with the bytes and the directory name it was
// parsed from (messages name the directory): a read that finds both the
// same reuses the parse. Keyed by content, not by the file's identity, so
// that nothing rewritten in place within a timestamp's tick (a fuzzer's
// inputs, a coarse-grained file system) is taken for what it replaced;
// reading the file is cheap beside unpickling it.
class LastParsedMetadata {
 public:
  std::optional<DcpMetadata> Find(const std::string& dir, const std::string& bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!metadata_.has_value() || dir != dir_ || bytes != bytes_) return std::nullopt;
    return metadata_;
  }
  void Keep(const std::string& dir, const std::string& bytes, const DcpMetadata& metadata) {
    std::lock_guard<std::mutex> lock(mu_);
    dir_ = dir;
    bytes_ = bytes;
    metadata_ = metadata;
  }

 private:
  std::mutex mu_;
  std::string dir_, bytes_;
  std::optional<DcpMetadata> metadata_;
};

LastParsedMetadata& MetadataCache() {
  static auto* cache = new LastParsedMetadata();
  return *cache;
}

}  // namespace

absl::StatusOr<DcpMetadata> ReadDcpMetadata(const std::string& dir) {
  const std::string path = dir + "/.metadata";
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("'", dir, "' is not a DCP checkpoint: no .metadata"));
  }
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (std::optional<DcpMetadata> kept = MetadataCache().Find(dir, bytes)) return *std::move(kept);
  FSDP_ASSIGN_OR_RETURN(PyRef root,
                        dcp_internal::UnpickleDcpMetadata(
                            bytes, absl::StrCat("DCP checkpoint '", dir, "': .metadata")));
  FSDP_ASSIGN_OR_RETURN(DcpMetadata metadata, dcp_internal::ParseDcpMetadata(dir, root));
  MetadataCache().Keep(dir, bytes, metadata);
  return metadata;
}

}  // namespace fsdp
