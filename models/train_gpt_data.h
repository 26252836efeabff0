// The tokens the main job trains on and the batches it draws from them:
// the generated corpus or --data (split into training and held-out parts),
// and --replay_batches' recorded batches. Every rank builds the same
// sources with the same seeds, so that all draw the same global batch and
// each trains on its slice of it.
#ifndef FSDP_MODELS_TRAIN_GPT_DATA_H_
#define FSDP_MODELS_TRAIN_GPT_DATA_H_

#include <cstdint>
#include <random>

#include "ATen/core/Tensor.h"
#include "absl/status/statusor.h"

namespace train_gpt {

// The tokens the run trains on and, with --data, the held-out tenth.
struct Corpus {
  at::Tensor train;     // int64 [n]
  at::Tensor held_out;  // int64 [m]; undefined without --data.
};

// The generated corpus (seeded by --seed), or --data's bytes. Errors name
// the flag.
absl::StatusOr<Corpus> LoadCorpus();

// Global batches of `block_size` + 1 tokens drawn from `tokens` with a
// generator every rank seeds alike.
class TokenSampler {
 public:
  TokenSampler(at::Tensor tokens, int64_t global_batch, int64_t block_size, uint64_t seed);

  // [global batch, block_size + 1] token ids.
  at::Tensor Next();
  // Drops the next `batches` batches.
  void Skip(int64_t batches);

 private:
  at::Tensor tokens_;
  int64_t global_batch_, t_;
  std::mt19937_64 sampler_;
};

// The batches the run trains on: --replay_batches' recorded ones, or drawn
// from the training tokens. Throws when the recorded batches do not fit
// the run.
class BatchSource {
 public:
  BatchSource(const at::Tensor& tokens, int64_t global_batch, int64_t block_size, int steps);

  // Drops the batches of steps 1..`steps` (already taken by a resumed run).
  void Skip(int64_t steps) { sampler_.Skip(steps); }

  // The global batch of `step`: [global batch, block_size + 1] token ids.
  at::Tensor Next(int step);

 private:
  int64_t t_;
  TokenSampler sampler_;
  at::Tensor replay_;  // [steps, global batch, t + 1], from --replay_batches.
  int64_t replay_first_step_ = 1;
};

}  // namespace train_gpt

#endif  // FSDP_MODELS_TRAIN_GPT_DATA_H_
