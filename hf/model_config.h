// The configuration of a Llama-family causal language model, read from a
// Hugging Face checkpoint's config.json (what transformers' save_pretrained
// writes beside the weights). A file-format piece: it knows JSON, not
// modules; models/llama.h builds the model from it.
//
//   FSDP_ASSIGN_OR_RETURN(fsdp::hf::CausalLmConfig config,
//                         fsdp::hf::ReadCausalLmConfig("Llama-3.2-1B"));
//
// model_type "llama" and "mistral" (one architecture), "qwen2" (biases on
// q/k/v_proj) and "qwen3" (an RMSNorm over each head of q and k). Fields a
// config may leave out take transformers' defaults for that model_type;
// the sizes are required. Anything this implementation does not compute as
// transformers does is refused by name (a hidden_act other than silu, a
// rope type other than llama3, sliding-window attention for qwen2/qwen3),
// never silently approximated. Rope parameters are read from
// rope_theta / rope_scaling (transformers 4.x) or from rope_parameters
// (5.x); both spellings name the same fields.
#ifndef FSDP_HF_MODEL_CONFIG_H_
#define FSDP_HF_MODEL_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace fsdp::hf {

// rope_type "llama3": transformers' _compute_llama3_parameters.
struct Llama3RopeScaling {
  double factor = 0;
  double low_freq_factor = 0;
  double high_freq_factor = 0;
  int64_t original_max_position_embeddings = 0;
};

struct CausalLmConfig {
  std::string model_type;  // llama, mistral, qwen2, qwen3.
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // Default: num_attention_heads.
  int64_t head_dim = 0;             // Default: hidden_size / num_attention_heads.
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<Llama3RopeScaling> rope_scaling;  // Unset: the default rope.
  bool tie_word_embeddings = false;
  // q/k/v_proj have biases (qwen2 always; llama and qwen3 when
  // attention_bias); o_proj has one when attention_bias.
  bool qkv_bias = false;
  bool o_bias = false;
  bool mlp_bias = false;   // llama's mlp_bias.
  bool qk_norm = false;    // qwen3.
  // Mistral's sliding window: keys this far behind a query are masked.
  std::optional<int64_t> sliding_window;
};

// Parses config.json's text. InvalidArgument naming the field for a field
// that is missing, of the wrong type or out of range; Unimplemented for a
// model_type, hidden_act or rope type this implementation does not compute.
absl::StatusOr<CausalLmConfig> ParseCausalLmConfig(const std::string& json_text);

// Reads and parses `dir`/config.json (NotFound when absent).
absl::StatusOr<CausalLmConfig> ReadCausalLmConfig(const std::string& dir);

}  // namespace fsdp::hf

#endif  // FSDP_HF_MODEL_CONFIG_H_
