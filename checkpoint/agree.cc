#include "checkpoint/agree.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "comm/collectives.h"

namespace fsdp::checkpoint_internal {
namespace {

// "" for OK; else "<code>|<who>|<message>".
std::string Encode(const absl::Status& status, const std::string& who) {
  if (status.ok()) return "";
  return absl::StrCat(static_cast<int>(status.code()), "|", who, "|", status.message());
}

absl::Status Decode(const std::string& text) {
  const size_t first = text.find('|');
  const size_t second = text.find('|', first + 1);
  int code = static_cast<int>(absl::StatusCode::kUnknown);
  if (first == std::string::npos || second == std::string::npos ||
      !absl::SimpleAtoi(text.substr(0, first), &code)) {
    return absl::UnknownError(text);
  }
  return absl::Status(static_cast<absl::StatusCode>(code),
                      absl::StrCat(text.substr(first + 1, second - first - 1), ": ",
                                   text.substr(second + 1)));
}

// What `mine` says when a rank other than this one saw otherwise.
absl::Status Differ(const Collectives& group, const std::string& where, const std::string& seen,
                    const std::vector<std::string>& seen_by) {
  for (size_t r = 0; r < seen_by.size(); ++r) {
    if (seen_by[r] == seen) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "the ranks see different things at '", where, "': this rank (", group.rank(), ") ", seen,
        ", rank ", r, " ", seen_by[r], "; every rank must see the same directory"));
  }
  return absl::OkStatus();
}

// Over one group: the first failure among the members, encoded ("" for
// none), or in `differ` this rank's account of a member that saw otherwise.
// When all is well this is one collective of two numbers per rank; only a
// failure or a difference costs a second that carries the texts.
std::string FirstFailure(Collectives& group, const std::string& seen, const std::string& mine,
                         const std::string& where, absl::Status& differ) {
  const int world = group.world_size();
  at::Tensor own = at::empty({2}, at::kDouble);
  // 52 bits of the hash: a double holds them exactly.
  own[0] = static_cast<double>(std::hash<std::string>()(seen) & ((uint64_t{1} << 52) - 1));
  own[1] = mine.empty() ? 0.0 : 1.0;
  at::Tensor all = at::empty({2 * world}, at::kDouble);
  group.AllGatherIntoTensor(all, own)->Wait();
  const double* v = all.data_ptr<double>();
  bool clean = true;
  for (int r = 0; r < world; ++r) clean = clean && v[2 * r] == v[0] && v[2 * r + 1] == 0;
  if (clean) return "";
  std::vector<std::string> seen_by;
  std::string first;
  for (const std::string& theirs : AllGatherBytes(group, absl::StrCat(seen, "\n", mine))) {
    const size_t cut = theirs.find('\n');
    seen_by.push_back(theirs.substr(0, cut));
    const std::string failure = cut == std::string::npos ? "" : theirs.substr(cut + 1);
    if (first.empty()) first = failure;
  }
  if (differ.ok()) differ = Differ(group, where, seen, seen_by);
  return first;
}

}  // namespace

absl::Status AgreeAcrossRanks(FullyShardedModel& model, const absl::Status& local) {
  return AgreeAcrossRanks(model, local, "", "");
}

absl::Status AgreeAcrossRanks(FullyShardedModel& model, const absl::Status& local,
                              const std::string& seen, const std::string& where) {
  try {
    Collectives* replicas = model.replicate_group();
    const std::string who =
        replicas == nullptr
            ? absl::StrCat("rank ", model.group().rank())
            : absl::StrCat("rank ", model.group().rank(), " of replica ", replicas->rank());
    absl::Status differ;
    std::string first = FirstFailure(model.group(), seen, Encode(local, who), where, differ);
    if (replicas != nullptr) first = FirstFailure(*replicas, seen, first, where, differ);
    if (!local.ok()) return local;
    if (!differ.ok()) return differ;
    if (first.empty()) return absl::OkStatus();
    return Decode(first);
  } catch (...) {
    return StatusFromCurrentException();
  }
}

absl::Status AgreeAfterLoad(FullyShardedModel& model, const absl::Status& local,
                            const char* what) {
  const absl::Status agreed = AgreeAcrossRanks(model, local);
  if (!local.ok() || agreed.ok()) return agreed;
  return absl::AbortedError(absl::StrCat(
      "this rank loaded the ", what, " but another could not (", agreed.message(),
      "); the ranks now disagree: load again, or restart"));
}

}  // namespace fsdp::checkpoint_internal
