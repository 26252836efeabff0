// State dicts move between the C++ GPT (wrapped with FSDP) and a PyTorch
// GPT of nanoGPT's layout both ways: each side reproduces the other's
// logits from the other's checkpoint (models/gpt_interop.py).
#include <cstdlib>
#include <string>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "formats/torch_file.h"
#include "fsdp/fully_shard.h"
#include "gtest/gtest.h"
#include "models/gpt.h"
#include "statedict/state_dict.h"
#include "testing/multi_rank.h"
#include "testing/torch_python.h"

namespace models {
namespace {

using ::fsdp::testing::RunOnThreadRanks;

int RunPython(const std::string& mode, const std::string& dir) {
  return std::system(absl::StrCat("timeout 120 ", ::fsdp::testing::TorchPython(),
                                  " models/gpt_interop.py ", mode, " '", dir, "'")
                         .c_str());
}

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

GptConfig Config(uint64_t seed) {
  GptConfig config;  // As CONFIG in gpt_interop.py.
  config.vocab_size = 256;
  config.block_size = 16;
  config.n_layer = 2;
  config.n_head = 2;
  config.n_embd = 32;
  config.seed = seed;
  return config;
}

TEST(GptInterop, PyTorchLoadsOurFullStateDictAndReproducesOurLogits) {
  const std::string dir = TempDir();
  absl::Status status = RunOnThreadRanks(2, [&](fsdp::Collectives& comm) {
    Gpt model(Config(3));
    auto wrapped = fsdp::FullyShardedModel::Wrap(model.ptr(), comm, {},
                                                 *fsdp::ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    const at::Tensor tokens = at::arange(2 * 16, at::kLong).view({2, 16}).mul(37).remainder(256);
    at::Tensor logits;
    {
      at::NoGradGuard no_grad;
      logits = model->forward(tokens);
    }
    auto state = fsdp::FullStateDict(**wrapped, {.rank0_only = true});
    ASSERT_TRUE(state.ok()) << state.status();
    if (comm.rank() != 0) return;
    ASSERT_TRUE(fsdp::SaveTorchStateDict(dir + "/cpp_gpt.pt", *state).ok());
    ASSERT_TRUE(
        fsdp::SaveTorchStateDict(dir + "/cpp_io.pt", {{"tokens", tokens}, {"logits", logits}}).ok());
  });
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(RunPython("check_cpp", dir), 0);
}

TEST(GptInterop, OurFsdpModelLoadsAPyTorchStateDictAndReproducesItsLogits) {
  const std::string dir = TempDir();
  ASSERT_EQ(RunPython("write_python", dir), 0);
  auto io = fsdp::LoadTorchStateDict(dir + "/py_io.pt");
  ASSERT_TRUE(io.ok()) << io.status();
  const at::Tensor tokens = (*io)[0].second, want = (*io)[1].second;
  absl::Status status = RunOnThreadRanks(3, [&](fsdp::Collectives& comm) {
    Gpt model(Config(11));  // Any initialization: the state dict replaces it.
    auto wrapped = fsdp::FullyShardedModel::Wrap(model.ptr(), comm, {},
                                                 *fsdp::ModuleTypePolicy::Of<BlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    auto state = fsdp::LoadTorchStateDict(dir + "/py_gpt.pt");
    ASSERT_TRUE(state.ok()) << state.status();
    // PyTorch's state dict has both tied names, as ours does.
    ASSERT_TRUE(fsdp::LoadFullStateDict(**wrapped, *state).ok());
    at::NoGradGuard no_grad;
    const at::Tensor logits = model->forward(tokens);
    EXPECT_TRUE(at::allclose(logits, want, 1e-5, 1e-5))
        << "max difference " << (logits - want).abs().max().item<float>();
  });
  EXPECT_TRUE(status.ok()) << status;
}

}  // namespace
}  // namespace models
