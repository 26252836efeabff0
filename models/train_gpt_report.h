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
  std::string device;
};

// The device caching allocator's peak of allocated bytes on `device`; none
// on the host, or with a libtorch older than 2.10 (no device-generic stats).
std::optional<int64_t> PeakDeviceBytes(const c10::Device& device);

// The process's resident set now (/proc/self/statm); 0 where unreadable.
int64_t CurrentRssBytes();

// The bytes of `model`'s gradients on this rank.
int64_t LocalGradientBytes(torch::nn::Module& model);

// The bytes of `optimizer`'s AdamW or SGD state on this rank.
int64_t LocalOptimizerStateBytes(torch::optim::Optimizer& optimizer);

// One line per rank; every figure is measured on that rank.
void PrintRankReport(int rank, const RankReport& r, const fsdp::CollectiveCounters& c);

}  // namespace train_gpt

#endif  // FSDP_MODELS_TRAIN_GPT_REPORT_H_
