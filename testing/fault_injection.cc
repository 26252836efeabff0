#include "testing/fault_injection.h"

#include <dirent.h>

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "c10/util/Exception.h"

namespace fsdp::testing {

const char* FaultKindName(FaultKind kind) {
  switch (kind) {
    case FaultKind::kDelay:
      return "delay";
    case FaultKind::kFail:
      return "fail";
    case FaultKind::kSkip:
      return "skip";
    case FaultKind::kMismatchSize:
      return "mismatch size";
    case FaultKind::kMismatchOp:
      return "mismatch op";
    case FaultKind::kRunAfter:
      return "run after";
  }
  return "invalid";
}

FaultInjectingCollectives::FaultInjectingCollectives(Collectives& inner)
    : Collectives(inner.rank(), inner.world_size()), inner_(inner) {}

void FaultInjectingCollectives::Inject(const Fault& fault) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.push_back({fault, 0});
}

std::vector<std::string> FaultInjectingCollectives::fired() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fired_;
}

std::optional<Fault> FaultInjectingCollectives::Match() {
  const CollectiveRecord record = fingerprints().Last();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    const Fault& f = it->fault;
    if ((f.op && *f.op != record.op) || (!f.unit.empty() && f.unit != record.unit) ||
        (!f.phase.empty() && f.phase != record.phase)) {
      continue;
    }
    if (it->seen++ < f.occurrence) continue;
    Fault fault = f;
    fired_.push_back(absl::StrCat(FaultKindName(f.kind), " ", DescribeRecord(record)));
    pending_.erase(it);
    return fault;
  }
  return std::nullopt;
}

std::unique_ptr<CollectiveWork> FaultInjectingCollectives::Preempt(
    const std::optional<Fault>& fault) {
  if (!fault) return nullptr;
  switch (fault->kind) {
    case FaultKind::kDelay:
      std::this_thread::sleep_for(fault->delay);
      return nullptr;
    case FaultKind::kFail:
      return MakeFailedWork(
          absl::StrCat(Describe(), ": injected failure of ", fired().back()));
    case FaultKind::kSkip:
      return MakeCompletedWork();
    default:
      return nullptr;
  }
}

std::unique_ptr<CollectiveWork> FaultInjectingCollectives::Follow(
    const std::optional<Fault>& fault, std::unique_ptr<CollectiveWork> work) {
  if (!fault || fault->kind != FaultKind::kRunAfter) return work;
  work->Wait();
  fault->run_after();
  return MakeCompletedWork();
}

std::unique_ptr<CollectiveWork> FaultInjectingCollectives::DoAllGather(const at::Tensor& output,
                                                                       const at::Tensor& input) {
  const std::optional<Fault> fault = Match();
  if (auto work = Preempt(fault)) return work;
  CollectiveLabel label(inner_, label_unit(), label_phase());
  if (fault && fault->kind == FaultKind::kMismatchSize) {
    const int64_t n = input.numel() - 1;
    return inner_.AllGatherIntoTensor(output.narrow(0, 0, n * world_size()),
                                      input.narrow(0, 0, n));
  }
  if (fault && fault->kind == FaultKind::kMismatchOp) return inner_.Broadcast(output, 0);
  return Follow(fault, inner_.AllGatherIntoTensor(output, input));
}

std::unique_ptr<CollectiveWork> FaultInjectingCollectives::DoReduceScatter(
    const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  const std::optional<Fault> fault = Match();
  if (auto work = Preempt(fault)) return work;
  CollectiveLabel label(inner_, label_unit(), label_phase());
  if (fault && fault->kind == FaultKind::kMismatchSize) {
    const int64_t n = output.numel() - 1;
    return inner_.ReduceScatterTensor(output.narrow(0, 0, n),
                                      input.narrow(0, 0, n * world_size()), op);
  }
  if (fault && fault->kind == FaultKind::kMismatchOp) return inner_.Broadcast(input, 0);
  return Follow(fault, inner_.ReduceScatterTensor(output, input, op));
}

std::unique_ptr<CollectiveWork> FaultInjectingCollectives::DoAllReduce(const at::Tensor& tensor,
                                                                       ReduceOp op) {
  const std::optional<Fault> fault = Match();
  if (auto work = Preempt(fault)) return work;
  CollectiveLabel label(inner_, label_unit(), label_phase());
  if (fault && fault->kind == FaultKind::kMismatchSize) {
    return inner_.AllReduce(tensor.view({-1}).narrow(0, 0, tensor.numel() - 1), op);
  }
  if (fault && fault->kind == FaultKind::kMismatchOp) return inner_.Broadcast(tensor, 0);
  return Follow(fault, inner_.AllReduce(tensor, op));
}

std::unique_ptr<CollectiveWork> FaultInjectingCollectives::DoAllToAll(const at::Tensor& output,
                                                                      const at::Tensor& input) {
  const std::optional<Fault> fault = Match();
  if (auto work = Preempt(fault)) return work;
  CollectiveLabel label(inner_, label_unit(), label_phase());
  if (fault && fault->kind == FaultKind::kMismatchSize) {
    const int64_t n = input.numel() - world_size();
    return inner_.AllToAll(output.narrow(0, 0, n), input.narrow(0, 0, n));
  }
  if (fault && fault->kind == FaultKind::kMismatchOp) return inner_.Broadcast(input, 0);
  return Follow(fault, inner_.AllToAll(output, input));
}

std::unique_ptr<CollectiveWork> FaultInjectingCollectives::DoBroadcast(const at::Tensor& tensor,
                                                                       int root) {
  const std::optional<Fault> fault = Match();
  if (auto work = Preempt(fault)) return work;
  CollectiveLabel label(inner_, label_unit(), label_phase());
  if (fault && fault->kind == FaultKind::kMismatchSize) {
    return inner_.Broadcast(tensor.view({-1}).narrow(0, 0, tensor.numel() - 1), root);
  }
  if (fault && fault->kind == FaultKind::kMismatchOp) {
    return inner_.AllReduce(tensor, ReduceOp::kSum);
  }
  return Follow(fault, inner_.Broadcast(tensor, root));
}

void FaultInjectingCollectives::DoBarrier() {
  const std::optional<Fault> fault = Match();
  if (auto work = Preempt(fault)) {
    work->Wait();
    return;
  }
  CollectiveLabel label(inner_, label_unit(), label_phase());
  inner_.Barrier();
  if (fault && fault->kind == FaultKind::kRunAfter) fault->run_after();
}

std::vector<std::string> RankErrors(int world_size, const RankBody& body,
                                    const MultiRankOptions& options) {
  std::vector<std::string> errors(world_size);
  const absl::Status status = RunOnThreadRanks(
      world_size,
      [&](Collectives& comm) {
        try {
          body(comm);
        } catch (const c10::Error& e) {
          errors[comm.rank()] = e.msg();
          throw;
        } catch (const std::exception& e) {
          errors[comm.rank()] = e.what();
          throw;
        }
      },
      options);
  (void)status;  // The errors say it all, rank by rank.
  return errors;
}

int ThreadCount() {
  int n = 0;
  if (DIR* dir = ::opendir("/proc/self/task")) {
    while (const dirent* entry = ::readdir(dir)) n += entry->d_name[0] != '.';
    ::closedir(dir);
  }
  return n;
}

}  // namespace fsdp::testing
