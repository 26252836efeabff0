// A GPT-2 style decoder language model with nanoGPT's module layout and
// parameter names (transformer.wte, transformer.wpe, transformer.h.{i}.ln_1,
// .attn.c_attn, .attn.c_proj, .ln_2, .mlp.c_fc, .mlp.c_proj,
// transformer.ln_f, lm_head tied to transformer.wte), exact (erf) GELU,
// LayerNorm with bias, dropout as configured (none by default).
//
// FSDP-ready: Block and Gpt are fsdp::ShardableModule and open a
// fsdp::UnitForward scope in forward — the only FSDP lines in the model; the
// scopes do nothing when the model is not wrapped. Block is also an
// fsdp::CheckpointableModule: its math runs through CheckpointedForward, so
// fsdp::ApplyActivationCheckpointing(model, *ModuleTypePolicy::Of<BlockImpl>())
// recomputes each block's activations in backward. Wrap per block with the
// same policy, *fsdp::ModuleTypePolicy::Of<models::BlockImpl>(); the
// embeddings, the final LayerNorm and the tied head stay with the root.
#ifndef FSDP_MODELS_GPT_H_
#define FSDP_MODELS_GPT_H_

#include <cstdint>

#include "ATen/core/Tensor.h"
#include "fsdp/activation_checkpointing.h"
#include "fsdp/fully_shard.h"
#include "torch/nn/module.h"
#include "torch/nn/modules/container/modulelist.h"
#include "torch/nn/modules/embedding.h"
#include "torch/nn/modules/linear.h"
#include "torch/nn/modules/normalization.h"

namespace models {

struct GptConfig {
  int64_t vocab_size = 256;  // Bytes.
  int64_t block_size = 64;   // Context length.
  int64_t n_layer = 2;
  int64_t n_head = 2;
  int64_t n_embd = 64;
  uint64_t seed = 0;  // Initialization (nanoGPT's: N(0, 0.02), scaled c_proj).
  // nanoGPT's dropout, in training mode: after the embeddings, on the
  // attention weights, and after each block's two projections. Draws from
  // the default generator of the activations' device.
  double dropout = 0.0;
};

// Attention through libtorch 2.x's fused scaled_dot_product_attention
// (flash or memory-efficient kernels on GPUs), which never materializes
// the [t, t] attention matrix; libtorch 1.x, which has none, computes it
// eagerly with a causal mask kept between forwards.
struct CausalSelfAttentionImpl : torch::nn::Module {
  explicit CausalSelfAttentionImpl(const GptConfig& config);
  at::Tensor forward(const at::Tensor& x);
  int64_t n_head;
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};

 private:
  at::Tensor Attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
  double dropout_;
  at::Tensor causal_mask_;  // Eager path: true above the diagonal; rebuilt when t or device change.
};
TORCH_MODULE(CausalSelfAttention);

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const GptConfig& config);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear c_fc{nullptr}, c_proj{nullptr};

 private:
  double dropout_;
};
TORCH_MODULE(Mlp);

struct BlockImpl : torch::nn::Module, fsdp::ShardableModule, fsdp::CheckpointableModule {
  explicit BlockImpl(const GptConfig& config);
  at::Tensor forward(at::Tensor x);
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(Block);

// nanoGPT's `transformer` ModuleDict.
struct TransformerImpl : torch::nn::Module {
  explicit TransformerImpl(const GptConfig& config);
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(Transformer);

// The output projection, whose weight is the token embedding's.
struct TiedLinearImpl : torch::nn::Module {
  explicit TiedLinearImpl(const at::Tensor& weight);
  at::Tensor forward(const at::Tensor& x) const;
  at::Tensor weight;
};
TORCH_MODULE(TiedLinear);

struct GptImpl : torch::nn::Module, fsdp::ShardableModule {
  explicit GptImpl(const GptConfig& config);
  // idx: [batch, time] int64 token ids, time <= block_size. Returns logits
  // [batch, time, vocab_size].
  at::Tensor forward(const at::Tensor& idx);
  GptConfig config;
  Transformer transformer{nullptr};
  TiedLinear lm_head{nullptr};
};
TORCH_MODULE(Gpt);

// Mean next-token cross-entropy of logits [B, T, V] against targets [B, T].
at::Tensor LanguageModelLoss(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace models

#endif  // FSDP_MODELS_GPT_H_
