// UnitModule over modules whose forward is not one tensor to one tensor: a
// Llama-style block forward(x, rotary, mask, scale) with a struct of
// tensors, an optional tensor and a double among its arguments; a block
// returning a struct of tensors; one returning a tuple. Held unchanged, as
// units, they train as the unwrapped model does, with and without
// activation checkpointing.
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "ATen/ATen.h"
#include "fsdp/activation_checkpointing.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_util.h"
#include "fsdp/unit_module.h"
#include "fsdp/utilities.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"
#include "torch/nn/modules/container/modulelist.h"
#include "torch/nn/modules/container/sequential.h"
#include "torch/nn/modules/linear.h"

namespace models_under_test {

constexpr int64_t kWidth = 8;

// The rotary embedding's tables, as a Llama model passes them to its blocks.
struct Rotary {
  at::Tensor cos;
  at::Tensor sin;
};

// A block's result with an auxiliary loss beside it (as a mixture of
// experts returns its load-balancing loss).
struct BlockOutput {
  at::Tensor hidden;
  at::Tensor aux_loss;
};

}  // namespace models_under_test

template <>
struct fsdp::TensorFields<models_under_test::Rotary> {
  template <typename F>
  static void ForEach(models_under_test::Rotary& rotary, F&& f) {
    f(rotary.cos);
    f(rotary.sin);
  }
};

template <>
struct fsdp::TensorFields<models_under_test::BlockOutput> {
  template <typename F>
  static void ForEach(models_under_test::BlockOutput& out, F&& f) {
    f(out.hidden);
    f(out.aux_loss);
  }
};

namespace models_under_test {

// Plain libtorch modules: nothing in them knows FSDP.
struct AttentionBlockImpl : torch::nn::Module {
  AttentionBlockImpl() {
    q = register_module("q", torch::nn::Linear(kWidth, kWidth));
    v = register_module("v", torch::nn::Linear(kWidth, kWidth));
  }
  at::Tensor forward(const at::Tensor& x, const Rotary& rotary,
                     const c10::optional<at::Tensor>& mask, double scale) {
    at::Tensor queries = q->forward(x) * rotary.cos + q->forward(x).flip(-1) * rotary.sin;
    at::Tensor scores = at::matmul(queries, x.transpose(-1, -2)) * scale;
    if (mask.has_value()) scores = scores + *mask;
    return x + at::matmul(at::softmax(scores, -1), v->forward(x));
  }
  torch::nn::Linear q{nullptr}, v{nullptr};
};
TORCH_MODULE(AttentionBlock);

struct ExpertBlockImpl : torch::nn::Module {
  ExpertBlockImpl() { fc = register_module("fc", torch::nn::Linear(kWidth, kWidth)); }
  BlockOutput forward(at::Tensor x) {
    at::Tensor h = at::tanh(fc->forward(x));
    return {x + h, h.pow(2).mean({1, 2}).unsqueeze(-1) * 0.01};  // Per sample: [batch, 1].
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ExpertBlock);

struct SplitBlockImpl : torch::nn::Module {
  SplitBlockImpl() { fc = register_module("fc", torch::nn::Linear(kWidth, 2 * kWidth)); }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    std::vector<at::Tensor> halves = fc->forward(x).chunk(2, -1);
    return {halves[0], at::sigmoid(halves[1])};
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(SplitBlock);

// The model: each block held as it is (Plain) or in a UnitModule (Units);
// the root's own head after them.
template <bool Units>
struct StackImpl : torch::nn::Module {
  template <typename M>
  using Held = std::conditional_t<Units, fsdp::UnitModule<typename M::ContainedType>, M>;

  StackImpl() {
    attention = register_module("attention", Held<AttentionBlock>(AttentionBlock()));
    expert = register_module("expert", Held<ExpertBlock>(ExpertBlock()));
    split = register_module("split", Held<SplitBlock>(SplitBlock()));
    head = register_module("head", torch::nn::Linear(kWidth, 1));
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor positions = at::arange(kWidth, at::kFloat) * 0.3;
    const Rotary rotary{at::cos(positions), at::sin(positions)};
    const at::Tensor mask = at::triu(at::full({x.size(1), x.size(1)}, -1e4), 1);
    at::Tensor h = attention->forward(x, rotary, mask, 0.5);
    h = attention->forward(h, rotary, c10::nullopt, 0.25);  // The same unit twice.
    BlockOutput out = expert->forward(h);
    // Only the second of the tuple's tensors is used: the unit must see
    // every output, not just the first.
    at::Tensor value = std::get<1>(split->forward(out.hidden));
    return head->forward(value).mean(1) + out.aux_loss;  // [batch, 1]
  }
  Held<AttentionBlock> attention{nullptr};
  Held<ExpertBlock> expert{nullptr};
  Held<SplitBlock> split{nullptr};
  torch::nn::Linear head{nullptr};
};

}  // namespace models_under_test

namespace fsdp {
namespace {

using ::fsdp::testing::FillDeterministically;
using ::fsdp::testing::MakeOptimizer;
using ::fsdp::testing::Optim;
using ::fsdp::testing::RunOnThreadRanks;
using models_under_test::kWidth;

constexpr int64_t kBatch = 6;  // Divisible by 2 and 3.
constexpr int64_t kSeq = 4;
constexpr int kSteps = 4;

at::Tensor Inputs(int step) {
  return at::sin(at::arange(kBatch * kSeq * kWidth, at::kFloat) * 0.11 + step)
      .view({kBatch, kSeq, kWidth});
}
at::Tensor Targets(int step) {
  return at::cos(at::arange(kBatch, at::kFloat) * 0.5 - step).view({kBatch, 1});
}

// The losses of every step, then the parameters by name.
struct Trained {
  std::vector<float> losses;
  std::map<std::string, at::Tensor> params;
};

Trained TrainPlain() {
  auto model = std::make_shared<models_under_test::StackImpl<false>>();
  FillDeterministically(*model);
  auto optimizer = MakeOptimizer(Optim::kSgdMomentum, model->parameters());
  Trained run;
  for (int step = 0; step < kSteps; ++step) {
    at::Tensor loss = at::mse_loss(model->forward(Inputs(step)), Targets(step));
    loss.backward();
    run.losses.push_back(loss.item<float>());
    optimizer->step();
    optimizer->zero_grad();
  }
  for (const auto& item : model->named_parameters()) {
    run.params[item.key()] = item.value().detach().clone();
  }
  return run;
}

class UnitArguments : public ::testing::TestWithParam<std::tuple<int, bool>> {};

// Every block a unit (the root too), at W = 2 and 3, checkpointed or not:
// the global loss of every step and the final parameters are the unwrapped
// model's.
TEST_P(UnitArguments, BlocksOfAnySignatureTrainAsUnwrapped) {
  const auto [world_size, checkpoint] = GetParam();
  const Trained expected = TrainPlain();
  absl::Status status = RunOnThreadRanks(world_size, [&](Collectives& comm) {
    UnitModule model(std::make_shared<models_under_test::StackImpl<true>>());
    FillDeterministically(*model);
    auto wrapped =
        FullyShardedModel::Wrap(model.ptr(), comm, {}, *ModuleTypePolicy::Of<UnitModuleImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    FullyShardedModel& fsdp = **wrapped;
    ASSERT_EQ(fsdp.units().size(), 4u);  // The root and three blocks.
    if (checkpoint) {
      // The blocks, not the root.
      auto applied = ApplyActivationCheckpointing(
          *model, *ModuleTypePolicy::Of<UnitModuleImpl>());
      ASSERT_TRUE(applied.ok()) << applied.status();
      EXPECT_EQ(*applied, (std::vector<std::string>{"attention", "expert", "split"}));
    }
    // Names are the unwrapped model's.
    std::vector<std::string> names;
    for (const auto& item : model->named_parameters()) names.push_back(item.key());
    std::vector<std::string> expected_names;
    for (const auto& [name, value] : expected.params) expected_names.push_back(name);
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, expected_names);

    auto optimizer = MakeOptimizer(Optim::kSgdMomentum, UniqueParameters(*model));
    const int64_t rows = kBatch / world_size;
    for (int step = 0; step < kSteps; ++step) {
      at::Tensor loss =
          at::mse_loss(model->forward(Inputs(step).narrow(0, comm.rank() * rows, rows)),
                       Targets(step).narrow(0, comm.rank() * rows, rows));
      if (checkpoint) {
        EXPECT_EQ(CheckpointedRegionsInGraph(loss), 4);  // attention twice.
      }
      loss.backward();
      optimizer->step();
      optimizer->zero_grad();
      at::Tensor global = loss.detach().clone();
      comm.AllReduce(global, ReduceOp::kAvg)->Wait();
      EXPECT_NEAR(global.item<float>(), expected.losses[step],
                  1e-5 * std::abs(expected.losses[step]))
          << "step " << step;
    }
    SummonFullParams full(fsdp);
    for (const auto& item : model->named_parameters()) {
      EXPECT_TRUE(at::allclose(item.value(), expected.params.at(item.key()), 1e-5, 1e-6))
          << item.key();
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

INSTANTIATE_TEST_SUITE_P(
    WorldSizes, UnitArguments,
    ::testing::Combine(::testing::Values(2, 3), ::testing::Bool()),
    [](const ::testing::TestParamInfo<std::tuple<int, bool>>& info) {
      return "W" + std::to_string(std::get<0>(info.param)) +
             (std::get<1>(info.param) ? "_checkpointed" : "");
    });

// What a held forward saw: its arguments' dtypes.
struct ProbeImpl : torch::nn::Module {
  ProbeImpl() { fc = register_module("fc", torch::nn::Linear(kWidth, kWidth)); }
  models_under_test::BlockOutput forward(const at::Tensor& x,
                                         const models_under_test::Rotary& rotary,
                                         const c10::optional<at::Tensor>& mask, int64_t tag) {
    seen = {x.scalar_type(), rotary.cos.scalar_type(), rotary.sin.scalar_type(),
            mask->scalar_type()};
    seen_tag = tag;
    at::Tensor h = fc->forward(x) * rotary.cos + *mask;
    return {h, h.sum(-1, /*keepdim=*/true)};
  }
  torch::nn::Linear fc{nullptr};
  std::vector<at::ScalarType> seen;
  int64_t seen_tag = 0;
};
TORCH_MODULE(Probe);

// The root: holds the probe as a unit and passes its arguments on.
struct ProbeHolderImpl : torch::nn::Module {
  explicit ProbeHolderImpl(Probe held) {
    probe = register_module("probe", UnitModule<ProbeImpl>(held));
  }
  models_under_test::BlockOutput forward(const at::Tensor& x,
                                         const models_under_test::Rotary& rotary,
                                         const at::Tensor& mask) {
    return probe->forward(x, rotary, mask, 7);
  }
  UnitModule<ProbeImpl> probe{nullptr};
};

// Mixed precision reaches every tensor argument of a unit, struct fields and
// optional included (cast_forward_inputs; the root casts nothing here), and
// every tensor of a struct result (output_dtype); other arguments pass as
// they are.
TEST(UnitArgumentsMixedPrecision, CastsEveryTensorArgumentAndResult) {
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    Probe probe;
    UnitModule root(std::make_shared<ProbeHolderImpl>(probe));
    FsdpOptions options;
    options.mixed_precision.param_dtype = at::kBFloat16;
    options.mixed_precision.cast_forward_inputs = true;
    options.mixed_precision.cast_root_forward_inputs = false;
    options.mixed_precision.output_dtype = at::kFloat;
    auto wrapped =
        FullyShardedModel::Wrap(root.ptr(), comm, options, *ModuleTypePolicy::Of<UnitModuleImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    ASSERT_EQ((*wrapped)->units().size(), 2u);
    const models_under_test::Rotary rotary{at::ones({kWidth}), at::zeros({kWidth})};
    models_under_test::BlockOutput out =
        root->forward(at::ones({2, kWidth}), rotary, at::zeros({kWidth}));
    EXPECT_EQ(probe->seen, (std::vector<at::ScalarType>{at::kBFloat16, at::kBFloat16,
                                                        at::kBFloat16, at::kBFloat16}));
    EXPECT_EQ(probe->seen_tag, 7);
    EXPECT_EQ(out.hidden.scalar_type(), at::kFloat);
    EXPECT_EQ(out.aux_loss.scalar_type(), at::kFloat);
  });
  EXPECT_TRUE(status.ok()) << status;
}

// A const forward is held as any other, and its UnitModule stands in a
// Sequential (which needs one non-template forward).
struct ScaleImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) const { return x * 3; }
};
TORCH_MODULE(Scale);

TEST(UnitArguments, AConstForwardIsHeldToo) {
  torch::nn::Sequential sequence(UnitModule{Scale()}, UnitModule{Scale()});
  EXPECT_TRUE(at::equal(sequence->forward(at::ones({2})), at::full({2}, 9.0)));
}

// ForEachTensor finds tensors inside containers and declared structs, in
// order, undefined ones included.
TEST(ForEachTensor, VisitsContainersAndDeclaredStructs) {
  const at::Tensor a = at::ones({1}), b = at::ones({2}), c = at::ones({3});
  auto value = std::make_tuple(a, 3, std::string("x"), std::vector<at::Tensor>{b, at::Tensor()},
                               c10::optional<at::Tensor>(c), c10::optional<at::Tensor>(),
                               std::make_pair(models_under_test::Rotary{a, b}, 1.5));
  std::vector<int64_t> sizes;
  ForEachTensor(value, [&](at::Tensor& t) { sizes.push_back(t.defined() ? t.numel() : -1); });
  EXPECT_EQ(sizes, (std::vector<int64_t>{1, 2, -1, 3, 1, 2}));
}

}  // namespace
}  // namespace fsdp
