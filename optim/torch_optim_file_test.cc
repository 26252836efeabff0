// FULL optimizer state in torch.save's format, checked against PyTorch:
// state we write after 3 steps continues in PyTorch with our losses, and
// state PyTorch writes continues here with PyTorch's. Index-keyed
// (torch.optim.Optimizer.state_dict()) between unwrapped models, and
// FQN-keyed (FSDP's FULL optim_state_dict) from FSDP at W = 2 through
// PyTorch's FSDP2 into FSDP at W = 3.
#include "optim/torch_optim_file.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "comm/collectives.h"
#include "formats/dcp.h"
#include "formats/torch_file.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "gtest/gtest.h"
#include "launch/local_launcher.h"
#include "optim/dcp_checkpoint.h"
#include "optim/optim_state.h"
#include "statedict/state_dict.h"
#include "testing/multi_rank.h"
#include "testing/torch_python.h"
#include "torch/nn/modules/linear.h"
#include "torch/optim/adam.h"
#include "torch/optim/adamw.h"
#include "torch/optim/sgd.h"

namespace fsdp {
namespace {

using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::Net;
using ::fsdp::testing::RunOnThreadRanks;
using ::fsdp::testing::Targets;

constexpr char kScript[] = "optim/optim_interop.py";

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

std::unique_ptr<torch::optim::AdamW> MakeAdamW(const std::vector<at::Tensor>& params) {
  return std::make_unique<torch::optim::AdamW>(params,
                                               torch::optim::AdamWOptions(0.01).weight_decay(0.1));
}

// What the loaded groups must overwrite.
std::unique_ptr<torch::optim::AdamW> MakeWrongAdamW(const std::vector<at::Tensor>& params) {
  return std::make_unique<torch::optim::AdamW>(params,
                                               torch::optim::AdamWOptions(0.5).weight_decay(0.0));
}

// One step on `step`'s global batch, this rank's rows; the global mean loss.
float Step(Net& model, torch::optim::Optimizer& optimizer, int step, Collectives* comm) {
  const int world = comm == nullptr ? 1 : comm->world_size();
  const int rank = comm == nullptr ? 0 : comm->rank();
  const int64_t rows = kGlobalBatch / world;
  at::Tensor loss = at::mse_loss(model->forward(Inputs(step, 0).narrow(0, rank * rows, rows)),
                                 Targets(step, 0).narrow(0, rank * rows, rows));
  loss.backward();
  optimizer.step();
  optimizer.zero_grad();
  at::Tensor mean = loss.detach().reshape({1}).clone();
  if (comm != nullptr) comm->AllReduce(mean, ReduceOp::kAvg)->Wait();
  return mean.item<float>();
}

void WriteData(const std::string& dir) {
  StateDict data;
  for (int step = 0; step < 9; ++step) {
    data.emplace_back(absl::StrCat("x", step), Inputs(step, 0));
    data.emplace_back(absl::StrCat("y", step), Targets(step, 0));
  }
  ASSERT_TRUE(SaveTorchStateDict(dir + "/data.pt", data).ok());
}

int RunPython(const std::string& keying, const std::string& dir) {
  const std::string command =
      absl::StrCat("timeout 180 ", ::fsdp::testing::TorchPython(), " ",
                   ::fsdp::testing::ScriptPath(kScript), " ", keying, " ", dir);
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::vector<std::string> ParameterFqns(const torch::nn::Module& module) {
  std::vector<std::string> fqns;
  for (const auto& item : module.named_parameters()) fqns.push_back(item.key());
  return fqns;
}

void ExpectLossesNear(const std::vector<float>& got, const at::Tensor& want, int first,
                      const std::string& who) {
  ASSERT_EQ(static_cast<int64_t>(got.size()), 3);
  for (int i = 0; i < 3; ++i) {
    const float expected = want[first + i].item<float>();
    EXPECT_NEAR(got[i], expected, 2e-5 * std::abs(expected) + 1e-6)
        << who << ", step " << 3 + first + i;
  }
}

void ExpectParamsNear(const StateDict& got, const StateDict& result) {
  size_t compared = 0;
  for (const auto& [fqn, tensor] : got) {
    for (const auto& [name, want] : result) {
      if (name != fqn) continue;
      EXPECT_TRUE(at::allclose(tensor, want, 1e-4, 1e-5)) << fqn;
      ++compared;
    }
  }
  EXPECT_EQ(compared, got.size());
}

TEST(TorchOptimFile, RoundTripsInBothKeyings) {
  Net model;
  auto optimizer = MakeAdamW(model->parameters());
  for (int step = 0; step < 3; ++step) Step(model, *optimizer, step, nullptr);
  auto state = ModuleOptimStateDict(*model, *optimizer);
  ASSERT_TRUE(state.ok()) << state.status();
  for (OptimStateKeys keys : {OptimStateKeys::kParameterIndex, OptimStateKeys::kParameterFqn}) {
    const std::string path = TempDir() + "/round_trip.pt";
    ASSERT_TRUE(SaveTorchOptimStateDict(path, *state, keys).ok());
    auto loaded = LoadTorchOptimStateDict(path, "", ParameterFqns(*model));
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    ASSERT_EQ(loaded->state.size(), state->state.size());
    for (size_t i = 0; i < state->state.size(); ++i) {
      const auto& [fqn, want] = state->state[i];
      EXPECT_EQ(loaded->state[i].first, fqn);
      const ParamOptimState& got = loaded->state[i].second;
      ASSERT_EQ(got.tensors.size(), want.tensors.size()) << fqn;
      for (const auto& [key, t] : want.tensors)
        EXPECT_TRUE(at::equal(got.tensors.at(key), t)) << key;
      EXPECT_EQ(got.values.at("step").toInt(), 3) << fqn;
    }
    ASSERT_EQ(loaded->param_groups.size(), 1u);
    EXPECT_EQ(loaded->param_groups[0].params, state->param_groups[0].params);
    EXPECT_EQ(loaded->param_groups[0].options.at("lr").toDouble(), 0.01);
    EXPECT_EQ(loaded->param_groups[0].options.at("betas").toTupleRef().elements()[1].toDouble(),
              0.999);
  }
}

// Index-keyed, unwrapped on both sides: what torch.optim.AdamW's
// load_state_dict takes and its state_dict writes.
TEST(TorchOptimFile, PlainOptimizerStateMovesToPyTorchAndBack) {
  const std::string dir = TempDir() + "/plain";
  ASSERT_EQ(std::system(absl::StrCat("rm -rf ", dir, " && mkdir -p ", dir).c_str()), 0);
  WriteData(dir);
  Net model;
  auto optimizer = MakeAdamW(model->parameters());
  for (int step = 0; step < 3; ++step) Step(model, *optimizer, step, nullptr);
  ASSERT_TRUE(SaveTorchStateDict(dir + "/model.pt", ModuleStateDict(*model)).ok());
  auto state = ModuleOptimStateDict(*model, *optimizer);
  ASSERT_TRUE(state.ok()) << state.status();
  ASSERT_TRUE(
      SaveTorchOptimStateDict(dir + "/optim.pt", *state, OptimStateKeys::kParameterIndex).ok());
  std::vector<float> ours;
  for (int step = 3; step < 6; ++step) ours.push_back(Step(model, *optimizer, step, nullptr));

  ASSERT_EQ(RunPython("index", dir), 0);
  auto result = LoadTorchStateDict(dir + "/result.pt");
  ASSERT_TRUE(result.ok()) << result.status();
  const at::Tensor python_losses = result->back().second;
  ExpectLossesNear(ours, python_losses, 0, "PyTorch continuing from our state");

  // PyTorch's state after its steps 3-5, continued here.
  Net resumed;
  auto resumed_optimizer = MakeWrongAdamW(resumed->parameters());
  auto model_py = LoadTorchStateDict(dir + "/model_py.pt");
  ASSERT_TRUE(model_py.ok()) << model_py.status();
  ASSERT_TRUE(LoadModuleStateDict(*resumed, *model_py).ok());
  auto optim_py = LoadTorchOptimStateDict(dir + "/optim_py.pt", "", ParameterFqns(*resumed));
  ASSERT_TRUE(optim_py.ok()) << optim_py.status();
  absl::Status loaded = LoadModuleOptimStateDict(*resumed, *resumed_optimizer, *optim_py);
  ASSERT_TRUE(loaded.ok()) << loaded;
  std::vector<float> continued;
  for (int step = 6; step < 9; ++step) {
    continued.push_back(Step(resumed, *resumed_optimizer, step, nullptr));
  }
  ExpectLossesNear(continued, python_losses, 3, "continuing from PyTorch's state");
  ExpectParamsNear(ModuleStateDict(*resumed), *result);
}

// FQN-keyed: our FULL optimizer state from FSDP at W = 2 into PyTorch's
// FSDP2 (set_optimizer_state_dict), and FSDP2's (get_optimizer_state_dict)
// into FSDP at W = 3.
TEST(TorchOptimFile, FsdpStateMovesToPyTorchFsdp2AndBack) {
  const std::string dir = TempDir() + "/fsdp";
  ASSERT_EQ(std::system(absl::StrCat("rm -rf ", dir, " && mkdir -p ", dir).c_str()), 0);
  WriteData(dir);
  std::vector<float> ours;
  absl::Status first = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    auto optimizer = MakeAdamW(model->parameters());
    for (int step = 0; step < 3; ++step) Step(model, *optimizer, step, &comm);
    auto model_state = FullStateDict(**wrapped, {.rank0_only = true});
    ASSERT_TRUE(model_state.ok()) << model_state.status();
    auto state = FullOptimStateDict(**wrapped, *optimizer, {.rank0_only = true});
    ASSERT_TRUE(state.ok()) << state.status();
    if (comm.rank() == 0) {
      ASSERT_TRUE(SaveTorchStateDict(dir + "/model.pt", *model_state).ok());
      absl::Status saved =
          SaveTorchOptimStateDict(dir + "/optim.pt", *state, OptimStateKeys::kParameterFqn);
      ASSERT_TRUE(saved.ok()) << saved;
    }
    for (int step = 3; step < 6; ++step) {
      const float loss = Step(model, *optimizer, step, &comm);
      if (comm.rank() == 0) ours.push_back(loss);
    }
  });
  ASSERT_TRUE(first.ok()) << first;

  const int python = RunPython("fqn", dir);
  if (python == 3) GTEST_SKIP() << "this torch has no FSDP2 (fully_shard)";
  ASSERT_EQ(python, 0);
  auto result = LoadTorchStateDict(dir + "/result.pt");
  ASSERT_TRUE(result.ok()) << result.status();
  const at::Tensor python_losses = result->back().second;
  ExpectLossesNear(ours, python_losses, 0, "FSDP2 continuing from our state");

  auto model_py = LoadTorchStateDict(dir + "/model_py.pt");
  ASSERT_TRUE(model_py.ok()) << model_py.status();
  auto optim_py = LoadTorchOptimStateDict(dir + "/optim_py.pt");
  ASSERT_TRUE(optim_py.ok()) << optim_py.status();
  absl::Status second = RunOnThreadRanks(3, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    auto optimizer = MakeWrongAdamW(model->parameters());
    ASSERT_TRUE(LoadFullStateDict(**wrapped, *model_py).ok());
    absl::Status loaded = LoadFullOptimStateDict(**wrapped, *optimizer, *optim_py);
    ASSERT_TRUE(loaded.ok()) << loaded;
    std::vector<float> continued;
    for (int step = 6; step < 9; ++step) continued.push_back(Step(model, *optimizer, step, &comm));
    ExpectLossesNear(continued, python_losses, 3, "continuing from FSDP2's state at W = 3");
    auto final_state = FullStateDict(**wrapped, {.rank0_only = true});
    ASSERT_TRUE(final_state.ok()) << final_state.status();
    if (comm.rank() == 0) ExpectParamsNear(*final_state, *result);
  });
  ASSERT_TRUE(second.ok()) << second;
}

// A Distributed Checkpoint of model and optimizer that PyTorch's FSDP2
// wrote at W = 2 (get_state_dict, dcp.save) after 3 steps continues here at
// W = 1, 2 and 3 with the losses FSDP2 continued with.
TEST(TorchOptimFile, Fsdp2DistributedCheckpointContinuesAtAnotherWorldSize) {
  const std::string dir = TempDir() + "/dcp";
  ASSERT_EQ(std::system(absl::StrCat("rm -rf ", dir, " && mkdir -p ", dir).c_str()), 0);
  WriteData(dir);
  Net init;
  ASSERT_TRUE(SaveTorchStateDict(dir + "/model.pt", ModuleStateDict(*init)).ok());
  LocalLaunchOptions launch;
  launch.nproc_per_node = 2;
  launch.program = ::fsdp::testing::TorchPython();
  launch.args = {::fsdp::testing::ScriptPath(kScript), "dcp_fsdp2", dir};
  launch.log_dir = dir;
  launch.timeout = std::chrono::minutes(3);
  absl::StatusOr<LaunchResult> launched = LaunchLocalRanks(launch);
  ASSERT_TRUE(launched.ok()) << launched.status();
  if (!launched->ok() && launched->ranks[0].ending == RankOutcome::Ending::kExited &&
      launched->ranks[0].code == 3) {
    GTEST_SKIP() << "this torch has no FSDP2 or Distributed Checkpoint";
  }
  ASSERT_TRUE(launched->ok()) << launched->Summary();
  auto result = LoadTorchStateDict(dir + "/result.pt");
  ASSERT_TRUE(result.ok()) << result.status();
  const at::Tensor python_losses = result->back().second;

  const std::string checkpoint = dir + "/ckpt";
  auto model_state = LoadDcpStateDict(checkpoint, "model.");
  ASSERT_TRUE(model_state.ok()) << model_state.status();
  auto optim_state = LoadDcpOptimStateDict(checkpoint, "optim");
  ASSERT_TRUE(optim_state.ok()) << optim_state.status();
  ASSERT_EQ(optim_state->state.size(), 8u);
  EXPECT_EQ(optim_state->state[0].second.values.at("step").toInt(), 3);
  auto model_as_optim = LoadDcpOptimStateDict(checkpoint, "model");
  ASSERT_FALSE(model_as_optim.ok());
  EXPECT_NE(model_as_optim.status().message().find(
                "entry 'model': 'model.blocks.0.fc.weight' is stored at a path an optimizer's "
                "state dict does not have"),
            std::string::npos)
      << model_as_optim.status();
  auto no_such_key = LoadDcpOptimStateDict(checkpoint, "optimizer");
  ASSERT_FALSE(no_such_key.ok());
  EXPECT_NE(no_such_key.status().message().find("no optimizer state is stored under it"),
            std::string::npos)
      << no_such_key.status();
  // Read whole (FULL state dicts), at W = 3.
  absl::Status continued = RunOnThreadRanks(3, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    auto optimizer = MakeWrongAdamW(model->parameters());
    ASSERT_TRUE(LoadFullStateDict(**wrapped, *model_state).ok());
    absl::Status loaded = LoadFullOptimStateDict(**wrapped, *optimizer, *optim_state);
    ASSERT_TRUE(loaded.ok()) << loaded;
    std::vector<float> losses;
    for (int step = 3; step < 6; ++step) losses.push_back(Step(model, *optimizer, step, &comm));
    ExpectLossesNear(losses, python_losses, 0, "continuing FSDP2's checkpoint at W = 3");
  });
  ASSERT_TRUE(continued.ok()) << continued;
  // Read by every rank for its own shards, at W = 1, 2 and 3: each rank
  // reads only the chunks that hold its part, fewer as W grows.
  int64_t stored = 0;
  auto metadata = ReadDcpMetadata(checkpoint);
  ASSERT_TRUE(metadata.ok()) << metadata.status();
  for (const DcpTensorEntry& tensor : metadata->tensors) {
    for (const DcpChunk& chunk : tensor.chunks) stored += chunk.location.length;
  }
  for (int world : {1, 2, 3}) {
    absl::Status resharded = RunOnThreadRanks(world, [&](Collectives& comm) {
      Net model;
      auto wrapped =
          FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
      ASSERT_TRUE(wrapped.ok()) << wrapped.status();
      auto optimizer = MakeWrongAdamW(model->parameters());
      ShardedLoadStats stats;
      absl::Status loaded =
          LoadShardedDcpModelAndOptimizer(**wrapped, *optimizer, checkpoint, {}, &stats);
      ASSERT_TRUE(loaded.ok()) << loaded;
      EXPECT_GE(stats.bytes_read, stats.bytes_needed);
      if (world == 1) {
        EXPECT_EQ(stats.bytes_read, stored);  // Every tensor chunk, once.
      } else {
        EXPECT_LT(stats.bytes_read, stored);
      }
      std::vector<float> losses;
      for (int step = 3; step < 6; ++step) losses.push_back(Step(model, *optimizer, step, &comm));
      ExpectLossesNear(losses, python_losses, 0,
                       absl::StrCat("continuing FSDP2's checkpoint read in shards at W = ", world));
      if (comm.rank() == 0) {
        std::printf("W = %d: rank 0 read %lld of the checkpoint's %lld tensor bytes\n", world,
                    static_cast<long long>(stats.bytes_read), static_cast<long long>(stored));
      }
    });
    ASSERT_TRUE(resharded.ok()) << resharded;
  }

  // Without the optimizer's state the losses are others: the check can fail.
  Net fresh;
  auto fresh_optimizer = MakeAdamW(fresh->parameters());
  ASSERT_TRUE(LoadModuleStateDict(*fresh, *model_state).ok());
  EXPECT_GT(
      std::abs(Step(fresh, *fresh_optimizer, 3, nullptr) - python_losses[0].item<float>()) +
          std::abs(Step(fresh, *fresh_optimizer, 4, nullptr) - python_losses[1].item<float>()),
      1e-4);
}

// The reverse: our FSDP at W = 3 writes model and optimizer after 3 steps
// as a Distributed Checkpoint, each rank its own shards; PyTorch's FSDP2 at W = 2 restores both the
// way its jobs do (dcp.load into get_state_dict's dicts, set_state_dict)
// and continues with our losses. Our readers read back what was written.
TEST(TorchOptimFile, OurDistributedCheckpointContinuesInFsdp2AtAnotherWorldSize) {
  const std::string dir = TempDir() + "/dcp_ours";
  ASSERT_EQ(std::system(absl::StrCat("rm -rf ", dir, " && mkdir -p ", dir).c_str()), 0);
  WriteData(dir);
  std::vector<float> ours;
  StateDict saved_model;
  OptimStateDict saved_optim;
  absl::Status trained = RunOnThreadRanks(3, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    auto optimizer = MakeAdamW(model->parameters());
    for (int step = 0; step < 3; ++step) Step(model, *optimizer, step, &comm);
    // Every rank writes its own shards (what Python reads below); the
    // FULL state written whole by rank 0 must read back the same.
    absl::Status sharded = SaveShardedDcpModelAndOptimizer(**wrapped, *optimizer, dir + "/ours");
    ASSERT_TRUE(sharded.ok()) << sharded;
    auto model_state = FullStateDict(**wrapped, {.rank0_only = true});
    ASSERT_TRUE(model_state.ok()) << model_state.status();
    auto optim_state = FullOptimStateDict(**wrapped, *optimizer, {.rank0_only = true});
    ASSERT_TRUE(optim_state.ok()) << optim_state.status();
    if (comm.rank() == 0) {
      absl::Status saved = SaveDcpModelAndOptimizer(dir + "/ours_full", *model_state, *optim_state);
      ASSERT_TRUE(saved.ok()) << saved;
      saved_model = *model_state;
      saved_optim = *optim_state;
    }
    for (int step = 3; step < 6; ++step) {
      const float loss = Step(model, *optimizer, step, &comm);
      if (comm.rank() == 0) ours.push_back(loss);
    }
  });
  ASSERT_TRUE(trained.ok()) << trained;

  for (const char* written : {"/ours", "/ours_full"}) {
    SCOPED_TRACE(written);
    auto model_back = LoadDcpStateDict(dir + written, "model.");
    ASSERT_TRUE(model_back.ok()) << model_back.status();
    ASSERT_EQ(model_back->size(), saved_model.size());
    for (size_t i = 0; i < saved_model.size(); ++i) {
      EXPECT_EQ((*model_back)[i].first, saved_model[i].first);
      EXPECT_TRUE(at::equal((*model_back)[i].second, saved_model[i].second))
          << saved_model[i].first;
    }
    auto optim_back = LoadDcpOptimStateDict(dir + written, "optim");
    ASSERT_TRUE(optim_back.ok()) << optim_back.status();
    ASSERT_EQ(optim_back->state.size(), saved_optim.state.size());
    ASSERT_EQ(optim_back->param_groups.size(), 1u);
    EXPECT_EQ(optim_back->param_groups[0].options, saved_optim.param_groups[0].options);
    for (size_t i = 0; i < saved_optim.state.size(); ++i) {
      const auto& [fqn, want] = saved_optim.state[i];
      EXPECT_EQ(optim_back->state[i].first, fqn);
      EXPECT_EQ(optim_back->state[i].second.values.at("step").toInt(), 3);
      for (const auto& [name, tensor] : want.tensors) {
        EXPECT_TRUE(at::equal(optim_back->state[i].second.tensors.at(name), tensor))
            << fqn << " " << name;
      }
    }
  }
  // Each rank wrote its own data file.
  auto metadata = ReadDcpMetadata(dir + "/ours");
  ASSERT_TRUE(metadata.ok()) << metadata.status();
  std::set<std::string> files;
  for (const DcpTensorEntry& tensor : metadata->tensors) {
    for (const DcpChunk& chunk : tensor.chunks) files.insert(chunk.location.relative_path);
  }
  EXPECT_EQ(files.size(), 3u);

  LocalLaunchOptions launch;
  launch.nproc_per_node = 2;
  launch.program = ::fsdp::testing::TorchPython();
  launch.args = {::fsdp::testing::ScriptPath(kScript), "load_dcp_fsdp2", dir};
  launch.log_dir = dir;
  launch.timeout = std::chrono::minutes(3);
  absl::StatusOr<LaunchResult> launched = LaunchLocalRanks(launch);
  ASSERT_TRUE(launched.ok()) << launched.status();
  if (!launched->ok() && launched->ranks[0].ending == RankOutcome::Ending::kExited &&
      launched->ranks[0].code == 3) {
    GTEST_SKIP() << "this torch has no FSDP2 or Distributed Checkpoint";
  }
  ASSERT_TRUE(launched->ok()) << launched->Summary();
  auto result = LoadTorchStateDict(dir + "/result_load.pt");
  ASSERT_TRUE(result.ok()) << result.status();
  ExpectLossesNear(ours, result->back().second, 0, "FSDP2 at W = 2 continuing from our checkpoint");
}

// dcp.save of a plain Optimizer.state_dict() keys the state by index, so
// a reader cannot tell a state's parameter before it has read the groups:
// such a state is read whole and each rank takes its part. Loaded in
// shards at W = 2, model and optimizer are what was saved.
TEST(TorchOptimFile, AnIndexKeyedDcpStateLoadsIntoShards) {
  const std::string dir = TempDir() + "/dcp_index_keyed";
  ASSERT_EQ(std::system(absl::StrCat("rm -rf ", dir).c_str()), 0);
  Net trained;
  auto optimizer = MakeAdamW(trained->parameters());
  for (int step = 0; step < 2; ++step) Step(trained, *optimizer, step, nullptr);
  auto saved = ModuleOptimStateDict(*trained, *optimizer);
  ASSERT_TRUE(saved.ok()) << saved.status();
  const std::vector<std::string> fqns = ParameterFqns(*trained);
  std::vector<DcpItem> items;
  for (const auto& [fqn, tensor] : ModuleStateDict(*trained)) {
    items.push_back({{{false, "model", 0}, {false, fqn, 0}}, tensor});
  }
  for (DcpItem& item : DcpItemsOfOptimState(*saved, "optim")) {
    if (item.path[1].key == "state") {
      const int64_t index = std::find(fqns.begin(), fqns.end(), item.path[2].key) - fqns.begin();
      item.path[2] = {true, "", index};
    } else if (item.path[3].key == "params") {
      c10::impl::GenericList indices(c10::AnyType::get());
      for (size_t i = 0; i < fqns.size(); ++i) indices.push_back(static_cast<int64_t>(i));
      item.value = indices;
    }
    items.push_back(std::move(item));
  }
  ASSERT_TRUE(SaveDcpCheckpoint(dir, items).ok());
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Net model;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    auto fresh = MakeWrongAdamW(model->parameters());
    absl::Status loaded = LoadShardedDcpModelAndOptimizer(**wrapped, *fresh, dir);
    ASSERT_TRUE(loaded.ok()) << loaded;
    auto model_state = FullStateDict(**wrapped);
    ASSERT_TRUE(model_state.ok());
    auto optim_state = FullOptimStateDict(**wrapped, *fresh);
    ASSERT_TRUE(optim_state.ok());
    if (comm.rank() != 0) return;
    const StateDict want = ModuleStateDict(*trained);
    ASSERT_EQ(model_state->size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(at::equal((*model_state)[i].second, want[i].second)) << want[i].first;
    }
    ASSERT_EQ(optim_state->state.size(), saved->state.size());
    for (size_t i = 0; i < saved->state.size(); ++i) {
      const auto& [fqn, param] = saved->state[i];
      EXPECT_EQ(optim_state->state[i].first, fqn);
      EXPECT_EQ(optim_state->state[i].second.values.at("step").toInt(), 2);
      for (const auto& [name, tensor] : param.tensors) {
        EXPECT_TRUE(at::equal(optim_state->state[i].second.tensors.at(name), tensor))
            << fqn << " " << name;
      }
    }
    EXPECT_EQ(optim_state->param_groups[0].options, saved->param_groups[0].options);
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A file written by hand through SaveTorchObject.
std::string WriteObject(const std::string& name, const c10::IValue& object) {
  const std::string path = TempDir() + "/" + name;
  EXPECT_TRUE(SaveTorchObject(path, object).ok());
  return path;
}

c10::impl::GenericDict OptimDict(const c10::IValue& state, const c10::IValue& group) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  c10::impl::GenericList groups(c10::AnyType::get());
  groups.push_back(group);
  dict.insert("state", state);
  dict.insert("param_groups", groups);
  return dict;
}

TEST(TorchOptimFile, WhatCannotBeLoadedIsRefusedByName) {
  auto expect_error = [](const absl::StatusOr<OptimStateDict>& got, const std::string& words) {
    ASSERT_FALSE(got.ok()) << "expected an error saying: " << words;
    EXPECT_NE(got.status().message().find(words), std::string::npos) << got.status();
  };
  c10::impl::GenericDict no_state(c10::IntType::get(), c10::AnyType::get());
  auto group = [](const c10::IValue& params) {
    c10::impl::GenericDict g(c10::StringType::get(), c10::AnyType::get());
    g.insert("lr", 0.1);
    g.insert("params", params);
    return g;
  };
  c10::impl::GenericList indices(c10::AnyType::get());
  indices.push_back(int64_t{0});
  indices.push_back(int64_t{1});

  const std::string by_index = WriteObject("by_index.pt", OptimDict(no_state, group(indices)));
  expect_error(LoadTorchOptimStateDict(by_index), "give the FQN of each index");
  expect_error(LoadTorchOptimStateDict(by_index, "", {"w"}),
               "the parameter groups list more parameters than the 1 FQNs given");
  expect_error(LoadTorchOptimStateDict(by_index, "", {"w", "b", "c"}),
               "list 2 parameters, but 3 FQNs");
  EXPECT_TRUE(LoadTorchOptimStateDict(by_index, "", {"w", "b"}).ok());
  expect_error(LoadTorchOptimStateDict(by_index, "optimizer"), "no entry 'optimizer'");

  c10::impl::GenericDict named = group(indices);
  c10::impl::GenericList names(c10::AnyType::get());
  names.push_back(std::string("b"));
  names.push_back(std::string("w"));
  named.insert("param_names", names);
  const std::string named_path = WriteObject("named.pt", OptimDict(no_state, named));
  expect_error(LoadTorchOptimStateDict(named_path, "", {"w", "b"}),
               "param_groups[0]['params'][0] is named 'b' in the file but is 'w' here");
  EXPECT_TRUE(LoadTorchOptimStateDict(named_path, "", {"b", "w"}).ok());

  c10::impl::GenericDict maximize = group(indices);
  maximize.insert("maximize", true);
  expect_error(LoadTorchOptimStateDict(WriteObject("maximize.pt", OptimDict(no_state, maximize)),
                                       "", {"w", "b"}),
               "param_groups[0]['maximize'] is set, and libtorch's optimizers have no 'maximize'");

  c10::impl::GenericList mixed(c10::AnyType::get());
  mixed.push_back(int64_t{0});
  mixed.push_back(std::string("b"));
  expect_error(LoadTorchOptimStateDict(WriteObject("mixed.pt", OptimDict(no_state, group(mixed))),
                                       "", {"w", "b"}),
               "mixes parameter indices and FQNs");

  c10::impl::GenericDict bad_step(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericDict param(c10::StringType::get(), c10::AnyType::get());
  param.insert("step", at::scalar_tensor(2.5));
  bad_step.insert(int64_t{0}, param);
  expect_error(LoadTorchOptimStateDict(
                   WriteObject("bad_step.pt", OptimDict(bad_step, group(indices))), "", {"w", "b"}),
               "state['w']['step'] is not a step count");

  c10::impl::GenericDict nested = group(indices);
  nested.insert("betas", c10::ivalue::Tuple::create({c10::ivalue::Tuple::create({0.9}), 0.99}));
  expect_error(LoadTorchOptimStateDict(WriteObject("nested.pt", OptimDict(no_state, nested)), "",
                                       {"w", "b"}),
               "param_groups[0]['betas'] holds a tuple inside a tuple or list");
  c10::impl::GenericDict complex_lr = group(indices);
  complex_lr.insert_or_assign(
      "lr", at::scalar_tensor(c10::complex<double>(0.1, 1.0), at::kComplexDouble));
  expect_error(LoadTorchOptimStateDict(
                   WriteObject("complex_lr.pt", OptimDict(no_state, complex_lr)), "", {"w", "b"}),
               "param_groups[0]['lr'] is a tensor of 1 elements of ComplexDouble, not one real");

  c10::impl::GenericList twice(c10::AnyType::get());
  twice.push_back(int64_t{5});
  twice.push_back(int64_t{5});
  expect_error(LoadTorchOptimStateDict(WriteObject("twice.pt", OptimDict(no_state, group(twice))),
                                       "", {"w", "b"}),
               "param_groups[0]['params'] lists parameter 5 a second time");
  c10::impl::GenericDict unlisted(c10::IntType::get(), c10::AnyType::get());
  unlisted.insert(int64_t{7}, param);
  expect_error(LoadTorchOptimStateDict(
                   WriteObject("unlisted.pt", OptimDict(unlisted, group(indices))), "", {"w", "b"}),
               "state for parameter 7, which no parameter group lists");

  c10::impl::GenericDict model_file(c10::StringType::get(), c10::AnyType::get());
  model_file.insert("w", at::ones({2}));
  expect_error(LoadTorchOptimStateDict(WriteObject("model.pt", model_file)),
               "not an optimizer's state dict");
}

// As Optimizer.load_state_dict reads them: an index means its position in
// the groups' params lists taken together, whatever its value; an entry of
// a checkpoint dict is read by its key.
TEST(TorchOptimFile, IndicesArePositionsAcrossGroups) {
  auto params = [](std::vector<int64_t> ids) {
    c10::impl::GenericList list(c10::AnyType::get());
    for (int64_t id : ids) list.push_back(id);
    c10::impl::GenericDict g(c10::StringType::get(), c10::AnyType::get());
    g.insert("lr", 0.1);
    g.insert("params", list);
    return g;
  };
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  for (int64_t id : {3, 9}) {
    c10::impl::GenericDict param(c10::StringType::get(), c10::AnyType::get());
    param.insert("exp_avg", at::full({2}, static_cast<double>(id)));
    state.insert(id, param);
  }
  c10::impl::GenericList groups(c10::AnyType::get());
  groups.push_back(params({5, 3}));
  groups.push_back(params({9}));
  c10::impl::GenericDict optimizer(c10::StringType::get(), c10::AnyType::get());
  optimizer.insert("state", state);
  optimizer.insert("param_groups", groups);
  c10::impl::GenericDict checkpoint(c10::StringType::get(), c10::AnyType::get());
  checkpoint.insert("model", c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
  checkpoint.insert("optimizer", optimizer);
  const std::string path = WriteObject("positions.pt", checkpoint);

  auto loaded = LoadTorchOptimStateDict(path, "optimizer", {"a", "b", "c"});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->param_groups.size(), 2u);
  EXPECT_EQ(loaded->param_groups[0].params, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(loaded->param_groups[1].params, (std::vector<std::string>{"c"}));
  ASSERT_EQ(loaded->state.size(), 2u);
  EXPECT_EQ(loaded->state[0].first, "b");  // Id 3: position 1.
  EXPECT_EQ(loaded->state[0].second.tensors.at("exp_avg")[0].item<float>(), 3);
  EXPECT_EQ(loaded->state[1].first, "c");  // Id 9: position 2.
}

// A PyTorch SGD's state (options as Python writes them: ints where libtorch
// has doubles, implementation keys) loads into libtorch's SGD built with
// momentum 0: the file's momentum applies before the state is made, so the
// momentum buffers arrive. Into AdamW it is refused, naming what is
// missing, and AdamW's state from libtorch's Adam with weight decay is
// refused too; a refused load changes nothing.
TEST(TorchOptimFile, OptionsAreCheckedBeforeAnythingChanges) {
  torch::nn::Linear model(3, 2);
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericList ids(c10::AnyType::get());
  int64_t id = 0;
  for (const at::Tensor& p : model->parameters()) {
    c10::impl::GenericDict param(c10::StringType::get(), c10::AnyType::get());
    param.insert("momentum_buffer", at::full_like(p, 0.5 + id).detach());
    state.insert(id, param);
    ids.push_back(id++);
  }
  c10::impl::GenericDict group(c10::StringType::get(), c10::AnyType::get());
  group.insert("lr", 0.1);
  group.insert("momentum", 0.9);
  group.insert("dampening", int64_t{0});
  group.insert("weight_decay", int64_t{0});
  group.insert("nesterov", false);
  group.insert("maximize", false);
  group.insert("foreach", c10::IValue());
  group.insert("differentiable", false);
  group.insert("fused", c10::IValue());
  group.insert("params", ids);
  const std::string path = WriteObject("sgd.pt", OptimDict(state, group));
  auto loaded = LoadTorchOptimStateDict(path, "", {"weight", "bias"});
  ASSERT_TRUE(loaded.ok()) << loaded.status();

  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(1.0));
  absl::Status status = LoadModuleOptimStateDict(*model, sgd, *loaded);
  ASSERT_TRUE(status.ok()) << status;
  const auto& options =
      static_cast<const torch::optim::SGDOptions&>(sgd.param_groups()[0].options());
  EXPECT_EQ(options.momentum(), 0.9);
  EXPECT_EQ(options.lr(), 0.1);
  auto back = ModuleOptimStateDict(*model, sgd);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->state.size(), 2u);
  EXPECT_TRUE(at::equal(back->state[1].second.tensors.at("momentum_buffer"), at::full({2}, 1.5)));

  auto adamw = MakeAdamW(model->parameters());
  status = LoadModuleOptimStateDict(*model, *adamw, *loaded);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("parameter group 0 of the state has no amsgrad, betas, eps"),
            std::string::npos)
      << status;
  EXPECT_EQ(adamw->param_groups()[0].options().get_lr(), 0.01);
  EXPECT_TRUE(adamw->state().empty());

  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01).weight_decay(0.1));
  model->forward(at::ones({1, 3})).sum().backward();
  adam.step();
  auto adam_state = ModuleOptimStateDict(*model, adam);
  ASSERT_TRUE(adam_state.ok()) << adam_state.status();
  const std::string adam_path = TempDir() + "/adam.pt";
  ASSERT_TRUE(SaveTorchOptimStateDict(adam_path, *adam_state, OptimStateKeys::kParameterFqn).ok());
  auto adam_loaded = LoadTorchOptimStateDict(adam_path);
  ASSERT_TRUE(adam_loaded.ok()) << adam_loaded.status();
  status = LoadModuleOptimStateDict(*model, *adamw, *adam_loaded);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("is Adam's (decoupled_weight_decay=False), this optimizer is "
                                  "AdamW: its weight decay would apply differently"),
            std::string::npos)
      << status;
  EXPECT_TRUE(adamw->state().empty());
}

}  // namespace
}  // namespace fsdp
