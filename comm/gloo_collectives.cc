#include "comm/gloo_collectives.h"

#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "c10/util/Exception.h"
#include "torch/csrc/distributed/c10d/PrefixStore.hpp"
#include "torch/csrc/distributed/c10d/ProcessGroupGloo.hpp"

namespace fsdp {
namespace {

// NOTE [Gloo algorithms]
// Gloo only moves bytes for the operations below, so tensors travel as byte
// views (Gloo rejects bfloat16 but accepts uint8); reductions happen here,
// where float16/bfloat16 can accumulate in float32. Reduce-scatter uses an
// all-to-all: each rank sends chunk r of its input to rank r and sums what it
// receives. Its traffic equals a ring reduce-scatter's, in one round instead
// of W-1 dependent ones, at the cost of a receive buffer as large as the
// input. collectives_benchmark.cc measures it against the all-reduce fallback.

at::Tensor AsBytes(const at::Tensor& t) { return t.view({-1}).view(at::kByte); }

bool IsHalfPrecision(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}

// One c10d work plus what must run on the waiting thread once it completes.
// `finish` may issue and wait for further collectives (the second phase of a
// float16 all-reduce).
class GlooWork final : public CollectiveWork {
 public:
  GlooWork(std::string what, c10::intrusive_ptr<c10d::Work> work,
           std::function<void()> finish)
      : what_(std::move(what)), work_(std::move(work)), finish_(std::move(finish)) {}

  ~GlooWork() override {
    if (done_) return;
    try {
      Wait();
    } catch (...) {
      // Destructors cannot throw; the caller chose not to wait for the error.
    }
  }

  void Wait() override {
    if (done_) return;
    done_ = true;  // A failed work is not retried; a second Wait() is a no-op.
    try {
      work_->wait();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, what_, " failed: ", StripBacktrace(e));
    }
    if (finish_) finish_();
  }

 private:
  static std::string StripBacktrace(const std::exception& e) {
    if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
      return c10_error->msg();
    }
    return e.what();
  }

  std::string what_;
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> finish_;
  bool done_ = false;
};

class GlooCollectives final : public Collectives {
 public:
  GlooCollectives(int rank, int world_size, std::string group_name,
                  c10::intrusive_ptr<c10d::ProcessGroupGloo> group)
      : Collectives(rank, world_size),
        group_name_(std::move(group_name)),
        group_(std::move(group)) {}

 protected:
  std::unique_ptr<CollectiveWork> DoAllGather(const at::Tensor& output,
                                              const at::Tensor& input) override {
    return std::make_unique<GlooWork>(What("all-gather", output), StartAllGather(output, input),
                                      nullptr);
  }

  std::unique_ptr<CollectiveWork> DoReduceScatter(const at::Tensor& output,
                                                  const at::Tensor& input,
                                                  ReduceOp op) override {
    at::Tensor received = at::empty_like(input);
    auto work = StartAllToAll(received, input);
    const int world = world_size();
    return std::make_unique<GlooWork>(
        What("reduce-scatter", input), std::move(work),
        [output, received, op, world] { SumChunks(output, received, world, op); });
  }

  std::unique_ptr<CollectiveWork> DoAllReduce(const at::Tensor& tensor,
                                              ReduceOp op) override {
    if (!IsHalfPrecision(tensor)) {
      std::vector<at::Tensor> tensors = {tensor};
      c10d::AllreduceOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      auto work = group_->allreduce(tensors, options);
      const int world = world_size();
      return std::make_unique<GlooWork>(What("all-reduce", tensor), std::move(work),
                                        [tensor, op, world] {
                                          if (op == ReduceOp::kAvg) tensor.div_(world);
                                        });
    }
    // Reduce-scatter then all-gather over a buffer padded to a multiple of W.
    const int64_t world = world_size();
    const int64_t numel = tensor.numel();
    const int64_t chunk = (numel + world - 1) / world;
    const bool padded = chunk * world != numel;
    at::Tensor flat = tensor.view({-1});
    at::Tensor send = flat;
    if (padded) {
      send = at::zeros({chunk * world}, tensor.options());
      send.narrow(0, 0, numel).copy_(flat);
    }
    at::Tensor received = at::empty_like(send);
    auto work = StartAllToAll(received, send);
    std::string what = What("all-reduce", tensor);
    return std::make_unique<GlooWork>(
        what, std::move(work), [this, what, flat, send, received, op, chunk, padded] {
          at::Tensor shard = at::empty({chunk}, flat.options());
          SumChunks(shard, received, world_size(), op);
          // `send` is free again: gather the reduced shards into it, or
          // straight into the caller's tensor when no padding was needed.
          at::Tensor gathered = padded ? send : flat;
          GlooWork second(what + " (all-gather phase)", StartAllGather(gathered, shard),
                          nullptr);
          second.Wait();
          if (padded) flat.copy_(gathered.narrow(0, 0, flat.numel()));
        });
  }

  std::unique_ptr<CollectiveWork> DoBroadcast(const at::Tensor& tensor,
                                              int root) override {
    std::vector<at::Tensor> tensors = {AsBytes(tensor)};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    options.rootTensor = 0;
    return std::make_unique<GlooWork>(What("broadcast", tensor),
                                      group_->broadcast(tensors, options), nullptr);
  }

  void DoBarrier() override {
    GlooWork work(absl::StrCat(Describe(), " of group '", group_name_, "': barrier"),
                  group_->barrier(c10d::BarrierOptions()), nullptr);
    work.Wait();
  }

 private:
  // Sums the W equal chunks of `received` into `output` (divided by W for
  // kAvg), accumulating 16-bit inputs in float32.
  static void SumChunks(const at::Tensor& output, const at::Tensor& received, int world,
                        ReduceOp op) {
    at::Tensor chunks = received.view({world, -1});
    if (IsHalfPrecision(output)) {
      at::Tensor sum = chunks.sum(0, /*keepdim=*/false, at::kFloat);
      if (op == ReduceOp::kAvg) sum.div_(world);
      output.copy_(sum);
      return;
    }
    at::sum_out(const_cast<at::Tensor&>(output), chunks, {0});
    if (op == ReduceOp::kAvg) output.div_(world);
  }

  c10::intrusive_ptr<c10d::Work> StartAllGather(const at::Tensor& output,
                                                const at::Tensor& input) {
    std::vector<std::vector<at::Tensor>> outputs(1);
    outputs[0] = AsBytes(output).chunk(world_size());
    std::vector<at::Tensor> inputs = {AsBytes(input)};
    return group_->allgather(outputs, inputs);
  }

  c10::intrusive_ptr<c10d::Work> StartAllToAll(const at::Tensor& received,
                                               const at::Tensor& send) {
    at::Tensor received_bytes = AsBytes(received);
    at::Tensor send_bytes = AsBytes(send);
    std::vector<int64_t> equal_splits;  // Empty: W equal chunks.
    return group_->alltoall_base(received_bytes, send_bytes, equal_splits, equal_splits);
  }

  std::string What(const char* op, const at::Tensor& full) const {
    return absl::StrCat(Describe(), " of group '", group_name_, "': ", op, " of ",
                        full.numel(), " ", c10::toString(full.scalar_type()),
                        " elements");
  }

  const std::string group_name_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
};

// Before Gloo connects, every rank announces its view of the group in the
// store and checks the others': ranks that disagree on the world size, or
// two processes claiming one rank, would otherwise wait for each other until
// the timeout and fail with a transport error that says neither.
absl::Status CheckMembership(c10d::Store& store, int rank, int world_size,
                             const std::string& who) {
  const std::string mine = std::to_string(world_size);
  if (store.add(absl::StrCat("joined/", rank), 1) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": another process already joined as rank ", rank));
  }
  store.set(absl::StrCat("world_size/", rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  for (int peer = 0; peer < world_size; ++peer) {
    if (peer == rank) continue;
    const std::vector<uint8_t> theirs = store.get(absl::StrCat("world_size/", peer));
    if (std::string(theirs.begin(), theirs.end()) != mine) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": world size mismatch: this rank was created with world size ",
          world_size, " but rank ", peer, " was created with world size ",
          std::string(theirs.begin(), theirs.end())));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Collectives>> CreateGlooCollectives(
    c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
    const GlooOptions& options) {
  if (!store) return absl::InvalidArgumentError("CreateGlooCollectives: store is null");
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CreateGlooCollectives: rank ", rank, " is not in [0, world_size = ", world_size,
        ")"));
  }
  if (options.threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("CreateGlooCollectives: threads must be >= 1, got ", options.threads));
  }
  if (options.timeout.count() <= 0) {
    return absl::InvalidArgumentError("CreateGlooCollectives: timeout must be positive");
  }
  if (!options.interface.empty() && !options.hostname.empty()) {
    return absl::InvalidArgumentError(
        "CreateGlooCollectives: set at most one of interface and hostname");
  }
  const std::string who = absl::StrCat("rank ", rank, " of ", world_size, " of group '",
                                       options.group_name, "'");
  try {
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
    if (!options.interface.empty()) {
      gloo_options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForInterface(options.interface));
    } else if (!options.hostname.empty()) {
      gloo_options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForHostname(options.hostname));
    } else {
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    gloo_options->threads = options.threads;
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
        absl::StrCat("fsdp/", options.group_name), std::move(store));
    prefixed->setTimeout(options.timeout);
    FSDP_RETURN_IF_ERROR(CheckMembership(*prefixed, rank, world_size, who));
    auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, world_size,
                                                             gloo_options);
    return std::unique_ptr<Collectives>(
        new GlooCollectives(rank, world_size, options.group_name, std::move(group)));
  } catch (...) {
    absl::Status cause = StatusFromCurrentException(absl::StatusCode::kUnavailable);
    return absl::Status(cause.code(),
                        absl::StrCat(who, ": could not connect the group within ",
                                     options.timeout.count(), " ms: ", cause.message()));
  }
}

}  // namespace fsdp
