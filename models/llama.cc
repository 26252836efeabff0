#include "models/llama.h"

#include <cmath>
#include <limits>
#include <string>

#include "ATen/ATen.h"
#include "ATen/CPUGeneratorImpl.h"
#include "c10/util/Exception.h"
#include "fsdp/unit_forward.h"

namespace models {
namespace {

// Uninitialized: CausalLm's own initialization or a deferred model's
// param_init_fn and checkpoint fill every projection.
LoraLinear MakeLinear(int64_t in, int64_t out, bool bias) {
  return LoraLinear(in, out, bias, /*initialize=*/false);
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// transformers' rotate_half: (x1, x2) -> (-x2, x1) over the last dimension's halves.
at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// transformers' repeat_kv: [b, kv, t, d] -> [b, kv * rep, t, d].
at::Tensor RepeatKv(const at::Tensor& x, int64_t rep) {
  if (rep == 1) return x;
  const int64_t b = x.size(0), kv = x.size(1), t = x.size(2), d = x.size(3);
  return x.unsqueeze(2).expand({b, kv, rep, t, d}).reshape({b, kv * rep, t, d});
}

}  // namespace

RmsNormImpl::RmsNormImpl(int64_t size, double eps) : eps(eps) {
  weight = register_parameter("weight", at::ones({size}));
}

at::Tensor RmsNormImpl::forward(const at::Tensor& x) {
  at::Tensor h = x.to(at::kFloat);
  at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  return weight * h.to(x.scalar_type());
}

at::Tensor RotaryInverseFrequencies(const LlamaConfig& config) {
  const int64_t dim = config.head_dim;
  at::Tensor inv_freq =
      1.0 / at::pow(config.rope_theta, at::arange(0, dim, 2, at::kLong).to(at::kFloat) / dim);
  if (!config.rope_scaling.has_value()) return inv_freq;
  // transformers' _compute_llama3_parameters, step by step.
  const fsdp::hf::Llama3RopeScaling& s = *config.rope_scaling;
  const double old_context = static_cast<double>(s.original_max_position_embeddings);
  const double low_freq_wavelen = old_context / s.low_freq_factor;
  const double high_freq_wavelen = old_context / s.high_freq_factor;
  const double pi = 3.141592653589793;  // Python's math.pi.
  at::Tensor wavelen = 2 * pi / inv_freq;
  at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
  at::Tensor smooth =
      (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  at::Tensor smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
  at::Tensor medium = (wavelen < high_freq_wavelen).logical_not() *
                      (wavelen > low_freq_wavelen).logical_not();
  return at::where(medium, smoothed, scaled);
}

std::pair<at::Tensor, at::Tensor> RotaryTables(const at::Tensor& inv_freq, int64_t t,
                                               at::ScalarType dtype) {
  at::Tensor positions = at::arange(t, inv_freq.options().dtype(at::kLong)).to(at::kFloat);
  at::Tensor freqs = at::outer(positions, inv_freq.to(at::kFloat));
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

at::Tensor CausalMask(int64_t t, std::optional<int64_t> sliding_window,
                      const at::TensorOptions& options) {
  at::Tensor ones = at::ones({t, t}, options.dtype(at::kBool));
  at::Tensor hidden = ones.triu(1);  // Key after the query.
  if (sliding_window.has_value()) {
    // Mistral: a key at or before query - window is out of reach.
    hidden = hidden.logical_or(ones.tril(-*sliding_window));
  }
  return at::zeros({t, t}, options)
      .masked_fill(hidden, -std::numeric_limits<double>::infinity());
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& config)
    : heads(config.num_attention_heads),
      kv_heads(config.num_key_value_heads),
      head_dim(config.head_dim) {
  const int64_t h = config.hidden_size;
  q_proj = register_module("q_proj", MakeLinear(h, heads * head_dim, config.qkv_bias));
  k_proj = register_module("k_proj", MakeLinear(h, kv_heads * head_dim, config.qkv_bias));
  v_proj = register_module("v_proj", MakeLinear(h, kv_heads * head_dim, config.qkv_bias));
  o_proj = register_module("o_proj", MakeLinear(heads * head_dim, h, config.o_bias));
  if (config.qk_norm) {
    q_norm = register_module("q_norm", RmsNorm(head_dim, config.rms_norm_eps));
    k_norm = register_module("k_norm", RmsNorm(head_dim, config.rms_norm_eps));
  }
}

// transformers' eager_attention_forward (no dropout).
at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos,
                                       const at::Tensor& sin,
                                       const std::optional<at::Tensor>& mask) {
  const int64_t b = x.size(0), t = x.size(1);
  at::Tensor q = q_proj->forward(x).view({b, t, heads, head_dim});
  at::Tensor k = k_proj->forward(x).view({b, t, kv_heads, head_dim});
  at::Tensor v = v_proj->forward(x).view({b, t, kv_heads, head_dim}).transpose(1, 2);
  if (q_norm) {
    q = q_norm->forward(q);
    k = k_norm->forward(k);
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  q = q * cos + RotateHalf(q) * sin;
  k = k * cos + RotateHalf(k) * sin;
  k = RepeatKv(k, heads / kv_heads);
  v = RepeatKv(v, heads / kv_heads);
  at::Tensor weights = at::matmul(q, k.transpose(2, 3)) * std::pow(head_dim, -0.5);
  if (mask.has_value() && mask->defined()) weights = weights + *mask;
  weights = at::softmax(weights, -1, at::kFloat).to(q.scalar_type());
  at::Tensor out = at::matmul(weights, v).transpose(1, 2).contiguous();
  return o_proj->forward(out.reshape({b, t, heads * head_dim}));
}

LlamaMlpImpl::LlamaMlpImpl(const LlamaConfig& config) {
  const int64_t h = config.hidden_size, m = config.intermediate_size;
  gate_proj = register_module("gate_proj", MakeLinear(h, m, config.mlp_bias));
  up_proj = register_module("up_proj", MakeLinear(h, m, config.mlp_bias));
  down_proj = register_module("down_proj", MakeLinear(m, h, config.mlp_bias));
}

at::Tensor LlamaMlpImpl::forward(const at::Tensor& x) {
  return down_proj->forward(at::silu(gate_proj->forward(x)) * up_proj->forward(x));
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& config) {
  self_attn = register_module("self_attn", LlamaAttention(config));
  mlp = register_module("mlp", LlamaMlp(config));
  input_layernorm =
      register_module("input_layernorm", RmsNorm(config.hidden_size, config.rms_norm_eps));
  post_attention_layernorm = register_module(
      "post_attention_layernorm", RmsNorm(config.hidden_size, config.rms_norm_eps));
}

at::Tensor LlamaDecoderLayerImpl::forward(const at::Tensor& x, const at::Tensor& cos,
                                          const at::Tensor& sin,
                                          const std::optional<at::Tensor>& mask) {
  at::Tensor h = x + self_attn->forward(input_layernorm->forward(x), cos, sin, mask);
  return h + mlp->forward(post_attention_layernorm->forward(h));
}

namespace {

// Releases `module`'s memory right after it is built (defer_allocation).
void Defer(torch::nn::Module& module) {
  const absl::Status deferred = fsdp::DeferParameterAllocation(module);
  TORCH_CHECK(deferred.ok(), "CausalLm: ", std::string(deferred.message()));
}

}  // namespace

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& config, bool defer_allocation) {
  embed_tokens =
      register_module("embed_tokens", torch::nn::Embedding(config.vocab_size, config.hidden_size));
  if (defer_allocation) Defer(*embed_tokens);
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    layer_list.push_back(LlamaLayer{LlamaDecoderLayer(config)});
    if (defer_allocation) Defer(*layer_list.back());
    layers->push_back(layer_list.back());
  }
  norm = register_module("norm", RmsNorm(config.hidden_size, config.rms_norm_eps));
  if (defer_allocation) Defer(*norm);
}

LmHeadImpl::LmHeadImpl(at::Tensor tensor) { weight = register_parameter("weight", tensor); }

at::Tensor LmHeadImpl::forward(const at::Tensor& x) const { return at::linear(x, weight); }

CausalLmImpl::CausalLmImpl(const LlamaConfig& config, uint64_t seed, bool defer_allocation)
    : config(config) {
  model = register_module("model", LlamaModel(config, defer_allocation));
  at::Tensor head = config.tie_word_embeddings ? model->embed_tokens->weight
                                               : at::empty({config.vocab_size, config.hidden_size});
  lm_head = register_module("lm_head", LmHead(head));
  inv_freq = RotaryInverseFrequencies(config);
  if (defer_allocation) {
    if (!config.tie_word_embeddings) Defer(*lm_head);
    return;
  }
  // transformers' _init_weights, from a generator of our own so that every
  // rank builds the same model.
  at::Generator gen = at::detail::createCPUGenerator(seed);
  at::NoGradGuard no_grad;
  for (const auto& item : named_parameters()) {
    const std::string& name = item.key();
    at::Tensor p = item.value();
    if (name == "lm_head.weight" && config.tie_word_embeddings) continue;
    if (EndsWith(name, "norm.weight")) {
      p.fill_(1.0);
    } else if (EndsWith(name, ".bias")) {
      p.zero_();
    } else {
      p.normal_(0.0, 0.02, gen);
    }
  }
}

void ZeroParameters(torch::nn::Module& module) {
  at::NoGradGuard no_grad;
  for (at::Tensor& p : module.parameters(/*recurse=*/false)) p.zero_();
  for (at::Tensor& b : module.buffers(/*recurse=*/false)) b.zero_();
}

at::Tensor CausalLmImpl::forward(const at::Tensor& input_ids) {
  fsdp::UnitForward unit(this);
  TORCH_CHECK(input_ids.dim() == 2, "CausalLm: input_ids must be [batch, time], got ",
              input_ids.sizes());
  const int64_t t = input_ids.size(1);
  at::Tensor h = model->embed_tokens->forward(input_ids);
  auto [cos, sin] = RotaryTables(inv_freq.to(h.device()), t, h.scalar_type());
  std::optional<at::Tensor> mask = CausalMask(t, config.sliding_window, h.options());
  for (LlamaLayer& layer : model->layer_list) h = layer->forward(h, cos, sin, mask);
  return unit.Return(lm_head->forward(model->norm->forward(h)));
}

at::Tensor CausalLmLoss(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t t = logits.size(1);
  TORCH_CHECK(t >= 2, "CausalLmLoss: needs at least 2 positions, got ", t);
  at::Tensor shifted = logits.narrow(1, 0, t - 1).to(at::kFloat);
  at::Tensor targets = labels.narrow(1, 1, t - 1);
  return at::cross_entropy_loss(shifted.reshape({-1, shifted.size(-1)}), targets.reshape({-1}),
                                /*weight=*/{}, at::Reduction::Mean, /*ignore_index=*/-100);
}

}  // namespace models
