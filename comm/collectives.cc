#include "comm/collectives.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "c10/util/Exception.h"
#include "comm/work_result.h"

namespace fsdp {
namespace {

class CompletedWork final : public CollectiveWork {
 public:
  void Wait() override {}
};

class FailedWork final : public CollectiveWork {
 public:
  explicit FailedWork(std::string error) : error_(std::move(error)) {}
  void Wait() override { TORCH_CHECK(false, error_); }

 private:
  std::string error_;
};

// The operations that only move bytes take bytes (uint8) too: coded
// payloads (comm/block_quantization.h).
bool IsSupportedDtype(at::ScalarType dtype, CollectiveOp op) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
      return true;
    case at::kByte:
      return op == CollectiveOp::kAllGather || op == CollectiveOp::kBroadcast ||
             op == CollectiveOp::kAllToAll;
    default:
      return false;
  }
}

// Checks one tensor argument of operation `op`; `role` is "input", "output"
// or "tensor".
void CheckTensor(const std::string& who, CollectiveOp op, const char* role,
                 const at::Tensor& t, bool require_1d, const Collectives& group) {
  TORCH_CHECK(t.defined(), who, ": ", CollectiveOpName(op), ": ", role,
              " is an undefined tensor");
  TORCH_CHECK(IsSupportedDtype(t.scalar_type(), op), who, ": ", CollectiveOpName(op), ": ", role,
              " has dtype ", t.scalar_type(),
              "; supported are Float, Double, Half and BFloat16 (and Byte for all-gather, "
              "all-to-all and broadcast)");
  TORCH_CHECK(group.HandlesDevice(t.device()), who, ": ", CollectiveOpName(op), ": ", role,
              " is on ", t.device(), ", which this group does not handle (",
              group.DevicesHandled(), ")");
  TORCH_CHECK(t.is_contiguous(), who, ": ", CollectiveOpName(op), ": ", role,
              " must be contiguous");
  TORCH_CHECK(!require_1d || t.dim() == 1, who, ": ", CollectiveOpName(op), ": ",
              role, " must be 1-D (a flat buffer) but has shape ", t.sizes());
}

// Reports by rank; nullopt for missing or damaged ones (a damaged report
// counts as none rather than being trusted).
std::vector<std::optional<FingerprintReport>> ParseReports(
    const std::vector<std::optional<std::string>>& texts, int world_size) {
  std::vector<std::optional<FingerprintReport>> reports(world_size);
  for (int r = 0; r < world_size && r < static_cast<int>(texts.size()); ++r) {
    if (!texts[r]) continue;
    absl::StatusOr<FingerprintReport> report = ParseReport(*texts[r]);
    if (report.ok() && report->rank == r) reports[r] = *std::move(report);
  }
  return reports;
}

// Checks the (full, shard) pair of an all-gather or a reduce-scatter.
void CheckFlatPair(const std::string& who, CollectiveOp op, const Collectives& group,
                   const at::Tensor& full, const char* full_role,
                   const at::Tensor& shard, const char* shard_role) {
  const int world_size = group.world_size();
  CheckTensor(who, op, full_role, full, /*require_1d=*/true, group);
  CheckTensor(who, op, shard_role, shard, /*require_1d=*/true, group);
  TORCH_CHECK(full.device() == shard.device(), who, ": ", CollectiveOpName(op), ": ",
              full_role, " is on ", full.device(), " but ", shard_role, " is on ",
              shard.device());
  TORCH_CHECK(full.scalar_type() == shard.scalar_type(), who, ": ",
              CollectiveOpName(op), ": ", full_role, " dtype ", full.scalar_type(),
              " does not match ", shard_role, " dtype ", shard.scalar_type());
  TORCH_CHECK(full.numel() == world_size * shard.numel(), who, ": ",
              CollectiveOpName(op), ": ", full_role, " has ", full.numel(),
              " elements but must have world_size * ", shard_role, ".numel() = ",
              world_size, " * ", shard.numel(), " = ", world_size * shard.numel());
}

}  // namespace

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
  }
  return "invalid";
}

std::unique_ptr<CollectiveWork> MakeCompletedWork() {
  return std::make_unique<CompletedWork>();
}

std::unique_ptr<CollectiveWork> MakeFailedWork(std::string error) {
  return std::make_unique<FailedWork>(std::move(error));
}

// A work whose failure is explained by the ranks' fingerprints.
class ExplainedWork final : public CollectiveWork {
 public:
  ExplainedWork(Collectives* group, CollectiveRecord record,
                std::unique_ptr<CollectiveWork> work)
      : group_(group), record_(std::move(record)), work_(std::move(work)) {}

  // The inner work's destructor waits; an error nobody waits for is not
  // worth blocking a destructor on the other ranks' reports.
  ~ExplainedWork() override = default;

  void Wait() override {
    result_.Wait([this] {
      const std::string error = ErrorMessageOf([this] { work_->Wait(); });
      work_.reset();
      if (error.empty()) return error;
      std::string cause = error.substr(0, error.find('\n'));
      // "<who>: <op> failed: <why>": the record says who and what.
      if (const size_t failed = cause.find(" failed: "); failed != std::string::npos) {
        cause = cause.substr(failed + 9);
      }
      return absl::StrCat(error, "\n",
                          group_->ExplainFailure(absl::StrCat(
                              "failed in ", DescribeRecord(record_), ": ", cause)));
    });
  }

 private:
  Collectives* group_;
  CollectiveRecord record_;
  std::unique_ptr<CollectiveWork> work_;
  WorkResult result_;
};

Collectives::Collectives(int rank, int world_size)
    : rank_(rank), world_size_(world_size), fingerprints_(std::make_unique<FingerprintLog>()) {
  TORCH_CHECK(world_size > 0 && rank >= 0 && rank < world_size,
              "Collectives: rank ", rank, " is not in [0, world_size = ", world_size,
              ")");
}

void Collectives::SetLabel(std::string unit, std::string phase) {
  label_unit_ = std::move(unit);
  label_phase_ = std::move(phase);
}

void Collectives::AttachFingerprintExchange(std::shared_ptr<FingerprintExchange> exchange,
                                            const FingerprintOptions& options) {
  TORCH_CHECK(fingerprints_->count() == 0, Describe(),
              ": attach the fingerprint exchange before the first collective");
  TORCH_CHECK(options.capacity >= 1 && options.report_timeout.count() > 0, Describe(),
              ": FingerprintOptions: capacity and report_timeout must be positive");
  exchange_ = std::move(exchange);
  fingerprint_options_ = options;
  fingerprints_ = std::make_unique<FingerprintLog>(options.capacity);
}

CollectiveRecord Collectives::Record(CollectiveOp op, int64_t numel, at::ScalarType dtype,
                                    int argument) {
  CollectiveRecord record =
      fingerprints_->Append(op, numel, op == CollectiveOp::kBarrier ? "" : c10::toString(dtype),
                            argument, label_unit_, label_phase_);
  if (fingerprint_options_.verify_each_collective && exchange_ && world_size_ > 1) {
    VerifyConsistency();
  }
  return record;
}

std::unique_ptr<CollectiveWork> Collectives::Explained(CollectiveRecord record,
                                                       std::unique_ptr<CollectiveWork> work) {
  if (!exchange_ || world_size_ == 1) return work;
  return std::make_unique<ExplainedWork>(this, std::move(record), std::move(work));
}

std::vector<std::optional<FingerprintReport>> Collectives::ExchangeReports(
    const std::string& round, const std::string& status) {
  const std::string mine = SerializeReport(MakeReport(rank_, *fingerprints_, status));
  std::vector<std::optional<std::string>> texts;
  if (exchange_) {
    exchange_->Publish(round, mine);
    texts = exchange_->Collect(round, fingerprint_options_.report_timeout);
  } else {
    for (std::string& text : AllGatherBytes(*this, mine)) texts.emplace_back(std::move(text));
  }
  return ParseReports(texts, world_size_);
}

void Collectives::VerifyConsistency() {
  if (world_size_ == 1) return;
  const std::string round = absl::StrCat("check/", checks_++);
  std::vector<std::optional<FingerprintReport>> reports = ExchangeReports(round, "checking");
  if (exchange_ && checks_ >= 3) {
    // Every rank has read round checks_-3: it published checks_-2 after.
    exchange_->Forget(absl::StrCat("check/", checks_ - 3));
  }
  bool all_present = true;
  for (const auto& report : reports) all_present &= report.has_value();
  if (all_present && HistoriesAgree(reports)) return;
  TORCH_CHECK(false, Describe(), ": collective fingerprint check ", checks_ - 1,
              " failed: the ranks' collective histories differ\n",
              DescribeDivergence(reports, fingerprint_options_.report_timeout));
}

std::string Collectives::ExplainFailure(const std::string& error) {
  std::lock_guard<std::mutex> lock(failure_mu_);
  if (!failure_explanation_.empty()) {
    return "(this group had failed before; that failure's reports:)\n" + failure_explanation_;
  }
  std::vector<std::optional<FingerprintReport>> reports;
  try {
    if (!failure_published_) {
      failure_published_ = true;
      reports = ExchangeReports("failure", error);
    } else {
      // ReportStopped already published; collect only.
      reports = ParseReports(exchange_->Collect("failure", fingerprint_options_.report_timeout),
                             world_size_);
    }
  } catch (const std::exception& e) {
    // The explanation must never hide the failure it explains.
    const std::string what = e.what();
    failure_explanation_ = absl::StrCat(
        "the ranks' reports could not be exchanged (the store is unreachable; the rank "
        "hosting it may be dead): ",
        what.substr(0, what.find('\n')), "\n");
    return failure_explanation_;
  }
  failure_explanation_ = absl::StrCat(
      "what every rank of the group reported:\n",
      DescribeDivergence(reports, fingerprint_options_.report_timeout));
  return failure_explanation_;
}

void Collectives::ReportStopped(const std::string& why) {
  if (!exchange_ || world_size_ == 1) return;
  std::lock_guard<std::mutex> lock(failure_mu_);
  if (failure_published_) return;
  failure_published_ = true;
  try {
    exchange_->Publish(
        "failure", SerializeReport(MakeReport(rank_, *fingerprints_, "stopped: " + why)));
  } catch (...) {
    // Best effort: the store may be gone with the job.
  }
}

CollectiveLabel::CollectiveLabel(Collectives& group, std::string unit, std::string phase)
    : CollectiveLabel(group, nullptr, std::move(unit), std::move(phase)) {}

CollectiveLabel::CollectiveLabel(Collectives& group, Collectives* second, std::string unit,
                                 std::string phase) {
  for (Collectives* g : {&group, second}) {
    if (g == nullptr) continue;
    saved_.push_back({g, g->label_unit(), g->label_phase()});
    g->SetLabel(unit, phase);
  }
}

CollectiveLabel::~CollectiveLabel() {
  for (Saved& s : saved_) s.group->SetLabel(std::move(s.unit), std::move(s.phase));
}

std::string Collectives::Describe() const {
  return "rank " + std::to_string(rank_) + " of " + std::to_string(world_size_);
}

void Collectives::Count(CollectiveOp op, int64_t bytes) {
  const int i = static_cast<int>(op);
  calls_[i].fetch_add(1, std::memory_order_relaxed);
  bytes_[i].fetch_add(bytes, std::memory_order_relaxed);
}

CollectiveCounters Collectives::counters() const {
  CollectiveCounters out;
  for (int i = 0; i < kNumCollectiveOps; ++i) {
    out.calls[i] = calls_[i].load(std::memory_order_relaxed);
    out.bytes[i] = bytes_[i].load(std::memory_order_relaxed);
  }
  return out;
}

void Collectives::ResetCounters() {
  for (int i = 0; i < kNumCollectiveOps; ++i) {
    calls_[i].store(0, std::memory_order_relaxed);
    bytes_[i].store(0, std::memory_order_relaxed);
  }
}

std::unique_ptr<CollectiveWork> Collectives::AllGatherIntoTensor(
    const at::Tensor& output, const at::Tensor& input) {
  CheckFlatPair(Describe(), CollectiveOp::kAllGather, *this, output, "output",
                input, "input");
  Count(CollectiveOp::kAllGather, output.nbytes());
  CollectiveRecord record =
      Record(CollectiveOp::kAllGather, output.numel(), output.scalar_type(), 0);
  if (input.numel() == 0) return MakeCompletedWork();
  if (world_size_ == 1) {
    if (!output.is_same(input)) output.copy_(input);
    return MakeCompletedWork();
  }
  return Explained(std::move(record), DoAllGather(output, input));
}

std::unique_ptr<CollectiveWork> Collectives::ReduceScatterTensor(
    const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  CheckFlatPair(Describe(), CollectiveOp::kReduceScatter, *this, input, "input",
                output, "output");
  TORCH_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, Describe(),
              ": reduce-scatter: invalid ReduceOp ", static_cast<int>(op));
  Count(CollectiveOp::kReduceScatter, input.nbytes());
  CollectiveRecord record = Record(CollectiveOp::kReduceScatter, input.numel(),
                                   input.scalar_type(), static_cast<int>(op));
  if (output.numel() == 0) return MakeCompletedWork();
  if (world_size_ == 1) {
    output.copy_(input);  // The sum and the average over one rank.
    return MakeCompletedWork();
  }
  return Explained(std::move(record), DoReduceScatter(output, input, op));
}

std::unique_ptr<CollectiveWork> Collectives::AllToAll(const at::Tensor& output,
                                                      const at::Tensor& input) {
  const CollectiveOp op = CollectiveOp::kAllToAll;
  CheckTensor(Describe(), op, "output", output, /*require_1d=*/true, *this);
  CheckTensor(Describe(), op, "input", input, /*require_1d=*/true, *this);
  TORCH_CHECK(output.device() == input.device(), Describe(), ": all-to-all: output is on ",
              output.device(), " but input is on ", input.device());
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), Describe(),
              ": all-to-all: output dtype ", output.scalar_type(), " does not match input dtype ",
              input.scalar_type());
  TORCH_CHECK(output.numel() == input.numel() && input.numel() % world_size_ == 0, Describe(),
              ": all-to-all: input and output must have the same number of elements, a multiple "
              "of world_size ",
              world_size_, ", but input has ", input.numel(), " and output ", output.numel());
  TORCH_CHECK(!output.is_same(input), Describe(),
              ": all-to-all: output and input are the same tensor (the exchange is not in place)");
  Count(op, input.nbytes());
  CollectiveRecord record = Record(op, input.numel(), input.scalar_type(), 0);
  if (input.numel() == 0) return MakeCompletedWork();
  if (world_size_ == 1) {
    output.copy_(input);
    return MakeCompletedWork();
  }
  return Explained(std::move(record), DoAllToAll(output, input));
}

std::unique_ptr<CollectiveWork> Collectives::AllReduce(const at::Tensor& tensor,
                                                       ReduceOp op) {
  CheckTensor(Describe(), CollectiveOp::kAllReduce, "tensor", tensor,
              /*require_1d=*/false, *this);
  TORCH_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, Describe(),
              ": all-reduce: invalid ReduceOp ", static_cast<int>(op));
  Count(CollectiveOp::kAllReduce, tensor.nbytes());
  CollectiveRecord record = Record(CollectiveOp::kAllReduce, tensor.numel(),
                                   tensor.scalar_type(), static_cast<int>(op));
  if (tensor.numel() == 0 || world_size_ == 1) return MakeCompletedWork();
  return Explained(std::move(record), DoAllReduce(tensor, op));
}

std::unique_ptr<CollectiveWork> Collectives::Broadcast(const at::Tensor& tensor,
                                                       int root) {
  CheckTensor(Describe(), CollectiveOp::kBroadcast, "tensor", tensor,
              /*require_1d=*/false, *this);
  TORCH_CHECK(root >= 0 && root < world_size_, Describe(), ": broadcast: root ", root,
              " is not a rank of this group (world_size ", world_size_, ")");
  Count(CollectiveOp::kBroadcast, tensor.nbytes());
  CollectiveRecord record =
      Record(CollectiveOp::kBroadcast, tensor.numel(), tensor.scalar_type(), root);
  if (tensor.numel() == 0 || world_size_ == 1) return MakeCompletedWork();
  return Explained(std::move(record), DoBroadcast(tensor, root));
}

void Collectives::Barrier() {
  Count(CollectiveOp::kBarrier, 0);
  const CollectiveRecord record = Record(CollectiveOp::kBarrier, 0, at::kByte, 0);
  if (world_size_ == 1) return;
  if (!exchange_) {
    DoBarrier();
    return;
  }
  const std::string error = ErrorMessageOf([this] { DoBarrier(); });
  if (error.empty()) return;
  TORCH_CHECK(false, error, "\n",
              ExplainFailure(absl::StrCat("failed in ", DescribeRecord(record), ": ",
                                          error.substr(0, error.find('\n')))));
}

void BroadcastBytes(Collectives& group, std::string& bytes, int root) {
  at::Tensor length = at::full({1}, static_cast<double>(bytes.size()), at::kDouble);
  group.Broadcast(length, root)->Wait();
  const int64_t size = static_cast<int64_t>(length.item<double>());
  const int64_t words = std::max<int64_t>(1, (size + 7) / 8);
  at::Tensor payload = at::zeros({words}, at::kDouble);
  if (group.rank() == root && size > 0) std::memcpy(payload.data_ptr(), bytes.data(), size);
  group.Broadcast(payload, root)->Wait();
  bytes.assign(static_cast<const char*>(payload.data_ptr()), size);
}

void BroadcastBytesFromRank0(Collectives& group, Collectives* replicate, std::string& bytes) {
  if (replicate != nullptr) BroadcastBytes(*replicate, bytes, 0);
  BroadcastBytes(group, bytes, 0);
}

std::vector<std::string> AllGatherBytes(Collectives& group, const std::string& mine) {
  const int world = group.world_size();
  at::Tensor lengths = at::empty({world}, at::kDouble);
  group.AllGatherIntoTensor(lengths, at::full({1}, static_cast<double>(mine.size()), at::kDouble))
      ->Wait();
  const int64_t longest = static_cast<int64_t>(lengths.max().item<double>());
  const int64_t words = std::max<int64_t>(1, (longest + 7) / 8);
  at::Tensor padded = at::zeros({words}, at::kDouble);
  if (!mine.empty()) std::memcpy(padded.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({world * words}, at::kDouble);
  group.AllGatherIntoTensor(all, padded)->Wait();
  std::vector<std::string> out;
  for (int r = 0; r < world; ++r) {
    out.emplace_back(static_cast<const char*>(all.data_ptr()) + r * words * 8,
                     static_cast<size_t>(lengths[r].item<double>()));
  }
  return out;
}

}  // namespace fsdp
