#include "models/train_gpt_report.h"

#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "ATen/ATen.h"
#if __has_include("ATen/DeviceAccelerator.h")
#include "ATen/DeviceAccelerator.h"
#endif
#include "absl/strings/str_format.h"
#include "fsdp/utilities.h"
#include "torch/optim/adamw.h"
#include "torch/optim/sgd.h"
#include "torch/version.h"

namespace train_gpt {

std::optional<int64_t> PeakDeviceBytes(const c10::Device& device) {
  if (device.is_cpu()) return std::nullopt;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10)
  const auto stats = at::accelerator::getDeviceStats(device.index());
  return stats.allocated_bytes[static_cast<size_t>(
                                   c10::CachingDeviceAllocator::StatType::AGGREGATE)]
      .peak;
#else
  return std::nullopt;
#endif
}

int64_t CurrentRssBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size_pages = 0, resident_pages = 0;
  if (!(statm >> size_pages >> resident_pages)) return 0;
  return resident_pages * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

namespace {

// Fixing the mmap threshold also stops glibc raising the trim threshold
// with it (to twice the mmap threshold), so that is set too.
void FixHeapThresholds(int mmap_bytes, int trim_bytes) {
#if defined(__GLIBC__)
  for (const char* chosen :
       {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"}) {
    if (std::getenv(chosen) != nullptr) return;
  }
  mallopt(M_MMAP_THRESHOLD, mmap_bytes);
  mallopt(M_TRIM_THRESHOLD, trim_bytes);
#else
  (void)mmap_bytes;
  (void)trim_bytes;
#endif
}

}  // namespace

void BeginModelBuild() { FixHeapThresholds(1 << 20, 2 << 20); }
void EndModelBuild() { FixHeapThresholds(32 << 20, 64 << 20); }

int64_t PeakRssBytes() {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

int64_t LocalGradientBytes(torch::nn::Module& model) {
  int64_t bytes = 0;
  for (const at::Tensor& p : fsdp::UniqueParameters(model)) {
    if (p.grad().defined()) bytes += p.grad().nbytes();
  }
  return bytes;
}

int64_t LocalOptimizerStateBytes(torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (const auto& [key, state] : optimizer.state()) {
    if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(state.get())) {
      for (const at::Tensor& t :
           {adamw->exp_avg(), adamw->exp_avg_sq(), adamw->max_exp_avg_sq()}) {
        if (t.defined()) bytes += t.nbytes();
      }
    } else if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(state.get())) {
      if (sgd->momentum_buffer().defined()) bytes += sgd->momentum_buffer().nbytes();
    }
  }
  return bytes;
}

void PrintRankReport(int rank, const RankReport& r, const fsdp::CollectiveCounters& c) {
  constexpr double kMiB = 1048576.0;
  const std::string line = absl::StrFormat(
      "rank %d: peak RSS %.1f MiB (%.1f before the first step, peak %.1f in the %.1f s until "
      "then)%s; held / unsharded: parameters %.2f / %.2f MiB, gradients "
      "%.2f / %.2f MiB, optimizer state %.2f / %.2f MiB; all-gathered %.1f MiB in %d calls, "
      "reduce-scattered %.1f MiB in %d calls, all-reduced %.1f MiB in %d calls%s\n",
      rank, PeakRssBytes() / kMiB, r.rss_before_steps / kMiB, r.peak_rss_before_steps / kMiB,
      r.seconds_before_steps,
      r.peak_device_bytes
          ? absl::StrFormat(", peak %s memory %.1f MiB", r.device, *r.peak_device_bytes / kMiB)
          : "",
      r.shard_param_bytes / kMiB, r.unsharded_param_bytes / kMiB, r.gradient_bytes / kMiB,
      r.unsharded_param_bytes / kMiB, r.optimizer_state_bytes / kMiB,
      r.unsharded_optimizer_state_bytes / kMiB, c.Bytes(fsdp::CollectiveOp::kAllGather) / kMiB,
      c.Calls(fsdp::CollectiveOp::kAllGather), c.Bytes(fsdp::CollectiveOp::kReduceScatter) / kMiB,
      c.Calls(fsdp::CollectiveOp::kReduceScatter), c.Bytes(fsdp::CollectiveOp::kAllReduce) / kMiB,
      c.Calls(fsdp::CollectiveOp::kAllReduce),
      // Only --reduce_quantization's reductions exchange all-to-all.
      c.Calls(fsdp::CollectiveOp::kAllToAll) == 0
          ? ""
          : absl::StrFormat(", exchanged %.1f MiB in %d all-to-all calls",
                            c.Bytes(fsdp::CollectiveOp::kAllToAll) / kMiB,
                            c.Calls(fsdp::CollectiveOp::kAllToAll)));
  std::fputs(line.c_str(), stdout);
  std::fflush(stdout);
}

}  // namespace train_gpt
