#include "hf/model_config.h"

#include <string>

#include <nlohmann/json.hpp>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp::hf {
namespace {

using ::testing::HasSubstr;

const char kLlama[] = R"({
  "model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": true,
  "rope_theta": 500000.0,
  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})";

// `text` with `field` (of rope_scaling for "factor") set to `value`, a
// JSON text; null removes the field.
std::string With(const std::string& text, const std::string& field, const std::string& value) {
  nlohmann::json root = nlohmann::json::parse(text);
  nlohmann::json& object = field == "factor" ? root["rope_scaling"] : root;
  nlohmann::json parsed = nlohmann::json::parse(value);
  if (parsed.is_null()) {
    object.erase(field);
  } else {
    object[field] = parsed;
  }
  return root.dump();
}

std::string ErrorOf(const std::string& json) {
  absl::StatusOr<CausalLmConfig> config = ParseCausalLmConfig(json);
  return config.ok() ? "ok" : std::string(config.status().message());
}

TEST(CausalLmConfig, ReadsTransformers4Fields) {
  absl::StatusOr<CausalLmConfig> config = ParseCausalLmConfig(kLlama);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->head_dim, 16);
  EXPECT_EQ(config->num_key_value_heads, 2);
  EXPECT_DOUBLE_EQ(config->rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(config->rope_theta, 500000.0);
  ASSERT_TRUE(config->rope_scaling.has_value());
  EXPECT_EQ(config->rope_scaling->original_max_position_embeddings, 8192);
  EXPECT_TRUE(config->tie_word_embeddings);
  EXPECT_FALSE(config->qkv_bias);
  EXPECT_FALSE(config->qk_norm);
}

TEST(CausalLmConfig, ReadsTransformers5RopeParameters) {
  absl::StatusOr<CausalLmConfig> config = ParseCausalLmConfig(R"({
    "model_type": "qwen3", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
    "head_dim": 32, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}})");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_DOUBLE_EQ(config->rope_theta, 1000000.0);
  EXPECT_FALSE(config->rope_scaling.has_value());
  EXPECT_EQ(config->head_dim, 32);
  EXPECT_EQ(config->num_key_value_heads, 4);
  EXPECT_TRUE(config->qk_norm);
  EXPECT_FALSE(config->tie_word_embeddings);
}

// Where transformers' default for an absent field is not what a reader
// would guess: Mistral's window is 4096 (null: none), and only Llama's
// num_key_value_heads defaults to one per head.
TEST(CausalLmConfig, AbsentFieldsFollowTransformersOrAreRequired) {
  const std::string mistral = With(kLlama, "model_type", "\"mistral\"");
  absl::StatusOr<CausalLmConfig> config = ParseCausalLmConfig(mistral);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->sliding_window, 4096);
  nlohmann::json no_window = nlohmann::json::parse(mistral);
  no_window["sliding_window"] = nullptr;
  config = ParseCausalLmConfig(no_window.dump());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->sliding_window.has_value());
  config = ParseCausalLmConfig(With(mistral, "sliding_window", "16"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->sliding_window, 16);
  EXPECT_THAT(ErrorOf(With(With(kLlama, "model_type", "\"qwen2\""), "num_key_value_heads",
                           "null")),
              HasSubstr("'num_key_value_heads' is missing"));
  config = ParseCausalLmConfig(With(kLlama, "num_key_value_heads", "null"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->num_key_value_heads, 4);
}

TEST(CausalLmConfig, Qwen2HasQkvBiasesButNoOutputBias) {
  absl::StatusOr<CausalLmConfig> config =
      ParseCausalLmConfig(With(With(kLlama, "model_type", "\"qwen2\""), "rope_scaling", "null"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->qkv_bias);
  EXPECT_FALSE(config->o_bias);
  EXPECT_FALSE(config->rope_scaling.has_value());
}

TEST(CausalLmConfig, NamesTheFieldThatIsWrong) {
  EXPECT_THAT(ErrorOf(With(kLlama, "hidden_size", "null")), HasSubstr("'hidden_size' is missing"));
  EXPECT_THAT(ErrorOf(With(kLlama, "vocab_size", "\"128\"")),
              HasSubstr("'vocab_size' is not an integer"));
  EXPECT_THAT(ErrorOf(With(kLlama, "num_key_value_heads", "3")),
              HasSubstr("'num_key_value_heads' (3) does not divide"));
  EXPECT_THAT(ErrorOf(With(kLlama, "hidden_act", "\"gelu\"")), HasSubstr("'hidden_act'"));
  EXPECT_THAT(ErrorOf(With(kLlama, "model_type", "\"gpt2\"")),
              HasSubstr("model_type 'gpt2' is not supported"));
  EXPECT_THAT(ErrorOf(With(kLlama, "rope_scaling", R"({"type": "yarn", "factor": 4.0})")),
              HasSubstr("rope_type 'yarn' is not supported"));
  EXPECT_THAT(ErrorOf(With(kLlama, "factor", "0")), HasSubstr("'factor' is 0, not positive"));
  EXPECT_THAT(ErrorOf(With(kLlama, "rms_norm_eps", "\"x\"")),
              HasSubstr("'rms_norm_eps' is not a number"));
  EXPECT_THAT(ErrorOf(With(With(kLlama, "model_type", "\"qwen3\""), "rope_scaling", "null")),
              HasSubstr("'head_dim' is missing"));
  EXPECT_THAT(ErrorOf(With(With(kLlama, "model_type", "\"qwen2\""), "use_sliding_window", "true")),
              HasSubstr("'use_sliding_window'"));
  EXPECT_THAT(ErrorOf(With(With(kLlama, "model_type", "\"qwen2\""), "layer_types",
                           R"(["full_attention", "sliding_attention"])")),
              HasSubstr("'layer_types' has \"sliding_attention\""));
  EXPECT_THAT(ErrorOf(With(With(With(kLlama, "rope_scaling", "null"), "rope_theta", "null"),
                           "rope_parameters",
                           R"({"full_attention": {"rope_theta": 1.0}})")),
              HasSubstr("'rope_parameters.rope_theta' is missing"));
  EXPECT_THAT(ErrorOf("[1]"), HasSubstr("not a JSON object"));
  EXPECT_THAT(ErrorOf("{"), HasSubstr("not valid JSON"));
}

}  // namespace
}  // namespace fsdp::hf
