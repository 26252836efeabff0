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
// With --shaped_link_rounds=N it runs, instead, the shaped-link cases: two
// hosts of two ranks each (network namespaces joined by a veth pair whose
// rate tc limits, testing/netns_hosts.h; needs root), each case's ranks
// started by PyPI's torchrun on each host, ours and PyTorch's (FSDP2, HSDP,
// DDP) alike, N rounds of every case interleaved; beside the figures below,
// the bytes that crossed the link per step (each host's link counter, read
// by its ranks around the timed steps). Tables:
// tools/shaped_link_table.py; results: models/shaped_link_benchmark_results.md.
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
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
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
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "benchmark/benchmark.h"
#include "c10/util/Exception.h"
#include "comm/hierarchical_collectives.h"
#include "comm/hybrid_groups.h"
#include "comm/launch_environment.h"
#include "comm/rendezvous.h"
#include "fsdp/fsdp_options.h"
#include "fsdp/fully_shard.h"
#include "fsdp/utilities.h"
#include "launch/local_launcher.h"
#include "models/gpt.h"
#include "policies/unit_options.h"
#include "testing/netns_hosts.h"
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
  // Shaped-link runs: what this rank's host sent over the link per step,
  // and the host.
  double link_mib = -1;
  std::string host;
};

std::string HostName() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}

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

// What this host's end of the link has sent so far, from the counter file
// the shaped-link driver names in FSDP_LINK_TX_BYTES; -1 without one.
int64_t LinkBytesSent() {
  const char* path = std::getenv("FSDP_LINK_TX_BYTES");
  if (path == nullptr) return -1;
  int64_t value = -1;
  if (!(std::ifstream(path) >> value)) return -1;
  return value;
}

// The process groups a worker's mode asks for, kept alive for the model.
struct WorkerGroups {
  std::unique_ptr<fsdp::Collectives> world;
  fsdp::HybridShardCollectives hybrid;
  std::unique_ptr<fsdp::Collectives> two_level;  // On the groups above: destroyed first.
};

// Worker mode: argv = --worker MODE OUT_DIR n_layer n_head n_embd block batch
// warmup steps. MODE is single (no group; the whole batch here) or a
// sharding strategy name followed by any of
//   :no_headers  without the collective header check, to measure its price;
//   :offload     CPU offload, to measure its copies where they save nothing;
//   :hpz         FSDP2's reshard_after_forward as this host's group (ZeRO++'s
//                hpZ): the backward all-gathers stay inside a host;
//   :int8        int8 blockwise all-gathers and gradient reductions;
//   :int8_reduce int8 gradient reductions only (under a hybrid strategy,
//                what crosses hosts: the all-gathers stay inside one);
//   :forward_prefetch  the next unit's all-gather issued during forward;
//   :hier        all-gathers and reduce-scatters in two levels, within a
//                host and across hosts (comm/hierarchical_collectives.h).
// Hybrid strategies shard within a host (LOCAL_WORLD_SIZE ranks) and
// replicate across hosts.
// What a worker's MODE asks for.
struct WorkerMode {
  std::string strategy;  // "single" or a sharding strategy's name.
  fsdp::GlooOptions gloo;
  fsdp::FsdpOptions options;
  bool hpz = false, hier = false;
};

// Throws c10::Error naming an unknown modifier or a refused combination.
WorkerMode ParseWorkerMode(const std::string& text) {
  const std::vector<std::string> parts = absl::StrSplit(text, ':');
  WorkerMode mode;
  mode.strategy = parts[0];
  const std::map<std::string, std::function<void(WorkerMode&)>> modifiers = {
      {"no_headers", [](WorkerMode& m) { m.gloo.check_collective_headers = false; }},
      {"offload", [](WorkerMode& m) { m.options.offload_params = true; }},
      {"hpz", [](WorkerMode& m) { m.hpz = true; }},
      {"hier", [](WorkerMode& m) { m.hier = true; }},
      {"forward_prefetch", [](WorkerMode& m) { m.options.forward_prefetch = true; }},
      {"int8",
       [](WorkerMode& m) {
         m.options.all_gather_quantization = fsdp::CommQuantization::kInt8;
         m.options.reduce_quantization = fsdp::CommQuantization::kInt8;
       }},
      {"int8_reduce",
       [](WorkerMode& m) { m.options.reduce_quantization = fsdp::CommQuantization::kInt8; }},
  };
  for (size_t i = 1; i < parts.size(); ++i) {
    const auto it = modifiers.find(parts[i]);
    TORCH_CHECK(it != modifiers.end(), "unknown mode modifier '", parts[i], "'");
    it->second(mode);
  }
  if (mode.strategy != "single") {
    mode.options.strategy = fsdp::ValueOrThrow(fsdp::ParseShardingStrategy(mode.strategy));
    // Both would use the host group beside the two-level group's worker.
    TORCH_CHECK(!mode.hier || !(mode.hpz || fsdp::IsHybrid(mode.options.strategy)),
                ":hier goes with neither :hpz nor a hybrid strategy");
  }
  return mode;
}

// Connects the groups `mode` asks for and returns the ones FSDP runs on
// (none for "single"); `groups` keeps them alive.
std::optional<fsdp::ProcessGroups> ConnectWorkerGroups(const WorkerMode& mode,
                                                       const fsdp::LaunchEnvironment& env,
                                                       WorkerGroups& groups) {
  if (mode.strategy == "single") return std::nullopt;
  const bool hybrid = fsdp::IsHybrid(mode.options.strategy);
  if (hybrid || mode.hpz || mode.hier) {
    fsdp::HybridGroupsFromEnvironment made = fsdp::ValueOrThrow(
        fsdp::CreateHybridGlooCollectivesFromEnvironment(env, env.local_world_size, mode.gloo));
    groups.world = std::move(made.world);
    groups.hybrid = std::move(made.hybrid);
  } else {
    groups.world = fsdp::ValueOrThrow(fsdp::CreateGlooCollectivesFromEnvironment(env, mode.gloo));
  }
  if (hybrid) {
    fsdp::ProcessGroups fsdp_groups(*groups.hybrid.shard);
    fsdp_groups.replicate = groups.hybrid.replicate.get();
    return fsdp_groups;
  }
  if (mode.hier) {
    groups.two_level = fsdp::CreateHierarchicalCollectives(*groups.world, *groups.hybrid.shard,
                                                           *groups.hybrid.replicate);
    return fsdp::ProcessGroups(*groups.two_level);
  }
  fsdp::ProcessGroups fsdp_groups(*groups.world);
  if (mode.hpz) fsdp_groups.post_forward = groups.hybrid.shard.get();
  return fsdp_groups;
}

int RunWorker(int argc, char** argv) {
  if (argc != 11) {
    std::fprintf(stderr, "worker: expected 9 arguments after --worker\n");
    return 2;
  }
  const WorkerMode mode = ParseWorkerMode(argv[2]);
  const std::string out_dir = argv[3];
  StepConfig c;
  int* fields[] = {&c.n_layer, &c.n_head, &c.n_embd, &c.block_size,
                   &c.batch_per_rank, &c.warmup, &c.steps};
  for (int i = 0; i < 7; ++i) *fields[i] = std::atoi(argv[4 + i]);
  if (const char* threads = std::getenv("OMP_NUM_THREADS")) at::set_num_threads(std::atoi(threads));

  const fsdp::LaunchEnvironment env = fsdp::ValueOrThrow(fsdp::ReadLaunchEnvironment());
  WorkerGroups groups;
  const std::optional<fsdp::ProcessGroups> fsdp_groups = ConnectWorkerGroups(mode, env, groups);
  models::GptConfig config;
  config.n_layer = c.n_layer;
  config.n_head = c.n_head;
  config.n_embd = c.n_embd;
  config.block_size = c.block_size;
  config.seed = 1;
  models::Gpt model(config);
  std::unique_ptr<fsdp::FullyShardedModel> wrapped;
  if (fsdp_groups.has_value()) {
    wrapped = fsdp::ValueOrThrow(fsdp::FullyShardedModel::Wrap(
        model.ptr(), *fsdp_groups, mode.options, *fsdp::ModuleTypePolicy::Of<models::BlockImpl>()));
  }
  torch::optim::AdamW optimizer(fsdp::UniqueParameters(*model),
                                torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  at::manual_seed(100 + env.rank);
  std::vector<double> step_ms;
  int64_t sent_before = 0, link_before = 0;
  int64_t state_bytes = 0;
  for (int step = 0; step < c.warmup + c.steps; ++step) {
    if (step == c.warmup) {
      ResetPeakRss();
      sent_before = BytesWritten();
      link_before = LinkBytesSent();
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
  const int64_t link_after = LinkBytesSent();
  std::sort(step_ms.begin(), step_ms.end());
  std::ofstream out(absl::StrCat(out_dir, "/rank_", env.rank, ".txt"));
  out << absl::StrFormat("step_ms=%.3f peak_rss_mib=%.1f model_state_mib=%.2f sent_mib=%.3f",
                         step_ms[step_ms.size() / 2], ReadVmHwmMib(), state_bytes / 1048576.0,
                         sent_mib);
  if (link_before >= 0 && link_after >= 0) {
    out << absl::StrFormat(" link_mib=%.3f host=%s",
                           (link_after - link_before) / static_cast<double>(c.steps) / 1048576.0,
                           HostName());
  }
  out << "\n";
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
  std::map<std::string, std::string> values;
  for (absl::string_view field : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
    const std::vector<std::string> kv = absl::StrSplit(field, absl::MaxSplits('=', 1));
    if (kv.size() == 2) values[kv[0]] = kv[1];
  }
  WorkerResult result;
  const std::pair<const char*, double*> numbers[] = {{"step_ms", &result.step_ms},
                                                     {"peak_rss_mib", &result.peak_rss_mib},
                                                     {"model_state_mib", &result.model_state_mib},
                                                     {"sent_mib", &result.sent_mib}};
  for (const auto& [key, value] : numbers) {
    if (!absl::SimpleAtod(values[key], value)) {
      return absl::DataLossError(absl::StrCat(path, " lacks ", key));
    }
  }
  if (values.count("link_mib") != 0 && !absl::SimpleAtod(values["link_mib"], &result.link_mib)) {
    return absl::DataLossError(absl::StrCat(path, ": bad link_mib"));
  }
  result.host = values["host"];
  return result;
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

// The shaped-link cases: two hosts (network namespaces joined by a veth
// pair, testing/netns_hosts.h) of two ranks each, the link between them
// limited to a rate in each direction; ranks on one host talk over its
// loopback, unshaped. Every case, ours and PyTorch's, is started the same
// way: PyPI's torchrun on each host (static rendezvous at node0), one
// intra-op thread per rank (four ranks share this machine's cores).
struct LinkCase {
  StepConfig config;
  int64_t bits_per_second;
  std::string mode;  // As RunCase's.
};

// The hosts every shaped case runs on, made at the first (null, with the
// reason in `why`, where namespaces cannot be made) and removed at exit.
fsdp::testing::NetnsHosts* SharedHosts(std::string* why) {
  static std::unique_ptr<fsdp::testing::NetnsHosts> hosts;
  static std::string failure;
  if (hosts == nullptr && failure.empty()) {
    absl::Status available = fsdp::testing::NetnsHosts::Available();
    absl::StatusOr<std::unique_ptr<fsdp::testing::NetnsHosts>> made =
        available.ok() ? fsdp::testing::NetnsHosts::Create()
                       : absl::StatusOr<std::unique_ptr<fsdp::testing::NetnsHosts>>(available);
    if (made.ok()) {
      hosts = *std::move(made);
    } else {
      failure = absl::StrCat("no shaped-link hosts here: ", made.status().message());
    }
  }
  *why = failure;
  return hosts.get();
}

std::string FileTail(const std::string& path, size_t bytes) {
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return text.substr(text.size() > bytes ? text.size() - bytes : 0);
}

// Each host's exit status from <dir>/rc<h> (-1: still running) once all
// have one, or `grace_s` after the first failure, or after `timeout_s`.
std::vector<int> WaitForHosts(const std::string& dir, int hosts, int timeout_s, int grace_s) {
  const auto start = Clock::now();
  std::optional<Clock::time_point> first_failure;
  std::vector<int> rc(hosts, -1);
  for (;;) {
    int running = 0;
    for (int h = 0; h < hosts; ++h) {
      if (rc[h] == -1 && !(std::ifstream(absl::StrCat(dir, "/rc", h)) >> rc[h])) rc[h] = -1;
      if (rc[h] == -1) ++running;
      if (rc[h] > 0 && !first_failure.has_value()) first_failure = Clock::now();
    }
    const auto now = Clock::now();
    if (running == 0 ||
        (first_failure.has_value() && now - *first_failure > std::chrono::seconds(grace_s)) ||
        now - start > std::chrono::seconds(timeout_s)) {
      return rc;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

// Runs one case's ranks on both hosts: torchrun on each, under a timeout.
// When one host's torchrun fails, the other's ranks would wait for their
// peers until their collective timeouts (PyTorch's Gloo: 30 min): they are
// killed after a grace. Every process left on a host is killed before
// returning, so that the next case starts on quiet hosts. OK, or which
// host's ranks did not finish or failed, with their log's end.
absl::Status RunOnBothHosts(fsdp::testing::NetnsHosts& hosts,
                            const std::vector<std::string>& host_commands, const std::string& dir,
                            int ranks_per_host) {
  constexpr int kTimeoutS = 900;
  constexpr int kGraceS = 30;
  std::ofstream script(dir + "/run.sh");
  for (int h = 0; h < hosts.size(); ++h) {
    script << "(" << hosts.Prefix(h) << "timeout -k 5 " << kTimeoutS << " " << host_commands[h]
           << " > " << dir << "/host" << h << ".log 2>&1; echo $? > " << dir << "/rc" << h
           << ") &\n";
  }
  script << "wait\n";
  script.close();
  if (!script) return absl::InternalError("cannot write " + dir + "/run.sh");
  std::system(absl::StrCat("bash ", dir, "/run.sh > ", dir, "/run.log 2>&1 &").c_str());
  const std::vector<int> rc = WaitForHosts(dir, hosts.size(), kTimeoutS + 15, kGraceS);
  for (int h = 0; h < hosts.size(); ++h) (void)hosts.KillProcesses(h);
  std::vector<std::string> problems;
  for (int h = 0; h < hosts.size(); ++h) {
    if (rc[h] == 0) continue;
    const std::string what = rc[h] == -1 ? "were still running when the case was stopped"
                             : rc[h] == 124 || rc[h] == 137
                                 ? absl::StrCat("did not finish within ", kTimeoutS, " s")
                                 : absl::StrCat("failed (torchrun exited with ", rc[h], ")");
    problems.push_back(absl::StrCat(
        hosts.name(h), "'s ranks (", h * ranks_per_host, "-", (h + 1) * ranks_per_host - 1, ") ",
        what, "; its log ends: ", FileTail(absl::StrCat(dir, "/host", h, ".log"), 600)));
  }
  if (problems.empty()) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(absl::StrJoin(problems, "\n"), "\n(logs kept in ", dir, ")"));
}

// The ranks' results of a shaped case: the slowest step, the largest
// memory and traffic figures, and as link_mib the sum over hosts of what
// each sent over the link (the largest of its ranks' readings: they read
// the same counter over nearly the same steps).
absl::StatusOr<WorkerResult> WorstOfShapedRanks(const std::string& dir, int hosts,
                                                int ranks_per_host) {
  WorkerResult worst;
  std::map<std::string, double> link_by_host;
  for (int rank = 0; rank < hosts * ranks_per_host; ++rank) {
    absl::StatusOr<WorkerResult> r = ParseWorkerResult(absl::StrCat(dir, "/rank_", rank, ".txt"));
    if (!r.ok()) return r.status();
    if (r->link_mib < 0)
      return absl::DataLossError(absl::StrCat("rank ", rank, ": no link counter"));
    worst.step_ms = std::max(worst.step_ms, r->step_ms);
    worst.peak_rss_mib = std::max(worst.peak_rss_mib, r->peak_rss_mib);
    worst.model_state_mib = std::max(worst.model_state_mib, r->model_state_mib);
    worst.sent_mib = std::max(worst.sent_mib, r->sent_mib);
    link_by_host[r->host] = std::max(link_by_host[r->host], r->link_mib);
  }
  if (link_by_host.size() != static_cast<size_t>(hosts)) {
    return absl::DataLossError(
        absl::StrCat("the ranks named ", link_by_host.size(), " hosts, not ", hosts));
  }
  worst.link_mib = 0;
  for (const auto& [host, mib] : link_by_host) worst.link_mib += mib;
  return worst;
}

void RunShapedCase(benchmark::State& state, const LinkCase& c) {
  constexpr int kRanksPerHost = 2;
  std::string why;
  fsdp::testing::NetnsHosts* hosts = SharedHosts(&why);
  if (hosts == nullptr) {
    state.SkipWithError(why.c_str());
    return;
  }
  if (absl::Status shaped = hosts->ShapeLink(c.bits_per_second); !shaped.ok()) {
    state.SkipWithError(std::string(shaped.message()).c_str());
    return;
  }
  char exe[4096] = {};
  if (::readlink("/proc/self/exe", exe, sizeof(exe) - 1) <= 0) {
    state.SkipWithError("cannot read /proc/self/exe");
    return;
  }
  char dir_template[] = "/tmp/shaped_link_benchmark_XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) {
    state.SkipWithError("cannot make a temporary directory");
    return;
  }
  const std::string dir = dir_template;
  // A port of its own per case: the last case's may still be in TIME_WAIT.
  static int port = 29600;
  ++port;
  const StepConfig& g = c.config;
  std::string program;
  if (absl::StartsWith(c.mode, "pytorch_")) {
    program = absl::StrCat(::fsdp::testing::ScriptPath("models/pytorch_step_benchmark.py"), " ",
                           c.mode.substr(std::string("pytorch_").size()));
  } else {
    program = absl::StrCat("--no-python ", exe, " --worker ", c.mode);
  }
  absl::StrAppend(&program, " ", dir, " ", g.n_layer, " ", g.n_head, " ", g.n_embd, " ",
                  g.block_size, " ", g.batch_per_rank, " ", g.warmup, " ", g.steps);
  std::vector<std::string> host_commands;
  for (int h = 0; h < hosts->size(); ++h) {
    host_commands.push_back(absl::StrCat(
        "env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 FSDP_LINK_TX_BYTES=", hosts->TxBytesPath(h),
        " ", ::fsdp::testing::TorchPython(), " -m torch.distributed.run --nnodes=", hosts->size(),
        " --node-rank=", h, " --nproc-per-node=", kRanksPerHost, " --master-addr=", hosts->name(0),
        " --master-port=", port, " ", program));
  }
  bool failed = false;
  for (auto _ : state) {
    const absl::Status ran = RunOnBothHosts(*hosts, host_commands, dir, kRanksPerHost);
    const absl::StatusOr<WorkerResult> worst =
        ran.ok() ? WorstOfShapedRanks(dir, hosts->size(), kRanksPerHost)
                 : absl::StatusOr<WorkerResult>(ran);
    if (!worst.ok()) {
      state.SkipWithError(std::string(worst.status().message()).c_str());
      failed = true;
      break;
    }
    state.SetIterationTime(worst->step_ms / 1e3);
    state.counters["link_MiB_per_step"] = worst->link_mib;
    state.counters["peak_rss_MiB"] = worst->peak_rss_mib;
    state.counters["model_state_MiB"] = worst->model_state_mib;
    state.counters["sent_MiB_per_step"] = worst->sent_mib;
    state.counters["link_Mbit_per_s"] = c.bits_per_second / 1e6;
  }
  // A failed case's logs stay for reading (its error names the directory).
  if (!failed) std::system(("rm -rf '" + dir + "'").c_str());
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

void RegisterOneHostCases() {
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
}

// The CPU loopback comparison at W = 2 (issue 44 asks FULL_SHARD for at
// most DDP's step there): the benchmark GPT, 30 timed steps, each round
// every case once.
void RegisterLoopbackCases(int rounds) {
  StepConfig gpt;
  gpt.steps = 30;
  for (int round = 1; round <= rounds; ++round) {
    for (const char* mode : {"pytorch_ddp", "full_shard", "full_shard:forward_prefetch",
                             "full_shard:no_headers", "no_shard", "pytorch_fsdp2"}) {
      Register(absl::StrFormat("BM_Loopback/round:%d", round), mode, 2, gpt);
    }
  }
}

// Two models: the benchmark GPT (3.3 M parameters, compute and traffic
// both count) and a wide one whose traffic dominates (width 512, 4 blocks,
// 12.7 M parameters, one 32-token sequence per rank); two link rates. Ours
// beside PyTorch's of the same kind: FULL_SHARD by FSDP2, HYBRID_SHARD
// (shard within a host, replicate across) by HSDP on a 2 x 2 mesh,
// FULL_SHARD with the host as post_forward group by FSDP2 with
// reshard_after_forward=2, SHARD_GRAD_OP by FSDP2 with
// reshard_after_forward=False, NO_SHARD by DDP.
void RegisterShapedLinkCases(int rounds) {
  StepConfig gpt;
  gpt.steps = 30;
  StepConfig wide = gpt;
  wide.n_head = 8;
  wide.n_embd = 512;
  wide.block_size = 32;
  wide.batch_per_rank = 1;
  const std::pair<const char*, StepConfig> models[] = {{"gpt", gpt}, {"gpt_wide", wide}};
  const std::pair<const char*, int64_t> rates[] = {{"1Gbit", 1'000'000'000},
                                                   {"10Gbit", 10'000'000'000}};
  // Under hybrid sharding only the gradients' replicate sum crosses the
  // link: hybrid_shard:int8_reduce codes the reductions alone.
  const char* modes[] = {"pytorch_fsdp2",       "full_shard",           "full_shard:int8",
                         "full_shard:hier",     "full_shard:hier:int8", "pytorch_hsdp",
                         "hybrid_shard",        "hybrid_shard:int8",    "hybrid_shard:int8_reduce",
                         "full_shard:hpz",      "pytorch_fsdp2_hpz",    "shard_grad_op",
                         "pytorch_fsdp2_zero2", "pytorch_ddp",          "no_shard"};
  for (int round = 1; round <= rounds; ++round) {
    for (const auto& [rate_name, rate] : rates) {
      for (const auto& [model_name, config] : models) {
        for (const char* mode : modes) {
          const LinkCase c{config, rate, mode};
          benchmark::RegisterBenchmark(
              absl::StrFormat("BM_ShapedLink/%s/%s/%s/round:%d", model_name, rate_name, mode, round)
                  .c_str(),
              [c](benchmark::State& state) { RunShapedCase(state, c); })
              ->Iterations(1)
              ->UseManualTime()
              ->Unit(benchmark::kMillisecond);
        }
      }
    }
  }
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
  // --shaped_link_rounds=N or --loopback_rounds=N: instead of the one-host
  // cases, N rounds of the shaped-link or loopback cases, each round every
  // case once (interleaved, so that a slow spell of this shared VM lands on
  // all of them).
  int shaped_rounds = 0, loopback_rounds = 0;
  for (int i = 1; i < argc;) {
    const std::pair<const char*, int*> flags[] = {{"--shaped_link_rounds=", &shaped_rounds},
                                                  {"--loopback_rounds=", &loopback_rounds}};
    bool consumed = false;
    for (const auto& [flag, value] : flags) {
      if (!absl::StartsWith(argv[i], flag)) continue;
      if (!absl::SimpleAtoi(argv[i] + std::string(flag).size(), value) || *value < 1) {
        std::fprintf(stderr, "train_step_benchmark: %s: expected a number of rounds >= 1\n",
                     argv[i]);
        return 2;
      }
      std::copy(argv + i + 1, argv + argc, argv + i);
      --argc;
      consumed = true;
      break;
    }
    if (!consumed) ++i;
  }
  if (shaped_rounds > 0) RegisterShapedLinkCases(shaped_rounds);
  if (loopback_rounds > 0) RegisterLoopbackCases(loopback_rounds);
  if (shaped_rounds == 0 && loopback_rounds == 0) RegisterOneHostCases();
  benchmark::Initialize(&argc, argv);
  PrintPyTorchSide();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
