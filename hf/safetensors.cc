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

namespace fsdp::hf {
namespace {

// std::map underneath: ordered_json's linear key search would make a
// header of many names quadratic.
using json = nlohmann::json;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors' bytes are little-endian, read and written as they are");

// The safetensors crate's limit; a longer header is refused before reading.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
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

// JSON nesting beyond a header's (object, entry, shape) is refused before
// parsing: messages and the parsed value then stay small.
constexpr int kMaxJsonDepth = 3;
constexpr size_t kMaxDims = 64;

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

// A value the file controls, short, for a message.
std::string Shown(const json& value) {
  if (value.is_string()) {
    const std::string& text = value.get_ref<const std::string&>();
    return absl::StrCat("\"", text.substr(0, 32), text.size() > 32 ? "..." : "", "\"");
  }
  if (value.is_number()) return value.dump();
  return absl::StrCat("a JSON ", value.type_name());
}

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
    if (strided > kLimit / counted) return Invalid(source, absl::StrCat(where, "'s shape overflows"));
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

absl::StatusOr<SafetensorsLayout> ParseSafetensorsHeader(absl::string_view text,
                                                         uint64_t file_size,
                                                         absl::string_view source) {
  if (text.empty() || text.front() != '{') return Invalid(source, "the header is not a JSON object");
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

// ---------------------------------------------------------------------------
// Checkpoint directories.

namespace {

std::string IndexName(const std::string& stem) { return stem + ".safetensors.index.json"; }

std::string ShardName(const std::string& stem, size_t k, size_t n) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "-%05zu-of-%05zu.safetensors", k, n);
  return stem + buffer;
}

int64_t BytesOf(const SafetensorsTensorSpec& spec) {
  int64_t bytes = static_cast<int64_t>(c10::elementSize(spec.dtype));
  for (int64_t d : spec.shape) bytes *= d;
  return bytes;
}

// A weight_map file name must be a file of the directory, not a path.
bool PlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

// An index: small, and bounded as a header is.
absl::StatusOr<std::string> ReadIndexText(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", Errno(errno)));
  struct stat st {};
  std::string bytes;
  absl::Status status;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    status = absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  } else if (static_cast<uint64_t>(st.st_size) > kMaxHeaderBytes) {
    status = absl::InvalidArgumentError(
        absl::StrCat(path, " is over ", kMaxHeaderBytes, " bytes: not an index"));
  } else {
    bytes.resize(static_cast<size_t>(st.st_size));
    status = ReadAt(fd, bytes.data(), bytes.size(), 0, path);
  }
  ::close(fd);
  if (!status.ok()) return status;
  return bytes;
}

// The index's weight_map: tensor name -> file name.
absl::StatusOr<std::map<std::string, std::string>> ReadIndex(const std::string& path) {
  FSDP_ASSIGN_OR_RETURN(std::string text, ReadIndexText(path));
  // An index nests as deep as {"metadata": {..}, "weight_map": {..}}, and
  // newer writers' metadata one level more.
  const json index = NestedAtMost(text, kMaxJsonDepth)
                         ? json::parse(text, nullptr, /*allow_exceptions=*/false)
                         : json(json::value_t::discarded);
  if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
      !index["weight_map"].is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a safetensors index (a JSON object with a weight_map)"));
  }
  std::map<std::string, std::string> weight_map;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string() || !PlainFileName(file.get<std::string>())) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", name.substr(0, 200),
                                                     "' maps to ", Shown(file),
                                                     ", not a file name"));
    }
    weight_map[name] = file.get<std::string>();
  }
  return weight_map;
}

}  // namespace

SafetensorsShardPlan PlanSafetensorsShards(const std::vector<SafetensorsTensorSpec>& specs,
                                           int64_t max_file_bytes, const std::string& stem) {
  SafetensorsShardPlan plan;
  int64_t current = 0;
  for (const SafetensorsTensorSpec& spec : specs) {
    const int64_t bytes = BytesOf(spec);
    if (plan.files.empty() || (current > 0 && current + bytes > max_file_bytes)) {
      plan.files.emplace_back();
      current = 0;
    }
    plan.files.back().push_back(spec);
    current += bytes;
  }
  if (plan.files.empty()) plan.files.emplace_back();
  const size_t n = plan.files.size();
  for (size_t k = 1; k <= n; ++k) {
    plan.file_names.push_back(n == 1 ? stem + ".safetensors" : ShardName(stem, k, n));
  }
  return plan;
}

absl::StatusOr<SafetensorsCheckpoint> SafetensorsCheckpoint::Open(const std::string& directory,
                                                                  const std::string& stem) {
  namespace fs = std::filesystem;
  const std::string index_path = (fs::path(directory) / IndexName(stem)).string();
  const std::string single_path = (fs::path(directory) / (stem + ".safetensors")).string();
  SafetensorsCheckpoint checkpoint;
  checkpoint.directory_ = directory;
  std::error_code error;
  if (!fs::exists(index_path, error)) {
    if (!fs::exists(single_path, error)) {
      return absl::NotFoundError(absl::StrCat(directory, " holds neither ", IndexName(stem),
                                              " nor ", stem, ".safetensors"));
    }
    FSDP_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(single_path));
    for (const SafetensorsEntry& e : file.entries()) checkpoint.file_of_.emplace(e.name, 0);
    checkpoint.files_.push_back(std::move(file));
    return checkpoint;
  }
  FSDP_ASSIGN_OR_RETURN(auto weight_map, ReadIndex(index_path));
  std::map<std::string, size_t> opened;
  for (const auto& [name, file_name] : weight_map) {
    auto [it, inserted] = opened.emplace(file_name, checkpoint.files_.size());
    if (inserted) {
      FSDP_ASSIGN_OR_RETURN(SafetensorsFile file,
                            SafetensorsFile::Open((fs::path(directory) / file_name).string()));
      checkpoint.files_.push_back(std::move(file));
    }
    if (checkpoint.files_[it->second].Find(name) == nullptr) {
      return absl::DataLossError(absl::StrCat(index_path, " puts tensor '", name, "' in ",
                                              file_name, ", which has no such tensor"));
    }
    checkpoint.file_of_.emplace(name, it->second);
  }
  return checkpoint;
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> names;
  names.reserve(file_of_.size());
  for (const auto& [name, file] : file_of_) names.push_back(name);
  return names;
}

const SafetensorsFile* SafetensorsCheckpoint::FileOf(absl::string_view name) const {
  auto it = file_of_.find(name);
  return it == file_of_.end() ? nullptr : &files_[it->second];
}

const SafetensorsEntry* SafetensorsCheckpoint::Find(absl::string_view name) const {
  const SafetensorsFile* file = FileOf(name);
  return file == nullptr ? nullptr : file->Find(name);
}

absl::StatusOr<const SafetensorsFile*> SafetensorsCheckpoint::Require(absl::string_view name) const {
  const SafetensorsFile* file = FileOf(name);
  if (file == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("the checkpoint in ", directory_, " has no tensor '", name, "'"));
  }
  return file;
}

absl::StatusOr<at::Tensor> SafetensorsCheckpoint::Read(absl::string_view name) const {
  FSDP_ASSIGN_OR_RETURN(const SafetensorsFile* file, Require(name));
  return file->Read(name);
}

absl::StatusOr<at::Tensor> SafetensorsCheckpoint::ReadRows(absl::string_view name, int64_t lo,
                                                           int64_t hi) const {
  FSDP_ASSIGN_OR_RETURN(const SafetensorsFile* file, Require(name));
  return file->ReadRows(name, lo, hi);
}

absl::StatusOr<at::Tensor> SafetensorsCheckpoint::ReadFlat(absl::string_view name, int64_t lo,
                                                           int64_t hi) const {
  FSDP_ASSIGN_OR_RETURN(const SafetensorsFile* file, Require(name));
  return file->ReadFlat(name, lo, hi);
}

absl::Status SafetensorsCheckpoint::ReadFlatInto(absl::string_view name, int64_t lo, int64_t hi,
                                                 const at::Tensor& out) const {
  FSDP_ASSIGN_OR_RETURN(const SafetensorsFile* file, Require(name));
  return file->ReadFlatInto(name, lo, hi, out);
}

absl::StatusOr<SafetensorsCheckpointWriter> SafetensorsCheckpointWriter::Create(
    const std::string& directory, const std::vector<SafetensorsTensorSpec>& specs,
    int64_t max_file_bytes, const std::map<std::string, std::string>& metadata,
    const std::string& stem) {
  namespace fs = std::filesystem;
  if (max_file_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_file_bytes must be positive, not ", max_file_bytes));
  }
  std::error_code error;
  fs::create_directories(directory, error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("cannot create directory ", directory, ": ", error.message()));
  }
  SafetensorsCheckpointWriter writer;
  writer.directory_ = directory;
  writer.stem_ = stem;
  writer.plan_ = PlanSafetensorsShards(specs, max_file_bytes, stem);
  for (const SafetensorsTensorSpec& spec : specs) writer.total_bytes_ += BytesOf(spec);
  for (size_t k = 0; k < writer.plan_.files.size(); ++k) {
    FSDP_ASSIGN_OR_RETURN(
        SafetensorsWriter file,
        SafetensorsWriter::Create((fs::path(directory) / writer.plan_.file_names[k]).string(),
                                  writer.plan_.files[k], metadata));
    writer.writers_.push_back(std::move(file));
  }
  return writer;
}

absl::Status SafetensorsCheckpointWriter::Write(absl::string_view name, const at::Tensor& value) {
  while (current_ < writers_.size() && writers_[current_].next() == nullptr) ++current_;
  if (current_ == writers_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        directory_, ": tensor '", name, "' written after every declared tensor was"));
  }
  return writers_[current_].Write(name, value);
}

namespace {

// The names an export under `stem` writes: <stem>.safetensors, its index,
// and <stem>-NNNNN-of-NNNNN.safetensors.
bool ExportFileName(const std::string& name, const std::string& stem) {
  if (name == stem + ".safetensors" || name == IndexName(stem)) return true;
  const std::string suffix = ".safetensors";
  const size_t digits = stem.size() + 1;  // After "<stem>-".
  if (name.size() != digits + 5 + 4 + 5 + suffix.size() || name.rfind(stem + "-", 0) != 0 ||
      name.compare(digits + 5, 4, "-of-") != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  for (size_t i : {digits, digits + 9}) {
    for (size_t j = i; j < i + 5; ++j) {
      if (name[j] < '0' || name[j] > '9') return false;
    }
  }
  return true;
}

}  // namespace

absl::Status SafetensorsCheckpointWriter::Commit() {
  namespace fs = std::filesystem;
  // Everything on disk before anything of the earlier export goes.
  for (SafetensorsWriter& writer : writers_) FSDP_RETURN_IF_ERROR(writer.Flush());
  // The old index goes next: new files may reuse old shard names, and an
  // old index over a half-renamed set would combine two exports.
  const std::string index_path = (fs::path(directory_) / IndexName(stem_)).string();
  std::error_code error;
  if (!fs::remove(index_path, error) && error) {
    return absl::UnavailableError(
        absl::StrCat("cannot remove the earlier ", index_path, ": ", error.message()));
  }
  for (SafetensorsWriter& writer : writers_) FSDP_RETURN_IF_ERROR(writer.Commit());
  std::set<std::string> keep(plan_.file_names.begin(), plan_.file_names.end());
  if (plan_.files.size() > 1) {
    std::map<std::string, std::string> weight_map;
    for (size_t k = 0; k < plan_.files.size(); ++k) {
      for (const SafetensorsTensorSpec& spec : plan_.files[k]) {
        weight_map[spec.name] = plan_.file_names[k];
      }
    }
    const json index = {{"metadata", {{"total_size", total_bytes_}}},
                        {"weight_map", weight_map}};
    const std::string text = index.dump(2) + "\n";
    FSDP_RETURN_IF_ERROR(WriteFileAtomically(index_path, text.data(), text.size()));
    keep.insert(IndexName(stem_));
  }
  // Files of an earlier export under the same stem would be read with ours;
  // the new set is complete, so they go.
  std::vector<std::string> stale;
  for (fs::directory_iterator it(directory_, error), end; !error && it != end;
       it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (ExportFileName(name, stem_) && keep.count(name) == 0) stale.push_back(name);
  }
  for (const std::string& name : stale) {
    if (!fs::remove(fs::path(directory_) / name, error) && error) break;
  }
  if (error) {
    return absl::UnavailableError(absl::StrCat(
        "the export to ", directory_, " is complete, but files of an earlier export could not be "
        "listed or removed: ", error.message()));
  }
  return absl::OkStatus();
}

}  // namespace fsdp::hf
