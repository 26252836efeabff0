// What a checkpoint costs training, blocking and in the background
// (checkpoint/async_checkpoint.h), side by side in one run: the benchmark
// GPT under FULL_SHARD with AdamW at W = 2 (and W = 1, which leaves one of
// this machine's two cores to the writer), in both sharded formats
// (models/async_checkpoint_benchmark_results.md).
//
//   bazel run //models:async_checkpoint_benchmark
//
// The ranks are processes (launch/local_launcher.h) running this binary in
// worker mode. Each repetition times three windows of kWindowSteps training
// steps, in an order that rotates with the repetition:
//   none      the steps alone;
//   blocking  a blocking save (SaveCheckpoint / SaveTrainingCheckpoint), then
//             the steps;
//   async     AsyncCheckpointer's save, then the steps, polling after each
//             (as a training loop does), then Wait.
// A window runs from a barrier to a barrier, so its time is the slowest
// rank's. A save's cost to training is its window's time less the none
// window's of the same repetition: for the blocking save, the save itself;
// for the async one, the copy to host memory, the polls, the write's share
// of the CPU while the steps run, and any wait at the end. Reported per
// format: the medians over the repetitions and their ranges, and the ratio
// of the two costs (the goal: async at most 0.10 of blocking).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "ATen/Parallel.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "benchmark/benchmark.h"
#include "checkpoint/async_checkpoint.h"
#include "checkpoint/checkpoint.h"
#include "comm/launch_environment.h"
#include "comm/rendezvous.h"
#include "fsdp/fully_shard.h"
#include "fsdp/utilities.h"
#include "launch/local_launcher.h"
#include "models/gpt.h"
#include "optim/training_checkpoint.h"
#include "torch/optim/adamw.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

constexpr int kWindowSteps = 6;
constexpr int kRepetitions = 16;  // 96 steps per case and format.
constexpr const char* kFormats[] = {"sharded", "dcp"};
constexpr const char* kCases[] = {"none", "blocking", "async"};

// The training-step benchmark's model (models/train_step_benchmark.cc): 4
// layers, width 256, 3.3 M parameters; its AdamW state doubles that.
models::GptConfig BenchmarkModel() {
  models::GptConfig config;
  config.n_layer = 4;
  config.n_head = 4;
  config.n_embd = 256;
  config.block_size = 128;
  config.seed = 1;
  return config;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Worker {
  std::unique_ptr<fsdp::Collectives> comm;
  models::Gpt model{BenchmarkModel()};
  std::unique_ptr<fsdp::FullyShardedModel> wrapped;
  std::unique_ptr<torch::optim::AdamW> optimizer;
  std::unique_ptr<fsdp::AsyncCheckpointer> saver;
  int step = 0;

  void Step() {
    at::manual_seed(100 + 7 * step++ + comm->rank());
    const at::Tensor batch = at::randint(256, {4, 129}, at::kLong);
    models::LanguageModelLoss(model->forward(batch.narrow(1, 0, 128)), batch.narrow(1, 1, 128))
        .backward();
    optimizer->step();
    optimizer->zero_grad();
  }

  absl::Status Save(const std::string& format, bool async, const std::string& dir) {
    if (format == "dcp") {
      const fsdp::TrainState state{step, step};
      return async ? saver->Save(dir, *wrapped, optimizer.get(), state)
                   : fsdp::SaveCheckpoint(dir, *wrapped, optimizer.get(), state);
    }
    if (comm->rank() == 0) fs::create_directories(dir);
    comm->Barrier();
    return async ? fsdp::checkpoint_internal::SaveShardedInBackground(*saver, dir, *wrapped,
                                                                      *optimizer, {})
                 : fsdp::SaveTrainingCheckpoint(*wrapped, *optimizer, dir);
  }

  // One window: the save `kind` asks for, then the steps; ms, the slowest
  // rank's.
  double Window(const std::string& format, const std::string& kind, const std::string& dir) {
    comm->Barrier();
    const Clock::time_point start = Clock::now();
    if (kind != "none") fsdp::ThrowIfError(Save(format, kind == "async", dir));
    for (int i = 0; i < kWindowSteps; ++i) {
      Step();
      if (kind == "async") fsdp::ThrowIfError(saver->Poll());
    }
    if (kind == "async") fsdp::ThrowIfError(saver->Wait());
    comm->Barrier();
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  }
};

// Worker mode: argv = --worker OUT_DIR CKPT_ROOT. Rank 0 writes one line per
// format and case, "<format> <case> ms=<one per repetition>", and the
// async saves' copy and write times, to OUT_DIR/result.txt.
int RunWorker(const std::string& out_dir, const std::string& root) {
  at::set_num_threads(1);
  const fsdp::LaunchEnvironment env = fsdp::ValueOrThrow(fsdp::ReadLaunchEnvironment());
  Worker w;
  w.comm = fsdp::ValueOrThrow(fsdp::CreateGlooCollectivesFromEnvironment(env));
  w.wrapped = fsdp::ValueOrThrow(
      fsdp::FullyShardedModel::Wrap(w.model.ptr(), *w.comm, fsdp::FsdpOptions{},
                                    *fsdp::ModuleTypePolicy::Of<models::BlockImpl>()));
  w.optimizer = std::make_unique<torch::optim::AdamW>(
      fsdp::UniqueParameters(*w.model), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  w.saver = fsdp::ValueOrThrow(fsdp::AsyncCheckpointer::Create(
      *w.wrapped, fsdp::ValueOrThrow(fsdp::GlooConnectorFromEnvironment(env))));
  for (int i = 0; i < 3; ++i) w.Step();  // Warm-up; every parameter gets AdamW state.
  std::map<std::string, std::vector<double>> ms;
  std::map<std::string, std::vector<double>> staged_ms, written_ms, write_cpu_ms, staged_mb,
      held_ms, held_mb;
  for (int rep = 0; rep < kRepetitions; ++rep) {
    for (const char* format : kFormats) {
      for (int c = 0; c < 3; ++c) {
        const std::string kind = kCases[(c + rep) % 3];
        const std::string dir = absl::StrCat(root, "/", format, "-", kind);
        ms[absl::StrCat(format, " ", kind)].push_back(w.Window(format, kind, dir));
        if (kind == "async") {
          const fsdp::AsyncCheckpointTimes& t = w.saver->last_times();
          staged_ms[format].push_back(t.staged.count() * 1e3);
          written_ms[format].push_back(t.written.count() * 1e3);
          write_cpu_ms[format].push_back(t.write_cpu.count() * 1e3);
          staged_mb[format].push_back(t.staged_bytes / 1e6);
          held_ms[format].push_back(t.held.count() * 1e3);
          held_mb[format].push_back(t.held_bytes / 1e6);
        }
      }
    }
  }
  if (w.comm->rank() != 0) return 0;
  std::ofstream out(out_dir + "/result.txt");
  for (const auto& [name, values] : ms) out << name << " ms=" << absl::StrJoin(values, ",") << "\n";
  for (const char* format : kFormats) {
    out << format << " staged_ms=" << absl::StrJoin(staged_ms[format], ",") << "\n";
    out << format << " written_ms=" << absl::StrJoin(written_ms[format], ",") << "\n";
    out << format << " write_cpu_ms=" << absl::StrJoin(write_cpu_ms[format], ",") << "\n";
    out << format << " staged_mb=" << absl::StrJoin(staged_mb[format], ",") << "\n";
    out << format << " held_ms=" << absl::StrJoin(held_ms[format], ",") << "\n";
    out << format << " held_mb=" << absl::StrJoin(held_mb[format], ",") << "\n";
  }
  return out ? 0 : 1;
}

// "<format> <name>=v,v,..." lines, by "<format> <name>".
absl::StatusOr<std::map<std::string, std::vector<double>>> ParseResult(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("no result at ", path));
  std::map<std::string, std::vector<double>> out;
  std::string line;
  while (std::getline(in, line)) {
    const std::vector<std::string> fields = absl::StrSplit(line, ' ');
    if (fields.size() != 2 && fields.size() != 3) return absl::DataLossError("bad line: " + line);
    const std::pair<std::string, std::string> kv = absl::StrSplit(fields.back(), '=');
    const std::string key = fields.size() == 3 ? absl::StrCat(fields[0], " ", fields[1])
                                               : absl::StrCat(fields[0], " ", kv.first);
    for (absl::string_view v : absl::StrSplit(kv.second, ',')) {
      double value = 0;
      if (!absl::SimpleAtod(v, &value)) return absl::DataLossError("bad value: " + line);
      out[key].push_back(value);
    }
  }
  return out;
}

void RunCase(benchmark::State& state, int world) {
  char dir_template[] = "/tmp/async_checkpoint_benchmark_XXXXXX";
  const std::string dir = ::mkdtemp(dir_template);
  fsdp::LocalLaunchOptions launch;
  launch.log_dir = dir;
  launch.timeout = std::chrono::minutes(20);
  launch.extra_env = {{"OPENBLAS_NUM_THREADS", "1"}};
  launch.nproc_per_node = world;
  launch.program = "/proc/self/exe";
  launch.args = {"--worker", dir, dir + "/checkpoints"};
  for (auto _ : state) {
    absl::StatusOr<fsdp::LaunchResult> result = fsdp::LaunchLocalRanks(launch);
    if (!result.ok() || !result->ok()) {
      state.SkipWithError(
          (result.ok() ? result->Summary() : std::string(result.status().message())).c_str());
      break;
    }
    absl::StatusOr<std::map<std::string, std::vector<double>>> r = ParseResult(dir + "/result.txt");
    if (!r.ok()) {
      state.SkipWithError(std::string(r.status().message()).c_str());
      break;
    }
    for (const char* format : kFormats) {
      const std::string f = format;
      const std::vector<double>& none = (*r)[f + " none"];
      std::vector<double> blocking, async, ratio;
      for (size_t i = 0; i < none.size(); ++i) {
        blocking.push_back((*r)[f + " blocking"][i] - none[i]);
        async.push_back((*r)[f + " async"][i] - none[i]);
        ratio.push_back(async.back() / blocking.back());
      }
      const auto range = [&](const std::string& name, const std::vector<double>& v) {
        state.counters[f + "_" + name] = Median(v);
        state.counters[f + "_" + name + "_min"] = *std::min_element(v.begin(), v.end());
        state.counters[f + "_" + name + "_max"] = *std::max_element(v.begin(), v.end());
      };
      state.counters[f + "_step_ms"] = Median(none) / kWindowSteps;
      range("blocking_cost_ms", blocking);
      range("async_cost_ms", async);
      range("ratio", ratio);
      state.counters[f + "_async_copy_ms"] = Median((*r)[f + " staged_ms"]);
      state.counters[f + "_async_write_ms"] = Median((*r)[f + " written_ms"]);
      state.counters[f + "_async_write_cpu_ms"] = Median((*r)[f + " write_cpu_ms"]);
      state.counters[f + "_copy_MB"] = Median((*r)[f + " staged_mb"]);
      state.counters[f + "_async_held_ms"] = Median((*r)[f + " held_ms"]);
      state.counters[f + "_held_MB"] = Median((*r)[f + " held_mb"]);
    }
    state.SetIterationTime(1);
  }
  fs::remove_all(dir);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--worker") {
    try {
      return RunWorker(argv[2], argv[3]);
    } catch (...) {
      std::fprintf(stderr, "worker: %s\n",
                   std::string(fsdp::StatusFromCurrentException().message()).c_str());
      return 1;
    }
  }
  // W = 2 keeps both of this machine's cores busy training; W = 1 leaves
  // one to spare, as a GPU job leaves the host's cores.
  for (int world : {2, 1}) {
    benchmark::RegisterBenchmark(absl::StrFormat("BM_AsyncCheckpoint/W:%d", world).c_str(),
                                 [world](benchmark::State& state) { RunCase(state, world); })
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
