// Gradient reductions run beside backward: each unit's reduction is issued
// when its gradients are ready and waited for only when the next unit's is
// issued (the reduce-scatter) or at the end of backward (what follows it),
// so the backward of the unit before it computes while it is in flight.
// Shown from the order of events on each rank: collectives issued and
// waited, and each block's backward starting.
#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "comm/gloo_collectives.h"
#include "comm/hybrid_groups.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_util.h"
#include "fsdp/unit_forward.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/fault_injection.h"
#include "testing/multi_rank.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"
#include "torch/nn/modules/container/modulelist.h"
#include "torch/nn/modules/linear.h"
#include "torch/optim/sgd.h"

namespace fsdp {
namespace {

using ::fsdp::testing::FillDeterministically;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::RunOnThreadRanks;
using ::fsdp::testing::Targets;
using ::testing::HasSubstr;

// One rank's events, in order.
class EventLog {
 public:
  void Add(std::string event) {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(event));
  }
  std::vector<std::string> events() const {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::string> events_;
};

// Passes every collective to `inner` and logs "issue <what>" when it is
// issued and "wait <what>" when its work is first waited for, where <what>
// is "<prefix><op> <unit>".
class RecordingCollectives final : public Collectives {
 public:
  RecordingCollectives(Collectives& inner, std::string prefix, EventLog& log)
      : Collectives(inner.rank(), inner.world_size()),
        inner_(inner),
        prefix_(std::move(prefix)),
        log_(log) {}

 protected:
  std::unique_ptr<CollectiveWork> DoAllGather(const at::Tensor& output,
                                              const at::Tensor& input) override {
    return Recorded("all-gather", [&] { return inner_.AllGatherIntoTensor(output, input); });
  }
  std::unique_ptr<CollectiveWork> DoReduceScatter(const at::Tensor& output, const at::Tensor& input,
                                                  ReduceOp op) override {
    return Recorded("reduce-scatter",
                    [&] { return inner_.ReduceScatterTensor(output, input, op); });
  }
  std::unique_ptr<CollectiveWork> DoAllReduce(const at::Tensor& tensor, ReduceOp op) override {
    return Recorded("all-reduce", [&] { return inner_.AllReduce(tensor, op); });
  }
  std::unique_ptr<CollectiveWork> DoBroadcast(const at::Tensor& tensor, int root) override {
    return Recorded("broadcast", [&] { return inner_.Broadcast(tensor, root); });
  }
  std::unique_ptr<CollectiveWork> DoAllToAll(const at::Tensor& output,
                                             const at::Tensor& input) override {
    return Recorded("all-to-all", [&] { return inner_.AllToAll(output, input); });
  }
  void DoBarrier() override {
    CollectiveLabel label(inner_, label_unit(), label_phase());
    inner_.Barrier();
  }

 private:
  class Work final : public CollectiveWork {
   public:
    Work(std::unique_ptr<CollectiveWork> inner, std::string event, EventLog& log)
        : inner_(std::move(inner)), event_(std::move(event)), log_(log) {}
    void Wait() override {
      if (!waited_) log_.Add(event_);
      waited_ = true;
      inner_->Wait();
    }

   private:
    std::unique_ptr<CollectiveWork> inner_;
    const std::string event_;
    EventLog& log_;
    bool waited_ = false;
  };

  template <typename Issue>
  std::unique_ptr<CollectiveWork> Recorded(const char* op, const Issue& issue) {
    const std::string what = absl::StrCat(prefix_, op, " ", label_unit());
    CollectiveLabel label(inner_, label_unit(), label_phase());
    log_.Add("issue " + what);
    return std::make_unique<Work>(issue(), "wait " + what, log_);
  }

  Collectives& inner_;
  const std::string prefix_;
  EventLog& log_;
};

// The rank thread's log, for the blocks' backward hooks.
thread_local EventLog* g_log = nullptr;

// A block whose backward logs "backward starts blocks.<i>" before any of
// its gradients are computed.
struct LoggedBlockImpl : torch::nn::Module, ShardableModule {
  LoggedBlockImpl(int64_t in, int64_t out, int index) : index(index) {
    fc = register_module("fc", torch::nn::Linear(in, out));
  }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    x = unit.Input(x);
    at::Tensor y = at::tanh(fc->forward(x));
    if (g_log != nullptr && y.requires_grad()) {
      y.register_hook([log = g_log, i = index](const at::Tensor& g) {
        log->Add(absl::StrCat("backward starts blocks.", i));
        return g;
      });
    }
    return unit.Return(y);
  }
  torch::nn::Linear fc{nullptr};
  int index;
};
TORCH_MODULE(LoggedBlock);

struct LoggedNetImpl : torch::nn::Module, ShardableModule {
  LoggedNetImpl() {
    blocks = register_module("blocks", torch::nn::ModuleList());
    blocks->push_back(LoggedBlock(7, 13, 0));
    blocks->push_back(LoggedBlock(13, 11, 1));
    blocks->push_back(LoggedBlock(11, 9, 2));
    head = register_module("head", torch::nn::Linear(9, 5));
    FillDeterministically(*this);
  }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    x = unit.Input(x);
    for (const auto& block : *blocks) x = block->as<LoggedBlockImpl>()->forward(x);
    return unit.Return(head->forward(x));
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(LoggedNet);

// Two training steps of LoggedNet over `group` (and `replicate` for hybrid
// sharding); returns the second step's events and the full parameters.
struct TrainingRecord {
  std::vector<std::string> events;
  std::map<std::string, at::Tensor> params;
};
TrainingRecord TrainTwoSteps(const ProcessGroups& groups, EventLog& log, FsdpOptions options) {
  LoggedNet model;
  auto wrapped = FullyShardedModel::Wrap(model.ptr(), groups, options,
                                         *ModuleTypePolicy::Of<LoggedBlockImpl>());
  TORCH_CHECK(wrapped.ok(), wrapped.status().ToString());
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  const Collectives& group = *groups.shard;
  const Collectives* replicate = groups.replicate;
  const int world = group.world_size() * (replicate != nullptr ? replicate->world_size() : 1);
  const int global_rank = replicate != nullptr
                              ? replicate->rank() * group.world_size() + group.rank()
                              : group.rank();
  const int64_t rows = kGlobalBatch / world;
  TrainingRecord run;
  for (int step = 0; step < 2; ++step) {
    g_log = step == 1 ? &log : nullptr;
    const size_t first = log.events().size();
    at::Tensor x = Inputs(step, 0).narrow(0, global_rank * rows, rows);
    at::Tensor y = Targets(step, 0).narrow(0, global_rank * rows, rows);
    at::mse_loss(model->forward(x), y).backward();
    log.Add("backward returned");
    sgd.step();
    sgd.zero_grad();
    if (step == 1) {
      const std::vector<std::string> all = log.events();
      run.events.assign(all.begin() + first, all.end());
    }
  }
  g_log = nullptr;
  SummonFullParams full(**wrapped, {/*writeback=*/false});
  for (const auto& item : model->named_parameters()) {
    run.params[item.key()] = item.value().detach().clone();
  }
  return run;
}

// Where `event` is in `events`; fails the test if it is not there once.
int64_t Position(const std::vector<std::string>& events, const std::string& event) {
  const int64_t count = std::count(events.begin(), events.end(), event);
  EXPECT_EQ(count, 1) << "'" << event << "' in: " << ::testing::PrintToString(events);
  return std::find(events.begin(), events.end(), event) - events.begin();
}

// Each of `units` (in backward order) against the block whose backward
// runs after it.
const std::vector<std::pair<std::string, std::string>> kUnitThenNextBlock = {
    {"<root>", "blocks.2"}, {"blocks.2", "blocks.1"}, {"blocks.1", "blocks.0"}};

class ReductionOverlap : public ::testing::TestWithParam<ShardingStrategy> {};

TEST_P(ReductionOverlap, EachUnitsReductionRunsWhileTheNextBlocksBackwardStarts) {
  const ShardingStrategy strategy = GetParam();
  const std::string op = strategy == ShardingStrategy::kNoShard ? "all-reduce" : "reduce-scatter";
  std::vector<TrainingRecord> runs(2);
  ASSERT_TRUE(RunOnThreadRanks(2, [&](Collectives& comm) {
                EventLog log;
                RecordingCollectives recording(comm, "", log);
                FsdpOptions options;
                options.strategy = strategy;
                runs[comm.rank()] = TrainTwoSteps(recording, log, options);
              }).ok());
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE(absl::StrCat("rank ", rank));
    const std::vector<std::string>& events = runs[rank].events;
    for (const auto& [unit, next_block] : kUnitThenNextBlock) {
      SCOPED_TRACE(unit);
      const int64_t issued = Position(events, absl::StrCat("issue ", op, " ", unit));
      const int64_t next_starts = Position(events, "backward starts " + next_block);
      const int64_t waited = Position(events, absl::StrCat("wait ", op, " ", unit));
      EXPECT_LT(issued, next_starts);
      EXPECT_LT(next_starts, waited);
      // Waited before the next unit's reduction is issued: reductions in
      // flight hold one unit's flat gradient.
      EXPECT_LT(waited, Position(events, absl::StrCat("issue ", op, " ", next_block)));
    }
    // The last one is waited for before backward returns.
    EXPECT_LT(Position(events, absl::StrCat("wait ", op, " blocks.0")),
              Position(events, "backward returned"));
  }
  // The ranks agree (each rank's parameters came out of the same
  // reductions), and the reductions reached the optimizer.
  LoggedNet initial;
  for (const auto& [name, value] : runs[0].params) {
    EXPECT_TRUE(at::equal(value, runs[1].params.at(name))) << name;
    EXPECT_FALSE(at::equal(value, initial->named_parameters()[name])) << name << " never moved";
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, ReductionOverlap,
                         ::testing::Values(ShardingStrategy::kFullShard,
                                           ShardingStrategy::kShardGradOp,
                                           ShardingStrategy::kNoShard),
                         [](const ::testing::TestParamInfo<ShardingStrategy>& info) {
                           return std::string(ShardingStrategyName(info.param));
                         });

TEST(ReductionOverlap, HybridsReplicateAllReduceRunsWhileABackwardAfterItStarts) {
  const HybridShardLayout layout = HybridShardLayout::Create(4, 2).value();
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<TrainingRecord> runs(4);
  ASSERT_TRUE(RunOnThreadRanks(4, [&](Collectives& world) {
                GlooOptions gloo;
                gloo.hostname = "127.0.0.1";
                gloo.timeout = std::chrono::seconds(60);
                auto groups = CreateHybridShardCollectives(world.rank(), layout, gloo.group_name,
                                                           GlooGroupConnector(store, gloo));
                ASSERT_TRUE(groups.ok()) << groups.status();
                EventLog log;
                RecordingCollectives shard(*groups->shard, "", log);
                RecordingCollectives replicate(*groups->replicate, "replicate ", log);
                FsdpOptions options;
                options.strategy = ShardingStrategy::kHybridShard;
                ProcessGroups hybrid(shard);
                hybrid.replicate = &replicate;
                runs[world.rank()] = TrainTwoSteps(hybrid, log, options);
              }).ok());
  for (int rank = 0; rank < 4; ++rank) {
    SCOPED_TRACE(absl::StrCat("rank ", rank));
    const std::vector<std::string>& events = runs[rank].events;
    // A unit's replicate all-reduce is issued once its reduce-scatter is
    // done, at the next unit's reduction, and waited for at the end of
    // backward: the backward of the unit after the next one starts while
    // it is in flight.
    const std::vector<std::pair<std::string, std::string>> unit_then_block_after_next = {
        {"<root>", "blocks.1"}, {"blocks.2", "blocks.0"}};
    for (const auto& [unit, later_block] : unit_then_block_after_next) {
      SCOPED_TRACE(unit);
      const int64_t scattered = Position(events, "wait reduce-scatter " + unit);
      const int64_t issued = Position(events, "issue replicate all-reduce " + unit);
      const int64_t later_starts = Position(events, "backward starts " + later_block);
      const int64_t waited = Position(events, "wait replicate all-reduce " + unit);
      EXPECT_LT(scattered, issued);
      EXPECT_LT(issued, later_starts);
      EXPECT_LT(later_starts, waited);
      EXPECT_LT(waited, Position(events, "backward returned"));
    }
  }
  LoggedNet initial;
  for (const auto& [name, value] : runs[0].params) {
    EXPECT_FALSE(at::equal(value, initial->named_parameters()[name])) << name << " never moved";
    for (int rank = 1; rank < 4; ++rank) {
      EXPECT_TRUE(at::equal(value, runs[rank].params.at(name))) << "rank " << rank << " " << name;
    }
  }
}

TEST(ReductionOverlap, AFailedReductionFailsTheBackwardNamingItsUnit) {
  std::vector<std::string> errors(2);
  testing::MultiRankOptions options;
  options.collective_timeout = std::chrono::seconds(5);
  options.gloo.fingerprints.report_timeout = std::chrono::seconds(5);
  ASSERT_TRUE(RunOnThreadRanks(
                  2,
                  [&](Collectives& comm) {
                    testing::FaultInjectingCollectives faulty(comm);
                    faulty.Inject({.kind = testing::FaultKind::kFail,
                                   .op = CollectiveOp::kReduceScatter,
                                   .unit = "blocks.2"});
                    EventLog log;
                    try {
                      TrainTwoSteps(faulty, log, FsdpOptions());
                    } catch (const std::exception& e) {
                      errors[comm.rank()] = e.what();
                    }
                  },
                  options)
                  .ok());
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_THAT(errors[rank], HasSubstr("injected failure of fail #"));
    EXPECT_THAT(errors[rank], HasSubstr("reduce-scatter"));
    EXPECT_THAT(errors[rank], HasSubstr("(unit 'blocks.2', backward)"));
  }
}

// The last unit's reduction is waited for at the end of backward: its
// failure is thrown from there, after the others were waited for, and
// leaves the model idle, so that the next step reduces and publishes its
// gradients as usual.
TEST(ReductionOverlap, AReductionThatFailsAtTheEndOfBackwardLeavesTheModelUsable) {
  testing::MultiRankOptions options;
  options.collective_timeout = std::chrono::seconds(5);
  ASSERT_TRUE(RunOnThreadRanks(
                  2,
                  [&](Collectives& comm) {
                    testing::FaultInjectingCollectives faulty(comm);
                    faulty.Inject({.kind = testing::FaultKind::kFail,
                                   .op = CollectiveOp::kReduceScatter,
                                   .unit = "blocks.0"});
                    LoggedNet model;
                    auto wrapped = FullyShardedModel::Wrap(
                        model.ptr(), faulty, {}, *ModuleTypePolicy::Of<LoggedBlockImpl>());
                    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
                    const int64_t rows = kGlobalBatch / 2;
                    auto step = [&](int i) {
                      const at::Tensor x = Inputs(i, 0).narrow(0, comm.rank() * rows, rows);
                      const at::Tensor y = Targets(i, 0).narrow(0, comm.rank() * rows, rows);
                      at::mse_loss(model->forward(x), y).backward();
                    };
                    try {
                      step(0);
                      ADD_FAILURE() << "the failed reduce-scatter was not reported";
                    } catch (const std::exception& e) {
                      EXPECT_THAT(e.what(), HasSubstr("(unit 'blocks.0', backward)"));
                    }
                    EXPECT_EQ((*wrapped)->training_state(), ModelTrainingState::kIdle);
                    for (at::Tensor& p : model->parameters()) p.mutable_grad() = at::Tensor();
                    step(1);
                    for (const auto& item : model->named_parameters()) {
                      EXPECT_TRUE(item.value().grad().defined()) << item.key();
                    }
                  },
                  options)
                  .ok());
}

}  // namespace
}  // namespace fsdp
