#include "statedict/sharded_checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "formats/atomic_file.h"
#include "formats/checkpoint_manifest.pb.h"
#include "formats/crc32.h"
#include "fsdp/shard_placement.h"
#include "statedict/load_check.h"
#include "statedict/model_tensors.h"

namespace fsdp {
namespace {

using statedict_internal::NamedTensors;

constexpr char kFormat[] = "fsdp_cpp.sharded.v1";
constexpr char kManifest[] = "manifest.pb";
constexpr char kMagic[8] = {'F', 'S', 'D', 'P', 'S', 'H', 'D', '1'};
// manifest.pb: this, the CRC-32 of the rest (little-endian), the message.
constexpr char kManifestMagic[8] = {'F', 'S', 'D', 'P', 'M', 'N', 'F', '1'};
constexpr size_t kManifestHeaderBytes = 12;
constexpr int64_t kHeaderBytes = 32;
constexpr int64_t kChunkBytes = 1 << 20;
// The largest chunk a manifest may record; bounds the arithmetic on chunk
// indices (and what one read may ask for).
constexpr int64_t kMaxChunkBytes = int64_t{1} << 30;

std::string ShardFileName(int rank, int world, uint64_t id) {
  return absl::StrFormat("shard-%d-of-%d-%016x.bin", rank, world, id);
}

std::string Header(uint64_t id, int rank, int world) {
  std::string header(kHeaderBytes, '\0');
  std::memcpy(&header[0], kMagic, 8);
  std::memcpy(&header[8], &id, 8);
  const int64_t r = rank, w = world;
  std::memcpy(&header[16], &r, 8);
  std::memcpy(&header[24], &w, 8);
  return header;
}

// A checkpoint id's two 32-bit halves, from the random device or, where it
// fails (no entropy source), the clock and the process.
at::Tensor RandomIdHalves() {
  uint64_t id = 0;
  try {
    std::random_device random;
    id = static_cast<uint64_t>(random()) << 32 | random();
  } catch (const std::exception&) {
    id = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
         (static_cast<uint64_t>(getpid()) << 40);
  }
  at::Tensor halves = at::empty({2}, at::kDouble);
  halves[0] = static_cast<double>(id >> 32);
  halves[1] = static_cast<double>(id & 0xffffffffu);
  return halves;
}

// Which ranks report failure; every rank must call.
std::vector<int> FailedRanks(Collectives& group, bool failed) {
  at::Tensor all = at::empty({group.world_size()}, at::kDouble);
  group.AllGatherIntoTensor(all, at::full({1}, failed ? 1.0 : 0.0, at::kDouble))->Wait();
  std::vector<int> ranks;
  for (int r = 0; r < group.world_size(); ++r) {
    if (all[r].item<double>() != 0) ranks.push_back(r);
  }
  return ranks;
}

// Writes this rank's shard file and describes it.
absl::Status WriteShardFile(const std::string& dir, uint64_t id, int rank, int world,
                            const std::vector<CheckpointTensor>& tensors,
                            checkpoint::RankReport& report) {
  const std::string name = ShardFileName(rank, world, id);
  FSDP_ASSIGN_OR_RETURN(AtomicFileWriter file, AtomicFileWriter::Open(dir + "/" + name));
  const std::string header = Header(id, rank, world);
  FSDP_RETURN_IF_ERROR(file.Write(header.data(), header.size()));
  for (const CheckpointTensor& t : tensors) {
    // Replicated tensors are written once, by rank 0.
    if (!t.sharded && rank != 0) continue;
    if (t.hi <= t.lo) continue;
    const at::Tensor data = t.local.contiguous().cpu();
    checkpoint::TensorEntry* entry = report.add_tensors();
    entry->set_fqn(t.fqn);
    checkpoint::Piece* piece = entry->add_pieces();
    piece->set_rank(rank);
    piece->set_offset(t.lo);
    piece->set_numel(t.hi - t.lo);
    piece->set_file_offset(file.bytes_written());
    const char* bytes = static_cast<const char*>(data.data_ptr());
    const int64_t nbytes = static_cast<int64_t>(data.nbytes());
    // A chunk at a time, so that the write copies what the CRC just read.
    for (int64_t at = 0; at < nbytes; at += kChunkBytes) {
      const int64_t n = std::min(kChunkBytes, nbytes - at);
      piece->add_chunk_crc32(Crc32(bytes + at, n));
      FSDP_RETURN_IF_ERROR(file.Write(bytes + at, n));
    }
  }
  report.mutable_file()->set_rank(rank);
  report.mutable_file()->set_name(name);
  report.mutable_file()->set_size_bytes(file.bytes_written());
  return file.Commit();
}

// Removes shard files of earlier checkpoints once a new manifest is in place.
void RemoveStaleShardFiles(const std::string& dir, const checkpoint::CheckpointManifest& manifest) {
  std::set<std::string> current;
  for (const auto& f : manifest.files()) current.insert(f.name());
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (absl::StartsWith(name, "shard-") && absl::EndsWith(name, ".bin") &&
        current.count(name) == 0) {
      unlink((dir + "/" + name).c_str());
    }
  }
  closedir(d);
}

std::string ManifestFileBytes(const checkpoint::CheckpointManifest& manifest) {
  const std::string message = manifest.SerializeAsString();
  const uint32_t crc = Crc32(message.data(), message.size());
  std::string bytes(kManifestMagic, sizeof(kManifestMagic));
  for (int k = 0; k < 4; ++k) bytes.push_back(static_cast<char>((crc >> (8 * k)) & 0xff));
  return bytes + message;
}

absl::StatusOr<checkpoint::CheckpointManifest> ReadManifest(const std::string& dir) {
  const std::string path = dir + "/" + kManifest;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (errno != ENOENT) {
      return absl::DataLossError(
          absl::StrCat("cannot read '", path, "': ", std::strerror(errno)));
    }
    return absl::NotFoundError(absl::StrCat("no SHARDED checkpoint in '", dir, "': ", kManifest,
                                            " is missing (an interrupted save writes none)"));
  }
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  checkpoint::CheckpointManifest manifest;
  const bool checksummed = bytes.size() >= kManifestHeaderBytes &&
                           bytes.compare(0, sizeof(kManifestMagic), kManifestMagic,
                                         sizeof(kManifestMagic)) == 0;
  if (checksummed) {
    uint32_t recorded = 0;
    for (int k = 0; k < 4; ++k) {
      recorded |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[8 + k])) << (8 * k);
    }
    const char* message = bytes.data() + kManifestHeaderBytes;
    const size_t size = bytes.size() - kManifestHeaderBytes;
    if (Crc32(message, size) != recorded) {
      return absl::DataLossError(absl::StrCat("the manifest '", path,
                                              "' is corrupt: it fails its CRC-32 check"));
    }
    if (!manifest.ParseFromArray(message, static_cast<int>(size)) ||
        manifest.format() != kFormat) {
      return absl::DataLossError(absl::StrCat("the manifest '", path, "' passes its CRC-32 "
                                              "check but is not a ", kFormat, " manifest"));
    }
  } else if (!manifest.ParseFromString(bytes) || manifest.format() != kFormat) {
    // Neither checksummed nor a manifest from before checksums existed.
    return absl::DataLossError(absl::StrCat("the manifest '", path, "' is corrupt: it is not a ",
                                            kFormat, " manifest"));
  }
  if (manifest.chunk_bytes() <= 0 || manifest.chunk_bytes() > kMaxChunkBytes ||
      manifest.world_size() <= 0) {
    return absl::DataLossError(absl::StrCat("the manifest '", path, "' is corrupt"));
  }
  for (const auto& f : manifest.files()) {
    // A file of the checkpoint directory, by name: never a path elsewhere.
    if (f.name().empty() || f.name().find('/') != std::string::npos ||
        f.name().find('\0') != std::string::npos || f.name() == "." || f.name() == "..") {
      return absl::DataLossError(
          absl::StrCat("the manifest '", path, "' is corrupt: the shard file of rank ", f.rank(),
                       " is not a file name inside the checkpoint directory"));
    }
  }
  return manifest;
}

// A shard file opened for reading, checked against the manifest.
class ShardReader {
 public:
  ~ShardReader() {
    if (fd_ >= 0) close(fd_);
  }
  static absl::StatusOr<std::unique_ptr<ShardReader>> Open(
      const std::string& dir, const checkpoint::ShardFile& file, uint64_t id, int world) {
    auto reader = std::unique_ptr<ShardReader>(new ShardReader());
    reader->path_ = dir + "/" + file.name();
    // O_NONBLOCK: a FIFO in the file's place must not block the open.
    reader->fd_ = open(reader->path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (reader->fd_ < 0) {
      return absl::NotFoundError(absl::StrCat("shard file '", reader->path_,
                                              "' cannot be opened: ", std::strerror(errno)));
    }
    struct stat st;
    if (fstat(reader->fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      return absl::DataLossError(
          absl::StrCat("shard file '", reader->path_, "' is not a regular file"));
    }
    if (st.st_size != file.size_bytes()) {
      return absl::DataLossError(absl::StrCat("shard file '", reader->path_, "' has ",
                                              static_cast<int64_t>(st.st_size),
                                              " bytes, the manifest records ", file.size_bytes(),
                                              " (truncated or replaced)"));
    }
    reader->size_ = st.st_size;
    std::string header(kHeaderBytes, '\0');
    FSDP_RETURN_IF_ERROR(reader->Read(0, kHeaderBytes, &header[0]));
    if (header != Header(id, file.rank(), world)) {
      return absl::DataLossError(absl::StrCat(
          "shard file '", reader->path_, "' does not belong to this checkpoint (its header "
          "names another checkpoint, rank or world size)"));
    }
    return reader;
  }
  absl::Status Read(int64_t offset, int64_t size, char* out) {
    while (size > 0) {
      const ssize_t n = pread(fd_, out, size, offset);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        return absl::DataLossError(absl::StrCat("cannot read ", size, " bytes at ", offset,
                                                " of '", path_, "'"));
      }
      out += n;
      offset += n;
      size -= n;
      bytes_read_ += n;
    }
    return absl::OkStatus();
  }
  const std::string& path() const { return path_; }
  int64_t size() const { return size_; }
  int64_t bytes_read() const { return bytes_read_; }

 private:
  ShardReader() = default;
  std::string path_;
  int64_t size_ = 0;
  int fd_ = -1;
  int64_t bytes_read_ = 0;
};

// The manifest's entry for each of the model's tensors, once the manifest
// is checked against them.
absl::StatusOr<std::vector<const checkpoint::TensorEntry*>> MatchManifest(
    const std::string& dir, const checkpoint::CheckpointManifest& manifest,
    const std::vector<CheckpointTensor>& tensors,
    const std::vector<std::string>& ignore_prefixes) {
  std::unordered_map<std::string, const checkpoint::TensorEntry*> by_name;
  for (const auto& entry : manifest.tensors()) {
    by_name[entry.fqn()] = &entry;
    for (const auto& alias : entry.aliases()) by_name[alias] = &entry;
  }
  LoadCheck check;
  std::set<const checkpoint::TensorEntry*> used;
  std::vector<const checkpoint::TensorEntry*> entries(tensors.size(), nullptr);
  for (size_t k = 0; k < tensors.size(); ++k) {
    const CheckpointTensor& t = tensors[k];
    auto it = by_name.find(t.fqn);
    if (it == by_name.end()) {
      check.Missing(t.fqn);
      continue;
    }
    const checkpoint::TensorEntry& e = *it->second;
    used.insert(&e);
    const std::string subject = LoadCheck::Quoted(t.fqn);
    const std::vector<int64_t> shape(e.shape().begin(), e.shape().end());
    if (!check.ShapeMatches(subject, shape, t.shape) ||
        !check.DtypeMatches(subject, e.dtype(), c10::toString(t.dtype))) {
      continue;
    }
    // The pieces must tile [0, numel) (checked without overflow: a piece
    // may claim any length).
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (const auto& p : e.pieces()) spans.emplace_back(p.offset(), p.numel());
    std::sort(spans.begin(), spans.end());
    int64_t covered = 0;
    bool tiles = true;
    for (const auto& [offset, length] : spans) {
      tiles = offset == covered && length > 0 && length <= numel - covered;
      if (!tiles) break;
      covered = offset + length;
    }
    if (!tiles || covered != numel) {
      check.Problem(absl::StrCat("the manifest's pieces of ", subject, " do not cover its ", numel,
                                 " elements exactly"));
      continue;
    }
    entries[k] = &e;
  }
  for (const auto& entry : manifest.tensors()) {
    bool ignored = false;
    for (const std::string& prefix : ignore_prefixes) {
      ignored = ignored || absl::StartsWith(entry.fqn(), prefix);
    }
    if (used.count(&entry) == 0 && !ignored) check.NotInModel(entry.fqn());
  }
  FSDP_RETURN_IF_ERROR(
      check.ToStatus(absl::StrCat("the checkpoint in '", dir, "' does not fit this model")));
  return entries;
}

// Checks the manifest against the model and reads what this rank needs into
// `staging` (one tensor per model tensor, elements [lo, hi)).
absl::Status ReadLocalState(const std::string& dir, const checkpoint::CheckpointManifest& manifest,
                            const std::vector<CheckpointTensor>& tensors,
                            const std::vector<std::string>& ignore_prefixes,
                            std::vector<at::Tensor>& staging, ShardedLoadStats& stats) {
  FSDP_ASSIGN_OR_RETURN(const std::vector<const checkpoint::TensorEntry*> entries,
                        MatchManifest(dir, manifest, tensors, ignore_prefixes));
  std::map<int, const checkpoint::ShardFile*> files;
  for (const auto& f : manifest.files()) files[f.rank()] = &f;
  std::map<int, std::unique_ptr<ShardReader>> readers;
  auto reader_for = [&](int rank) -> absl::StatusOr<ShardReader*> {
    auto open = readers.find(rank);
    if (open != readers.end()) return open->second.get();
    auto file = files.find(rank);
    if (file == files.end()) {
      return absl::DataLossError(absl::StrCat("the manifest lists no shard file of rank ", rank));
    }
    FSDP_ASSIGN_OR_RETURN(auto reader, ShardReader::Open(dir, *file->second,
                                                         manifest.checkpoint_id(),
                                                         manifest.world_size()));
    return (readers[rank] = std::move(reader)).get();
  };

  const int64_t chunk = manifest.chunk_bytes();
  std::string buffer;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const CheckpointTensor& t = tensors[k];
    staging[k] = at::empty({t.hi - t.lo}, at::TensorOptions().dtype(t.dtype));
    const int64_t item = staging[k].element_size();
    stats.bytes_needed += (t.hi - t.lo) * item;
    char* out = static_cast<char*>(staging[k].data_ptr());
    for (const auto& p : entries[k]->pieces()) {
      const int64_t lo = std::max(t.lo, p.offset()), hi = std::min(t.hi, p.offset() + p.numel());
      if (lo >= hi) continue;
      FSDP_ASSIGN_OR_RETURN(ShardReader * reader, reader_for(p.rank()));
      // The piece must lie in its file, after the header (which also bounds
      // the arithmetic below).
      const int64_t piece_bytes = p.numel() * item;
      if (p.file_offset() < kHeaderBytes || piece_bytes > reader->size() - p.file_offset()) {
        return absl::DataLossError(
            absl::StrCat("the manifest places rank ", p.rank(), "'s piece of '", t.fqn, "' (",
                         piece_bytes, " bytes at ", p.file_offset(), ") outside its shard file '",
                         reader->path(), "' (", reader->size(), " bytes)"));
      }
      // The whole chunks that hold [lo, hi) of this piece, each verified.
      const int64_t first = (lo - p.offset()) * item / chunk;
      const int64_t last = ((hi - p.offset()) * item + chunk - 1) / chunk;
      if (last > p.chunk_crc32_size()) {
        return absl::DataLossError(absl::StrCat("the manifest's checksums of '", t.fqn,
                                                "' are incomplete"));
      }
      const int64_t begin = first * chunk, end = std::min(last * chunk, piece_bytes);
      buffer.resize(end - begin);
      FSDP_RETURN_IF_ERROR(reader->Read(p.file_offset() + begin, end - begin, &buffer[0]));
      for (int64_t c = first; c < last; ++c) {
        const int64_t at = c * chunk - begin;
        const int64_t n = std::min(chunk, end - c * chunk);
        if (Crc32(buffer.data() + at, n) != p.chunk_crc32(c)) {
          return absl::DataLossError(absl::StrCat(
              "shard file '", reader->path(), "' is corrupt: chunk ", c, " of '", t.fqn,
              "' (rank ", p.rank(), "'s piece) fails its CRC-32 check"));
        }
      }
      std::memcpy(out + (lo - t.lo) * item,
                  buffer.data() + (lo - p.offset()) * item - begin, (hi - lo) * item);
    }
  }
  for (const auto& [rank, reader] : readers) stats.bytes_read += reader->bytes_read();
  return absl::OkStatus();
}

// Rank 0: the manifest of checkpoint `id` from every rank's report, written
// last, so that a checkpoint with a manifest is complete.
absl::Status WriteManifest(const std::string& dir, uint64_t id, int world,
                           const std::vector<CheckpointTensor>& tensors,
                           const CheckpointMetadata& metadata,
                           const std::vector<std::string>& reports) {
  checkpoint::CheckpointManifest manifest;
  manifest.set_format(kFormat);
  manifest.set_checkpoint_id(id);
  manifest.set_world_size(world);
  manifest.set_chunk_bytes(kChunkBytes);
  manifest.mutable_metadata()->insert(metadata.begin(), metadata.end());
  std::unordered_map<std::string, checkpoint::TensorEntry*> by_name;
  for (const CheckpointTensor& t : tensors) {
    checkpoint::TensorEntry* entry = manifest.add_tensors();
    entry->set_fqn(t.fqn);
    for (const auto& alias : t.aliases) entry->add_aliases(alias);
    for (int64_t d : t.shape) entry->add_shape(d);
    entry->set_dtype(c10::toString(t.dtype));
    by_name[t.fqn] = entry;
  }
  std::vector<std::string> errors;
  for (int r = 0; r < world; ++r) {
    checkpoint::RankReport theirs;
    if (!theirs.ParseFromString(reports[r])) {
      errors.push_back(absl::StrCat("rank ", r, " sent an unreadable report"));
      continue;
    }
    if (!theirs.error().empty()) {
      errors.push_back(absl::StrCat("rank ", r, ": ", theirs.error()));
      continue;
    }
    *manifest.add_files() = theirs.file();
    for (const auto& t : theirs.tensors()) {
      auto it = by_name.find(t.fqn());
      if (it == by_name.end()) {
        errors.push_back(absl::StrCat("rank ", r, " wrote '", t.fqn(),
                                      "', which rank 0's model does not have"));
        continue;
      }
      for (const auto& p : t.pieces()) *it->second->add_pieces() = p;
    }
  }
  if (!errors.empty()) return absl::InternalError(absl::StrJoin(errors, "; "));
  const std::string bytes = ManifestFileBytes(manifest);
  FSDP_RETURN_IF_ERROR(WriteFileAtomically(dir + "/" + kManifest, bytes.data(), bytes.size()));
  RemoveStaleShardFiles(dir, manifest);
  return absl::OkStatus();
}

}  // namespace

std::vector<CheckpointTensor> ModelCheckpointTensors(const FullyShardedModel& model) {
  const ShardPlacements placements = ShardPlacementsOf(model);
  std::vector<CheckpointTensor> out;
  std::unordered_map<const void*, size_t> seen;
  for (const auto& [name, tensor] : NamedTensors(model.units().front()->module())) {
    auto it = seen.find(tensor.unsafeGetTensorImpl());
    if (it != seen.end()) {
      out[it->second].aliases.push_back(name);
      continue;
    }
    seen.emplace(tensor.unsafeGetTensorImpl(), out.size());
    const ShardPlacement p = PlacementOf(placements, tensor);
    CheckpointTensor t;
    t.fqn = name;
    t.dtype = tensor.scalar_type();
    t.shape = p.full_shape;
    t.sharded = p.sharded;
    t.lo = p.lo;
    t.hi = p.hi;
    t.local = p.local;
    t.in_place = p.in_place;
    out.push_back(std::move(t));
  }
  return out;
}

absl::Status SaveShardedCheckpoint(FullyShardedModel& model, const std::string& dir,
                                   const CheckpointMetadata& metadata) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("saving a SHARDED checkpoint"));
  return SaveModelCheckpointTensors(model, dir, ModelCheckpointTensors(model), metadata);
}

SaveGroups ModelSaveGroups(FullyShardedModel& model) {
  return SaveGroups{&model.group(), model.replicate_group()};
}

absl::Status SaveModelCheckpointTensors(FullyShardedModel& model, const std::string& dir,
                                        const std::vector<CheckpointTensor>& tensors,
                                        const CheckpointMetadata& metadata) {
  return SaveModelCheckpointTensors(ModelSaveGroups(model), dir, tensors, metadata);
}

absl::Status SaveModelCheckpointTensors(const SaveGroups& groups, const std::string& dir,
                                        const std::vector<CheckpointTensor>& tensors,
                                        const CheckpointMetadata& metadata,
                                        const absl::Status& ready,
                                        const AfterLocalWrite& after_write) {
  Collectives* replicate = groups.replicate;
  absl::Status saved = absl::OkStatus();
  if (replicate == nullptr || replicate->rank() == 0) {
    saved = SaveCheckpointTensors(*groups.shard, dir, tensors, metadata, ready, after_write);
  } else if (!ready.ok()) {
    saved = ready;  // Its shard group's writer reports its own.
  }
  if (replicate == nullptr) return saved;
  at::Tensor outcome = at::full({1}, saved.ok() ? 1.0 : 0.0, at::kDouble);
  replicate->Broadcast(outcome, /*root=*/0)->Wait();
  if (saved.ok() && outcome.item<double>() == 0) {
    return absl::UnavailableError(absl::StrCat(
        "rank ", replicate->rank(), " of the replicate group: the rank that writes this shard "
        "group's checkpoint to '", dir, "' failed (its own status says why)"));
  }
  return saved;
}

absl::Status LoadShardedCheckpoint(FullyShardedModel& model, const std::string& dir,
                                   ShardedLoadStats* stats) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("loading a SHARDED checkpoint"));
  return LoadCheckpointTensors(model.group(), dir, ModelCheckpointTensors(model), {"optim/"},
                               stats);
}

absl::Status SaveCheckpointTensors(Collectives& group, const std::string& dir,
                                   const std::vector<CheckpointTensor>& tensors,
                                   const CheckpointMetadata& metadata, const absl::Status& ready,
                                   const AfterLocalWrite& after_write) {
  const int rank = group.rank(), world = group.world_size();
  CollectiveLabel label(group, "", "checkpoint save");
  try {
    // A random id, as two 32-bit halves (exact in the float64 that
    // broadcast carries).
    at::Tensor id_tensor = at::zeros({2}, at::kDouble);
    if (rank == 0) id_tensor.copy_(RandomIdHalves());
    group.Broadcast(id_tensor, 0)->Wait();
    const uint64_t id = static_cast<uint64_t>(id_tensor[0].item<double>()) << 32 |
                        static_cast<uint64_t>(id_tensor[1].item<double>());

    // Whatever happens locally (an error or a throw: a tensor that cannot
    // be read, out of memory), every rank reaches the collectives below
    // and learns that the checkpoint failed.
    checkpoint::RankReport report;
    report.set_rank(rank);
    absl::Status written = ready;
    if (written.ok()) {
      written =
          CatchAsStatus([&] { return WriteShardFile(dir, id, rank, world, tensors, report); });
    }
    if (after_write) {
      const absl::Status after = CatchAsStatus(after_write);
      if (written.ok()) written = after;
    }
    if (!written.ok()) {
      report.Clear();
      report.set_rank(rank);
      report.set_error(std::string(written.message()));
    }
    const std::vector<std::string> reports = AllGatherBytes(group, report.SerializeAsString());

    absl::Status manifest_status;
    if (rank == 0) {
      manifest_status = CatchAsStatus(
          [&] { return WriteManifest(dir, id, world, tensors, metadata, reports); });
      // Every rank has finished writing: what temporary files remain are
      // those of saves that were killed.
      RemoveAbandonedTempFiles(dir);
    }
    // Everyone learns whether the checkpoint landed.
    const std::vector<int> failed = FailedRanks(group, rank == 0 && !manifest_status.ok());
    if (failed.empty()) return absl::OkStatus();
    return absl::InternalError(absl::StrCat(
        "rank ", rank, " of ", world, ": the SHARDED checkpoint in '", dir,
        "' was not saved (no manifest written)",
        rank == 0 ? absl::StrCat(": ", manifest_status.message())
                  : std::string("; rank 0 reports why")));
  } catch (...) {
    return StatusFromCurrentException();
  }
}

std::string NotLoadableInPlace(const std::string& name) {
  return absl::StrCat("'", name, "' is not contiguous in the model (a transposed or strided "
                      "view), so a checkpoint cannot load into its storage; make it contiguous "
                      "(register .contiguous()) before loading");
}

absl::StatusOr<CheckpointMetadata> ReadCheckpointMetadata(const std::string& dir) {
  FSDP_ASSIGN_OR_RETURN(const checkpoint::CheckpointManifest manifest, ReadManifest(dir));
  // A manifest whose shard files are gone (removed by hand, or by another
  // job in the same directory) is not a checkpoint.
  for (const auto& f : manifest.files()) {
    const std::string path = absl::StrCat(dir, "/", f.name());
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
      return absl::DataLossError(absl::StrCat("the shard file '", path, "' of rank ", f.rank(),
                                              " that the manifest names cannot be found: ",
                                              std::strerror(errno)));
    }
    if (!S_ISREG(st.st_mode) || st.st_size != f.size_bytes()) {
      return absl::DataLossError(absl::StrCat(
          "the shard file '", path, "' of rank ", f.rank(), " has ",
          static_cast<int64_t>(st.st_size), " bytes, the manifest records ", f.size_bytes(),
          S_ISREG(st.st_mode) ? " (truncated or replaced)" : " (not a regular file)"));
    }
  }
  return CheckpointMetadata(manifest.metadata().begin(), manifest.metadata().end());
}

absl::Status LoadCheckpointTensors(Collectives& group, const std::string& dir,
                                   const std::vector<CheckpointTensor>& tensors,
                                   const std::vector<std::string>& ignore_prefixes,
                                   ShardedLoadStats* stats) {
  CollectiveLabel label(group, "", "checkpoint load");
  std::vector<at::Tensor> staging(tensors.size());
  ShardedLoadStats local_stats;
  absl::Status local;
  for (const CheckpointTensor& t : tensors) {
    if (!t.in_place && local.ok()) local = absl::InvalidArgumentError(NotLoadableInPlace(t.fqn));
  }
  try {
    if (local.ok()) {
      absl::StatusOr<checkpoint::CheckpointManifest> manifest = ReadManifest(dir);
      local = manifest.ok()
                  ? ReadLocalState(dir, *manifest, tensors, ignore_prefixes, staging, local_stats)
                  : manifest.status();
    }
  } catch (...) {
    local = StatusFromCurrentException();
  }
  try {
    const std::vector<int> failed = FailedRanks(group, !local.ok());
    if (!failed.empty()) {
      const std::string who = absl::StrCat("rank ", group.rank(), " of ", group.world_size());
      if (!local.ok()) {
        return absl::Status(local.code(), absl::StrCat(who, ": nothing was loaded: ",
                                                       local.message()));
      }
      return absl::AbortedError(absl::StrCat(who, ": nothing was loaded: rank(s) ",
                                             absl::StrJoin(failed, ", "),
                                             " could not read the checkpoint in '", dir, "'"));
    }
    at::NoGradGuard no_grad;
    for (size_t k = 0; k < tensors.size(); ++k) {
      const CheckpointTensor& t = tensors[k];
      if (t.hi > t.lo) t.local.copy_(staging[k]);
    }
  } catch (...) {
    return StatusFromCurrentException();
  }
  if (stats != nullptr) *stats = local_stats;
  return absl::OkStatus();
}

}  // namespace fsdp
