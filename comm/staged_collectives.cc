#include "comm/staged_collectives.h"

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "base/device_event.h"
#include "c10/core/DeviceGuard.h"
#include "c10/core/StreamGuard.h"
#include "c10/core/impl/VirtualGuardImpl.h"
#include "c10/util/Exception.h"
#include "comm/ordered_worker.h"

namespace fsdp {
namespace {

// The host group's collective on staged tensors (`input` undefined for the
// in-place ones).
using HostCollective = std::function<std::unique_ptr<CollectiveWork>(
    Collectives& host, const at::Tensor& output, const at::Tensor& input)>;

// One issued collective: the caller's tensors, held until it has run.
struct Job {
  HostCollective run;
  at::Tensor output;
  at::Tensor input;         // Undefined for in-place collectives.
  DeviceEvent input_ready;  // Recorded on the caller's current stream at issue.
  std::string unit, phase;  // The label at issue.
};

// A staging buffer for `t` on the host: pinned when `t` is on a device
// whose copies can then run asynchronously.
at::Tensor HostBufferLike(const at::Tensor& t) {
  return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(t.is_cuda()));
}

class StagedCollectives final : public Collectives {
 public:
  StagedCollectives(Collectives& host, c10::Device device)
      : Collectives(host.rank(), host.world_size()), host_(host), device_(device) {
    if (DeviceHasStreams(device_.type())) {
      c10::impl::VirtualGuardImpl guard(device_.type());
      TORCH_CHECK(device_.has_index(), Describe(), ": staged collectives: give the device's "
                  "index (", device_.str(), ":N)");
      TORCH_CHECK(device_.index() < guard.deviceCount(), Describe(),
                  ": staged collectives: no device ", device_.str(), " (", guard.deviceCount(),
                  " visible)");
      staging_stream_ = guard.getStreamFromGlobalPool(device_, /*isHighPriority=*/true);
    }
    // The worker copies on the staging stream.
    worker_.emplace(Describe(), [this]() -> std::shared_ptr<void> {
      if (!staging_stream_.has_value()) return nullptr;
      struct Guards {
        Guards(c10::Device device, c10::Stream stream)
            : device_guard(device), stream_guard(stream) {}
        c10::DeviceGuard device_guard;
        c10::StreamGuard stream_guard;
      };
      return std::make_shared<Guards>(device_, *staging_stream_);
    });
  }

  bool HandlesDevice(const c10::Device& device) const override {
    return device.is_cpu() || device == device_;
  }
  std::string DevicesHandled() const override {
    return device_.is_cpu() ? "it handles CPU tensors"
                            : absl::StrCat("it handles ", device_.str(),
                                           " and CPU tensors (staged through the host)");
  }

 protected:
  std::unique_ptr<CollectiveWork> DoAllGather(const at::Tensor& output,
                                              const at::Tensor& input) override {
    return Enqueue(output, input, [](Collectives& host, const at::Tensor& out,
                                     const at::Tensor& in) {
      return host.AllGatherIntoTensor(out, in);
    });
  }
  std::unique_ptr<CollectiveWork> DoReduceScatter(const at::Tensor& output,
                                                  const at::Tensor& input,
                                                  ReduceOp op) override {
    return Enqueue(output, input, [op](Collectives& host, const at::Tensor& out,
                                       const at::Tensor& in) {
      return host.ReduceScatterTensor(out, in, op);
    });
  }
  std::unique_ptr<CollectiveWork> DoAllReduce(const at::Tensor& tensor, ReduceOp op) override {
    return Enqueue(tensor, at::Tensor(), [op](Collectives& host, const at::Tensor& t,
                                              const at::Tensor&) {
      return host.AllReduce(t, op);
    });
  }
  std::unique_ptr<CollectiveWork> DoBroadcast(const at::Tensor& tensor, int root) override {
    return Enqueue(tensor, at::Tensor(), [root](Collectives& host, const at::Tensor& t,
                                                const at::Tensor&) {
      return host.Broadcast(t, root);
    });
  }
  std::unique_ptr<CollectiveWork> DoAllToAll(const at::Tensor& output,
                                             const at::Tensor& input) override {
    return Enqueue(output, input,
                   [](Collectives& host, const at::Tensor& out, const at::Tensor& in) {
                     return host.AllToAll(out, in);
                   });
  }
  // Queued like the others: only the worker talks to the host group.
  void DoBarrier() override {
    Enqueue(at::Tensor(), at::Tensor(), [](Collectives& host, const at::Tensor&,
                                           const at::Tensor&) {
      host.Barrier();
      return MakeCompletedWork();
    })->Wait();
  }

 private:
  std::unique_ptr<CollectiveWork> Enqueue(const at::Tensor& output, const at::Tensor& input,
                                          HostCollective run) {
    auto job = std::make_shared<Job>();
    job->run = std::move(run);
    job->output = output;
    job->input = input;
    if (output.defined() && DeviceHasStreams(output.device().type())) {
      job->input_ready = DeviceEvent::RecordOn(
          c10::impl::VirtualGuardImpl(output.device().type()).getStream(output.device()));
    }
    job->unit = label_unit();
    job->phase = label_phase();
    return worker_->Enqueue([this, job] { Run(*job); });
  }

  // Copies the input out (after the caller's stream has produced it), runs
  // the host collective and copies the result back, waiting for the copies
  // before the job counts as done.
  void Run(Job& job) {
    CollectiveLabel label(host_, job.unit, job.phase);
    if (!job.output.defined()) {
      job.run(host_, at::Tensor(), at::Tensor())->Wait();
      return;
    }
    if (staging_stream_.has_value()) job.input_ready.BlockStream(*staging_stream_);
    const at::Tensor& source = job.input.defined() ? job.input : job.output;
    at::Tensor host_in = HostBufferLike(source);
    host_in.copy_(source, /*non_blocking=*/true);
    at::Tensor host_out = job.input.defined() ? HostBufferLike(job.output) : host_in;
    SynchronizeStaging();
    job.run(host_, host_out, job.input.defined() ? host_in : at::Tensor())->Wait();
    job.output.copy_(host_out, /*non_blocking=*/true);
    SynchronizeStaging();
  }

  void SynchronizeStaging() {
    if (staging_stream_.has_value()) DeviceEvent::RecordOn(*staging_stream_).Synchronize();
  }

  Collectives& host_;
  const c10::Device device_;
  std::optional<c10::Stream> staging_stream_;  // None for host-synchronous devices.
  // Last: destroyed (its queue run, its thread joined) before the rest.
  std::optional<OrderedWorker> worker_;
};

}  // namespace

std::unique_ptr<Collectives> CreateStagedCollectives(Collectives& host_group,
                                                     c10::Device device) {
  return std::make_unique<StagedCollectives>(host_group, device);
}

}  // namespace fsdp
