#include "fsdp/flat_param_handle.h"

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "ATen/ATen.h"
#include "c10/util/Exception.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "fsdp/test_util.h"
#include "testing/multi_rank.h"
#include "torch/nn/module.h"
#include "torch/nn/modules/linear.h"
#include "torch/optim/adam.h"
#include "torch/optim/sgd.h"

namespace fsdp {
namespace {

using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::MakeOptimizer;
using ::fsdp::testing::Optim;
using ::fsdp::testing::RunOnThreadRanks;
using ::fsdp::testing::Targets;
using ::testing::HasSubstr;

// A small MLP with odd sizes, so that flat parameters need padding at every
// world size. Values come from a formula, not an RNG, so that every rank
// thread builds the same model without sharing a generator.
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(7, 13));
    fc2 = register_module("fc2", torch::nn::Linear(13, 11));
    fc3 = register_module("fc3", torch::nn::Linear(11, 5));
    testing::FillDeterministically(*this);
  }
  at::Tensor forward(at::Tensor x) {
    x = at::tanh(fc1->forward(x));
    x = at::tanh(fc2->forward(x));
    return fc3->forward(x);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);


// Units: one per Linear ("per-layer") or one for the whole model.
std::vector<std::vector<std::string>> UnitPrefixes(bool per_layer) {
  if (per_layer) return {{"fc1."}, {"fc2."}, {"fc3."}};
  return {{"fc1.", "fc2.", "fc3."}};
}

struct Trajectory {
  std::vector<float> losses;
  std::map<std::string, at::Tensor> params;  // Final, full.
};

constexpr int kSteps = 5;

// Single-process training on the global batch.
Trajectory TrainLocally(Optim kind, int micro_batches) {
  Mlp model;
  auto optimizer = MakeOptimizer(kind, model->parameters());
  Trajectory t;
  for (int step = 0; step < kSteps; ++step) {
    float loss_sum = 0;
    for (int micro = 0; micro < micro_batches; ++micro) {
      at::Tensor loss =
          at::mse_loss(model->forward(Inputs(step, micro)), Targets(step, micro));
      loss.backward();
      loss_sum += loss.item<float>();
    }
    t.losses.push_back(loss_sum / micro_batches);
    optimizer->step();
    optimizer->zero_grad();
  }
  for (const auto& item : model->named_parameters()) {
    t.params[item.key()] = item.value().detach().clone();
  }
  return t;
}

struct ParityCase {
  int world_size;
  ShardingStrategy strategy;
  bool per_layer;
  Optim optim;
  int micro_batches;
};

std::string CaseName(const ParityCase& c) {
  return "W" + std::to_string(c.world_size) + "_" + ShardingStrategyName(c.strategy) +
         (c.per_layer ? "_PerLayer" : "_WholeModel") +
         (c.optim == Optim::kSgdMomentum ? "_SgdMomentum" : "_Adam") +
         (c.micro_batches > 1 ? "_Accumulate" + std::to_string(c.micro_batches) : "");
}

class FlatParamHandleParity : public ::testing::TestWithParam<ParityCase> {};

// Drives the handles by hand the way the runtime will: unshard before
// forward, reshard after it (FULL_SHARD), unshard again and take the
// gradients back before backward, reduce-scatter and reshard after it.
// Every step's loss and the final parameters must match TrainLocally.
TEST_P(FlatParamHandleParity, MatchesLocalTraining) {
  const ParityCase c = GetParam();
  const Trajectory expected = TrainLocally(c.optim, c.micro_batches);
  absl::Status status = RunOnThreadRanks(c.world_size, [&](Collectives& comm) {
    Mlp model;
    std::vector<std::unique_ptr<FlatParamHandle>> handles;
    const auto named = model->named_parameters();
    for (const auto& prefixes : UnitPrefixes(c.per_layer)) {
      std::vector<FlatParamEntry> entries;
      for (const auto& item : named) {
        for (const std::string& prefix : prefixes) {
          if (item.key().rfind(prefix, 0) == 0) entries.push_back({item.key(), item.value()});
        }
      }
      ResolvedUnitOptions options;
      options.strategy = c.strategy;
      auto handle = FlatParamHandle::Create(prefixes.front(), entries, comm, options);
      ASSERT_TRUE(handle.ok()) << handle.status();
      handles.push_back(std::move(*handle));
    }
    // Built after wrapping: the optimizer sees the shards.
    auto optimizer = MakeOptimizer(c.optim, model->parameters());
    const int64_t rows = kGlobalBatch / comm.world_size();
    const bool full_shard = c.strategy == ShardingStrategy::kFullShard;
    const bool sharded = c.strategy != ShardingStrategy::kNoShard;
    const int64_t units = static_cast<int64_t>(handles.size());
    for (int step = 0; step < kSteps; ++step) {
      comm.ResetCounters();
      at::Tensor loss_sum = at::zeros({1});
      for (int micro = 0; micro < c.micro_batches; ++micro) {
        at::Tensor x = Inputs(step, micro).narrow(0, comm.rank() * rows, rows);
        at::Tensor y = Targets(step, micro).narrow(0, comm.rank() * rows, rows);
        for (auto& h : handles) h->Unshard();
        at::Tensor loss = at::mse_loss(model->forward(x), y);
        if (full_shard) {
          for (auto& h : handles) h->Reshard();
          for (auto& h : handles) EXPECT_EQ(h->full_param_bytes(), 0);
        }
        for (auto& h : handles) {
          h->Unshard();
          h->PrepareGradientsForBackward();
        }
        loss.backward();
        for (auto& h : handles) {
          h->ReduceGradients();
          h->Reshard();
        }
        loss_sum += loss.detach();
      }
      // Counted communication: exactly what the strategy needs.
      const CollectiveCounters counted = comm.counters();
      const int64_t per_pass = full_shard ? 2 : (sharded ? 1 : 0);
      EXPECT_EQ(counted.Calls(CollectiveOp::kAllGather),
                per_pass * units * c.micro_batches);
      EXPECT_EQ(counted.Calls(CollectiveOp::kReduceScatter),
                sharded ? units * c.micro_batches : 0);
      EXPECT_EQ(counted.Calls(CollectiveOp::kAllReduce), sharded ? 0 : units * c.micro_batches);
      int64_t padded_bytes = 0;
      for (auto& h : handles) padded_bytes += h->layout().padded_numel() * 4;
      EXPECT_EQ(counted.Bytes(CollectiveOp::kAllGather),
                per_pass * padded_bytes * c.micro_batches);
      EXPECT_EQ(counted.Bytes(CollectiveOp::kReduceScatter),
                sharded ? padded_bytes * c.micro_batches : 0);

      optimizer->step();
      optimizer->zero_grad();
      comm.AllReduce(loss_sum, ReduceOp::kAvg)->Wait();
      const float loss = loss_sum.item<float>() / c.micro_batches;
      // float32 sums over ranks of per-rank means (with the pre/post
      // divide) are not bitwise the global mean; 1e-5 relative covers that
      // rounding over 5 steps and is far below any real mistake (a missed
      // or doubled gradient moves the loss by >1e-2).
      EXPECT_NEAR(loss, expected.losses[step], 1e-5 * std::abs(expected.losses[step]) + 1e-7)
          << "step " << step;
    }
    // Persistent parameter storage is the shard, padding included.
    for (auto& h : handles) {
      const int64_t expected_shard =
          sharded ? (h->layout().flat_numel() + comm.world_size() - 1) / comm.world_size()
                  : h->layout().flat_numel();
      EXPECT_EQ(h->layout().shard_numel(), expected_shard);
      EXPECT_EQ(h->full_param_bytes(), 0);
      h->Unshard();
    }
    for (const auto& item : model->named_parameters()) {
      const at::Tensor& want = expected.params.at(item.key());
      EXPECT_TRUE(at::allclose(item.value().detach(), want, /*rtol=*/1e-5, /*atol=*/1e-6))
          << item.key() << " max diff "
          << (item.value().detach() - want).abs().max().item<float>();
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

std::vector<ParityCase> ParityCases() {
  std::vector<ParityCase> cases;
  for (int w : {1, 2, 3, 4}) {
    for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                               ShardingStrategy::kNoShard}) {
      for (bool per_layer : {true, false}) {
        for (Optim o : {Optim::kSgdMomentum, Optim::kAdam}) {
          cases.push_back({w, s, per_layer, o, 1});
        }
      }
    }
  }
  // Gradient accumulation over two micro-batches.
  for (int w : {2, 3}) {
    for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
      cases.push_back({w, s, true, Optim::kAdam, 2});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, FlatParamHandleParity, ::testing::ValuesIn(ParityCases()),
                         [](const ::testing::TestParamInfo<ParityCase>& info) {
                           return CaseName(info.param);
                         });

TEST(FlatParamHandle, ShardsWithPaddingAndKeepsParameterIdentity) {
  absl::Status status = RunOnThreadRanks(3, [](Collectives& comm) {
    // 15 + 7 + 4 = 26 elements: padded to 27, shards of 9.
    at::Tensor a = (at::arange(15, at::kFloat).view({5, 3}) + 100).requires_grad_();
    at::Tensor b = (at::arange(7, at::kFloat) + 200).requires_grad_();
    at::Tensor c = (at::arange(4, at::kFloat).view({2, 2}) + 300).requires_grad_();
    const auto* a_impl = a.unsafeGetTensorImpl();
    auto handle = FlatParamHandle::Create("unit", {{"a", a}, {"b", b}, {"c", c}}, comm);
    ASSERT_TRUE(handle.ok()) << handle.status();
    FlatParamHandle& h = **handle;
    EXPECT_EQ(h.layout().flat_numel(), 26);
    EXPECT_EQ(h.layout().padded_numel(), 27);
    EXPECT_EQ(h.layout().shard_numel(), 9);
    EXPECT_EQ(h.local_shard().nbytes(), 9 * 4) << "persistent storage is the shard";
    EXPECT_EQ(a.unsafeGetTensorImpl(), a_impl) << "the parameter keeps its identity";
    // Rank 0 owns a[0:9]; rank 1 a[9:15], b[0:3]; rank 2 b[3:7], c, padding.
    const std::vector<std::vector<int64_t>> owned = {{9, 0, 0}, {6, 3, 0}, {0, 4, 4}};
    const int r = comm.rank();
    EXPECT_EQ(a.numel(), owned[r][0]);
    EXPECT_EQ(b.numel(), owned[r][1]);
    EXPECT_EQ(c.numel(), owned[r][2]);
    EXPECT_EQ(h.layout().params()[1].shard_offset, r == 2 ? 3 : 0);
    if (r == 1) {
      EXPECT_TRUE(at::equal(a.detach(), at::arange(9, 15, at::kFloat) + 100));
      EXPECT_TRUE(at::equal(b.detach(), at::arange(3, at::kFloat) + 200));
    }
    if (r == 2) EXPECT_EQ(h.local_shard()[8].item<float>(), 0) << "padding is zero";

    h.Unshard();
    EXPECT_EQ(h.full_param_bytes(), 27 * 4);
    EXPECT_TRUE(at::equal(a.detach(), at::arange(15, at::kFloat).view({5, 3}) + 100));
    EXPECT_TRUE(at::equal(c.detach(), at::arange(4, at::kFloat).view({2, 2}) + 300));
    const auto* storage = a.storage().unsafeGetStorageImpl();
    h.Reshard();
    EXPECT_EQ(h.full_param_bytes(), 0) << "resharding frees the full parameter";
    h.Unshard();
    EXPECT_EQ(a.storage().unsafeGetStorageImpl(), storage)
        << "the full parameter's storage object survives resharding, so saved views stay valid";
    EXPECT_EQ(a.unsafeGetTensorImpl(), a_impl);
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Frozen parameters between trainable ones: the trainable segment comes
// first, each segment is padded and split apart, the unshard restores every
// parameter, and only the trainable segment is reduced and holds gradients.
TEST(FlatParamHandle, FrozenAndTrainableParametersLieInTwoSegments) {
  absl::Status status = RunOnThreadRanks(3, [](Collectives& comm) {
    // Trainable a (5) and c (2): 7 -> padded 9, 3 per rank. Frozen b (4):
    // 4 -> padded 6, 2 per rank.
    at::Tensor a = (at::arange(5, at::kFloat) + 100).requires_grad_();
    at::Tensor b = at::arange(4, at::kFloat).view({2, 2}) + 200;
    at::Tensor c = (at::arange(2, at::kFloat) + 300).requires_grad_();
    auto handle = FlatParamHandle::Create("unit", {{"a", a}, {"b", b}, {"c", c}}, comm);
    ASSERT_TRUE(handle.ok()) << handle.status();
    FlatParamHandle& h = **handle;
    EXPECT_EQ(h.layout().flat_numel(), 11);
    EXPECT_EQ(h.layout().trainable_numel(), 7);
    EXPECT_EQ(h.layout().padded_numel(), 15);
    EXPECT_EQ(h.layout().shard_numel(), 5);
    EXPECT_EQ(h.layout().trainable_shard_numel(), 3);
    EXPECT_EQ(h.layout().params()[1].offset, 9)
        << "the frozen segment follows the padded trainable";
    EXPECT_EQ(h.layout().params()[2].offset, 5);
    // Trainable segment [a0..a4 c0 c1 pad pad]: rank 0 a[0:3], rank 1
    // a[3:5] c[0:1], rank 2 c[1:2]. Frozen [b0..b3 pad pad]: two each.
    const int r = comm.rank();
    const std::vector<std::vector<int64_t>> owned = {{3, 2, 0}, {2, 2, 1}, {0, 0, 1}};
    EXPECT_EQ(a.numel(), owned[r][0]);
    EXPECT_EQ(b.numel(), owned[r][1]);
    EXPECT_EQ(c.numel(), owned[r][2]);
    const std::vector<std::vector<float>> shards = {
        {100, 101, 102, 200, 201}, {103, 104, 300, 202, 203}, {301, 0, 0, 0, 0}};
    EXPECT_TRUE(at::equal(h.local_shard(), at::tensor(shards[r])));

    comm.ResetCounters();
    h.Unshard();
    EXPECT_EQ(comm.counters().Calls(CollectiveOp::kAllGather), 2) << "one per segment";
    EXPECT_EQ(h.full_param_bytes(), 15 * 4);
    EXPECT_TRUE(at::equal(a.detach(), at::arange(5, at::kFloat) + 100));
    EXPECT_TRUE(at::equal(b.detach(), at::arange(4, at::kFloat).view({2, 2}) + 200));
    EXPECT_TRUE(at::equal(c.detach(), at::arange(2, at::kFloat) + 300));
    h.PrepareGradientsForBackward();
    ((a * 2).sum() + (b.detach() * c.sum()).sum()).backward();  // da = 2, dc = sum(b) = 806.
    h.ReduceGradients();
    EXPECT_EQ(comm.counters().Bytes(CollectiveOp::kReduceScatter), 9 * 4)
        << "only the trainable segment is reduced";
    h.Reshard();
    EXPECT_FALSE(b.grad().defined());
    EXPECT_TRUE(at::allclose(a.grad(), at::full({owned[r][0]}, 2.0)));
    EXPECT_TRUE(at::allclose(c.grad(), at::full({owned[r][2]}, 806.0)));
    EXPECT_EQ(h.ShardBytesOn(c10::DeviceType::CPU), (5 + 3) * 4);

    // Changes to the full parameters reach both segments' shards.
    h.Transition(HandleTrainingState::kIdle, HandleTrainingState::kSummonFullParams);
    h.Unshard();
    {
      at::NoGradGuard no_grad;
      b.add_(1000);
      c.add_(1000);
    }
    h.WritebackShard();
    h.Reshard();
    h.Transition(HandleTrainingState::kSummonFullParams, HandleTrainingState::kIdle);
    h.Unshard();
    EXPECT_TRUE(at::equal(b.detach(), at::arange(4, at::kFloat).view({2, 2}) + 1200));
    EXPECT_TRUE(at::equal(c.detach(), at::arange(2, at::kFloat) + 1300));
    EXPECT_TRUE(at::equal(a.detach(), at::arange(5, at::kFloat) + 100));
    h.Reshard();
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A group without elements has no segment of its own: an empty frozen
// parameter costs a trainable unit no second all-gather, and an empty
// trainable one does not make a frozen unit reduce.
TEST(FlatParamHandle, EmptyParametersAddNoSegment) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    at::Tensor a = at::ones({5}).requires_grad_();
    at::Tensor empty_frozen = at::ones({0});
    auto trainable = FlatParamHandle::Create("t", {{"a", a}, {"e", empty_frozen}}, comm);
    ASSERT_TRUE(trainable.ok()) << trainable.status();
    EXPECT_TRUE((*trainable)->layout().has_trainable_params());
    EXPECT_EQ((*trainable)->layout().shard_numel(), 3);
    comm.ResetCounters();
    (*trainable)->Unshard();
    EXPECT_EQ(comm.counters().Calls(CollectiveOp::kAllGather), 1);
    EXPECT_EQ(empty_frozen.numel(), 0);
    EXPECT_TRUE(at::equal(a.detach(), at::ones({5})));
    (*trainable)->Reshard();

    at::Tensor f = at::ones({3});
    at::Tensor empty_trainable = at::ones({0}).requires_grad_();
    auto frozen = FlatParamHandle::Create("f", {{"z", empty_trainable}, {"f", f}}, comm);
    ASSERT_TRUE(frozen.ok()) << frozen.status();
    EXPECT_FALSE((*frozen)->layout().has_trainable_params());
    EXPECT_EQ((*frozen)->layout().trainable_shard_numel(), 0);
    EXPECT_EQ((*frozen)->layout().shard_numel(), 2);
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Gradients accumulate across backward passes; one the user cleared (set
// undefined) restarts from zero, one the user replaced continues from the
// replacement.
TEST(FlatParamHandle, AccumulationFollowsWhatTheUserDidToGrad) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    at::Tensor w = at::ones({4}).requires_grad_();
    at::Tensor v = at::ones({2}).requires_grad_();
    auto handle = FlatParamHandle::Create("unit", {{"w", w}, {"v", v}}, comm);
    ASSERT_TRUE(handle.ok()) << handle.status();
    FlatParamHandle& h = **handle;
    auto pass = [&] {
      h.Unshard();
      h.PrepareGradientsForBackward();
      ((w * 2).sum() + (v * 3).sum()).backward();  // dw = 2, dv = 3 on each rank.
      h.ReduceGradients();
      h.Reshard();
    };
    pass();
    pass();
    // Shards of 3: rank 0 owns w[0:3], rank 1 owns w[3], v[0:2].
    EXPECT_TRUE(at::allclose(w.grad(), at::full({comm.rank() == 0 ? 3 : 1}, 4.0)));
    if (comm.rank() == 1) EXPECT_TRUE(at::allclose(v.grad(), at::full({2}, 6.0)));
    w.mutable_grad() = at::Tensor();
    pass();
    EXPECT_TRUE(at::allclose(w.grad(), at::full({comm.rank() == 0 ? 3 : 1}, 2.0)));
    if (comm.rank() == 1) EXPECT_TRUE(at::allclose(v.grad(), at::full({2}, 9.0)));
    // A gradient the user replaced is what accumulation continues from.
    if (comm.rank() == 1) v.mutable_grad() = at::full({2}, 10.0);
    pass();
    if (comm.rank() == 1) EXPECT_TRUE(at::allclose(v.grad(), at::full({2}, 13.0)));
    EXPECT_TRUE(at::allclose(w.grad(), at::full({comm.rank() == 0 ? 3 : 1}, 4.0)));
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(FlatParamHandle, RejectsParametersItCannotFlatten) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    at::Tensor p = at::ones({3}).requires_grad_();
    at::Tensor doubles = at::ones({3}, at::kDouble).requires_grad_();
    EXPECT_THAT(FlatParamHandle::Create("blocks.0", {}, comm).status().message(),
                HasSubstr("unit 'blocks.0' on rank " + std::to_string(comm.rank()) +
                          " of 2: a unit needs parameters"));
    EXPECT_THAT(
        FlatParamHandle::Create("u", {{"wte.weight", p}, {"lm_head.weight", p}}, comm)
            .status()
            .message(),
        HasSubstr("'lm_head.weight' is a parameter already in this unit under another name"));
    EXPECT_THAT(FlatParamHandle::Create("u", {{"a", p}, {"d", doubles}}, comm).status().message(),
                HasSubstr("'d' has dtype Double but 'a' has Float"));
    EXPECT_THAT(FlatParamHandle::Create("u", {{"a", p}, {"view", p * 2}}, comm)
                    .status()
                    .message(),
                HasSubstr("'view' is not a leaf tensor"));
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(FlatParamHandle, MisuseNamesUnitRankAndState) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    at::Tensor p = at::ones({5}).requires_grad_();
    auto handle = FlatParamHandle::Create("h.3", {{"h.3.weight", p}}, comm);
    ASSERT_TRUE(handle.ok()) << handle.status();
    FlatParamHandle& h = **handle;
    const std::string who = "unit 'h.3' on rank " + std::to_string(comm.rank()) + " of 2";
    try {
      h.FinishUnshard();
      ADD_FAILURE() << "FinishUnshard without StartUnshard did not throw";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.msg(), HasSubstr(who + ": FinishUnshard without a pending all-gather"));
      EXPECT_THAT(e.msg(), HasSubstr("training state IDLE"));
    }
    try {
      h.PrepareGradientsForBackward();
      ADD_FAILURE() << "PrepareGradientsForBackward while resharded did not throw";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.msg(), HasSubstr(who + ": PrepareGradientsForBackward needs the unit "
                                           "unsharded"));
    }
    h.Transition(HandleTrainingState::kIdle, HandleTrainingState::kForward);
    try {
      h.Transition(HandleTrainingState::kBackwardPre, HandleTrainingState::kBackwardPost);
      ADD_FAILURE() << "a transition from the wrong state did not throw";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.msg(), HasSubstr(who + ": cannot enter BACKWARD_POST from FORWARD "
                                           "(expected BACKWARD_PRE)"));
    }
    h.StartUnshard();
    try {
      h.Reshard();
      ADD_FAILURE() << "Reshard with a pending all-gather did not throw";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.msg(), HasSubstr(who + ": Reshard while an all-gather is pending"));
    }
    h.FinishUnshard();
    h.Reshard();
  });
  EXPECT_TRUE(status.ok()) << status;
}

}  // namespace
}  // namespace fsdp
