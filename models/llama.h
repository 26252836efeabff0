// Llama-family causal language models (Llama, Mistral, Qwen2, Qwen3) with
// transformers' module names, so that a Hugging Face checkpoint loads with
// no renaming (fsdp::LoadCheckpoint reads its directory):
//
//   model.embed_tokens, model.layers.N.{input_layernorm,
//   post_attention_layernorm}, model.layers.N.self_attn.{q,k,v,o}_proj
//   (qwen3: .q_norm, .k_norm), model.layers.N.mlp.{gate,up,down}_proj,
//   model.norm, lm_head (the embedding's tensor when tie_word_embeddings).
//
// The math is transformers' eager path: RMSNorm in float32 then cast back
// before the weight, rotary embeddings in the rotate-half layout (llama3
// frequency scaling as _compute_llama3_parameters), grouped-query attention
// with a causal mask and softmax in float32, SwiGLU MLP. No dropout, no KV
// cache (training and whole-sequence scoring).
//
// FSDP: each decoder layer is held as fsdp::UnitModule<LlamaDecoderLayerImpl>
// (the layer's own code has no FSDP line), and CausalLm's forward opens the
// root's UnitForward scope. Wrap with
// *fsdp::ModuleTypePolicy::Of<fsdp::UnitModuleImpl>(): one unit per layer,
// the embeddings, final norm and head with the root.
//
//   auto config = fsdp::hf::ReadCausalLmConfig(dir).value();
//   models::CausalLm model(config);
//   auto sharded = fsdp::FullyShardedModel::Wrap(model.ptr(), group, {},
//       *fsdp::ModuleTypePolicy::Of<fsdp::UnitModuleImpl>()).value();
//   FSDP_RETURN_IF_ERROR(fsdp::LoadCheckpoint(dir, *sharded));
//   at::Tensor loss = models::CausalLmLoss(model->forward(ids), ids);
#ifndef FSDP_MODELS_LLAMA_H_
#define FSDP_MODELS_LLAMA_H_

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "ATen/core/Tensor.h"
#include "fsdp/fully_shard.h"
#include "fsdp/unit_module.h"
#include "hf/model_config.h"
#include "models/lora.h"
#include "torch/nn/module.h"
#include "torch/nn/modules/container/modulelist.h"
#include "torch/nn/modules/embedding.h"

namespace models {

using LlamaConfig = fsdp::hf::CausalLmConfig;

// x * rsqrt(mean(x^2) + eps) in float32, cast back, times the weight.
struct RmsNormImpl : torch::nn::Module {
  RmsNormImpl(int64_t size, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps;
};
TORCH_MODULE(RmsNorm);

// The inverse frequencies of the rotary embedding, [head_dim / 2] float32,
// as transformers computes them (default or llama3 rope).
at::Tensor RotaryInverseFrequencies(const LlamaConfig& config);

// cos and sin tables [t, head_dim] (positions 0..t-1) in `dtype`.
std::pair<at::Tensor, at::Tensor> RotaryTables(const at::Tensor& inv_freq, int64_t t,
                                               at::ScalarType dtype);

// Additive causal mask [t, t]: 0 on and below the diagonal, -inf above
// (and beyond the sliding window, when there is one).
at::Tensor CausalMask(int64_t t, std::optional<int64_t> sliding_window,
                      const at::TensorOptions& options);

struct LlamaAttentionImpl : torch::nn::Module {
  explicit LlamaAttentionImpl(const LlamaConfig& config);
  // x: [b, t, hidden]; cos, sin: [t, head_dim]; mask: [t, t] additive, or
  // none (every position sees every other).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::optional<at::Tensor>& mask);
  int64_t heads, kv_heads, head_dim;
  // LoraLinear: models/lora.h can put adapters on them.
  LoraLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RmsNorm q_norm{nullptr}, k_norm{nullptr};  // qwen3 only.
};
TORCH_MODULE(LlamaAttention);

struct LlamaMlpImpl : torch::nn::Module {
  explicit LlamaMlpImpl(const LlamaConfig& config);
  at::Tensor forward(const at::Tensor& x);
  LoraLinear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMlp);

// A plain module: FSDP reaches it through fsdp::UnitModule.
struct LlamaDecoderLayerImpl : torch::nn::Module {
  explicit LlamaDecoderLayerImpl(const LlamaConfig& config);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::optional<at::Tensor>& mask);
  RmsNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  LlamaAttention self_attn{nullptr};
  LlamaMlp mlp{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

using LlamaLayer = fsdp::UnitModule<LlamaDecoderLayerImpl>;

// transformers' LlamaModel: embeddings, layers, final norm.
// `defer_allocation`: see CausalLmImpl.
struct LlamaModelImpl : torch::nn::Module {
  explicit LlamaModelImpl(const LlamaConfig& config, bool defer_allocation = false);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};  // Of LlamaLayer.
  std::vector<LlamaLayer> layer_list;     // The same, typed.
  RmsNorm norm{nullptr};
};
TORCH_MODULE(LlamaModel);

// The output projection: its own weight, or (tied) the embedding's.
struct LmHeadImpl : torch::nn::Module {
  explicit LmHeadImpl(at::Tensor weight);
  at::Tensor forward(const at::Tensor& x) const;
  at::Tensor weight;
};
TORCH_MODULE(LmHead);

// transformers' *ForCausalLM. Parameters are initialized as transformers
// does (normal(0, 0.02) for linears and embeddings, ones for norms, zero
// biases) from `seed`, the same on every rank; a checkpoint usually
// replaces them.
//
// `defer_allocation`: for a model whose weights all come from a checkpoint.
// Each layer's memory is released (fsdp::DeferParameterAllocation) as soon
// as it is built, so that no rank ever holds the whole model: Wrap gives
// the parameters memory one unit at a time through
// FsdpOptions::param_init_fn (ZeroParameters below will do), and the
// checkpoint their values. Not initialized from `seed`; not usable before
// Wrap.
struct CausalLmImpl : torch::nn::Module, fsdp::ShardableModule {
  explicit CausalLmImpl(const LlamaConfig& config, uint64_t seed = 0,
                        bool defer_allocation = false);
  // input_ids: [b, t] int64. Returns logits [b, t, vocab_size] (in the
  // parameters' dtype).
  at::Tensor forward(const at::Tensor& input_ids);
  LlamaConfig config;
  LlamaModel model{nullptr};
  LmHead lm_head{nullptr};
  at::Tensor inv_freq;  // Not a parameter or buffer: not in checkpoints.
};
TORCH_MODULE(CausalLm);

// An FsdpOptions::param_init_fn for weights a checkpoint will replace:
// zeroes `module`'s own parameters and buffers (a buffer the checkpoint
// does not hold stays zero; the Llama family has none).
void ZeroParameters(torch::nn::Module& module);

// transformers' ForCausalLMLoss: mean cross-entropy (in float32) of logits
// [b, t, V] at position i against labels[i + 1], labels equal to -100
// ignored; the last position predicts nothing.
at::Tensor CausalLmLoss(const at::Tensor& logits, const at::Tensor& labels);

}  // namespace models

#endif  // FSDP_MODELS_LLAMA_H_
