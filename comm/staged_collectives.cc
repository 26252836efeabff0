#include "comm/staged_collectives.h"

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "base/device_event.h"
#include "c10/core/DeviceGuard.h"
#include "c10/core/StreamGuard.h"
#include "c10/core/impl/VirtualGuardImpl.h"
#include "c10/util/Exception.h"

namespace fsdp {
namespace {

// The host group's collective on staged tensors (`input` undefined for the
// in-place ones).
using HostCollective = std::function<std::unique_ptr<CollectiveWork>(
    Collectives& host, const at::Tensor& output, const at::Tensor& input)>;

// One issued collective, shared by the worker and the work.
struct Job {
  HostCollective run;
  at::Tensor output;        // The caller's tensors, held until the job has run.
  at::Tensor input;         // Undefined for in-place collectives.
  DeviceEvent input_ready;  // Recorded on the caller's current stream at issue.
  std::string unit, phase;  // The label at issue.

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::string error;  // Empty when the collective succeeded.

  void Finish(std::string failure) {
    {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
      error = std::move(failure);
    }
    cv.notify_all();
  }
  // Returns the error, empty on success.
  std::string AwaitDone() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    return error;
  }
};

class StagedWork final : public CollectiveWork {
 public:
  explicit StagedWork(std::shared_ptr<Job> job) : job_(std::move(job)) {}
  // An unwaited work waits for its collective (see CollectiveWork).
  ~StagedWork() override { job_->AwaitDone(); }

  void Wait() override {
    const std::string error = job_->AwaitDone();
    TORCH_CHECK(error.empty(), error);
  }

 private:
  std::shared_ptr<Job> job_;
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
    worker_ = std::thread([this] { RunJobs(); });
  }

  ~StagedCollectives() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
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
    {
      std::lock_guard<std::mutex> lock(mu_);
      TORCH_CHECK(!stopping_, Describe(), ": staged collectives: the group is being destroyed");
      jobs_.push_back(job);
    }
    cv_.notify_all();
    return std::make_unique<StagedWork>(std::move(job));
  }

  void RunJobs() {
    std::optional<c10::DeviceGuard> device_guard;
    std::optional<c10::StreamGuard> stream_guard;
    if (staging_stream_.has_value()) {
      device_guard.emplace(device_);
      stream_guard.emplace(*staging_stream_);
    }
    std::string first_failure;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      if (!first_failure.empty()) {
        job->Finish(absl::StrCat(Describe(), ": not run: an earlier collective of this group "
                                             "failed: ",
                                 first_failure));
        continue;
      }
      try {
        Run(*job);
        job->Finish("");
      } catch (const c10::Error& e) {
        first_failure = e.what_without_backtrace();
        job->Finish(first_failure);
      } catch (const std::exception& e) {
        first_failure = e.what();
        job->Finish(first_failure);
      } catch (...) {
        first_failure = absl::StrCat(Describe(), ": a collective threw a non-standard exception");
        job->Finish(first_failure);
      }
    }
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
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> jobs_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace

std::unique_ptr<Collectives> CreateStagedCollectives(Collectives& host_group,
                                                     c10::Device device) {
  return std::make_unique<StagedCollectives>(host_group, device);
}

}  // namespace fsdp
