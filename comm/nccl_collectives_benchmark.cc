// The two NCCL transports of comm/nccl_collectives.h side by side: direct
// NCCL calls on the caller's stream against libtorch's ProcessGroupNCCL, for
// the collectives FSDP issues. Ranks are the benchmark's threads
// (->Threads(W)), rank r on GPU r, W = every visible GPU; each transport and
// world size has its groups, made on first use by all ranks at once.
//
//   BM_Nccl/<transport>/<op>/<bytes>/threads:W
//
// <bytes> is the full (unsharded) buffer, float32. One iteration issues
// kBatch collectives back to back on the current stream (as FSDP's unit
// after unit), waits for each, and synchronizes the device; the time is per
// collective. Counters (averaged over ranks): busbw, the bytes each rank
// must move for an optimal all-gather or reduce-scatter (full bytes *
// (W-1)/W, twice that for all-reduce) per second, the convention of
// nccl-tests; issue_us, host time to issue one collective (the per-unit
// host cost the transport adds).
//
// Needs two or more GPUs: NCCL refuses two ranks on one device, and at one
// rank the Collectives API completes every collective itself. UNVERIFIED:
// no machine with two GPUs has run it; the run on one H200 (2026-11-26)
// skipped it (docs/building.md, "GPU builds").
#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "benchmark/benchmark.h"
#include "c10/cuda/CUDAFunctions.h"
#include "comm/collectives.h"
#include "comm/nccl_collectives.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kBatch = 4;

enum class Op { kAllGather, kReduceScatter, kAllReduce };

Collectives& RankGroup(NcclTransport transport, int world_size, int rank) {
  static std::mutex mu;
  static std::map<std::pair<NcclTransport, int>, std::vector<std::unique_ptr<Collectives>>>
      groups;
  std::lock_guard<std::mutex> lock(mu);
  auto& ranks = groups[{transport, world_size}];
  if (ranks.empty()) {
    ranks.resize(world_size);
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::vector<absl::Status> made(world_size);
    std::vector<std::thread> threads;
    for (int r = 0; r < world_size; ++r) {
      threads.emplace_back([&, r] {
        c10::cuda::set_device(static_cast<c10::DeviceIndex>(r));
        NcclOptions options;
        options.transport = transport;
        options.group_name = absl::StrCat("bench", static_cast<int>(transport), "/", world_size);
        absl::StatusOr<std::unique_ptr<Collectives>> group =
            CreateNcclCollectives(store, r, world_size, r, options);
        made[r] = group.status();
        if (group.ok()) ranks[r] = std::move(*group);
      });
    }
    for (std::thread& t : threads) t.join();
    for (const absl::Status& status : made) ThrowIfError(status);
  }
  TORCH_CHECK(ranks[rank] != nullptr, "no group for rank ", rank, " (its creation failed)");
  return *ranks[rank];
}

void RunOrThrow(benchmark::State& state, NcclTransport transport, Op op) {
  const int world = state.threads();
  const int rank = state.thread_index();
  if (world < 2) {
    state.SkipWithError("needs two or more GPUs (one rank per GPU)");
    return;
  }
  const c10::DeviceIndex device_index = static_cast<c10::DeviceIndex>(rank);
  c10::cuda::set_device(device_index);
  Collectives& group = RankGroup(transport, world, rank);
  const int64_t full_numel = state.range(0) / 4;
  const int64_t shard_numel = full_numel / world;
  const auto options = at::TensorOptions(at::kFloat).device(c10::DeviceType::CUDA, device_index);
  const at::Tensor full = at::ones({shard_numel * world}, options);
  const at::Tensor shard = at::ones({shard_numel}, options);
  auto issue = [&]() -> std::unique_ptr<CollectiveWork> {
    switch (op) {
      case Op::kAllGather:
        return group.AllGatherIntoTensor(full, shard);
      case Op::kReduceScatter:
        return group.ReduceScatterTensor(shard, full, ReduceOp::kAvg);
      case Op::kAllReduce:
        return group.AllReduce(full, ReduceOp::kAvg);
    }
    return nullptr;
  };
  issue()->Wait();  // Warm-up: lazy communicator set-up, NCCL's buffers.
  c10::cuda::device_synchronize();
  double issue_seconds = 0;
  for (auto _ : state) {
    const Clock::time_point start = Clock::now();
    std::vector<std::unique_ptr<CollectiveWork>> works;
    for (int i = 0; i < kBatch; ++i) works.push_back(issue());
    issue_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    for (auto& work : works) work->Wait();
    c10::cuda::device_synchronize();
    state.SetIterationTime(std::chrono::duration<double>(Clock::now() - start).count() / kBatch);
  }
  const double moved = static_cast<double>(full.nbytes()) * (world - 1) / world *
                       (op == Op::kAllReduce ? 2 : 1);
  state.counters["busbw"] = benchmark::Counter(
      moved, static_cast<benchmark::Counter::Flags>(benchmark::Counter::kIsIterationInvariantRate |
                                                    benchmark::Counter::kAvgThreads));
  state.counters["issue_us"] = benchmark::Counter(
      issue_seconds * 1e6 / (kBatch * static_cast<double>(state.iterations())),
      benchmark::Counter::kAvgThreads);
}

void BM_Nccl(benchmark::State& state, NcclTransport transport, Op op) {
  try {
    RunOrThrow(state, transport, op);
  } catch (...) {
    state.SkipWithError(std::string(StatusFromCurrentException().message()).c_str());
  }
}

void Register(const char* transport_name, NcclTransport transport, const char* op_name, Op op,
              int world) {
  benchmark::RegisterBenchmark(
      absl::StrCat("BM_Nccl/", transport_name, "/", op_name).c_str(),
      [=](benchmark::State& state) { BM_Nccl(state, transport, op); })
      ->Arg(1 << 20)
      ->Arg(16 << 20)
      ->Arg(128 << 20)
      ->Threads(world)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
}

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  using fsdp::NcclTransport;
  using fsdp::Op;
  const int world = std::max<int>(1, c10::cuda::device_count());
  for (const auto& [name, transport] : {std::pair{"direct", NcclTransport::kDirect},
                                        std::pair{"process_group", NcclTransport::kProcessGroup}}) {
    fsdp::Register(name, transport, "all_gather", Op::kAllGather, world);
    fsdp::Register(name, transport, "reduce_scatter", Op::kReduceScatter, world);
    fsdp::Register(name, transport, "all_reduce", Op::kAllReduce, world);
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
