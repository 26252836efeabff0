#include "comm/fingerprint.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/fnv1a.h"

namespace fsdp {
namespace {

constexpr char kReportHeader[] = "fsdp-fingerprint-report v1";

// A rank that issues a collective this much after the first one is named
// as late (clocks of one host agree; across hosts, NTP skew is far below).
constexpr int64_t kLateMs = 500;

// Reports are line- and tab-separated; labels come from callers.
std::string Clean(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  std::replace(s.begin(), s.end(), '\t', ' ');
  return s;
}

std::string RankList(const std::vector<int>& ranks) {
  return absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "));
}

// The record of `report` with sequence number `seq`, if its ring holds it.
const CollectiveRecord* RecordAt(const FingerprintReport& report, int64_t seq) {
  const int64_t first = report.count - static_cast<int64_t>(report.recent.size());
  if (seq < first || seq >= report.count) return nullptr;
  return &report.recent[seq - first];
}

// Ranks grouped by the collective they issued as #seq; ranks whose ring
// does not hold #seq are left out.
std::vector<std::pair<const CollectiveRecord*, std::vector<int>>> RanksByCollectiveAt(
    const std::vector<const FingerprintReport*>& present, int64_t seq) {
  std::vector<std::pair<const CollectiveRecord*, std::vector<int>>> groups;
  for (const FingerprintReport* report : present) {
    const CollectiveRecord* record = RecordAt(*report, seq);
    if (record == nullptr) continue;  // Not issued (yet): see the counts below.
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) {
      return g.first->SameCollective(*record);
    });
    if (it == groups.end()) {
      groups.push_back({record, {report->rank}});
    } else {
      it->second.push_back(report->rank);
    }
  }
  return groups;
}

// Same collective at #seq but different histories before the rings: the
// ranks grouped by history, or "" when they share one.
std::string DescribeHistoriesBeforeRings(const std::vector<const FingerprintReport*>& present,
                                         int64_t seq) {
  std::string out;
  std::map<uint64_t, std::vector<int>> by_hash;
  for (const FingerprintReport* report : present) {
    if (const CollectiveRecord* record = RecordAt(*report, seq)) {
      by_hash[record->hash].push_back(report->rank);
    }
  }
  if (by_hash.size() > 1) {
    absl::StrAppend(&out, "  the histories differ before collective #", seq,
                    ", older than the records kept (raise the fingerprint capacity):");
    for (const auto& [hash, ranks] : by_hash) {
      absl::StrAppend(&out, "\n    ", RankList(ranks), " share one history");
    }
    out += "\n";
  }
  return out;
}

// The first collective in [first_common, last) that the ranks issued
// differently, or "" when no recorded one differs.
std::string DescribeFirstDivergence(const std::vector<const FingerprintReport*>& present,
                                    int64_t first_common, int64_t last) {
  for (int64_t seq = first_common; seq < last; ++seq) {
    const auto groups = RanksByCollectiveAt(present, seq);
    if (groups.size() > 1) {
      std::string out = absl::StrCat("  first divergence at collective #", seq, ":");
      for (const auto& [record, ranks] : groups) {
        absl::StrAppend(&out, "\n    ", RankList(ranks), " issued ", DescribeRecord(*record));
      }
      return out + "\n";
    }
    if (seq == first_common && groups.size() == 1) {
      std::string older = DescribeHistoriesBeforeRings(present, seq);
      if (!older.empty()) return older;
    }
  }
  return "";
}

// Stragglers: who issued the newest collective that every present rank
// issued, and how much later than the first.
std::string DescribeLateRanks(const std::vector<const FingerprintReport*>& present, int64_t last) {
  std::string out;
  int64_t common_last = last;
  for (const FingerprintReport* report : present) {
    common_last = std::min(common_last, report->count - 1);
  }
  int64_t earliest = 0;
  std::vector<std::pair<int, int64_t>> issued_at;  // rank, µs
  for (const FingerprintReport* report : present) {
    const CollectiveRecord* record = RecordAt(*report, common_last);
    if (record == nullptr) continue;
    issued_at.emplace_back(report->rank, record->issued_at_us);
    if (earliest == 0 || record->issued_at_us < earliest) earliest = record->issued_at_us;
  }
  for (const auto& [rank, at_us] : issued_at) {
    const int64_t late_ms = (at_us - earliest) / 1000;
    if (late_ms >= kLateMs) {
      absl::StrAppend(&out, "  rank ", rank, " issued #", common_last, " ", late_ms,
                      " ms after the first rank did\n");
    }
  }
  return out;
}

// One line per reporting rank: its count, last collective and status.
std::string DescribeEachRank(const std::vector<const FingerprintReport*>& present) {
  std::string out;
  for (const FingerprintReport* report : present) {
    absl::StrAppend(&out, "  rank ", report->rank, ": ", report->count, " collectives issued");
    if (!report->recent.empty()) {
      absl::StrAppend(&out, ", last ", DescribeRecord(report->recent.back()));
    }
    absl::StrAppend(&out, "; ", report->status.empty() ? "no status" : report->status, "\n");
  }
  return out;
}

}  // namespace

const char* CollectiveOpName(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllGather:
      return "all-gather";
    case CollectiveOp::kReduceScatter:
      return "reduce-scatter";
    case CollectiveOp::kAllReduce:
      return "all-reduce";
    case CollectiveOp::kBroadcast:
      return "broadcast";
    case CollectiveOp::kBarrier:
      return "barrier";
    case CollectiveOp::kAllToAll:
      return "all-to-all";
  }
  return "invalid";
}

bool CollectiveRecord::SameCollective(const CollectiveRecord& other) const {
  return seq == other.seq && op == other.op && numel == other.numel && dtype == other.dtype &&
         argument == other.argument && unit == other.unit && phase == other.phase;
}

std::string DescribeRecord(const CollectiveRecord& record) {
  std::string out = absl::StrCat("#", record.seq, " ", CollectiveOpName(record.op));
  if (record.op != CollectiveOp::kBarrier) {
    absl::StrAppend(&out, " of ", record.numel, " ", record.dtype);
  }
  if (record.op == CollectiveOp::kBroadcast) absl::StrAppend(&out, " from root ", record.argument);
  if (record.op == CollectiveOp::kReduceScatter || record.op == CollectiveOp::kAllReduce) {
    absl::StrAppend(&out, record.argument == 0 ? " (sum)" : " (avg)");
  }
  if (record.unit.empty() && record.phase.empty()) return out + " (no label)";
  absl::StrAppend(&out, " (");
  if (!record.unit.empty()) absl::StrAppend(&out, "unit '", record.unit, "'");
  if (!record.unit.empty() && !record.phase.empty()) absl::StrAppend(&out, ", ");
  absl::StrAppend(&out, record.phase, ")");
  return out;
}

FingerprintLog::FingerprintLog(int capacity) : capacity_(std::max(1, capacity)) {}

CollectiveRecord FingerprintLog::Append(CollectiveOp op, int64_t numel, std::string dtype,
                                        int argument, std::string unit, std::string phase) {
  CollectiveRecord record;
  record.op = op;
  record.numel = numel;
  record.dtype = Clean(std::move(dtype));
  record.argument = argument;
  record.unit = Clean(std::move(unit));
  record.phase = Clean(std::move(phase));
  record.issued_at_us = std::chrono::duration_cast<std::chrono::microseconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
  std::lock_guard<std::mutex> lock(mu_);
  record.seq = count_++;
  uint64_t h = hash_ == 0 ? kFnv1aOffsetBasis : hash_;
  const int64_t fields[] = {record.seq, static_cast<int64_t>(op), numel, argument};
  h = Fnv1a(h, fields, sizeof(fields));
  h = Fnv1aString(h, record.dtype);
  h = Fnv1aString(h, record.unit);
  h = Fnv1aString(h, record.phase);
  record.hash = hash_ = h;
  recent_.push_back(record);
  if (static_cast<int>(recent_.size()) > capacity_) recent_.pop_front();
  return record;
}

int64_t FingerprintLog::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_;
}

CollectiveRecord FingerprintLog::Last() const {
  std::lock_guard<std::mutex> lock(mu_);
  return recent_.back();
}

uint64_t FingerprintLog::hash() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hash_;
}

std::vector<CollectiveRecord> FingerprintLog::Recent() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {recent_.begin(), recent_.end()};
}

FingerprintReport MakeReport(int rank, const FingerprintLog& log, std::string status) {
  FingerprintReport report;
  report.rank = rank;
  // One snapshot: count, hash and ring taken together.
  report.recent = log.Recent();
  report.count = report.recent.empty() ? log.count() : report.recent.back().seq + 1;
  report.hash = report.recent.empty() ? log.hash() : report.recent.back().hash;
  report.status = Clean(std::move(status));
  return report;
}

std::string SerializeReport(const FingerprintReport& report) {
  std::string out = absl::StrCat(kReportHeader, "\nrank\t", report.rank, "\ncount\t",
                                 report.count, "\nhash\t", report.hash, "\nstatus\t",
                                 Clean(report.status), "\n");
  for (const CollectiveRecord& r : report.recent) {
    absl::StrAppend(&out, "record\t", r.seq, "\t", static_cast<int>(r.op), "\t", r.numel, "\t",
                    Clean(r.dtype), "\t", r.argument, "\t", Clean(r.unit), "\t",
                    Clean(r.phase), "\t", r.hash, "\t", r.issued_at_us, "\n");
  }
  return out;
}

absl::StatusOr<FingerprintReport> ParseReport(const std::string& text) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  if (lines.empty() || lines[0] != kReportHeader) {
    return absl::InvalidArgumentError("not a fingerprint report (bad header)");
  }
  FingerprintReport report;
  bool have_rank = false, have_count = false, have_hash = false;
  for (size_t i = 1; i < lines.size(); ++i) {
    std::vector<std::string> f = absl::StrSplit(lines[i], '\t');
    auto bad = [&] {
      return absl::InvalidArgumentError(
          absl::StrCat("fingerprint report: malformed line ", i + 1, ": '", lines[i], "'"));
    };
    if (f[0] == "rank" && f.size() == 2) {
      if (!absl::SimpleAtoi(f[1], &report.rank)) return bad();
      have_rank = true;
    } else if (f[0] == "count" && f.size() == 2) {
      if (!absl::SimpleAtoi(f[1], &report.count)) return bad();
      have_count = true;
    } else if (f[0] == "hash" && f.size() == 2) {
      if (!absl::SimpleAtoi(f[1], &report.hash)) return bad();
      have_hash = true;
    } else if (f[0] == "status" && f.size() == 2) {
      report.status = f[1];
    } else if (f[0] == "record" && f.size() == 10) {
      CollectiveRecord r;
      int op = 0;
      if (!absl::SimpleAtoi(f[1], &r.seq) || !absl::SimpleAtoi(f[2], &op) || op < 0 ||
          op >= kNumCollectiveOps || !absl::SimpleAtoi(f[3], &r.numel) ||
          !absl::SimpleAtoi(f[5], &r.argument) || !absl::SimpleAtoi(f[8], &r.hash) ||
          !absl::SimpleAtoi(f[9], &r.issued_at_us)) {
        return bad();
      }
      r.op = static_cast<CollectiveOp>(op);
      r.dtype = f[4];
      r.unit = f[6];
      r.phase = f[7];
      if (!report.recent.empty() && r.seq != report.recent.back().seq + 1) return bad();
      report.recent.push_back(std::move(r));
    } else {
      return bad();
    }
  }
  if (!have_rank || !have_count || !have_hash) {
    return absl::InvalidArgumentError("fingerprint report: rank, count or hash missing");
  }
  if (!report.recent.empty() && report.recent.back().seq + 1 != report.count) {
    return absl::InvalidArgumentError("fingerprint report: records do not end at its count");
  }
  return report;
}

bool HistoriesAgree(const std::vector<std::optional<FingerprintReport>>& reports) {
  const FingerprintReport* first = nullptr;
  for (const auto& report : reports) {
    if (!report) continue;
    if (first == nullptr) {
      first = &*report;
    } else if (report->count != first->count || report->hash != first->hash) {
      return false;
    }
  }
  return true;
}

std::string DescribeDivergence(const std::vector<std::optional<FingerprintReport>>& reports,
                               std::chrono::milliseconds waited) {
  std::vector<const FingerprintReport*> present;
  std::vector<int> silent;
  for (size_t r = 0; r < reports.size(); ++r) {
    if (reports[r]) {
      present.push_back(&*reports[r]);
    } else {
      silent.push_back(static_cast<int>(r));
    }
  }
  // The first sequence number every present ring still holds, and the last
  // any rank issued.
  int64_t first_common = 0, last = 0;
  for (const FingerprintReport* report : present) {
    first_common = std::max<int64_t>(
        first_common, report->count - static_cast<int64_t>(report->recent.size()));
    last = std::max(last, report->count);
  }
  std::string out = DescribeFirstDivergence(present, first_common, last);
  if (out.empty() && !present.empty()) {
    bool counts_differ = false;
    for (const FingerprintReport* report : present) {
      counts_differ |= report->count != present.front()->count;
    }
    out += counts_differ ? "  no recorded collective differs, but the ranks issued different "
                           "numbers of collectives\n"
                         : "  the reporting ranks' histories agree\n";
  }
  out += DescribeLateRanks(present, last);
  out += DescribeEachRank(present);
  if (!silent.empty()) {
    absl::StrAppend(&out, "  ", RankList(silent), " sent no report within ", waited.count(),
                    " ms: dead, stuck outside a collective of this group, or still in one "
                    "that has not timed out\n");
  }
  return out;
}

}  // namespace fsdp
