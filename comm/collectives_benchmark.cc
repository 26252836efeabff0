// Bandwidth of the CPU collectives against the fallbacks a Gloo user has
// without them. Ranks are the benchmark's threads (->Threads(W)), each with
// its own Gloo group over loopback TCP, as in the thread-mode tests.
//
//   BM_AllGather/<bytes>          AllGatherIntoTensor (Gloo all-gather of bytes)
//   BM_AllGatherNaive/<bytes>     zero-filled full buffer + all-reduce
//   BM_ReduceScatter/<bytes>      ReduceScatterTensor (all-to-all + local sum)
//   BM_ReduceScatterNaive/<bytes> all-reduce of the whole buffer, keep a chunk
//   BM_AllReduce/bf16/<bytes>     AllReduce (reduce-scatter + all-gather)
//   BM_AllReduceNaive/bf16/<bytes> float32 copy + Gloo ring all-reduce
//   BM_AllGatherHeaders/{on,off}/<bytes>  AllGatherIntoTensor with and
//                                 without the collective header check
// <bytes> is the full (unsharded) buffer. The naive variants reduce in
// float32 (Gloo cannot reduce bfloat16), so for bfloat16 they copy to and
// from a float32 buffer, as a user working around Gloo would.
//
// Counters (rank 0): algbw = full bytes / time; busbw = algbw * (W-1)/W, the
// bytes each rank must move for an optimal all-gather or reduce-scatter
// (the convention of nccl-tests; an all-reduce moves twice that).
// Run with OMP_NUM_THREADS=1: W rank threads each running multi-threaded
// ATen kernels on a 2-core machine oversubscribe it and measure that instead.
// Results of a run: collectives_benchmark_results.md.
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ATen/ATen.h"
#include "base/status.h"
#include "benchmark/benchmark.h"
#include "comm/collectives.h"
#include "comm/gloo_collectives.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"

namespace fsdp {
namespace {

// One group per world size (and header setting), created on first use by
// all ranks at once.
Collectives& RankGroup(int world_size, int rank, bool check_headers = true) {
  static std::mutex mu;
  static std::map<std::pair<int, bool>, std::vector<std::unique_ptr<Collectives>>> groups;
  std::lock_guard<std::mutex> lock(mu);
  auto& ranks = groups[{world_size, check_headers}];
  if (ranks.empty()) {
    ranks.resize(world_size);
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::vector<std::thread> threads;
    for (int r = 0; r < world_size; ++r) {
      threads.emplace_back([&, r] {
        GlooOptions options;
        options.hostname = "127.0.0.1";
        options.group_name = "bench" + std::to_string(world_size) +
                             (check_headers ? "" : "/no_headers");
        options.check_collective_headers = check_headers;
        ranks[r] = ValueOrThrow(CreateGlooCollectives(store, r, world_size, options));
      });
    }
    for (std::thread& t : threads) t.join();
  }
  return *ranks[rank];
}

enum class Algorithm {
  kAllGather,
  kAllGatherNaive,
  kReduceScatter,
  kReduceScatterNaive,
  kAllReduce,
  kAllReduceNaive,
};

template <Algorithm kAlgorithm, at::ScalarType kDtype>
void BM_Collective(benchmark::State& state) {
  const int world = state.threads();
  const int rank = state.thread_index();
  Collectives& comm = RankGroup(world, rank);
  const int64_t full_bytes = state.range(0);
  const int64_t element = c10::elementSize(kDtype);
  const int64_t shard_numel = full_bytes / element / world;
  const int64_t full_numel = shard_numel * world;
  at::Tensor shard = at::randn({shard_numel}).to(kDtype);
  at::Tensor full = at::randn({full_numel}).to(kDtype);
  at::Tensor scratch = at::empty({full_numel}, at::kFloat);

  for (auto _ : state) {
    switch (kAlgorithm) {
      case Algorithm::kAllGather:
        comm.AllGatherIntoTensor(full, shard)->Wait();
        break;
      case Algorithm::kAllGatherNaive:
        scratch.zero_();
        scratch.narrow(0, rank * shard_numel, shard_numel).copy_(shard);
        comm.AllReduce(scratch, ReduceOp::kSum)->Wait();
        full.copy_(scratch);
        break;
      case Algorithm::kReduceScatter:
        comm.ReduceScatterTensor(shard, full, ReduceOp::kAvg)->Wait();
        break;
      case Algorithm::kReduceScatterNaive:
        scratch.copy_(full);
        comm.AllReduce(scratch, ReduceOp::kAvg)->Wait();
        shard.copy_(scratch.narrow(0, rank * shard_numel, shard_numel));
        break;
      case Algorithm::kAllReduce:
        comm.AllReduce(full, ReduceOp::kAvg)->Wait();
        break;
      case Algorithm::kAllReduceNaive:
        scratch.copy_(full);
        comm.AllReduce(scratch, ReduceOp::kAvg)->Wait();
        full.copy_(scratch);
        break;
    }
  }
  if (rank == 0) {
    // google-benchmark divides a rate counter by the real time summed over
    // all threads; one rank's bytes times W gives bytes per wall second.
    const double bytes =
        static_cast<double>(full_numel * element) * state.iterations() * world;
    state.counters["algbw"] =
        benchmark::Counter(bytes, benchmark::Counter::kIsRate, benchmark::Counter::kIs1024);
    state.counters["busbw"] = benchmark::Counter(bytes * (world - 1) / world,
                                                 benchmark::Counter::kIsRate,
                                                 benchmark::Counter::kIs1024);
  }
}

// Full buffer sizes 1 KiB .. 64 MiB, at W = 2 and 4.
void Sizes(benchmark::internal::Benchmark* b) {
  b->RangeMultiplier(4)->Range(1 << 10, 64 << 20)->Threads(2)->Threads(4)->UseRealTime();
}

BENCHMARK_TEMPLATE(BM_Collective, Algorithm::kAllGather, at::kFloat)
    ->Name("BM_AllGather/f32")->Apply(Sizes);
BENCHMARK_TEMPLATE(BM_Collective, Algorithm::kAllGatherNaive, at::kFloat)
    ->Name("BM_AllGatherNaive/f32")->Apply(Sizes);
BENCHMARK_TEMPLATE(BM_Collective, Algorithm::kReduceScatter, at::kFloat)
    ->Name("BM_ReduceScatter/f32")->Apply(Sizes);
BENCHMARK_TEMPLATE(BM_Collective, Algorithm::kReduceScatterNaive, at::kFloat)
    ->Name("BM_ReduceScatterNaive/f32")->Apply(Sizes);
BENCHMARK_TEMPLATE(BM_Collective, Algorithm::kAllGather, at::kBFloat16)
    ->Name("BM_AllGather/bf16")->Apply(Sizes);
BENCHMARK_TEMPLATE(BM_Collective, Algorithm::kAllGatherNaive, at::kBFloat16)
    ->Name("BM_AllGatherNaive/bf16")->Apply(Sizes);
BENCHMARK_TEMPLATE(BM_Collective, Algorithm::kReduceScatter, at::kBFloat16)
    ->Name("BM_ReduceScatter/bf16")->Apply(Sizes);
BENCHMARK_TEMPLATE(BM_Collective, Algorithm::kReduceScatterNaive, at::kBFloat16)
    ->Name("BM_ReduceScatterNaive/bf16")->Apply(Sizes);
BENCHMARK_TEMPLATE(BM_Collective, Algorithm::kAllReduce, at::kBFloat16)
    ->Name("BM_AllReduce/bf16")->Apply(Sizes);
BENCHMARK_TEMPLATE(BM_Collective, Algorithm::kAllReduceNaive, at::kBFloat16)
    ->Name("BM_AllReduceNaive/bf16")->Apply(Sizes);

// The price of NOTE [Collective headers] (gloo_collectives.cc): float32
// all-gathers with the headers checked (the default) and without.
template <bool kHeaders>
void BM_AllGatherHeaders(benchmark::State& state) {
  const int world = state.threads();
  Collectives& comm = RankGroup(world, state.thread_index(), kHeaders);
  const int64_t shard_numel = state.range(0) / 4 / world;
  at::Tensor shard = at::randn({shard_numel});
  at::Tensor full = at::empty({shard_numel * world});
  for (auto _ : state) comm.AllGatherIntoTensor(full, shard)->Wait();
}

void HeaderSizes(benchmark::internal::Benchmark* b) {
  b->Arg(1 << 10)->Arg(64 << 10)->Arg(4 << 20)->Threads(2)->Threads(4)->UseRealTime();
}

BENCHMARK_TEMPLATE(BM_AllGatherHeaders, true)->Name("BM_AllGatherHeaders/on")->Apply(HeaderSizes);
BENCHMARK_TEMPLATE(BM_AllGatherHeaders, false)
    ->Name("BM_AllGatherHeaders/off")->Apply(HeaderSizes);

}  // namespace
}  // namespace fsdp
