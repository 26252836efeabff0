// The project's main job until the FSDP runtime lands: W local processes
// meet through a TCPStore rendezvous and run every collective FSDP uses over
// a range of sizes, checking each result and printing time and bandwidth.
//
//   bazel run //comm:collectives_main -- --world_size=4 --dtype=bfloat16
//
// Run without launcher variables, it launches --world_size copies of itself
// (launch/local_launcher.h) and exits non-zero naming any rank that failed.
// Run under torchrun or srun, it is one rank of their job.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "comm/collectives.h"
#include "comm/launch_environment.h"
#include "comm/rendezvous.h"
#include "launch/local_launcher.h"

ABSL_FLAG(int, world_size, 2, "Ranks to launch on this host (launcher mode).");
ABSL_FLAG(int64_t, min_bytes, 1 << 10, "Smallest full buffer, in bytes.");
ABSL_FLAG(int64_t, max_bytes, 64 << 20, "Largest full buffer, in bytes.");
ABSL_FLAG(std::string, dtype, "float32", "float32, float16 or bfloat16.");
ABSL_FLAG(int, timeout_s, 600, "Whole-job timeout (launcher mode).");
ABSL_FLAG(int, collective_timeout_s, 120, "Timeout of each collective.");

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;

absl::StatusOr<at::ScalarType> ParseDtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  return absl::InvalidArgumentError("--dtype=" + name +
                                    ": expected float32, float16 or bfloat16");
}

// Small integers: exact in every dtype, different per rank and position.
at::Tensor Pattern(int rank, int64_t numel, at::ScalarType dtype) {
  return ((at::arange(numel, at::kLong) * 7 + rank * 5) % 11 - 5).to(dtype);
}

at::Tensor ExpectedSum(int world, int64_t numel, at::ScalarType dtype) {
  at::Tensor sum = at::zeros({numel}, at::kFloat);
  for (int r = 0; r < world; ++r) sum += Pattern(r, numel, at::kFloat);
  return sum.to(dtype);
}

struct Measurement {
  double seconds_per_op = 0;
  bool correct = false;
};

// Runs `op` once to check its result, then `iters` times timed; the time is
// the average over ranks.
template <typename Op, typename Check>
Measurement Measure(Collectives& comm, int iters, Op op, Check check) {
  Measurement m;
  op();
  m.correct = check();
  comm.Barrier();
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < iters; ++i) op();
  comm.Barrier();
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  at::Tensor t = at::full({2}, 0.0, at::kDouble);
  t[0] = elapsed / iters;
  t[1] = m.correct ? 1.0 : 0.0;
  comm.AllReduce(t, ReduceOp::kSum)->Wait();
  m.seconds_per_op = t[0].item<double>() / comm.world_size();
  m.correct = t[1].item<double>() == comm.world_size();
  return m;
}

// Measures all-gather, reduce-scatter and all-reduce of a `bytes` full
// buffer, rank 0 printing a row for each; true when every result was right
// on every rank.
bool MeasureAtSize(Collectives& comm, int64_t bytes, at::ScalarType dtype, bool print) {
  const int rank = comm.rank();
  const int world = comm.world_size();
  const int64_t element = c10::elementSize(dtype);
  const int64_t shard = std::max<int64_t>(1, bytes / element / world);
  const int64_t full = shard * world;
  const int iters = static_cast<int>(std::clamp<int64_t>((256 << 20) / bytes, 3, 100));
  at::Tensor shard_in = Pattern(rank, shard, dtype);
  at::Tensor full_buf = at::empty({full}, dtype);
  at::Tensor shard_out = at::empty({shard}, dtype);
  at::Tensor full_in = Pattern(rank, full, dtype);
  at::Tensor reduce_buf = at::empty({full}, dtype);

  struct Row {
    const char* name;
    double bus_factor;  // busbw / algbw for an optimal algorithm.
    Measurement m;
  };
  const double gather_factor = static_cast<double>(world - 1) / world;
  std::vector<Row> rows;
  rows.push_back({"all-gather", gather_factor,
                  Measure(
                      comm, iters,
                      [&] { comm.AllGatherIntoTensor(full_buf, shard_in)->Wait(); },
                      [&] {
                        std::vector<at::Tensor> parts;
                        for (int r = 0; r < world; ++r) parts.push_back(Pattern(r, shard, dtype));
                        return at::equal(full_buf, at::cat(parts));
                      })});
  rows.push_back(
      {"reduce-scatter", gather_factor,
       Measure(
           comm, iters,
           [&] { comm.ReduceScatterTensor(shard_out, full_in, ReduceOp::kSum)->Wait(); },
           [&] {
             return at::equal(shard_out, ExpectedSum(world, full, dtype)
                                             .slice(0, rank * shard, (rank + 1) * shard));
           })});
  rows.push_back({"all-reduce", 2 * gather_factor,
                  Measure(
                      comm, iters,
                      [&] {
                        reduce_buf.copy_(full_in);
                        comm.AllReduce(reduce_buf, ReduceOp::kSum)->Wait();
                      },
                      [&] { return at::equal(reduce_buf, ExpectedSum(world, full, dtype)); })});
  rows.push_back({"all-to-all", gather_factor,
                  Measure(
                      comm, iters, [&] { comm.AllToAll(full_buf, full_in)->Wait(); },
                      [&] {
                        std::vector<at::Tensor> parts;
                        for (int r = 0; r < world; ++r) {
                          parts.push_back(
                              Pattern(r, full, dtype).slice(0, rank * shard, (rank + 1) * shard));
                        }
                        return at::equal(full_buf, at::cat(parts));
                      })});
  bool all_correct = true;
  for (const Row& row : rows) {
    all_correct = all_correct && row.m.correct;
    if (!print) continue;
    const double algbw = static_cast<double>(full * element) / row.m.seconds_per_op / 1e9;
    std::printf("%-15s %12lld %6d %12.1f %12.3f %12.3f  %s\n", row.name,
                static_cast<long long>(full * element), iters, row.m.seconds_per_op * 1e6,
                algbw, algbw * row.bus_factor, row.m.correct ? "ok" : "WRONG RESULT");
    std::fflush(stdout);
  }
  return all_correct;
}

int RunRank(const LaunchEnvironment& env, at::ScalarType dtype) {
  GlooOptions options;
  options.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_collective_timeout_s));
  std::unique_ptr<Collectives> comm =
      ValueOrThrow(CreateGlooCollectivesFromEnvironment(env, options));
  const int rank = comm->rank();
  const int world = comm->world_size();
  const bool print = rank == 0;
  if (print) {
    std::printf("collectives over Gloo: %d ranks (rendezvous from %s variables), dtype %s\n", world,
                env.source.c_str(), c10::toString(dtype));
    std::printf("%-15s %12s %6s %12s %12s %12s  %s\n", "operation", "bytes", "iters",
                "time/op(us)", "algbw(GB/s)", "busbw(GB/s)", "result");
  }
  bool all_correct = true;
  for (int64_t bytes = absl::GetFlag(FLAGS_min_bytes);
       bytes <= absl::GetFlag(FLAGS_max_bytes); bytes *= 4) {
    const bool correct = MeasureAtSize(*comm, bytes, dtype, print);
    all_correct = all_correct && correct;
  }
  if (print) {
    const CollectiveCounters c = comm->counters();
    std::printf("rank 0 issued:");
    for (int op = 0; op < kNumCollectiveOps; ++op) {
      std::printf(" %s %lld calls / %.1f MiB;", CollectiveOpName(static_cast<CollectiveOp>(op)),
                  static_cast<long long>(c.calls[op]), c.bytes[op] / 1048576.0);
    }
    std::printf("\n%s\n", all_correct ? "all results correct" : "SOME RESULTS WERE WRONG");
  }
  return all_correct ? 0 : 1;
}

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<at::ScalarType> dtype = fsdp::ParseDtype(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) {
    std::fprintf(stderr, "collectives_main: %s\n", dtype.status().ToString().c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_world_size) < 1 || absl::GetFlag(FLAGS_min_bytes) < 1 ||
      absl::GetFlag(FLAGS_max_bytes) < absl::GetFlag(FLAGS_min_bytes)) {
    std::fprintf(stderr,
                 "collectives_main: need --world_size >= 1 and 1 <= --min_bytes <= "
                 "--max_bytes\n");
    return 2;
  }
  absl::StatusOr<fsdp::LaunchEnvironment> env = fsdp::ReadLaunchEnvironment();
  if (absl::IsNotFound(env.status())) {
    fsdp::SelfLaunch launch;
    launch.world_size = absl::GetFlag(FLAGS_world_size);
    launch.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s));
    return fsdp::LaunchSelfAndReport(argc, argv, launch, "collectives_main");
  }
  if (!env.ok()) {
    std::fprintf(stderr, "collectives_main: %s\n", env.status().ToString().c_str());
    return 2;
  }
  try {
    return fsdp::RunRank(*env, *dtype);
  } catch (...) {
    std::fprintf(stderr, "collectives_main rank %d: %s\n", env->rank,
                 std::string(fsdp::StatusFromCurrentException().message()).c_str());
    return 1;
  }
}
