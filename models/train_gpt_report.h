// What one rank of the main job held and sent, measured on that rank and
// printed as one line at the end of the run: memory (resident, device,
// parameters, gradients, optimizer state, held against unsharded) and
// collective traffic.
#ifndef FSDP_MODELS_TRAIN_GPT_REPORT_H_
#define FSDP_MODELS_TRAIN_GPT_REPORT_H_

#include <cstdint>
#include <optional>
#include <string>

#include "c10/core/Device.h"
#include "comm/collectives.h"
#include "torch/nn/module.h"
#include "torch/optim/optimizer.h"

namespace train_gpt {

// What one rank held and sent, for the report at the end of the run.
struct RankReport {
  int64_t shard_param_bytes = 0, unsharded_param_bytes = 0;
  int64_t gradient_bytes = 0;  // Measured after the last backward.
  int64_t optimizer_state_bytes = 0, unsharded_optimizer_state_bytes = 0;
  // The caching allocator's peak on the rank's GPU; none on the host.
  std::optional<int64_t> peak_device_bytes;
  // Resident memory once the model is wrapped and the optimizer built,
  // before the first step: what the peak adds to it is the steps' own.
  int64_t rss_before_steps = 0;
  // The peak resident memory until then: building, wrapping and loading
  // the model (--hf_model's weights, a resumed checkpoint), and the corpus.
  int64_t peak_rss_before_steps = 0;
  double seconds_before_steps = 0;  // From building the model to the first step.
  std::string device;
};

// The device caching allocator's peak of allocated bytes on `device`; none
// on the host, or with a libtorch older than 2.10 (no device-generic stats).
std::optional<int64_t> PeakDeviceBytes(const c10::Device& device);

// The process's resident set now (/proc/self/statm); 0 where unreadable.
int64_t CurrentRssBytes();
// The process's peak resident memory so far.
int64_t PeakRssBytes();

// glibc keeps freed blocks under its sliding mmap threshold (up to 32 MiB)
// in its heap for reuse. Building, wrapping and loading a model one unit at
// a time frees one unit's tensors after another, and a rank building a
// 1.1 B Llama kept about 1.1-1.4 GiB of them.
// BeginModelBuild fixes the threshold at 1 MiB, so that such blocks go back
// to the kernel when freed; EndModelBuild fixes it at 32 MiB (trim 64 MiB,
// what glibc would choose) for the steps, where reusing unshard buffers
// from the heap is faster (a 512-wide GPT ran 17% slower with 4 MiB).
// Neither does anything off glibc or where the environment chose
// thresholds (MALLOC_MMAP_THRESHOLD_, as the memory benchmarks do,
// MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES).
void BeginModelBuild();
void EndModelBuild();

// The bytes of `model`'s gradients on this rank.
int64_t LocalGradientBytes(torch::nn::Module& model);

// The bytes of `optimizer`'s AdamW or SGD state on this rank.
int64_t LocalOptimizerStateBytes(torch::optim::Optimizer& optimizer);

// One line per rank; every figure is measured on that rank.
void PrintRankReport(int rank, const RankReport& r, const fsdp::CollectiveCounters& c);

}  // namespace train_gpt

#endif  // FSDP_MODELS_TRAIN_GPT_REPORT_H_
