// The tokens the main job trains on and the batches it draws from them:
// the generated corpus, --data or --data_tokens (split into training and
// held-out parts), and --replay_batches' recorded batches. Every rank
// builds the same sources with the same seeds, so that all draw the same
// global batch and each trains on its slice of it.
#ifndef FSDP_MODELS_TRAIN_GPT_DATA_H_
#define FSDP_MODELS_TRAIN_GPT_DATA_H_

#include <cstdint>
#include <random>
#include <string>

#include "ATen/core/Tensor.h"
#include "absl/status/statusor.h"

namespace train_gpt {

// The tokens the run trains on and, with --data or --data_tokens, the
// held-out tenth.
//
// --data_tokens is nanoGPT's train.bin: token ids as little-endian uint16
// or uint32 (--data_tokens_dtype), nothing else. The file is mapped, not
// read: `train` and `held_out` are then int16 / int32 views of the mapping
// (libtorch 1.13 has no unsigned 16- or 32-bit type), which TokenSampler
// widens to the unsigned ids batch by batch. Ranks on one host share the
// page cache, so a corpus of gigabytes costs each rank nothing up front.
struct Corpus {
  at::Tensor train;     // [n]: int64, or the mapping's int16 / int32.
  at::Tensor held_out;  // [m]; undefined for the generated corpus.
  // "--data=PATH" or "--data_tokens=PATH", for messages; empty for the
  // generated corpus.
  std::string source;
  const char* unit = "bytes";  // What one element of `source` is.
};

// The generated corpus (seeded by --seed), --data's bytes or --data_tokens'
// ids. Errors name the flag.
absl::StatusOr<Corpus> LoadCorpus();

// How --data_tokens_dtype's ids are held: at::kShort for uint16, at::kInt
// for uint32 (see Corpus).
at::ScalarType TokenFileDtype();

// Global batches of `block_size` + 1 tokens drawn from `tokens` with a
// generator every rank seeds alike.
class TokenSampler {
 public:
  // `tokens` as in Corpus. Every drawn id must be below `vocab_size`; one
  // that is not fails Next, naming `source` and the id's position, before
  // the batch reaches the model (PreLaunchProblems checks only the file's
  // size: a scan of a corpus of gigabytes would delay every launch).
  TokenSampler(at::Tensor tokens, int64_t global_batch, int64_t block_size, uint64_t seed,
               int64_t vocab_size, std::string source);

  // [global batch, block_size + 1] int64 token ids.
  at::Tensor Next();
  // Drops the next `batches` batches.
  void Skip(int64_t batches);

 private:
  at::Tensor tokens_;
  int64_t global_batch_, t_, vocab_size_;
  std::string source_;
  std::mt19937_64 sampler_;
};

// The batches the run trains on: --replay_batches' recorded ones, or drawn
// from the training tokens. Throws when the recorded batches do not fit
// the run.
class BatchSource {
 public:
  BatchSource(const Corpus& corpus, int64_t global_batch, int64_t block_size, int64_t vocab_size,
              int steps);

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
