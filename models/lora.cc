#include "models/lora.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "ATen/ATen.h"
#include "ATen/CPUGeneratorImpl.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "checkpoint/checkpoint.h"
#include "fsdp/utilities.h"
#include "torch/nn/init.h"

namespace models {
namespace {

using json = nlohmann::json;

// PEFT's rule (check_target_module_exists): a module is a target when its
// name is one of the targets or ends with "." + one.
const std::string* MatchingTarget(const std::string& name, const LoraConfig& config) {
  for (const std::string& target : config.target_modules) {
    if (name == target || absl::EndsWith(name, "." + target)) return &target;
  }
  return nullptr;
}

absl::Status CheckConfig(const LoraConfig& config) {
  if (config.r < 1) {
    return absl::InvalidArgumentError(absl::StrCat("LoRA: r must be at least 1, got ", config.r));
  }
  if (!(config.lora_dropout >= 0 && config.lora_dropout < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoRA: lora_dropout must be in [0, 1), got ", config.lora_dropout));
  }
  if (config.target_modules.empty()) {
    return absl::InvalidArgumentError("LoRA: target_modules is empty");
  }
  return absl::OkStatus();
}

// The model's LoraLinears, by name.
std::vector<std::pair<std::string, LoraLinearImpl*>> LoraLinears(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, LoraLinearImpl*>> found;
  for (const auto& item : model.named_modules()) {
    if (auto* linear = item.value()->as<LoraLinearImpl>()) found.emplace_back(item.key(), linear);
  }
  return found;
}

// Whether the model's adapters are `config`'s: on exactly the targets'
// LoraLinears, with its rank, scaling and dropout.
absl::Status CheckAdaptersAre(const torch::nn::Module& model, const LoraConfig& config) {
  size_t adapted = 0;
  for (const auto& [name, linear] : LoraLinears(model)) {
    const bool target = MatchingTarget(name, config) != nullptr;
    if (target != linear->has_adapter() ||
        (target && (linear->r != config.r || linear->scaling != config.scaling() ||
                    linear->dropout != config.lora_dropout))) {
      return absl::FailedPreconditionError(absl::StrCat(
          "LoRA: the model's adapter on '", name, "' is not the config's (r ", config.r,
          ", scaling ", config.scaling(), ", dropout ", config.lora_dropout, ", targets ",
          absl::StrJoin(config.target_modules, ","), "): ",
          linear->has_adapter() ? absl::StrCat("r ", linear->r, ", scaling ", linear->scaling,
                                               ", dropout ", linear->dropout)
                                : std::string("no adapter")));
    }
    adapted += target;
  }
  if (adapted == 0) return absl::FailedPreconditionError("LoRA: the model has no adapters");
  return absl::OkStatus();
}

// Fields of PEFT's LoraConfig that change the model in ways not computed
// here: each must be absent or hold its default.
absl::Status RefuseUnsupported(const json& root) {
  auto is_default = [&](const char* field) {
    if (!root.contains(field)) return true;
    const json& v = root.at(field);
    return v.is_null() || (v.is_boolean() && !v.get<bool>()) ||
           ((v.is_object() || v.is_array()) && v.empty());
  };
  for (const char* field :
       {"use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "fan_in_fan_out",
        "layers_to_transform", "layers_pattern", "exclude_modules", "lora_bias",
        "trainable_token_indices", "target_parameters", "layer_replication", "use_qalora",
        "megatron_config", "alora_invocation_tokens", "use_bdlora", "arrow_config",
        "kasa_config", "velora_config", "monteclora_config"}) {
    if (!is_default(field)) {
      return absl::UnimplementedError(absl::StrCat(
          "adapter_config.json: '", field, "' is ", root.at(field).dump(),
          "; this LoRA implementation supports only its default"));
    }
  }
  // PEFT's from_pretrained re-runs the init: pissa*, olora, corda*, loftq
  // and lora_ga rewrite the base weight, and what they compute is not here.
  // true, false, "gaussian", "eva", "orthogonal" and "mica" set only lora_A /
  // lora_B, which the adapter file then overwrites.
  if (root.contains("init_lora_weights")) {
    const json& init = root.at("init_lora_weights");
    static const std::set<std::string> kOnlyAdapter = {"gaussian", "eva", "orthogonal", "mica"};
    if (!init.is_boolean() && !(init.is_string() && kOnlyAdapter.count(init.get<std::string>()))) {
      return absl::UnimplementedError(absl::StrCat(
          "adapter_config.json: 'init_lora_weights' is ", init.dump(),
          "; supported: true, false, \"gaussian\", \"eva\", \"orthogonal\", \"mica\" (the "
          "others rewrite the base weight)"));
    }
  }
  if (root.contains("bias") && (!root.at("bias").is_string() || root.at("bias") != "none")) {
    return absl::UnimplementedError(absl::StrCat("adapter_config.json: 'bias' is ",
                                                 root.at("bias").dump(),
                                                 "; only \"none\" is supported"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LoraConfig> ParseJson(const json& root) {
  if (!root.is_object()) return absl::InvalidArgumentError("adapter_config.json: not an object");
  if (!root.contains("peft_type") || !root.at("peft_type").is_string() ||
      root.at("peft_type").get<std::string>() != "LORA") {
    return absl::UnimplementedError(absl::StrCat(
        "adapter_config.json: 'peft_type' is ",
        root.contains("peft_type") ? root.at("peft_type").dump() : "absent", ", not \"LORA\""));
  }
  FSDP_RETURN_IF_ERROR(RefuseUnsupported(root));
  LoraConfig config;
  auto number = [&](const char* field, double& out) -> absl::Status {
    if (!root.contains(field) || !root.at(field).is_number()) {
      return absl::InvalidArgumentError(
          absl::StrCat("adapter_config.json: '", field, "' is missing or not a number"));
    }
    out = root.at(field).get<double>();
    return absl::OkStatus();
  };
  if (!root.contains("r") || !root.at("r").is_number_integer()) {
    return absl::InvalidArgumentError("adapter_config.json: 'r' is missing or not an integer");
  }
  config.r = root.at("r").get<int64_t>();
  FSDP_RETURN_IF_ERROR(number("lora_alpha", config.lora_alpha));
  if (root.contains("lora_dropout")) {
    FSDP_RETURN_IF_ERROR(number("lora_dropout", config.lora_dropout));
  }
  if (root.contains("use_rslora")) {
    if (!root.at("use_rslora").is_boolean()) {
      return absl::InvalidArgumentError("adapter_config.json: 'use_rslora' is not a boolean");
    }
    config.use_rslora = root.at("use_rslora").get<bool>();
  }
  const json targets = root.contains("target_modules") ? root.at("target_modules") : json();
  if (targets.is_string()) {
    return absl::UnimplementedError(absl::StrCat(
        "adapter_config.json: 'target_modules' is the regular expression ", targets.dump(),
        "; only a list of module names is supported"));
  }
  if (!targets.is_array()) {
    return absl::InvalidArgumentError("adapter_config.json: 'target_modules' is not a list");
  }
  for (const json& t : targets) {
    if (!t.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat("adapter_config.json: 'target_modules' holds ", t.dump()));
    }
    config.target_modules.push_back(t.get<std::string>());
  }
  FSDP_RETURN_IF_ERROR(CheckConfig(config));
  return config;
}

// An adapter directory holds the trainable tensors, which must then be the
// adapters' alone.
absl::Status OnlyAdaptersTrain(const torch::nn::Module& model) {
  for (const auto& item : model.named_parameters()) {
    if (!item.value().requires_grad()) continue;
    const std::string& name = item.key();
    if (!absl::EndsWith(name, ".lora_A.weight") && !absl::EndsWith(name, ".lora_B.weight")) {
      return absl::FailedPreconditionError(absl::StrCat(
          "LoRA: '", name, "' is trainable but no lora_A / lora_B weight; PEFT's adapter "
          "directory holds the adapters only (freeze it, or save it with SaveCheckpoint)"));
    }
  }
  return absl::OkStatus();
}

std::vector<std::string> Sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

// The LoraLinears of `module`'s subtree that belong to its unit: not
// inside another unit (`units`, the model's units' modules).
void UnitLoraLinears(const torch::nn::Module& module,
                     const std::set<const torch::nn::Module*>& units,
                     std::vector<LoraLinearImpl*>& out) {
  for (const auto& child : module.children()) {
    if (units.count(child.get()) > 0) continue;
    if (auto* linear = child->as<LoraLinearImpl>()) out.push_back(linear);
    UnitLoraLinears(*child, units, out);
  }
}

}  // namespace

double LoraConfig::scaling() const {
  return use_rslora ? lora_alpha / std::sqrt(static_cast<double>(r)) : lora_alpha / r;
}

bool LoraConfig::operator==(const LoraConfig& other) const {
  return r == other.r && lora_alpha == other.lora_alpha && lora_dropout == other.lora_dropout &&
         Sorted(target_modules) == Sorted(other.target_modules) && use_rslora == other.use_rslora;
}

LoraLinearImpl::LoraLinearImpl(int64_t in_features, int64_t out_features, bool with_bias,
                               bool initialize) {
  weight = register_parameter("weight", at::empty({out_features, in_features}));
  if (with_bias) bias = register_parameter("bias", at::empty({out_features}));
  if (!initialize) return;
  at::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (with_bias) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
    bias.uniform_(-bound, bound);
  }
}

at::Tensor LoraLinearImpl::forward(const at::Tensor& x) {
  at::Tensor y = at::linear(x, weight, bias);
  if (!has_adapter()) return y;
  // PEFT's Linear.forward: result + lora_B(lora_A(dropout(x))) * scaling.
  const at::Tensor in = dropout > 0 ? at::dropout(x, dropout, is_training()) : x;
  return y + lora_B->forward(lora_A->forward(in)) * scaling;
}

absl::Status ApplyLora(torch::nn::Module& model, const LoraConfig& config, uint64_t seed) {
  FSDP_RETURN_IF_ERROR(CheckConfig(config));
  // A wrapped model's units hold their parameters flattened: new ones
  // would belong to no unit.
  for (const auto& item : model.named_modules()) {
    if (fsdp::GetModuleUnit(item.value().get()) != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "ApplyLora: the model is wrapped already ('", item.key().empty() ? "<root>" : item.key(),
          "' is an FSDP unit); apply LoRA before FullyShardedModel::Wrap"));
    }
  }
  // As PEFT: a target that matches nothing is allowed while another
  // matches; a match that cannot take an adapter is refused (PEFT would
  // adapt it: an embedding, a plain Linear such as lm_head).
  std::vector<LoraLinearImpl*> targets;
  for (const auto& item : model.named_modules()) {
    const std::string* target = MatchingTarget(item.key(), config);
    auto* linear = item.value()->as<LoraLinearImpl>();
    if (linear != nullptr && linear->has_adapter()) {
      return absl::FailedPreconditionError(
          absl::StrCat("ApplyLora: '", item.key(), "' already has a LoRA adapter"));
    }
    if (target == nullptr) continue;
    if (linear == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ApplyLora: target module '", *target, "' matches '", item.key(),
          "', which is no linear layer that takes an adapter (LoraLinear)"));
    }
    targets.push_back(linear);
  }
  if (targets.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ApplyLora: target modules '", absl::StrJoin(config.target_modules, "', '"),
        "' match no linear layer of the model that takes an adapter (LoraLinear)"));
  }
  at::NoGradGuard no_grad;
  for (at::Tensor& p : model.parameters()) p.set_requires_grad(false);
  at::Generator gen = at::detail::createCPUGenerator(seed);
  for (LoraLinearImpl* linear : targets) {
    const int64_t in = linear->weight.size(1), out = linear->weight.size(0);
    auto options = [](int64_t i, int64_t o) {
      return torch::nn::LinearOptions(i, o).bias(false);
    };
    linear->lora_A = linear->register_module("lora_A", torch::nn::Linear(options(in, config.r)));
    linear->lora_B = linear->register_module("lora_B", torch::nn::Linear(options(config.r, out)));
    const at::TensorOptions like = linear->weight.options();
    linear->lora_A->weight.set_data(at::empty({config.r, in}, like));
    linear->lora_B->weight.set_data(at::zeros({out, config.r}, like));
    // kaiming_uniform_(a = sqrt(5)) on [r, in]: bound 1 / sqrt(in).
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    linear->lora_A->weight.uniform_(-bound, bound, gen);
    linear->r = config.r;
    linear->scaling = config.scaling();
    linear->dropout = config.lora_dropout;
  }
  return absl::OkStatus();
}

absl::StatusOr<LoraConfig> ParsePeftAdapterConfig(const std::string& json_text) {
  json root = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return absl::InvalidArgumentError("adapter_config.json: not JSON");
  return ParseJson(root);
}

absl::StatusOr<LoraConfig> ReadPeftAdapterConfig(const std::string& dir) {
  const std::string path = dir + "/adapter_config.json";
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<LoraConfig> config = ParsePeftAdapterConfig(text.str());
  if (config.ok()) return config;
  return absl::Status(config.status().code(),
                      absl::StrCat("'", path, "': ", config.status().message()));
}

std::string PeftAdapterConfigJson(const LoraConfig& config) {
  json root = {{"peft_type", "LORA"},
               {"task_type", "CAUSAL_LM"},
               {"r", config.r},
               {"lora_alpha", config.lora_alpha},
               {"lora_dropout", config.lora_dropout},
               {"target_modules", Sorted(config.target_modules)},
               {"use_rslora", config.use_rslora},
               {"bias", "none"},
               {"use_dora", false},
               {"fan_in_fan_out", false},
               {"init_lora_weights", true},
               {"inference_mode", true},
               {"modules_to_save", nullptr},
               {"layers_to_transform", nullptr},
               {"layers_pattern", nullptr},
               {"rank_pattern", json::object()},
               {"alpha_pattern", json::object()},
               {"base_model_name_or_path", nullptr},
               {"revision", nullptr}};
  return root.dump(2) + "\n";
}

fsdp::CheckpointIoOptions PeftAdapterIoOptions() {
  fsdp::CheckpointIoOptions options;
  options.format = fsdp::CheckpointFormat::kHuggingFace;
  options.hugging_face.stem = "adapter_model";
  options.hugging_face.name_prefix = "base_model.model.";
  options.hugging_face.tensors = fsdp::HuggingFaceTensors::kTrainable;
  options.hugging_face.config_file = "adapter_config.json";
  return options;
}

absl::Status SavePeftAdapter(const std::string& dir, fsdp::FullyShardedModel& model,
                             const LoraConfig& config) {
  FSDP_RETURN_IF_ERROR(CheckAdaptersAre(model.units().front()->module(), config));
  FSDP_RETURN_IF_ERROR(OnlyAdaptersTrain(model.units().front()->module()));
  fsdp::CheckpointIoOptions options = PeftAdapterIoOptions();
  options.config_json = PeftAdapterConfigJson(config);
  return fsdp::SaveCheckpoint(dir, model, nullptr, {}, options);
}

absl::Status LoadPeftAdapter(const std::string& dir, fsdp::FullyShardedModel& model,
                             const LoraConfig& config) {
  FSDP_RETURN_IF_ERROR(CheckAdaptersAre(model.units().front()->module(), config));
  FSDP_RETURN_IF_ERROR(OnlyAdaptersTrain(model.units().front()->module()));
  fsdp::CheckpointIoOptions options = PeftAdapterIoOptions();
  // Checked inside the load's one agreement: a rank whose file differs
  // fails every rank, instead of leaving the others waiting in the load.
  options.check_config = [&config](const std::string& text) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(const LoraConfig read, ParsePeftAdapterConfig(text));
    if (read == config) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "another adapter than the model's (r ", read.r, " vs ", config.r, ", lora_alpha ",
        read.lora_alpha, " vs ", config.lora_alpha, ", target_modules ",
        absl::StrJoin(Sorted(read.target_modules), ","), " vs ",
        absl::StrJoin(Sorted(config.target_modules), ","), ", use_rslora ", read.use_rslora,
        " vs ", config.use_rslora, ", lora_dropout ", read.lora_dropout, " vs ",
        config.lora_dropout, ")"));
  };
  return fsdp::LoadCheckpoint(dir, model, nullptr, nullptr, options);
}

absl::Status MergeLoraAdapters(fsdp::FullyShardedModel& model) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("merging LoRA adapters"));
  std::set<const torch::nn::Module*> units;
  for (const auto& unit : model.units()) units.insert(&unit->module());
  try {
    for (const auto& unit : model.units()) {
      std::vector<LoraLinearImpl*> linears;
      UnitLoraLinears(unit->module(), units, linears);
      fsdp::SummonOptions options;
      options.recurse = false;
      fsdp::SummonFullParams full(model, unit->module(), options);
      at::NoGradGuard no_grad;
      for (LoraLinearImpl* linear : linears) {
        if (!linear->has_adapter()) continue;
        at::Tensor w = linear->weight;
        w.add_(at::matmul(linear->lora_B->weight, linear->lora_A->weight) * linear->scaling);
        linear->lora_B->weight.zero_();
      }
    }
  } catch (...) {
    return fsdp::StatusFromCurrentException();
  }
  return absl::OkStatus();
}

}  // namespace models
