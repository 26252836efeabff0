#include "formats/torch_file.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
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
#include "formats/atomic_file.h"
#include "formats/restricted_unpickler.h"
#include "formats/torch_zip.h"
#include "torch/csrc/jit/serialization/export.h"
#include "torch/csrc/jit/serialization/pickler.h"

namespace fsdp {
namespace {

using torch_zip::ByteRange;
using torch_zip::ByteRangeAdapter;
using torch_zip::CheckRecordCrc;
using torch_zip::CheckRecordSize;
using torch_zip::ReadZipDirectory;
using torch_zip::ZipDirectory;

// --- Writing -----------------------------------------------------------------

// A tensor whose storage holds exactly its elements, in order: the pickler
// writes whole storages, so a view (a parameter's shard of a flat buffer)
// would otherwise drag its whole buffer into the file.
at::Tensor Compact(const at::Tensor& t) {
  const bool compact = t.is_contiguous() && t.storage_offset() == 0 &&
                       t.storage().nbytes() == static_cast<size_t>(t.numel()) * t.element_size();
  if (compact) return t;
  if (!t.is_contiguous()) return t.contiguous();  // A copy of its own.
  if (!t.is_cpu() || t.is_conj() || t.is_neg()) return t.clone();
  // A view in host memory: a tensor whose storage is exactly its elements,
  // aliasing them (the alias keeps them alive), rather than a copy of every
  // byte only to write it once.
  return at::from_blob(
      t.data_ptr(), t.sizes(), [keep = t](void*) {}, t.options());
}

// --- Reading -----------------------------------------------------------------

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

}  // namespace

absl::StatusOr<at::ScalarType> ScalarTypeFromPython(const std::string& name) {
  static const auto* kNames = new std::map<std::string, at::ScalarType>{
      {"torch.float32", at::kFloat},
      {"torch.float", at::kFloat},
      {"torch.float64", at::kDouble},
      {"torch.double", at::kDouble},
      {"torch.float16", at::kHalf},
      {"torch.half", at::kHalf},
      {"torch.bfloat16", at::kBFloat16},
      {"torch.int64", at::kLong},
      {"torch.long", at::kLong},
      {"torch.int32", at::kInt},
      {"torch.int", at::kInt},
      {"torch.int16", at::kShort},
      {"torch.short", at::kShort},
      {"torch.int8", at::kChar},
      {"torch.uint8", at::kByte},
      {"torch.bool", at::kBool},
      {"torch.complex64", at::kComplexFloat},
      {"torch.cfloat", at::kComplexFloat},
      {"torch.complex128", at::kComplexDouble},
      {"torch.cdouble", at::kComplexDouble},
      {"torch.complex32", at::kComplexHalf},
      {"torch.chalf", at::kComplexHalf},
  };
  auto it = kNames->find(name);
  if (it != kNames->end()) return it->second;
  // The newer dtypes (float8_*, uint16/32/64) are named as libtorch names
  // them, in lower case; which exist depends on the libtorch.
  if (name.rfind("torch.", 0) == 0) {
    for (int k = 0; k < static_cast<int>(at::ScalarType::NumOptions); ++k) {
      const auto type = static_cast<at::ScalarType>(k);
      std::string lower = c10::toString(type);
      for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if ((lower.rfind("float8_", 0) == 0 || lower.rfind("uint", 0) == 0) &&
          name == "torch." + lower) {
        return type;
      }
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(name, " is not a dtype this libtorch has"));
}

namespace {

bool HasStorageClass(at::ScalarType dtype) {
  for (const auto& [name, type] : StorageClasses()) {
    if (type == dtype) return true;
  }
  return false;
}

// The torch.save-specific part of reading data.pkl: storages from the
// archive's records, tensors rebuilt over them, and the few constructors
// a state dict needs. Nothing else the pickle calls is accepted.
class TorchSaveHooks {
 public:
  TorchSaveHooks(caffe2::serialize::PyTorchStreamReader& archive, const ZipDirectory& directory)
      : archive_(archive), directory_(directory) {}

  UnpicklerHooks Hooks() {
    UnpicklerHooks hooks;
    hooks.call = [this](const std::string& global, const std::vector<PyRef>& args,
                        bool /*newobj*/) { return Reduce(global, args); };
    hooks.persistent_load = [this](const PyRef& pid) { return PersistentLoad(pid); };
    return hooks;
  }

 private:
  static absl::Status Error(const std::string& what) { return absl::InvalidArgumentError(what); }

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
    // torch.save names a dtype through its legacy Storage class, or, for
    // dtypes without one, stores bytes (UntypedStorage) and names the dtype
    // in _rebuild_tensor_v3.
    at::ScalarType dtype = at::kByte;
    if (pid->items[1]->s != "torch.storage.UntypedStorage" &&
        !StorageDtype(pid->items[1]->s, &dtype)) {
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
    FSDP_RETURN_IF_ERROR(CheckRecordSize(directory_, record, numel * element_size));
    at::DataPtr bytes;
    size_t nbytes = 0;
    std::tie(bytes, nbytes) = archive_.getRecord(record);
    if (nbytes != static_cast<size_t>(numel * element_size)) {
      return Error(absl::StrCat("storage record '", record, "' has ", nbytes, " bytes, expected ",
                                numel * element_size));
    }
    FSDP_RETURN_IF_ERROR(CheckRecordCrc(directory_, record, bytes.get(), nbytes));
    at::Tensor storage;
    if (nbytes > 0 && reinterpret_cast<uintptr_t>(bytes.get()) % element_size == 0) {
      // The record's own buffer becomes the storage: a chunk's bytes are
      // not copied once more (a DCP load reads every chunk this way).
      auto owner = std::make_shared<at::DataPtr>(std::move(bytes));
      storage = at::from_blob(
          owner->get(), {numel}, [owner](void*) {}, at::TensorOptions().dtype(dtype));
    } else {
      storage = at::empty({numel}, at::TensorOptions().dtype(dtype));
      if (nbytes > 0) std::memcpy(storage.data_ptr(), bytes.get(), nbytes);
    }
    PyRef value = MakePy(PyValue::Kind::kTensor);
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

  absl::StatusOr<PyRef> Reduce(const std::string& name, const std::vector<PyRef>& a) {
    if (name == "collections.OrderedDict") {
      if (!a.empty()) return Error("OrderedDict with constructor arguments");
      return MakePy(PyValue::Kind::kDict);
    }
    if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor" ||
        name == "torch._utils._rebuild_tensor_v3") {
      // (storage, offset, size, stride, ...); v3 adds the dtype at 6 and
      // its storage holds bytes.
      const bool v3 = name == "torch._utils._rebuild_tensor_v3";
      if (a.size() < (v3 ? 7u : 4u) || a[0]->kind != PyValue::Kind::kTensor ||
          a[1]->kind != PyValue::Kind::kInt) {
        return Error(absl::StrCat("bad arguments to ", name));
      }
      at::Tensor storage = a[0]->tensor;
      if (v3) {
        if (a[6]->kind != PyValue::Kind::kGlobal || storage.scalar_type() != at::kByte) {
          return Error(absl::StrCat("bad arguments to ", name));
        }
        FSDP_ASSIGN_OR_RETURN(at::ScalarType dtype, ScalarTypeFromPython(a[6]->s));
        const int64_t element_size = static_cast<int64_t>(c10::elementSize(dtype));
        if (storage.numel() % element_size != 0) {
          return Error(absl::StrCat("a storage of ", storage.numel(), " bytes holds no whole ",
                                    a[6]->s, " elements"));
        }
        storage = storage.view(dtype);
      }
      FSDP_ASSIGN_OR_RETURN(std::vector<int64_t> sizes, IntTuple(a[2], "tensor size"));
      FSDP_ASSIGN_OR_RETURN(std::vector<int64_t> strides, IntTuple(a[3], "tensor stride"));
      if (sizes.size() != strides.size()) return Error("tensor size and stride differ in rank");
      int64_t last = a[1]->i;  // The furthest element the view reaches.
      bool empty = false, overflow = false;
      for (size_t d = 0; d < sizes.size(); ++d) {
        if (sizes[d] < 0 || strides[d] < 0) return Error("negative tensor size or stride");
        if (sizes[d] == 0) empty = true;
        int64_t reach = 0;
        overflow = overflow || __builtin_mul_overflow(sizes[d] - 1, strides[d], &reach) ||
                   __builtin_add_overflow(last, reach, &last);
      }
      if (a[1]->i < 0 || (!empty && (overflow || last >= storage.numel()))) {
        return Error("a tensor reaches beyond its storage");
      }
      // A view with zero strides (an expanded tensor) may hold more
      // elements than its storage; materializing one is bounded, so that a
      // few bytes cannot claim terabytes.
      int64_t numel = 1;
      for (int64_t size : sizes) {
        if (__builtin_mul_overflow(numel, size, &numel)) return Error("a tensor's size overflows");
      }
      constexpr int64_t kMaxExpandedBytes = int64_t{1} << 30;
      const int64_t element_size = static_cast<int64_t>(storage.element_size());
      if (numel > storage.numel() && numel > kMaxExpandedBytes / element_size) {
        return Error(absl::StrCat("a tensor of ", numel, " elements over a storage of ",
                                  storage.numel(), " would expand beyond 1 GiB"));
      }
      PyRef value = MakePy(PyValue::Kind::kTensor);
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

  caffe2::serialize::PyTorchStreamReader& archive_;
  const ZipDirectory& directory_;
  std::unordered_map<std::string, PyRef> storages_;
};

}  // namespace

namespace {

// `value` with every tensor checked and compacted, lists made generic (the
// pickler writes a typed list through a torch.jit global that Python's
// weights_only loader refuses) and dicts and tuples rebuilt around them.
// `where` names the value in errors ("'state'.'w'.'exp_avg'").
absl::StatusOr<c10::IValue> PrepareForPickle(
    const c10::IValue& value, const std::string& where,
    std::unordered_map<const void*, at::Tensor>& compacted) {
  if (value.isTensor()) {
    const at::Tensor& tensor = value.toTensor();
    if (!tensor.defined()) {
      return absl::InvalidArgumentError(absl::StrCat(where, " is an undefined tensor"));
    }
    if (!tensor.device().is_cpu()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " is on ", tensor.device().str(), "; offload it to CPU first"));
    }
    if (!HasStorageClass(tensor.scalar_type())) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, " has dtype ", c10::toString(tensor.scalar_type()),
          ", which torch.save's format cannot name (it has no legacy Storage class); convert "
          "it to a dtype that has one (e.g. bfloat16) before saving"));
    }
    auto it = compacted.find(tensor.unsafeGetTensorImpl());
    if (it == compacted.end()) {  // Tied tensors stay tied.
      it = compacted.emplace(tensor.unsafeGetTensorImpl(), Compact(tensor.detach())).first;
    }
    return c10::IValue(it->second);
  }
  if (value.isList()) {
    c10::impl::GenericList list(c10::AnyType::get());
    const c10::List<c10::IValue> items = value.toList();
    for (size_t i = 0; i < items.size(); ++i) {
      FSDP_ASSIGN_OR_RETURN(
          c10::IValue item,
          PrepareForPickle(items.get(i), absl::StrCat(where, "[", i, "]"), compacted));
      list.push_back(std::move(item));
    }
    return c10::IValue(list);
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> items;
    for (const c10::IValue& item : value.toTupleRef().elements()) {
      FSDP_ASSIGN_OR_RETURN(
          c10::IValue prepared,
          PrepareForPickle(item, absl::StrCat(where, "[", items.size(), "]"), compacted));
      items.push_back(std::move(prepared));
    }
    return c10::IValue(c10::ivalue::Tuple::create(std::move(items)));
  }
  if (value.isGenericDict()) {
    const c10::Dict<c10::IValue, c10::IValue> dict = value.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), c10::AnyType::get());
    for (const auto& entry : dict) {
      const std::string key = entry.key().isString()
                                  ? absl::StrCat("'", entry.key().toStringRef(), "'")
                              : entry.key().isInt() ? absl::StrCat(entry.key().toInt())
                                                    : std::string("?");
      FSDP_ASSIGN_OR_RETURN(
          c10::IValue prepared,
          PrepareForPickle(entry.value(), where.empty() ? key : absl::StrCat(where, ".", key),
                           compacted));
      out.insert(entry.key(), std::move(prepared));
    }
    return c10::IValue(out);
  }
  if (value.isNone() || value.isBool() || value.isInt() || value.isDouble() || value.isString()) {
    return value;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(where, " is a ", value.tagKind(), ", which this writer does not pickle"));
}

}  // namespace

absl::Status SaveTorchStateDict(const std::string& path, const StateDict& state) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [name, tensor] : state) {
    if (dict.contains(name)) {
      return absl::InvalidArgumentError(absl::StrCat("'", name, "' appears twice"));
    }
    dict.insert(name, tensor);
  }
  return SaveTorchObject(path, dict);
}

absl::Status WriteTorchSave(const c10::IValue& object,
                            const std::function<absl::Status(const void*, size_t)>& write) {
  std::unordered_map<const void*, at::Tensor> compacted;
  FSDP_ASSIGN_OR_RETURN(const c10::IValue prepared, PrepareForPickle(object, "", compacted));
  try {
    std::vector<char> pickle;
    // Without type tags: plain dicts and lists, as Python's torch.save writes.
    torch::jit::Pickler pickler(
        [&](const char* bytes, size_t n) { pickle.insert(pickle.end(), bytes, bytes + n); },
        /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
        /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
    pickler.protocol();
    pickler.pushIValue(prepared);
    pickler.stop();
    absl::Status write_status;
    caffe2::serialize::PyTorchStreamWriter archive([&](const void* bytes, size_t n) -> size_t {
      if (write_status.ok()) write_status = write(bytes, n);
      return n;
    });
    torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(),
                                       archive);
    if (!archive.finalized()) archive.writeEndOfFile();
    return write_status;
  } catch (...) {
    return StatusFromCurrentException();
  }
}

absl::Status SaveTorchObject(const std::string& path, const c10::IValue& object) {
  FSDP_ASSIGN_OR_RETURN(AtomicFileWriter file, AtomicFileWriter::Open(path));
  FSDP_RETURN_IF_ERROR(
      WriteTorchSave(object, [&](const void* bytes, size_t n) { return file.Write(bytes, n); }));
  return file.Commit();
}

absl::StatusOr<PyRef> ReadTorchSaveObject(const std::string& path, uint64_t offset,
                                          std::optional<uint64_t> length) {
  const std::string name = length.has_value() ? absl::StrCat("bytes [", offset, ", ",
                                                             offset + *length, ") of '", path, "'")
                           : offset != 0 ? absl::StrCat("bytes [", offset, ", end) of '", path, "'")
                                         : absl::StrCat("'", path, "'");
  FSDP_ASSIGN_OR_RETURN(std::shared_ptr<ByteRange> range, ByteRange::Open(path, offset, length));
  absl::StatusOr<ZipDirectory> read_directory;
  try {
    read_directory = ReadZipDirectory(*range, name);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read ", name, " as a torch.save archive: ", e.what()));
  }
  FSDP_ASSIGN_OR_RETURN(const ZipDirectory directory, std::move(read_directory));
  const auto named = [&name](const absl::Status& status) {
    return absl::Status(status.code(), absl::StrCat(name, ": ", status.message()));
  };
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> archive;
  at::DataPtr pickle;
  size_t pickle_size = 0;
  try {
    archive = std::make_unique<caffe2::serialize::PyTorchStreamReader>(
        std::make_shared<ByteRangeAdapter>(range));
    if (!archive->hasRecord("data.pkl")) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " is not a torch.save file: the archive has no data.pkl"));
    }
    absl::Status size_ok = CheckRecordSize(directory, "data.pkl", -1);
    if (!size_ok.ok()) return named(size_ok);
    // torch.save stores the pickle uncompressed; a larger one is a pickle
    // bomb (each opcode byte can cost a value of ~160 bytes).
    if (directory.entries.at("data.pkl").size > range->size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": data.pkl claims more bytes than the file holds"));
    }
    std::tie(pickle, pickle_size) = archive->getRecord("data.pkl");
    absl::Status crc_ok = CheckRecordCrc(directory, "data.pkl", pickle.get(), pickle_size);
    if (!crc_ok.ok()) return named(crc_ok);
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read ", name, " as a torch.save archive: ", what));
  }
  try {
    TorchSaveHooks hooks(*archive, directory);
    return Unpickle(static_cast<const char*>(pickle.get()), pickle_size,
                    absl::StrCat(name, ": data.pkl"), hooks.Hooks());
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    return absl::InvalidArgumentError(absl::StrCat("cannot read ", name, ": ", what));
  }
}

absl::StatusOr<StateDict> LoadTorchStateDict(const std::string& path, const std::string& entry) {
  FSDP_ASSIGN_OR_RETURN(PyRef root, ReadTorchSaveObject(path));
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
