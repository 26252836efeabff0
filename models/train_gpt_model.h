// The model the main job trains, for the files of the job's library: its
// own byte-level GPT (models/gpt.h, shaped by --n_layer, --n_head, --n_embd
// and --block_size), or an open-weight Llama-family model (models/llama.h)
// read from a Hugging Face directory (--hf_model), with LoRA adapters when
// --lora_r or --init_peft asks (models/lora.h). The run's steps, held-out
// loss and outputs see only this interface, so both train through the same
// loop, checkpoints and checks.
#ifndef FSDP_MODELS_TRAIN_GPT_MODEL_H_
#define FSDP_MODELS_TRAIN_GPT_MODEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "ATen/core/Tensor.h"
#include "absl/status/statusor.h"
#include "fsdp/fully_shard.h"
#include "policies/wrap_policy.h"
#include "torch/nn/module.h"

namespace train_gpt {

class JobModel {
 public:
  virtual ~JobModel() = default;

  // The module FSDP wraps: the root of the model (a reference, and the
  // owning pointer Wrap takes). The model is the job's to change (train,
  // load): these hand it out mutable.
  virtual torch::nn::Module& module() const = 0;
  virtual std::shared_ptr<torch::nn::Module> shared_module() const = 0;
  // Logits [b, t, vocab_size()] of token ids [b, t].
  virtual at::Tensor Logits(const at::Tensor& ids) = 0;
  virtual int64_t vocab_size() const = 0;
  // The transformer blocks: what --activation_checkpointing wraps and
  // (unless --wrap_policy says otherwise) the FSDP units.
  virtual std::unique_ptr<fsdp::WrapPolicy> BlockPolicy() const = 0;
  // The start of the header line: "GPT 2 layers x 4 heads x 64 wide".
  virtual std::string Description() const = 0;
  // FsdpOptions::param_init_fn for a model built without memory (a
  // --hf_model: no rank holds it whole; its values are the checkpoint's);
  // null for one built with its values.
  virtual std::function<void(torch::nn::Module&)> param_init_fn() const = 0;
  // Whether its forward draws random numbers in training (dropout).
  virtual bool draws_random_numbers() const = 0;
  // Whether the ids are bytes, so that a generated sample is text.
  virtual bool ids_are_bytes() const = 0;

  // Called by every rank once the model is wrapped, in a run that does not
  // resume: the weights the flags name in place of the seed's (the
  // --hf_model directory's, --init_peft's adapter). Throws on failure,
  // naming the file.
  virtual void LoadStartingWeights(fsdp::FullyShardedModel& wrapped, bool print) = 0;
  // Called by every rank after training, the last of the outputs: writes
  // --export_peft and then --export_hf (with adapters, merged into the
  // base first, which changes the model: nothing may run after it).
  virtual void Export(fsdp::FullyShardedModel& wrapped, bool print) = 0;
};

// The model the flags ask for, built on the host from --seed, the same on
// every rank. kInvalidArgument / kNotFound naming the flag and the file for
// a --hf_model directory or a --init_peft adapter that cannot be used.
absl::StatusOr<std::unique_ptr<JobModel>> JobModelFromFlags();

// The decoder layers of a --hf_model model: the default wrap policy there.
std::unique_ptr<fsdp::WrapPolicy> HfModelLayerPolicy();

}  // namespace train_gpt

#endif  // FSDP_MODELS_TRAIN_GPT_MODEL_H_
