#include "comm/nccl_collectives.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "c10/cuda/CUDACachingAllocator.h"
#include "c10/cuda/CUDAGuard.h"
#include "c10/cuda/CUDAStream.h"
#include "c10/util/Exception.h"
#include "torch/csrc/distributed/c10d/PrefixStore.hpp"
#include "torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
#include "torch/csrc/distributed/c10d/Store.hpp"

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t NcclType(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kHalf:
      return ncclFloat16;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kByte:  // All-gathers and broadcasts of coded payloads.
      return ncclUint8;
    default:
      TORCH_CHECK(false, "NCCL collectives: unsupported dtype ", c10::toString(type),
                  " (float32, float64, float16, bfloat16 and uint8 are)");
  }
}

ncclRedOp_t NcclOp(ReduceOp op) { return op == ReduceOp::kAvg ? ncclAvg : ncclSum; }

// Host tensors are staged through the group's device on the current stream:
// the device tensors to issue the collective on, and what completes the host
// output once it is done. `output` may alias `input` (in-place collectives),
// which staging preserves.
struct Staged {
  at::Tensor in, out;
  std::function<void()> finish_on_host;  // Null for device tensors.
};

Staged StageOnDevice(const at::Tensor& input, const at::Tensor& output,
                     const c10::Device& device) {
  if (!input.device().is_cpu()) return Staged{input, output, nullptr};
  Staged staged;
  staged.in = input.to(device);
  staged.out = input.is_same(output)
                   ? staged.in
                   : at::empty_like(output, output.options().device(device));
  const at::Tensor device_out = staged.out;
  staged.finish_on_host = [output, device_out] { output.copy_(device_out); };
  return staged;
}

// What both transports share: the device, host-tensor placement checks,
// the barrier, and the options.
class NcclGroup : public Collectives {
 public:
  NcclGroup(int rank, int world_size, int device_index, const NcclOptions& options)
      : Collectives(rank, world_size),
        device_(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index)),
        options_(options) {}

  bool HandlesDevice(const c10::Device& device) const override {
    return device.is_cpu() || device == device_;
  }
  std::string DevicesHandled() const override {
    return absl::StrCat("it handles ", device_.str(), ", and host tensors by staging");
  }

  bool blocking_wait() const { return options_.blocking_wait; }
  const NcclOptions& options() const { return options_; }
  const c10::Device& device() const { return device_; }

 protected:
  // Names the collective for messages, and checks where its tensors are.
  std::string Check(const char* op, const std::vector<at::Tensor>& tensors) const {
    const std::string what = absl::StrCat(op, " of ", tensors[0].numel(), " ",
                                          c10::toString(tensors[0].scalar_type()));
    const bool on_host = tensors[0].device().is_cpu();
    for (const at::Tensor& t : tensors) {
      TORCH_CHECK(t.device().is_cpu() == on_host && (on_host || t.device() == device_),
                  Describe(), ": ", what, ": tensors must be on this group's device ",
                  device_.str(), " (or all on the host), got one on ", t.device().str());
    }
    return what;
  }

  void DoBarrier() override {
    c10::cuda::CUDAGuard on_device(device_);
    const at::Tensor one = at::ones({1}, at::TensorOptions().device(device_));
    std::unique_ptr<CollectiveWork> work = DoAllReduce(one, ReduceOp::kSum);
    const bool blocking = options_.blocking_wait;
    options_.blocking_wait = true;  // A barrier returns when every rank entered it.
    try {
      work->Wait();
    } catch (...) {
      options_.blocking_wait = blocking;
      throw;
    }
    options_.blocking_wait = blocking;
  }

  const c10::Device device_;
  NcclOptions options_;
};

class NcclCollectives;

// One issued collective: an event recorded after it on its stream, and for
// host tensors the copy back that completes it.
class NcclWork final : public CollectiveWork {
 public:
  NcclWork(NcclCollectives* group, std::string what, cudaEvent_t event,
           std::function<void()> finish_on_host)
      : group_(group),
        what_(std::move(what)),
        event_(event),
        finish_on_host_(std::move(finish_on_host)) {}
  ~NcclWork() override;
  void Wait() override;

 private:
  NcclCollectives* group_;
  const std::string what_;
  cudaEvent_t event_;
  std::function<void()> finish_on_host_;  // Null for device tensors.
  bool waited_ = false;
  std::string error_;
};

class NcclCollectives final : public NcclGroup {
 public:
  NcclCollectives(int rank, int world_size, int device_index, ncclComm_t comm,
                  const NcclOptions& options)
      : NcclGroup(rank, world_size, device_index, options), comm_(comm) {}

  ~NcclCollectives() override {
    if (aborted_) return;
    // A communicator with pending work must be aborted, not destroyed
    // (destroy would wait for peers that may be gone).
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess) {
      ncclCommAbort(comm_);
    } else {
      ncclCommDestroy(comm_);
    }
  }

  // Throws naming `what` if NCCL reported an asynchronous error.
  void CheckAsyncError(const std::string& what) {
    TORCH_CHECK(!aborted_, Describe(), ": ", what, ": the communicator was aborted after ",
                abort_reason_);
    ncclResult_t async = ncclSuccess;
    const ncclResult_t got = ncclCommGetAsyncError(comm_, &async);
    TORCH_CHECK(got == ncclSuccess && async == ncclSuccess, Describe(), ": ", what,
                " failed in NCCL: ", ncclGetErrorString(got != ncclSuccess ? got : async),
                " (", ncclGetLastError(comm_), ")");
  }

  void Abort(const std::string& reason) {
    if (aborted_) return;
    aborted_ = true;
    abort_reason_ = reason;
    ncclCommAbort(comm_);
  }

  // Waits on the host for `event`, up to the timeout; aborts on expiry.
  void HostWait(cudaEvent_t event, const std::string& what) {
    const Clock::time_point deadline = Clock::now() + options_.timeout;
    for (;;) {
      const cudaError_t state = cudaEventQuery(event);
      if (state == cudaSuccess) return;
      TORCH_CHECK(state == cudaErrorNotReady, Describe(), ": ", what, ": CUDA error ",
                  cudaGetErrorString(state));
      CheckAsyncError(what);
      if (Clock::now() > deadline) {
        const std::string reason = absl::StrCat(
            what, " did not complete within ", options_.timeout.count(), " ms");
        Abort(reason);
        TORCH_CHECK(false, Describe(), ": ", reason,
                    " (a peer is dead, hung, or issued another collective); the communicator "
                    "was aborted");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  std::unique_ptr<CollectiveWork> DoAllGather(const at::Tensor& output,
                                              const at::Tensor& input) override {
    return Issue("all-gather", {input}, {output}, [&](const std::vector<at::Tensor>& in,
                                                      const std::vector<at::Tensor>& out,
                                                      cudaStream_t stream) {
      return ncclAllGather(in[0].data_ptr(), out[0].data_ptr(), in[0].numel(),
                           NcclType(in[0].scalar_type()), comm_, stream);
    });
  }

  std::unique_ptr<CollectiveWork> DoReduceScatter(const at::Tensor& output,
                                                  const at::Tensor& input,
                                                  ReduceOp op) override {
    return Issue("reduce-scatter", {input}, {output},
                 [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& out,
                     cudaStream_t stream) {
                   return ncclReduceScatter(in[0].data_ptr(), out[0].data_ptr(), out[0].numel(),
                                            NcclType(in[0].scalar_type()), NcclOp(op), comm_,
                                            stream);
                 });
  }

  std::unique_ptr<CollectiveWork> DoAllReduce(const at::Tensor& tensor, ReduceOp op) override {
    return Issue("all-reduce", {tensor}, {tensor},
                 [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& out,
                     cudaStream_t stream) {
                   return ncclAllReduce(in[0].data_ptr(), out[0].data_ptr(), in[0].numel(),
                                        NcclType(in[0].scalar_type()), NcclOp(op), comm_,
                                        stream);
                 });
  }

  std::unique_ptr<CollectiveWork> DoBroadcast(const at::Tensor& tensor, int root) override {
    return Issue("broadcast", {tensor}, {tensor},
                 [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& out,
                     cudaStream_t stream) {
                   return ncclBroadcast(in[0].data_ptr(), out[0].data_ptr(), in[0].numel(),
                                        NcclType(in[0].scalar_type()), root, comm_, stream);
                 });
  }

  // NCCL has no all-to-all: a send and a receive per peer, fused into one
  // launch by the group calls.
  std::unique_ptr<CollectiveWork> DoAllToAll(const at::Tensor& output,
                                             const at::Tensor& input) override {
    const int world = world_size();
    return Issue("all-to-all", {input}, {output},
                 [&](const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& out,
                     cudaStream_t stream) {
                   const int64_t chunk = in[0].numel() / world;
                   const int64_t bytes = chunk * in[0].element_size();
                   const ncclDataType_t type = NcclType(in[0].scalar_type());
                   const char* send = static_cast<const char*>(in[0].data_ptr());
                   char* receive = static_cast<char*>(out[0].data_ptr());
                   ncclResult_t result = ncclGroupStart();
                   for (int peer = 0; peer < world && result == ncclSuccess; ++peer) {
                     result = ncclSend(send + peer * bytes, chunk, type, peer, comm_, stream);
                     if (result == ncclSuccess) {
                       result = ncclRecv(receive + peer * bytes, chunk, type, peer, comm_, stream);
                     }
                   }
                   const ncclResult_t ended = ncclGroupEnd();
                   return result != ncclSuccess ? result : ended;
                 });
  }

 private:
  using Launch = std::function<ncclResult_t(const std::vector<at::Tensor>&,
                                            const std::vector<at::Tensor>&, cudaStream_t)>;

  // Issues `launch` on the current stream of the group's device. Host
  // tensors are staged through the device; `outputs` may alias `inputs`
  // (in-place collectives), which staging preserves.
  std::unique_ptr<CollectiveWork> Issue(const char* op, const std::vector<at::Tensor>& inputs,
                                        const std::vector<at::Tensor>& outputs,
                                        const Launch& launch) {
    const std::string what = Check(op, inputs);
    CheckAsyncError(what);
    c10::cuda::CUDAGuard on_device(device_);
    c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device_.index());
    Staged staged = StageOnDevice(inputs[0], outputs[0], device_);
    for (const at::Tensor* t : {&staged.in, &staged.out}) {
      // The tensors may have been allocated on another stream.
      c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), stream);
    }
    const ncclResult_t result = launch({staged.in}, {staged.out}, stream.stream());
    TORCH_CHECK(result == ncclSuccess, Describe(), ": ", what,
                " could not be issued: ", ncclGetErrorString(result), " (",
                ncclGetLastError(comm_), ")");
    cudaEvent_t event = nullptr;
    cudaError_t status = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (status == cudaSuccess) status = cudaEventRecord(event, stream.stream());
    TORCH_CHECK(status == cudaSuccess, Describe(), ": ", what, ": recording its event: ",
                cudaGetErrorString(status));
    return std::make_unique<NcclWork>(this, what, event, std::move(staged.finish_on_host));
  }

  ncclComm_t comm_;
  bool aborted_ = false;
  std::string abort_reason_;
};

NcclWork::~NcclWork() {
  if (!waited_) {
    // Later work on the current stream must not reuse the buffers first.
    c10::cuda::CUDAGuard on_device(group_->device());
    cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(group_->device().index()).stream(),
                        event_, 0);
  }
  cudaEventDestroy(event_);
}

void NcclWork::Wait() {
  if (waited_) {
    TORCH_CHECK(error_.empty(), error_);
    return;
  }
  waited_ = true;
  try {
    c10::cuda::CUDAGuard on_device(group_->device());
    if (finish_on_host_ || group_->blocking_wait()) group_->HostWait(event_, what_);
    group_->CheckAsyncError(what_);
    const cudaError_t status = cudaStreamWaitEvent(
        c10::cuda::getCurrentCUDAStream(group_->device().index()).stream(), event_, 0);
    TORCH_CHECK(status == cudaSuccess, what_, ": waiting for its event: ",
                cudaGetErrorString(status));
    if (finish_on_host_) finish_on_host_();
  } catch (const c10::Error& e) {
    error_ = e.what_without_backtrace();
    throw;
  }
}

// The ProcessGroupNCCL transport: c10d issues each collective on a stream of
// its own after making it wait for the caller's current stream, records the
// tensors' use there, and runs its watchdog; a work's wait() makes the
// current stream wait for that stream.
class ProcessGroupNcclCollectives;

class ProcessGroupNcclWork final : public CollectiveWork {
 public:
  ProcessGroupNcclWork(const ProcessGroupNcclCollectives* group, std::string what,
                       c10::intrusive_ptr<c10d::Work> work,
                       std::function<void()> finish_on_host)
      : group_(group),
        what_(std::move(what)),
        work_(std::move(work)),
        finish_on_host_(std::move(finish_on_host)) {}
  ~ProcessGroupNcclWork() override {
    if (waited_) return;
    try {
      work_->wait();  // Later work on the current stream must not reuse the buffers first.
    } catch (...) {
    }
  }
  void Wait() override;

 private:
  const ProcessGroupNcclCollectives* group_;
  const std::string what_;
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> finish_on_host_;
  bool waited_ = false;
  std::string error_;
};

class ProcessGroupNcclCollectives final : public NcclGroup {
 public:
  ProcessGroupNcclCollectives(int rank, int world_size, int device_index,
                              c10::intrusive_ptr<c10d::ProcessGroupNCCL> group,
                              const NcclOptions& options)
      : NcclGroup(rank, world_size, device_index, options), group_(std::move(group)) {}

  std::string Name() const { return Describe(); }

 protected:
  std::unique_ptr<CollectiveWork> DoAllGather(const at::Tensor& output,
                                              const at::Tensor& input) override {
    return Issue("all-gather", input, output, [&](at::Tensor& in, at::Tensor& out) {
      return group_->_allgather_base(out, in, c10d::AllgatherOptions());
    });
  }

  std::unique_ptr<CollectiveWork> DoReduceScatter(const at::Tensor& output,
                                                  const at::Tensor& input,
                                                  ReduceOp op) override {
    return Issue("reduce-scatter", input, output, [&](at::Tensor& in, at::Tensor& out) {
      c10d::ReduceScatterOptions options;
      options.reduceOp = C10dOp(op);
      return group_->_reduce_scatter_base(out, in, options);
    });
  }

  std::unique_ptr<CollectiveWork> DoAllReduce(const at::Tensor& tensor, ReduceOp op) override {
    return Issue("all-reduce", tensor, tensor, [&](at::Tensor& in, at::Tensor&) {
      c10d::AllreduceOptions options;
      options.reduceOp = C10dOp(op);
      std::vector<at::Tensor> tensors = {in};
      return group_->allreduce(tensors, options);
    });
  }

  std::unique_ptr<CollectiveWork> DoBroadcast(const at::Tensor& tensor, int root) override {
    return Issue("broadcast", tensor, tensor, [&](at::Tensor& in, at::Tensor&) {
      c10d::BroadcastOptions options;
      options.rootRank = root;
      std::vector<at::Tensor> tensors = {in};
      return group_->broadcast(tensors, options);
    });
  }

  std::unique_ptr<CollectiveWork> DoAllToAll(const at::Tensor& output,
                                             const at::Tensor& input) override {
    return Issue("all-to-all", input, output, [&](at::Tensor& in, at::Tensor& out) {
      std::vector<int64_t> equal_splits;  // Empty: W equal chunks.
      return group_->alltoall_base(out, in, equal_splits, equal_splits, c10d::AllToAllOptions());
    });
  }

 private:
  using Launch = std::function<c10::intrusive_ptr<c10d::Work>(at::Tensor&, at::Tensor&)>;

  static c10d::ReduceOp C10dOp(ReduceOp op) {
    return op == ReduceOp::kAvg ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
  }

  std::unique_ptr<CollectiveWork> Issue(const char* op, const at::Tensor& input,
                                        const at::Tensor& output, const Launch& launch) {
    const std::string what = Check(op, {input, output});
    c10::cuda::CUDAGuard on_device(device_);
    Staged staged = StageOnDevice(input, output, device_);
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = launch(staged.in, staged.out);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, Describe(), ": ", what, " could not be issued: ", e.what());
    }
    return std::make_unique<ProcessGroupNcclWork>(this, what, std::move(work),
                                                  std::move(staged.finish_on_host));
  }

  c10::intrusive_ptr<c10d::ProcessGroupNCCL> group_;
};

void ProcessGroupNcclWork::Wait() {
  if (waited_) {
    TORCH_CHECK(error_.empty(), error_);
    return;
  }
  waited_ = true;
  try {
    if (finish_on_host_ || group_->blocking_wait()) {
      const Clock::time_point deadline = Clock::now() + group_->options().timeout;
      while (!work_->isCompleted()) {
        if (Clock::now() > deadline) {
          work_->abort();
          TORCH_CHECK(false, group_->Name(), ": ", what_, " did not complete within ",
                      group_->options().timeout.count(),
                      " ms (a peer is dead, hung, or issued another collective); it was "
                      "aborted");
        }
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    try {
      work_->wait();  // The current stream waits; rethrows what c10d caught.
    } catch (const std::exception& e) {
      TORCH_CHECK(false, group_->Name(), ": ", what_, " failed: ", e.what());
    }
    if (finish_on_host_) finish_on_host_();
  } catch (const c10::Error& e) {
    error_ = e.what_without_backtrace();
    throw;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Collectives>> CreateNcclCollectives(
    c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, int device_index,
    const NcclOptions& options) {
  const std::string who = absl::StrCat("rank ", rank, " of ", world_size, " on cuda:",
                                       device_index, ": ");
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat(who, "rank out of range"));
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || device_index < 0 ||
      device_index >= devices) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, "no such CUDA device (", devices, " visible)"));
  }
  if (options.transport == NcclTransport::kProcessGroup) {
    try {
      c10::cuda::CUDAGuard on_device(static_cast<c10::DeviceIndex>(device_index));
      auto pg_options = c10d::ProcessGroupNCCL::Options::create();
      pg_options->timeout = options.timeout;
      auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>(
              absl::StrCat("fsdp/nccl_pg/", options.group_name), store),
          rank, world_size, pg_options);
      return std::unique_ptr<Collectives>(new ProcessGroupNcclCollectives(
          rank, world_size, device_index, std::move(group), options));
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat(who, "creating ProcessGroupNCCL: ", e.what()));
    }
  }
  const std::string key = absl::StrCat("fsdp/nccl/", options.group_name, "/unique_id");
  ncclUniqueId id;
  try {
    if (rank == 0) {
      const ncclResult_t made = ncclGetUniqueId(&id);
      if (made != ncclSuccess) {
        return absl::InternalError(
            absl::StrCat(who, "ncclGetUniqueId: ", ncclGetErrorString(made)));
      }
      const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
      store->set(key, std::vector<uint8_t>(bytes, bytes + sizeof(id)));
    } else {
      const std::vector<uint8_t> bytes = store->get(key);  // Bounded by the store's timeout.
      if (bytes.size() != sizeof(id)) {
        return absl::InternalError(absl::StrCat(who, "the NCCL id under '", key, "' has ",
                                                bytes.size(), " bytes, expected ",
                                                sizeof(id)));
      }
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat(who, "exchanging the NCCL id through the store: ", e.what()));
  }
  c10::cuda::CUDAGuard on_device(static_cast<c10::DeviceIndex>(device_index));
  ncclComm_t comm = nullptr;
  const ncclResult_t init = ncclCommInitRank(&comm, world_size, id, rank);
  if (init != ncclSuccess) {
    return absl::InternalError(
        absl::StrCat(who, "ncclCommInitRank: ", ncclGetErrorString(init)));
  }
  return std::unique_ptr<Collectives>(
      new NcclCollectives(rank, world_size, device_index, comm, options));
}

GroupConnector NcclGroupConnector(c10::intrusive_ptr<c10d::Store> store, int device_index,
                                  NcclOptions options) {
  return [store = std::move(store), device_index, options = std::move(options)](
             const std::string& group_name, int rank,
             int size) -> absl::StatusOr<std::unique_ptr<Collectives>> {
    NcclOptions group_options = options;
    group_options.group_name = group_name;
    return CreateNcclCollectives(store, rank, size, device_index, group_options);
  };
}

}  // namespace fsdp
