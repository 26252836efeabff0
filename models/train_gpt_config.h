// The main job's settings resolved from its flags, beyond the FSDP options
// and wrap policy (train_gpt_checks.h): the model's shape, and where each
// rank computes and how it talks (--device and --collectives). The
// placement is resolved once before any rank starts, to refuse a bad one
// early, and again by each rank for itself.
#ifndef FSDP_MODELS_TRAIN_GPT_CONFIG_H_
#define FSDP_MODELS_TRAIN_GPT_CONFIG_H_

#include <string>

#include "absl/status/statusor.h"
#include "c10/core/Device.h"
#include "models/gpt.h"

namespace train_gpt {

// --block_size, --n_layer, --n_head, --n_embd, --seed and --dropout.
models::GptConfig GptConfigFromFlags();

// Where this rank computes and how it talks: --device, --collectives and
// --shard_collectives resolved for it. Checked once before any rank starts (ResolvePlacement
// with the host's ranks), then per rank.
struct Placement {
  c10::Device device = c10::Device(c10::kCPU);
  std::string collectives;  // gloo, nccl or staged.
  // --shard_collectives=two_level: FSDP's group is two-level over the
  // host groups of LOCAL_WORLD_SIZE ranks and the groups across them.
  bool two_level = false;
};

// The placement of local rank `local_rank` of `ranks_on_host`: an error
// names the flag and what would be valid (or why the host cannot do it).
absl::StatusOr<Placement> ResolvePlacement(int local_rank, int ranks_on_host);

}  // namespace train_gpt

#endif  // FSDP_MODELS_TRAIN_GPT_CONFIG_H_
