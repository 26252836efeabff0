// Host cost of a FlatParamHandle, without communication: at W = 1 the
// all-gather and reduce-scatter are copies, so what remains is what the
// handle itself adds per unit per step (storage allocation and freeing,
// pointing every parameter at new data, flattening gradients). This is the
// per-unit overhead FSDP pays on top of the collectives.
//
//   BM_UnshardReshard/<params>/<elements>   Unshard() + Reshard()
//   BM_ReduceGradients/<params>/<elements>  PrepareGradientsForBackward() +
//                                           ReduceGradients() + Reshard()
// <params> parameters share <elements> elements (a transformer block has 12).
// Results: flat_param_handle_benchmark_results.md.
#include <memory>
#include <vector>

#include "ATen/ATen.h"
#include "base/status.h"
#include "benchmark/benchmark.h"
#include "comm/gloo_collectives.h"
#include "fsdp/flat_param_handle.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"

namespace fsdp {
namespace {

Collectives& SingleRankGroup() {
  static std::unique_ptr<Collectives> group = [] {
    GlooOptions options;
    options.hostname = "127.0.0.1";
    return ValueOrThrow(
        CreateGlooCollectives(c10::make_intrusive<c10d::HashStore>(), 0, 1, options));
  }();
  return *group;
}

struct Unit {
  std::vector<at::Tensor> params;
  std::unique_ptr<FlatParamHandle> handle;
};

Unit MakeUnit(int64_t num_params, int64_t elements) {
  Unit unit;
  std::vector<FlatParamEntry> entries;
  for (int64_t i = 0; i < num_params; ++i) {
    unit.params.push_back(at::randn({elements / num_params}).requires_grad_());
    entries.push_back({"p" + std::to_string(i), unit.params.back()});
  }
  unit.handle = ValueOrThrow(FlatParamHandle::Create("unit", entries, SingleRankGroup()));
  return unit;
}

void BM_UnshardReshard(benchmark::State& state) {
  Unit unit = MakeUnit(state.range(0), state.range(1));
  for (auto _ : state) {
    unit.handle->Unshard();
    unit.handle->Reshard();
  }
  state.counters["ns_per_param"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * state.range(0),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void BM_ReduceGradients(benchmark::State& state) {
  Unit unit = MakeUnit(state.range(0), state.range(1));
  unit.handle->Unshard();
  for (auto _ : state) {
    state.PauseTiming();
    unit.handle->Unshard();
    for (at::Tensor& p : unit.params) p.mutable_grad() = at::ones_like(p);
    state.ResumeTiming();
    unit.handle->ReduceGradients();
    unit.handle->Reshard();
    state.PauseTiming();
    unit.handle->Unshard();
    unit.handle->PrepareGradientsForBackward();
    state.ResumeTiming();
  }
}

void Args(benchmark::internal::Benchmark* b) {
  for (int64_t params : {1, 12, 64}) {
    for (int64_t elements : {int64_t{1} << 12, int64_t{1} << 20}) b->Args({params, elements});
  }
}

BENCHMARK(BM_UnshardReshard)->Apply(Args);
BENCHMARK(BM_ReduceGradients)->Apply(Args);

}  // namespace
}  // namespace fsdp
