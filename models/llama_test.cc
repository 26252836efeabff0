#include "models/llama.h"

#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "fsdp/fully_shard.h"
#include "fsdp/unit_module.h"
#include "fsdp/utilities.h"
#include "gtest/gtest.h"
#include "hf/model_config.h"
#include "hf/safetensors.h"
#include "testing/multi_rank.h"
#include "testing/torch_python.h"
#include "torch/optim/sgd.h"

namespace models {
namespace {

using ::fsdp::testing::RunOnThreadRanks;

// The cases of models/llama_interop.py, and its SGD learning rate.
const char* const kCases[] = {"llama3", "llama_tied", "mistral", "qwen2", "qwen3"};
constexpr double kLr = 0.5;
constexpr double kTolerance = 1e-4;

std::string TempDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// models/llama_interop.py serve, beside the test: it writes transformers'
// checkpoints and references and prints "written", waits for `dir`/saved,
// reads our checkpoints back and prints "checked". One Python start
// instead of two: importing transformers is most of the test's time.
class Interop {
 public:
  explicit Interop(std::string dir) : dir_(std::move(dir)) {
    const std::string command =
        absl::StrCat("timeout 300 ", ::fsdp::testing::TorchPython(), " ",
                     ::fsdp::testing::ScriptPath("models/llama_interop.py"), " serve ", dir_);
    pipe_ = popen(command.c_str(), "r");
  }
  Interop(const Interop&) = delete;
  Interop& operator=(const Interop&) = delete;
  ~Interop() { Close(); }

  // Reads the script's output up to the line `marker`; false when it ended
  // first. Other lines are passed on.
  bool WaitFor(const std::string& marker) {
    char line[4096];
    while (pipe_ != nullptr && std::fgets(line, sizeof line, pipe_) != nullptr) {
      if (marker + "\n" == line) return true;
      std::fputs(line, stdout);
    }
    return false;
  }
  // Lets the script go on to read our checkpoints.
  void Saved() {
    if (!saved_) std::ofstream(dir_ + "/saved") << "saved\n";
    saved_ = true;
  }
  // Waits for the script's end; its exit code.
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

std::map<std::string, at::Tensor> ReadAll(const std::string& path) {
  auto file = fsdp::hf::SafetensorsFile::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  std::map<std::string, at::Tensor> tensors;
  if (!file.ok()) return tensors;
  for (const fsdp::hf::SafetensorsEntry& e : file->entries()) tensors[e.name] = *file->Read(e.name);
  return tensors;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// What rank 0 measured in one case.
struct Measured {
  double logits = -1, loss = -1, logits_after = -1, change = -1;
  at::Tensor after;  // Our logits after the step.
};

// One case at W = 2, FULL_SHARD, one unit per decoder layer: loads
// transformers' checkpoint, compares logits and loss, takes one SGD step
// (each rank on one row of the batch), compares logits again, saves
// `dir`/`name`.cpp.
Measured RunCase(const std::string& dir, const std::string& name) {
  const std::string model_dir = dir + "/" + name;
  std::map<std::string, at::Tensor> ref = ReadAll(dir + "/" + name + ".ref.safetensors");
  const at::Tensor ids = ref.at("input_ids");
  Measured measured;
  std::mutex mu;
  absl::Status status = RunOnThreadRanks(2, [&](fsdp::Collectives& comm) {
    auto config = fsdp::hf::ReadCausalLmConfig(model_dir);
    ASSERT_TRUE(config.ok()) << config.status();
    CausalLm model(*config, /*seed=*/comm.rank() + 5);  // The checkpoint replaces it.
    auto sharded = fsdp::FullyShardedModel::Wrap(
        model.ptr(), comm, {}, *fsdp::ModuleTypePolicy::Of<fsdp::UnitModuleImpl>());
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    ASSERT_EQ((*sharded)->units().size(), 1 + config->num_hidden_layers);
    absl::Status loaded = fsdp::LoadCheckpoint(model_dir, **sharded);
    ASSERT_TRUE(loaded.ok()) << loaded;
    Measured m;
    {
      at::NoGradGuard no_grad;
      at::Tensor logits = model->forward(ids);
      m.logits = MaxAbsDiff(logits, ref.at("logits"));
      m.loss = MaxAbsDiff(CausalLmLoss(logits, ids).reshape({1}), ref.at("loss"));
    }
    torch::optim::SGD optimizer(fsdp::UniqueParameters(*model), torch::optim::SGDOptions(kLr));
    const at::Tensor row = ids.narrow(0, comm.rank(), 1);
    CausalLmLoss(model->forward(row), row).backward();
    optimizer.step();
    optimizer.zero_grad();
    {
      at::NoGradGuard no_grad;
      m.after = model->forward(ids);
      m.logits_after = MaxAbsDiff(m.after, ref.at("logits_after"));
      m.change = MaxAbsDiff(ref.at("logits_after"), ref.at("logits"));
    }
    fsdp::CheckpointIoOptions options;
    options.format = fsdp::CheckpointFormat::kHuggingFace;
    options.max_file_bytes = 100'000;
    options.config_json = ReadText(model_dir + "/config.json");
    absl::Status saved = fsdp::SaveCheckpoint(model_dir + ".cpp", **sharded, nullptr, {}, options);
    ASSERT_TRUE(saved.ok()) << saved;
    if (comm.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      measured = m;
    }
  });
  EXPECT_TRUE(status.ok()) << status;
  return measured;
}

// Without transformers (the plain Bazel pass): the names transformers
// gives, the tied head, causality and the loss's shift and ignore_index.
TEST(LlamaTest, HasTransformersNamesAndIsCausal) {
  auto config = fsdp::hf::ParseCausalLmConfig(R"({
    "model_type": "qwen3", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "tie_word_embeddings": true})");
  ASSERT_TRUE(config.ok()) << config.status();
  CausalLm model(*config);
  std::vector<std::string> names;
  for (const auto& item : model->named_parameters()) names.push_back(item.key());
  for (const char* name :
       {"model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_norm.weight", "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  }
  EXPECT_TRUE(model->lm_head->weight.is_same(model->model->embed_tokens->weight));
  at::NoGradGuard no_grad;
  const at::Tensor ids = at::arange(6, at::kLong).reshape({1, 6});
  at::Tensor changed = ids.clone();
  changed[0][5] = 20;
  const at::Tensor logits = model->forward(ids);
  EXPECT_TRUE(at::allclose(logits.narrow(1, 0, 5), model->forward(changed).narrow(1, 0, 5)));
  EXPECT_FALSE(at::allclose(logits.narrow(1, 5, 1), model->forward(changed).narrow(1, 5, 1)));
  at::Tensor labels = ids.clone();
  labels[0][5] = -100;  // Ignored: the loss is over positions 0..3's next tokens.
  const at::Tensor expected = at::cross_entropy_loss(logits[0].narrow(0, 0, 4), ids[0].narrow(0, 1, 4));
  EXPECT_TRUE(at::allclose(CausalLmLoss(logits, labels), expected));
}

// Models that transformers 5.23 built and wrote (save_pretrained, several
// files) give its logits and loss at W = 2, and the same logits after one
// SGD step; what we save, from_pretrained reads back to the same logits.
TEST(LlamaTest, MatchesTransformersBeforeAndAfterAStepAndRoundTrips) {
  const std::string dir = TempDir("llama_interop");
  Interop python(dir);
  if (!python.WaitFor("written")) {
    const int code = python.Close();
    if (code == 77) GTEST_SKIP() << "this Python has no transformers package";
    FAIL() << "models/llama_interop.py failed before writing, exit code " << code;
  }
  std::map<std::string, at::Tensor> ours_after;
  for (const char* name : kCases) {
    SCOPED_TRACE(name);
    Measured m = RunCase(dir, name);
    std::printf("%-10s max |logits - transformers| %.3g, |loss - transformers| %.3g; after the "
                "step %.3g (the step moved the logits by up to %.3g)\n",
                name, m.logits, m.loss, m.logits_after, m.change);
    EXPECT_LE(m.logits, kTolerance);
    EXPECT_LE(m.loss, kTolerance);
    EXPECT_LE(m.logits_after, kTolerance);
    EXPECT_GT(m.change, 100 * kTolerance);  // The step changed something to compare.
    ours_after[name] = m.after;
  }
  python.Saved();
  ASSERT_TRUE(python.WaitFor("checked"));
  ASSERT_EQ(python.Close(), 0);
  for (const char* name : kCases) {
    SCOPED_TRACE(name);
    std::map<std::string, at::Tensor> reloaded =
        ReadAll(dir + "/" + name + ".reloaded.safetensors");
    ASSERT_TRUE(ours_after[name].defined());
    const double diff = MaxAbsDiff(reloaded.at("logits"), ours_after[name]);
    std::printf("%-10s from_pretrained of ours: max |logits - ours| %.3g\n", name, diff);
    EXPECT_LE(diff, kTolerance);
  }
}

}  // namespace
}  // namespace models
