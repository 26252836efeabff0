// LoRA adapters (Hu et al. 2021) on a model's linear layers, as PEFT's
// LoraModel computes them, and PEFT's adapter directory
// (adapter_config.json + adapter_model.safetensors) read and written for an
// FSDP-wrapped model.
//
// A LoraLinear is a linear layer with transformers' parameter names (weight
// [out, in], bias) that can carry an adapter: lora_A.weight [r, in] and
// lora_B.weight [out, r], and
//   y = x W^T + b + lora_B(lora_A(dropout(x))) * scaling,
// scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). A new
// adapter starts as PEFT's default (init_lora_weights=True): lora_A
// kaiming_uniform(a = sqrt(5)), lora_B zeros, so the model's output is
// unchanged until lora_B moves. The Llama family's projections
// (models/llama.h) are LoraLinears; a module's names are then PEFT's minus
// the adapter's name, so the adapter file's keys are "base_model.model." +
// our names (PEFT's get_peft_model_state_dict).
//
// Fine-tuning an open-weight model:
//
//   models::CausalLm model(config);
//   models::LoraConfig lora;
//   lora.r = 16; lora.lora_alpha = 32;
//   lora.target_modules = {"q_proj", "v_proj"};
//   FSDP_RETURN_IF_ERROR(models::ApplyLora(*model, lora));  // Before Wrap.
//   auto sharded = fsdp::FullyShardedModel::Wrap(model.ptr(), group, {},
//       *fsdp::ModuleTypePolicy::Of<fsdp::UnitModuleImpl>()).value();
//   fsdp::CheckpointIoOptions base;  // The base's tensors: all but the adapters.
//   base.hugging_face.tensors = fsdp::HuggingFaceTensors::kFrozen;
//   FSDP_RETURN_IF_ERROR(fsdp::LoadCheckpoint(base_dir, *sharded, nullptr, nullptr, base));
//   ... train with an optimizer over fsdp::UniqueParameters(*model) ...
//   FSDP_RETURN_IF_ERROR(models::SavePeftAdapter(out_dir, *sharded, lora));
//   // Or a plain transformers checkpoint of the result: MergeLoraAdapters,
//   // then SaveCheckpoint with hugging_face.tensors = kFrozen.
//
// ApplyLora freezes every parameter but the adapters' (requires_grad
// false), so an FSDP unit holds the frozen base and its trainable adapters
// together (NOTE in fsdp/wrap_plan.h) and gradients, optimizer state and
// the saved adapter are the adapters' only.
//
// Not supported (refused by name when a config asks for them): DoRA,
// biases of the adapter (bias != "none"), modules_to_save, per-module rank
// or alpha patterns, fan_in_fan_out, layers_to_transform / layers_pattern,
// target_modules given as a regular expression, exclude_modules, adapters on
// embeddings or other non-linear layers.
#ifndef FSDP_MODELS_LORA_H_
#define FSDP_MODELS_LORA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ATen/core/Tensor.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"
#include "fsdp/fully_shard.h"
#include "torch/nn/module.h"
#include "torch/nn/modules/linear.h"
#include "torch/nn/pimpl.h"

namespace models {

// PEFT's LoraConfig, the fields this implementation computes.
struct LoraConfig {
  int64_t r = 8;
  double lora_alpha = 8;
  // Applied to the adapter's input in training mode only; 0: none.
  double lora_dropout = 0;
  // Module names' last components ("q_proj"): every LoraLinear so named
  // gets an adapter. Each must match at least one.
  std::vector<std::string> target_modules;
  bool use_rslora = false;

  // lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.
  double scaling() const;
  bool operator==(const LoraConfig& other) const;
};

// A linear layer that may carry a LoRA adapter (see the top).
struct LoraLinearImpl : torch::nn::Module {
  // Initialized as torch::nn::Linear, or left uninitialized (`initialize`
  // false) for a model whose own initialization or checkpoint fills it:
  // drawing a billion random numbers that are then replaced is most of a
  // large model's build time.
  LoraLinearImpl(int64_t in_features, int64_t out_features, bool bias, bool initialize = true);
  at::Tensor forward(const at::Tensor& x);
  // Whether an adapter is on.
  bool has_adapter() const { return !lora_A.is_empty(); }

  at::Tensor weight;  // [out, in].
  at::Tensor bias;    // [out], or undefined.
  // Set by ApplyLora; null without an adapter.
  torch::nn::Linear lora_A{nullptr}, lora_B{nullptr};
  int64_t r = 0;
  double scaling = 0;
  double dropout = 0;
};
TORCH_MODULE(LoraLinear);

// Puts an adapter on every LoraLinear of `model` whose name is one of
// config.target_modules or ends with "." + one (PEFT's rule), and freezes
// every other parameter. The adapters are initialized from `seed` (the same
// on every rank: call with the same seed everywhere). All-or-nothing:
// kInvalidArgument for a bad config (r < 1, dropout outside [0, 1), no
// targets), targets that together match no LoraLinear (naming them; one
// that matches nothing beside others that match is allowed, as in PEFT), or
// a target that matches a module that is no LoraLinear (naming both);
// kFailedPrecondition when the model already has adapters or is wrapped
// already (any of its modules an FSDP unit: fsdp::FullyShardedModel::Wrap
// flattens the parameters it finds, so apply LoRA before it).
absl::Status ApplyLora(torch::nn::Module& model, const LoraConfig& config, uint64_t seed = 0);

// PEFT's adapter_config.json: parsed (kInvalidArgument naming the field for
// a missing or mistyped one; kUnimplemented naming what this implementation
// does not compute, see the top) and written, with the fields PEFT 0.21
// writes for a LoRA config (task_type CAUSAL_LM).
absl::StatusOr<LoraConfig> ParsePeftAdapterConfig(const std::string& json_text);
absl::StatusOr<LoraConfig> ReadPeftAdapterConfig(const std::string& dir);
std::string PeftAdapterConfigJson(const LoraConfig& config);

// The checkpoint options of PEFT's adapter files (checkpoint/checkpoint.h:
// the trainable parameters, "base_model.model." + name, in
// adapter_model.safetensors, config as adapter_config.json).
fsdp::CheckpointIoOptions PeftAdapterIoOptions();

// Writes `dir`/adapter_model.safetensors (the adapters' tensors, float32 as
// the model holds them, gathered one unit at a time) and
// adapter_config.json from `config`, atomically (checkpoint/checkpoint.h's
// Hugging Face saves). Called by every rank, the model idle.
// kFailedPrecondition when the model's adapters are not `config`'s, or
// when a trainable parameter is not a lora_A / lora_B weight (naming it;
// the same for LoadPeftAdapter).
absl::Status SavePeftAdapter(const std::string& dir, fsdp::FullyShardedModel& model,
                             const LoraConfig& config);

// Loads a PEFT adapter directory into the model's adapters (each rank reads
// only its shards' elements); the base is not touched. The directory's
// config must equal `config`, the model's (ApplyLora's); the file must
// hold exactly the adapters' tensors with their shapes: anything missing,
// extra or mis-shaped is refused by key, and nothing is changed.
absl::Status LoadPeftAdapter(const std::string& dir, fsdp::FullyShardedModel& model,
                             const LoraConfig& config);

// Merges every adapter into its base weight, W += scaling * B A (PEFT's
// merge_and_unload), and zeroes lora_B: the model computes what it did, and
// its frozen tensors are the fine-tuned model, so a save of them
// (CheckpointIoOptions::hugging_face.tensors = kFrozen, with the base's
// config.json) is a transformers checkpoint that from_pretrained reads
// without peft. Save the adapter first if it is still wanted. Gathers one
// unit's full parameters at a time (fsdp::SummonFullParams, written back).
// Every rank calls it, the model idle (else kFailedPrecondition).
absl::Status MergeLoraAdapters(fsdp::FullyShardedModel& model);

}  // namespace models

#endif  // FSDP_MODELS_LORA_H_
