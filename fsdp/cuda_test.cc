// FSDP on one CUDA device (world size 1, NCCL group): training matches the
// unwrapped model trained on the same device, with and without CPU offload
// and with bf16 mixed precision; offload moves shards, gradients and
// optimizer state off the device, measured with the caching allocator's
// statistics; full parameters are freed after backward.
//
// Needs a GPU and a CUDA-enabled libtorch: built under --config=cuda (tag
// manual, so //... never builds it) or by the CMake build against a pip
// torch. UNVERIFIED: no GPU has run it yet.
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "c10/cuda/CUDACachingAllocator.h"
#include "c10/cuda/CUDAFunctions.h"
#include "comm/nccl_collectives.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "gtest/gtest.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"

namespace fsdp {
namespace {

using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::MakeOptimizer;
using ::fsdp::testing::Net;
using ::fsdp::testing::Optim;
using ::fsdp::testing::Targets;

constexpr int kSteps = 4;
const c10::Device kCuda(c10::DeviceType::CUDA, 0);

int64_t DeviceBytesAllocated() {
  // Index 0 of every statistic array is the aggregate over pool types.
  return c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current;
}

struct Trained {
  std::vector<float> losses;
  std::map<std::string, at::Tensor> params;  // On the host.
  int64_t device_bytes_after_step = 0;
};

// `fsdp_options` null: the unwrapped model.
Trained Train(const FsdpOptions* fsdp_options, const NcclOptions& nccl = {}) {
  Net model;
  model->to(kCuda);
  std::unique_ptr<Collectives> group;
  std::unique_ptr<FullyShardedModel> wrapped;
  if (fsdp_options != nullptr) {
    group = CreateNcclCollectives(c10::make_intrusive<c10d::HashStore>(), 0, 1, 0, nccl).value();
    wrapped = FullyShardedModel::Wrap(model.ptr(), *group, *fsdp_options,
                                      SelectModulesOfType<BlockImpl>())
                  .value();
  }
  auto optimizer = MakeOptimizer(Optim::kAdam, model->parameters());
  Trained t;
  for (int step = 0; step < kSteps; ++step) {
    at::Tensor loss = at::mse_loss(model->forward(Inputs(step, 0).to(kCuda)).to(at::kFloat),
                                   Targets(step, 0).to(kCuda));
    loss.backward();
    if (wrapped != nullptr) EXPECT_EQ(wrapped->FullParamBytes(), 0) << "step " << step;
    optimizer->step();
    optimizer->zero_grad();
    t.losses.push_back(loss.item<float>());
  }
  c10::cuda::device_synchronize();
  t.device_bytes_after_step = DeviceBytesAllocated();
  std::optional<SummonFullParams> full;
  if (wrapped != nullptr) full.emplace(*wrapped, SummonOptions{/*writeback=*/false});
  for (const auto& item : model->named_parameters()) {
    t.params[item.key()] = item.value().detach().to(at::kCPU);
  }
  return t;
}

void ExpectClose(const Trained& got, const Trained& want, double tolerance) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], tolerance) << "step " << i;
  }
  for (const auto& [fqn, p] : want.params) {
    EXPECT_TRUE(at::allclose(got.params.at(fqn), p, tolerance, tolerance)) << fqn;
  }
}

TEST(CudaFsdp, FullShardMatchesTheUnwrappedModelOnTheDevice) {
  const Trained local = Train(nullptr);
  FsdpOptions options;
  ExpectClose(Train(&options), local, 1e-5);
}

// At world size 1 no collective reaches the transport; this checks that
// libtorch's ProcessGroupNCCL is created and linked with this build.
TEST(CudaFsdp, ProcessGroupTransportMatchesTheUnwrappedModel) {
  const Trained local = Train(nullptr);
  FsdpOptions options;
  NcclOptions nccl;
  nccl.transport = NcclTransport::kProcessGroup;
  ExpectClose(Train(&options, nccl), local, 1e-5);
}

TEST(CudaFsdp, OffloadMatchesAndKeepsModelStateOffTheDevice) {
  FsdpOptions options;
  const Trained on_device = Train(&options);
  options.offload_params = true;
  const Trained offloaded = Train(&options);
  ExpectClose(offloaded, on_device, 1e-6);
  // Parameters, gradients and two Adam moments: 4 x 4 bytes per parameter
  // leave the device.
  int64_t numel = 0;
  for (const auto& [fqn, p] : on_device.params) numel += p.numel();
  std::printf("device bytes after a step: %lld without offload, %lld with (%lld parameters)\n",
              static_cast<long long>(on_device.device_bytes_after_step),
              static_cast<long long>(offloaded.device_bytes_after_step),
              static_cast<long long>(numel));
  EXPECT_LE(offloaded.device_bytes_after_step, on_device.device_bytes_after_step - 4 * 4 * numel);
}

TEST(CudaFsdp, OffloadedShardsArePinnedHostMemory) {
  Net model;
  model->to(kCuda);
  auto group = CreateNcclCollectives(c10::make_intrusive<c10d::HashStore>(), 0, 1, 0).value();
  FsdpOptions options;
  options.offload_params = true;
  auto wrapped =
      FullyShardedModel::Wrap(model.ptr(), *group, options, SelectModulesOfType<BlockImpl>())
          .value();
  for (const auto& unit : wrapped->units()) {
    const FlatParamHandle& h = *unit->handle();
    EXPECT_EQ(h.compute_device(), kCuda);
    EXPECT_TRUE(h.local_shard().device().is_cpu());
    EXPECT_TRUE(h.local_shard().is_pinned()) << unit->fqn();
  }
}

TEST(CudaFsdp, Bf16MixedPrecisionTrainsCloseToFloat32) {
  const Trained local = Train(nullptr);
  FsdpOptions options;
  options.mixed_precision.param_dtype = DType::kBFloat16;
  ExpectClose(Train(&options), local, 5e-2);
}

}  // namespace
}  // namespace fsdp
