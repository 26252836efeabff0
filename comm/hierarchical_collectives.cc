#include "comm/hierarchical_collectives.h"

#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "c10/util/Exception.h"
#include "comm/ordered_worker.h"

namespace fsdp {
namespace {

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
    worker_.emplace(Describe());
  }

  bool HandlesDevice(const c10::Device& device) const override { return device.is_cpu(); }

 protected:
  // out[(h * L + l) * n] = shard of rank (h, l): the H shards of this
  // rank's local index across hosts, then the host's L bundles of them.
  std::unique_ptr<CollectiveWork> DoAllGather(const at::Tensor& output,
                                              const at::Tensor& input) override {
    return worker_->Enqueue([this, output, input, unit = label_unit(), phase = label_phase()] {
      CollectiveLabel label(cross_, &host_, unit, phase);
      const int64_t hosts = cross_.world_size(), per_host = host_.world_size();
      const int64_t n = input.numel();
      at::Tensor across = at::empty({hosts * n}, input.options());
      cross_.AllGatherIntoTensor(across, input)->Wait();
      // bundles[l][h] = shard of rank (h, l).
      at::Tensor bundles = at::empty({per_host * hosts * n}, input.options());
      host_.AllGatherIntoTensor(bundles, across)->Wait();
      output.view({hosts, per_host, n}).copy_(bundles.view({per_host, hosts, n}).transpose(0, 1));
    });
  }

  // Chunk l of the arranged input is the segments of ranks (0, l) ...
  // (H-1, l); this host's sum of it lands on local rank l, and the hosts'
  // sum of segment h of that on rank (h, l).
  std::unique_ptr<CollectiveWork> DoReduceScatter(const at::Tensor& output, const at::Tensor& input,
                                                  ReduceOp op) override {
    return worker_->Enqueue([this, output, input, op, unit = label_unit(), phase = label_phase()] {
      CollectiveLabel label(cross_, &host_, unit, phase);
      const int64_t hosts = cross_.world_size(), per_host = host_.world_size();
      const int64_t n = output.numel();
      const at::Tensor arranged =
          input.view({hosts, per_host, n}).transpose(0, 1).contiguous().view({-1});
      at::Tensor host_sum = at::empty({hosts * n}, output.options());
      host_.ReduceScatterTensor(host_sum, arranged, op)->Wait();
      cross_.ReduceScatterTensor(output, host_sum, op)->Wait();
    });
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
  // Behind the queued collectives, as issued: a barrier of every host, then
  // of every cross-host group, is one of the world.
  void DoBarrier() override {
    worker_
        ->Enqueue([this] {
          host_.Barrier();
          cross_.Barrier();
        })
        ->Wait();
  }

 private:
  Collectives& world_;
  Collectives& host_;
  Collectives& cross_;
  // Last: destroyed (its queue run, its thread joined) before the rest.
  std::optional<OrderedWorker> worker_;
};

}  // namespace

std::unique_ptr<Collectives> CreateHierarchicalCollectives(Collectives& world, Collectives& host,
                                                           Collectives& cross_host) {
  return std::make_unique<HierarchicalCollectives>(world, host, cross_host);
}

}  // namespace fsdp
