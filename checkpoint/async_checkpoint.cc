#include "checkpoint/async_checkpoint.h"

#include <time.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ATen/ops/empty.h"
#include "absl/strings/str_cat.h"
#include "base/device_event.h"
#include "base/status.h"
#include "c10/core/StreamGuard.h"
#include "c10/core/impl/VirtualGuardImpl.h"
#include "checkpoint/agree.h"
#include "checkpoint/save_internal.h"
#include "optim/training_checkpoint.h"
#include "statedict/dcp_sharded.h"

namespace fsdp {
namespace checkpoint_internal {

using Clock = std::chrono::steady_clock;

// The model's tensors a save on the host writes from where they are, and
// the version each had at Save: released on the writer's thread once this
// rank's file is written, and waited for on training's (through
// FullyShardedModel::HoldShards). Aliases (detach()) share a tensor's
// storage and version counter. The model's parameters are watched besides:
// an optimizer updates them, not the flat shards they view, and a
// parameter keeps a version counter of its own.
class ShardHold {
 public:
  void Watch(const at::Tensor& t, std::string name) {
    tensors_.push_back(t.detach());
    versions_.push_back(t._version());
    names_.push_back(std::move(name));
  }
  bool empty() const { return tensors_.empty(); }
  // On the writer's thread, once every held byte has been written.
  absl::Status CheckAndRelease() {
    absl::Status status;
    for (size_t i = 0; i < tensors_.size() && status.ok(); ++i) {
      if (tensors_[i]._version() != versions_[i]) {
        status = absl::AbortedError(absl::StrCat(
            "'", names_[i],
            "' changed in place while the background save was writing it "
            "(an update between Save and the end of the next backward pass, which the save "
            "cannot hold back); the checkpoint would mix two steps, so it is not saved. "
            "Call Wait() before changing the shards by hand"));
      }
    }
    Release();
    return status;
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }
  // On training's thread.
  void Wait() {
    const Clock::time_point begin = Clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return released_; });
    waited_ += Clock::now() - begin;
  }
  std::chrono::duration<double> waited() {
    std::lock_guard<std::mutex> lock(mu_);
    return waited_;
  }

 private:
  std::vector<at::Tensor> tensors_;
  std::vector<int64_t> versions_;
  std::vector<std::string> names_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;                    // Guarded by mu_.
  std::chrono::duration<double> waited_{0};  // Guarded by mu_.
};

namespace {
std::function<void()>& BeforeBackgroundWrite() {
  static auto* hook = new std::function<void()>();
  return *hook;
}
}  // namespace

void SetBeforeBackgroundWriteForTesting(std::function<void()> hook) {
  BeforeBackgroundWrite() = std::move(hook);
}

}  // namespace checkpoint_internal

namespace {

using checkpoint_internal::Clock;
using checkpoint_internal::ShardHold;

// The storages (StorageImpl addresses) in host memory that training
// writes: the shards, which only an optimizer step or a load writes, and
// the buffers, which forward may update.
struct LiveStorages {
  std::set<const void*> shards;
  std::set<const void*> buffers;
};

const void* StorageOf(const at::Tensor& t) {
  return t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

LiveStorages LiveStoragesOf(const FullyShardedModel& model, torch::optim::Optimizer* optimizer) {
  LiveStorages live;
  if (optimizer != nullptr) live.shards = OptimizerStateStorages(*optimizer);
  const torch::nn::Module& root = model.units().front()->module();
  for (const at::Tensor& p : root.parameters(/*recurse=*/true)) live.shards.insert(StorageOf(p));
  for (const at::Tensor& b : root.buffers(/*recurse=*/true)) {
    if (b.defined()) live.buffers.insert(StorageOf(b));
  }
  live.shards.erase(nullptr);
  live.buffers.erase(nullptr);
  return live;
}

// Stages tensors for a write that outlives the step. A shard in host
// memory is held (`hold`) and written from where it is; another tensor in
// host memory that training does not write (a value the save made) is
// written as it is. Any other, a buffer or a tensor on a device, is copied
// to host memory, into the buffers of the save before when they fit
// (`buffers`, the i-th copy into the i-th: a save stages the same tensors
// in the same order each time), so that a save touches no fresh pages. On a device with streams
// the copies run on a side stream after the work issued so far, into
// pinned memory, and the caller's stream waits for them (the next step's
// in-place updates must not overtake a copy); the writer waits for them on
// the host (Ready). On the host a copy is done when it returns.
class HostStager {
 public:
  HostStager(std::vector<at::Tensor>& buffers, std::shared_ptr<ShardHold> hold, LiveStorages live)
      : buffers_(buffers), hold_(std::move(hold)), live_(std::move(live)) {}
  HostStager(const HostStager&) = delete;
  HostStager& operator=(const HostStager&) = delete;
  // A staging that failed part way: the copies issued must land before
  // their buffers are reused or freed.
  ~HostStager() {
    if (finished_) return;
    try {
      for (auto& [device, streams] : streams_) DeviceEvent::RecordOn(streams.side).Synchronize();
    } catch (...) {
      // The device failed; nothing the buffers hold will be written.
    }
  }

  at::Tensor Stage(const at::Tensor& t, std::string name) {
    const void* storage = StorageOf(t);
    if (!t.device().is_cpu() || live_.buffers.count(storage) != 0) return Copy(t);
    if (live_.shards.count(storage) == 0) return t;
    held_bytes_ += t.numel() * static_cast<int64_t>(t.element_size());
    hold_->Watch(t, std::move(name));
    return t.detach();
  }

  at::Tensor Copy(const at::Tensor& t) {
    bytes_ += t.numel() * static_cast<int64_t>(t.element_size());
    const bool streams = DeviceHasStreams(t.device().type());
    const size_t i = copies_++;
    if (i == buffers_.size()) buffers_.emplace_back();
    at::Tensor& host = buffers_[i];
    if (!host.defined() || host.sizes() != t.sizes() || host.dtype() != t.dtype() ||
        host.is_pinned() != streams) {
      host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(streams));
    }
    if (!streams) {
      host.copy_(t.detach());
      return host;
    }
    c10::StreamGuard on_side(StreamsOf(t.device()).side);
    host.copy_(t.detach(), /*non_blocking=*/true);
    return host;
  }
  // Every copy issued is ordered before the callers' next work.
  void Finish() {
    finished_ = true;
    buffers_.resize(copies_);
    for (auto& [device, streams] : streams_) {
      copied_.push_back(DeviceEvent::RecordOn(streams.side));
      copied_.back().BlockStream(streams.caller);
    }
  }
  // On the writer's thread, once every copy has landed: an error there
  // fails the save in its own round, on every rank.
  absl::Status Ready() const {
    return CatchAsStatus([&] {
      for (const DeviceEvent& event : copied_) event.Synchronize();
      return absl::OkStatus();
    });
  }
  int64_t bytes() const { return bytes_; }
  int64_t held_bytes() const { return held_bytes_; }

 private:
  struct Streams {
    c10::Stream caller;
    c10::Stream side;
  };
  Streams& StreamsOf(const c10::Device& device) {
    auto it = streams_.find(device.str());
    if (it != streams_.end()) return it->second;
    c10::impl::VirtualGuardImpl guard(device.type());
    Streams streams{guard.getStream(device),
                    guard.getStreamFromGlobalPool(device, /*isHighPriority=*/false)};
    // The side stream copies what the caller's stream has computed so far.
    DeviceEvent::RecordOn(streams.caller).BlockStream(streams.side);
    return streams_.emplace(device.str(), streams).first->second;
  }

  std::vector<at::Tensor>& buffers_;
  const std::shared_ptr<ShardHold> hold_;
  const LiveStorages live_;
  bool finished_ = false;
  size_t copies_ = 0;
  int64_t bytes_ = 0, held_bytes_ = 0;
  std::map<std::string, Streams> streams_;
  std::vector<DeviceEvent> copied_;
};

// A value rank 0 writes, as it is now: tensors copied, containers deep.
c10::IValue CopyValue(const c10::IValue& value, HostStager& stager) {
  if (value.isTensor()) return stager.Copy(value.toTensor());
  return value.deepcopy();
}

// Whether this rank writes: under hybrid sharding one shard group writes
// and the other replicas only learn its outcome.
bool Writes(const SaveGroups& groups) {
  return groups.replicate == nullptr || groups.replicate->rank() == 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<AsyncCheckpointer>> AsyncCheckpointer::Create(
    FullyShardedModel& model, const GroupConnector& connect, const std::string& group_name) {
  Collectives* replicate = model.replicate_group();
  const Collectives& shard = model.group();
  std::unique_ptr<Collectives> own_shard, own_replicate;
  const std::string shard_name =
      replicate == nullptr ? group_name : absl::StrCat(group_name, "/shard", replicate->rank());
  FSDP_ASSIGN_OR_RETURN(own_shard, connect(shard_name, shard.rank(), shard.world_size()));
  if (replicate != nullptr) {
    FSDP_ASSIGN_OR_RETURN(own_replicate,
                          connect(absl::StrCat(group_name, "/replicate", shard.rank()),
                                  replicate->rank(), replicate->world_size()));
  }
  return std::unique_ptr<AsyncCheckpointer>(
      new AsyncCheckpointer(model, std::move(own_shard), std::move(own_replicate)));
}

AsyncCheckpointer::AsyncCheckpointer(FullyShardedModel& model, std::unique_ptr<Collectives> shard,
                                     std::unique_ptr<Collectives> replicate)
    : model_(&model), shard_group_(std::move(shard)), replicate_group_(std::move(replicate)) {}

AsyncCheckpointer::~AsyncCheckpointer() {
  if (worker_.joinable()) worker_.join();
}

absl::Status AsyncCheckpointer::Finish() {
  if (!in_flight()) return absl::OkStatus();
  if (worker_.joinable()) worker_.join();
  done_inline_ = false;
  std::lock_guard<std::mutex> lock(mu_);
  done_ = false;
  times_.written = written_;
  times_.write_cpu = write_cpu_;
  if (hold_ != nullptr) times_.held = hold_->waited();
  hold_.reset();
  return std::exchange(outcome_, absl::OkStatus());
}

absl::Status AsyncCheckpointer::Wait() { return Finish(); }

absl::Status AsyncCheckpointer::Poll() {
  if (!in_flight()) return absl::OkStatus();
  // The ranks' writers end at different moments: the outcome is taken when
  // every rank's has, so that every rank reports it at the same call.
  bool done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done = done_;
  }
  at::Tensor writing = at::full({1}, done ? 0.0 : 1.0, at::kDouble);
  const absl::Status agreed = CatchAsStatus([&] {
    model_->group().AllReduce(writing, ReduceOp::kSum)->Wait();
    if (Collectives* replicate = model_->replicate_group()) {
      replicate->AllReduce(writing, ReduceOp::kSum)->Wait();
    }
    return absl::OkStatus();
  });
  FSDP_RETURN_IF_ERROR(agreed);
  if (writing.item<double>() != 0) return absl::OkStatus();
  return Finish();
}

absl::Status AsyncCheckpointer::Start(FullyShardedModel& model, const std::string& dir,
                                      const std::function<absl::StatusOr<Write>()>& stage) {
  if (&model != model_) {
    return absl::InvalidArgumentError(
        "AsyncCheckpointer::Save: the model is not the one the checkpointer was created for");
  }
  FSDP_RETURN_IF_ERROR(model.RequireIdle("saving a checkpoint in the background"));
  const Clock::time_point begin = Clock::now();
  const absl::Status before = Finish();
  const Clock::time_point waited = Clock::now();
  FSDP_RETURN_IF_ERROR(before);
  times_ = AsyncCheckpointTimes{};
  hold_ = std::make_shared<ShardHold>();
  const absl::StatusOr<Write> write = [&]() -> absl::StatusOr<Write> {
    try {
      return stage();
    } catch (...) {
      return StatusFromCurrentException();
    }
  }();
  // A refusal or a copy that failed on any rank stops the save on every
  // rank here, before any thread starts (and before the shards are held).
  const absl::Status agreed = checkpoint_internal::AgreeAcrossRanks(model, write.status());
  if (!agreed.ok()) hold_.reset();
  FSDP_RETURN_IF_ERROR(agreed);
  if (hold_->empty()) {
    hold_.reset();
  } else {
    for (const auto& p : model.units().front()->module().named_parameters(/*recurse=*/true)) {
      hold_->Watch(p.value(), p.key());
    }
    model.HoldShards([hold = hold_] { hold->Wait(); });
  }
  const Clock::time_point staged = Clock::now();
  times_.waited = waited - begin;
  times_.staged = staged - waited;
  dir_ = dir;
  SaveGroups groups{shard_group_.get(), replicate_group_.get()};
  const auto cpu_seconds = [] {
    timespec cpu{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu);
    return cpu.tv_sec + cpu.tv_nsec * 1e-9;
  };
  auto run = [this, groups, write = *write, cpu_seconds, hold = hold_]() {
    const Clock::time_point start = Clock::now();
    const double cpu_start = cpu_seconds();
    absl::Status outcome;
    try {
      const std::function<void()>& before = checkpoint_internal::BeforeBackgroundWrite();
      if (before) before();
      outcome = write(groups);
    } catch (...) {
      outcome = StatusFromCurrentException();
    }
    const double cpu = cpu_seconds() - cpu_start;
    // Normally released once the file was written; here whatever happened.
    if (hold != nullptr) hold->Release();
    std::lock_guard<std::mutex> lock(mu_);
    written_ = Clock::now() - start;
    write_cpu_ = std::chrono::duration<double>(cpu);
    outcome_ = outcome;
    done_ = true;
  };
  try {
    // At normal priority: at idle priority (SCHED_IDLE) other processes
    // starved the write until a later save waited for it, longer than a
    // blocking save takes (models/async_checkpoint_benchmark_results.md).
    worker_ = std::thread(run);
  } catch (...) {
    // The other ranks' writers have started and wait for this rank's in
    // the commit: write here rather than leave them waiting.
    run();
    done_inline_ = true;
  }
  return absl::OkStatus();
}

absl::Status AsyncCheckpointer::Save(const std::string& dir, FullyShardedModel& model,
                                     torch::optim::Optimizer* optimizer,
                                     const TrainState& train_state,
                                     const CheckpointIoOptions& options) {
  if (options.format != CheckpointFormat::kDistributed) {
    return absl::InvalidArgumentError(
        "AsyncCheckpointer::Save: a Hugging Face checkpoint is an export of whole tensors, "
        "which one rank gathers and writes; write it with SaveCheckpoint");
  }
  return Start(model, dir, [&]() -> absl::StatusOr<Write> {
    FSDP_ASSIGN_OR_RETURN(
        checkpoint_internal::DistributedSave save,
        checkpoint_internal::PrepareDistributedSave(dir, model, optimizer, train_state, options));
    FSDP_RETURN_IF_ERROR(save.ready);
    const SaveGroups groups{shard_group_.get(), replicate_group_.get()};
    auto stager =
        std::make_shared<HostStager>(staging_buffers_, hold_, LiveStoragesOf(model, optimizer));
    if (Writes(groups)) {
      for (DcpTensorShard& shard : save.shards) {
        shard.local = stager->Stage(shard.local, DcpStoredName(shard.path));
      }
      for (DcpItem& item : save.values) item.value = CopyValue(item.value, *stager);
      stager->Finish();
    } else {
      save.shards.clear();
      save.values.clear();
    }
    times_.staged_bytes = stager->bytes();
    times_.held_bytes = stager->held_bytes();
    return Write([dir, save = std::move(save), stager, hold = hold_](const SaveGroups& groups) {
      return SaveModelShardedDcp(groups, dir, save.shards, save.values, stager->Ready(),
                                 [&hold] { return hold->CheckAndRelease(); });
    });
  });
}

namespace checkpoint_internal {

absl::Status SaveShardedInBackground(AsyncCheckpointer& saver, const std::string& dir,
                                     FullyShardedModel& model, torch::optim::Optimizer& optimizer,
                                     const std::map<std::string, std::string>& metadata) {
  return saver.Start(model, dir, [&]() -> absl::StatusOr<AsyncCheckpointer::Write> {
    FSDP_ASSIGN_OR_RETURN(std::vector<CheckpointTensor> tensors,
                          TrainingCheckpointTensors(model, optimizer));
    auto stager = std::make_shared<HostStager>(saver.staging_buffers_, saver.hold_,
                                               LiveStoragesOf(model, &optimizer));
    const SaveGroups groups{saver.shard_group_.get(), saver.replicate_group_.get()};
    if (Writes(groups)) {
      for (CheckpointTensor& t : tensors) t.local = stager->Stage(t.local, t.fqn);
      stager->Finish();
    } else {
      tensors.clear();
    }
    saver.times_.staged_bytes = stager->bytes();
    saver.times_.held_bytes = stager->held_bytes();
    return AsyncCheckpointer::Write([dir, tensors = std::move(tensors), metadata, stager,
                                     hold = saver.hold_](const SaveGroups& groups) {
      return SaveModelCheckpointTensors(groups, dir, tensors, metadata, stager->Ready(),
                                        [&hold] { return hold->CheckAndRelease(); });
    });
  });
}

}  // namespace checkpoint_internal
}  // namespace fsdp
