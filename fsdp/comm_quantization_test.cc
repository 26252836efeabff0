// Quantized communication (all_gather_quantization, reduce_quantization):
// parity against a local reference that computes with the values every
// rank decodes (fsdp/quantized_gather.h), sums the gradients each rank
// decodes in float32 and steps full-precision masters; the bytes the
// collectives' counters see, exact summoned parameters, per-unit overrides
// through a policy spec, and the refusals.
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "fsdp/flat_param_handle.h"
#include "fsdp/fully_shard.h"
#include "fsdp/quantized_gather.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "fsdp/utilities.h"
#include "fsdp/wrap_plan.h"
#include "gtest/gtest.h"
#include "policies/registry.h"
#include "policies/wrap_policy.h"
#include "testing/multi_rank.h"
#include "torch/optim/sgd.h"

namespace fsdp {
namespace {

using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::g_in_block_forward;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::Net;
using ::fsdp::testing::RunOnThreadRanks;
using ::fsdp::testing::Targets;

constexpr int kSteps = 3;
constexpr int kWorld = 2;

torch::optim::SGD MakeSgd(std::vector<at::Tensor> params) {
  return torch::optim::SGD(std::move(params), torch::optim::SGDOptions(0.1).momentum(0.9));
}

at::Tensor RankInputs(int step, int rank) {
  const int64_t rows = kGlobalBatch / kWorld;
  return Inputs(step, 0).narrow(0, rank * rows, rows);
}

at::Tensor RankLoss(const at::Tensor& out, int step, int rank) {
  const int64_t rows = kGlobalBatch / kWorld;
  return at::mse_loss(out.to(at::kFloat), Targets(step, 0).narrow(0, rank * rows, rows));
}

// The values every rank computes with for a unit of `params` (all
// trainable, registration order) sharded over kWorld ranks: each rank's
// shard coded and decoded into `compute`, as the all-gather leaves them.
// QuantizedGather::RoundTrip codes them, so this reference checks what the
// handle and the collectives do with the code, not the code's layout,
// which //fsdp:quantized_gather_test checks against the bounds it promises.
std::vector<at::Tensor> Decoded(const std::vector<at::Tensor>& params, CommQuantization q,
                                at::ScalarType compute) {
  std::vector<FlatLayout::Param> specs;
  for (size_t i = 0; i < params.size(); ++i) {
    specs.push_back({"p" + std::to_string(i), params[i].sizes().vec(), true});
  }
  std::vector<at::Tensor> out(params.size());
  at::Tensor full;
  for (int r = 0; r < kWorld; ++r) {
    const FlatLayout layout = FlatLayout::Of(specs, true, kWorld, r);
    at::Tensor exact = at::zeros({layout.padded_numel()});
    for (size_t i = 0; i < params.size(); ++i) layout.FullViewOf(exact, i).copy_(params[i]);
    if (!full.defined()) full = at::zeros({layout.padded_numel()}, compute);
    const FlatLayout::Segment& seg = layout.segments().front();
    const at::Tensor shard = exact.narrow(0, layout.OwnedBegin(seg, r), seg.shard_numel);
    full.narrow(0, layout.OwnedBegin(seg, r), seg.shard_numel)
        .copy_(QuantizedGather(layout, kWorld, q, at::kCPU).RoundTrip(shard, compute));
    if (r == kWorld - 1) {
      for (size_t i = 0; i < params.size(); ++i) out[i] = layout.FullViewOf(full, i).clone();
    }
  }
  return out;
}

// What rank c holds after a quantized reduce-scatter of a unit's
// gradients, for every c, put together: each rank's gradients
// (`per_rank[r]`, registration order, already divided as the runtime
// pre-divides) laid out flat, chunk c of each coded and decoded as rank c's
// shard would be, and the W decoded chunks summed in rank order in float32.
std::vector<at::Tensor> ReducedInChunks(const std::vector<std::vector<at::Tensor>>& per_rank,
                                        CommQuantization q) {
  std::vector<FlatLayout::Param> specs;
  for (size_t i = 0; i < per_rank[0].size(); ++i) {
    specs.push_back({"p" + std::to_string(i), per_rank[0][i].sizes().vec(), true});
  }
  std::vector<at::Tensor> flat(kWorld);
  at::Tensor sum;
  for (int c = 0; c < kWorld; ++c) {
    const FlatLayout layout = FlatLayout::Of(specs, true, kWorld, c);
    const FlatLayout::Segment& seg = layout.segments().front();
    if (!sum.defined()) {
      sum = at::zeros({layout.padded_numel()});
      for (int r = 0; r < kWorld; ++r) {
        flat[r] = at::zeros({layout.padded_numel()});
        for (size_t i = 0; i < specs.size(); ++i) {
          layout.FullViewOf(flat[r], i).copy_(per_rank[r][i]);
        }
      }
    }
    const QuantizedGather codec(layout, kWorld, q, at::kCPU);
    at::Tensor chunk_sum;
    for (int r = 0; r < kWorld; ++r) {
      const at::Tensor decoded = codec.RoundTrip(
          flat[r].narrow(0, layout.OwnedBegin(seg, c), seg.shard_numel), at::kFloat);
      chunk_sum = r == 0 ? decoded.clone() : chunk_sum.add_(decoded);
    }
    sum.narrow(0, layout.OwnedBegin(seg, c), seg.shard_numel).copy_(chunk_sum);
  }
  const FlatLayout any = FlatLayout::Of(specs, true, kWorld, 0);
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < specs.size(); ++i) out.push_back(any.FullViewOf(sum, i).clone());
  return out;
}

struct Trajectory {
  std::vector<float> losses;
  std::map<std::string, at::Tensor> params;
};

// Full-precision masters; each step every replica computes with the
// decoded values of its units (the root: head; each block: its fc) and the
// float32 gradients are averaged over the ranks: exactly, or with
// `reduce` as ReducedInChunks sums them (float32 compute only).
Trajectory TrainLocally(CommQuantization q, at::ScalarType compute,
                        CommQuantization reduce = CommQuantization::kNone) {
  Net master;
  auto optimizer = MakeSgd(master->parameters());
  Trajectory t;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<std::vector<at::Tensor>> units = {{master->head->weight, master->head->bias}};
    for (const auto& block : *master->blocks) {
      units.push_back({block->as<BlockImpl>()->fc->weight, block->as<BlockImpl>()->fc->bias});
    }
    std::map<const void*, at::Tensor> value_of;
    for (const auto& unit : units) {
      at::NoGradGuard no_grad;
      std::vector<at::Tensor> values;
      for (const at::Tensor& p : unit) values.push_back(p.detach());
      const std::vector<at::Tensor> decoded =
          q == CommQuantization::kNone ? values : Decoded(values, q, compute);
      for (size_t i = 0; i < unit.size(); ++i) {
        value_of[unit[i].unsafeGetTensorImpl()] = decoded[i].to(compute);
      }
    }
    std::vector<at::Tensor> sums;
    for (const auto& p : master->parameters()) sums.push_back(at::zeros_like(p));
    std::vector<std::vector<at::Tensor>> grads(kWorld);  // Divided by kWorld, as pre-divided.
    float loss_sum = 0;
    for (int rank = 0; rank < kWorld; ++rank) {
      Net replica;
      {
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < replica->parameters().size(); ++i) {
          replica->parameters()[i].set_data(
              value_of.at(master->parameters()[i].unsafeGetTensorImpl()).clone());
        }
      }
      at::Tensor loss = RankLoss(replica->forward(RankInputs(step, rank).to(compute)), step, rank);
      loss.backward();
      loss_sum += loss.item<float>();
      for (size_t i = 0; i < sums.size(); ++i) {
        sums[i] += (replica->parameters()[i].grad().to(compute) / 2).to(at::kFloat);
        grads[rank].push_back(replica->parameters()[i].grad() / 2);
      }
    }
    if (reduce != CommQuantization::kNone) {
      std::map<const void*, size_t> index_of;
      for (size_t i = 0; i < sums.size(); ++i) {
        index_of[master->parameters()[i].unsafeGetTensorImpl()] = i;
      }
      for (const auto& unit : units) {
        std::vector<std::vector<at::Tensor>> per_rank(kWorld);
        for (int r = 0; r < kWorld; ++r) {
          for (const at::Tensor& p : unit) {
            per_rank[r].push_back(grads[r][index_of.at(p.unsafeGetTensorImpl())]);
          }
        }
        const std::vector<at::Tensor> reduced = ReducedInChunks(per_rank, reduce);
        for (size_t k = 0; k < unit.size(); ++k) {
          sums[index_of.at(unit[k].unsafeGetTensorImpl())] = reduced[k];
        }
      }
    }
    for (size_t i = 0; i < sums.size(); ++i) {
      master->parameters()[i].mutable_grad() = sums[i].to(compute).to(at::kFloat);
    }
    t.losses.push_back(loss_sum / kWorld);
    optimizer.step();
    optimizer.zero_grad();
  }
  for (const auto& item : master->named_parameters()) {
    t.params[item.key()] = item.value().detach().clone();
  }
  return t;
}

struct QuantCase {
  const char* name;
  ShardingStrategy strategy;
  CommQuantization quantization;
  std::optional<at::ScalarType> param_dtype;
  bool offload = false;
  CommQuantization reduce = CommQuantization::kNone;
};

std::string QuantCaseName(const ::testing::TestParamInfo<QuantCase>& info) {
  return info.param.name;
}

class CommQuantizationParity : public ::testing::TestWithParam<QuantCase> {};

TEST_P(CommQuantizationParity, MatchesALocalReferenceThatComputesWithTheDecodedValues) {
  const QuantCase c = GetParam();
  const at::ScalarType compute = c.param_dtype.value_or(at::kFloat);
  const Trajectory same_values = TrainLocally(c.quantization, compute, c.reduce);
  const Trajectory exact = TrainLocally(CommQuantization::kNone, compute);
  std::vector<float> error(kWorld), error_vs_exact(kWorld);
  ASSERT_TRUE(
      RunOnThreadRanks(kWorld, [&](Collectives& comm) {
        Net model;
        FsdpOptions options;
        options.strategy = c.strategy;
        options.mixed_precision.param_dtype = c.param_dtype;
        options.all_gather_quantization = c.quantization;
        options.reduce_quantization = c.reduce;
        options.offload_params = c.offload;
        auto wrapped =
            FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
        ASSERT_TRUE(wrapped.ok()) << wrapped.status();
        FullyShardedModel& fsdp = **wrapped;
        auto optimizer = MakeSgd(model->parameters());
        // What one all-gather of each unit moves: W messages; what the
        // reductions send, per step.
        int64_t root_bytes = 0, block_bytes = 0, reduce_bytes = 0;
        for (const auto& unit : fsdp.units()) {
          const FlatLayout& layout = unit->handle()->layout();
          (unit->is_root() ? root_bytes : block_bytes) +=
              c.quantization == CommQuantization::kNone
                  ? kWorld * layout.shard_numel() * 4
                  : kWorld *
                        QuantizedGather(layout, kWorld, c.quantization, at::kCPU).message_bytes();
          reduce_bytes +=
              c.reduce == CommQuantization::kNone
                  ? kWorld * layout.shard_numel() * c10::elementSize(compute)
                  : QuantizedReduceScatter(layout, kWorld, c.reduce, at::kCPU).sent_bytes();
        }
        std::vector<at::ScalarType> seen;
        g_in_block_forward = [&](int index) {
          seen.push_back(model->blocks[index]->as<BlockImpl>()->fc->weight.scalar_type());
        };
        for (int step = 0; step < kSteps; ++step) {
          comm.ResetCounters();
          at::Tensor loss =
              RankLoss(model->forward(RankInputs(step, comm.rank())), step, comm.rank());
          loss.backward();
          if (step > 0) {  // Step 0 adds lazy init's small all-gathers.
            const int64_t gathered = c.strategy == ShardingStrategy::kFullShard
                                         ? root_bytes + 2 * block_bytes
                                         : root_bytes + block_bytes;
            EXPECT_EQ(comm.counters().Bytes(CollectiveOp::kAllGather), gathered);
            const bool quantized = c.reduce != CommQuantization::kNone;
            EXPECT_EQ(comm.counters().Bytes(quantized ? CollectiveOp::kAllToAll
                                                      : CollectiveOp::kReduceScatter),
                      reduce_bytes);
            EXPECT_EQ(comm.counters().Bytes(quantized ? CollectiveOp::kReduceScatter
                                                      : CollectiveOp::kAllToAll),
                      0);
          }
          for (const at::Tensor& p : model->parameters()) {
            EXPECT_EQ(p.scalar_type(), at::kFloat);  // The shards stay exact.
          }
          optimizer.step();
          optimizer.zero_grad();
          at::Tensor global = loss.detach().clone();
          comm.AllReduce(global, ReduceOp::kAvg)->Wait();
          error[comm.rank()] = std::max(error[comm.rank()],
                                        std::abs(global.item<float>() - same_values.losses[step]));
        }
        g_in_block_forward = nullptr;
        for (at::ScalarType dtype : seen) EXPECT_EQ(dtype, compute);
        // Summoned parameters are the masters, gathered exactly.
        SummonFullParams full(fsdp, {/*writeback=*/false});
        for (const auto& item : model->named_parameters()) {
          const float off =
              (item.value() - same_values.params.at(item.key())).abs().max().item<float>();
          error[comm.rank()] = std::max(error[comm.rank()], off);
          error_vs_exact[comm.rank()] =
              std::max(error_vs_exact[comm.rank()],
                       (item.value() - exact.params.at(item.key())).abs().max().item<float>());
        }
      }).ok());
  const float worst = std::max(error[0], error[1]);
  const float worst_exact = std::max(error_vs_exact[0], error_vs_exact[1]);
  std::printf("| %s | max |FSDP - decoded-values reference| %.2e | max |FSDP - exact run| %.2e |\n",
              c.name, worst, worst_exact);
  EXPECT_LT(worst, c.param_dtype ? 1e-5 : 1e-6);
  // The quantization happened: the run is measurably off the exact one.
  EXPECT_GT(worst_exact, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CommQuantizationParity,
    ::testing::Values(
        QuantCase{"FullShard_int8", ShardingStrategy::kFullShard, CommQuantization::kInt8,
                  std::nullopt},
        QuantCase{"ShardGradOp_int8", ShardingStrategy::kShardGradOp, CommQuantization::kInt8,
                  std::nullopt},
        QuantCase{"FullShard_bf16", ShardingStrategy::kFullShard, CommQuantization::kBf16,
                  std::nullopt},
        QuantCase{"FullShard_int8_param_bf16", ShardingStrategy::kFullShard,
                  CommQuantization::kInt8, at::kBFloat16},
        QuantCase{"FullShard_int8_offload", ShardingStrategy::kFullShard, CommQuantization::kInt8,
                  std::nullopt, /*offload=*/true},
        QuantCase{"FullShard_reduce_int8", ShardingStrategy::kFullShard, CommQuantization::kNone,
                  std::nullopt, false, CommQuantization::kInt8},
        QuantCase{"FullShard_reduce_bf16", ShardingStrategy::kFullShard, CommQuantization::kNone,
                  std::nullopt, false, CommQuantization::kBf16},
        QuantCase{"ShardGradOp_both_int8", ShardingStrategy::kShardGradOp, CommQuantization::kInt8,
                  std::nullopt, false, CommQuantization::kInt8},
        QuantCase{"FullShard_reduce_int8_offload", ShardingStrategy::kFullShard,
                  CommQuantization::kNone, std::nullopt, /*offload=*/true,
                  CommQuantization::kInt8}),
    QuantCaseName);

// A policy spec sets it per unit: the blocks gather in int8, the root as
// it is; the plan says so.
TEST(AllGatherQuantization, APolicySetsItPerUnit) {
  absl::StatusOr<std::unique_ptr<WrapPolicy>> policy =
      PolicyRegistry::Global().Build("module:Block,all_gather_quantization=int8");
  ASSERT_TRUE(policy.ok()) << policy.status();
  ASSERT_TRUE(
      RunOnThreadRanks(kWorld, [&](Collectives& comm) {
        Net model;
        absl::StatusOr<WrapPlan> plan = PlanWrap(*model, kWorld, FsdpOptions{}, **policy);
        ASSERT_TRUE(plan.ok()) << plan.status();
        EXPECT_NE(plan->ToString().find("blocks.0 (fsdp::testing::BlockImpl): FULL_SHARD "
                                        "(override), all-gather int8"),
                  std::string::npos)
            << plan->ToString();
        auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, FsdpOptions{}, **policy);
        ASSERT_TRUE(wrapped.ok()) << wrapped.status();
        int64_t root = 0, blocks = 0;
        for (const auto& unit : (*wrapped)->units()) {
          const FlatLayout& layout = unit->handle()->layout();
          if (unit->is_root()) {
            root = kWorld * layout.shard_numel() * 4;
          } else {
            blocks +=
                kWorld *
                QuantizedGather(layout, kWorld, CommQuantization::kInt8, at::kCPU).message_bytes();
          }
        }
        model->forward(RankInputs(0, comm.rank())).sum().backward();
        comm.ResetCounters();
        model->forward(RankInputs(1, comm.rank())).sum().backward();
        EXPECT_EQ(comm.counters().Bytes(CollectiveOp::kAllGather), root + 2 * blocks);
      }).ok());
}

// Ranks whose policies quantize different units would all-gather bytes on
// one rank and floats on another: the wrap check names it instead.
TEST(AllGatherQuantization, RanksThatQuantizeDifferentlyAreNamedAtTheFirstForward) {
  absl::StatusOr<std::unique_ptr<WrapPolicy>> int8 =
      PolicyRegistry::Global().Build("module:Block,all_gather_quantization=int8");
  absl::StatusOr<std::unique_ptr<WrapPolicy>> plain =
      PolicyRegistry::Global().Build("module:Block");
  ASSERT_TRUE(int8.ok() && plain.ok());
  ASSERT_TRUE(RunOnThreadRanks(kWorld, [&](Collectives& comm) {
                Net model;
                auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, FsdpOptions{},
                                                       comm.rank() == 0 ? **int8 : **plain);
                ASSERT_TRUE(wrapped.ok()) << wrapped.status();
                try {
                  model->forward(RankInputs(0, comm.rank()));
                  ADD_FAILURE() << "different quantization was not detected";
                } catch (const c10::Error& e) {
                  EXPECT_NE(std::string(e.what()).find("ranks wrapped the model differently"),
                            std::string::npos)
                      << e.what();
                }
              }).ok());
}

TEST(AllGatherQuantization, WrapRefusesItWhereItCannotApplyNamingTheUnit) {
  ASSERT_TRUE(
      RunOnThreadRanks(kWorld, [&](Collectives& comm) {
        Net model;
        FsdpOptions options;
        options.strategy = ShardingStrategy::kNoShard;
        options.all_gather_quantization = CommQuantization::kInt8;
        auto wrapped =
            FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
        ASSERT_FALSE(wrapped.ok());
        EXPECT_NE(wrapped.status().message().find(
                      "unit '<root>' has all_gather_quantization=int8 but its strategy "
                      "is NO_SHARD"),
                  std::string::npos)
            << wrapped.status();
        // The model is untouched: it wraps again without the option.
        options.all_gather_quantization = CommQuantization::kBf16;
        options.strategy = ShardingStrategy::kFullShard;
        options.mixed_precision.param_dtype = at::kBFloat16;
        wrapped =
            FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
        ASSERT_FALSE(wrapped.ok());
        EXPECT_NE(wrapped.status().message().find("already all-gathers in BFloat16"),
                  std::string::npos)
            << wrapped.status();
        options.all_gather_quantization = CommQuantization::kNone;
        // The same for the reduction: bf16 over a bf16 reduce_dtype...
        options.mixed_precision.param_dtype = std::nullopt;
        options.mixed_precision.reduce_dtype = at::kBFloat16;
        options.reduce_quantization = CommQuantization::kBf16;
        wrapped =
            FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
        ASSERT_FALSE(wrapped.ok());
        EXPECT_NE(wrapped.status().message().find(
                      "has reduce_quantization=bf16 but it already reduce-scatters in "
                      "BFloat16"),
                  std::string::npos)
            << wrapped.status();
        // ... and NO_SHARD.
        options.mixed_precision.reduce_dtype = std::nullopt;
        options.reduce_quantization = CommQuantization::kInt8;
        options.strategy = ShardingStrategy::kNoShard;
        wrapped =
            FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
        ASSERT_FALSE(wrapped.ok());
        EXPECT_NE(wrapped.status().message().find(
                      "has reduce_quantization=int8 but its strategy is NO_SHARD, which "
                      "reduce-scatters nothing"),
                  std::string::npos)
            << wrapped.status();
        options.reduce_quantization = CommQuantization::kNone;
        EXPECT_TRUE(
            FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>())
                .ok());
      }).ok());
}

// A comm hook replaces the reduction reduce_quantization quantizes: the
// two are not combined silently.
TEST(ReduceQuantization, ACommHookIsRefusedNamingTheUnit) {
  ASSERT_TRUE(RunOnThreadRanks(kWorld, [&](Collectives& comm) {
                Net model;
                FsdpOptions options;
                options.reduce_quantization = CommQuantization::kInt8;
                auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, options,
                                                       *ModuleTypePolicy::Of<BlockImpl>());
                ASSERT_TRUE(wrapped.ok()) << wrapped.status();
                const absl::Status hooked =
                    (*wrapped)->RegisterCommHook(std::make_shared<DefaultCommHook>());
                EXPECT_EQ(hooked.code(), absl::StatusCode::kInvalidArgument);
                EXPECT_NE(hooked.message().find(
                              "unit '<root>' has reduce_quantization; a hook replaces it"),
                          std::string::npos)
                    << hooked;
              }).ok());
}

}  // namespace
}  // namespace fsdp
