#include "models/lora.h"

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <stdexcept>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "ATen/CPUGeneratorImpl.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "fsdp/fully_shard.h"
#include "fsdp/unit_module.h"
#include "fsdp/utilities.h"
#include "gtest/gtest.h"
#include "hf/model_config.h"
#include "hf/safetensors.h"
#include "models/llama.h"
#include "optim/flat_shard_optimizers.h"
#include "testing/multi_rank.h"
#include "testing/torch_python.h"

namespace models {
namespace {

using ::fsdp::testing::RunOnThreadRanks;

std::string TempDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void WriteText(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

std::map<std::string, at::Tensor> ReadAll(const std::string& path) {
  auto file = fsdp::hf::SafetensorsFile::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  std::map<std::string, at::Tensor> tensors;
  if (!file.ok()) return tensors;
  for (const fsdp::hf::SafetensorsEntry& e : file->entries()) tensors[e.name] = *file->Read(e.name);
  return tensors;
}

void WriteAll(const std::string& path, const std::map<std::string, at::Tensor>& tensors) {
  std::vector<fsdp::hf::SafetensorsTensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  auto writer = fsdp::hf::SafetensorsWriter::Create(path, specs);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (const auto& [name, t] : tensors) ASSERT_TRUE(writer->Write(name, t).ok());
  ASSERT_TRUE(writer->Commit().ok());
}

double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

LlamaConfig TinyConfig() {
  auto config = fsdp::hf::ParseCausalLmConfig(R"({
    "model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "attention_bias": true, "tie_word_embeddings": false})");
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

LoraConfig TinyLora() {
  LoraConfig lora;
  lora.r = 3;
  lora.lora_alpha = 6;
  lora.target_modules = {"q_proj", "v_proj", "down_proj"};
  return lora;
}

std::vector<std::string> TrainableNames(const torch::nn::Module& model) {
  std::vector<std::string> names;
  for (const auto& item : model.named_parameters()) {
    if (item.value().requires_grad()) names.push_back(item.key());
  }
  return names;
}

// lora_B away from its zeros, from `seed` (a generator of its own: the
// ranks are threads, and the global generator would be shared).
void RandomizeB(torch::nn::Module& model, uint64_t seed) {
  at::NoGradGuard no_grad;
  at::Generator gen = at::detail::createCPUGenerator(seed);
  for (const auto& item : model.named_parameters()) {
    if (absl::StrContains(item.key(), "lora_B")) item.value().normal_(0.0, 0.5, gen);
  }
}

// The model's LoraLinear whose name ends in `suffix` ("layers.0.self_attn.q_proj").
LoraLinearImpl& Proj(const torch::nn::Module& model, const std::string& suffix) {
  for (const auto& item : model.named_modules()) {
    if (absl::EndsWith(item.key(), suffix)) {
      if (auto* linear = item.value()->as<LoraLinearImpl>()) return *linear;
    }
  }
  ADD_FAILURE() << "no " << suffix;
  throw std::runtime_error("no " + suffix);
}

TEST(LoraTest, StartsAsTheBaseScalesAndFreezes) {
  CausalLm model(TinyConfig(), /*seed=*/1);
  CausalLm base(TinyConfig(), /*seed=*/1);
  const at::Tensor ids = at::arange(12, at::kLong).remainder(32).reshape({2, 6});
  ASSERT_TRUE(ApplyLora(*model, TinyLora(), /*seed=*/4).ok());
  std::vector<std::string> expected;
  for (int layer : {0, 1}) {
    for (const char* m : {"self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"}) {
      for (const char* ab : {"lora_A", "lora_B"}) {
        expected.push_back(absl::StrCat("model.layers.", layer, ".", m, ".", ab, ".weight"));
      }
    }
  }
  std::vector<std::string> trainable = TrainableNames(*model);
  std::sort(expected.begin(), expected.end());
  std::sort(trainable.begin(), trainable.end());
  EXPECT_EQ(trainable, expected);  // Everything else frozen.
  LoraLinearImpl* q = &Proj(*model, "layers.0.self_attn.q_proj");
  ASSERT_TRUE(q->has_adapter());
  EXPECT_EQ(q->lora_A->weight.sizes(), (std::vector<int64_t>{3, 16}));
  EXPECT_EQ(q->lora_B->weight.sizes(), (std::vector<int64_t>{16, 3}));
  EXPECT_LE(q->lora_A->weight.abs().max().item<double>(), 1 / std::sqrt(16.0));
  EXPECT_GT(q->lora_A->weight.abs().max().item<double>(), 0.5 / std::sqrt(16.0));
  EXPECT_FALSE(Proj(*model, "layers.0.self_attn.k_proj").has_adapter());
  at::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(model->forward(ids), base->forward(ids)));  // lora_B = 0.
  RandomizeB(*model, 9);
  EXPECT_GT(MaxAbsDiff(model->forward(ids), base->forward(ids)), 1e-3);
  // One layer's output: base + B A x * alpha / r (2), and alpha / sqrt(r).
  const at::Tensor x = at::randn({2, 5, 16});
  const at::Tensor delta = at::matmul(at::matmul(x, q->lora_A->weight.t()), q->lora_B->weight.t());
  const at::Tensor plain = at::linear(x, q->weight, q->bias);
  EXPECT_TRUE(at::allclose(q->forward(x), plain + delta * 2.0, 1e-5, 1e-6));
  LoraConfig rs = TinyLora();
  rs.use_rslora = true;
  EXPECT_DOUBLE_EQ(rs.scaling(), 6 / std::sqrt(3.0));
  CausalLm rs_model(TinyConfig(), 1);
  ASSERT_TRUE(ApplyLora(*rs_model, rs).ok());
  EXPECT_DOUBLE_EQ(Proj(*rs_model, "layers.1.mlp.down_proj").scaling, 6 / std::sqrt(3.0));
}

TEST(LoraTest, RefusesTargetsThatMatchNothingAndASecondAdapter) {
  {  // PEFT's rule: one that matches nothing beside others is allowed, and a
     // target may hold dots.
    CausalLm model(TinyConfig());
    LoraConfig lora = TinyLora();
    lora.target_modules = {"qq_proj", "self_attn.q_proj"};
    ASSERT_TRUE(ApplyLora(*model, lora).ok());
    EXPECT_TRUE(Proj(*model, "layers.0.self_attn.q_proj").has_adapter());
    EXPECT_FALSE(Proj(*model, "layers.0.self_attn.v_proj").has_adapter());
  }
  CausalLm model(TinyConfig());
  {
    LoraConfig lora = TinyLora();
    lora.target_modules = {"qq_proj", "zz_proj"};
    absl::Status status = ApplyLora(*model, lora);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), "'qq_proj', 'zz_proj'")) << status;
  }
  for (const char* target : {"lm_head", "embed_tokens", "mlp"}) {
    LoraConfig lora = TinyLora();
    lora.target_modules.push_back(target);
    absl::Status status = ApplyLora(*model, lora);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), absl::StrCat("'", target, "'"))) << status;
    // Nothing was changed.
    EXPECT_EQ(TrainableNames(*model).size(), model->parameters().size());
    EXPECT_FALSE(Proj(*model, "layers.0.self_attn.q_proj").has_adapter());
  }
  LoraConfig bad = TinyLora();
  bad.r = 0;
  EXPECT_EQ(ApplyLora(*model, bad).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(ApplyLora(*model, TinyLora()).ok());
  EXPECT_EQ(ApplyLora(*model, TinyLora()).code(), absl::StatusCode::kFailedPrecondition);
}

// adapter_config.json as peft 0.21.2 writes it (trimmed of its null fields).
constexpr char kPeftConfig[] = R"({
  "alpha_pattern": {}, "bias": "none", "fan_in_fan_out": false, "inference_mode": true,
  "init_lora_weights": false, "layers_pattern": null, "layers_to_transform": null,
  "loftq_config": {}, "lora_alpha": 8, "lora_bias": false, "lora_dropout": 0.0,
  "megatron_core": "megatron.core", "modules_to_save": null, "peft_type": "LORA",
  "peft_version": "0.21.2", "qalora_group_size": 16, "r": 4, "rank_pattern": {},
  "target_modules": ["q_proj", "v_proj", "down_proj"], "task_type": "CAUSAL_LM",
  "use_dora": false, "use_qalora": false, "use_rslora": false})";

std::string WithField(const std::string& field, const std::string& value) {
  std::string text = kPeftConfig;
  return text.substr(0, text.size() - 1) + ", \"" + field + "\": " + value + "}";
}

TEST(LoraTest, ParsesPeftConfigsAndRefusesWhatItDoesNotCompute) {
  auto config = ParsePeftAdapterConfig(kPeftConfig);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->r, 4);
  EXPECT_EQ(config->lora_alpha, 8);
  EXPECT_EQ(config->target_modules, (std::vector<std::string>{"q_proj", "v_proj", "down_proj"}));
  auto again = ParsePeftAdapterConfig(PeftAdapterConfigJson(*config));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(*again == *config);
  const std::pair<const char*, const char*> unsupported[] = {
      {"use_dora", "true"},          {"bias", "\"all\""},
      {"modules_to_save", "[\"lm_head\"]"}, {"rank_pattern", "{\"q_proj\": 8}"},
      {"alpha_pattern", "{\"q_proj\": 8}"}, {"fan_in_fan_out", "true"},
      {"layers_to_transform", "[0]"}, {"target_modules", "\".*q_proj\""},
      {"peft_type", "\"IA3\""}, {"peft_type", "1"}, {"peft_type", "null"},
      {"init_lora_weights", "\"pissa\""}, {"init_lora_weights", "\"pissa_niter_4\""},
      {"init_lora_weights", "\"olora\""}, {"init_lora_weights", "\"corda\""},
      {"init_lora_weights", "\"loftq\""}, {"init_lora_weights", "\"lora_ga\""},
      {"init_lora_weights", "1"}};
  for (const auto& [field, value] : unsupported) {
    auto refused = ParsePeftAdapterConfig(WithField(field, value));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnimplemented) << field;
    EXPECT_TRUE(absl::StrContains(refused.status().message(), field)) << refused.status();
  }
  // Variants of init_lora_weights that set only lora_A / lora_B, which the
  // adapter file overwrites.
  for (const char* init : {"true", "false", "\"gaussian\"", "\"eva\"", "\"orthogonal\"",
                           "\"mica\""}) {
    auto accepted = ParsePeftAdapterConfig(WithField("init_lora_weights", init));
    EXPECT_TRUE(accepted.ok()) << init << ": " << accepted.status();
  }
  for (const auto& [field, value] : std::vector<std::pair<const char*, const char*>>{
           {"r", "\"4\""}, {"use_rslora", "\"yes\""}, {"lora_dropout", "\"0\""}, {"lora_alpha", "null"}, {"target_modules", "[1]"}, {"r", "0"}}) {
    auto refused = ParsePeftAdapterConfig(WithField(field, value));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << field;
  }
}

// Builds the tiny model with adapters, wraps it at the rank's world size
// and runs `body`.
template <typename Body>
void WithShardedLora(fsdp::Collectives& comm, uint64_t lora_seed, uint64_t b_seed,
                     const Body& body) {
  CausalLm model(TinyConfig(), /*seed=*/1);
  ASSERT_TRUE(ApplyLora(*model, TinyLora(), lora_seed).ok());
  if (b_seed != 0) RandomizeB(*model, b_seed);
  auto sharded = fsdp::FullyShardedModel::Wrap(
      model.ptr(), comm, {}, *fsdp::ModuleTypePolicy::Of<fsdp::UnitModuleImpl>());
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  body(model, **sharded);
}

// Copies of the good adapter directory `dir`/adapter (tensors `written`)
// with one thing wrong each, and what the refusal must name.
std::vector<std::pair<std::string, std::string>> BadAdapterDirs(
    const std::string& dir, const std::map<std::string, at::Tensor>& written) {
  const std::string key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight";
  auto bad_dir = [&](const std::string& name, std::map<std::string, at::Tensor> tensors,
                     const std::string& config_text) {
    const std::string path = dir + "/" + name;
    std::filesystem::create_directories(path);
    WriteAll(path + "/adapter_model.safetensors", tensors);
    WriteText(path + "/adapter_config.json", config_text);
    return path;
  };
  const std::string good_config = ReadText(dir + "/adapter/adapter_config.json");
  std::map<std::string, at::Tensor> missing = written, extra = written, shaped = written;
  missing.erase(key);
  extra["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] = at::zeros({3, 16});
  shaped[key] = at::zeros({2, 24});
  LoraConfig r2 = TinyLora();
  r2.r = 2;
  return {
      {bad_dir("missing", missing, good_config), key},
      {bad_dir("extra", extra, good_config), "k_proj.lora_A.weight"},
      {bad_dir("shaped", shaped, good_config), key},
      {bad_dir("dora", written, WithField("use_dora", "true")), "use_dora"},
      {bad_dir("rank", written, PeftAdapterConfigJson(r2)), "r 2 vs 3"},
  };
}

// Saved at W = 2, the adapter directory holds exactly the adapters under
// PEFT's names; loaded at W = 2 into another model it gives the same
// logits; bad directories are refused by key and change nothing.
TEST(LoraTest, AdapterDirectoryRoundTripsThroughFsdpAndBadOnesAreRefused) {
  const std::string dir = TempDir("lora_round_trip");
  const at::Tensor ids = at::arange(12, at::kLong).remainder(32).reshape({2, 6});
  at::Tensor saved_logits;
  std::map<std::string, at::Tensor> expected;
  absl::Status status = RunOnThreadRanks(2, [&](fsdp::Collectives& comm) {
    WithShardedLora(comm, 4, 9, [&](CausalLm& model, fsdp::FullyShardedModel& sharded) {
      ASSERT_TRUE(SavePeftAdapter(dir + "/adapter", sharded, TinyLora()).ok());
      LoraConfig other = TinyLora();
      other.r = 2;
      EXPECT_EQ(SavePeftAdapter(dir + "/other", sharded, other).code(),
                absl::StatusCode::kFailedPrecondition);
      at::NoGradGuard no_grad;
      at::Tensor logits = model->forward(ids);
      if (comm.rank() == 0) saved_logits = logits;
    });
  });
  ASSERT_TRUE(status.ok()) << status;
  {  // What the unwrapped model holds, under "base_model.model." + name.
    CausalLm model(TinyConfig(), 1);
    ASSERT_TRUE(ApplyLora(*model, TinyLora(), 4).ok());
    RandomizeB(*model, 9);
    for (const auto& item : model->named_parameters()) {
      if (item.value().requires_grad()) expected["base_model.model." + item.key()] = item.value();
    }
  }
  const std::map<std::string, at::Tensor> written =
      ReadAll(dir + "/adapter/adapter_model.safetensors");
  ASSERT_EQ(written.size(), expected.size());
  for (const auto& [name, t] : expected) {
    ASSERT_TRUE(written.count(name)) << name;
    EXPECT_TRUE(at::equal(written.at(name), t.detach())) << name;
  }
  auto config = ReadPeftAdapterConfig(dir + "/adapter");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(*config == TinyLora());

  const std::vector<std::pair<std::string, std::string>> bad = BadAdapterDirs(dir, written);
  status = RunOnThreadRanks(2, [&](fsdp::Collectives& comm) {
    WithShardedLora(comm, 5, 0, [&](CausalLm& model, fsdp::FullyShardedModel& sharded) {
      at::Tensor before;
      {
        at::NoGradGuard no_grad;
        before = model->forward(ids);
      }
      for (const auto& [path, named] : bad) {
        absl::Status loaded = LoadPeftAdapter(path, sharded, TinyLora());
        EXPECT_FALSE(loaded.ok()) << path;
        EXPECT_TRUE(absl::StrContains(loaded.message(), named)) << loaded;
        at::NoGradGuard no_grad;
        EXPECT_TRUE(at::equal(model->forward(ids), before)) << path << ": changed the model";
      }
      absl::Status loaded = LoadPeftAdapter(dir + "/adapter", sharded, TinyLora());
      ASSERT_TRUE(loaded.ok()) << loaded;
      at::NoGradGuard no_grad;
      EXPECT_TRUE(at::equal(model->forward(ids), saved_logits));
    });
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Adapters go on before Wrap; the adapter directory holds adapters only.
TEST(LoraTest, RefusesApplyingAfterWrapAndSavingOtherTrainableTensors) {
  const std::string dir = TempDir("lora_misuse");
  absl::Status status = RunOnThreadRanks(2, [&](fsdp::Collectives& comm) {
    CausalLm model(TinyConfig(), /*seed=*/1);
    ASSERT_TRUE(ApplyLora(*model, TinyLora()).ok());
    bool found = false;
    for (auto& item : model->named_parameters()) {
      if (item.key() != "model.norm.weight") continue;
      item.value().set_requires_grad(true);
      found = true;
    }
    ASSERT_TRUE(found);
    auto sharded = fsdp::FullyShardedModel::Wrap(
        model.ptr(), comm, {}, *fsdp::ModuleTypePolicy::Of<fsdp::UnitModuleImpl>());
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    absl::Status applied = ApplyLora(*model, TinyLora());
    EXPECT_EQ(applied.code(), absl::StatusCode::kFailedPrecondition) << applied;
    EXPECT_TRUE(absl::StrContains(applied.message(), "Wrap")) << applied;
    absl::Status saved = SavePeftAdapter(dir, **sharded, TinyLora());
    EXPECT_EQ(saved.code(), absl::StatusCode::kFailedPrecondition) << saved;
    EXPECT_TRUE(absl::StrContains(saved.message(), "'model.norm.weight'")) << saved;
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A rank whose adapter_config.json differs, or is missing, or that passes
// other Hugging Face options fails every rank in the load's one agreement:
// none is left waiting in the load.
TEST(LoraTest, ARankWithAnotherConfigFailsEveryRank) {
  const std::string dir = TempDir("lora_config_agreement");
  absl::Status status = RunOnThreadRanks(2, [&](fsdp::Collectives& comm) {
    WithShardedLora(comm, 4, 9, [&](CausalLm&, fsdp::FullyShardedModel& sharded) {
      ASSERT_TRUE(SavePeftAdapter(dir + "/adapter", sharded, TinyLora()).ok());
    });
  });
  ASSERT_TRUE(status.ok()) << status;
  LoraConfig r2 = TinyLora();
  r2.r = 2;
  for (const char* name : {"rank", "no_config"}) {
    std::filesystem::create_directories(dir + "/" + name);
    std::filesystem::copy_file(dir + "/adapter/adapter_model.safetensors",
                               dir + "/" + name + "/adapter_model.safetensors");
  }
  WriteText(dir + "/rank/adapter_config.json", PeftAdapterConfigJson(r2));
  status = RunOnThreadRanks(2, [&](fsdp::Collectives& comm) {
    WithShardedLora(comm, 5, 0, [&](CausalLm&, fsdp::FullyShardedModel& sharded) {
      for (const auto& [other, named] : std::vector<std::pair<std::string, std::string>>{
               {"rank", "r 2 vs 3"}, {"no_config", "adapter_config.json"}}) {
        const std::string path = dir + "/" + (comm.rank() == 1 ? other : "adapter");
        absl::Status loaded = LoadPeftAdapter(path, sharded, TinyLora());
        EXPECT_FALSE(loaded.ok()) << other << " on rank " << comm.rank();
        EXPECT_TRUE(absl::StrContains(loaded.message(), named)) << loaded;
      }
      fsdp::CheckpointIoOptions options = PeftAdapterIoOptions();
      if (comm.rank() == 1) options.hugging_face.tensors = fsdp::HuggingFaceTensors::kAll;
      absl::Status loaded = fsdp::LoadCheckpoint(dir + "/adapter", sharded, nullptr, nullptr,
                                                 options);
      EXPECT_EQ(loaded.code(), absl::StatusCode::kFailedPrecondition) << loaded;
      EXPECT_TRUE(absl::StrContains(loaded.message(), "tensors")) << loaded;
      ASSERT_TRUE(LoadPeftAdapter(dir + "/adapter", sharded, TinyLora()).ok());
    });
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A base checkpoint (transformers' layout, no adapters) loads strictly into
// a model with adapters with HuggingFaceTensors::kFrozen: the adapters keep
// their values, a base tensor missing from the files is refused by name.
TEST(LoraTest, BaseLoadsStrictlyBesideTheAdapters) {
  const std::string dir = TempDir("lora_base");
  const at::Tensor ids = at::arange(12, at::kLong).remainder(32).reshape({2, 6});
  CausalLm plain(TinyConfig(), /*seed=*/7);
  at::Tensor base_logits;
  std::map<std::string, at::Tensor> full;
  {
    at::NoGradGuard no_grad;
    base_logits = plain->forward(ids);
    for (const auto& item : plain->named_parameters()) full[item.key()] = item.value().detach();
  }
  std::filesystem::create_directories(dir + "/base");
  WriteAll(dir + "/base/model.safetensors", full);
  full.erase("model.layers.1.self_attn.o_proj.weight");
  std::filesystem::create_directories(dir + "/lacking");
  WriteAll(dir + "/lacking/model.safetensors", full);
  fsdp::CheckpointIoOptions base;
  base.hugging_face.tensors = fsdp::HuggingFaceTensors::kFrozen;
  absl::Status status = RunOnThreadRanks(2, [&](fsdp::Collectives& comm) {
    WithShardedLora(comm, 4, 0, [&](CausalLm& model, fsdp::FullyShardedModel& sharded) {
      absl::Status loaded = fsdp::LoadCheckpoint(dir + "/lacking", sharded, nullptr, nullptr, base);
      EXPECT_FALSE(loaded.ok());
      EXPECT_TRUE(absl::StrContains(loaded.message(), "model.layers.1.self_attn.o_proj.weight"))
          << loaded;
      // Without kFrozen the adapters are missing from the files.
      loaded = fsdp::LoadCheckpoint(dir + "/base", sharded);
      EXPECT_TRUE(absl::StrContains(loaded.message(), "lora_A.weight")) << loaded;
      loaded = fsdp::LoadCheckpoint(dir + "/base", sharded, nullptr, nullptr, base);
      ASSERT_TRUE(loaded.ok()) << loaded;
      at::NoGradGuard no_grad;
      EXPECT_TRUE(at::allclose(model->forward(ids), base_logits, 1e-6, 1e-6));  // lora_B = 0.
    });
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Merged at W = 2, the model computes what it did, and its frozen tensors,
// exported as a transformers checkpoint, are W + scaling B A: a model
// without adapters loads them and gives the same logits.
TEST(LoraTest, MergedAdaptersExportAsAPlainCheckpoint) {
  const std::string dir = TempDir("lora_merge");
  const at::Tensor ids = at::arange(12, at::kLong).remainder(32).reshape({2, 6});
  at::Tensor before, after;
  absl::Status status = RunOnThreadRanks(2, [&](fsdp::Collectives& comm) {
    WithShardedLora(comm, 4, 9, [&](CausalLm& model, fsdp::FullyShardedModel& sharded) {
      at::NoGradGuard no_grad;
      at::Tensor logits = model->forward(ids);
      ASSERT_TRUE(MergeLoraAdapters(sharded).ok());
      at::Tensor merged = model->forward(ids);
      fsdp::CheckpointIoOptions options;
      options.format = fsdp::CheckpointFormat::kHuggingFace;
      options.hugging_face.tensors = fsdp::HuggingFaceTensors::kFrozen;
      absl::Status saved = fsdp::SaveCheckpoint(dir + "/merged", sharded, nullptr, {}, options);
      ASSERT_TRUE(saved.ok()) << saved;
      if (comm.rank() == 0) {
        before = logits;
        after = merged;
      }
    });
  });
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_LE(MaxAbsDiff(after, before), 1e-5);
  CausalLm reference(TinyConfig(), /*seed=*/1);
  ASSERT_TRUE(ApplyLora(*reference, TinyLora(), 4).ok());
  RandomizeB(*reference, 9);
  const std::map<std::string, at::Tensor> merged = ReadAll(dir + "/merged/model.safetensors");
  EXPECT_EQ(merged.size(), CausalLm(TinyConfig())->parameters().size());
  LoraLinearImpl& down = Proj(*reference, "layers.1.mlp.down_proj");
  const at::Tensor expected =
      down.weight + at::matmul(down.lora_B->weight, down.lora_A->weight) * 2.0;
  EXPECT_LE(MaxAbsDiff(merged.at("model.layers.1.mlp.down_proj.weight"), expected.detach()), 1e-6);
  CausalLm plain(TinyConfig(), /*seed=*/3);
  {
    at::NoGradGuard no_grad;
    for (const auto& item : plain->named_parameters()) item.value().copy_(merged.at(item.key()));
    EXPECT_LE(MaxAbsDiff(plain->forward(ids), before), 1e-5);
  }
}

std::vector<at::Tensor> Trainable(const torch::nn::Module& model) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : fsdp::UniqueParameters(model)) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

// Training the adapters at W = 2 under FULL_SHARD (each rank one row; the
// base frozen in the same units) gives the unwrapped model's training on
// the whole batch. Backward computes the inputs' gradients through the
// frozen weights after the adapters' gradients (NOTE [Frozen parameters in
// backward] in fsdp/fully_shard.cc).
TEST(LoraTest, TrainingThroughFsdpMatchesTheUnwrappedModel) {
  const at::Tensor ids = at::arange(24, at::kLong).mul(7).remainder(32).reshape({2, 12});
  constexpr int kTrainSteps = 3;
  auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.01);
  CausalLm reference(TinyConfig(), /*seed=*/1);
  ASSERT_TRUE(ApplyLora(*reference, TinyLora(), 4).ok());
  RandomizeB(*reference, 9);
  torch::optim::AdamW reference_optimizer(Trainable(*reference), options);
  for (int step = 0; step < kTrainSteps; ++step) {
    CausalLmLoss(reference->forward(ids), ids).backward();
    reference_optimizer.step();
    reference_optimizer.zero_grad();
  }
  at::Tensor expected;
  {
    at::NoGradGuard no_grad;
    expected = reference->forward(ids);
  }
  absl::Status status = RunOnThreadRanks(2, [&](fsdp::Collectives& comm) {
    WithShardedLora(comm, 4, 9, [&](CausalLm& model, fsdp::FullyShardedModel&) {
      fsdp::FlatShardAdamW optimizer(Trainable(*model), options);
      const at::Tensor row = ids.narrow(0, comm.rank(), 1);
      for (int step = 0; step < kTrainSteps; ++step) {
        CausalLmLoss(model->forward(row), row).backward();
        optimizer.step();
        optimizer.zero_grad();
      }
      at::NoGradGuard no_grad;
      const at::Tensor logits = model->forward(ids);
      EXPECT_LE(MaxAbsDiff(logits, expected), 1e-5);
    });
  });
  EXPECT_TRUE(status.ok()) << status;
}

// ---------------------------------------------------------------------------
// Parity with peft (models/peft_interop.py).

// Its hyper-parameters.
constexpr int kSteps = 6;
constexpr double kLr = 1e-2, kWeightDecay = 0.01;

// models/peft_interop.py serve, beside the test (as llama_test's Interop).
class Interop {
 public:
  explicit Interop(std::string dir) : dir_(std::move(dir)) {
    const std::string command =
        // Under the test's own timeout (size medium: 300 s), so that a stuck
        // helper is reported by this test's message, not by bazel's kill.
        absl::StrCat("timeout 240 ", ::fsdp::testing::TorchPython(), " ",
                     ::fsdp::testing::ScriptPath("models/peft_interop.py"), " serve ", dir_);
    pipe_ = popen(command.c_str(), "r");
  }
  Interop(const Interop&) = delete;
  Interop& operator=(const Interop&) = delete;
  ~Interop() { Close(); }

  bool WaitFor(const std::string& marker) {
    char line[4096];
    while (pipe_ != nullptr && std::fgets(line, sizeof line, pipe_) != nullptr) {
      if (marker + "\n" == line) return true;
      std::fputs(line, stdout);
    }
    return false;
  }
  void Saved() {
    if (!saved_) std::ofstream(dir_ + "/saved") << "saved\n";
    saved_ = true;
  }
  int Close() {
    if (pipe_ == nullptr) return -1;
    Saved();
    const int status = pclose(pipe_);
    pipe_ = nullptr;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  std::string dir_;
  FILE* pipe_ = nullptr;
  bool saved_ = false;
};

// Fine-tunes transformers' checkpoint `dir`/base with peft's adapter
// `dir`/adapter0 at W = `world` (each rank its rows of every batch), kSteps
// AdamW steps; saves the adapter to `out`. Each step's loss, the mean over
// the ranks (the whole batch's: every row has as many tokens).
std::vector<double> FineTune(const std::string& dir, int world, const at::Tensor& batches,
                             const std::string& out) {
  std::vector<double> losses(kSteps, 0.0);
  std::mutex mu;
  absl::Status status = RunOnThreadRanks(world, [&](fsdp::Collectives& comm) {
    auto config = fsdp::hf::ReadCausalLmConfig(dir + "/base");
    ASSERT_TRUE(config.ok()) << config.status();
    auto lora = ReadPeftAdapterConfig(dir + "/adapter0");
    ASSERT_TRUE(lora.ok()) << lora.status();
    CausalLm model(*config);
    ASSERT_TRUE(ApplyLora(*model, *lora).ok());
    auto sharded = fsdp::FullyShardedModel::Wrap(
        model.ptr(), comm, {}, *fsdp::ModuleTypePolicy::Of<fsdp::UnitModuleImpl>());
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    fsdp::CheckpointIoOptions base;
    base.hugging_face.tensors = fsdp::HuggingFaceTensors::kFrozen;
    absl::Status loaded = fsdp::LoadCheckpoint(dir + "/base", **sharded, nullptr, nullptr, base);
    ASSERT_TRUE(loaded.ok()) << loaded;
    loaded = LoadPeftAdapter(dir + "/adapter0", **sharded, *lora);
    ASSERT_TRUE(loaded.ok()) << loaded;
    auto options =
        torch::optim::AdamWOptions(kLr).betas({0.9, 0.999}).eps(1e-8).weight_decay(kWeightDecay);
    fsdp::FlatShardAdamW optimizer(Trainable(*model), options);
    const int64_t rows = batches.size(1) / world;
    for (int step = 0; step < kSteps; ++step) {
      const at::Tensor ids = batches[step].narrow(0, comm.rank() * rows, rows);
      at::Tensor loss = CausalLmLoss(model->forward(ids), ids);
      loss.backward();
      optimizer.step();
      optimizer.zero_grad();
      std::lock_guard<std::mutex> lock(mu);
      losses[step] += loss.item<double>() / world;
    }
    absl::Status saved = SavePeftAdapter(out, **sharded, *lora);
    ASSERT_TRUE(saved.ok()) << saved;
  });
  EXPECT_TRUE(status.ok()) << status;
  return losses;
}

// transformers 5.23 + peft 0.21.2 fine-tune a random Llama with a random
// adapter (q_proj, v_proj, down_proj) for kSteps AdamW steps; so do we at
// W = 2 and W = 1, from their files. Every step's loss agrees, our trained
// adapter equals theirs, and PeftModel.from_pretrained reads ours back to
// their logits.
TEST(LoraTest, FineTuningMatchesPeftStepByStep) {
  const std::string dir = TempDir("peft_interop");
  Interop python(dir);
  if (!python.WaitFor("written")) {
    const int code = python.Close();
    if (code == 77) GTEST_SKIP() << "this Python has no transformers or no peft package";
    FAIL() << "models/peft_interop.py failed before writing, exit code " << code;
  }
  std::map<std::string, at::Tensor> ref = ReadAll(dir + "/ref.safetensors");
  ASSERT_TRUE(ref.count("losses"));
  for (int world : {2, 1}) {
    SCOPED_TRACE(absl::StrCat("W = ", world));
    const std::string out = world == 2 ? dir + "/ours" : dir + "/ours_w1";
    std::vector<double> losses = FineTune(dir, world, ref.at("input_ids"), out);
    double max_loss = 0;
    for (int step = 0; step < kSteps; ++step) {
      const double diff = std::abs(losses[step] - ref.at("losses")[step].item<double>());
      max_loss = std::max(max_loss, diff);
      EXPECT_LE(diff, 1e-5) << "step " << step;
    }
    double max_adapter = 0, moved = 0;
    const std::map<std::string, at::Tensor> ours = ReadAll(out + "/adapter_model.safetensors");
    const std::map<std::string, at::Tensor> initial =
        ReadAll(dir + "/adapter0/adapter_model.safetensors");
    size_t compared = 0;
    for (const auto& [name, t] : ref) {
      if (!absl::StartsWith(name, "trained.")) continue;
      const std::string key = name.substr(8);
      ASSERT_TRUE(ours.count(key)) << key;
      ASSERT_TRUE(initial.count(key)) << key;
      max_adapter = std::max(max_adapter, MaxAbsDiff(ours.at(key), t));
      moved = std::max(moved, MaxAbsDiff(ours.at(key), initial.at(key)));
      ++compared;
    }
    EXPECT_EQ(compared, ours.size());
    EXPECT_EQ(compared, 2u * 2u * 3u);
    EXPECT_LE(max_adapter, 1e-5);
    EXPECT_GT(moved, 1e-2);  // Training moved the adapter: there was something to compare.
    std::printf("W = %d: max |loss - peft| over %d steps %.3g, max |adapter - peft's| %.3g "
                "(training moved the adapter by up to %.3g)\n",
                world, kSteps, max_loss, max_adapter, moved);
  }
  python.Saved();
  ASSERT_TRUE(python.WaitFor("checked"));
  ASSERT_EQ(python.Close(), 0);
  std::map<std::string, at::Tensor> reloaded = ReadAll(dir + "/reloaded.safetensors");
  ASSERT_TRUE(reloaded.count("logits"));
  const double logits = MaxAbsDiff(reloaded.at("logits"), ref.at("logits"));
  double adapter = 0;
  for (const auto& [name, t] : ref) {
    if (!absl::StartsWith(name, "trained.")) continue;
    const std::string key = "reloaded." + name.substr(8);
    ASSERT_TRUE(reloaded.count(key)) << key;
    adapter = std::max(adapter, MaxAbsDiff(reloaded.at(key), t));
  }
  std::printf("PeftModel.from_pretrained of ours: max |adapter - peft's| %.3g, "
              "max |logits - peft's| %.3g\n", adapter, logits);
  EXPECT_LE(adapter, 1e-5);
  EXPECT_LE(logits, 1e-5);
}

}  // namespace
}  // namespace models
