#include "comm/hierarchical_collectives.h"

#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "ATen/core/grad_mode.h"
#include "absl/strings/str_cat.h"
#include "c10/util/Exception.h"
#include "comm/ordered_worker.h"
#include "comm/work_result.h"

namespace fsdp {
namespace {

class HierarchicalCollectives;

// The works of one stage: the job that issues it, and the collectives'
// works the job leaves in `works` (read only once the job is done).
struct Stage {
  using Works = std::vector<std::unique_ptr<CollectiveWork>>;
  std::shared_ptr<CollectiveWork> job;
  std::shared_ptr<Works> works = std::make_shared<Works>();
};

// A two-level collective: done when its second stage's job (which waited
// for the first stage) and that stage's collectives are done. On a failure, both levels fail what
// they have not started (HierarchicalCollectives::Fail), and this waits for a first stage still in
// flight here, on the waiting thread, not on a worker, whose later jobs must fail at once. Errors
// name `what`.
class StageWork final : public CollectiveWork {
 public:
  StageWork(HierarchicalCollectives* group, std::string what, Stage first, Stage second)
      : group_(group),
        what_(std::move(what)),
        first_(std::move(first)),
        second_(std::move(second)) {}
  ~StageWork() override {
    if (result_.done()) return;
    try {
      Wait();
    } catch (...) {
      // Destructors cannot throw; the caller chose not to wait for the error.
    }
  }
  void Wait() override;

 private:
  HierarchicalCollectives* group_;
  const std::string what_;
  Stage first_;
  Stage second_;
  WorkResult result_;
};

class HierarchicalCollectives final : public Collectives {
 public:
  HierarchicalCollectives(Collectives& world, Collectives& host, Collectives& cross_host)
      : Collectives(world.rank(), world.world_size()),
        world_(world),
        host_(host),
        cross_(cross_host) {
    TORCH_CHECK(&world != &host && &world != &cross_host && &host != &cross_host, Describe(),
                ": hierarchical collectives: the world, host and cross-host groups must be "
                "three groups (one thread issues on each)");
    TORCH_CHECK(host.world_size() * cross_host.world_size() == world.world_size(), Describe(),
                ": hierarchical collectives: a host group of ", host.world_size(),
                " ranks and a cross-host group of ", cross_host.world_size(),
                " do not make the world's ", world.world_size());
    // Every rank checks every rank's places, so that all refuse together
    // instead of the well-placed ones waiting for peers that refused.
    const std::vector<std::string> places =
        AllGatherBytes(world, absl::StrCat(host.rank(), " ", cross_host.rank()));
    for (int r = 0; r < world.world_size(); ++r) {
      int in_host = -1, across = -1;
      std::istringstream(places[r]) >> in_host >> across;
      TORCH_CHECK(r == across * host.world_size() + in_host, Describe(),
                  ": hierarchical collectives: world rank ", r, " is rank ", in_host,
                  " of its host group and ", across, " of its cross-host group, which makes it ",
                  across * host.world_size() + in_host, " (ranks must be numbered host by host)");
    }
    // Their copies record no autograd history, whatever the tensors.
    const auto no_grad = [] { return std::make_shared<at::NoGradGuard>(); };
    cross_worker_.emplace(absl::StrCat(Describe(), " (across hosts)"), no_grad);
    host_worker_.emplace(absl::StrCat(Describe(), " (within the host)"), no_grad);
  }

  bool HandlesDevice(const c10::Device& device) const override { return device.is_cpu(); }

 protected:
  // out[(h * L + l) * n] = shard of rank (h, l): the H shards of this
  // rank's local index across hosts, then, for each host h, the host's L
  // shards h gathered straight into out's rows for host h (contiguous), so
  // that nothing rearranges them afterwards.
  std::unique_ptr<CollectiveWork> DoAllGather(const at::Tensor& output,
                                              const at::Tensor& input) override {
    const int64_t hosts = cross_.world_size(), per_host = host_.world_size();
    const int64_t n = input.numel();
    at::Tensor across = at::empty({hosts * n}, input.options());
    Stage first, second;
    first.job = cross_worker_->Enqueue(Guarded(
        [this, across, input, works = first.works, unit = label_unit(), phase = label_phase()] {
          CollectiveLabel label(cross_, unit, phase);
          works->push_back(cross_.AllGatherIntoTensor(across, input));
        }));
    second.job = host_worker_->Enqueue(
        Guarded([this, first, works = second.works, across, out = output.view({-1}), hosts,
                 per_host, n, unit = label_unit(), phase = label_phase()] {
          WaitFor(first);
          CollectiveLabel label(host_, unit, phase);
          for (int64_t h = 0; h < hosts; ++h) {
            works->push_back(host_.AllGatherIntoTensor(
                out.narrow(0, h * per_host * n, per_host * n), across.narrow(0, h * n, n)));
          }
        }));
    return std::make_unique<StageWork>(this, What("all-gather", output), std::move(first),
                                       std::move(second));
  }

  // Segment h of the input (ranks (h, 0) ... (h, L-1)) is reduce-scattered
  // over this host, so that local rank l holds this host's sum of the
  // chunks of ranks (0, l) ... (H-1, l) without a copy arranging them; the
  // hosts' sum of chunk h of that lands on rank (h, l).
  std::unique_ptr<CollectiveWork> DoReduceScatter(const at::Tensor& output, const at::Tensor& input,
                                                  ReduceOp op) override {
    const int64_t hosts = cross_.world_size(), per_host = host_.world_size();
    const int64_t n = output.numel();
    at::Tensor host_sum = at::empty({hosts * n}, output.options());
    Stage first, second;
    first.job = host_worker_->Enqueue(
        Guarded([this, host_sum, in = input.view({-1}), op, hosts, per_host, n, works = first.works,
                 unit = label_unit(), phase = label_phase()] {
          CollectiveLabel label(host_, unit, phase);
          for (int64_t h = 0; h < hosts; ++h) {
            works->push_back(host_.ReduceScatterTensor(
                host_sum.narrow(0, h * n, n), in.narrow(0, h * per_host * n, per_host * n), op));
          }
        }));
    second.job =
        cross_worker_->Enqueue(Guarded([this, first, works = second.works, host_sum, output, op,
                                        unit = label_unit(), phase = label_phase()] {
          WaitFor(first);
          CollectiveLabel label(cross_, unit, phase);
          works->push_back(cross_.ReduceScatterTensor(output, host_sum, op));
        }));
    return std::make_unique<StageWork>(this, What("reduce-scatter", input), std::move(first),
                                       std::move(second));
  }

  // The world group's, labelled with this group's label so that its
  // failure explanations name the unit and phase.
  std::unique_ptr<CollectiveWork> DoAllReduce(const at::Tensor& tensor, ReduceOp op) override {
    CollectiveLabel label(world_, label_unit(), label_phase());
    return world_.AllReduce(tensor, op);
  }
  std::unique_ptr<CollectiveWork> DoBroadcast(const at::Tensor& tensor, int root) override {
    CollectiveLabel label(world_, label_unit(), label_phase());
    return world_.Broadcast(tensor, root);
  }
  std::unique_ptr<CollectiveWork> DoAllToAll(const at::Tensor& output,
                                             const at::Tensor& input) override {
    CollectiveLabel label(world_, label_unit(), label_phase());
    return world_.AllToAll(output, input);
  }
  // Behind the queued collectives, as issued: a barrier of every
  // cross-host group, then of every host, is one of the world.
  void DoBarrier() override {
    std::shared_ptr<CollectiveWork> across =
        cross_worker_->Enqueue(Guarded([this] { cross_.Barrier(); }));
    host_worker_
        ->Enqueue(Guarded([this, across] {
          across->Wait();
          host_.Barrier();
        }))
        ->Wait();
  }

 private:
  // `body` as a job of either level: a failure fails what neither level
  // has started (each worker already fails its own later jobs), so that
  // neither goes on with collectives the other has abandoned, each waiting
  // its timeout.
  std::function<void()> Guarded(std::function<void()> body) {
    return [this, body = std::move(body)] {
      const std::string error = ErrorMessageOf(body);
      if (error.empty()) return;
      Fail(error);
      TORCH_CHECK(false, error);
    };
  }
  friend class StageWork;
  // A first stage, from the job that issues the second.
  static void WaitFor(const Stage& first) {
    first.job->Wait();
    for (const std::unique_ptr<CollectiveWork>& work : *first.works) work->Wait();
  }
  void Fail(const std::string& failure) {
    cross_worker_->Fail(failure);
    host_worker_->Fail(failure);
  }
  std::string What(const char* op, const at::Tensor& full) const {
    return absl::StrCat(Describe(), " of a two-level group: ", op, " of ", full.numel(), " ",
                        c10::toString(full.scalar_type()), " elements");
  }

  Collectives& world_;
  Collectives& host_;
  Collectives& cross_;
  // Last: destroyed (their queues run, their threads joined) before the
  // rest. The host level's first: its jobs wait on cross-level jobs queued
  // before them, which the cross worker, still running, completes; the
  // cross level's jobs then find the host-level ones they wait on done.
  std::optional<OrderedWorker> cross_worker_;
  std::optional<OrderedWorker> host_worker_;
};

void StageWork::Wait() {
  result_.Wait([this] {
    std::string error = ErrorMessageOf([this] {
      second_.job->Wait();
      // Filled by the job before it completed, read after it.
      for (const std::unique_ptr<CollectiveWork>& work : *second_.works) work->Wait();
    });
    if (!error.empty()) {
      if (error.rfind(what_, 0) != 0) error = absl::StrCat(what_, " failed: ", error);
      group_->Fail(error);
      // A first stage the second's job did not wait for (it failed or did
      // not run) is waited for here, on the waiting thread; its error is
      // the cause of the one above or a consequence of it.
      ErrorMessageOf([this] { first_.job->Wait(); });
    }
    first_.works->clear();
    second_.works->clear();
    return error;
  });
}

}  // namespace

std::unique_ptr<Collectives> CreateHierarchicalCollectives(Collectives& world, Collectives& host,
                                                           Collectives& cross_host) {
  return std::make_unique<HierarchicalCollectives>(world, host, cross_host);
}

}  // namespace fsdp
