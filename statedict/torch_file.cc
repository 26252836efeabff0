#include "statedict/torch_file.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "ATen/core/Dict.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "caffe2/serialize/inline_container.h"
#include "statedict/atomic_file.h"
#include "statedict/crc32.h"
#include "torch/csrc/jit/serialization/export.h"
#include "torch/csrc/jit/serialization/pickler.h"

namespace fsdp {
namespace {

// --- Writing -----------------------------------------------------------------

// A tensor whose storage holds exactly its elements, in order: the pickler
// writes whole storages, so a view (a parameter's shard of a flat buffer)
// would otherwise drag its whole buffer into the file.
at::Tensor Compact(const at::Tensor& t) {
  const bool compact = t.is_contiguous() && t.storage_offset() == 0 &&
                       t.storage().nbytes() == static_cast<size_t>(t.numel()) * t.element_size();
  return compact ? t : t.contiguous().clone();
}

// --- Reading -----------------------------------------------------------------

uint64_t Le(const std::string& b, size_t at, int bytes) {
  uint64_t v = 0;
  for (int k = 0; k < bytes; ++k) v |= static_cast<uint64_t>(static_cast<uint8_t>(b[at + k])) << (8 * k);
  return v;
}

// What the zip central directory records for one entry.
struct ZipEntry {
  uint32_t crc = 0;
  uint64_t compressed_size = 0;
  uint64_t size = 0;  // Uncompressed.
};

// The central directory's entries, by name without the archive's top
// directory ("data/0", "data.pkl"). The reader checks every record against
// them before reading it: the CRC-32, which libtorch's reader does not
// check for stored (uncompressed) records, how torch.save stores
// everything, so a flipped byte would load silently; and the size, before
// anything is allocated for it. An archive whose every CRC is 0 was written
// with torch.serialization.set_crc32_options(False) and cannot be checked.
struct ZipDirectory {
  uint64_t file_size = 0;
  bool has_crcs = false;
  std::unordered_map<std::string, ZipEntry> entries;
};

absl::StatusOr<ZipDirectory> ReadZipDirectory(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  const auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read '", path, "' as a torch.save archive: ", what));
  };
  if (!in) return bad("cannot open it");
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  const uint64_t tail_size = std::min<uint64_t>(size, 65535 + 22 + 20);
  std::string tail(tail_size, '\0');
  in.seekg(static_cast<std::streamoff>(size - tail_size));
  in.read(&tail[0], static_cast<std::streamsize>(tail_size));
  size_t eocd = std::string::npos;
  for (size_t at = tail_size >= 22 ? tail_size - 22 + 1 : 0; at-- > 0;) {
    if (Le(tail, at, 4) == 0x06054b50) {
      eocd = at;
      break;
    }
  }
  if (eocd == std::string::npos) {
    // torch.save's format before PyTorch 1.6 (and with
    // _use_new_zipfile_serialization=False) is a pickle stream that starts
    // by pickling this magic number (a LONG1 opcode with 10 bytes).
    static constexpr unsigned char kLegacyMagic[] = {0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c,
                                                     0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19};
    std::string head(sizeof(kLegacyMagic), '\0');
    in.clear();
    in.seekg(0);
    in.read(&head[0], static_cast<std::streamsize>(head.size()));
    if (in && std::memcmp(head.data(), kLegacyMagic, sizeof(kLegacyMagic)) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", path, "' is in torch.save's legacy format (PyTorch before 1.6, or "
          "_use_new_zipfile_serialization=False), which is not supported: convert it in "
          "Python with torch.save(torch.load('", path, "'), 'NEW.pt')"));
    }
    return bad("no zip end-of-central-directory record");
  }
  uint64_t entries = Le(tail, eocd + 10, 2);
  uint64_t dir_size = Le(tail, eocd + 12, 4);
  uint64_t dir_offset = Le(tail, eocd + 16, 4);
  if ((entries == 0xffff || dir_offset == 0xffffffff) && eocd >= 20 &&
      Le(tail, eocd - 20, 4) == 0x07064b50) {  // Zip64 locator -> zip64 record.
    const uint64_t record = Le(tail, eocd - 20 + 8, 8);
    std::string z(56, '\0');
    in.seekg(static_cast<std::streamoff>(record));
    in.read(&z[0], 56);
    if (!in || Le(z, 0, 4) != 0x06064b50) return bad("broken zip64 end record");
    entries = Le(z, 32, 8);
    dir_size = Le(z, 40, 8);
    dir_offset = Le(z, 48, 8);
  }
  if (dir_offset + dir_size > size) return bad("the zip central directory lies beyond the file");
  std::string dir(dir_size, '\0');
  in.seekg(static_cast<std::streamoff>(dir_offset));
  in.read(&dir[0], static_cast<std::streamsize>(dir_size));
  if (!in) return bad("cannot read the zip central directory");
  ZipDirectory directory;
  directory.file_size = size;
  size_t at = 0;
  for (uint64_t e = 0; e < entries; ++e) {
    if (at + 46 > dir.size() || Le(dir, at, 4) != 0x02014b50) return bad("corrupt zip directory");
    ZipEntry entry;
    entry.crc = static_cast<uint32_t>(Le(dir, at + 16, 4));
    entry.compressed_size = Le(dir, at + 20, 4);
    entry.size = Le(dir, at + 24, 4);
    const size_t name_len = Le(dir, at + 28, 2), extra_len = Le(dir, at + 30, 2),
                 comment_len = Le(dir, at + 32, 2);
    if (at + 46 + name_len > dir.size()) return bad("corrupt zip directory");
    if (at + 46 + name_len + extra_len > dir.size()) return bad("corrupt zip directory");
    // Sizes of 4 GiB and more live in the zip64 extra field, in this order.
    std::string extra = dir.substr(at + 46 + name_len, extra_len);
    for (size_t e = 0; e + 4 <= extra.size();) {
      const uint64_t tag = Le(extra, e, 2), len = Le(extra, e + 2, 2);
      if (e + 4 + len > extra.size()) break;
      if (tag == 0x0001) {
        size_t field = e + 4;
        if (entry.size == 0xffffffff && field + 8 <= e + 4 + len) {
          entry.size = Le(extra, field, 8);
          field += 8;
        }
        if (entry.compressed_size == 0xffffffff && field + 8 <= e + 4 + len) {
          entry.compressed_size = Le(extra, field, 8);
        }
      }
      e += 4 + len;
    }
    directory.has_crcs = directory.has_crcs || entry.crc != 0;
    std::string name = dir.substr(at + 46, name_len);
    const size_t slash = name.find('/');
    directory.entries[slash == std::string::npos ? name : name.substr(slash + 1)] = entry;
    at += 46 + name_len + extra_len + comment_len;
  }
  return directory;
}

// Checks a record's directory entry before anything is allocated for it:
// it exists, holds `expected_size` bytes when that is known (>= 0), and
// claims no more than the file could hold (deflate expands at most 1032x).
absl::Status CheckRecordSize(const std::string& path, const ZipDirectory& directory,
                             const std::string& record, int64_t expected_size) {
  auto it = directory.entries.find(record);
  if (it == directory.entries.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "': the archive has no record '", record, "'"));
  }
  const ZipEntry& entry = it->second;
  if (expected_size >= 0 && entry.size != static_cast<uint64_t>(expected_size)) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': record '", record, "' has ",
                                                   entry.size, " bytes, expected ", expected_size));
  }
  if (entry.compressed_size > directory.file_size ||
      entry.size > 1032 * entry.compressed_size + 1024) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': record '", record, "' claims ",
                                                   entry.size, " bytes from ",
                                                   entry.compressed_size, " stored in a file of ",
                                                   directory.file_size, ": the file is corrupt"));
  }
  return absl::OkStatus();
}

absl::Status CheckRecordCrc(const std::string& path, const ZipDirectory& directory,
                            const std::string& record, const void* bytes, size_t n) {
  if (!directory.has_crcs) return absl::OkStatus();
  auto it = directory.entries.find(record);
  if (it == directory.entries.end() || Crc32(bytes, n) != it->second.crc) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", path, "': record '", record, "' fails its CRC-32 check: the file is corrupt"));
  }
  return absl::OkStatus();
}

// A value of the pickle subset torch.save uses for state dicts.
struct PyValue;
using PyRef = std::shared_ptr<PyValue>;
struct PyValue {
  enum class Kind { kNone, kBool, kInt, kFloat, kString, kTuple, kList, kDict, kGlobal, kTensor };
  Kind kind = Kind::kNone;
  int64_t i = 0;  // Bool and int.
  double f = 0;
  std::string s;  // String; "module.name" for a global.
  std::vector<PyRef> items;                      // Tuple, list.
  std::vector<std::pair<PyRef, PyRef>> entries;  // Dict, in insertion order.
  at::Tensor tensor;                             // Tensor, or a storage as a 1-D tensor.
};

PyRef Make(PyValue::Kind kind) {
  auto v = std::make_shared<PyValue>();
  v->kind = kind;
  return v;
}

const char* KindName(PyValue::Kind kind) {
  switch (kind) {
    case PyValue::Kind::kNone: return "None";
    case PyValue::Kind::kBool: return "bool";
    case PyValue::Kind::kInt: return "int";
    case PyValue::Kind::kFloat: return "float";
    case PyValue::Kind::kString: return "str";
    case PyValue::Kind::kTuple: return "tuple";
    case PyValue::Kind::kList: return "list";
    case PyValue::Kind::kDict: return "dict";
    case PyValue::Kind::kGlobal: return "global";
    case PyValue::Kind::kTensor: return "tensor";
  }
  return "?";
}

// The legacy Storage classes through which torch.save's format names a
// storage's dtype (libtorch's pickler writes "torch.<Type>Storage").
// Dtypes without one (float8, uint16/32/64) cannot be written in it.
const std::map<std::string, at::ScalarType>& StorageClasses() {
  static const auto* kTypes = new std::map<std::string, at::ScalarType>{
      {"torch.FloatStorage", at::kFloat},
      {"torch.DoubleStorage", at::kDouble},
      {"torch.HalfStorage", at::kHalf},
      {"torch.BFloat16Storage", at::kBFloat16},
      {"torch.LongStorage", at::kLong},
      {"torch.IntStorage", at::kInt},
      {"torch.ShortStorage", at::kShort},
      {"torch.CharStorage", at::kChar},
      {"torch.ByteStorage", at::kByte},
      {"torch.BoolStorage", at::kBool},
      {"torch.ComplexFloatStorage", at::kComplexFloat},
      {"torch.ComplexDoubleStorage", at::kComplexDouble},
  };
  return *kTypes;
}

bool StorageDtype(const std::string& storage_type, at::ScalarType* dtype) {
  auto it = StorageClasses().find(storage_type);
  if (it == StorageClasses().end()) return false;
  *dtype = it->second;
  return true;
}

bool HasStorageClass(at::ScalarType dtype) {
  for (const auto& [name, type] : StorageClasses()) {
    if (type == dtype) return true;
  }
  return false;
}

class Unpickler {
 public:
  Unpickler(std::string path, const char* data, size_t size,
            caffe2::serialize::PyTorchStreamReader& archive, const ZipDirectory& directory)
      : path_(std::move(path)),
        data_(data),
        size_(size),
        archive_(archive),
        directory_(directory) {}

  absl::StatusOr<PyRef> Run() {
    while (true) {
      uint8_t op = 0;
      FSDP_RETURN_IF_ERROR(ReadByte(&op));
      if (op == '.') break;  // STOP
      FSDP_RETURN_IF_ERROR(Step(op));
    }
    if (stack_.size() != 1) return Error("the pickle does not end with one value");
    return stack_.back();
  }

 private:
  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path_, "': ", what, " (at byte ", pos_, " of data.pkl)"));
  }
  absl::Status ReadByte(uint8_t* out) {
    if (pos_ >= size_) return Error("data.pkl ends early");
    *out = static_cast<uint8_t>(data_[pos_++]);
    return absl::OkStatus();
  }
  absl::Status ReadBytes(size_t n, std::string* out) {
    if (n > size_ - pos_) return Error("data.pkl ends early");
    out->assign(data_ + pos_, n);
    pos_ += n;
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> ReadUint(size_t n) {
    std::string bytes;
    FSDP_RETURN_IF_ERROR(ReadBytes(n, &bytes));
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[k])) << (8 * k);
    return v;
  }
  absl::StatusOr<std::string> ReadLine() {
    const size_t start = pos_;
    while (pos_ < size_ && data_[pos_] != '\n') ++pos_;
    if (pos_ >= size_) return Error("data.pkl ends inside a GLOBAL");
    return std::string(data_ + start, pos_++ - start);
  }
  absl::StatusOr<PyRef> Pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) {
      return Error("pickle stack underflow");
    }
    PyRef v = stack_.back();
    stack_.pop_back();
    return v;
  }
  absl::StatusOr<std::vector<PyRef>> PopToMark() {
    if (marks_.empty()) return Error("pickle MARK missing");
    std::vector<PyRef> items(stack_.begin() + marks_.back(), stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return items;
  }
  absl::StatusOr<PyRef> Top() {
    if (stack_.empty()) return Error("pickle stack underflow");
    return stack_.back();
  }
  void Push(PyRef v) { stack_.push_back(std::move(v)); }
  PyRef Int(int64_t v) {
    PyRef r = Make(PyValue::Kind::kInt);
    r->i = v;
    return r;
  }
  PyRef Str(std::string s, PyValue::Kind kind = PyValue::Kind::kString) {
    PyRef r = Make(kind);
    r->s = std::move(s);
    return r;
  }
  PyRef Tuple(std::vector<PyRef> items) {
    PyRef r = Make(PyValue::Kind::kTuple);
    r->items = std::move(items);
    return r;
  }
  absl::Status Memoize(uint64_t index) {
    FSDP_ASSIGN_OR_RETURN(PyRef top, Top());
    memo_[index] = top;
    return absl::OkStatus();
  }
  absl::Status Recall(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) return Error(absl::StrCat("memo ", index, " was never stored"));
    Push(it->second);
    return absl::OkStatus();
  }
  absl::Status SetItems(const PyRef& dict, const std::vector<PyRef>& kv) {
    if (dict->kind != PyValue::Kind::kDict) return Error("SETITEM(S) on a non-dict");
    if (kv.size() % 2 != 0) return Error("SETITEMS with an odd number of values");
    for (size_t k = 0; k < kv.size(); k += 2) dict->entries.emplace_back(kv[k], kv[k + 1]);
    return absl::OkStatus();
  }

  absl::StatusOr<PyRef> PersistentLoad(const PyRef& pid) {
    // ('storage', <storage type>, key, location, numel)
    if (pid->kind != PyValue::Kind::kTuple || pid->items.size() < 5 ||
        pid->items[0]->kind != PyValue::Kind::kString || pid->items[0]->s != "storage" ||
        pid->items[1]->kind != PyValue::Kind::kGlobal ||
        pid->items[2]->kind != PyValue::Kind::kString || pid->items[4]->kind != PyValue::Kind::kInt) {
      return Error("unsupported persistent id (expected a storage reference)");
    }
    const std::string& key = pid->items[2]->s;
    auto cached = storages_.find(key);
    if (cached != storages_.end()) return cached->second;
    at::ScalarType dtype;
    if (!StorageDtype(pid->items[1]->s, &dtype)) {
      return Error(absl::StrCat("unsupported storage type ", pid->items[1]->s));
    }
    // Everything here comes from the file: check the count against the
    // record's size before allocating for either.
    const int64_t numel = pid->items[4]->i;
    const int64_t element_size = static_cast<int64_t>(c10::elementSize(dtype));
    const std::string record = "data/" + key;
    if (numel < 0 || numel > std::numeric_limits<int64_t>::max() / element_size) {
      return Error(absl::StrCat("storage '", record, "' claims ", numel, " elements"));
    }
    FSDP_RETURN_IF_ERROR(CheckRecordSize(path_, directory_, record, numel * element_size));
    at::DataPtr bytes;
    size_t nbytes = 0;
    std::tie(bytes, nbytes) = archive_.getRecord(record);
    if (nbytes != static_cast<size_t>(numel * element_size)) {
      return Error(absl::StrCat("storage record '", record, "' has ", nbytes, " bytes, expected ",
                                numel * element_size));
    }
    FSDP_RETURN_IF_ERROR(CheckRecordCrc(path_, directory_, record, bytes.get(), nbytes));
    at::Tensor storage = at::empty({numel}, at::TensorOptions().dtype(dtype));
    if (nbytes > 0) std::memcpy(storage.data_ptr(), bytes.get(), nbytes);
    PyRef value = Make(PyValue::Kind::kTensor);
    value->tensor = storage;
    storages_[key] = value;
    return value;
  }

  absl::StatusOr<std::vector<int64_t>> IntTuple(const PyRef& v, const char* what) {
    if (v->kind != PyValue::Kind::kTuple) return Error(absl::StrCat(what, " is not a tuple"));
    std::vector<int64_t> out;
    for (const PyRef& item : v->items) {
      if (item->kind != PyValue::Kind::kInt) return Error(absl::StrCat(what, " holds a non-int"));
      out.push_back(item->i);
    }
    return out;
  }

  absl::StatusOr<PyRef> Reduce(const PyRef& callable, const PyRef& args) {
    if (callable->kind != PyValue::Kind::kGlobal || args->kind != PyValue::Kind::kTuple) {
      return Error("REDUCE of something that is not a global");
    }
    const std::string& name = callable->s;
    const std::vector<PyRef>& a = args->items;
    if (name == "collections.OrderedDict") {
      if (!a.empty()) return Error("OrderedDict with constructor arguments");
      return Make(PyValue::Kind::kDict);
    }
    if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor") {
      if (a.size() < 4 || a[0]->kind != PyValue::Kind::kTensor || a[1]->kind != PyValue::Kind::kInt) {
        return Error(absl::StrCat("bad arguments to ", name));
      }
      FSDP_ASSIGN_OR_RETURN(std::vector<int64_t> sizes, IntTuple(a[2], "tensor size"));
      FSDP_ASSIGN_OR_RETURN(std::vector<int64_t> strides, IntTuple(a[3], "tensor stride"));
      if (sizes.size() != strides.size()) return Error("tensor size and stride differ in rank");
      const at::Tensor& storage = a[0]->tensor;
      int64_t last = a[1]->i;  // The furthest element the view reaches.
      bool empty = false;
      for (size_t d = 0; d < sizes.size(); ++d) {
        if (sizes[d] < 0 || strides[d] < 0) return Error("negative tensor size or stride");
        if (sizes[d] == 0) empty = true;
        last += (sizes[d] - 1) * strides[d];
      }
      if (a[1]->i < 0 || (!empty && last >= storage.numel())) {
        return Error("a tensor reaches beyond its storage");
      }
      PyRef value = Make(PyValue::Kind::kTensor);
      value->tensor = empty ? at::empty(sizes, storage.options())
                            : storage.as_strided(sizes, strides, a[1]->i).contiguous();
      return value;
    }
    if (name == "torch.jit._pickle.restore_type_tag") {  // (value, type string) -> value
      if (a.empty()) return Error("restore_type_tag without arguments");
      return a[0];
    }
    if (name == "torch._utils._rebuild_parameter" ||
        name == "torch._utils._rebuild_parameter_with_state") {
      if (a.empty() || a[0]->kind != PyValue::Kind::kTensor) {
        return Error(absl::StrCat("bad arguments to ", name));
      }
      return a[0];
    }
    return Error(absl::StrCat("the pickle calls ", name,
                              ", which a state dict file never needs; refusing to load it"));
  }

  absl::Status Step(uint8_t op) {
    switch (op) {
      case 0x80: {  // PROTO
        FSDP_ASSIGN_OR_RETURN(uint64_t version, ReadUint(1));
        if (version > 5) return Error(absl::StrCat("pickle protocol ", version));
        return absl::OkStatus();
      }
      case 0x95: {  // FRAME
        FSDP_ASSIGN_OR_RETURN(uint64_t ignored, ReadUint(8));
        (void)ignored;
        return absl::OkStatus();
      }
      case '}': Push(Make(PyValue::Kind::kDict)); return absl::OkStatus();
      case ']': Push(Make(PyValue::Kind::kList)); return absl::OkStatus();
      case ')': Push(Tuple({})); return absl::OkStatus();
      case 'N': Push(Make(PyValue::Kind::kNone)); return absl::OkStatus();
      case 0x88:
      case 0x89: {  // NEWTRUE, NEWFALSE
        PyRef b = Make(PyValue::Kind::kBool);
        b->i = op == 0x88;
        Push(b);
        return absl::OkStatus();
      }
      case '(': marks_.push_back(stack_.size()); return absl::OkStatus();
      case 'K': { FSDP_ASSIGN_OR_RETURN(uint64_t v, ReadUint(1)); Push(Int(static_cast<int64_t>(v))); return absl::OkStatus(); }
      case 'M': { FSDP_ASSIGN_OR_RETURN(uint64_t v, ReadUint(2)); Push(Int(static_cast<int64_t>(v))); return absl::OkStatus(); }
      case 'J': {
        FSDP_ASSIGN_OR_RETURN(uint64_t v, ReadUint(4));
        Push(Int(static_cast<int32_t>(static_cast<uint32_t>(v))));
        return absl::OkStatus();
      }
      case 0x8a: {  // LONG1: little-endian two's complement of n bytes.
        FSDP_ASSIGN_OR_RETURN(uint64_t n, ReadUint(1));
        if (n > 8) return Error("an integer wider than 64 bits");
        FSDP_ASSIGN_OR_RETURN(uint64_t v, ReadUint(n));
        if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);
        Push(Int(static_cast<int64_t>(v)));
        return absl::OkStatus();
      }
      case 'G': {  // BINFLOAT, big-endian.
        FSDP_ASSIGN_OR_RETURN(uint64_t le, ReadUint(8));
        uint64_t be = 0;
        for (int k = 0; k < 8; ++k) be |= ((le >> (8 * k)) & 0xff) << (8 * (7 - k));
        PyRef f = Make(PyValue::Kind::kFloat);
        std::memcpy(&f->f, &be, 8);
        Push(f);
        return absl::OkStatus();
      }
      case 'X':     // BINUNICODE
      case 'T':     // BINSTRING
      case 0x8c:    // SHORT_BINUNICODE
      case 'U':     // SHORT_BINSTRING
      case 'C':     // SHORT_BINBYTES
      case 'B': {   // BINBYTES
        const size_t width = (op == 'X' || op == 'T' || op == 'B') ? 4 : 1;
        FSDP_ASSIGN_OR_RETURN(uint64_t n, ReadUint(width));
        std::string s;
        FSDP_RETURN_IF_ERROR(ReadBytes(n, &s));
        Push(Str(std::move(s)));
        return absl::OkStatus();
      }
      case 'q': { FSDP_ASSIGN_OR_RETURN(uint64_t i, ReadUint(1)); return Memoize(i); }
      case 'r': { FSDP_ASSIGN_OR_RETURN(uint64_t i, ReadUint(4)); return Memoize(i); }
      case 0x94: return Memoize(memo_.size());  // MEMOIZE
      case 'h': { FSDP_ASSIGN_OR_RETURN(uint64_t i, ReadUint(1)); return Recall(i); }
      case 'j': { FSDP_ASSIGN_OR_RETURN(uint64_t i, ReadUint(4)); return Recall(i); }
      case 'c': {  // GLOBAL
        FSDP_ASSIGN_OR_RETURN(std::string module, ReadLine());
        FSDP_ASSIGN_OR_RETURN(std::string name, ReadLine());
        Push(Str(module + "." + name, PyValue::Kind::kGlobal));
        return absl::OkStatus();
      }
      case 0x93: {  // STACK_GLOBAL
        FSDP_ASSIGN_OR_RETURN(PyRef name, Pop());
        FSDP_ASSIGN_OR_RETURN(PyRef module, Pop());
        if (name->kind != PyValue::Kind::kString || module->kind != PyValue::Kind::kString) {
          return Error("STACK_GLOBAL of non-strings");
        }
        Push(Str(module->s + "." + name->s, PyValue::Kind::kGlobal));
        return absl::OkStatus();
      }
      case 't': { FSDP_ASSIGN_OR_RETURN(std::vector<PyRef> items, PopToMark()); Push(Tuple(std::move(items))); return absl::OkStatus(); }
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        std::vector<PyRef> items(op - 0x84);
        for (size_t k = items.size(); k > 0; --k) {
          FSDP_ASSIGN_OR_RETURN(items[k - 1], Pop());
        }
        Push(Tuple(std::move(items)));
        return absl::OkStatus();
      }
      case 'Q': {  // BINPERSID
        FSDP_ASSIGN_OR_RETURN(PyRef pid, Pop());
        FSDP_ASSIGN_OR_RETURN(PyRef storage, PersistentLoad(pid));
        Push(storage);
        return absl::OkStatus();
      }
      case 'R': {  // REDUCE
        FSDP_ASSIGN_OR_RETURN(PyRef args, Pop());
        FSDP_ASSIGN_OR_RETURN(PyRef callable, Pop());
        FSDP_ASSIGN_OR_RETURN(PyRef result, Reduce(callable, args));
        Push(result);
        return absl::OkStatus();
      }
      case 0x81: {  // NEWOBJ
        FSDP_ASSIGN_OR_RETURN(PyRef args, Pop());
        FSDP_ASSIGN_OR_RETURN(PyRef cls, Pop());
        FSDP_ASSIGN_OR_RETURN(PyRef result, Reduce(cls, args));
        Push(result);
        return absl::OkStatus();
      }
      case 'b': {  // BUILD: an OrderedDict's _metadata, a tensor's state: not needed.
        FSDP_ASSIGN_OR_RETURN(PyRef state, Pop());
        (void)state;
        FSDP_ASSIGN_OR_RETURN(PyRef target, Top());
        if (target->kind != PyValue::Kind::kDict && target->kind != PyValue::Kind::kTensor) {
          return Error(absl::StrCat("BUILD on a ", KindName(target->kind)));
        }
        return absl::OkStatus();
      }
      case 's': {  // SETITEM
        FSDP_ASSIGN_OR_RETURN(PyRef value, Pop());
        FSDP_ASSIGN_OR_RETURN(PyRef key, Pop());
        FSDP_ASSIGN_OR_RETURN(PyRef dict, Top());
        return SetItems(dict, {key, value});
      }
      case 'u': {  // SETITEMS
        FSDP_ASSIGN_OR_RETURN(std::vector<PyRef> kv, PopToMark());
        FSDP_ASSIGN_OR_RETURN(PyRef dict, Top());
        return SetItems(dict, kv);
      }
      case 'a': {  // APPEND
        FSDP_ASSIGN_OR_RETURN(PyRef value, Pop());
        FSDP_ASSIGN_OR_RETURN(PyRef list, Top());
        if (list->kind != PyValue::Kind::kList) return Error("APPEND to a non-list");
        list->items.push_back(value);
        return absl::OkStatus();
      }
      case 'e': {  // APPENDS
        FSDP_ASSIGN_OR_RETURN(std::vector<PyRef> values, PopToMark());
        FSDP_ASSIGN_OR_RETURN(PyRef list, Top());
        if (list->kind != PyValue::Kind::kList) return Error("APPENDS to a non-list");
        list->items.insert(list->items.end(), values.begin(), values.end());
        return absl::OkStatus();
      }
      default:
        return Error(absl::StrCat("unsupported pickle opcode 0x", absl::Hex(op)));
    }
  }

  const std::string path_;
  const char* data_;
  size_t size_;
  size_t pos_ = 0;
  caffe2::serialize::PyTorchStreamReader& archive_;
  const ZipDirectory& directory_;
  std::vector<PyRef> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PyRef> memo_;
  std::unordered_map<std::string, PyRef> storages_;
};

}  // namespace

absl::Status SaveTorchStateDict(const std::string& path, const StateDict& state) {
  c10::Dict<std::string, at::Tensor> dict;
  std::unordered_map<const void*, at::Tensor> compacted;  // Tied tensors stay tied.
  for (const auto& [name, tensor] : state) {
    if (!tensor.defined()) {
      return absl::InvalidArgumentError(absl::StrCat("'", name, "' is an undefined tensor"));
    }
    if (!tensor.device().is_cpu()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", name, "' is on ", tensor.device().str(), "; offload it to CPU first"));
    }
    if (!HasStorageClass(tensor.scalar_type())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", name, "' has dtype ", c10::toString(tensor.scalar_type()),
          ", which torch.save's format cannot name (it has no legacy Storage class); convert "
          "it to a dtype that has one (e.g. bfloat16) before saving"));
    }
    if (dict.contains(name)) {
      return absl::InvalidArgumentError(absl::StrCat("'", name, "' appears twice"));
    }
    auto it = compacted.find(tensor.unsafeGetTensorImpl());
    if (it == compacted.end()) {
      it = compacted.emplace(tensor.unsafeGetTensorImpl(), Compact(tensor.detach())).first;
    }
    dict.insert(name, it->second);
  }
  try {
    std::vector<char> pickle;
    // Without type tags: a plain dict, as Python's torch.save writes.
    torch::jit::Pickler pickler(
        [&](const char* bytes, size_t n) { pickle.insert(pickle.end(), bytes, bytes + n); },
        /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
        /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
    pickler.protocol();
    pickler.pushIValue(dict);
    pickler.stop();
    FSDP_ASSIGN_OR_RETURN(AtomicFileWriter file, AtomicFileWriter::Open(path));
    absl::Status write_status;
    caffe2::serialize::PyTorchStreamWriter archive([&](const void* bytes, size_t n) -> size_t {
      if (write_status.ok()) write_status = file.Write(bytes, n);
      return n;
    });
    torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(),
                                       archive);
    if (!archive.finalized()) archive.writeEndOfFile();
    FSDP_RETURN_IF_ERROR(write_status);
    return file.Commit();
  } catch (...) {
    return StatusFromCurrentException();
  }
}

absl::StatusOr<StateDict> LoadTorchStateDict(const std::string& path, const std::string& entry) {
  FSDP_ASSIGN_OR_RETURN(const ZipDirectory directory, ReadZipDirectory(path));
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> archive;
  at::DataPtr pickle;
  size_t pickle_size = 0;
  try {
    archive = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
    if (!archive->hasRecord("data.pkl")) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", path, "' is not a torch.save file: the archive has no data.pkl"));
    }
    FSDP_RETURN_IF_ERROR(CheckRecordSize(path, directory, "data.pkl", -1));
    std::tie(pickle, pickle_size) = archive->getRecord("data.pkl");
    FSDP_RETURN_IF_ERROR(CheckRecordCrc(path, directory, "data.pkl", pickle.get(), pickle_size));
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read '", path, "' as a torch.save archive: ", what));
  }
  PyRef root;
  try {
    Unpickler unpickler(path, static_cast<const char*>(pickle.get()), pickle_size, *archive,
                        directory);
    FSDP_ASSIGN_OR_RETURN(root, unpickler.Run());
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    return absl::InvalidArgumentError(absl::StrCat("cannot read '", path, "': ", what));
  }
  if (root->kind != PyValue::Kind::kDict) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' holds a ", KindName(root->kind), ", not a dict"));
  }
  PyRef dict = root;
  if (!entry.empty()) {
    dict = nullptr;
    std::vector<std::string> keys;
    for (const auto& [k, v] : root->entries) {
      if (k->kind != PyValue::Kind::kString) continue;
      keys.push_back(k->s);
      if (k->s == entry) dict = v;
    }
    if (dict == nullptr || dict->kind != PyValue::Kind::kDict) {
      return absl::NotFoundError(absl::StrCat("'", path, "' has no dict under '", entry,
                                              "' (top-level keys: ", absl::StrJoin(keys, ", "),
                                              ")"));
    }
  }
  StateDict state;
  std::vector<std::string> problems;
  for (const auto& [k, v] : dict->entries) {
    if (k->kind != PyValue::Kind::kString) {
      problems.push_back(absl::StrCat("a key of type ", KindName(k->kind)));
    } else if (v->kind != PyValue::Kind::kTensor) {
      problems.push_back(absl::StrCat("'", k->s, "' is a ", KindName(v->kind)));
    } else {
      state.emplace_back(k->s, v->tensor);
    }
  }
  if (!problems.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("'", path,
                                                   "' is not a dict of tensors: ",
                                                   absl::StrJoin(problems, "; ")));
  }
  return state;
}

}  // namespace fsdp
