// Optimizer-step benchmark: libtorch's per-parameter AdamW and SGD against
// FlatShardAdamW and FlatShardSGD (optim/flat_shard_optimizers.h) over the
// same FSDP model's shards, beside PyTorch's AdamW and SGD over the same
// parameter shapes in each implementation that torch has on the CPU
// (models/pytorch_optimizer_benchmark.py, by the interop Python of
// testing/torch_python.h). Run it from a build against the same torch as
// that Python (tools/test_torch2.sh's CMake build with torch 2.15), so that
// both sides use the same kernels.
//
//   bazel run //models:optimizer_step_benchmark   # -O2 (see .bazelrc)
//
// The model is the GPT of models/gpt.h wrapped per block (FULL_SHARD) in a
// group of one rank: a rank steps its own shard only, so one rank holding
// the whole model is the most work a rank can have, and the per-parameter
// overhead is the same at any W. Gradients come from one backward and stay
// set, so every timed step does the full work. Each case times `steps`
// steps after `warmup` (the state is created in the first), and reports the
// median as the benchmark's time with the 10th and 90th percentiles beside
// it, as the Python side does. The *_fused cases step with PyTorch's fused
// kernels (FlatShardKernel::kFused, libtorch >= 2.4; skipped before).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "benchmark/benchmark.h"
#include "comm/gloo_collectives.h"
#include "fsdp/fully_shard.h"
#include "fsdp/utilities.h"
#include "models/gpt.h"
#include "optim/flat_shard_optimizers.h"
#include "testing/torch_python.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"
#include "torch/optim/adamw.h"
#include "torch/optim/sgd.h"

namespace {

using Clock = std::chrono::steady_clock;

struct ModelShape {
  const char* name;
  int n_layer, n_head, n_embd, block_size;
};

// The step benchmark's model (3.3M parameters in 52 tensors), and a wider,
// deeper one (25M in 100) where the elementwise work dominates.
constexpr ModelShape kShapes[] = {{"gpt_4x256", 4, 4, 256, 128}, {"gpt_8x512", 8, 8, 512, 256}};
constexpr int kWarmup = 3;
constexpr int kSteps = 30;

struct Timing {
  double median_ms = 0, p10_ms = 0, p90_ms = 0;
};

Timing Summarize(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  auto at = [&](double q) {
    return ms[std::min(ms.size() - 1, static_cast<size_t>(q * ms.size()))];
  };
  return {at(0.5), at(0.1), at(0.9)};
}

void Report(benchmark::State& state, const Timing& t) {
  for (auto _ : state) state.SetIterationTime(t.median_ms / 1e3);
  state.counters["p10_ms"] = t.p10_ms;
  state.counters["p90_ms"] = t.p90_ms;
}

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const std::string& impl,
                                                       std::vector<at::Tensor> params) {
  // PyTorch side's options (models/pytorch_optimizer_benchmark.py).
  const auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
  const auto sgd = torch::optim::SGDOptions(1e-3).momentum(0.9);
  const fsdp::FlatShardKernel kernel = absl::EndsWith(impl, "_fused")
                                           ? fsdp::FlatShardKernel::kFused
                                           : fsdp::FlatShardKernel::kExact;
  if (impl == "libtorch_adamw") return std::make_unique<torch::optim::AdamW>(params, adamw);
  if (absl::StartsWith(impl, "flat_shard_adamw")) {
    return std::make_unique<fsdp::FlatShardAdamW>(params, adamw, kernel);
  }
  if (impl == "libtorch_sgd") return std::make_unique<torch::optim::SGD>(params, sgd);
  return std::make_unique<fsdp::FlatShardSGD>(params, sgd, kernel);
}

// Worker mode: times one C++ case and prints its result line.
int RunCppWorker(const ModelShape& shape, const std::string& impl) {
  if (absl::EndsWith(impl, "_fused") && !fsdp::kHaveFusedOptimizerKernels) {
    std::printf("unavailable=no_fused_optimizer_kernels_before_libtorch_2.4\n");
    return 0;
  }
  fsdp::GlooOptions gloo;
  gloo.hostname = "127.0.0.1";
  auto comm = fsdp::ValueOrThrow(
      fsdp::CreateGlooCollectives(c10::make_intrusive<c10d::HashStore>(), 0, 1, gloo));
  models::GptConfig config;
  config.n_layer = shape.n_layer;
  config.n_head = shape.n_head;
  config.n_embd = shape.n_embd;
  config.block_size = shape.block_size;
  config.seed = 1;
  models::Gpt model(config);
  auto wrapped = fsdp::ValueOrThrow(fsdp::FullyShardedModel::Wrap(
      model.ptr(), *comm, {}, *fsdp::ModuleTypePolicy::Of<models::BlockImpl>()));
  auto optimizer = MakeOptimizer(impl, fsdp::UniqueParameters(*model));
  at::manual_seed(0);
  const at::Tensor batch = at::randint(256, {2, shape.block_size + 1}, at::kLong);
  models::LanguageModelLoss(model->forward(batch.narrow(1, 0, shape.block_size)),
                            batch.narrow(1, 1, shape.block_size))
      .backward();
  std::vector<double> ms;
  for (int step = 0; step < kWarmup + kSteps; ++step) {
    const Clock::time_point start = Clock::now();
    optimizer->step();
    if (step >= kWarmup) {
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    }
  }
  const Timing t = Summarize(ms);
  int64_t runs = 0;
  if (auto* flat = dynamic_cast<fsdp::FlatShardAdamW*>(optimizer.get())) {
    runs = flat->last_step_stats().runs;
  } else if (auto* flat = dynamic_cast<fsdp::FlatShardSGD*>(optimizer.get())) {
    runs = flat->last_step_stats().runs;
  }
  int64_t tensors = 0, elements = 0;
  for (const at::Tensor& p : fsdp::UniqueParameters(*model)) {
    ++tensors;
    elements += p.numel();
  }
  std::printf("median_ms=%.4f p10_ms=%.4f p90_ms=%.4f param_tensors=%lld params_M=%.3f runs=%lld\n",
              t.median_ms, t.p10_ms, t.p90_ms, static_cast<long long>(tensors), elements / 1e6,
              static_cast<long long>(runs));
  return 0;
}

const ModelShape* ShapeNamed(const std::string& name) {
  for (const ModelShape& shape : kShapes) {
    if (name == shape.name) return &shape;
  }
  return nullptr;
}

// Runs one case in a process of its own (ours: this binary in worker mode;
// PyTorch's: the script), so that no case inherits another's heap, and
// reports the line it printed.
void RunCase(benchmark::State& state, const ModelShape& shape, const std::string& impl) {
  std::string command;
  if (absl::StartsWith(impl, "pytorch_")) {
    command = absl::StrCat(::fsdp::testing::TorchPython(), " ",
                           ::fsdp::testing::ScriptPath("models/pytorch_optimizer_benchmark.py"),
                           " ", impl.substr(std::string("pytorch_").size()), " ", shape.n_layer,
                           " ", shape.n_head, " ", shape.n_embd, " ", shape.block_size, " ",
                           kWarmup, " ", kSteps);
  } else {
    // The shell popen starts would read /proc/self/exe as itself.
    char self[4096] = {};
    const ssize_t length = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (length <= 0) {
      state.SkipWithError("cannot read /proc/self/exe");
      return;
    }
    command = absl::StrCat("'", std::string(self, length), "' --worker ", shape.name, " ", impl);
  }
  std::string result, output;
  if (FILE* pipe = ::popen((command + " 2>&1").c_str(), "r")) {
    char line[512];
    while (std::fgets(line, sizeof(line), pipe) != nullptr) {
      output += line;
      const absl::string_view text = absl::StripAsciiWhitespace(line);
      if (absl::StartsWith(text, "median_ms=") || absl::StartsWith(text, "unavailable=")) {
        result = std::string(text);
      }
    }
    ::pclose(pipe);
  }
  if (result.empty()) {
    state.SkipWithError(("no result; the case printed: " + output).c_str());
    return;
  }
  std::map<std::string, double> values;
  for (absl::string_view field : absl::StrSplit(result, ' ')) {
    const std::vector<std::string> kv = absl::StrSplit(field, absl::MaxSplits('=', 1));
    if (kv.size() == 2 && kv[0] == "unavailable") {
      state.SkipWithError(("unavailable: " + kv[1]).c_str());
      return;
    }
    double v = 0;
    if (kv.size() == 2 && absl::SimpleAtod(kv[1], &v)) values[kv[0]] = v;
  }
  Report(state, {values["median_ms"], values["p10_ms"], values["p90_ms"]});
  for (const char* key : {"param_tensors", "params_M", "runs"}) {
    if (values.count(key) != 0 && values[key] != 0) state.counters[key] = values[key];
  }
}

void PrintPyTorchSide() {
  const std::string python = ::fsdp::testing::TorchPython();
  std::string version = "unknown";
  if (FILE* pipe = ::popen(
          (python + " -c 'import torch; print(torch.__version__)' 2>/dev/null").c_str(), "r")) {
    char line[128] = {};
    if (std::fgets(line, sizeof(line), pipe) != nullptr) {
      version = std::string(absl::StripAsciiWhitespace(line));
    }
    ::pclose(pipe);
  }
  std::printf("pytorch side: %s (torch %s)\n", python.c_str(), version.c_str());
  std::fflush(stdout);
}

void Register(const std::string& name, std::function<void(benchmark::State&)> run) {
  benchmark::RegisterBenchmark(name.c_str(), [run](benchmark::State& state) { run(state); })
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--worker") {
    const ModelShape* shape = ShapeNamed(argv[2]);
    if (shape == nullptr) return 2;
    try {
      return RunCppWorker(*shape, argv[3]);
    } catch (...) {
      std::printf("worker failed: %s\n",
                  std::string(fsdp::StatusFromCurrentException().message()).c_str());
      return 1;
    }
  }
  for (const ModelShape& shape : kShapes) {
    for (const std::string impl :
         {"libtorch_adamw", "flat_shard_adamw", "flat_shard_adamw_fused", "pytorch_adamw_for_loop",
          "pytorch_adamw_foreach", "pytorch_adamw_fused", "libtorch_sgd", "flat_shard_sgd",
          "flat_shard_sgd_fused", "pytorch_sgd_for_loop", "pytorch_sgd_foreach",
          "pytorch_sgd_fused"}) {
      Register(absl::StrCat("OptimizerStep/", shape.name, "/", impl),
               [&shape, impl](benchmark::State& state) { RunCase(state, shape, impl); });
    }
  }
  benchmark::Initialize(&argc, argv);
  PrintPyTorchSide();
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
