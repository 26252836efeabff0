// Unit-by-unit initialization: a model built with its memory released
// (DeferParameterAllocation, libtorch 1.13's stand-in for the meta device)
// is allocated, initialized and sharded one unit at a time. Parity with an
// eagerly built model, and measured peak memory during Wrap.
#include <malloc.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "base/status.h"
#include "fsdp/fully_shard.h"
#include "fsdp/unit_forward.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"
#include "torch/nn/module.h"
#include "torch/nn/modules/container/modulelist.h"
#include "torch/nn/modules/linear.h"

namespace fsdp {
namespace {

using ::fsdp::testing::RunOnProcessRanks;
using ::fsdp::testing::RunOnThreadRanks;
using ::testing::HasSubstr;

constexpr int64_t kWidth = 1024;
constexpr int kBlocks = 16;

struct WideBlockImpl : torch::nn::Module, ShardableModule {
  WideBlockImpl() { fc = register_module("fc", torch::nn::Linear(kWidth, kWidth)); }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    return unit.Return(at::tanh(fc->forward(x)));
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(WideBlock);

struct TowerImpl : torch::nn::Module, ShardableModule {
  // Deferred: each block releases its memory as soon as it is built, so
  // building never holds more than one block.
  explicit TowerImpl(bool deferred) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < kBlocks; ++i) {
      WideBlock block;
      if (deferred) ThrowIfError(DeferParameterAllocation(*block));
      blocks->push_back(block);
    }
  }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    for (const auto& block : *blocks) x = block->as<WideBlockImpl>()->forward(x);
    return unit.Return(x);
  }
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Tower);

int64_t ModelBytes() { return kBlocks * (kWidth * kWidth + kWidth) * 4; }

// The same values whether called on a fresh CPU module or a materialized one.
void InitLinear(torch::nn::Module& module) {
  auto* linear = dynamic_cast<torch::nn::LinearImpl*>(&module);
  if (linear == nullptr) return;
  at::NoGradGuard no_grad;
  for (at::Tensor* p : {&linear->weight, &linear->bias}) {
    // In place: no temporaries beside the parameter itself.
    at::Tensor flat = p->view({-1});
    at::arange_out(flat, p->numel());
    flat.mul_(1e-3).sin_().mul_(0.05);
  }
}

void InitEagerly(torch::nn::Module& model) {
  for (const auto& m : model.modules()) InitLinear(*m);
}

double ReadStatusMiB(const char* field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field, 0) == 0) return std::atof(line.c_str() + std::strlen(field)) / 1024.0;
  }
  return 0;
}

// Peak resident memory added while `build_and_wrap` runs (VmHWM after a
// reset, minus VmRSS before).
template <typename Fn>
double PeakGrowthMiB(const Fn& build_and_wrap) {
  malloc_trim(0);
  const double before = ReadStatusMiB("VmRSS:");
  std::ofstream("/proc/self/clear_refs") << "5";
  build_and_wrap();
  return ReadStatusMiB("VmHWM:") - before;
}

TEST(MetaInit, MaterializesUnitByUnitAndMatchesEagerInitialization) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
                Tower eager(/*deferred=*/false);
                InitEagerly(*eager);
                auto eager_fsdp = FullyShardedModel::Wrap(eager.ptr(), comm, {},
                                                          *ModuleTypePolicy::Of<WideBlockImpl>());
                ASSERT_TRUE(eager_fsdp.ok());
                Tower meta(/*deferred=*/true);
                EXPECT_EQ(meta->blocks[0]->as<WideBlockImpl>()->fc->weight.storage().nbytes(), 0u);
                FsdpOptions options;
                options.param_init_fn = InitLinear;
                auto meta_fsdp = FullyShardedModel::Wrap(meta.ptr(), comm, options,
                                                         *ModuleTypePolicy::Of<WideBlockImpl>());
                ASSERT_TRUE(meta_fsdp.ok()) << meta_fsdp.status();
                const at::Tensor x = at::sin(at::arange(3 * kWidth, at::kFloat)).view({3, kWidth});
                {
                  at::NoGradGuard no_grad;
                  EXPECT_TRUE(at::equal(meta->forward(x), eager->forward(x)));
                }
                SummonFullParams a(**meta_fsdp, {false}), b(**eager_fsdp, {false});
                const auto want = eager->named_parameters();
                for (const auto& item : meta->named_parameters()) {
                  EXPECT_GT(item.value().storage().nbytes(), 0u);
                  EXPECT_TRUE(at::equal(item.value(), want[item.key()])) << item.key();
                }
              });
  EXPECT_TRUE(status.ok()) << status;
}

// A parameter that cannot be released is named, and nothing is released.
TEST(MetaInit, DeferringANonContiguousParameterIsRefusedByName) {
  WideBlock block;
  block->register_parameter("transposed", at::ones({4, 2}).t());
  const absl::Status status = DeferParameterAllocation(*block);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("parameter 'transposed' is not contiguous"));
  for (const at::Tensor& p : block->parameters()) EXPECT_GT(p.storage().nbytes(), 0u);
}

TEST(MetaInit, WithoutParamInitFnDeferredParametersAreNamed) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
                Tower meta(/*deferred=*/true);
                auto wrapped = FullyShardedModel::Wrap(meta.ptr(), comm, {},
                                                       *ModuleTypePolicy::Of<WideBlockImpl>());
                EXPECT_THAT(wrapped.status().message(),
                            HasSubstr("parameter 'blocks.0.fc.weight' is deferred "
                                      "(DeferParameterAllocation); set "
                                      "FsdpOptions::param_init_fn"));
              });
  EXPECT_TRUE(status.ok()) << status;
}

// device_id on the host: every move is a no-op, and the path a GPU takes
// (materialize, move, shard, unit by unit) gives the eager model's values.
TEST(MetaInit, DeviceIdOnTheHostMatchesEagerInitialization) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
                Tower eager(/*deferred=*/false);
                InitEagerly(*eager);
                auto eager_fsdp = FullyShardedModel::Wrap(eager.ptr(), comm, {},
                                                          *ModuleTypePolicy::Of<WideBlockImpl>());
                ASSERT_TRUE(eager_fsdp.ok());
                Tower meta(/*deferred=*/true);
                FsdpOptions options;
                options.param_init_fn = InitLinear;
                options.device_id = c10::Device(c10::DeviceType::CPU);
                auto meta_fsdp = FullyShardedModel::Wrap(meta.ptr(), comm, options,
                                                         *ModuleTypePolicy::Of<WideBlockImpl>());
                ASSERT_TRUE(meta_fsdp.ok()) << meta_fsdp.status();
                SummonFullParams a(**meta_fsdp, {false}), b(**eager_fsdp, {false});
                const auto want = eager->named_parameters();
                for (const auto& item : meta->named_parameters()) {
                  EXPECT_TRUE(item.value().device().is_cpu()) << item.key();
                  EXPECT_TRUE(at::equal(item.value(), want[item.key()])) << item.key();
                }
              });
  EXPECT_TRUE(status.ok()) << status;
}

// Nothing is sharded when Wrap refuses device_id.
void ExpectUnwrapped(TowerImpl& model) {
  for (const auto& block : *model.blocks) {
    EXPECT_EQ(GetModuleUnit(block.get()), nullptr);
    const at::Tensor& weight = block->as<WideBlockImpl>()->fc->weight;
    EXPECT_EQ(weight.numel(), kWidth * kWidth);
    EXPECT_TRUE(weight.device().is_cpu());
  }
}

TEST(MetaInit, DeviceIdMustNameOneDevice) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
                for (const char* device : {"meta", "cuda"}) {
                  Tower model(/*deferred=*/false);
                  FsdpOptions options;
                  options.device_id = c10::Device(device);
                  auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, options,
                                                         *ModuleTypePolicy::Of<WideBlockImpl>());
                  EXPECT_EQ(wrapped.status().code(), absl::StatusCode::kInvalidArgument);
                  EXPECT_THAT(wrapped.status().message(),
                              HasSubstr(std::string("FsdpOptions::device_id must name a device "
                                                    "with its index (e.g. cuda:0), got '") +
                                        device + "'"));
                  ExpectUnwrapped(*model);
                }
              });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(MetaInit, DeviceIdThisBuildCannotReachIsRefusedBeforeAnyMove) {
  if (at::hasCUDA()) GTEST_SKIP() << "CUDA is available: //fsdp:cuda_test covers device_id";
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
                Tower model(/*deferred=*/false);
                FsdpOptions options;
                options.device_id = c10::Device("cuda:0");
                auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, options,
                                                       *ModuleTypePolicy::Of<WideBlockImpl>());
                EXPECT_THAT(wrapped.status().message(),
                            HasSubstr("cannot compute on cuda:0"));
                ExpectUnwrapped(*model);
              });
  EXPECT_TRUE(status.ok()) << status;
}

// Measured in each of 4 rank processes: building deferred and wrapping
// never holds the whole unsharded model (64 MiB); building eagerly does.
std::string FiguresPath(int rank) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp != nullptr ? tmp : "/tmp") + "/meta_init_rank" + std::to_string(rank);
}

TEST(MetaInit, PeakMemoryDuringWrapStaysNearAShardAndOneUnit) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's allocator quarantines freed memory, so RSS does not "
                  "track live memory; measured in the plain build";
#endif
  absl::Status status = RunOnProcessRanks(4, [](Collectives& comm) {
                // Freed buffers above 256 KiB go back to the kernel at once,
                // so that RSS tracks live memory.
                mallopt(M_MMAP_THRESHOLD, 256 * 1024);
                const double model_mib = ModelBytes() / 1048576.0;
                const double unit_mib = model_mib / kBlocks;
                // Eager first: it also pays the process's one-time allocations.
                const double eager_growth = PeakGrowthMiB([&] {
                  Tower model(/*deferred=*/false);
                  InitEagerly(*model);
                  auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, {},
                                                         *ModuleTypePolicy::Of<WideBlockImpl>());
                  ASSERT_TRUE(wrapped.ok());
                });
                const double meta_growth = PeakGrowthMiB([&] {
                  Tower model(/*deferred=*/true);
                  FsdpOptions options;
                  options.param_init_fn = InitLinear;
                  auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, options,
                                                         *ModuleTypePolicy::Of<WideBlockImpl>());
                  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
                });
                // Into a file the parent prints (rank processes log apart).
                std::ofstream(FiguresPath(comm.rank()))
                    << "rank " << comm.rank() << ": model " << model_mib << " MiB (unit "
                    << unit_mib << ", shard " << model_mib / 4
                    << "); peak growth while building and wrapping: deferred " << meta_growth
                    << " MiB, eagerly " << eager_growth << " MiB\n";
                EXPECT_GT(eager_growth, 0.9 * model_mib);
                // The rank's shard, plus about a unit's full parameters and
                // its flat copy; far from the whole model.
                EXPECT_LT(meta_growth, model_mib / 4 + 4 * unit_mib);
                EXPECT_LT(meta_growth, 0.5 * model_mib);
              });
  EXPECT_TRUE(status.ok()) << status;
  for (int rank = 0; rank < 4; ++rank) {
    std::ifstream figures(FiguresPath(rank));
    std::string line;
    if (std::getline(figures, line)) std::printf("%s\n", line.c_str());
  }
}

}  // namespace
}  // namespace fsdp
