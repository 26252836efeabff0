// Communication hooks: the default hook is the built-in reduction, the
// compressed hooks halve what is communicated and stay close, a stateful
// error-feedback hook changes what is sent and still converges, and misuse
// is refused by name.
#include "fsdp/comm_hooks.h"

#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "comm/gloo_collectives.h"
#include "comm/hybrid_groups.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"
#include "torch/optim/sgd.h"

namespace fsdp {
namespace {

using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::Net;
using ::fsdp::testing::RunOnThreadRanks;
using ::fsdp::testing::Targets;
using ::testing::HasSubstr;

constexpr int kWorld = 2;

struct TrainingRun {
  std::vector<float> losses;                  // Global average per step.
  std::map<std::string, at::Tensor> params;   // Full, after training.
  int64_t gradient_bytes_per_step = 0;        // Reduce-scatter / all-reduce.
};

// Trains Net at W = 2 for `steps` with `make_hook()` registered (none if it
// returns null); the same data and SGD as the other parity tests.
template <typename MakeHook>
TrainingRun Train(ShardingStrategy strategy, int steps, const MakeHook& make_hook) {
  TrainingRun run;
  std::vector<TrainingRun> per_rank(kWorld);
  EXPECT_TRUE(RunOnThreadRanks(kWorld, [&](Collectives& comm) {
                Net model;
                FsdpOptions options;
                options.strategy = strategy;
                auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, options,
                                                       *ModuleTypePolicy::Of<BlockImpl>());
                ASSERT_TRUE(wrapped.ok());
                if (std::shared_ptr<CommHook> hook = make_hook()) {
                  ASSERT_TRUE((*wrapped)->RegisterCommHook(hook).ok());
                }
                torch::optim::SGD sgd(model->parameters(),
                                      torch::optim::SGDOptions(0.1).momentum(0.9));
                const int64_t rows = kGlobalBatch / kWorld;
                TrainingRun& mine = per_rank[comm.rank()];
                for (int step = 0; step < steps; ++step) {
                  comm.ResetCounters();
                  at::Tensor loss = at::mse_loss(
                      model->forward(Inputs(step % 4, 0).narrow(0, comm.rank() * rows, rows)),
                      Targets(step % 4, 0).narrow(0, comm.rank() * rows, rows));
                  loss.backward();
                  const CollectiveCounters c = comm.counters();
                  mine.gradient_bytes_per_step = c.Bytes(CollectiveOp::kReduceScatter) +
                                                 c.Bytes(CollectiveOp::kAllReduce);
                  sgd.step();
                  sgd.zero_grad();
                  at::Tensor global = loss.detach().clone();
                  comm.AllReduce(global, ReduceOp::kAvg)->Wait();
                  mine.losses.push_back(global.item<float>());
                }
                SummonFullParams full(**wrapped, {/*writeback=*/false});
                for (const auto& item : model->named_parameters()) {
                  mine.params[item.key()] = item.value().detach().clone();
                }
              }).ok());
  return per_rank[0];
}

float MaxDifference(const TrainingRun& a, const TrainingRun& b) {
  float worst = 0;
  for (const auto& [name, value] : a.params) {
    worst = std::max(worst, (value - b.params.at(name)).abs().max().item<float>());
  }
  return worst;
}

std::shared_ptr<CommHook> NoHook() { return nullptr; }

TEST(CommHooks, TheDefaultHookIsTheBuiltInReduction) {
  for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
    const TrainingRun plain = Train(strategy, 3, NoHook);
    const TrainingRun hooked = Train(strategy, 3, [] { return std::make_shared<DefaultCommHook>(); });
    EXPECT_EQ(MaxDifference(plain, hooked), 0) << ShardingStrategyName(strategy);
    EXPECT_EQ(plain.gradient_bytes_per_step, hooked.gradient_bytes_per_step);
  }
}

TEST(CommHooks, CompressedHooksHalveTheBytesAndStayClose) {
  for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
    const TrainingRun plain = Train(strategy, 3, NoHook);
    for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
      const TrainingRun hooked =
          Train(strategy, 3, [&] { return std::make_shared<LowPrecisionCommHook>(dtype); });
      const float difference = MaxDifference(plain, hooked);
      std::printf(
          "| %s | %s_compress | gradient bytes/step %lld vs %lld | max |param diff| "
          "%.2e |\n",
          ShardingStrategyName(strategy), DtypeFlagName(dtype).c_str(),
          static_cast<long long>(hooked.gradient_bytes_per_step),
          static_cast<long long>(plain.gradient_bytes_per_step), difference);
      EXPECT_EQ(2 * hooked.gradient_bytes_per_step, plain.gradient_bytes_per_step);
      EXPECT_GT(difference, 0);     // It did communicate something else...
      EXPECT_LT(difference, 2e-2);  // ...close to the full-precision values.
    }
  }
}

// A user's stateful hook: bfloat16 compression with error feedback — each
// rank keeps, per unit, what rounding dropped last time and adds it back
// before compressing again.
class ErrorFeedbackBf16Hook : public CommHook {
 public:
  std::string Name() const override { return "error_feedback_bf16"; }
  std::unique_ptr<PendingReduction> Reduce(const CommHookContext& context, at::Tensor grad,
                                           at::Tensor out) override {
    ++calls_;
    at::Tensor& residual = residuals_[context.unit];
    if (!residual.defined()) residual = at::zeros_like(grad);
    const at::Tensor corrected = grad + residual;
    at::Tensor low = corrected.to(at::kBFloat16);
    residual = corrected - low.to(grad.scalar_type());
    at::Tensor low_out = context.sharded ? at::empty({out.numel()}, low.options()) : low;
    return ReductionThen(DefaultCommHook().Reduce(context, low, low_out),
                         [out, low_out]() mutable { out.copy_(low_out); });
  }
  int calls() const { return calls_; }
  float residual_norm() const {
    float sum = 0;
    for (const auto& [unit, r] : residuals_) sum += r.norm().item<float>();
    return sum;
  }

 private:
  std::map<std::string, at::Tensor> residuals_;
  int calls_ = 0;
};

TEST(CommHooks, AStatefulErrorFeedbackHookChangesWhatIsSentAndConverges) {
  constexpr int kSteps = 40;
  const TrainingRun plain = Train(ShardingStrategy::kFullShard, kSteps, NoHook);
  std::vector<std::shared_ptr<ErrorFeedbackBf16Hook>> hooks;
  std::mutex mutex;
  const TrainingRun hooked = Train(ShardingStrategy::kFullShard, kSteps, [&] {
    auto hook = std::make_shared<ErrorFeedbackBf16Hook>();
    std::lock_guard<std::mutex> lock(mutex);
    hooks.push_back(hook);
    return hook;
  });
  ASSERT_EQ(hooks.size(), 2u);
  for (const auto& hook : hooks) {
    EXPECT_EQ(hook->calls(), 4 * kSteps);  // Four units, every step.
    EXPECT_GT(hook->residual_norm(), 0);   // Its state is in use.
  }
  EXPECT_EQ(2 * hooked.gradient_bytes_per_step, plain.gradient_bytes_per_step);
  EXPECT_NE(MaxDifference(plain, hooked), 0);
  // Converges as the uncompressed run does (this regression falls about 6%
  // in 40 steps).
  EXPECT_LT(hooked.losses.back(), 0.97 * hooked.losses.front());
  EXPECT_NEAR(hooked.losses.back(), plain.losses.back(), 1e-3 * plain.losses.back());
  std::printf("error feedback: loss %.5f -> %.5f (uncompressed %.5f -> %.5f)\n",
              hooked.losses.front(), hooked.losses.back(), plain.losses.front(),
              plain.losses.back());
}

// The contract a hook's reduction is given (comm_hooks.h): Advance() once,
// when the next unit's reduction is issued, and Wait() once. The runtime
// advances its own reductions a second time (a quantized replicate sum's
// second stage), never a hook's. Four units per backward: the first three
// reductions are advanced once each, the last one never.
class CountingHook : public CommHook {
 public:
  std::string Name() const override { return "counting"; }
  std::unique_ptr<PendingReduction> Reduce(const CommHookContext& context, at::Tensor grad,
                                           at::Tensor out) override {
    calls_.push_back(std::make_shared<Calls>());
    return std::make_unique<Counted>(DefaultCommHook().Reduce(context, grad, out), calls_.back());
  }
  struct Calls {
    int advances = 0;
    int waits = 0;
  };
  const std::vector<std::shared_ptr<Calls>>& calls() const { return calls_; }

 private:
  class Counted : public PendingReduction {
   public:
    Counted(std::unique_ptr<PendingReduction> inner, std::shared_ptr<Calls> calls)
        : inner_(std::move(inner)), calls_(std::move(calls)) {}
    void Advance() override {
      ++calls_->advances;
      inner_->Advance();
    }
    void Wait() override {
      ++calls_->waits;
      inner_->Wait();
    }

   private:
    std::unique_ptr<PendingReduction> inner_;
    std::shared_ptr<Calls> calls_;
  };
  std::vector<std::shared_ptr<Calls>> calls_;
};

TEST(CommHooks, AHooksReductionIsAdvancedAtMostOnceAndWaitedOnce) {
  constexpr int kSteps = 2;
  std::vector<std::shared_ptr<CountingHook>> hooks;
  std::mutex mutex;
  Train(ShardingStrategy::kFullShard, kSteps, [&] {
    auto hook = std::make_shared<CountingHook>();
    std::lock_guard<std::mutex> lock(mutex);
    hooks.push_back(hook);
    return hook;
  });
  ASSERT_EQ(hooks.size(), 2u);
  for (const auto& hook : hooks) {
    ASSERT_EQ(hook->calls().size(), 4u * kSteps);
    for (size_t i = 0; i < hook->calls().size(); ++i) {
      SCOPED_TRACE(absl::StrCat("reduction ", i % 4, " of step ", i / 4));
      EXPECT_EQ(hook->calls()[i]->advances, i % 4 == 3 ? 0 : 1);
      EXPECT_EQ(hook->calls()[i]->waits, 1);
    }
  }
}

// FSDP2's set_gradient_divide_factor: 1 makes the reduction a sum. At W = 2
// the default divides by 2 (all of it before the sum), so the gradients
// are exactly twice the default's, in every strategy.
TEST(CommHooks, AGradientDivideFactorReplacesTheAverage) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
    SCOPED_TRACE(ShardingStrategyName(strategy));
    std::vector<std::map<std::string, at::Tensor>> grads(2);  // [default, factor 1], rank 0.
    for (int summed = 0; summed < 2; ++summed) {
      ASSERT_TRUE(RunOnThreadRanks(kWorld, [&](Collectives& comm) {
                    Net model;
                    FsdpOptions options;
                    options.strategy = strategy;
                    if (summed == 1) options.gradient_divide_factor = 1.0;
                    auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, options,
                                                           *ModuleTypePolicy::Of<BlockImpl>());
                    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
                    const int64_t rows = kGlobalBatch / kWorld;
                    at::mse_loss(model->forward(Inputs(0, 0).narrow(0, comm.rank() * rows, rows)),
                                 Targets(0, 0).narrow(0, comm.rank() * rows, rows))
                        .backward();
                    SummonFullParams full(
                        **wrapped, {.writeback = false, .rank0_only = false, .with_grads = true});
                    if (comm.rank() != 0) return;
                    for (const auto& item : model->named_parameters()) {
                      grads[summed][item.key()] = item.value().grad().clone();
                    }
                  }).ok());
    }
    ASSERT_EQ(grads[0].size(), grads[1].size());
    for (const auto& [name, grad] : grads[0]) {
      EXPECT_TRUE(at::equal(grad * 2, grads[1].at(name))) << name;
    }
  }
}

TEST(CommHooks, MisuseIsRefusedByName) {
  ASSERT_TRUE(RunOnThreadRanks(kWorld, [](Collectives& comm) {
                Net model;
                auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, {},
                                                       *ModuleTypePolicy::Of<BlockImpl>());
                ASSERT_TRUE(wrapped.ok());
                FullyShardedModel& fsdp = **wrapped;
                EXPECT_THAT(fsdp.RegisterCommHook(nullptr).message(),
                            HasSubstr("RegisterCommHook: the hook is null"));
                ASSERT_TRUE(fsdp.RegisterCommHook(std::make_shared<DefaultCommHook>()).ok());
                EXPECT_THAT(
                    fsdp.RegisterCommHook(std::make_shared<DefaultCommHook>()).message(),
                    HasSubstr("hook 'default' is already registered"));
              }).ok());
  ASSERT_TRUE(RunOnThreadRanks(kWorld, [](Collectives& comm) {
                Net model;
                auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, {},
                                                       *ModuleTypePolicy::Of<BlockImpl>());
                ASSERT_TRUE(wrapped.ok());
                model->forward(Inputs(0, 0)).sum().backward();
                EXPECT_THAT((*wrapped)->RegisterCommHook(std::make_shared<DefaultCommHook>())
                                .message(),
                            HasSubstr("register the hook before the first forward"));
              }).ok());
  // Hybrid sharding: refused, naming the unit and the strategy.
  const HybridShardLayout layout = HybridShardLayout::Create(4, 2).value();
  auto store = c10::make_intrusive<c10d::HashStore>();
  ASSERT_TRUE(RunOnThreadRanks(4, [&](Collectives& world) {
                GlooOptions gloo;
                gloo.hostname = "127.0.0.1";
                auto groups = CreateHybridShardCollectives(world.rank(), layout, gloo.group_name,
                                                           GlooGroupConnector(store, gloo));
                ASSERT_TRUE(groups.ok());
                Net model;
                FsdpOptions options;
                options.strategy = ShardingStrategy::kHybridShard;
                ProcessGroups hybrid(*groups->shard);
                hybrid.replicate = groups->replicate.get();
                auto wrapped = FullyShardedModel::Wrap(model.ptr(), hybrid, options,
                                                       *ModuleTypePolicy::Of<BlockImpl>());
                ASSERT_TRUE(wrapped.ok());
                EXPECT_THAT(
                    (*wrapped)->RegisterCommHook(std::make_shared<DefaultCommHook>()).message(),
                    HasSubstr("unit '<root>' uses HYBRID_SHARD; communication hooks are not "
                              "supported with hybrid sharding"));
              }).ok());
}

}  // namespace
}  // namespace fsdp
