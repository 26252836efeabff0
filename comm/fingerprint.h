// Collective fingerprints: what each collective of a group was, so that the
// ranks can compare their histories and say where they parted.
//
// Every collective a Collectives object issues is recorded here (the base
// class does it for every implementation): its sequence number, operation,
// element count, dtype, root or reduce op, and the label its caller set (the
// FSDP unit and phase: "forward", "backward", "state dict", ...). A rank
// keeps its last `capacity` records in a ring and a rolling hash over all of
// them, so two ranks agree on their whole history iff their counts and
// hashes agree (up to 64-bit hash collisions), and the ring says where they
// first differed when the difference is recent.
//
// Ranks compare histories as FingerprintReports, serialized as text: in a
// periodic check (Collectives::VerifyConsistency) and when a collective
// fails. DescribeDivergence turns every rank's report into the error users
// read: the first diverging collective, which ranks issued what there, and
// what each rank was doing last.
#ifndef FSDP_COMM_FINGERPRINT_H_
#define FSDP_COMM_FINGERPRINT_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace fsdp {

// The operations of the Collectives interface, for counters, fingerprints
// and error messages.
enum class CollectiveOp : int {
  kAllGather = 0,
  kReduceScatter,
  kAllReduce,
  kBroadcast,
  kBarrier,
  kAllToAll,  // Last: reports carry ops as numbers.
};
inline constexpr int kNumCollectiveOps = 6;

const char* CollectiveOpName(CollectiveOp op);

// One collective as its issuing rank saw it.
struct CollectiveRecord {
  int64_t seq = 0;  // 0-based, per group and rank.
  CollectiveOp op = CollectiveOp::kBarrier;
  int64_t numel = 0;    // Of the full buffer (the all-gather's output, ...).
  std::string dtype;    // "Float", "BFloat16", ... ("" for a barrier).
  int argument = 0;     // Broadcast root; reduce op (0 sum, 1 avg); else 0.
  std::string unit;     // The caller's label ("" when none was set).
  std::string phase;
  uint64_t hash = 0;    // Rolling hash of records 0..seq (this one included).
  // When it was issued (system clock, µs since the epoch): not part of the
  // collective's identity; says which rank came late.
  int64_t issued_at_us = 0;

  // Whether two ranks issued the same collective here (all but the hash).
  bool SameCollective(const CollectiveRecord& other) const;
};

// "#57 all-gather of 4096 Float (unit 'blocks.1', forward)".
std::string DescribeRecord(const CollectiveRecord& record);

// A rank's collective history: a ring of the last records and the rolling
// hash of all. Thread-safe (collectives are issued on one thread, but a
// failure may be explained on another).
class FingerprintLog {
 public:
  explicit FingerprintLog(int capacity = 128);

  // Appends the next record and returns it (with its seq and hash).
  CollectiveRecord Append(CollectiveOp op, int64_t numel, std::string dtype, int argument,
                          std::string unit, std::string phase);

  int64_t count() const;   // Collectives recorded so far.
  CollectiveRecord Last() const;  // REQUIRES: count() > 0.
  uint64_t hash() const;   // Of all of them; 0 before the first.
  std::vector<CollectiveRecord> Recent() const;  // Oldest first.

 private:
  const int capacity_;
  mutable std::mutex mu_;
  int64_t count_ = 0;
  uint64_t hash_ = 0;
  std::deque<CollectiveRecord> recent_;
};

// What one rank tells the others about its history.
struct FingerprintReport {
  int rank = 0;
  int64_t count = 0;
  uint64_t hash = 0;
  // Why it reports: "check", or the error that stopped it ("timed out in
  // ...", "stopped: <exception>").
  std::string status;
  std::vector<CollectiveRecord> recent;
};

FingerprintReport MakeReport(int rank, const FingerprintLog& log, std::string status);

// A line-based text form; ParseReport(SerializeReport(r)) == r. Labels may
// hold any bytes but newlines and tabs, which are replaced by spaces.
std::string SerializeReport(const FingerprintReport& report);
absl::StatusOr<FingerprintReport> ParseReport(const std::string& text);

// Whether the reports present agree on the whole history (equal counts and
// hashes).
bool HistoriesAgree(const std::vector<std::optional<FingerprintReport>>& reports);

// A multi-line explanation for an error message, from every rank's report
// (index = rank; nullopt for a rank that sent none within `waited`): the
// first collective whose records differ and who issued what there, ranks
// that issued fewer collectives than others, ranks that issued the last
// common collective late, ranks that sent no report, and each rank's status
// and last collective.
std::string DescribeDivergence(const std::vector<std::optional<FingerprintReport>>& reports,
                               std::chrono::milliseconds waited);

// A channel the ranks of a group share besides the group itself (the
// TCPStore they met through), where they compare reports when the group
// can no longer be trusted: after a failure, or to check it. Rounds are
// named by the caller; every rank publishes at most once per round.
class FingerprintExchange {
 public:
  virtual ~FingerprintExchange() = default;

  virtual void Publish(const std::string& round, const std::string& report) = 0;

  // Every rank's report of `round` (index = rank), waiting up to `timeout`
  // for those not yet published; nullopt for the ranks still missing then.
  virtual std::vector<std::optional<std::string>> Collect(
      const std::string& round, std::chrono::milliseconds timeout) = 0;

  // Drops this rank's report of `round` (every rank has read it).
  virtual void Forget(const std::string& round) = 0;
};

}  // namespace fsdp

#endif  // FSDP_COMM_FINGERPRINT_H_
