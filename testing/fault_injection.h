// Fault injection for multi-rank tests: a Collectives that passes every
// collective to another one, except those a test told it to break.
//
//   FaultInjectingCollectives faulty(comm);     // comm: the rank's group
//   if (comm.rank() == 1) {
//     faulty.Inject({.kind = FaultKind::kSkip, .unit = "blocks.1",
//                    .phase = "forward"});
//   }
//   ... wrap the model over `faulty` and train ...
//
// A fault fires once, at the first collective issued after Inject that
// matches all of its filters (operation, label unit and phase, and the
// index among matching collectives). The inner group receives the label of
// each collective, so its fingerprints and the errors explaining a failure
// name the units as the caller set them; a changed or skipped collective is
// recorded by the inner group as what was actually sent (or not at all),
// exactly as a rank with that bug would record it.
#ifndef FSDP_TESTING_FAULT_INJECTION_H_
#define FSDP_TESTING_FAULT_INJECTION_H_

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/collectives.h"
#include "testing/multi_rank.h"

namespace fsdp::testing {

enum class FaultKind {
  kDelay,         // Wait `delay` before issuing the collective.
  kFail,          // Do not issue it; its Wait() throws "injected failure".
  kSkip,          // Do not issue it; report success (a rank skipping it).
  kMismatchSize,  // Issue it with one element less per rank.
  kMismatchOp,    // Issue a broadcast of the same buffer instead.
  kRunAfter,      // Issue it, wait for it, then call `run_after`: a test
                  // that changes the world between two collectives (a file
                  // truncated after the ranks agreed to read it).
};

const char* FaultKindName(FaultKind kind);

struct Fault {
  FaultKind kind = FaultKind::kFail;
  // Filters; unset or empty matches anything.
  std::optional<CollectiveOp> op;
  std::string unit;
  std::string phase;
  // Fire at the `occurrence`-th matching collective (0: the first).
  int occurrence = 0;
  std::chrono::milliseconds delay{0};  // kDelay.
  std::function<void()> run_after;     // kRunAfter.
};

class FaultInjectingCollectives final : public Collectives {
 public:
  // `inner` must outlive this object.
  explicit FaultInjectingCollectives(Collectives& inner);

  void Inject(const Fault& fault);
  // Faults that have fired so far, in order ("skip all-gather #12 ...").
  std::vector<std::string> fired() const;

 protected:
  std::unique_ptr<CollectiveWork> DoAllGather(const at::Tensor& output,
                                              const at::Tensor& input) override;
  std::unique_ptr<CollectiveWork> DoReduceScatter(const at::Tensor& output,
                                                  const at::Tensor& input,
                                                  ReduceOp op) override;
  std::unique_ptr<CollectiveWork> DoAllReduce(const at::Tensor& tensor, ReduceOp op) override;
  std::unique_ptr<CollectiveWork> DoBroadcast(const at::Tensor& tensor, int root) override;
  std::unique_ptr<CollectiveWork> DoAllToAll(const at::Tensor& output,
                                             const at::Tensor& input) override;
  void DoBarrier() override;

 private:
  // The fault that fires at the collective just recorded, if any.
  std::optional<Fault> Match();
  // Applies kDelay/kFail/kSkip; returns the work to hand back for kFail and
  // kSkip (null: issue the collective).
  std::unique_ptr<CollectiveWork> Preempt(const std::optional<Fault>& fault);
  // `work` as issued, or for kRunAfter waited for, followed by `run_after`
  // and handed back completed.
  static std::unique_ptr<CollectiveWork> Follow(const std::optional<Fault>& fault,
                                                std::unique_ptr<CollectiveWork> work);

  Collectives& inner_;
  mutable std::mutex mu_;
  struct Pending {
    Fault fault;
    int seen = 0;
  };
  std::vector<Pending> pending_;
  std::vector<std::string> fired_;
};

// Runs `body` on `world_size` thread ranks (RunOnThreadRanks) and returns
// each rank's error message, "" for ranks that finished; gtest failures
// inside the body are reported as usual.
std::vector<std::string> RankErrors(int world_size, const RankBody& body,
                                    const MultiRankOptions& options);

// Threads of this process now (/proc/self/task): a fault test compares it
// before and after to show that no thread was left behind.
int ThreadCount();

}  // namespace fsdp::testing

#endif  // FSDP_TESTING_FAULT_INJECTION_H_
