#include "checkpoint/checkpoint.h"

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "comm/gloo_collectives.h"
#include "comm/hybrid_groups.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hf/safetensors.h"
#include "testing/fault_injection.h"
#include "testing/multi_rank.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"
#include "torch/optim/sgd.h"
#include "torch/nn/modules/embedding.h"
#include "torch/nn/modules/linear.h"

namespace fsdp {
namespace {

using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::Fault;
using ::fsdp::testing::FaultInjectingCollectives;
using ::fsdp::testing::FaultKind;
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

std::unique_ptr<FullyShardedModel> Wrap(Net& model, const ProcessGroups& groups,
                                        const FsdpOptions& options = {}) {
  return FullyShardedModel::Wrap(model.ptr(), groups, options, *ModuleTypePolicy::Of<BlockImpl>())
      .value();
}

CheckpointIoOptions HuggingFace() {
  CheckpointIoOptions options;
  options.format = CheckpointFormat::kHuggingFace;
  return options;
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
    CheckpointIoOptions options;
    options.format = CheckpointFormat::kHuggingFace;
    options.max_file_bytes = 400;
    options.config_json = config;
    absl::Status status = SaveCheckpoint(dir, *fsdp, nullptr, {}, options);
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
      absl::Status loaded = LoadCheckpoint(dir, *fsdp);
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
    CheckpointIoOptions options;
    options.format = CheckpointFormat::kHuggingFace;
    options.dtype = at::kBFloat16;
    absl::Status s = SaveCheckpoint(dir, *fsdp, nullptr, {}, options);
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
    ASSERT_TRUE(LoadCheckpoint(dir, *fsdp).ok());
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
    absl::Status loaded = LoadCheckpoint(dir, *fsdp);
    EXPECT_THAT(loaded.ToString(), HasSubstr("'head.bias' has shape [6], the model's is [5]"));
    EXPECT_THAT(loaded.ToString(), HasSubstr("missing: blocks.1.fc.bias"));
    EXPECT_THAT(loaded.ToString(), HasSubstr("not in the model: extra.weight"));
    EXPECT_THAT(loaded.ToString(), HasSubstr("nothing was changed"));
    const StateDict after = FullState(*fsdp);
    for (size_t i = 0; i < after.size(); ++i) {
      EXPECT_TRUE(at::equal(after[i].second, before[i].second)) << after[i].first;
    }
    // Not strict: the extra and missing tensors are allowed, the shape is not.
    CheckpointIoOptions not_strict;
    not_strict.strict = false;
    loaded = LoadCheckpoint(dir, *fsdp, nullptr, nullptr, not_strict);
    EXPECT_THAT(loaded.ToString(), HasSubstr("'head.bias' has shape [6]"));
    EXPECT_THAT(loaded.ToString(), ::testing::Not(HasSubstr("missing")));
    EXPECT_EQ(LoadCheckpoint(Dir("hf_none"), *fsdp).code(), absl::StatusCode::kNotFound);
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
    CheckpointIoOptions options;
    options.format = CheckpointFormat::kHuggingFace;
    ASSERT_TRUE(SaveCheckpoint(dir, *fsdp, nullptr, {}, options).ok());
    const StateDict full = FullState(*fsdp);
    if (comm.rank() == 0) saved_embed = full[0].second;
  });
  ASSERT_TRUE(status.ok()) << status;
  auto files = hf::SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(files.ok());
  EXPECT_EQ(files->names(), (std::vector<std::string>{"embed.weight", "proj.bias", "proj.weight"}));
  // A checkpoint that names the tied tensor by its second name only.
  const std::string second = Dir("hf_tied_second");
  {
    std::vector<hf::SafetensorsTensorSpec> specs;
    std::vector<at::Tensor> values;
    for (const std::string& name : files->names()) {
      const at::Tensor value = *files->Read(name) + 1;
      specs.push_back({name == "embed.weight" ? "head.weight" : name, value.scalar_type(),
                       value.sizes().vec()});
      values.push_back(value);
    }
    auto writer = hf::SafetensorsCheckpointWriter::Create(second, specs, 1 << 20);
    ASSERT_TRUE(writer.ok());
    for (size_t i = 0; i < specs.size(); ++i) {
      ASSERT_TRUE(writer->Write(specs[i].name, values[i]).ok());
    }
    ASSERT_TRUE(writer->Commit().ok());
  }
  status = RunOnThreadRanks(3, [&](Collectives& comm) {
    at::manual_seed(6);
    Tied model;
    auto fsdp = FullyShardedModel::Wrap(model.ptr(), comm, {}, NoUnitsPolicy()).value();
    absl::Status loaded = LoadCheckpoint(dir, *fsdp);
    ASSERT_TRUE(loaded.ok()) << loaded;
    const StateDict full = FullState(*fsdp);
    for (const auto& [name, value] : full) {
      if (name == "embed.weight" || name == "head.weight") {
        EXPECT_TRUE(at::equal(value, saved_embed)) << name;
      }
    }
    loaded = LoadCheckpoint(second, *fsdp);
    ASSERT_TRUE(loaded.ok()) << loaded;
    for (const auto& [name, value] : FullState(*fsdp)) {
      if (name == "embed.weight" || name == "head.weight") {
        EXPECT_TRUE(at::equal(value, saved_embed + 1)) << name;
      }
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Under hybrid sharding one rank of the job writes (not one per replica,
// which would race on the files), and every replica loads.
TEST(HuggingFaceCheckpoint, HybridShardingWritesOnceAndLoadsOnEveryReplica) {
  const std::string dir = Dir("hf_hybrid");
  const HybridShardLayout layout = HybridShardLayout::Create(4, 2).value();
  auto store = c10::make_intrusive<c10d::HashStore>();
  StateDict saved;
  absl::Status status = RunOnThreadRanks(4, [&](Collectives& world) {
    GlooOptions gloo;
    gloo.hostname = "127.0.0.1";
    gloo.timeout = std::chrono::seconds(60);
    auto groups = CreateHybridShardCollectives(world.rank(), layout, gloo.group_name,
                                               GlooGroupConnector(store, gloo));
    ASSERT_TRUE(groups.ok()) << groups.status();
    FsdpOptions options;
    options.strategy = ShardingStrategy::kHybridShard;
    ProcessGroups hybrid(*groups->shard);
    hybrid.replicate = groups->replicate.get();
    Net model;
    auto fsdp = Wrap(model, hybrid, options);
    CheckpointIoOptions save = HuggingFace();
    save.max_file_bytes = 300;
    absl::Status saved_status = SaveCheckpoint(dir, *fsdp, nullptr, {}, save);
    ASSERT_TRUE(saved_status.ok()) << "rank " << world.rank() << ": " << saved_status;
    const StateDict full = FullState(*fsdp);
    if (world.rank() == 0) saved = full;
    world.Barrier();
    Net fresh;
    for (at::Tensor& p : fresh->parameters()) p.detach().zero_();
    auto loaded_model = Wrap(fresh, hybrid, options);
    absl::Status loaded = LoadCheckpoint(dir, *loaded_model);
    ASSERT_TRUE(loaded.ok()) << "rank " << world.rank() << ": " << loaded;
    const StateDict got = FullState(*loaded_model);
    world.Barrier();
    ASSERT_EQ(got.size(), saved.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(at::equal(got[i].second, saved[i].second))
          << "rank " << world.rank() << ": " << got[i].first;
    }
  });
  EXPECT_TRUE(status.ok()) << status;
  size_t temporaries = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    temporaries += entry.path().filename().string().find(".tmp-") != std::string::npos;
  }
  EXPECT_EQ(temporaries, 0u);
}

// Misuse gets the same clear error on every rank, and nothing hangs: rank
// 0 cannot write (the directory is a file), an optimizer or a train state
// for a format that holds none, strict = false for a format that loads
// strictly, and a save beside a checkpoint of the other format.
TEST(HuggingFaceCheckpoint, RefusesMisuseOnEveryRank) {
  const std::string file = Dir("hf_is_a_file");
  std::ofstream(file) << "not a directory";
  const std::string dcp = Dir("hf_beside_dcp");
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto fsdp = Wrap(model, comm);
    absl::Status cannot = SaveCheckpoint(file, *fsdp, nullptr, {}, HuggingFace());
    EXPECT_FALSE(cannot.ok());
    EXPECT_THAT(cannot.ToString(), HasSubstr(file)) << "rank " << comm.rank();
    torch::optim::SGD sgd(UniqueParameters(*model), torch::optim::SGDOptions(0.1));
    EXPECT_THAT(SaveCheckpoint(Dir("hf_x"), *fsdp, &sgd, {}, HuggingFace()).ToString(),
                HasSubstr("pass no optimizer and no train state"));
    EXPECT_THAT(SaveCheckpoint(Dir("hf_x"), *fsdp, nullptr, {3, 0}, HuggingFace()).ToString(),
                HasSubstr("pass no optimizer and no train state"));
    ASSERT_TRUE(SaveCheckpoint(dcp, *fsdp).ok());
    EXPECT_THAT(SaveCheckpoint(dcp, *fsdp, nullptr, {}, HuggingFace()).ToString(),
                HasSubstr("holds a Distributed Checkpoint"));
    CheckpointIoOptions not_strict;
    not_strict.strict = false;
    EXPECT_THAT(LoadCheckpoint(dcp, *fsdp, nullptr, nullptr, not_strict).ToString(),
                HasSubstr("loads strictly"));
    const std::string hf = Dir("hf_for_optimizer");
    ASSERT_TRUE(SaveCheckpoint(hf, *fsdp, nullptr, {}, HuggingFace()).ok());
    EXPECT_THAT(LoadCheckpoint(hf, *fsdp, &sgd).ToString(), HasSubstr("pass no optimizer"));
    EXPECT_THAT(SaveCheckpoint(hf, *fsdp).ToString(), HasSubstr("model.safetensors"));
    // Beside an adapter's files (another stem) too, naming the file.
    CheckpointIoOptions adapter = HuggingFace();
    adapter.hugging_face.stem = "adapter_model";
    const std::string adapter_dir = Dir("hf_adapter_stem");
    ASSERT_TRUE(SaveCheckpoint(adapter_dir, *fsdp, nullptr, {}, adapter).ok());
    EXPECT_THAT(SaveCheckpoint(adapter_dir, *fsdp).ToString(),
                HasSubstr("adapter_model.safetensors"));
    for (const char* bad : {"", ".", "..", "a/b"}) {
      CheckpointIoOptions stem = HuggingFace(), config = HuggingFace();
      stem.hugging_face.stem = bad;
      config.hugging_face.config_file = bad;
      for (const CheckpointIoOptions& options : {stem, config}) {
        EXPECT_EQ(SaveCheckpoint(Dir("hf_bad_name"), *fsdp, nullptr, {}, options).code(),
                  absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
        EXPECT_EQ(LoadCheckpoint(hf, *fsdp, nullptr, nullptr, options).code(),
                  absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
      }
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A read that fails after every check passed and the ranks agreed to load
// (here the file's last bytes cut between that agreement and the reads)
// cannot be taken back: every rank fails, the one whose read failed saying
// that the model may be partly loaded, the others that another rank could
// not load, so that no rank trains on as if the load had landed.
TEST(HuggingFaceCheckpoint, AReadFailingAfterTheChecksFailsEveryRankAndSaysSo) {
  const std::string dir = Dir("hf_cut_while_loading");
  absl::Status saved = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto fsdp = Wrap(model, comm);
    Train(model, comm);
    ASSERT_TRUE(SaveCheckpoint(dir, *fsdp, nullptr, {}, HuggingFace()).ok());
  });
  ASSERT_TRUE(saved.ok()) << saved;
  const std::string file = dir + "/model.safetensors";
  const uintmax_t size = std::filesystem::file_size(file);
  std::vector<absl::Status> loaded(2);
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    FaultInjectingCollectives faulty(comm);
    if (comm.rank() == 1) {
      Fault cut;
      cut.kind = FaultKind::kRunAfter;
      cut.phase = "loading a Hugging Face checkpoint";
      cut.run_after = [&] { std::filesystem::resize_file(file, size - 4); };
      faulty.Inject(cut);
    }
    Net model;
    auto fsdp = Wrap(model, faulty);
    loaded[comm.rank()] = LoadCheckpoint(dir, *fsdp);
    EXPECT_EQ(faulty.fired().size(), comm.rank() == 1 ? 1u : 0u);
  });
  ASSERT_TRUE(status.ok()) << status;
  ASSERT_EQ(std::filesystem::file_size(file), size - 4) << "the file was not cut";
  int partly = 0;
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_FALSE(loaded[rank].ok()) << "rank " << rank;
    const std::string message(loaded[rank].message());
    if (message.find("the model may now be partly loaded") != std::string::npos) {
      ++partly;
      EXPECT_THAT(message, HasSubstr(file)) << "rank " << rank;
    } else {
      EXPECT_THAT(message, HasSubstr("this rank loaded the model's parameters but another could "
                                     "not")) << "rank " << rank;
    }
  }
  EXPECT_GE(partly, 1);
}

}  // namespace
}  // namespace fsdp
