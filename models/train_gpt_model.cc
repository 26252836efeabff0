#include "models/train_gpt_model.h"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "checkpoint/checkpoint.h"
#include "fsdp/unit_module.h"
#include "hf/model_config.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/train_gpt_config.h"
#include "models/train_gpt_flags.h"

namespace train_gpt {
namespace {

class GptJobModel final : public JobModel {
 public:
  explicit GptJobModel(const models::GptConfig& config) : config_(config), model_(config) {}

  torch::nn::Module& module() const override { return *model_.ptr(); }
  std::shared_ptr<torch::nn::Module> shared_module() const override { return model_.ptr(); }
  at::Tensor Logits(const at::Tensor& ids) override { return model_->forward(ids); }
  int64_t vocab_size() const override { return config_.vocab_size; }
  std::unique_ptr<fsdp::WrapPolicy> BlockPolicy() const override {
    return fsdp::ModuleTypePolicy::Of<models::BlockImpl>();
  }
  std::string Description() const override {
    return absl::StrFormat("GPT %d layers x %d heads x %d wide", config_.n_layer, config_.n_head,
                           config_.n_embd);
  }
  std::function<void(torch::nn::Module&)> param_init_fn() const override { return nullptr; }
  bool draws_random_numbers() const override { return config_.dropout > 0; }
  bool ids_are_bytes() const override { return true; }
  // Its starting weights are --init_state_dict's (train_gpt_initial_state.h)
  // and its exports the format-neutral ones: nothing of its own.
  void LoadStartingWeights(fsdp::FullyShardedModel&, bool) override {}
  void Export(fsdp::FullyShardedModel&, bool) override {}

 private:
  const models::GptConfig config_;
  models::Gpt model_;
};

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", path));
  return text.str();
}

class HfJobModel final : public JobModel {
 public:
  HfJobModel(std::string dir, const models::LlamaConfig& config, std::string config_json,
             std::optional<models::LoraConfig> lora, uint64_t seed)
      : dir_(std::move(dir)),
        config_json_(std::move(config_json)),
        lora_(std::move(lora)),
        model_(config, seed, /*defer_allocation=*/true) {}

  // Before Wrap: the adapters' parameters must be in the units.
  absl::Status AddAdapters(uint64_t seed) {
    if (!lora_.has_value()) return absl::OkStatus();
    return models::ApplyLora(*model_, *lora_, seed);
  }

  torch::nn::Module& module() const override { return *model_.ptr(); }
  std::shared_ptr<torch::nn::Module> shared_module() const override { return model_.ptr(); }
  at::Tensor Logits(const at::Tensor& ids) override { return model_->forward(ids); }
  int64_t vocab_size() const override { return model_->config.vocab_size; }
  std::unique_ptr<fsdp::WrapPolicy> BlockPolicy() const override { return HfModelLayerPolicy(); }
  std::string Description() const override {
    const models::LlamaConfig& c = model_->config;
    std::string text = absl::StrFormat(
        "%s (%s) %d layers x %d heads (%d key/value) x %d wide, vocabulary %d", dir_,
        c.model_type, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
        c.hidden_size, c.vocab_size);
    if (lora_.has_value()) {
      absl::StrAppendFormat(&text, ", LoRA r=%d alpha=%g on %s", lora_->r, lora_->lora_alpha,
                            absl::StrJoin(lora_->target_modules, ","));
    }
    return text;
  }
  std::function<void(torch::nn::Module&)> param_init_fn() const override {
    return models::ZeroParameters;
  }
  bool draws_random_numbers() const override {
    return lora_.has_value() && lora_->lora_dropout > 0;
  }
  bool ids_are_bytes() const override { return false; }

  void LoadStartingWeights(fsdp::FullyShardedModel& wrapped, bool print) override {
    fsdp::CheckpointIoOptions base;
    // The adapters are not in the base's files: they keep their
    // initialization, or take --init_peft's below.
    if (lora_.has_value()) base.hugging_face.tensors = fsdp::HuggingFaceTensors::kFrozen;
    const auto start = std::chrono::steady_clock::now();
    if (absl::Status loaded = fsdp::LoadCheckpoint(dir_, wrapped, nullptr, nullptr, base);
        !loaded.ok()) {
      throw std::runtime_error(absl::StrCat("--hf_model=", dir_, ": ", loaded.message()));
    }
    if (print) {
      std::printf("loaded the weights of %s in %.2f s\n", dir_.c_str(),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    if (const std::string peft = absl::GetFlag(FLAGS_init_peft); !peft.empty()) {
      if (absl::Status loaded = models::LoadPeftAdapter(peft, wrapped, *lora_); !loaded.ok()) {
        throw std::runtime_error(absl::StrCat("--init_peft=", peft, ": ", loaded.message()));
      }
      if (print) std::printf("loaded the LoRA adapters of %s\n", peft.c_str());
    }
  }

  void Export(fsdp::FullyShardedModel& wrapped, bool print) override {
    if (const std::string dir = absl::GetFlag(FLAGS_export_peft); !dir.empty()) {
      fsdp::ThrowIfError(models::SavePeftAdapter(dir, wrapped, *lora_));
      if (print) std::printf("wrote the LoRA adapters as PEFT's files to %s\n", dir.c_str());
    }
    const std::string dir = absl::GetFlag(FLAGS_export_hf);
    if (dir.empty()) return;
    fsdp::CheckpointIoOptions options;
    options.format = fsdp::CheckpointFormat::kHuggingFace;
    options.config_json = config_json_;
    if (lora_.has_value()) {
      fsdp::ThrowIfError(models::MergeLoraAdapters(wrapped));
      options.hugging_face.tensors = fsdp::HuggingFaceTensors::kFrozen;
    }
    fsdp::ThrowIfError(fsdp::SaveCheckpoint(dir, wrapped, nullptr, {}, options));
    if (print) {
      std::printf("wrote the model as a Hugging Face checkpoint to %s%s\n", dir.c_str(),
                  lora_.has_value() ? " (adapters merged)" : "");
    }
  }

 private:
  const std::string dir_;
  const std::string config_json_;  // The source's, written beside the export.
  const std::optional<models::LoraConfig> lora_;
  models::CausalLm model_;
};

// --init_peft's config, or the --lora_* flags' (none when --lora_r is 0).
absl::StatusOr<std::optional<models::LoraConfig>> LoraConfigFromFlags() {
  if (const std::string dir = absl::GetFlag(FLAGS_init_peft); !dir.empty()) {
    absl::StatusOr<models::LoraConfig> config = models::ReadPeftAdapterConfig(dir);
    if (!config.ok()) {
      return absl::Status(config.status().code(),
                          absl::StrCat("--init_peft=", dir, ": ", config.status().message()));
    }
    return std::optional<models::LoraConfig>(*std::move(config));
  }
  if (absl::GetFlag(FLAGS_lora_r) == 0) return std::optional<models::LoraConfig>();
  models::LoraConfig config;
  config.r = absl::GetFlag(FLAGS_lora_r);
  config.lora_alpha = absl::GetFlag(FLAGS_lora_alpha);
  config.lora_dropout = absl::GetFlag(FLAGS_lora_dropout);
  config.target_modules = absl::GetFlag(FLAGS_lora_targets);
  return std::optional<models::LoraConfig>(std::move(config));
}

}  // namespace

std::unique_ptr<fsdp::WrapPolicy> HfModelLayerPolicy() {
  return fsdp::ModuleTypePolicy::Of<fsdp::UnitModuleImpl>();
}

absl::StatusOr<std::unique_ptr<JobModel>> JobModelFromFlags() {
  const std::string dir = absl::GetFlag(FLAGS_hf_model);
  if (dir.empty()) return std::make_unique<GptJobModel>(GptConfigFromFlags());
  absl::StatusOr<models::LlamaConfig> config = fsdp::hf::ReadCausalLmConfig(dir);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat("--hf_model=", dir, ": ", config.status().message()));
  }
  absl::StatusOr<std::string> config_json = ReadText(dir + "/config.json");
  if (!config_json.ok()) return config_json.status();
  FSDP_ASSIGN_OR_RETURN(std::optional<models::LoraConfig> lora, LoraConfigFromFlags());
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  auto model = std::make_unique<HfJobModel>(dir, *config, *std::move(config_json),
                                            std::move(lora), seed);
  if (absl::Status added = model->AddAdapters(seed); !added.ok()) {
    return absl::Status(added.code(), absl::StrCat("LoRA: ", added.message()));
  }
  return model;
}

}  // namespace train_gpt
