// Internal to //formats:torch_file: the zip container of torch.save
// archives. libtorch's archive reader trusts the zip's central directory
// and checks no CRC of a stored record, so the directory is read and
// checked here first (every entry inside the archive's one top directory,
// named once, its local header agreeing), and every record is checked
// against it before it is used: its size before anything is allocated for
// it, its CRC-32 once read. The archive may be a byte range of a larger
// file (Distributed Checkpoint's data files).
#ifndef FSDP_FORMATS_TORCH_ZIP_H_
#define FSDP_FORMATS_TORCH_ZIP_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "caffe2/serialize/read_adapter_interface.h"

namespace fsdp::torch_zip {

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
  std::string prefix;  // The archive's top directory, with its '/'.
  bool has_crcs = false;
  std::unordered_map<std::string, ZipEntry> entries;
};

// Bytes [base, base + size) of an open file: a whole torch.save file, or
// one embedded in another (Distributed Checkpoint's .distcp files).
class ByteRange {
 public:
  static absl::StatusOr<std::shared_ptr<ByteRange>> Open(const std::string& path, uint64_t offset,
                                                         std::optional<uint64_t> length);
  ~ByteRange();
  ByteRange(const ByteRange&) = delete;
  ByteRange& operator=(const ByteRange&) = delete;

  uint64_t size() const { return size_; }
  // Reads up to n bytes at pos (clipped to the range); returns how many.
  size_t Read(uint64_t pos, void* out, size_t n) const;
  bool ReadExactly(uint64_t pos, std::string* out, size_t n) const {
    out->assign(n, '\0');
    return Read(pos, &(*out)[0], n) == n;
  }

 private:
  explicit ByteRange(int fd) : fd_(fd) {}
  int fd_;
  uint64_t base_ = 0;
  uint64_t size_ = 0;
};

// libtorch's archive reader over a ByteRange.
class ByteRangeAdapter : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit ByteRangeAdapter(std::shared_ptr<const ByteRange> range) : range_(std::move(range)) {}
  size_t size() const override { return static_cast<size_t>(range_->size()); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    return range_->Read(pos, buf, n);
  }

 private:
  std::shared_ptr<const ByteRange> range_;
};

// The central directory of the archive in `in`, checked as above. `name`
// says what the range is in errors ("'x.pt'").
absl::StatusOr<ZipDirectory> ReadZipDirectory(const ByteRange& in, const std::string& name);

// Checks a record's directory entry before anything is allocated for it:
// it exists, holds `expected_size` bytes when that is known (>= 0), and
// claims no more than the file could hold (deflate expands at most 1032x).
absl::Status CheckRecordSize(const ZipDirectory& directory, const std::string& record,
                             int64_t expected_size);

// `bytes` (n of them) are the record's as the directory's CRC-32 says,
// unless the archive was written without CRCs.
absl::Status CheckRecordCrc(const ZipDirectory& directory, const std::string& record,
                            const void* bytes, size_t n);

}  // namespace fsdp::torch_zip

#endif  // FSDP_FORMATS_TORCH_ZIP_H_
