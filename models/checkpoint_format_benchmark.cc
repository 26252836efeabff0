// Sharded checkpoint formats side by side: the project's SHARDED format
// (optim/training_checkpoint.h: a protobuf manifest and one shard file per
// rank) against the front door's Distributed Checkpoint
// (checkpoint/checkpoint.h: SaveCheckpoint / LoadCheckpoint, what PyTorch's
// dcp.load reads), saving and loading the same FULL_SHARD GPT and its AdamW
// state at W = 1..4. It decides whether SHARDED stays a format users may
// choose (models/checkpoint_format_benchmark_results.md).
//
//   bazel run //models:checkpoint_format_benchmark
//
// Each case launches its ranks as processes (launch/local_launcher.h) running
// this binary in worker mode. A worker saves `reps` checkpoints into fresh
// directories, then loads the last two `reps` times, alternating the two
// formats save by save and load by load so that both meet the same page
// cache and disk. Every timed call starts after a barrier and ends after
// one, so a figure is the slowest rank's. Reported per case and format: the
// median and range of the calls, and the checkpoint's bytes and files on
// disk.
#include <sys/stat.h>

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
#include "checkpoint/checkpoint.h"
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

enum class Format { kSharded, kDcp };
constexpr Format kFormats[] = {Format::kSharded, Format::kDcp};
const char* FormatName(Format f) { return f == Format::kSharded ? "sharded" : "dcp"; }

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

absl::Status Save(Format format, const std::string& dir, fsdp::FullyShardedModel& model,
                  torch::optim::Optimizer& optimizer) {
  if (format == Format::kDcp) {
    return fsdp::SaveCheckpoint(dir, model, &optimizer, fsdp::TrainState{7, 7});
  }
  return fsdp::SaveTrainingCheckpoint(model, optimizer, dir);
}

absl::Status Load(Format format, const std::string& dir, fsdp::FullyShardedModel& model,
                  torch::optim::Optimizer& optimizer) {
  if (format == Format::kDcp) {
    fsdp::TrainState state;
    return fsdp::LoadCheckpoint(dir, model, &optimizer, &state);
  }
  return fsdp::LoadTrainingCheckpoint(model, optimizer, dir);
}

// Bytes and files under `dir`.
std::pair<int64_t, int64_t> DiskUse(const std::string& dir) {
  int64_t bytes = 0, files = 0;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    bytes += static_cast<int64_t>(entry.file_size());
    ++files;
  }
  return {bytes, files};
}

// The upper median of an even count (the 16th of 30).
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One timed call: from a barrier to a barrier, so every rank's figure is the
// slowest rank's.
template <typename Call>
double TimeMs(fsdp::Collectives& comm, Call call) {
  comm.Barrier();
  const Clock::time_point start = Clock::now();
  fsdp::ThrowIfError(call());
  comm.Barrier();
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Worker mode: argv = --worker OUT_DIR CKPT_ROOT REPS. Rank 0 writes
// "<format> save_ms=... load_ms=... bytes=... files=..." lines (one value
// per call for the times) to OUT_DIR/result.txt.
int RunWorker(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "worker: expected OUT_DIR CKPT_ROOT REPS after --worker\n");
    return 2;
  }
  const std::string out_dir = argv[2], root = argv[3];
  const int reps = std::atoi(argv[4]);
  // Saving and loading are copies, checksums and system calls: OpenMP's
  // threads would only spin between the few parallel copies (46% of a W = 1
  // profile), adding noise.
  at::set_num_threads(1);
  std::unique_ptr<fsdp::Collectives> comm = fsdp::ValueOrThrow(fsdp::InitProcessGroup());
  const int rank = comm->rank();
  models::Gpt model(BenchmarkModel());
  std::unique_ptr<fsdp::FullyShardedModel> wrapped = fsdp::ValueOrThrow(
      fsdp::FullyShardedModel::Wrap(model.ptr(), *comm, fsdp::FsdpOptions{},
                                    *fsdp::ModuleTypePolicy::Of<models::BlockImpl>()));
  torch::optim::AdamW optimizer(fsdp::UniqueParameters(*model),
                                torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  // One step, so that every parameter has AdamW state to save.
  at::manual_seed(100 + rank);
  const at::Tensor batch = at::randint(256, {2, 129}, at::kLong);
  models::LanguageModelLoss(model->forward(batch.narrow(1, 0, 128)), batch.narrow(1, 1, 128))
      .backward();
  optimizer.step();
  optimizer.zero_grad();

  std::map<Format, std::vector<double>> save_ms, load_ms;
  // The last two checkpoints of each format; the loads alternate between
  // them, so that no load finds what it reads already parsed by the one
  // before (ReadDcpMetadata keeps the last .metadata it parsed).
  std::map<Format, std::vector<std::string>> kept;
  for (int i = 0; i < reps; ++i) {
    for (Format f : kFormats) {
      const std::string dir = absl::StrCat(root, "/", FormatName(f), "-", i);
      // SaveTrainingCheckpoint writes into an existing directory (the main
      // job's run directory makes it); SaveCheckpoint creates its own.
      if (f == Format::kSharded && rank == 0) fs::create_directories(dir);
      save_ms[f].push_back(TimeMs(*comm, [&] { return Save(f, dir, *wrapped, optimizer); }));
      kept[f].push_back(dir);
      if (kept[f].size() > 2) {
        if (rank == 0) fs::remove_all(kept[f].front());
        kept[f].erase(kept[f].begin());
      }
    }
  }
  for (int i = 0; i < reps; ++i) {
    for (Format f : kFormats) {
      const std::string& dir = kept[f][i % 2];
      load_ms[f].push_back(TimeMs(*comm, [&] { return Load(f, dir, *wrapped, optimizer); }));
    }
  }
  if (rank != 0) return 0;
  std::ofstream out(out_dir + "/result.txt");
  for (Format f : kFormats) {
    const auto [bytes, files] = DiskUse(kept[f].back());
    out << FormatName(f) << " save_ms=" << absl::StrJoin(save_ms[f], ",")
        << " load_ms=" << absl::StrJoin(load_ms[f], ",") << " bytes=" << bytes
        << " files=" << files << "\n";
  }
  return out ? 0 : 1;
}

struct FormatResult {
  std::vector<double> save_ms, load_ms;
  double bytes = 0, files = 0;
};

absl::StatusOr<std::map<std::string, FormatResult>> ParseResult(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("no result at ", path));
  std::map<std::string, FormatResult> out;
  std::string line;
  while (std::getline(in, line)) {
    const std::vector<std::string> fields = absl::StrSplit(line, ' ');
    FormatResult& r = out[fields[0]];
    for (size_t i = 1; i < fields.size(); ++i) {
      const std::pair<std::string, std::string> kv = absl::StrSplit(fields[i], '=');
      if (kv.first == "save_ms" || kv.first == "load_ms") {
        for (absl::string_view v : absl::StrSplit(kv.second, ',')) {
          double ms = 0;
          if (!absl::SimpleAtod(v, &ms)) return absl::DataLossError("bad time in " + path);
          (kv.first == "save_ms" ? r.save_ms : r.load_ms).push_back(ms);
        }
      } else if (!absl::SimpleAtod(kv.second, kv.first == "bytes" ? &r.bytes : &r.files)) {
        return absl::DataLossError("bad field in " + path);
      }
    }
  }
  return out;
}

void RunCase(benchmark::State& state, int world, int reps) {
  char dir_template[] = "/tmp/checkpoint_format_benchmark_XXXXXX";
  const std::string dir = ::mkdtemp(dir_template);
  fsdp::LocalLaunchOptions launch;
  launch.log_dir = dir;
  launch.timeout = std::chrono::minutes(20);
  launch.extra_env = {{"OPENBLAS_NUM_THREADS", "1"}};
  launch.nproc_per_node = world;
  launch.program = "/proc/self/exe";
  launch.args = {"--worker", dir, dir + "/checkpoints", std::to_string(reps)};
  for (auto _ : state) {
    absl::StatusOr<fsdp::LaunchResult> result = fsdp::LaunchLocalRanks(launch);
    if (!result.ok() || !result->ok()) {
      state.SkipWithError(
          (result.ok() ? result->Summary() : std::string(result.status().message())).c_str());
      break;
    }
    absl::StatusOr<std::map<std::string, FormatResult>> r = ParseResult(dir + "/result.txt");
    if (!r.ok()) {
      state.SkipWithError(std::string(r.status().message()).c_str());
      break;
    }
    double total_ms = 0;
    for (auto& [name, f] : *r) {
      const auto [save_min, save_max] = std::minmax_element(f.save_ms.begin(), f.save_ms.end());
      const auto [load_min, load_max] = std::minmax_element(f.load_ms.begin(), f.load_ms.end());
      state.counters[name + "_save_ms"] = Median(f.save_ms);
      state.counters[name + "_save_min_ms"] = *save_min;
      state.counters[name + "_save_max_ms"] = *save_max;
      state.counters[name + "_load_ms"] = Median(f.load_ms);
      state.counters[name + "_load_min_ms"] = *load_min;
      state.counters[name + "_load_max_ms"] = *load_max;
      state.counters[name + "_MiB"] = f.bytes / 1048576.0;
      state.counters[name + "_files"] = f.files;
      total_ms += Median(f.save_ms) + Median(f.load_ms);
    }
    state.SetIterationTime(total_ms / 1e3);
  }
  fs::remove_all(dir);
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
  // 30 saves and 30 loads of each format per case.
  constexpr int kReps = 30;
  for (int world : {1, 2, 3, 4}) {
    benchmark::RegisterBenchmark(absl::StrFormat("BM_CheckpointFormats/W:%d", world).c_str(),
                                 [world](benchmark::State& state) { RunCase(state, world, kReps); })
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
