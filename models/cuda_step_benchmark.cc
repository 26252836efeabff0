// Training-step benchmark of the GPT (models/gpt.h) on CUDA devices: this
// project's FSDP over NCCL for each sharding strategy, with bf16 mixed
// precision, with CPU offload and over ProcessGroupNCCL, against the
// unwrapped model on the same device. Its PyTorch counterpart is
// models/fsdp_step_benchmark.py (PyTorch's FullyShardedDataParallel and
// fully_shard on the same model, batch and optimizer); tools/gpu_verify.sh
// runs both and tools/gpu_step_table.py puts them side by side.
//
//   cuda_step_benchmark                                # world size 1
//   launch --nproc_per_node=W -- cuda_step_benchmark   # rank r on GPU r % GPUs
//
// With fewer GPUs than ranks only the unwrapped and staged cases can run
// (NCCL refuses two ranks on one device): pass
// --benchmark_filter='unwrapped|staged'. Every rank runs every case in the
// same order (the filter must agree); rank 0 reports. Before the first
// case, a few untimed steps warm the device and libraries up, so that the
// first case is not the slow one. A case builds and wraps its model, runs
// warm-up steps, then times each of 50 steps from its start to a device
// synchronize after the optimizer step. Reported per case: the step time
// (manual time, the mean; median_ms, p10_ms and p90_ms besides), tokens
// per second over all ranks at the median, the
// peak of the caching allocator's allocated and reserved bytes during the
// timed steps (PyTorch's max_memory_allocated / max_memory_reserved), and
// the bytes of model state this rank holds on the device (parameters,
// gradients, AdamW state).
//
// The optimizer, on both sides, is AdamW stepped by PyTorch's fused kernel
// (here FlatShardAdamW with FlatShardKernel::kFused, there
// torch.optim.AdamW(fused=True); offloaded host parameters only from torch
// 2.4, which has the CPU kernel), so that neither side's step time carries
// an optimizer the other does not use; the unwrapped:per_parameter_adamw
// case shows what libtorch's own AdamW, one op sequence per parameter,
// costs instead.
//
// Ran on one H200 with torch 2.11 on 2026-11-26, at W = 1 and at W = 2
// sharing the GPU: models/gpu_verify_h200/README.md has the results and how
// much they vary between runs. The NCCL cases at W >= 2 need two GPUs and
// have not run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "benchmark/benchmark.h"
#include "c10/cuda/CUDACachingAllocator.h"
#include "c10/cuda/CUDAFunctions.h"
#include "comm/gloo_collectives.h"
#include "comm/launch_environment.h"
#include "comm/nccl_collectives.h"
#include "comm/rendezvous.h"
#include "comm/staged_collectives.h"
#include "fsdp/fully_shard.h"
#include "fsdp/utilities.h"
#include "models/gpt.h"
#include "optim/flat_shard_optimizers.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"
#include "torch/optim/adamw.h"

namespace {

using Clock = std::chrono::steady_clock;

struct StepConfig {
  int n_layer, n_head, n_embd, block_size, batch_per_rank;
  int warmup = 5, steps = 50;
};

// "small": the CPU benchmark's model (models/train_step_benchmark.cc), where
// per-unit host work dominates a GPU step. "gpt2": GPT-2 small's shape
// (byte vocabulary, so 85 M parameters), where compute does.
const StepConfig kSmall{4, 4, 256, 128, 8};
const StepConfig kGpt2{12, 12, 768, 1024, 8};

// Every case but unwrapped:per_parameter_adamw steps with FlatShardAdamW:
// PyTorch's fused AdamW kernel (what models/fsdp_step_benchmark.py runs,
// fused=True) over the shards, one call for all of them; libtorch < 2.4 has
// no such kernel, and its op sequence per run is used there.
constexpr fsdp::FlatShardKernel kOptimizerKernel = fsdp::kHaveFusedOptimizerKernels
                                                       ? fsdp::FlatShardKernel::kFused
                                                       : fsdp::FlatShardKernel::kExact;

struct Case {
  bool wrap = true;
  fsdp::ShardingStrategy strategy = fsdp::ShardingStrategy::kFullShard;
  bool bf16 = false;  // param_dtype bfloat16, reduce_dtype float32.
  bool offload = false;
  fsdp::NcclTransport transport = fsdp::NcclTransport::kDirect;
  // Staged collectives over Gloo (comm/staged_collectives.h) instead of
  // NCCL: how ranks sharing a GPU talk.
  bool staged = false;
  // libtorch's torch::optim::AdamW, which steps parameter by parameter
  // (about nine kernels each), instead of FlatShardAdamW.
  bool per_parameter_adamw = false;
};

// The job this process is a rank of; set up once in main.
struct Job {
  fsdp::LaunchEnvironment env;
  c10::intrusive_ptr<c10d::Store> store;
  int groups_made = 0;
};
Job* job = nullptr;

int64_t ModelStateBytesOnDevice(torch::nn::Module& model, torch::optim::AdamW& optimizer) {
  auto on_device = [](const at::Tensor& t) { return t.defined() && t.is_cuda() ? t.nbytes() : 0; };
  int64_t bytes = 0;
  for (const at::Tensor& p : fsdp::UniqueParameters(model)) {
    bytes += on_device(p) + on_device(p.grad());
  }
  for (const auto& item : optimizer.state()) {
    auto& adamw = static_cast<torch::optim::AdamWParamState&>(*item.second);
    bytes += on_device(adamw.exp_avg()) + on_device(adamw.exp_avg_sq());
  }
  return bytes;
}

// This rank's GPU: ranks share them round-robin.
c10::Device RankDevice() {
  return c10::Device(c10::DeviceType::CUDA,
                     static_cast<c10::DeviceIndex>(job->env.local_rank %
                                                   c10::cuda::device_count()));
}

models::Gpt MakeModel(const StepConfig& c, c10::Device device) {
  models::GptConfig config;
  config.n_layer = c.n_layer;
  config.n_head = c.n_head;
  config.n_embd = c.n_embd;
  config.block_size = c.block_size;
  config.seed = 1;
  models::Gpt model(config);
  model->to(device);
  return model;
}

// Untimed steps of the small model before the first case: the first use
// of the device, cuBLAS and the allocator is slow, and would otherwise be
// charged to whichever case runs first.
void WarmUp(const StepConfig& c) {
  const c10::Device device = RankDevice();
  c10::cuda::set_device(device.index());
  models::Gpt model = MakeModel(c, device);
  // Unique: the tied embedding is listed twice by parameters(), and one
  // fused call must not update the same memory twice.
  fsdp::FlatShardAdamW optimizer(fsdp::UniqueParameters(*model), torch::optim::AdamWOptions(1e-3),
                                 kOptimizerKernel);
  for (int i = 0; i < 10; ++i) {
    const at::Tensor batch = at::randint(
        256, {c.batch_per_rank, c.block_size + 1}, at::TensorOptions(at::kLong).device(device));
    models::LanguageModelLoss(model->forward(batch.narrow(1, 0, c.block_size)),
                              batch.narrow(1, 1, c.block_size))
        .backward();
    optimizer.step();
    optimizer.zero_grad();
  }
  c10::cuda::device_synchronize();
}

// The group a case trains over, fresh per case (its own keys on the store)
// so that a case starts from the same state whatever ran before it; under
// staged collectives, with the Gloo group that carries them.
struct CaseGroup {
  std::unique_ptr<fsdp::Collectives> host;
  std::unique_ptr<fsdp::Collectives> group;
};

CaseGroup MakeGroup(const Case& kase, c10::Device device) {
  CaseGroup made;
  const std::string name = absl::StrFormat("bench%d", job->groups_made++);
  if (kase.staged) {
    fsdp::GlooOptions gloo;
    gloo.hostname = "127.0.0.1";  // Ranks sharing a GPU share a host.
    gloo.group_name = name;
    made.host = fsdp::ValueOrThrow(
        fsdp::CreateGlooCollectives(job->store, job->env.rank, job->env.world_size, gloo));
    made.group = fsdp::CreateStagedCollectives(*made.host, device);
    return made;
  }
  fsdp::NcclOptions nccl;
  nccl.group_name = name;
  nccl.transport = kase.transport;
  made.group = fsdp::ValueOrThrow(fsdp::CreateNcclCollectives(
      job->store, job->env.rank, job->env.world_size, device.index(), nccl));
  return made;
}

void RunCaseOrThrow(benchmark::State& state, const Case& kase, const StepConfig& c) {
  const c10::Device device = RankDevice();
  const c10::DeviceIndex index = device.index();
  c10::cuda::set_device(index);
  // What earlier cases left cached would count in this one's reserved bytes.
  c10::cuda::CUDACachingAllocator::emptyCache();
  models::Gpt model = MakeModel(c, device);
  CaseGroup group;
  std::unique_ptr<fsdp::FullyShardedModel> wrapped;
  if (kase.wrap) {
    group = MakeGroup(kase, device);
    fsdp::FsdpOptions options;
    options.strategy = kase.strategy;
    options.offload_params = kase.offload;
    if (kase.bf16) {
      options.mixed_precision.param_dtype = at::kBFloat16;
      options.mixed_precision.reduce_dtype = at::kFloat;
    }
    wrapped = fsdp::ValueOrThrow(fsdp::FullyShardedModel::Wrap(
        model.ptr(), *group.group, options, *fsdp::ModuleTypePolicy::Of<models::BlockImpl>()));
  }
  const torch::optim::AdamWOptions adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
  std::unique_ptr<torch::optim::AdamW> optimizer_holder;
  if (kase.per_parameter_adamw) {
    optimizer_holder = std::make_unique<torch::optim::AdamW>(fsdp::UniqueParameters(*model), adamw);
  } else {
    optimizer_holder = std::make_unique<fsdp::FlatShardAdamW>(fsdp::UniqueParameters(*model), adamw,
                                                              kOptimizerKernel);
  }
  torch::optim::AdamW& optimizer = *optimizer_holder;
  at::manual_seed(100 + job->env.rank);
  auto step = [&] {
    const at::Tensor batch = at::randint(
        256, {c.batch_per_rank, c.block_size + 1}, at::TensorOptions(at::kLong).device(device));
    at::Tensor loss = models::LanguageModelLoss(model->forward(batch.narrow(1, 0, c.block_size)),
                                                batch.narrow(1, 1, c.block_size));
    loss.backward();
    optimizer.step();
    optimizer.zero_grad();
  };
  for (int i = 0; i < c.warmup; ++i) step();
  c10::cuda::device_synchronize();
  c10::cuda::CUDACachingAllocator::resetPeakStats(index);
  std::vector<double> step_ms;
  for (auto _ : state) {
    const Clock::time_point start = Clock::now();
    step();
    c10::cuda::device_synchronize();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    state.SetIterationTime(seconds);
    step_ms.push_back(seconds * 1e3);
  }
  std::sort(step_ms.begin(), step_ms.end());
  const double median_ms = step_ms[step_ms.size() / 2];
  // The spread: the 10th and 90th percentiles.
  state.counters["p10_ms"] = step_ms[step_ms.size() / 10];
  state.counters["p90_ms"] = step_ms[step_ms.size() * 9 / 10];
  // Index 0 of each statistic is the aggregate over the allocator's pools.
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  state.counters["median_ms"] = median_ms;
  state.counters["tokens_per_s"] = static_cast<double>(c.batch_per_rank) * c.block_size *
                                   job->env.world_size / (median_ms / 1e3);
  state.counters["peak_allocated_MiB"] = stats.allocated_bytes[0].peak / 1048576.0;
  state.counters["peak_reserved_MiB"] = stats.reserved_bytes[0].peak / 1048576.0;
  state.counters["model_state_MiB"] = ModelStateBytesOnDevice(*model, optimizer) / 1048576.0;
}

// A case that fails (out of memory, a refused option) is reported as failed
// and the next one runs.
void RunCase(benchmark::State& state, const Case& kase, const StepConfig& c) {
  try {
    RunCaseOrThrow(state, kase, c);
  } catch (...) {
    state.SkipWithError(
        std::string(fsdp::StatusFromCurrentException().message()).c_str());
  }
}

void Register(const char* model_name, const StepConfig& c, const char* case_name,
              const Case& kase) {
  benchmark::RegisterBenchmark(
      absl::StrFormat("BM_CudaStep/%s/%s/W:%d", model_name, case_name, job->env.world_size)
          .c_str(),
      [=](benchmark::State& state) { RunCase(state, kase, c); })
      ->Iterations(c.steps)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

// Ranks other than 0 run the same cases and say nothing.
class SilentReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  try {
    Job the_job;
    absl::StatusOr<fsdp::LaunchEnvironment> env = fsdp::ReadLaunchEnvironment();
    if (env.ok()) {
      the_job.env = *env;
      the_job.store = fsdp::ValueOrThrow(
          fsdp::ConnectRendezvousStore(the_job.env, std::chrono::minutes(2)));
    } else if (absl::IsNotFound(env.status())) {
      the_job.store = c10::make_intrusive<c10d::HashStore>();  // Alone: world size 1.
    } else {
      fsdp::ThrowIfError(env.status());
    }
    job = &the_job;
    const fsdp::ShardingStrategy kFull = fsdp::ShardingStrategy::kFullShard;
    for (const auto& [name, c] : {std::pair{"small", kSmall}, std::pair{"gpt2", kGpt2}}) {
      Register(name, c, "unwrapped", Case{/*wrap=*/false});
      // What libtorch's own optimizer costs: the step the C++ baseline took
      // before FlatShardAdamW (issue 25's unwrapped gap to PyTorch).
      Case per_parameter{/*wrap=*/false};
      per_parameter.per_parameter_adamw = true;
      Register(name, c, "unwrapped:per_parameter_adamw", per_parameter);
      Register(name, c, "full_shard", Case{true, kFull});
      Register(name, c, "shard_grad_op", Case{true, fsdp::ShardingStrategy::kShardGradOp});
      Register(name, c, "no_shard", Case{true, fsdp::ShardingStrategy::kNoShard});
      Register(name, c, "full_shard:bf16", Case{true, kFull, /*bf16=*/true});
      Register(name, c, "full_shard:offload", Case{true, kFull, false, /*offload=*/true});
      // The same over libtorch's ProcessGroupNCCL instead of direct NCCL
      // calls (identical at world size 1, where no collective reaches NCCL).
      Register(name, c, "full_shard:process_group",
               Case{true, kFull, false, false, fsdp::NcclTransport::kProcessGroup});
      // Staged collectives: what ranks sharing one GPU use.
      Register(name, c, "full_shard:staged",
               Case{true, kFull, false, false, fsdp::NcclTransport::kDirect, /*staged=*/true});
      Register(name, c, "full_shard:bf16:staged",
               Case{true, kFull, true, false, fsdp::NcclTransport::kDirect, /*staged=*/true});
    }
    if (the_job.env.rank != 0) {
      // Only rank 0 writes the --benchmark_out file.
      argc = static_cast<int>(std::remove_if(argv + 1, argv + argc, [](const char* arg) {
                                return std::string(arg).rfind("--benchmark_out", 0) == 0;
                              }) -
                              argv);
    }
    benchmark::Initialize(&argc, argv);
    WarmUp(kSmall);
    if (the_job.env.rank == 0) {
      benchmark::RunSpecifiedBenchmarks();
    } else {
      SilentReporter silent;
      benchmark::RunSpecifiedBenchmarks(&silent);
    }
    benchmark::Shutdown();
    return 0;
  } catch (...) {
    std::fprintf(stderr, "cuda_step_benchmark: %s\n",
                 std::string(fsdp::StatusFromCurrentException().message()).c_str());
    return 1;
  }
}
