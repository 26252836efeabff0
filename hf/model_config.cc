#include "hf/model_config.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace fsdp::hf {
namespace {

using json = nlohmann::json;

absl::Status Invalid(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: field '", field, "' ", what));
}

bool Present(const json& object, const std::string& field) {
  return object.contains(field) && !object.at(field).is_null();
}

// A positive integer; `fallback` when absent (nullopt: required).
absl::StatusOr<int64_t> PositiveInt(const json& object, const std::string& field,
                                    std::optional<int64_t> fallback = std::nullopt) {
  if (!Present(object, field)) {
    if (fallback.has_value()) return *fallback;
    return Invalid(field, "is missing");
  }
  const json& value = object.at(field);
  if (!value.is_number_integer()) return Invalid(field, "is not an integer");
  const int64_t n = value.get<int64_t>();
  if (n <= 0) return Invalid(field, absl::StrCat("is ", n, ", not positive"));
  return n;
}

absl::StatusOr<double> PositiveNumber(const json& object, const std::string& field,
                                      std::optional<double> fallback = std::nullopt) {
  if (!Present(object, field)) {
    if (fallback.has_value()) return *fallback;
    return Invalid(field, "is missing");
  }
  const json& value = object.at(field);
  if (!value.is_number()) return Invalid(field, "is not a number");
  const double x = value.get<double>();
  if (!(x > 0)) return Invalid(field, absl::StrCat("is ", x, ", not positive"));
  return x;
}

absl::StatusOr<bool> Bool(const json& object, const std::string& field, bool fallback) {
  if (!Present(object, field)) return fallback;
  if (!object.at(field).is_boolean()) return Invalid(field, "is not true or false");
  return object.at(field).get<bool>();
}

absl::StatusOr<std::string> String(const json& object, const std::string& field,
                                   const std::string& fallback) {
  if (!Present(object, field)) return fallback;
  if (!object.at(field).is_string()) return Invalid(field, "is not a string");
  return object.at(field).get<std::string>();
}

absl::StatusOr<Llama3RopeScaling> ParseLlama3(const json& root, const json& rope,
                                              const std::string& where) {
  Llama3RopeScaling s;
  FSDP_ASSIGN_OR_RETURN(s.factor, PositiveNumber(rope, "factor"));
  FSDP_ASSIGN_OR_RETURN(s.low_freq_factor, PositiveNumber(rope, "low_freq_factor"));
  FSDP_ASSIGN_OR_RETURN(s.high_freq_factor, PositiveNumber(rope, "high_freq_factor"));
  // transformers falls back to max_position_embeddings.
  std::optional<int64_t> context;
  if (!Present(rope, "original_max_position_embeddings")) {
    FSDP_ASSIGN_OR_RETURN(context, PositiveInt(root, "max_position_embeddings"));
  }
  FSDP_ASSIGN_OR_RETURN(s.original_max_position_embeddings,
                        PositiveInt(rope, "original_max_position_embeddings", context));
  if (s.high_freq_factor <= s.low_freq_factor) {
    return Invalid(where + ".high_freq_factor", "is not above low_freq_factor");
  }
  return s;
}

// rope_theta and rope_scaling (transformers 4.x) or rope_parameters (5.x:
// {"rope_type": ..., "rope_theta": ..., and the type's own fields}).
absl::Status ParseRope(const json& root, CausalLmConfig& config) {
  std::string where = "rope_scaling";
  const json* rope = nullptr;
  if (Present(root, "rope_parameters")) {
    where = "rope_parameters";
    rope = &root.at("rope_parameters");
    if (!rope->is_object()) return Invalid(where, "is not an object");
    // Required (transformers 5 writes it there): one absent, as in a
    // per-layer-type dict ({"full_attention": {...}, ...}), is not
    // guessed.
    if (Present(*rope, "rope_theta")) {
      FSDP_ASSIGN_OR_RETURN(config.rope_theta, PositiveNumber(*rope, "rope_theta"));
    } else if (Present(root, "rope_theta")) {
      FSDP_ASSIGN_OR_RETURN(config.rope_theta, PositiveNumber(root, "rope_theta"));
    } else {
      return Invalid("rope_parameters.rope_theta", "is missing");
    }
  } else {
    FSDP_ASSIGN_OR_RETURN(config.rope_theta, PositiveNumber(root, "rope_theta", 10000.0));
    if (Present(root, "rope_scaling")) {
      rope = &root.at("rope_scaling");
      if (!rope->is_object()) return Invalid(where, "is not an object or null");
    }
  }
  for (const json* holder : {&root, rope}) {
    if (holder == nullptr) continue;
    FSDP_ASSIGN_OR_RETURN(double partial, PositiveNumber(*holder, "partial_rotary_factor", 1.0));
    if (partial != 1.0) {
      return absl::UnimplementedError(
          "config.json: field 'partial_rotary_factor' is not 1: partial rotary embeddings are "
          "not supported");
    }
  }
  if (rope == nullptr) return absl::OkStatus();
  // transformers reads "rope_type", and "type" from older configs.
  FSDP_ASSIGN_OR_RETURN(std::string type, String(*rope, "rope_type", ""));
  if (type.empty()) {
    FSDP_ASSIGN_OR_RETURN(type, String(*rope, "type", "default"));
  }
  if (type == "default") return absl::OkStatus();
  if (type != "llama3") {
    return absl::UnimplementedError(absl::StrCat("config.json: ", where, ".rope_type '", type,
                                                 "' is not supported (only default and llama3)"));
  }
  FSDP_ASSIGN_OR_RETURN(config.rope_scaling, ParseLlama3(root, *rope, where));
  return absl::OkStatus();
}

absl::Status ParseSizes(const json& root, CausalLmConfig& c) {
  FSDP_ASSIGN_OR_RETURN(c.vocab_size, PositiveInt(root, "vocab_size"));
  FSDP_ASSIGN_OR_RETURN(c.hidden_size, PositiveInt(root, "hidden_size"));
  FSDP_ASSIGN_OR_RETURN(c.intermediate_size, PositiveInt(root, "intermediate_size"));
  FSDP_ASSIGN_OR_RETURN(c.num_hidden_layers, PositiveInt(root, "num_hidden_layers"));
  FSDP_ASSIGN_OR_RETURN(c.num_attention_heads, PositiveInt(root, "num_attention_heads"));
  // LlamaConfig's absent num_key_value_heads means one per head; the other
  // types' defaults are fixed numbers (Mistral's and Qwen3's 8), which a
  // hand-written config rarely means: required there.
  FSDP_ASSIGN_OR_RETURN(
      c.num_key_value_heads,
      PositiveInt(root, "num_key_value_heads",
                  c.model_type == "llama" ? std::optional<int64_t>(c.num_attention_heads)
                                          : std::nullopt));
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return Invalid("num_key_value_heads",
                   absl::StrCat("(", c.num_key_value_heads, ") does not divide num_attention_heads (",
                                c.num_attention_heads, ")"));
  }
  // Qwen3's head_dim is independent of hidden_size (its default, 128, is
  // not hidden / heads): required there.
  std::optional<int64_t> head_dim;
  if (c.model_type != "qwen3") {
    if (c.hidden_size % c.num_attention_heads != 0 && !Present(root, "head_dim")) {
      return Invalid("num_attention_heads", "does not divide hidden_size and head_dim is missing");
    }
    head_dim = c.hidden_size / c.num_attention_heads;
  }
  FSDP_ASSIGN_OR_RETURN(c.head_dim, PositiveInt(root, "head_dim", head_dim));
  if (c.head_dim % 2 != 0) return Invalid("head_dim", "is odd (rotary embeddings pair halves)");
  FSDP_ASSIGN_OR_RETURN(c.rms_norm_eps, PositiveNumber(root, "rms_norm_eps", 1e-6));
  return absl::OkStatus();
}

// Biases, norms and windows: what differs between the model types.
absl::Status ParseVariant(const json& root, CausalLmConfig& c) {
  FSDP_ASSIGN_OR_RETURN(bool attention_bias, Bool(root, "attention_bias", false));
  c.qkv_bias = attention_bias || c.model_type == "qwen2";
  c.o_bias = attention_bias && c.model_type != "qwen2";
  if (c.model_type == "llama") {
    FSDP_ASSIGN_OR_RETURN(c.mlp_bias, Bool(root, "mlp_bias", false));
  }
  c.qk_norm = c.model_type == "qwen3";
  if (c.model_type == "qwen2" || c.model_type == "qwen3") {
    FSDP_ASSIGN_OR_RETURN(bool sliding, Bool(root, "use_sliding_window", false));
    if (sliding) {
      return absl::UnimplementedError(
          "config.json: field 'use_sliding_window' is true: sliding-window attention is not "
          "supported");
    }
    // transformers 5's per-layer attention kinds: only full attention.
    if (Present(root, "layer_types")) {
      const json& types = root.at("layer_types");
      if (!types.is_array()) return Invalid("layer_types", "is not a list");
      for (const json& type : types) {
        if (type != "full_attention") {
          return absl::UnimplementedError(absl::StrCat(
              "config.json: field 'layer_types' has ", type.dump(),
              "; only full_attention layers are supported"));
        }
      }
    }
  }
  // MistralConfig's window when the field is absent is 4096; null is none.
  if (c.model_type == "mistral" && (Present(root, "sliding_window") ||
                                    !root.contains("sliding_window"))) {
    FSDP_ASSIGN_OR_RETURN(c.sliding_window, PositiveInt(root, "sliding_window", 4096));
  }
  return absl::OkStatus();
}

absl::StatusOr<CausalLmConfig> ParseJson(const json& root) {
  if (!root.is_object()) return absl::InvalidArgumentError("config.json: not a JSON object");
  CausalLmConfig c;
  FSDP_ASSIGN_OR_RETURN(c.model_type, String(root, "model_type", ""));
  if (c.model_type.empty()) return Invalid("model_type", "is missing");
  if (c.model_type != "llama" && c.model_type != "mistral" && c.model_type != "qwen2" &&
      c.model_type != "qwen3") {
    return absl::UnimplementedError(absl::StrCat("config.json: model_type '", c.model_type,
                                                 "' is not supported (llama, mistral, qwen2, "
                                                 "qwen3)"));
  }
  FSDP_ASSIGN_OR_RETURN(std::string act, String(root, "hidden_act", "silu"));
  if (act != "silu") {
    return absl::UnimplementedError(
        absl::StrCat("config.json: field 'hidden_act' is '", act, "'; only silu is supported"));
  }
  FSDP_RETURN_IF_ERROR(ParseSizes(root, c));
  FSDP_RETURN_IF_ERROR(ParseRope(root, c));
  FSDP_RETURN_IF_ERROR(ParseVariant(root, c));
  FSDP_ASSIGN_OR_RETURN(c.tie_word_embeddings, Bool(root, "tie_word_embeddings", false));
  return c;
}

}  // namespace

absl::StatusOr<CausalLmConfig> ParseCausalLmConfig(const std::string& json_text) {
  json root = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return absl::InvalidArgumentError("config.json: not valid JSON");
  return ParseJson(root);
}

absl::StatusOr<CausalLmConfig> ReadCausalLmConfig(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<CausalLmConfig> config = ParseCausalLmConfig(text.str());
  if (!config.ok()) {
    return absl::Status(config.status().code(), absl::StrCat(path, ": ", config.status().message()));
  }
  return config;
}

}  // namespace fsdp::hf
