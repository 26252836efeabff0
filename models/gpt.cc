#include "models/gpt.h"

#include <cmath>
#include <limits>

#include "ATen/ATen.h"
#include "ATen/CPUGeneratorImpl.h"
#include "c10/util/Exception.h"
#include "fsdp/unit_forward.h"
#include "torch/version.h"

namespace models {

namespace {

// nanoGPT's nn.Dropout: active in training mode only.
at::Tensor Dropout(const at::Tensor& x, double p, bool training) {
  return p > 0.0 && training ? at::dropout(x, p, /*train=*/true) : x;
}

}  // namespace

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GptConfig& config)
    : n_head(config.n_head), dropout_(config.dropout) {
  TORCH_CHECK(config.n_embd % config.n_head == 0, "GptConfig: n_embd ", config.n_embd,
              " is not a multiple of n_head ", config.n_head);
  c_attn = register_module("c_attn", torch::nn::Linear(config.n_embd, 3 * config.n_embd));
  c_proj = register_module("c_proj", torch::nn::Linear(config.n_embd, config.n_embd));
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), c = x.size(2), hs = c / n_head;
  auto qkv = c_attn->forward(x).split(c, /*dim=*/2);
  auto heads = [&](const at::Tensor& z) { return z.view({b, t, n_head, hs}).transpose(1, 2); };
  at::Tensor y = Attend(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]));
  return Dropout(c_proj->forward(y.transpose(1, 2).contiguous().view({b, t, c})), dropout_,
                 is_training());
}

at::Tensor CausalSelfAttentionImpl::Attend(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{},
                                          /*dropout_p=*/is_training() ? dropout_ : 0.0,
                                          /*is_causal=*/true);
#else
  const int64_t t = q.size(2);
  if (!causal_mask_.defined() || causal_mask_.size(0) != t ||
      causal_mask_.device() != q.device()) {
    causal_mask_ = at::ones({t, t}, q.options().dtype(at::kBool)).tril().logical_not();
  }
  at::Tensor att = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  att = att.masked_fill(causal_mask_, -std::numeric_limits<float>::infinity()).softmax(-1);
  return at::matmul(Dropout(att, dropout_, is_training()), v);
#endif
}

MlpImpl::MlpImpl(const GptConfig& config) : dropout_(config.dropout) {
  c_fc = register_module("c_fc", torch::nn::Linear(config.n_embd, 4 * config.n_embd));
  c_proj = register_module("c_proj", torch::nn::Linear(4 * config.n_embd, config.n_embd));
}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  // Exact (erf) GELU.
  return Dropout(c_proj->forward(at::gelu(c_fc->forward(x))), dropout_, is_training());
}

BlockImpl::BlockImpl(const GptConfig& config) {
  ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.n_embd})));
  attn = register_module("attn", CausalSelfAttention(config));
  ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.n_embd})));
  mlp = register_module("mlp", Mlp(config));
}

at::Tensor BlockImpl::forward(at::Tensor x) {
  fsdp::UnitForward unit(this);
  return unit.Return(fsdp::CheckpointedForward(*this, x, [this](at::Tensor x) {
    x = x + attn->forward(ln_1->forward(x));
    return x + mlp->forward(ln_2->forward(x));
  }));
}

TransformerImpl::TransformerImpl(const GptConfig& config) {
  wte = register_module("wte", torch::nn::Embedding(config.vocab_size, config.n_embd));
  wpe = register_module("wpe", torch::nn::Embedding(config.block_size, config.n_embd));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.n_layer; ++i) h->push_back(Block(config));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.n_embd})));
}

TiedLinearImpl::TiedLinearImpl(const at::Tensor& tied) {
  weight = register_parameter("weight", tied);
}

at::Tensor TiedLinearImpl::forward(const at::Tensor& x) const { return at::linear(x, weight); }

GptImpl::GptImpl(const GptConfig& config) : config(config) {
  transformer = register_module("transformer", Transformer(config));
  lm_head = register_module("lm_head", TiedLinear(transformer->wte->weight));
  // nanoGPT's initialization, from a generator of our own so that every rank
  // (or rank thread) builds the same model from the same seed.
  at::Generator gen = at::detail::createCPUGenerator(config.seed);
  at::NoGradGuard no_grad;
  const double proj_std = 0.02 / std::sqrt(2.0 * config.n_layer);
  for (const auto& item : named_parameters()) {
    const std::string& name = item.key();
    at::Tensor p = item.value();
    if (name == "lm_head.weight") continue;  // Tied to transformer.wte.weight.
    if (name.find("ln_") != std::string::npos) {
      p.fill_(name.size() >= 6 && name.compare(name.size() - 6, 6, "weight") == 0 ? 1.0 : 0.0);
    } else if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) {
      p.zero_();
    } else if (name.size() >= 13 && name.compare(name.size() - 13, 13, "c_proj.weight") == 0) {
      p.normal_(0.0, proj_std, gen);
    } else {
      p.normal_(0.0, 0.02, gen);
    }
  }
}

at::Tensor GptImpl::forward(const at::Tensor& idx) {
  fsdp::UnitForward unit(this);
  const int64_t t = idx.size(1);
  TORCH_CHECK(t <= config.block_size, "Gpt: sequence length ", t, " exceeds block_size ",
              config.block_size);
  at::Tensor pos = at::arange(t, idx.options().dtype(at::kLong));
  at::Tensor x = Dropout(transformer->wte->forward(idx) + transformer->wpe->forward(pos),
                         config.dropout, is_training());
  for (const auto& block : *transformer->h) x = block->as<BlockImpl>()->forward(x);
  x = transformer->ln_f->forward(x);
  return unit.Return(lm_head->forward(x));
}

at::Tensor LanguageModelLoss(const at::Tensor& logits, const at::Tensor& targets) {
  // In float32 whatever the model computed in (mixed precision).
  return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, logits.size(-1)}),
                                targets.reshape({-1}));
}

}  // namespace models
