#include "statedict/dcp_sharded.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "formats/atomic_file.h"

namespace fsdp {
namespace {

// What every rank must pass alike: each tensor's name, shape, dtype and
// whether it is sharded. Rank 0 compares the others' with its own, since
// it names their chunks from its own list.
int64_t Fingerprint(const std::vector<DcpTensorShard>& tensors) {
  std::string all;
  for (const DcpTensorShard& t : tensors) {
    absl::StrAppend(&all, DcpStoredName(t.path), "|", absl::StrJoin(t.shape, ","), "|",
                    static_cast<int>(t.dtype), "|", t.sharded, "\n");
  }
  return static_cast<int64_t>(std::hash<std::string>()(all));
}

// A rank's report of its save: the fingerprint of its tensors, the id in
// its data file's name, then the chunks it wrote, as int64 words (shard
// index, dims, offsets..., sizes..., byte offset, byte length), or its
// error (a leading 'E').
std::string EncodeReport(int64_t fingerprint, uint64_t save_id,
                         const std::vector<std::pair<size_t, DcpStoredEntry>>& chunks) {
  std::vector<int64_t> words = {fingerprint, static_cast<int64_t>(save_id)};
  for (const auto& [index, entry] : chunks) {
    words.push_back(static_cast<int64_t>(index));
    words.push_back(static_cast<int64_t>(entry.chunk_offsets.size()));
    words.insert(words.end(), entry.chunk_offsets.begin(), entry.chunk_offsets.end());
    words.insert(words.end(), entry.chunk_sizes.begin(), entry.chunk_sizes.end());
    words.push_back(static_cast<int64_t>(entry.location.offset));
    words.push_back(static_cast<int64_t>(entry.location.length));
  }
  std::string out = "C";
  out.append(reinterpret_cast<const char*>(words.data()), words.size() * sizeof(int64_t));
  return out;
}

std::vector<int64_t> ReportWords(const std::string& report) {
  if (report.empty() || report[0] != 'C' || (report.size() - 1) % sizeof(int64_t) != 0) return {};
  std::vector<int64_t> words((report.size() - 1) / sizeof(int64_t));
  std::memcpy(words.data(), report.data() + 1, words.size() * sizeof(int64_t));
  return words;
}

// The data file rank `rank` wrote, as its report names it; "" if none.
std::string ReportedFile(const std::string& report, int rank) {
  const std::vector<int64_t> words = ReportWords(report);
  if (words.size() < 2) return "";
  return NewDcpDataFileName(rank, static_cast<uint64_t>(words[1]));
}

// Rank `rank`'s chunks as stored entries (rank 0 decodes what every rank
// reported; the reports come from this job's own ranks).
absl::Status DecodeReport(const std::string& report, int rank,
                          const std::vector<DcpTensorShard>& tensors,
                          std::vector<DcpStoredEntry>& out, std::vector<size_t>& indices) {
  const std::vector<int64_t> words = ReportWords(report);
  if (words.size() < 2) {
    return absl::InternalError(absl::StrCat("rank ", rank, " sent a malformed report"));
  }
  const std::string file = ReportedFile(report, rank);
  if (words[0] != Fingerprint(tensors)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank,
                     " passed other tensors than rank 0 (names, shapes, dtypes "
                     "or order differ)"));
  }
  size_t at = 2;
  const auto take = [&]() -> int64_t { return at < words.size() ? words[at++] : -1; };
  while (at < words.size()) {
    const int64_t index = take(), dims = take();
    if (index < 0 || static_cast<size_t>(index) >= tensors.size() || dims < 0 ||
        static_cast<size_t>(dims) != tensors[index].shape.size() ||
        at + 2 * static_cast<size_t>(dims) + 2 > words.size()) {
      return absl::InternalError(absl::StrCat("rank ", rank, " sent a malformed report"));
    }
    DcpStoredEntry entry;
    const DcpTensorShard& t = tensors[index];
    entry.path = t.path;
    entry.is_tensor = true;
    entry.dtype = t.dtype;
    entry.tensor_size = t.shape;
    for (int64_t d = 0; d < dims; ++d) entry.chunk_offsets.push_back(take());
    for (int64_t d = 0; d < dims; ++d) entry.chunk_sizes.push_back(take());
    entry.location.relative_path = file;
    entry.location.offset = static_cast<uint64_t>(take());
    entry.location.length = static_cast<uint64_t>(take());
    out.push_back(std::move(entry));
    indices.push_back(static_cast<size_t>(index));
  }
  return absl::OkStatus();
}

// This rank's items: its part of every sharded tensor as boxes, and, on
// rank 0, every replicated tensor whole and the plain values. `owner[i]` is
// the shard index of tensor item i.
absl::Status ItemsOf(int rank, const std::vector<DcpTensorShard>& tensors,
                     const std::vector<DcpItem>& values, std::vector<DcpItem>& items,
                     std::vector<size_t>& owner) {
  for (size_t k = 0; k < tensors.size(); ++k) {
    const DcpTensorShard& t = tensors[k];
    int64_t numel = 1;
    for (int64_t s : t.shape) numel *= s;
    const int64_t lo = t.sharded ? t.lo : 0, hi = t.sharded ? t.hi : numel;
    if (!t.local.defined() || t.local.numel() != hi - lo || lo < 0 || hi > numel ||
        t.local.scalar_type() != t.dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", DcpStoredName(t.path), "': this rank's part holds ",
                       t.local.defined() ? t.local.numel() : 0, " elements for [", lo, ", ", hi,
                       ") of ", numel));
    }
    if (!t.sharded && rank != 0) continue;
    if (numel == 0) {
      // No rank holds an element: rank 0 writes the empty tensor as one
      // chunk, as dcp.save does, so that the tensor is in the checkpoint.
      if (rank != 0) continue;
      DcpItem item;
      item.path = t.path;
      item.value = t.local.detach().view(t.shape);
      items.push_back(std::move(item));
      owner.push_back(k);
      continue;
    }
    at::Tensor flat = t.local.detach().reshape({-1});
    for (const DcpBox& box : DcpBoxesOfFlatRange(t.shape, lo, hi)) {
      int64_t box_numel = 1;
      for (int64_t s : box.sizes) box_numel *= s;
      DcpItem item;
      item.path = t.path;
      item.value = flat.narrow(0, box.flat_begin - lo, box_numel).view(box.sizes);
      item.chunk_offsets = box.offsets;
      item.tensor_size = t.shape;
      items.push_back(std::move(item));
      owner.push_back(k);
    }
  }
  if (rank == 0) {
    for (const DcpItem& value : values) items.push_back(value);
  }
  return absl::OkStatus();
}

std::string Who(const Collectives& group) {
  return absl::StrCat("rank ", group.rank(), " of ", group.world_size());
}

// A failure as "<code>|<message>", and back (kInternal if malformed).
std::string EncodeFailure(const absl::Status& status) {
  return absl::StrCat(static_cast<int>(status.code()), "|", status.message());
}

absl::Status DecodeFailure(const std::string& text) {
  const size_t bar = text.find('|');
  int code = 0;
  if (bar == std::string::npos || !absl::SimpleAtoi(text.substr(0, bar), &code) || code <= 0 ||
      code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    return absl::InternalError(text);
  }
  return absl::Status(static_cast<absl::StatusCode>(code), text.substr(bar + 1));
}

// A data file name this rank has not used in `dir`: the replaced
// checkpoint's files must stay until the new .metadata lands, also when the
// clock stepped back or two saves fall within its resolution.
uint64_t FreshSaveId(const std::string& dir, int rank) {
  uint64_t id = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  struct stat st;
  while (stat(absl::StrCat(dir, "/", NewDcpDataFileName(rank, id)).c_str(), &st) == 0) ++id;
  return id;
}

// Writes this rank's items into its own data file of the save `save_id`:
// `mine` says where each went, `owner` which tensor each chunk is of.
absl::Status WriteThisRanksFile(int rank, const std::string& dir, uint64_t save_id,
                                const std::vector<DcpTensorShard>& tensors,
                                const std::vector<DcpItem>& values, std::vector<size_t>& owner,
                                std::vector<DcpStoredEntry>& mine) {
  std::vector<DcpItem> items;
  FSDP_RETURN_IF_ERROR(ItemsOf(rank, tensors, values, items, owner));
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot create '", dir, "': ", std::strerror(errno)));
  }
  FSDP_ASSIGN_OR_RETURN(mine, WriteDcpDataFile(dir, NewDcpDataFileName(rank, save_id), items));
  return absl::OkStatus();
}

// Every rank's file, as rank 0 sees it: a directory that is not shared
// would otherwise commit a checkpoint naming files it lacks.
absl::Status CheckEveryFileVisible(const std::string& dir,
                                   const std::vector<DcpStoredEntry>& mine,
                                   const std::vector<DcpStoredEntry>& all) {
  std::map<std::string, uint64_t> file_ends;
  for (const std::vector<DcpStoredEntry>* entries : {&mine, &all}) {
    for (const DcpStoredEntry& e : *entries) {
      uint64_t& end = file_ends[e.location.relative_path];
      end = std::max(end, e.location.offset + e.location.length);
    }
  }
  for (const auto& [file, end] : file_ends) {
    struct stat st;
    if (stat(absl::StrCat(dir, "/", file).c_str(), &st) != 0 ||
        static_cast<uint64_t>(st.st_size) < end) {
      return absl::UnavailableError(
          absl::StrCat("rank 0 does not see ", file, " whole in '", dir,
                       "': every rank must write to the same (shared) directory"));
    }
  }
  return absl::OkStatus();
}

// Tensors in the callers' order (each rank's chunks are), then the values:
// rank 0's entries after its chunks. `mine` is rank 0's entries, its first
// `owner.size()` its chunks; `all` the other ranks', of tensors `reported_index`.
std::vector<DcpStoredEntry> InCommitOrder(const std::vector<DcpStoredEntry>& mine,
                                          const std::vector<size_t>& owner,
                                          const std::vector<DcpStoredEntry>& all,
                                          const std::vector<size_t>& reported_index) {
  std::vector<DcpStoredEntry> ordered(mine.begin(), mine.begin() + owner.size());
  std::vector<size_t> index_of = owner;
  for (size_t i = 0; i < all.size(); ++i) {
    ordered.push_back(all[i]);
    index_of.push_back(reported_index[i]);
  }
  std::vector<size_t> order(ordered.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return index_of[x] < index_of[y]; });
  std::vector<DcpStoredEntry> sorted;
  for (size_t i : order) sorted.push_back(ordered[i]);
  sorted.insert(sorted.end(), mine.begin() + owner.size(), mine.end());
  return sorted;
}

// Rank 0's part of a save: every rank's report read, then .metadata for
// all their chunks committed; an error names every rank that failed.
absl::Status CommitEveryRanksChunks(const std::string& dir, int world,
                                    const std::vector<std::string>& reports,
                                    const std::vector<DcpTensorShard>& tensors,
                                    const std::vector<size_t>& owner,
                                    const std::vector<DcpStoredEntry>& mine) {
  std::vector<std::string> failed;
  absl::StatusCode code = absl::StatusCode::kOk;  // The first failure's.
  std::vector<DcpStoredEntry> all;     // Other ranks' chunks,
  std::vector<size_t> reported_index;  // and their tensors.
  for (int r = 0; r < world; ++r) {
    absl::Status problem;
    if (!reports[r].empty() && reports[r][0] == 'E') {
      problem = DecodeFailure(reports[r].substr(1));
      failed.push_back(absl::StrCat("rank ", r, ": ", problem.message()));
    } else if (r != 0) {
      problem = DecodeReport(reports[r], r, tensors, all, reported_index);
      if (!problem.ok()) failed.push_back(std::string(problem.message()));
    }
    if (code == absl::StatusCode::kOk) code = problem.code();
  }
  if (!failed.empty()) return absl::Status(code, absl::StrJoin(failed, "; "));
  FSDP_RETURN_IF_ERROR(CheckEveryFileVisible(dir, mine, all));
  return CommitDcpMetadata(dir, InCommitOrder(mine, owner, all, reported_index));
}

}  // namespace

absl::Status SaveShardedDcp(Collectives& group, const std::string& dir,
                            const std::vector<DcpTensorShard>& tensors,
                            const std::vector<DcpItem>& values, const absl::Status& ready,
                            const AfterLocalWrite& after_write) {
  const int rank = group.rank(), world = group.world_size();
  CollectiveLabel label(group, "", "DCP save");
  try {
    // Each rank names its own file and reports the name: no round to
    // share one id.
    const uint64_t save_id = FreshSaveId(dir, rank);

    std::vector<size_t> owner;         // This rank's chunks' tensors,
    std::vector<DcpStoredEntry> mine;  // and where its items went.
    absl::Status written = ready;
    if (written.ok()) {
      written = CatchAsStatus(
          [&] { return WriteThisRanksFile(rank, dir, save_id, tensors, values, owner, mine); });
    }
    if (after_write) {
      const absl::Status after = CatchAsStatus(after_write);
      if (written.ok()) written = after;
    }
    std::string report;
    if (written.ok()) {
      std::vector<std::pair<size_t, DcpStoredEntry>> chunks;
      for (size_t i = 0; i < owner.size(); ++i) chunks.emplace_back(owner[i], mine[i]);
      report = EncodeReport(Fingerprint(tensors), save_id, chunks);
    } else {
      report = absl::StrCat("E", EncodeFailure(written));
    }
    const std::vector<std::string> reports = AllGatherBytes(group, report);

    std::string outcome;  // Rank 0's: empty when the checkpoint landed.
    if (rank == 0) {
      // A local failure becomes this rank's report: every rank reaches
      // every collective, whatever happens to it locally.
      const absl::Status committed = CatchAsStatus([&] {
        return CommitEveryRanksChunks(dir, world, reports, tensors, owner, mine);
      });
      if (!committed.ok()) {
        for (int r = 0; r < world; ++r) {
          const std::string file = ReportedFile(reports[r], r);
          if (!file.empty()) unlink(absl::StrCat(dir, "/", file).c_str());
        }
        outcome = EncodeFailure(committed);
      }
      // Every rank of the job has finished writing: what temporary files
      // remain are those of saves that were killed.
      RemoveAbandonedTempFiles(dir);
    }
    // A flag first: a save that landed costs one collective, not the two
    // of a message.
    at::Tensor failed = at::full({1}, outcome.empty() ? 0.0 : 1.0, at::kDouble);
    group.Broadcast(failed, /*root=*/0)->Wait();
    if (failed.item<double>() == 0) return absl::OkStatus();
    BroadcastBytes(group, outcome, /*root=*/0);
    // The first failed rank's code: a caller's refusal (kFailedPrecondition,
    // say) stays what it is on every rank.
    const absl::Status first = DecodeFailure(outcome);
    return absl::Status(first.code(),
                        absl::StrCat(Who(group), ": the DCP checkpoint in '", dir,
                                     "' was not saved (the one there is unchanged): ",
                                     first.message()));
  } catch (...) {
    return StatusFromCurrentException();
  }
}

namespace {

// A load's refusal of a checkpoint whose tensors do not fit the model's,
// naming the first few it does hold.
absl::Status DoesNotFit(const std::string& dir, const DcpMetadata& metadata,
                        const std::vector<std::string>& problems) {
  std::vector<std::string> names;
  for (const DcpTensorEntry& entry : metadata.tensors) {
    if (names.size() == 4) break;
    names.push_back(entry.fqn);
  }
  const std::string holds = absl::StrCat(" (its tensors start: ", absl::StrJoin(names, ", "), ")");
  return absl::InvalidArgumentError(absl::StrCat(
      "DCP checkpoint '", dir, "' does not fit: ", absl::StrJoin(problems, "; "), holds));
}

// Reads this rank's part of every tensor into `staging` (nothing is copied
// into the tensors yet: that waits for every rank's agreement).
absl::Status StageThisRanksParts(const std::string& dir,
                                 const std::vector<DcpTensorShard>& tensors,
                                 std::vector<at::Tensor>& staging, ShardedLoadStats& stats) {
  FSDP_ASSIGN_OR_RETURN(const DcpMetadata metadata, ReadDcpMetadata(dir));
  std::unordered_map<std::string, const DcpTensorEntry*> by_name;
  for (const DcpTensorEntry& entry : metadata.tensors) by_name[entry.fqn] = &entry;
  std::vector<std::string> problems;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const DcpTensorShard& t = tensors[k];
    const std::string name = DcpStoredName(t.path);
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      problems.push_back(absl::StrCat("'", name, "' is missing"));
      continue;
    }
    const DcpTensorEntry& entry = *it->second;
    if (entry.size != t.shape || entry.dtype != t.dtype) {
      problems.push_back(absl::StrCat("'", name, "' is ", c10::toString(entry.dtype), " [",
                                      absl::StrJoin(entry.size, ", "), "] in the checkpoint, ",
                                      c10::toString(t.dtype), " [", absl::StrJoin(t.shape, ", "),
                                      "] here"));
      continue;
    }
    int64_t numel = 1;
    for (int64_t s : t.shape) numel *= s;
    const int64_t lo = t.sharded ? t.lo : 0, hi = t.sharded ? t.hi : numel;
    if (!t.in_place) {
      return absl::InvalidArgumentError(NotLoadableInPlace(name));
    }
    // Checked here, so that copying after the agreement cannot fail.
    if (!t.local.defined() || t.local.numel() != hi - lo || t.local.scalar_type() != t.dtype ||
        !t.local.is_contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", name, "': this rank's tensor is not a contiguous ", c10::toString(t.dtype),
          " tensor of the ", hi - lo, " elements it holds"));
    }
    FSDP_ASSIGN_OR_RETURN(staging[k], ReadDcpFlatRange(dir, entry, lo, hi, &stats.bytes_read));
    stats.bytes_needed += (hi - lo) * static_cast<int64_t>(c10::elementSize(t.dtype));
  }
  if (!problems.empty()) return DoesNotFit(dir, metadata, problems);
  return absl::OkStatus();
}

// Every rank's outcome (and, under hybrid sharding, every replica's): OK
// only when every rank staged its parts; else this rank's error, or one
// naming the ranks that failed.
absl::Status AgreeOnLoad(Collectives& group, const std::string& dir, const absl::Status& local,
                         Collectives* replicate_group) {
  at::Tensor failed = at::empty({group.world_size()}, at::kDouble);
  group.AllGatherIntoTensor(failed, at::full({1}, local.ok() ? 0.0 : 1.0, at::kDouble))->Wait();
  std::vector<int> ranks;
  for (int r = 0; r < group.world_size(); ++r) {
    if (failed[r].item<double>() != 0) ranks.push_back(r);
  }
  if (replicate_group != nullptr) {
    // Every replica loads or none: the others' groups' outcomes too.
    at::Tensor any = at::full({1}, ranks.empty() ? 0.0 : 1.0, at::kDouble);
    replicate_group->AllReduce(any, ReduceOp::kSum)->Wait();
    if (ranks.empty() && any.item<double>() != 0) {
      return absl::AbortedError(
          absl::StrCat(Who(group),
                       ": nothing was loaded: a rank of another shard group could not load "
                       "the DCP checkpoint in '",
                       dir, "'"));
    }
  }
  if (!ranks.empty()) {
    if (!local.ok()) {
      return absl::Status(local.code(),
                          absl::StrCat(Who(group), ": nothing was loaded: ", local.message()));
    }
    return absl::AbortedError(absl::StrCat(Who(group), ": nothing was loaded: rank(s) ",
                                           absl::StrJoin(ranks, ", "),
                                           " could not load the DCP checkpoint in '", dir, "'"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status StageShardedDcp(const std::string& dir, std::vector<DcpTensorShard> tensors,
                             StagedDcpLoad& staged) {
  staged.tensors = std::move(tensors);
  staged.staging.assign(staged.tensors.size(), at::Tensor());
  staged.stats = ShardedLoadStats();
  return CatchAsStatus(
      [&] { return StageThisRanksParts(dir, staged.tensors, staged.staging, staged.stats); });
}

absl::Status ApplyStagedDcp(const StagedDcpLoad& staged) {
  return CatchAsStatus([&] {
    at::NoGradGuard no_grad;
    for (size_t k = 0; k < staged.tensors.size(); ++k) {
      if (staged.staging[k].defined() && staged.staging[k].numel() > 0) {
        staged.tensors[k].local.view({-1}).copy_(staged.staging[k]);
      }
    }
    return absl::OkStatus();
  });
}

absl::Status LoadShardedDcp(Collectives& group, const std::string& dir,
                            const std::vector<DcpTensorShard>& tensors, ShardedLoadStats* stats,
                            const absl::Status& ready, Collectives* replicate_group) {
  CollectiveLabel label(group, "", "DCP load");
  StagedDcpLoad staged;
  absl::Status local = ready;
  if (local.ok()) local = StageShardedDcp(dir, tensors, staged);
  try {
    FSDP_RETURN_IF_ERROR(AgreeOnLoad(group, dir, local, replicate_group));
  } catch (...) {
    return StatusFromCurrentException();
  }
  FSDP_RETURN_IF_ERROR(ApplyStagedDcp(staged));
  if (stats != nullptr) *stats = staged.stats;
  return absl::OkStatus();
}

std::vector<DcpTensorShard> ModelDcpShards(const FullyShardedModel& model, const std::string& key,
                                           bool every_name) {
  std::vector<DcpTensorShard> out;
  for (const CheckpointTensor& t : ModelCheckpointTensors(model)) {
    std::vector<std::string> names = {t.fqn};
    if (every_name) names.insert(names.end(), t.aliases.begin(), t.aliases.end());
    for (const std::string& name : names) {
      DcpTensorShard shard;
      if (!key.empty()) shard.path.push_back({false, key, 0});
      shard.path.push_back({false, name, 0});
      shard.shape = t.shape;
      shard.dtype = t.dtype;
      shard.sharded = t.sharded;
      shard.lo = t.lo;
      shard.hi = t.hi;
      shard.local = t.local;
      shard.in_place = t.in_place;
      out.push_back(std::move(shard));
    }
  }
  return out;
}

absl::Status SaveModelShardedDcp(FullyShardedModel& model, const std::string& dir,
                                 const std::vector<DcpTensorShard>& tensors,
                                 const std::vector<DcpItem>& values, const absl::Status& ready) {
  return SaveModelShardedDcp(ModelSaveGroups(model), dir, tensors, values, ready);
}

absl::Status SaveModelShardedDcp(const SaveGroups& groups, const std::string& dir,
                                 const std::vector<DcpTensorShard>& tensors,
                                 const std::vector<DcpItem>& values, const absl::Status& ready,
                                 const AfterLocalWrite& after_write) {
  Collectives* replicate = groups.replicate;
  absl::Status saved = absl::OkStatus();
  if (replicate == nullptr || replicate->rank() == 0) {
    saved = SaveShardedDcp(*groups.shard, dir, tensors, values, ready, after_write);
  } else if (!ready.ok()) {
    saved = ready;  // Its shard group's writer reports its own.
  }
  if (replicate == nullptr) return saved;
  at::Tensor outcome = at::full({1}, saved.ok() ? 1.0 : 0.0, at::kDouble);
  replicate->Broadcast(outcome, /*root=*/0)->Wait();
  if (saved.ok() && outcome.item<double>() == 0) {
    return absl::UnavailableError(
        absl::StrCat("rank ", replicate->rank(),
                     " of the replicate group: the shard group that writes the "
                     "DCP checkpoint to '",
                     dir, "' failed (its own status says why)"));
  }
  return saved;
}

absl::Status SaveShardedDcpModel(FullyShardedModel& model, const std::string& dir,
                                 const std::string& key) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("saving a DCP checkpoint"));
  return SaveModelShardedDcp(model, dir, ModelDcpShards(model, key, /*every_name=*/true));
}

absl::Status LoadShardedDcpModel(FullyShardedModel& model, const std::string& dir,
                                 const std::string& key, ShardedLoadStats* stats) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("loading a DCP checkpoint"));
  return LoadShardedDcp(model.group(), dir, ModelDcpShards(model, key, /*every_name=*/false), stats,
                        absl::OkStatus(), model.replicate_group());
}

}  // namespace fsdp
