// Training-step benchmark of the GPT (models/gpt.h): FSDP at W ranks for each
// sharding strategy, plain single-process libtorch on the same global batch,
// and PyTorch's own DistributedDataParallel, FullyShardedDataParallel (FSDP1)
// and fully_shard (FSDP2) over Gloo (models/pytorch_step_benchmark.py, run
// by the interop Python of testing/torch_python.h) on the same model, batch
// and optimizer. Run it from a build against the same torch as that Python
// (tools/test_torch2.sh's CMake build with torch 2.15), so that both sides
// use the same kernels.
// Plus per-rank memory against model size (FULL_SHARD vs NO_SHARD) where
// model state dominates.
//
//   bazel run //models:train_step_benchmark   # -O2 (see .bazelrc)
//
// Each case launches its ranks as processes (launch/local_launcher.h, one rank
// per process, intra-op threads = cores / W) running this binary in worker
// mode, or the Python script; a worker times its own steps after warm-up, so
// process start, rendezvous and wrapping are not in the figures. Reported
// per case (worst rank): step time (the benchmark's time, median of the
// timed steps), peak resident memory during the timed steps
// (/proc/self/status VmHWM after resetting it through clear_refs), the
// measured bytes of model state the rank holds (parameters, gradients and
// AdamW state: the tensors themselves, summed), and the bytes it sent per
// step (/proc/self/io wchar: Gloo's socket writes, the same library on
// both sides).
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ATen/ATen.h"
#include "ATen/Parallel.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "benchmark/benchmark.h"
#include "comm/launch_environment.h"
#include "comm/rendezvous.h"
#include "fsdp/fully_shard.h"
#include "fsdp/utilities.h"
#include "launch/local_launcher.h"
#include "models/gpt.h"
#include "testing/torch_python.h"
#include "torch/optim/adamw.h"

namespace {

using Clock = std::chrono::steady_clock;

// The benchmark model: 4 layers, 4 heads, width 256, context 128,
// 8 sequences per rank, AdamW.
struct StepConfig {
  int n_layer = 4, n_head = 4, n_embd = 256, block_size = 128, batch_per_rank = 8;
  int warmup = 2, steps = 8;
};

// What a worker writes: one line "key=value ..." to <out_dir>/rank_<r>.txt.
struct WorkerResult {
  double step_ms = 0;
  double peak_rss_mib = 0;
  double model_state_mib = 0;
  double sent_mib = 0;  // Per step.
};

// Bytes this process passed to write(2)-like calls so far: Gloo's sends
// (writev on its sockets).
int64_t BytesWritten() {
  std::ifstream io("/proc/self/io");
  std::string line;
  while (std::getline(io, line)) {
    if (line.rfind("wchar:", 0) == 0) return std::atoll(line.c_str() + 6);
  }
  return 0;
}

double ReadVmHwmMib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::atof(line.c_str() + 6) / 1024.0;
  }
  return 0;
}

// From here on VmHWM is the peak of what follows (Linux >= 4.0).
void ResetPeakRss() {
  malloc_trim(0);
  std::ofstream("/proc/self/clear_refs") << "5";
}

int64_t ModelStateBytes(torch::nn::Module& model, torch::optim::AdamW& optimizer) {
  int64_t bytes = 0;
  for (const at::Tensor& p : fsdp::UniqueParameters(model)) {
    bytes += p.nbytes();
    if (p.grad().defined()) bytes += p.grad().nbytes();
  }
  for (const auto& [key, state] : optimizer.state()) {
    auto& adamw = static_cast<torch::optim::AdamWParamState&>(*state);
    bytes += adamw.exp_avg().nbytes() + adamw.exp_avg_sq().nbytes();
  }
  return bytes;
}

// Worker mode: argv = --worker MODE OUT_DIR n_layer n_head n_embd block batch
// warmup steps. MODE is single (no group; the whole batch here) or a
// sharding strategy name.
int RunWorker(int argc, char** argv) {
  if (argc != 11) {
    std::fprintf(stderr, "worker: expected 9 arguments after --worker\n");
    return 2;
  }
  std::string mode = argv[2];
  const std::string out_dir = argv[3];
  // "<strategy>:no_headers": without the collective header check, to
  // measure its price; "<strategy>:offload": with CPU offload, to measure
  // the price of its copies where they save nothing (compute on CPU).
  fsdp::GlooOptions gloo;
  bool offload = false;
  if (absl::EndsWith(mode, ":no_headers")) {
    mode = mode.substr(0, mode.size() - std::string(":no_headers").size());
    gloo.check_collective_headers = false;
  } else if (absl::EndsWith(mode, ":offload")) {
    mode = mode.substr(0, mode.size() - std::string(":offload").size());
    offload = true;
  }
  StepConfig c;
  int* fields[] = {&c.n_layer, &c.n_head, &c.n_embd, &c.block_size,
                   &c.batch_per_rank, &c.warmup, &c.steps};
  for (int i = 0; i < 7; ++i) *fields[i] = std::atoi(argv[4 + i]);
  if (const char* threads = std::getenv("OMP_NUM_THREADS")) at::set_num_threads(std::atoi(threads));

  const fsdp::LaunchEnvironment env = fsdp::ValueOrThrow(fsdp::ReadLaunchEnvironment());
  std::unique_ptr<fsdp::Collectives> comm;
  if (mode != "single") {
    comm = fsdp::ValueOrThrow(fsdp::CreateGlooCollectivesFromEnvironment(env, gloo));
  }
  models::GptConfig config;
  config.n_layer = c.n_layer;
  config.n_head = c.n_head;
  config.n_embd = c.n_embd;
  config.block_size = c.block_size;
  config.seed = 1;
  models::Gpt model(config);
  std::unique_ptr<fsdp::FullyShardedModel> wrapped;
  if (comm != nullptr) {
    fsdp::FsdpOptions options;
    options.strategy = fsdp::ValueOrThrow(fsdp::ParseShardingStrategy(mode));
    options.offload_params = offload;
    wrapped = fsdp::ValueOrThrow(fsdp::FullyShardedModel::Wrap(
        model.ptr(), *comm, options, *fsdp::ModuleTypePolicy::Of<models::BlockImpl>()));
  }
  torch::optim::AdamW optimizer(fsdp::UniqueParameters(*model),
                                torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  at::manual_seed(100 + env.rank);
  std::vector<double> step_ms;
  int64_t sent_before = 0;
  int64_t state_bytes = 0;
  for (int step = 0; step < c.warmup + c.steps; ++step) {
    if (step == c.warmup) {
      ResetPeakRss();
      sent_before = BytesWritten();
    }
    const at::Tensor batch = at::randint(256, {c.batch_per_rank, c.block_size + 1}, at::kLong);
    const Clock::time_point start = Clock::now();
    at::Tensor loss = models::LanguageModelLoss(model->forward(batch.narrow(1, 0, c.block_size)),
                                                batch.narrow(1, 1, c.block_size));
    loss.backward();
    optimizer.step();
    // Gradients included: libtorch 2.x's zero_grad drops them.
    if (step == c.warmup + c.steps - 1) state_bytes = ModelStateBytes(*model, optimizer);
    optimizer.zero_grad();
    if (step >= c.warmup) {
      step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    }
  }
  const double sent_mib = (BytesWritten() - sent_before) / static_cast<double>(c.steps) / 1048576.0;
  std::sort(step_ms.begin(), step_ms.end());
  std::ofstream out(absl::StrCat(out_dir, "/rank_", env.rank, ".txt"));
  out << absl::StrFormat("step_ms=%.3f peak_rss_mib=%.1f model_state_mib=%.2f sent_mib=%.3f\n",
                         step_ms[step_ms.size() / 2], ReadVmHwmMib(),
                         state_bytes / 1048576.0, sent_mib);
  return out ? 0 : 1;
}

// kUnavailable with the worker's reason when it could not run the case (a
// torch without FSDP2).
absl::StatusOr<WorkerResult> ParseWorkerResult(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line)) return absl::NotFoundError("no result in " + path);
  if (absl::StartsWith(line, "unavailable=")) {
    return absl::UnavailableError(line.substr(std::string("unavailable=").size()));
  }
  std::map<std::string, double> values;
  for (absl::string_view field : absl::StrSplit(line, ' ')) {
    const std::vector<std::string> kv = absl::StrSplit(field, '=');
    double v = 0;
    if (kv.size() == 2 && absl::SimpleAtod(kv[1], &v)) values[kv[0]] = v;
  }
  for (const char* key : {"step_ms", "peak_rss_mib", "model_state_mib", "sent_mib"}) {
    if (values.count(key) == 0) return absl::DataLossError(absl::StrCat(path, " lacks ", key));
  }
  return WorkerResult{values["step_ms"], values["peak_rss_mib"], values["model_state_mib"],
                      values["sent_mib"]};
}

// Launches one case; fills the benchmark's time and counters from the ranks'
// results (the slowest step time, the largest memory figures).
void RunCase(benchmark::State& state, const std::string& mode, int world, const StepConfig& c,
             bool memory_run) {
  char dir_template[] = "/tmp/train_step_benchmark_XXXXXX";
  const std::string dir = ::mkdtemp(dir_template);
  fsdp::LocalLaunchOptions launch;
  launch.log_dir = dir;
  launch.timeout = std::chrono::minutes(20);
  // BLAS runs in the calling thread; the cores / W intra-op threads are
  // OpenMP's. Measured here: a single process with OpenMP and OpenBLAS both
  // two-threaded took 1013 ms a step where OpenBLAS single-threaded took 602.
  launch.extra_env = {{"OPENBLAS_NUM_THREADS", "1"}};
  if (memory_run) {
    // A fixed mmap threshold returns every freed buffer above 256 KiB to the
    // kernel, so that RSS tracks live memory: with glibc's adaptive
    // threshold, freed unshard buffers stayed in the heap and the peak RSS
    // of identical runs differed by up to 120 MiB. It slows the steps, so
    // only the memory runs use it.
    launch.extra_env.emplace_back("MALLOC_MMAP_THRESHOLD_", "262144");
  }
  const bool single = mode == "single";
  launch.nproc_per_node = single ? 1 : world;
  const int batch = single ? c.batch_per_rank * world : c.batch_per_rank;
  const std::vector<std::string> shape = {
      std::to_string(c.n_layer), std::to_string(c.n_head),   std::to_string(c.n_embd),
      std::to_string(c.block_size), std::to_string(batch), std::to_string(c.warmup),
      std::to_string(c.steps)};
  if (absl::StartsWith(mode, "pytorch_")) {
    launch.program = ::fsdp::testing::TorchPython();
    launch.args = {::fsdp::testing::ScriptPath("models/pytorch_step_benchmark.py"),
                   mode.substr(std::string("pytorch_").size()), dir};
  } else {
    launch.program = "/proc/self/exe";
    launch.args = {"--worker", mode, dir};
  }
  launch.args.insert(launch.args.end(), shape.begin(), shape.end());
  for (auto _ : state) {
    absl::StatusOr<fsdp::LaunchResult> result = fsdp::LaunchLocalRanks(launch);
    if (result.ok() && result->forwarded_signal != 0) {
      // Interrupted (Ctrl-C, kill): stop here rather than start the next case.
      std::fprintf(stderr, "train_step_benchmark: stopped by signal %d\n",
                   result->forwarded_signal);
      std::exit(128 + result->forwarded_signal);
    }
    if (!result.ok() || !result->ok()) {
      state.SkipWithError(
          (result.ok() ? result->Summary() : std::string(result.status().message())).c_str());
      return;
    }
    WorkerResult worst;
    for (int rank = 0; rank < launch.nproc_per_node; ++rank) {
      absl::StatusOr<WorkerResult> r = ParseWorkerResult(absl::StrCat(dir, "/rank_", rank, ".txt"));
      if (!r.ok()) {
        state.SkipWithError(std::string(r.status().message()).c_str());
        return;
      }
      worst.step_ms = std::max(worst.step_ms, r->step_ms);
      worst.peak_rss_mib = std::max(worst.peak_rss_mib, r->peak_rss_mib);
      worst.model_state_mib = std::max(worst.model_state_mib, r->model_state_mib);
      worst.sent_mib = std::max(worst.sent_mib, r->sent_mib);
    }
    state.SetIterationTime(worst.step_ms / 1e3);
    state.counters["peak_rss_MiB"] = worst.peak_rss_mib;
    state.counters["model_state_MiB"] = worst.model_state_mib;
    state.counters["sent_MiB_per_step"] = worst.sent_mib;
    state.counters["tokens_per_s"] =
        static_cast<double>(c.batch_per_rank) * world * c.block_size / (worst.step_ms / 1e3);
  }
  std::system(("rm -rf '" + dir + "'").c_str());
}

// Which torch the PyTorch cases run (tools/train_step_benchmark_table.py
// labels them with it).
void PrintPyTorchSide() {
  const std::string python = ::fsdp::testing::TorchPython();
  std::string version = "unknown";
  if (FILE* pipe =
          ::popen((python + " -c 'import torch; print(torch.__version__)'").c_str(), "r")) {
    char line[128] = {};
    if (std::fgets(line, sizeof(line), pipe) != nullptr)
      version = std::string(absl::StripAsciiWhitespace(line));
    ::pclose(pipe);
  }
  std::printf("pytorch side: %s (torch %s)\n", python.c_str(), version.c_str());
  std::fflush(stdout);
}

void Register(const std::string& family, const std::string& mode, int world,
              const StepConfig& c, bool memory_run = false) {
  benchmark::RegisterBenchmark(
      absl::StrFormat("%s/%s/W:%d", family, mode, world).c_str(),
      [=](benchmark::State& state) { RunCase(state, mode, world, c, memory_run); })
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--worker") {
    try {
      return RunWorker(argc, argv);
    } catch (...) {
      std::fprintf(stderr, "worker: %s\n",
                   std::string(fsdp::StatusFromCurrentException().message()).c_str());
      return 1;
    }
  }
  const StepConfig step;
  for (int world : {1, 2, 4}) {
    for (const char* mode : {"single", "full_shard", "shard_grad_op", "no_shard", "pytorch_ddp",
                             "pytorch_fsdp1", "pytorch_fsdp2"}) {
      Register("BM_TrainStep", mode, world, step);
    }
    // The price of the collective header check (on in every case above).
    if (world > 1) Register("BM_TrainStep", "full_shard:no_headers", world, step);
    if (world == 2) Register("BM_TrainStep", "full_shard:offload", world, step);
  }
  // Memory against model size, where model state dominates (hundreds of MB
  // per replica): blocks of width 512 (3.1 M parameters each; with
  // gradients and AdamW state 50 MB), 4 and 8 of them, one sequence of 32
  // tokens per rank so that activations stay small.
  for (int layers : {4, 8}) {
    StepConfig big;
    big.n_layer = layers;
    big.n_head = 8;
    big.n_embd = 512;
    big.block_size = 32;
    big.batch_per_rank = 1;
    big.warmup = 1;
    big.steps = 2;
    for (int world : {1, 2, 4}) {
      for (const char* mode : {"full_shard", "no_shard"}) {
        Register(absl::StrCat("BM_ModelMemory", layers, "L"), mode, world, big,
                 /*memory_run=*/true);
      }
    }
  }
  benchmark::Initialize(&argc, argv);
  PrintPyTorchSide();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
