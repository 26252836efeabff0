#include "checkpoint/hugging_face.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hf/safetensors.h"
#include "testing/multi_rank.h"
#include "torch/nn/modules/embedding.h"
#include "torch/nn/modules/linear.h"

namespace fsdp {
namespace {

using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::Net;
using ::fsdp::testing::RunOnThreadRanks;
using ::fsdp::testing::Targets;
using ::testing::HasSubstr;

std::string Dir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
}

std::unique_ptr<FullyShardedModel> Wrap(Net& model, Collectives& comm) {
  return FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>())
      .value();
}

// Two SGD steps at W = 2, so that the weights are no longer the
// constructor's.
void Train(Net& model, Collectives& comm) {
  const int64_t rows = kGlobalBatch / comm.world_size();
  for (int step = 0; step < 2; ++step) {
    at::Tensor loss =
        at::mse_loss(model->forward(Inputs(step, 0).narrow(0, comm.rank() * rows, rows)),
                     Targets(step, 0).narrow(0, comm.rank() * rows, rows));
    loss.backward();
    at::NoGradGuard no_grad;
    for (at::Tensor& p : model->parameters()) {
      if (p.grad().defined()) {
        p.sub_(p.grad() * 0.1);
        p.mutable_grad() = at::Tensor();
      }
    }
  }
}

StateDict FullState(FullyShardedModel& fsdp) {
  StateDictOptions options;
  options.cpu_offload = false;
  return GetModelStateDict(fsdp, options).value();
}

// Saved at W = 2 over several files (one unit's tensors and the next cross
// a file boundary), with a config: the files hold the FULL state dict's
// tensors under its names; loaded at W = 3 and W = 1, the model's state
// dict is the saved one.
TEST(HuggingFaceCheckpoint, SavesTheFullStateDictAndLoadsItAtOtherWorldSizes) {
  const std::string dir = Dir("hf_round_trip");
  const std::string config = R"({"model_type": "test", "hidden_size": 9})";
  StateDict saved;
  absl::Status first = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto fsdp = Wrap(model, comm);
    Train(model, comm);
    absl::Status status = SaveHuggingFaceCheckpoint(dir, *fsdp, {.max_file_bytes = 400,
                                                               .config_json = config});
    ASSERT_TRUE(status.ok()) << status;
    StateDict full = FullState(*fsdp);
    if (comm.rank() == 0) saved = full;
  });
  ASSERT_TRUE(first.ok()) << first;
  std::ifstream in(dir + "/config.json");
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), config);
  EXPECT_TRUE(std::filesystem::exists(dir + "/model.safetensors.index.json"));
  auto files = hf::SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(files.ok()) << files.status();
  ASSERT_EQ(files->names().size(), saved.size());
  for (const auto& [name, value] : saved) {
    auto read = files->Read(name);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_TRUE(at::equal(*read, value)) << name;
    EXPECT_EQ(files->FileOf(name)->metadata().at("format"), "pt");
  }
  for (int world : {3, 1}) {
    absl::Status second = RunOnThreadRanks(world, [&](Collectives& comm) {
      Net model;
      auto fsdp = Wrap(model, comm);
      absl::Status loaded = LoadHuggingFaceCheckpoint(dir, *fsdp);
      ASSERT_TRUE(loaded.ok()) << loaded;
      const StateDict got = FullState(*fsdp);
      ASSERT_EQ(got.size(), saved.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(at::equal(got[i].second, saved[i].second))
            << got[i].first << " at world " << world;
      }
    });
    EXPECT_TRUE(second.ok()) << second;
  }
}

// bf16 on disk, as the hub keeps weights; loading casts back to the
// model's float32, each value the bf16 rounding of the saved one.
TEST(HuggingFaceCheckpoint, WritesAnotherDTypeAndCastsOnLoad) {
  const std::string dir = Dir("hf_bf16");
  StateDict saved;
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto fsdp = Wrap(model, comm);
    absl::Status s = SaveHuggingFaceCheckpoint(dir, *fsdp, {.dtype = at::kBFloat16});
    ASSERT_TRUE(s.ok()) << s;
    StateDict full = FullState(*fsdp);
    if (comm.rank() == 0) saved = full;
  });
  ASSERT_TRUE(status.ok()) << status;
  auto files = hf::SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(files.ok());
  EXPECT_EQ(files->Find("head.weight")->dtype, at::kBFloat16);
  EXPECT_FALSE(std::filesystem::exists(dir + "/model.safetensors.index.json"));
  status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto fsdp = Wrap(model, comm);
    ASSERT_TRUE(LoadHuggingFaceCheckpoint(dir, *fsdp).ok());
    const StateDict got = FullState(*fsdp);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].second.scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(got[i].second, saved[i].second.to(at::kBFloat16).to(at::kFloat)))
          << got[i].first;
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A checkpoint that does not fit: every problem named at once, and nothing
// changed on any rank; strict = false loads what fits.
TEST(HuggingFaceCheckpoint, RefusesACheckpointThatDoesNotFitAndChangesNothing) {
  const std::string dir = Dir("hf_misfit");
  {
    Net reference;
    std::vector<hf::SafetensorsTensorSpec> specs;
    std::vector<at::Tensor> values;
    for (const auto& item : reference->named_parameters()) {
      if (item.key() == "blocks.1.fc.bias") continue;  // Missing.
      at::Tensor value = item.value().detach() + 1;
      if (item.key() == "head.bias") value = at::zeros({6});  // Wrong shape.
      specs.push_back({item.key(), at::kFloat, value.sizes().vec()});
      values.push_back(value);
    }
    specs.push_back({"extra.weight", at::kFloat, {2}});
    values.push_back(at::ones({2}));
    auto writer = hf::SafetensorsCheckpointWriter::Create(dir, specs, 1 << 20);
    ASSERT_TRUE(writer.ok());
    for (size_t i = 0; i < specs.size(); ++i) ASSERT_TRUE(writer->Write(specs[i].name, values[i]).ok());
    ASSERT_TRUE(writer->Commit().ok());
  }
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto fsdp = Wrap(model, comm);
    const StateDict before = FullState(*fsdp);
    absl::Status loaded = LoadHuggingFaceCheckpoint(dir, *fsdp);
    EXPECT_THAT(loaded.ToString(), HasSubstr("'head.bias' has shape [6], the model's is [5]"));
    EXPECT_THAT(loaded.ToString(), HasSubstr("missing: blocks.1.fc.bias"));
    EXPECT_THAT(loaded.ToString(), HasSubstr("not in the model: extra.weight"));
    EXPECT_THAT(loaded.ToString(), HasSubstr("nothing was changed"));
    const StateDict after = FullState(*fsdp);
    for (size_t i = 0; i < after.size(); ++i) {
      EXPECT_TRUE(at::equal(after[i].second, before[i].second)) << after[i].first;
    }
    // Not strict: the extra and missing tensors are allowed, the shape is not.
    loaded = LoadHuggingFaceCheckpoint(dir, *fsdp, {.strict = false});
    EXPECT_THAT(loaded.ToString(), HasSubstr("'head.bias' has shape [6]"));
    EXPECT_THAT(loaded.ToString(), ::testing::Not(HasSubstr("missing")));
    EXPECT_EQ(LoadHuggingFaceCheckpoint(Dir("hf_none"), *fsdp).code(),
              absl::StatusCode::kNotFound);
  });
  EXPECT_TRUE(status.ok()) << status;
}

// An embedding tied to the output head, as Llama 3.2 and Qwen3's small
// models have: written once under its first name, as save_pretrained does,
// and both names filled on load.
struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(const at::Tensor& tied) { weight = register_parameter("weight", tied); }
  at::Tensor forward(const at::Tensor& x) const { return at::linear(x, weight); }
  at::Tensor weight;
};
TORCH_MODULE(TiedHead);

struct TiedImpl : torch::nn::Module, ShardableModule {
  TiedImpl() {
    embed = register_module("embed", torch::nn::Embedding(10, 4));
    proj = register_module("proj", torch::nn::Linear(4, 4));
    head = register_module("head", TiedHead(embed->weight));
  }
  at::Tensor forward(at::Tensor ids) {
    UnitForward unit(this);
    return unit.Return(head->forward(proj->forward(embed->forward(unit.Input(ids)))));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear proj{nullptr};
  TiedHead head{nullptr};
};
TORCH_MODULE(Tied);

TEST(HuggingFaceCheckpoint, WritesATiedTensorOnceAndFillsBothNames) {
  const std::string dir = Dir("hf_tied");
  at::Tensor saved_embed;
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    at::manual_seed(5);
    Tied model;
    auto fsdp = FullyShardedModel::Wrap(model.ptr(), comm, {}, NoUnitsPolicy()).value();
    ASSERT_TRUE(SaveHuggingFaceCheckpoint(dir, *fsdp).ok());
    const StateDict full = FullState(*fsdp);
    if (comm.rank() == 0) saved_embed = full[0].second;
  });
  ASSERT_TRUE(status.ok()) << status;
  auto files = hf::SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(files.ok());
  EXPECT_EQ(files->names(), (std::vector<std::string>{"embed.weight", "proj.bias", "proj.weight"}));
  status = RunOnThreadRanks(3, [&](Collectives& comm) {
    at::manual_seed(6);
    Tied model;
    auto fsdp = FullyShardedModel::Wrap(model.ptr(), comm, {}, NoUnitsPolicy()).value();
    absl::Status loaded = LoadHuggingFaceCheckpoint(dir, *fsdp);
    ASSERT_TRUE(loaded.ok()) << loaded;
    const StateDict full = FullState(*fsdp);
    for (const auto& [name, value] : full) {
      if (name == "embed.weight" || name == "head.weight") {
        EXPECT_TRUE(at::equal(value, saved_embed)) << name;
      }
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

}  // namespace
}  // namespace fsdp
