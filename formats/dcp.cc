// Reading a DCP checkpoint's tensor data: the chunks .metadata names
// (formats/dcp_metadata_reader.cc reads and checks it), each a torch.save
// archive at a byte range of a data file, checked against the size and
// dtype the metadata gives it, and copied into the part of the flattened
// tensor a caller asks for.
#include "formats/dcp.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "formats/restricted_unpickler.h"

namespace fsdp {
namespace {

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
    const std::vector<DcpBox> boxes = DcpBoxesOfFlatRange(tensor.size, lo, hi);
    // The range is one chunk exactly (a checkpoint written at this world
    // size and layout, or a whole tensor): the chunk as read is the answer,
    // without a copy.
    for (const DcpChunk& chunk : tensor.chunks) {
      if (boxes.size() != 1 || chunk.offsets != boxes[0].offsets ||
          chunk.sizes != boxes[0].sizes) {
        continue;
      }
      FSDP_ASSIGN_OR_RETURN(at::Tensor stored, ReadChunk(dir, tensor, chunk));
      if (bytes_read != nullptr) *bytes_read += static_cast<int64_t>(chunk.location.length);
      return stored.contiguous().view({-1});
    }
    at::Tensor out = at::empty({hi - lo}, at::TensorOptions().dtype(tensor.dtype));
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
