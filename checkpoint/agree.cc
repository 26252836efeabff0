#include "checkpoint/agree.h"

#include <string>
#include <vector>

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

// The first failure among the group's members, encoded.
std::string FirstFailure(Collectives& group, const std::string& mine) {
  for (const std::string& theirs : AllGatherBytes(group, mine)) {
    if (!theirs.empty()) return theirs;
  }
  return "";
}

}  // namespace

absl::Status AgreeAcrossRanks(FullyShardedModel& model, const absl::Status& local) {
  try {
    Collectives* replicas = model.replicate_group();
    const std::string who =
        replicas == nullptr
            ? absl::StrCat("rank ", model.group().rank())
            : absl::StrCat("rank ", model.group().rank(), " of replica ", replicas->rank());
    std::string first = FirstFailure(model.group(), Encode(local, who));
    if (replicas != nullptr) first = FirstFailure(*replicas, first);
    if (first.empty()) return absl::OkStatus();
    return local.ok() ? Decode(first) : local;
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
