// FSDP on one CUDA device (world size 1, NCCL group): training matches the
// unwrapped model trained on the same device, with and without CPU offload
// and with bf16 mixed precision; offload moves shards, gradients and
// optimizer state off the device, measured with the caching allocator's
// statistics; full parameters are freed after backward; the rate limiter
// bounds the full parameters in flight. And several ranks
// (processes) sharing the GPU through staged collectives: the same model,
// and exactly the collectives the same run on the host issues. And an
// Unshard ahead of the forward seen stale after a queued shard update.
//
// Needs a GPU and a CUDA-enabled libtorch: built under --config=cuda (tag
// manual, so //... never builds it) or by the CMake build against a pip
// torch. Every case passed on one H100 with torch 2.11 on 2026-11-26
// (models/gpu_verify_h100/README.md); not yet run with torch 2.15 on a GPU.
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "ATen/cuda/Sleep.h"
#include "c10/cuda/CUDACachingAllocator.h"
#include "c10/cuda/CUDAFunctions.h"
#include "comm/block_quantization.h"
#include "comm/nccl_collectives.h"
#include "comm/staged_collectives.h"
#include "fsdp/flat_param_handle.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "fsdp/unit_forward.h"
#include "fsdp/unit_scheduler.h"
#include "fsdp/utilities.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"
#include "torch/nn/modules/container/sequential.h"
#include "torch/nn/modules/linear.h"

namespace fsdp {
namespace {

using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::MakeOptimizer;
using ::fsdp::testing::Net;
using ::fsdp::testing::Optim;
using ::fsdp::testing::RunOnProcessRanks;
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

// `fsdp_options` null: the unwrapped model. With device_id set, the model is
// built on the host and Wrap moves it.
Trained Train(const FsdpOptions* fsdp_options, const NcclOptions& nccl = {}) {
  Net model;
  if (fsdp_options == nullptr || !fsdp_options->device_id) model->to(kCuda);
  std::unique_ptr<Collectives> group;
  std::unique_ptr<FullyShardedModel> wrapped;
  if (fsdp_options != nullptr) {
    group = CreateNcclCollectives(c10::make_intrusive<c10d::HashStore>(), 0, 1, 0, nccl).value();
    wrapped = FullyShardedModel::Wrap(model.ptr(), *group, *fsdp_options,
                                      *ModuleTypePolicy::Of<BlockImpl>())
                  .value();
  }
  auto optimizer = MakeOptimizer(Optim::kAdam, model->parameters());
  Trained t;
  for (int step = 0; step < kSteps; ++step) {
    at::Tensor loss = at::mse_loss(model->forward(Inputs(step, 0).to(kCuda)).to(at::kFloat),
                                   Targets(step, 0).to(kCuda));
    loss.backward();
    if (wrapped != nullptr) {
      EXPECT_EQ(wrapped->FullParamBytes(), 0) << "step " << step;
    }
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

// The device kernels code every block into the bytes the host's do, and
// decode them into the same values.
TEST(CudaFsdp, BlockQuantizationKernelsCodeAsTheHostDoes) {
  at::manual_seed(5);
  // Runs of one block, of several (the last one short), and of single values.
  std::vector<QuantizationRun> runs;
  int64_t n = 0, param = 0;
  for (int64_t length : {256, 1, 100, 700, 7}) {
    runs.push_back({n, n, 0, length});
    n += length;
  }
  param = (n + 7) / 8 * 8;
  for (QuantizationRun& run : runs) {
    run.param_offset = param;
    param += run.blocks() * kBlockParamBytes;
  }
  const BlockTable table(runs);
  const BlockTable device_table = table.To(kCuda);
  for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    at::Tensor values = (at::randn({n}) * 0.02).to(dtype);
    values[300] = 1.5;                                     // One block far from zero.
    values[900] = std::numeric_limits<float>::infinity();  // One block of NaN.
    at::Tensor host_bytes = at::zeros({table.byte_end()}, at::kByte);
    QuantizeBlocks(values, host_bytes, table);
    at::Tensor device_bytes =
        at::zeros({table.byte_end()}, at::TensorOptions(kCuda).dtype(at::kByte));
    QuantizeBlocks(values.to(kCuda), device_bytes, device_table);
    EXPECT_TRUE(at::equal(device_bytes.cpu(), host_bytes)) << c10::toString(dtype);
    at::Tensor host_values = at::empty({n}, dtype);
    DequantizeBlocks(host_bytes, table, host_values);
    at::Tensor device_values = at::empty({n}, at::TensorOptions(kCuda).dtype(dtype));
    DequantizeBlocks(host_bytes.to(kCuda), device_table, device_values);
    // NaN != NaN: compare the finite values and where the NaNs are.
    const at::Tensor got = device_values.cpu();
    EXPECT_TRUE(at::equal(got.isnan(), host_values.isnan())) << c10::toString(dtype);
    EXPECT_TRUE(at::equal(got.nan_to_num(0), host_values.nan_to_num(0))) << c10::toString(dtype);
    EXPECT_GT(host_values.isnan().sum().item<int64_t>(), 0);
  }
}

// int8 all-gathers on the device train within the code's error of float32,
// and measurably off it (the code ran: at one rank too, by design).
TEST(CudaFsdp, Int8AllGatherTrainsOnTheDevice) {
  ASSERT_TRUE(CanQuantizeOn(kCuda));
  const Trained local = Train(nullptr);
  FsdpOptions options;
  options.all_gather_quantization = CommQuantization::kInt8;
  const Trained quantized = Train(&options);
  ExpectClose(quantized, local, 2e-2);
  float off = 0;
  for (const auto& [fqn, p] : local.params) {
    off = std::max(off, (quantized.params.at(fqn) - p).abs().max().item<float>());
  }
  EXPECT_GT(off, 1e-5);
}

TEST(CudaFsdp, DeviceIdMovesAHostModelAndTrainsTheSame) {
  const Trained local = Train(nullptr);
  FsdpOptions options;
  options.device_id = kCuda;
  ExpectClose(Train(&options), local, 1e-5);
}

// 8 units of 4 MiB: with device_id and offload, Wrap never holds more than
// about one unit on the device (its moved parameters and its flat buffer);
// the model built on the device first would hold all 32 MiB.
struct WideBlockImpl : torch::nn::Module, ShardableModule {
  WideBlockImpl() { fc = register_module("fc", torch::nn::Linear(1024, 1024)); }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    return unit.Return(at::tanh(fc->forward(x)));
  }
  torch::nn::Linear fc{nullptr};
};

TEST(CudaFsdp, DeviceIdWithOffloadWrapsUnitByUnit) {
  torch::nn::Sequential model;
  for (int i = 0; i < 8; ++i) model->push_back(std::make_shared<WideBlockImpl>());
  const int64_t unit_bytes = (1024 * 1024 + 1024) * 4;
  auto group = CreateNcclCollectives(c10::make_intrusive<c10d::HashStore>(), 0, 1, 0).value();
  FsdpOptions options;
  options.device_id = kCuda;
  options.offload_params = true;
  c10::cuda::device_synchronize();
  c10::cuda::CUDACachingAllocator::emptyCache();
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  const int64_t before = DeviceBytesAllocated();
  auto wrapped =
      FullyShardedModel::Wrap(model.ptr(), *group, options, *ModuleTypePolicy::Of<WideBlockImpl>());
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  const int64_t peak =
      c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak - before;
  std::printf("device peak during Wrap: %lld bytes (one unit: %lld, model: %lld)\n",
              static_cast<long long>(peak), static_cast<long long>(unit_bytes),
              static_cast<long long>(8 * unit_bytes));
  EXPECT_LE(peak, 3 * unit_bytes);
  for (const auto& unit : (*wrapped)->units()) {
    if (unit->handle() == nullptr) continue;
    EXPECT_EQ(unit->handle()->compute_device(), kCuda) << unit->fqn();
    EXPECT_TRUE(unit->handle()->local_shard().is_pinned()) << unit->fqn();
  }
  const at::Tensor x = at::ones({2, 1024}, at::TensorOptions().device(kCuda));
  EXPECT_TRUE(model->forward(x).is_cuda());
}

// A WideBlock that records where its weight's data is during its forward:
// the full parameters it was gathered into.
struct AddressRecordingBlockImpl : torch::nn::Module, ShardableModule {
  explicit AddressRecordingBlockImpl(std::vector<const void*>* addresses) : addresses(addresses) {
    fc = register_module("fc", torch::nn::Linear(1024, 1024));
  }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    addresses->push_back(fc->weight.data_ptr());
    return unit.Return(at::tanh(fc->forward(x)));
  }
  torch::nn::Linear fc{nullptr};
  std::vector<const void*>* addresses;
};

// The rate limiter (FsdpOptions::limit_all_gathers) has an effect. The
// compute stream is held behind a long kernel, so the host issues a whole
// forward of 8 units ahead of the device. A unit's full parameters, freed
// after its forward, cannot be reused until the compute stream has passed
// them (the caching allocator waits on the event record_stream left), so
// without the limiter every unit is gathered into new memory: 8 full
// buffers at once. With it, the host waits, before each all-gather, for the
// reshard two units back, and that unit's memory is reused: at most 3
// buffers.
TEST(CudaFsdp, RateLimiterBoundsTheFullParametersInFlight) {
  for (bool limit : {false, true}) {
    SCOPED_TRACE(limit ? "limit_all_gathers" : "no limit");
    std::vector<const void*> addresses;
    torch::nn::Sequential model;
    for (int i = 0; i < 8; ++i) {
      model->push_back(std::make_shared<AddressRecordingBlockImpl>(&addresses));
    }
    model->to(kCuda);
    auto group = CreateNcclCollectives(c10::make_intrusive<c10d::HashStore>(), 0, 1, 0).value();
    FsdpOptions options;
    options.limit_all_gathers = limit;
    auto wrapped = FullyShardedModel::Wrap(model.ptr(), *group, options,
                                           *ModuleTypePolicy::Of<AddressRecordingBlockImpl>())
                       .value();
    at::NoGradGuard no_grad;  // Every unit reshards after its forward.
    const at::Tensor x = at::ones({2, 1024}, at::TensorOptions().device(kCuda));
    model->forward(x);  // The first forward's one-time work stays out of the count.
    c10::cuda::device_synchronize();
    c10::cuda::CUDACachingAllocator::emptyCache();
    addresses.clear();
    const int64_t waits_before = wrapped->scheduler().rate_limiter().host_waits();
    at::cuda::sleep(int64_t{1} << 31);  // About a second on the compute stream.
    model->forward(x);
    const int64_t waits = wrapped->scheduler().rate_limiter().host_waits() - waits_before;
    c10::cuda::device_synchronize();
    ASSERT_EQ(addresses.size(), 8u);
    const size_t distinct = std::set<const void*>(addresses.begin(), addresses.end()).size();
    std::printf("%s: 8 units gathered into %zu distinct buffers; the host waited %lld times\n",
                limit ? "limit_all_gathers" : "no limit", distinct, static_cast<long long>(waits));
    if (limit) {
      EXPECT_LE(distinct, 3u);
      EXPECT_GT(waits, 0);
    } else {
      EXPECT_EQ(distinct, 8u);
      EXPECT_EQ(waits, 0);
    }
  }
}

// The all-gather stream waits for the compute stream before reading shards:
// an update of the shards queued on the compute stream behind a long kernel
// (as an optimizer step may be) is what the next forward computes with.
// Without that wait the gather (a copy at world size 1) runs at once on
// its own stream and reads the old values.
TEST(CudaFsdp, UnshardSeesShardUpdatesStillQueuedOnTheComputeStream) {
  for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
    torch::nn::Sequential model;
    for (int i = 0; i < 2; ++i) model->push_back(std::make_shared<WideBlockImpl>());
    model->to(kCuda);
    auto group = CreateNcclCollectives(c10::make_intrusive<c10d::HashStore>(), 0, 1, 0).value();
    FsdpOptions options;
    options.strategy = strategy;
    options.mixed_precision.param_dtype = at::kBFloat16;  // NO_SHARD then copies too.
    auto wrapped = FullyShardedModel::Wrap(model.ptr(), *group, options,
                                           *ModuleTypePolicy::Of<WideBlockImpl>())
                       .value();
    at::NoGradGuard no_grad;
    // In the compute dtype: nothing here asks FSDP to cast forward inputs.
    const at::Tensor x =
        at::ones({2, 1024}, at::TensorOptions().device(kCuda).dtype(at::kBFloat16));
    ASSERT_GT(model->forward(x).abs().max().item<float>(), 0);
    at::cuda::sleep(int64_t{1} << 31);  // About a second on the compute stream.
    for (const at::Tensor& p : model->parameters()) p.zero_();
    EXPECT_EQ(model->forward(x).abs().max().item<float>(), 0)
        << ShardingStrategyName(strategy);
  }
}

// Unshard ahead of the forward on the device (FullyShardedModel::Unshard):
// its copy of the shard is queued on the compute stream behind a long
// kernel, and a shard update queued after it (as an optimizer step would
// be) must not reach the gathered values; the step's first forward hook
// then finds the kept copy stale and gathers the unit again, so the forward
// computes with the update, as one that gathers it the ordinary way. Also with bf16 compute (the
// gather sends a cast of the copy) and with offload (the copy is made on the host).
TEST(CudaFsdp, AnUnshardAheadOfAQueuedShardUpdateIsGatheredAgain) {
  for (int config = 0; config < 3; ++config) {
    SCOPED_TRACE(config == 0 ? "float32" : config == 1 ? "bfloat16" : "offload");
    Net model;  // Its root opens a forward scope: each forward ends IDLE.
    model->to(kCuda);
    auto group = CreateNcclCollectives(c10::make_intrusive<c10d::HashStore>(), 0, 1, 0).value();
    FsdpOptions options;
    if (config == 1) options.mixed_precision.param_dtype = at::kBFloat16;
    options.offload_params = config == 2;
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), *group, options, *ModuleTypePolicy::Of<BlockImpl>())
            .value();
    at::NoGradGuard no_grad;
    const at::Tensor x = Inputs(0, 0).to(kCuda);
    ASSERT_GT(model->forward(x).abs().max().item<float>(), 0);
    at::cuda::sleep(int64_t{1} << 31);  // About a second on the compute stream.
    ASSERT_TRUE(wrapped->Unshard(*model->blocks[0]).ok());
    // blocks.0's shard; on the host when offloaded.
    for (const at::Tensor& p : model->blocks[0]->parameters()) p.zero_();
    const at::Tensor after_unshard = model->forward(x).to(at::kCPU);
    for (const auto& unit : wrapped->units()) {
      if (unit->handle() != nullptr) EXPECT_FALSE(unit->handle()->holds_kept_full());
    }
    EXPECT_EQ(wrapped->FullParamBytes(), 0);
    // A forward that gathers the updated shards the ordinary way.
    EXPECT_TRUE(at::equal(after_unshard, model->forward(x).to(at::kCPU)));
  }
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
      FullyShardedModel::Wrap(model.ptr(), *group, options, *ModuleTypePolicy::Of<BlockImpl>())
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
  options.mixed_precision.param_dtype = at::kBFloat16;
  ExpectClose(Train(&options), local, 5e-2);
}

// One rank of a run of W ranks on `device` (the GPU, or the host for the
// reference count of collectives): its rows of each global batch, the
// global loss, the full parameters at the end, and what its group carried.
struct RankRun {
  Trained trained;
  CollectiveCounters counters;
};

RankRun TrainRank(Collectives& group, const FsdpOptions& options, c10::Device device) {
  Net model;
  FsdpOptions on_device = options;
  if (device.is_cuda()) on_device.device_id = device;
  auto wrapped =
      FullyShardedModel::Wrap(model.ptr(), group, on_device, *ModuleTypePolicy::Of<BlockImpl>())
          .value();
  auto optimizer = MakeOptimizer(Optim::kAdam, model->parameters());
  const int64_t rows = kGlobalBatch / group.world_size();
  RankRun run;
  for (int step = 0; step < kSteps; ++step) {
    const at::Tensor x = Inputs(step, 0).narrow(0, group.rank() * rows, rows).to(device);
    const at::Tensor y = Targets(step, 0).narrow(0, group.rank() * rows, rows).to(device);
    at::Tensor loss = at::mse_loss(model->forward(x).to(at::kFloat), y);
    loss.backward();
    optimizer->step();
    optimizer->zero_grad();
    at::Tensor global = loss.detach().clone();
    group.AllReduce(global, ReduceOp::kAvg)->Wait();
    run.trained.losses.push_back(global.item<float>());
  }
  run.counters = group.counters();
  SummonFullParams full(*wrapped, SummonOptions{/*writeback=*/false});
  for (const auto& item : model->named_parameters()) {
    run.trained.params[item.key()] = item.value().detach().to(at::kCPU);
  }
  return run;
}

// NCCL refuses two ranks on one device; staged collectives carry them. At
// W = 2 and 3, for each strategy and in bf16: the global losses and final
// parameters of the unwrapped model trained on the whole batch on the GPU,
// and the same collectives, call for call and byte for byte, as the same
// ranks training on the host over Gloo directly.
TEST(CudaFsdp, RanksSharingTheGpuMatchTheUnwrappedModel) {
  const Trained local = Train(nullptr);
  for (int world_size : {2, 3}) {
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard,
                                      ShardingStrategy::kShardGradOp,
                                      ShardingStrategy::kNoShard}) {
      for (bool bf16 : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "W=" << world_size << " "
                                          << ShardingStrategyName(strategy)
                                          << (bf16 ? " bf16" : ""));
        FsdpOptions options;
        options.strategy = strategy;
        if (bf16) options.mixed_precision.param_dtype = at::kBFloat16;
        absl::Status status = RunOnProcessRanks(world_size, [&](Collectives& host) {
          const RankRun on_host = TrainRank(host, options, c10::Device(c10::kCPU));
          std::unique_ptr<Collectives> staged = CreateStagedCollectives(host, kCuda);
          const RankRun on_gpu = TrainRank(*staged, options, kCuda);
          ExpectClose(on_gpu.trained, local, bf16 ? 5e-2 : 1e-5);
          for (int op = 0; op < kNumCollectiveOps; ++op) {
            EXPECT_EQ(on_gpu.counters.calls[op], on_host.counters.calls[op]) << "op " << op;
            EXPECT_EQ(on_gpu.counters.bytes[op], on_host.counters.bytes[op]) << "op " << op;
          }
        });
        EXPECT_TRUE(status.ok()) << status;
      }
    }
  }
}

}  // namespace
}  // namespace fsdp
