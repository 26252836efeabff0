#include "hf/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <utility>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "formats/atomic_file.h"
#include "hf/safetensors_internal.h"

namespace fsdp::hf {
namespace safetensors_internal {

bool NestedAtMost(absl::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) return false;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return true;
}

std::string Shown(const nlohmann::json& value) {
  if (value.is_string()) {
    const std::string& text = value.get_ref<const std::string&>();
    return absl::StrCat("\"", text.substr(0, 32), text.size() > 32 ? "..." : "", "\"");
  }
  if (value.is_number()) return value.dump();
  return absl::StrCat("a JSON ", value.type_name());
}

std::string Errno(int error) { return std::strerror(error); }

absl::Status ReadAt(int fd, void* out, uint64_t size, uint64_t offset, absl::string_view path) {
  auto* p = static_cast<char*>(out);
  while (size > 0) {
    const ssize_t n = ::pread(fd, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::DataLossError(absl::StrCat(path, ": read at byte ", offset, " failed: ",
                                              n == 0 ? "the file is shorter than its header says"
                                                     : Errno(errno)));
    }
    p += n;
    size -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace safetensors_internal

namespace {

using safetensors_internal::Errno;
using safetensors_internal::kMaxHeaderBytes;
using safetensors_internal::kMaxJsonDepth;
using safetensors_internal::NestedAtMost;
using safetensors_internal::ReadAt;
using safetensors_internal::Shown;

// std::map underneath: ordered_json's linear key search would make a
// header of many names quadratic.
using json = nlohmann::json;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors' bytes are little-endian, read and written as they are");

constexpr char kMetadataKey[] = "__metadata__";

// Every dtype the format defines in whole bytes, and libtorch's where this
// libtorch has one. The sub-byte F4/F6 types are refused by name.
struct DTypeName {
  const char* name;
  int64_t size;
  at::ScalarType dtype;
};
constexpr at::ScalarType kNone = at::ScalarType::Undefined;
constexpr std::array<DTypeName, 16> kDTypes = {{
    {"BOOL", 1, at::ScalarType::Bool},
    {"U8", 1, at::ScalarType::Byte},
    {"I8", 1, at::ScalarType::Char},
    {"F8_E5M2", 1, kNone},
    {"F8_E4M3", 1, kNone},
    {"F8_E8M0", 1, kNone},
    {"I16", 2, at::ScalarType::Short},
    {"U16", 2, kNone},
    {"F16", 2, at::ScalarType::Half},
    {"BF16", 2, at::ScalarType::BFloat16},
    {"I32", 4, at::ScalarType::Int},
    {"U32", 4, kNone},
    {"F32", 4, at::ScalarType::Float},
    {"F64", 8, at::ScalarType::Double},
    {"I64", 8, at::ScalarType::Long},
    {"U64", 8, kNone},
}};

const DTypeName* DTypeOf(const std::string& name) {
  for (const DTypeName& d : kDTypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

constexpr size_t kMaxDims = 64;

absl::Status Invalid(absl::string_view source, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": not a valid safetensors file: ", what));
}

// A non-negative integer that fits int64 (JSON numbers may be negative,
// fractional or huge; none of those is a size).
std::optional<uint64_t> Size(const json& value) {
  if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    if (v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return v;
  } else if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    return static_cast<uint64_t>(value.get<int64_t>());
  }
  return std::nullopt;
}

absl::StatusOr<SafetensorsEntry> ParseEntry(const std::string& name, const json& value,
                                            absl::string_view source) {
  const std::string where = absl::StrCat("tensor '", name.substr(0, 200), "'");
  // Fields beyond these three are ignored, as the crate ignores them.
  if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") ||
      !value.contains("data_offsets")) {
    return Invalid(source, absl::StrCat(where, " is not {dtype, shape, data_offsets}"));
  }
  SafetensorsEntry entry;
  entry.name = name;
  const json& dtype = value["dtype"];
  const DTypeName* known = dtype.is_string() ? DTypeOf(dtype.get<std::string>()) : nullptr;
  if (known == nullptr) {
    return Invalid(source, absl::StrCat(where, " has dtype ", Shown(dtype),
                                        ", not one the format defines in whole bytes"));
  }
  entry.dtype_name = known->name;
  entry.dtype = known->dtype;
  entry.element_size = known->size;
  const json& shape = value["shape"];
  if (!shape.is_array() || shape.size() > kMaxDims) {
    return Invalid(source, absl::StrCat(where, "'s shape is not a list of at most ", kMaxDims,
                                        " dimensions"));
  }
  // Both products must fit: the element count, and (libtorch's strides)
  // the product with zero dimensions counted as one.
  constexpr uint64_t kLimit = static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / 8;
  uint64_t numel = 1;
  uint64_t strided = 1;
  for (const json& dim : shape) {
    std::optional<uint64_t> d = Size(dim);
    if (!d) return Invalid(source, absl::StrCat(where, " has a dimension ", Shown(dim)));
    entry.shape.push_back(static_cast<int64_t>(*d));
    const uint64_t counted = std::max<uint64_t>(*d, 1);
    if (strided > kLimit / counted)
      return Invalid(source, absl::StrCat(where, "'s shape overflows"));
    strided *= counted;
    numel *= *d;
  }
  const json& offsets = value["data_offsets"];
  std::optional<uint64_t> begin =
      offsets.is_array() && offsets.size() == 2 ? Size(offsets[0]) : std::nullopt;
  std::optional<uint64_t> end = begin ? Size(offsets[1]) : std::nullopt;
  if (!end || *end < *begin) {
    return Invalid(source, absl::StrCat(where, " has data_offsets that are not [begin, end]"));
  }
  entry.begin = *begin;
  entry.end = *end;
  const uint64_t bytes = numel * static_cast<uint64_t>(known->size);
  if (*end - *begin != bytes) {
    return Invalid(source, absl::StrCat(where, " holds ", *end - *begin, " bytes; its shape and ",
                                        known->name, " need ", bytes));
  }
  return entry;
}

absl::StatusOr<std::map<std::string, std::string>> ParseMetadata(const json& value,
                                                                 absl::string_view source) {
  std::map<std::string, std::string> metadata;
  if (value.is_null()) return metadata;
  if (!value.is_object()) return Invalid(source, "__metadata__ is not an object");
  for (const auto& [key, v] : value.items()) {
    if (!v.is_string()) {
      return Invalid(source, absl::StrCat("__metadata__ '", key.substr(0, 200),
                                          "' is not a string"));
    }
    metadata[key] = v.get<std::string>();
  }
  return metadata;
}

// The entries must tile [0, data size) in offset order, as the crate
// requires: a hole or overlap means a corrupt or hostile file.
absl::Status CheckTiling(const std::vector<SafetensorsEntry>& entries, uint64_t data_bytes,
                         absl::string_view source) {
  uint64_t next = 0;
  for (const SafetensorsEntry& e : entries) {
    if (e.begin != next) {
      return Invalid(source, absl::StrCat("tensor '", e.name.substr(0, 200), "' starts at byte ",
                                          e.begin, " of the data where ", next, " was expected (",
                                          e.begin < next ? "an overlap" : "a hole", ")"));
    }
    next = e.end;
  }
  if (next != data_bytes) {
    return Invalid(source, absl::StrCat("the tensors cover ", next, " bytes of data but the file "
                                        "holds ", data_bytes));
  }
  return absl::OkStatus();
}

absl::Status CheckRange(absl::string_view what, int64_t lo, int64_t hi, int64_t size,
                        absl::string_view name) {
  if (lo < 0 || hi < lo || hi > size) {
    return absl::OutOfRangeError(absl::StrCat(what, " [", lo, ", ", hi, ") of tensor '", name,
                                              "' is outside [0, ", size, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<SafetensorsLayout> ParseSafetensorsHeader(absl::string_view text, uint64_t file_size,
                                                         absl::string_view source) {
  if (text.empty() || text.front() != '{')
    return Invalid(source, "the header is not a JSON object");
  if (file_size < 8 + text.size()) return Invalid(source, "the file is shorter than its header");
  if (!NestedAtMost(text, kMaxJsonDepth)) {
    return Invalid(source, "the header nests deeper than a safetensors header does");
  }
  json header = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return Invalid(source, "the header is not a JSON object");
  }
  SafetensorsLayout layout;
  layout.data_start = 8 + text.size();
  for (const auto& [name, value] : header.items()) {
    if (name == kMetadataKey) {
      FSDP_ASSIGN_OR_RETURN(layout.metadata, ParseMetadata(value, source));
      continue;
    }
    FSDP_ASSIGN_OR_RETURN(SafetensorsEntry entry, ParseEntry(name, value, source));
    layout.entries.push_back(std::move(entry));
  }
  std::stable_sort(layout.entries.begin(), layout.entries.end(),
                   [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
                     return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
                   });
  FSDP_RETURN_IF_ERROR(CheckTiling(layout.entries, file_size - layout.data_start, source));
  return layout;
}

absl::StatusOr<std::string> SafetensorsDTypeName(at::ScalarType dtype) {
  for (const DTypeName& d : kDTypes) {
    if (d.dtype == dtype && dtype != kNone) return std::string(d.name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("safetensors cannot hold dtype ", c10::toString(dtype)));
}

// ---------------------------------------------------------------------------
// Reading one file.

class SafetensorsFile::Descriptor {
 public:
  explicit Descriptor(int fd) : fd_(fd) {}
  ~Descriptor() { ::close(fd_); }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

SafetensorsFile::SafetensorsFile(std::string path, std::shared_ptr<Descriptor> fd,
                                 SafetensorsLayout layout)
    : path_(std::move(path)), fd_(std::move(fd)), layout_(std::move(layout)) {
  for (size_t i = 0; i < layout_.entries.size(); ++i) index_.emplace(layout_.entries[i].name, i);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  // O_NONBLOCK: a FIFO named in an index must not block the open (a
  // regular file ignores the flag).
  const int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (raw < 0) {
    return absl::NotFoundError(absl::StrCat("cannot open safetensors file ", path, ": ",
                                            Errno(errno)));
  }
  auto fd = std::make_shared<Descriptor>(raw);
  struct stat st {};
  if (::fstat(raw, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  const auto file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) return Invalid(path, "shorter than the 8-byte header length");
  std::array<unsigned char, 8> prefix{};
  FSDP_RETURN_IF_ERROR(ReadAt(raw, prefix.data(), 8, 0, path));
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | prefix[i];
  if (header_bytes > kMaxHeaderBytes) {
    return Invalid(path, absl::StrCat("a header of ", header_bytes, " bytes (at most ",
                                      kMaxHeaderBytes, ")"));
  }
  if (header_bytes > file_size - 8) return Invalid(path, "the file is shorter than its header");
  std::string text(header_bytes, '\0');
  FSDP_RETURN_IF_ERROR(ReadAt(raw, text.data(), header_bytes, 8, path));
  FSDP_ASSIGN_OR_RETURN(SafetensorsLayout layout, ParseSafetensorsHeader(text, file_size, path));
  return SafetensorsFile(path, std::move(fd), std::move(layout));
}

const SafetensorsEntry* SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &layout_.entries[it->second];
}

absl::StatusOr<const SafetensorsEntry*> SafetensorsFile::Require(absl::string_view name) const {
  const SafetensorsEntry* entry = Find(name);
  if (entry == nullptr) {
    return absl::NotFoundError(absl::StrCat(path_, " has no tensor '", name, "'"));
  }
  return entry;
}

absl::StatusOr<at::Tensor> SafetensorsFile::ReadBytes(const SafetensorsEntry& entry,
                                                      uint64_t byte_offset,
                                                      std::vector<int64_t> shape) const {
  if (entry.dtype == at::ScalarType::Undefined) {
    return absl::UnimplementedError(absl::StrCat("tensor '", entry.name, "' in ", path_, " is ",
                                                 entry.dtype_name,
                                                 ", a dtype this library does not read"));
  }
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(entry.dtype));
  const uint64_t bytes = static_cast<uint64_t>(out.numel()) * entry.element_size;
  FSDP_RETURN_IF_ERROR(ReadAt(fd_->get(), out.data_ptr(), bytes,
                              layout_.data_start + entry.begin + byte_offset, path_));
  return out;
}

absl::StatusOr<at::Tensor> SafetensorsFile::Read(absl::string_view name) const {
  FSDP_ASSIGN_OR_RETURN(const SafetensorsEntry* entry, Require(name));
  return ReadBytes(*entry, 0, entry->shape);
}

absl::StatusOr<at::Tensor> SafetensorsFile::ReadRows(absl::string_view name, int64_t lo,
                                                     int64_t hi) const {
  FSDP_ASSIGN_OR_RETURN(const SafetensorsEntry* entry, Require(name));
  if (entry->shape.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in ", path_,
                                                   " is a scalar: it has no rows"));
  }
  FSDP_RETURN_IF_ERROR(CheckRange("rows", lo, hi, entry->shape[0], name));
  std::vector<int64_t> shape = entry->shape;
  const int64_t row_numel = shape[0] == 0 ? 0 : entry->numel() / shape[0];
  shape[0] = hi - lo;
  return ReadBytes(*entry, static_cast<uint64_t>(lo * row_numel * entry->element_size),
                   std::move(shape));
}

absl::StatusOr<at::Tensor> SafetensorsFile::ReadFlat(absl::string_view name, int64_t lo,
                                                     int64_t hi) const {
  FSDP_ASSIGN_OR_RETURN(const SafetensorsEntry* entry, Require(name));
  FSDP_RETURN_IF_ERROR(CheckRange("elements", lo, hi, entry->numel(), name));
  return ReadBytes(*entry, static_cast<uint64_t>(lo * entry->element_size), {hi - lo});
}

absl::Status SafetensorsFile::ReadFlatInto(absl::string_view name, int64_t lo, int64_t hi,
                                           const at::Tensor& out) const {
  FSDP_ASSIGN_OR_RETURN(const SafetensorsEntry* entry, Require(name));
  FSDP_RETURN_IF_ERROR(CheckRange("elements", lo, hi, entry->numel(), name));
  if (entry->dtype == at::ScalarType::Undefined) {
    return absl::UnimplementedError(absl::StrCat("tensor '", entry->name, "' in ", path_, " is ",
                                                 entry->dtype_name,
                                                 ", a dtype this library does not read"));
  }
  if (out.dim() != 1 || out.numel() != hi - lo) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reading elements [", lo, ", ", hi, ") of tensor '", name, "' into a tensor of shape [",
        absl::StrJoin(out.sizes(), ", "), "]: it must be 1-D, of ", hi - lo, " elements"));
  }
  const uint64_t start = layout_.data_start + entry->begin;
  const auto element = static_cast<uint64_t>(entry->element_size);
  if (out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == entry->dtype) {
    return ReadAt(fd_->get(), out.data_ptr(), static_cast<uint64_t>(hi - lo) * element,
                  start + static_cast<uint64_t>(lo) * element, path_);
  }
  const int64_t chunk = std::max<int64_t>(1, static_cast<int64_t>(kReadChunkBytes / element));
  at::Tensor buffer = at::empty({std::min(chunk, hi - lo)},
                                at::TensorOptions().dtype(entry->dtype));
  for (int64_t from = lo; from < hi; from += chunk) {
    const int64_t n = std::min(chunk, hi - from);
    at::Tensor part = buffer.narrow(0, 0, n);
    FSDP_RETURN_IF_ERROR(ReadAt(fd_->get(), part.data_ptr(), static_cast<uint64_t>(n) * element,
                                start + static_cast<uint64_t>(from) * element, path_));
    out.narrow(0, from - lo, n).copy_(part);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Writing one file.

struct SafetensorsWriter::State {
  std::optional<AtomicFileWriter> file;
  std::vector<SafetensorsTensorSpec> specs;
  size_t next = 0;
  std::string path;
  bool failed = false;
};

SafetensorsWriter::SafetensorsWriter(std::unique_ptr<State> state) : state_(std::move(state)) {}
SafetensorsWriter::SafetensorsWriter(SafetensorsWriter&&) noexcept = default;
SafetensorsWriter& SafetensorsWriter::operator=(SafetensorsWriter&&) noexcept = default;
SafetensorsWriter::~SafetensorsWriter() = default;

namespace {

absl::StatusOr<std::string> HeaderFor(const std::vector<SafetensorsTensorSpec>& specs,
                                      const std::map<std::string, std::string>& metadata,
                                      absl::string_view path) {
  json header = json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::set<absl::string_view> seen;
  uint64_t offset = 0;
  for (const SafetensorsTensorSpec& spec : specs) {
    if (spec.name == kMetadataKey || !seen.insert(spec.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor name '", spec.name, "' is ",
          spec.name == kMetadataKey ? "reserved by the format" : "given twice"));
    }
    FSDP_ASSIGN_OR_RETURN(std::string dtype, SafetensorsDTypeName(spec.dtype));
    uint64_t bytes = c10::elementSize(spec.dtype);
    for (int64_t d : spec.shape) {
      if (d < 0 || (d > 0 && bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) /
                                         static_cast<uint64_t>(d))) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": tensor '", spec.name, "' has a negative or too large shape"));
      }
      bytes *= static_cast<uint64_t>(d);
    }
    header[spec.name] = {{"dtype", dtype}, {"shape", spec.shape},
                         {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  // The crate pads the header with spaces so that the data starts 8-aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

}  // namespace

absl::StatusOr<SafetensorsWriter> SafetensorsWriter::Create(
    const std::string& path, std::vector<SafetensorsTensorSpec> specs,
    const std::map<std::string, std::string>& metadata) {
  FSDP_ASSIGN_OR_RETURN(std::string text, HeaderFor(specs, metadata, path));
  FSDP_ASSIGN_OR_RETURN(AtomicFileWriter file, AtomicFileWriter::Open(path));
  std::array<unsigned char, 8> prefix{};
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<unsigned char>(text.size() >> (8 * i));
  FSDP_RETURN_IF_ERROR(file.Write(prefix.data(), prefix.size()));
  FSDP_RETURN_IF_ERROR(file.Write(text.data(), text.size()));
  auto state = std::make_unique<State>();
  state->file.emplace(std::move(file));
  state->specs = std::move(specs);
  state->path = path;
  return SafetensorsWriter(std::move(state));
}

const SafetensorsTensorSpec* SafetensorsWriter::next() const {
  return state_ != nullptr && state_->next < state_->specs.size() ? &state_->specs[state_->next]
                                                                  : nullptr;
}

bool SafetensorsWriter::failed() const { return state_ == nullptr || state_->failed; }

absl::Status SafetensorsWriter::Write(absl::string_view name, const at::Tensor& value) {
  if (failed()) {
    return absl::FailedPreconditionError(
        absl::StrCat(state_ == nullptr ? "a moved-from writer" : state_->path,
                     ": an earlier write failed; the file is incomplete"));
  }
  const SafetensorsTensorSpec* spec = next();
  if (spec == nullptr || spec->name != name) {
    return absl::FailedPreconditionError(absl::StrCat(
        state_->path, ": tensor '", name, "' written out of order; the next is ",
        spec == nullptr ? "none (all were written)" : absl::StrCat("'", spec->name, "'")));
  }
  if (value.scalar_type() != spec->dtype || value.sizes() != at::IntArrayRef(spec->shape)) {
    return absl::InvalidArgumentError(absl::StrCat(
        state_->path, ": tensor '", name, "' is ", c10::toString(value.scalar_type()), " ",
        c10::str(value.sizes()), " but was declared ", c10::toString(spec->dtype), " [",
        absl::StrJoin(spec->shape, ", "), "]"));
  }
  state_->failed = true;  // Until the bytes are all written.
  const at::Tensor bytes = value.cpu().contiguous();
  FSDP_RETURN_IF_ERROR(
      state_->file->Write(bytes.data_ptr(), static_cast<size_t>(bytes.nbytes())));
  state_->failed = false;
  ++state_->next;
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Flush() {
  if (failed()) {
    return absl::FailedPreconditionError(
        absl::StrCat(state_ == nullptr ? "a moved-from writer" : state_->path,
                     ": an earlier write failed; the file is incomplete"));
  }
  if (const SafetensorsTensorSpec* spec = next()) {
    return absl::FailedPreconditionError(absl::StrCat(
        state_->path, ": not committed: tensor '", spec->name, "' and ",
        state_->specs.size() - state_->next - 1, " after it were not written"));
  }
  return state_->file->Flush();
}

absl::Status SafetensorsWriter::Commit() {
  FSDP_RETURN_IF_ERROR(Flush());
  return state_->file->Commit();
}

}  // namespace fsdp::hf
