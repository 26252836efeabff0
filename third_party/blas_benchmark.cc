// Matrix-product throughput of the libtorch build in use. Debian's libtorch
// calls libblas.so.3: with OpenBLAS (libopenblas0-pthread, which
// tools/install_deps.sh installs) a 1024x1024 float32 product runs an order of
// magnitude faster than on the reference BLAS. This benchmark shows which
// one a machine has. Results: blas_benchmark_results.md.
#include "ATen/ATen.h"
#include "benchmark/benchmark.h"

namespace {

void BM_Matmul(benchmark::State& state) {
  const int64_t n = state.range(0);
  at::Tensor a = at::randn({n, n});
  at::Tensor b = at::randn({n, n});
  at::Tensor c = at::empty({n, n});
  for (auto _ : state) {
    at::mm_out(c, a, b);
    benchmark::DoNotOptimize(c.data_ptr<float>());
  }
  state.counters["FLOP/s"] = benchmark::Counter(
      2.0 * n * n * n * state.iterations(), benchmark::Counter::kIsRate);
}

BENCHMARK(BM_Matmul)->Arg(256)->Arg(1024)->UseRealTime();

}  // namespace
