// Host overhead of the FSDP runtime: what a forward and a backward cost
// beyond the model's own compute when communication is free, per unit,
// beside PyTorch's FSDP2 on the same structure (fsdp/host_overhead_fsdp2.py).
//
//   bazel run //fsdp:host_overhead_benchmark   # -O2 (see .bazelrc)
//
// The model: kUnits units of one Linear(8, 8) and a tanh each, under a root
// without parameters of its own; one row of input. The group: rank 0 of 2
// whose collectives complete at once (InstantCollectives: the all-gather
// copies this rank's shard into both halves, the reduce-scatter copies its
// own half, nothing crosses a wire). FSDP2's side is rank 0 of 2 over
// PyTorch's fake process group, whose collectives return at once without
// touching data. Each case times the unwrapped model and the wrapped one in
// the same process, one intra-op thread, medians of kSteps steps after
// kWarmup; the counters are the wrapped model's extra time per unit:
// (wrapped - unwrapped) / kUnits, for the forward and for the backward.
// Results: host_overhead_benchmark_results.md.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "ATen/Parallel.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "benchmark/benchmark.h"
#include "comm/collectives.h"
#include "fsdp/fully_shard.h"
#include "fsdp/unit_forward.h"
#include "testing/torch_python.h"
#include "torch/nn/modules/container/modulelist.h"
#include "torch/nn/modules/linear.h"

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kUnits = 32;
constexpr int kWarmup = 20;
constexpr int kSteps = 200;

class InstantCollectives final : public Collectives {
 public:
  InstantCollectives() : Collectives(/*rank=*/0, /*world_size=*/2) {}

 protected:
  std::unique_ptr<CollectiveWork> DoAllGather(const at::Tensor& output,
                                              const at::Tensor& input) override {
    const int64_t n = input.numel();
    for (int r = 0; r < world_size(); ++r) output.narrow(0, r * n, n).copy_(input);
    return MakeCompletedWork();
  }
  std::unique_ptr<CollectiveWork> DoReduceScatter(const at::Tensor& output,
                                                  const at::Tensor& input, ReduceOp) override {
    output.copy_(input.narrow(0, rank() * output.numel(), output.numel()));
    return MakeCompletedWork();
  }
  std::unique_ptr<CollectiveWork> DoAllReduce(const at::Tensor&, ReduceOp) override {
    return MakeCompletedWork();
  }
  std::unique_ptr<CollectiveWork> DoBroadcast(const at::Tensor&, int) override {
    return MakeCompletedWork();
  }
  std::unique_ptr<CollectiveWork> DoAllToAll(const at::Tensor&, const at::Tensor&) override {
    return MakeCompletedWork();
  }
  void DoBarrier() override {}
};

struct TinyBlockImpl : torch::nn::Module, ShardableModule {
  TinyBlockImpl() { fc = register_module("fc", torch::nn::Linear(8, 8)); }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    return unit.Return(at::tanh(fc->forward(unit.Input(x))));
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(TinyBlock);

struct TinyNetImpl : torch::nn::Module, ShardableModule {
  TinyNetImpl() {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < kUnits; ++i) blocks->push_back(TinyBlock());
  }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    x = unit.Input(x);
    for (const auto& block : *blocks) x = block->as<TinyBlockImpl>()->forward(x);
    return unit.Return(x);
  }
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(TinyNet);

struct PassTimes {
  double forward_us = 0;
  double backward_us = 0;
};

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

PassTimes TimePasses(TinyNet& model) {
  const at::Tensor x = at::randn({1, 8});
  std::vector<double> forward, backward;
  for (int step = 0; step < kWarmup + kSteps; ++step) {
    const Clock::time_point start = Clock::now();
    at::Tensor loss = model->forward(x).sum();
    const Clock::time_point middle = Clock::now();
    loss.backward();
    const Clock::time_point end = Clock::now();
    for (at::Tensor& p : model->parameters()) p.mutable_grad() = at::Tensor();
    if (step >= kWarmup) {
      forward.push_back(std::chrono::duration<double, std::micro>(middle - start).count());
      backward.push_back(std::chrono::duration<double, std::micro>(end - middle).count());
    }
  }
  return {Median(forward), Median(backward)};
}

void Report(benchmark::State& state, const PassTimes& base, const PassTimes& wrapped) {
  state.SetIterationTime((wrapped.forward_us + wrapped.backward_us) / 1e6);
  state.counters["forward_us_per_unit"] = (wrapped.forward_us - base.forward_us) / kUnits;
  state.counters["backward_us_per_unit"] = (wrapped.backward_us - base.backward_us) / kUnits;
  state.counters["unwrapped_step_us"] = base.forward_us + base.backward_us;
}

void BM_HostOverhead(benchmark::State& state, ShardingStrategy strategy) {
  at::set_num_threads(1);
  for (auto _ : state) {
    TinyNet plain;
    const PassTimes base = TimePasses(plain);
    TinyNet model;
    InstantCollectives group;
    FsdpOptions options;
    options.strategy = strategy;
    auto wrapped = ValueOrThrow(FullyShardedModel::Wrap(model.ptr(), group, options,
                                                        *ModuleTypePolicy::Of<TinyBlockImpl>()));
    Report(state, base, TimePasses(model));
  }
}

// Runs host_overhead_fsdp2.py and reports its figures the same way.
void BM_HostOverheadFsdp2(benchmark::State& state) {
  const std::string command =
      absl::StrCat(testing::TorchPython(), " ", testing::ScriptPath("fsdp/host_overhead_fsdp2.py"),
                   " ", kUnits, " ", kWarmup, " ", kSteps, " 2>/dev/null");
  for (auto _ : state) {
    std::string line;
    if (FILE* pipe = ::popen(command.c_str(), "r")) {
      char buffer[512] = {};
      while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) line = buffer;
      ::pclose(pipe);
    }
    if (absl::StartsWith(line, "unavailable=")) {
      state.SkipWithError(line.c_str());
      return;
    }
    std::map<std::string, double> values;
    for (absl::string_view field : absl::StrSplit(line, absl::ByAnyChar(" \n"))) {
      const std::vector<std::string> kv = absl::StrSplit(field, '=');
      double v = 0;
      if (kv.size() == 2 && absl::SimpleAtod(kv[1], &v)) values[kv[0]] = v;
    }
    if (values.size() != 4) {
      state.SkipWithError(absl::StrCat("no figures from: ", command, " (got '", line, "')").c_str());
      return;
    }
    Report(state, {values["base_forward_us"], values["base_backward_us"]},
           {values["forward_us"], values["backward_us"]});
  }
}

void Register(const char* name, ShardingStrategy strategy) {
  benchmark::RegisterBenchmark(absl::StrCat("BM_HostOverhead/", name).c_str(), BM_HostOverhead,
                               strategy)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
}

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  fsdp::Register("full_shard", fsdp::ShardingStrategy::kFullShard);
  fsdp::Register("shard_grad_op", fsdp::ShardingStrategy::kShardGradOp);
  fsdp::Register("no_shard", fsdp::ShardingStrategy::kNoShard);
  benchmark::RegisterBenchmark("BM_HostOverhead/pytorch_fsdp2", fsdp::BM_HostOverheadFsdp2)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
