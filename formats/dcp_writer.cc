// Writing a DCP checkpoint: each writer's data file (every item a
// torch.save archive at a byte range) and the .metadata pickle that names
// them all, written opcode by opcode as Python's pickler writes DCP's
// dataclasses, so that PyTorch's dcp.load reads it. What is committed is
// first read back with the reader's own checks (formats/dcp_internal.h),
// and .metadata is replaced last, so a failed save leaves the checkpoint
// that was there whole.
#include "formats/dcp.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
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
#include "formats/atomic_file.h"
#include "formats/dcp_internal.h"
#include "formats/restricted_unpickler.h"

namespace fsdp {
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

// A tensor's entry: its dtype and size, and where each chunk lies in it.
absl::Status WriteTensorStorageMetadata(PickleWriter& p, const StoredGroup& group) {
  const DcpStoredEntry& first = *group.pieces.front();
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
  return absl::OkStatus();
}

// state_dict_metadata: {stored name: TensorStorageMetadata or BytesStorageMetadata}.
absl::Status WriteStateDictMetadata(PickleWriter& p, const std::vector<StoredGroup>& groups) {
  p.Str("state_dict_metadata");
  p.EmptyDict();
  p.Mark();
  for (const StoredGroup& group : groups) {
    p.Str(group.name);
    if (!group.pieces.front()->is_tensor) {
      p.Object(kMetadataPackage, "BytesStorageMetadata");
      continue;
    }
    FSDP_RETURN_IF_ERROR(WriteTensorStorageMetadata(p, group));
  }
  p.SetItems();
  return absl::OkStatus();
}

// planner_data: {stored name: (key or index, ...)}, the path that dcp.load
// unflattens each stored name to.
void WritePlannerData(PickleWriter& p, const std::vector<StoredGroup>& groups) {
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
}

// storage_data: {MetadataIndex(fqn, chunk offsets): _StorageInfo(file, byte range)}.
void WriteStorageData(PickleWriter& p, const std::vector<StoredGroup>& groups) {
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
}

absl::StatusOr<std::string> MetadataPickle(const std::vector<StoredGroup>& groups) {
  PickleWriter p;
  p.Object(kMetadataPackage, "Metadata");
  p.EmptyDict();
  p.Mark();
  FSDP_RETURN_IF_ERROR(WriteStateDictMetadata(p, groups));
  WritePlannerData(p, groups);
  WriteStorageData(p, groups);
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
  // The writer gathers the archives' small pieces (zip headers, pickles)
  // into its buffer.
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
      value = t.detach().contiguous().cpu();  // WriteTorchSave compacts it, uncopied.
    } else if (!item.chunk_offsets.empty() || !item.tensor_size.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", DcpStoredName(item.path), "' is a chunk but not a tensor"));
    }
    FSDP_RETURN_IF_ERROR(
        WriteTorchSave(value, [&](const void* bytes, size_t n) { return data.Write(bytes, n); }));
    const uint64_t end = static_cast<uint64_t>(data.bytes_written());
    entry.location = {file_name, offset, end - offset};
    offset = end;
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
    FSDP_ASSIGN_OR_RETURN(PyRef root,
                          dcp_internal::UnpickleDcpMetadata(
                              pickle, absl::StrCat("DCP checkpoint '", dir, "': new .metadata")));
    absl::StatusOr<DcpMetadata> check = dcp_internal::ParseDcpMetadata(dir, root);
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

}  // namespace fsdp
