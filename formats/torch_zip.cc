#include "formats/torch_zip.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "formats/crc32.h"

namespace fsdp::torch_zip {
namespace {

uint64_t Le(const std::string& b, size_t at, int bytes) {
  uint64_t v = 0;
  for (int k = 0; k < bytes; ++k) v |= static_cast<uint64_t>(static_cast<uint8_t>(b[at + k])) << (8 * k);
  return v;
}

absl::Status NotAnArchive(const std::string& name, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat("cannot read ", name, " as a torch.save archive: ", what));
}

// Where the zip central directory is, as its end records say.
struct CentralDirectorySpan {
  uint64_t entries = 0;
  uint64_t size = 0;
  uint64_t offset = 0;
};

// A range without a zip end record is most often a file from before
// torch.save wrote zips: it deserves a message that says how to convert it.
absl::Status NoEndRecord(const ByteRange& in, const std::string& name) {
  // torch.save's format before PyTorch 1.6 (and with
  // _use_new_zipfile_serialization=False) is a pickle stream that starts
  // by pickling this magic number (a LONG1 opcode with 10 bytes).
  static constexpr unsigned char kLegacyMagic[] = {0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c,
                                                   0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19};
  std::string head;
  if (in.ReadExactly(0, &head, sizeof(kLegacyMagic)) &&
      std::memcmp(head.data(), kLegacyMagic, sizeof(kLegacyMagic)) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        name,
        " is in torch.save's legacy format (PyTorch before 1.6, or "
        "_use_new_zipfile_serialization=False), which is not supported: convert it in "
        "Python with torch.save(torch.load(",
        name, "), 'NEW.pt')"));
  }
  return NotAnArchive(name, "no zip end-of-central-directory record");
}

// The end-of-central-directory record (its comment may push it up to 64 KiB
// from the end) and, for a large archive, the zip64 record it points to.
absl::StatusOr<CentralDirectorySpan> FindCentralDirectory(const ByteRange& in,
                                                          const std::string& name) {
  const uint64_t size = in.size();
  const uint64_t tail_size = std::min<uint64_t>(size, 65535 + 22 + 20);
  std::string tail;
  if (!in.ReadExactly(size - tail_size, &tail, tail_size)) {
    return NotAnArchive(name, "cannot read its end");
  }
  size_t eocd = std::string::npos;
  for (size_t at = tail_size >= 22 ? tail_size - 22 + 1 : 0; at-- > 0;) {
    if (Le(tail, at, 4) == 0x06054b50) {
      eocd = at;
      break;
    }
  }
  if (eocd == std::string::npos) return NoEndRecord(in, name);
  CentralDirectorySpan span;
  span.entries = Le(tail, eocd + 10, 2);
  span.size = Le(tail, eocd + 12, 4);
  span.offset = Le(tail, eocd + 16, 4);
  if ((span.entries == 0xffff || span.offset == 0xffffffff) && eocd >= 20 &&
      Le(tail, eocd - 20, 4) == 0x07064b50) {  // Zip64 locator -> zip64 record.
    const uint64_t record = Le(tail, eocd - 20 + 8, 8);
    std::string z;
    if (!in.ReadExactly(record, &z, 56) || Le(z, 0, 4) != 0x06064b50) {
      return NotAnArchive(name, "broken zip64 end record");
    }
    span.entries = Le(z, 32, 8);
    span.size = Le(z, 40, 8);
    span.offset = Le(z, 48, 8);
  }
  if (span.offset > size || span.size > size - span.offset) {
    return NotAnArchive(name, "the zip central directory lies beyond the file");
  }
  return span;
}

// Sizes of 4 GiB and more live in the zip64 extra field, in this order;
// only the fields whose 32-bit value is saturated are there.
void ReadZip64Extra(const std::string& extra, ZipEntry& entry, uint64_t& local_header) {
  for (size_t x = 0; x + 4 <= extra.size();) {
    const uint64_t tag = Le(extra, x, 2), len = Le(extra, x + 2, 2);
    if (x + 4 + len > extra.size()) break;
    if (tag == 0x0001) {
      size_t field = x + 4;
      if (entry.size == 0xffffffff && field + 8 <= x + 4 + len) {
        entry.size = Le(extra, field, 8);
        field += 8;
      }
      if (entry.compressed_size == 0xffffffff && field + 8 <= x + 4 + len) {
        entry.compressed_size = Le(extra, field, 8);
        field += 8;
      }
      if (local_header == 0xffffffff && field + 8 <= x + 4 + len) {
        local_header = Le(extra, field, 8);
      }
    }
    x += 4 + len;
  }
}

// Reads the central directory record at `dir`[`at`] (entry number `e`) into
// `directory`, and returns the offset of the record after it.
absl::StatusOr<size_t> ReadDirectoryRecord(const ByteRange& in, const std::string& name,
                                           const std::string& dir, size_t at, uint64_t e,
                                           ZipDirectory& directory) {
  if (at + 46 > dir.size() || Le(dir, at, 4) != 0x02014b50) {
    return NotAnArchive(name, "corrupt zip directory");
  }
  ZipEntry entry;
  entry.crc = static_cast<uint32_t>(Le(dir, at + 16, 4));
  entry.compressed_size = Le(dir, at + 20, 4);
  entry.size = Le(dir, at + 24, 4);
  uint64_t local_header = Le(dir, at + 42, 4);
  const size_t name_len = Le(dir, at + 28, 2), extra_len = Le(dir, at + 30, 2),
               comment_len = Le(dir, at + 32, 2);
  if (at + 46 + name_len > dir.size()) return NotAnArchive(name, "corrupt zip directory");
  if (at + 46 + name_len + extra_len > dir.size()) {
    return NotAnArchive(name, "corrupt zip directory");
  }
  ReadZip64Extra(dir.substr(at + 46 + name_len, extra_len), entry, local_header);
  directory.has_crcs = directory.has_crcs || entry.crc != 0;
  // libtorch's reader names records by the first entry's top directory;
  // an entry elsewhere, or a name twice, would be checked against one
  // entry while another is read.
  const std::string entry_name = dir.substr(at + 46, name_len);
  const size_t slash = entry_name.find('/');
  if (slash == std::string::npos) {
    return NotAnArchive(name, absl::StrCat("entry '", entry_name, "' is in no directory"));
  }
  if (e == 0) directory.prefix = entry_name.substr(0, slash + 1);
  if (entry_name.compare(0, directory.prefix.size(), directory.prefix) != 0) {
    return NotAnArchive(name, absl::StrCat("entry '", entry_name,
                                           "' is outside the archive's directory '",
                                           directory.prefix, "'"));
  }
  if (!directory.entries.emplace(entry_name.substr(slash + 1), entry).second) {
    return NotAnArchive(name, absl::StrCat("entry '", entry_name, "' appears twice"));
  }
  // Each entry's local header must agree with the directory. libtorch
  // 1.13's reader throws from its constructor when one does not, and
  // then leaks its zip state (the fuzzer's finding), so this is checked
  // before the reader exists.
  std::string local;
  if (!in.ReadExactly(local_header, &local, 30 + name_len) || Le(local, 0, 4) != 0x04034b50 ||
      Le(local, 26, 2) != name_len || local.compare(30, name_len, entry_name) != 0) {
    return NotAnArchive(name, absl::StrCat("the local header of entry '", entry_name,
                                           "' does not match the zip directory"));
  }
  return at + 46 + name_len + extra_len + comment_len;
}

}  // namespace

absl::StatusOr<std::shared_ptr<ByteRange>> ByteRange::Open(const std::string& path,
                                                           uint64_t offset,
                                                           std::optional<uint64_t> length) {
  // Non-blocking, so that a FIFO planted where a file should be cannot
  // block the open; only regular files are read.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("cannot read '", path,
                                            "' as a torch.save archive: cannot open it (",
                                            std::strerror(errno), ")"));
  }
  auto range = std::shared_ptr<ByteRange>(new ByteRange(fd));
  struct stat st;
  if (fstat(fd, &st) != 0) return absl::InternalError(absl::StrCat("cannot stat '", path, "'"));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read '", path, "' as a torch.save archive: not a regular file"));
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  const uint64_t size = length.value_or(file_size - std::min(offset, file_size));
  if (offset > file_size || size > file_size - offset) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' has ", file_size,
                                                   " bytes, too few for bytes [", offset, ", ",
                                                   offset + size, ")"));
  }
  range->base_ = offset;
  range->size_ = size;
  return range;
}

ByteRange::~ByteRange() { ::close(fd_); }

size_t ByteRange::Read(uint64_t pos, void* out, size_t n) const {
  if (pos >= size_) return 0;
  n = static_cast<size_t>(std::min<uint64_t>(n, size_ - pos));
  size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd_, static_cast<char*>(out) + done, n - done,
                                static_cast<off_t>(base_ + pos + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    done += static_cast<size_t>(got);
  }
  return done;
}

absl::StatusOr<ZipDirectory> ReadZipDirectory(const ByteRange& in, const std::string& name) {
  FSDP_ASSIGN_OR_RETURN(const CentralDirectorySpan span, FindCentralDirectory(in, name));
  std::string dir;
  if (!in.ReadExactly(span.offset, &dir, span.size)) {
    return NotAnArchive(name, "cannot read the zip central directory");
  }
  ZipDirectory directory;
  directory.file_size = in.size();
  size_t at = 0;
  for (uint64_t e = 0; e < span.entries; ++e) {
    FSDP_ASSIGN_OR_RETURN(at, ReadDirectoryRecord(in, name, dir, at, e, directory));
  }
  return directory;
}

absl::Status CheckRecordSize(const ZipDirectory& directory, const std::string& record,
                             int64_t expected_size) {
  auto it = directory.entries.find(record);
  if (it == directory.entries.end()) {
    return absl::InvalidArgumentError(absl::StrCat("the archive has no record '", record, "'"));
  }
  const ZipEntry& entry = it->second;
  if (expected_size >= 0 && entry.size != static_cast<uint64_t>(expected_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat("record '", record, "' has ", entry.size, " bytes, expected ", expected_size));
  }
  if (entry.compressed_size > directory.file_size ||
      entry.size > 1032 * entry.compressed_size + 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "record '", record, "' claims ", entry.size, " bytes from ", entry.compressed_size,
        " stored in a file of ", directory.file_size, ": the file is corrupt"));
  }
  return absl::OkStatus();
}

absl::Status CheckRecordCrc(const ZipDirectory& directory, const std::string& record,
                            const void* bytes, size_t n) {
  if (!directory.has_crcs) return absl::OkStatus();
  auto it = directory.entries.find(record);
  if (it == directory.entries.end() || Crc32(bytes, n) != it->second.crc) {
    return absl::InvalidArgumentError(
        absl::StrCat("record '", record, "' fails its CRC-32 check: the file is corrupt"));
  }
  return absl::OkStatus();
}

}  // namespace fsdp::torch_zip
