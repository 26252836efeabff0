// Distributed failure modes of FSDP training, injected on one rank of
// three: a rank that skips a unit, runs units in another order, raises in
// forward or in an autograd hook, or whose collective is delayed, fails or
// is mismatched. Each must end with an error on every rank, within the
// collective timeout plus the report wait, that says what happened and
// where (the first diverging collective and its unit, or the rank that
// stopped and why), and leave no thread behind.
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "c10/util/Exception.h"
#include "comm/collectives.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "fsdp/unit_forward.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/fault_injection.h"
#include "testing/multi_rank.h"
#include "torch/nn/modules/container/modulelist.h"
#include "torch/nn/modules/linear.h"
#include "torch/optim/sgd.h"

namespace fsdp::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

// Per rank thread: blocks this rank's forward leaves out, or runs swapped.
thread_local int g_skip_block = -1;
thread_local bool g_swap_blocks_1_and_2 = false;

// Four equal blocks, so that a rank that skips or reorders one still
// computes (and issues equal-sized collectives) instead of failing on a
// shape.
struct ChainImpl : torch::nn::Module, ShardableModule {
  ChainImpl() {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 4; ++i) blocks->push_back(Block(8, 8, i));
    head = register_module("head", torch::nn::Linear(8, 3));
    FillDeterministically(*this);
  }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    std::vector<int> order = {0, 1, 2, 3};
    if (g_swap_blocks_1_and_2) std::swap(order[1], order[2]);
    for (int i : order) {
      if (i != g_skip_block) x = blocks[i]->as<BlockImpl>()->forward(x);
    }
    return unit.Return(head->forward(x));
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Chain);

MultiRankOptions ShortTimeouts() {
  MultiRankOptions options;
  options.timeout = std::chrono::seconds(90);
  options.collective_timeout = std::chrono::seconds(3);
  options.gloo.fingerprints.report_timeout = std::chrono::seconds(5);
  return options;
}

// Trains `steps` SGD steps of the chain, FULL_SHARD over `group`, each rank
// on its slice of a fixed batch; `before_step(step)` arms this rank's
// fault. Returns the parameters after training, flattened (each rank its
// shard).
at::Tensor TrainChain(Collectives& group, int steps, const FsdpOptions& options,
                      const std::function<void(int)>& before_step) {
  g_skip_block = -1;
  g_swap_blocks_1_and_2 = false;
  g_in_block_forward = nullptr;
  g_after_block_backward = nullptr;
  Chain chain;
  auto wrapped =
      FullyShardedModel::Wrap(chain.ptr(), group, options, *ModuleTypePolicy::Of<BlockImpl>());
  TORCH_CHECK(wrapped.ok(), wrapped.status().ToString());
  torch::optim::SGD sgd(UniqueParameters(*chain), torch::optim::SGDOptions(0.1));
  const int rows = 6 / group.world_size();
  for (int step = 0; step < steps; ++step) {
    if (before_step) before_step(step);
    at::Tensor x = at::sin(at::arange(6 * 8, at::kFloat).view({6, 8}) * (step + 1))
                       .narrow(0, group.rank() * rows, rows);
    sgd.zero_grad();
    chain->forward(x).pow(2).mean().backward();
    sgd.step();
  }
  g_in_block_forward = nullptr;
  g_after_block_backward = nullptr;
  std::vector<at::Tensor> flat;
  for (const at::Tensor& p : UniqueParameters(*chain)) flat.push_back(p.detach().reshape({-1}));
  return at::cat(flat);
}

// Runs the chain's training on three ranks with `fault(rank, step, group)`
// arming faults, and returns each rank's error; checks that every thread
// the run started is gone.
std::vector<std::string> TrainWithFault(
    const std::function<void(int rank, int step, FaultInjectingCollectives&)>& fault,
    const FsdpOptions& options = {}, const MultiRankOptions& ranks = ShortTimeouts()) {
  const int threads_before = ThreadCount();
  std::vector<std::string> errors = RankErrors(
      3,
      [&](Collectives& comm) {
        FaultInjectingCollectives faulty(comm);
        TrainChain(faulty, 4, options, [&](int step) { fault(comm.rank(), step, faulty); });
      },
      ranks);
  EXPECT_EQ(ThreadCount(), threads_before) << "threads left behind";
  for (int r = 0; r < 3; ++r) std::printf("--- rank %d's error:\n%s\n", r, errors[r].c_str());
  return errors;
}

TEST(FailureModes, ARankThatSkipsAUnitFailsEveryRankNamingTheUnit) {
  const std::vector<std::string> errors =
      TrainWithFault([](int rank, int step, FaultInjectingCollectives&) {
        g_skip_block = (rank == 1 && step == 2) ? 1 : -1;
      });
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(r);
    EXPECT_THAT(errors[r],
                AllOf(HasSubstr("what every rank of the group reported:"),
                      HasSubstr("first divergence at collective #"),
                      HasSubstr("ranks 0, 2 issued"), HasSubstr("(unit 'blocks.1', forward)"),
                      HasSubstr("rank 1 issued"), HasSubstr("(unit 'blocks.2', forward)")));
  }
}

TEST(FailureModes, UnitsRunInAnotherOrderAreStoppedByTheHeaders) {
  // Equal-sized units swapped on one rank: without a check every
  // collective would pair and complete, with the wrong shards.
  const std::vector<std::string> errors =
      TrainWithFault([](int rank, int step, FaultInjectingCollectives&) {
        g_swap_blocks_1_and_2 = rank == 1 && step == 2;
      });
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(r);
    EXPECT_THAT(errors[r],
                AllOf(HasSubstr("the ranks issued different collectives here (nothing was sent)"),
                      HasSubstr("ranks 0, 2 issued"), HasSubstr("(unit 'blocks.1', forward)"),
                      HasSubstr("rank 1 issued"), HasSubstr("(unit 'blocks.2', forward)")));
  }
}

TEST(FailureModes, WithoutHeadersThePeriodicCheckCatchesUnitsRunInAnotherOrder) {
  // No timeout would ever fire here: only the fingerprints tell.
  FsdpOptions options;
  options.verify_collectives_every = 1;
  MultiRankOptions ranks = ShortTimeouts();
  ranks.gloo.check_collective_headers = false;
  const std::vector<std::string> errors = TrainWithFault(
      [](int rank, int step, FaultInjectingCollectives&) {
        g_swap_blocks_1_and_2 = rank == 1 && step == 2;
      },
      options, ranks);
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(r);
    EXPECT_THAT(errors[r],
                AllOf(HasSubstr("collective fingerprint check 2 failed"),
                      HasSubstr("ranks 0, 2 issued"), HasSubstr("(unit 'blocks.1', forward)"),
                      HasSubstr("rank 1 issued"), HasSubstr("(unit 'blocks.2', forward)")));
  }
}

TEST(FailureModes, AnExceptionInForwardIsQuotedByTheOtherRanks) {
  const std::vector<std::string> errors =
      TrainWithFault([](int rank, int step, FaultInjectingCollectives&) {
        if (rank != 1 || step != 2) return;
        g_in_block_forward = [](int index) {
          TORCH_CHECK(index != 2, "rank 1's blocks.2 forward raised");
        };
      });
  EXPECT_THAT(errors[1], HasSubstr("rank 1's blocks.2 forward raised"));
  for (int r : {0, 2}) {
    SCOPED_TRACE(r);
    EXPECT_THAT(errors[r], AllOf(HasSubstr("what every rank of the group reported:"),
                                 HasSubstr("stopped: rank 1's blocks.2 forward raised")));
  }
}

TEST(FailureModes, AnExceptionInAnAutogradHookIsQuotedByTheOtherRanks) {
  const std::vector<std::string> errors =
      TrainWithFault([](int rank, int step, FaultInjectingCollectives&) {
        if (rank != 1 || step != 2) return;
        g_after_block_backward = [](int index) {
          TORCH_CHECK(index != 1, "rank 1's hook after blocks.1's backward raised");
        };
      });
  EXPECT_THAT(errors[1], HasSubstr("rank 1's hook after blocks.1's backward raised"));
  for (int r : {0, 2}) {
    SCOPED_TRACE(r);
    EXPECT_THAT(errors[r], HasSubstr("stopped: "));
    EXPECT_THAT(errors[r], HasSubstr("rank 1's hook after blocks.1's backward raised"));
  }
}

// Every rank's all-gather of blocks.1 fails while SummonFullParams gathers:
// the units gathered before it go back resharded and IDLE, so the model is
// usable again (the next summon works), not stuck in SUMMON_FULL_PARAMS.
TEST(FailureModes, AFailedSummonLeavesEveryUnitIdleAndResharded) {
  ASSERT_TRUE(RunOnThreadRanks(2, [&](Collectives& comm) {
                Chain chain;
                FaultInjectingCollectives faulty(comm);
                auto wrapped = FullyShardedModel::Wrap(chain.ptr(), faulty, {},
                                                       *ModuleTypePolicy::Of<BlockImpl>());
                ASSERT_TRUE(wrapped.ok()) << wrapped.status();
                faulty.Inject({.kind = FaultKind::kFail, .op = CollectiveOp::kAllGather,
                               .unit = "blocks.1", .phase = "summon_full_params"});
                try {
                  SummonFullParams full(**wrapped);
                  ADD_FAILURE() << "the injected failure went unnoticed";
                } catch (const c10::Error& e) {
                  EXPECT_THAT(e.what(), HasSubstr("injected failure"));
                }
                EXPECT_EQ(faulty.fired().size(), 1u);
                EXPECT_TRUE((*wrapped)->RequireIdle("after the failed summon").ok());
                EXPECT_EQ((*wrapped)->FullParamBytes(), 0);
                SummonFullParams again(**wrapped);
                EXPECT_GT((*wrapped)->FullParamBytes(), 0);
              }, ShortTimeouts()).ok());
}

TEST(FailureModes, ADelayWithinTheTimeoutChangesNothing) {
  at::Tensor undisturbed[3], delayed[3];
  ASSERT_TRUE(RunOnThreadRanks(3, [&](Collectives& comm) {
                undisturbed[comm.rank()] = TrainChain(comm, 4, {}, nullptr);
              }, ShortTimeouts()).ok());
  ASSERT_TRUE(RunOnThreadRanks(3, [&](Collectives& comm) {
                FaultInjectingCollectives faulty(comm);
                if (comm.rank() == 2) {
                  faulty.Inject({.kind = FaultKind::kDelay, .op = CollectiveOp::kReduceScatter,
                                 .unit = "blocks.1", .occurrence = 1,
                                 .delay = std::chrono::milliseconds(1500)});
                }
                delayed[comm.rank()] = TrainChain(faulty, 4, {}, nullptr);
                if (comm.rank() == 2) {
                  EXPECT_EQ(faulty.fired().size(), 1u);
                }
              }, ShortTimeouts()).ok());
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(at::equal(undisturbed[r], delayed[r])) << r;
}

TEST(FailureModes, ADelayBeyondTheTimeoutFailsEveryRankNamingTheCollective) {
  const std::vector<std::string> errors =
      TrainWithFault([](int rank, int step, FaultInjectingCollectives& faulty) {
        if (rank == 2 && step == 1) {
          faulty.Inject({.kind = FaultKind::kDelay, .op = CollectiveOp::kAllGather,
                         .unit = "blocks.2", .phase = "forward",
                         .delay = std::chrono::milliseconds(4000)});
        }
      });
  for (int r : {0, 1}) {
    SCOPED_TRACE(r);
    EXPECT_THAT(errors[r], AllOf(HasSubstr("Timed out"),
                                 MatchesRegex("(.|\n)*failed in #[0-9]+ all-gather of 72 Float "
                                              "\\(unit 'blocks.2', forward\\)(.|\n)*")));
  }
  EXPECT_FALSE(errors[2].empty());
  // Rank 2's report (it fails too, once its peers are gone) shows it late.
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(errors[r], MatchesRegex("(.|\n)*rank 2 issued #[0-9]+ [0-9]+ ms after the "
                                        "first rank did(.|\n)*"))
        << r;
  }
}

TEST(FailureModes, AFailedCollectiveIsReportedByItsRankAndQuotedByTheOthers) {
  const std::vector<std::string> errors =
      TrainWithFault([](int rank, int step, FaultInjectingCollectives& faulty) {
        if (rank == 0 && step == 1) {
          faulty.Inject({.kind = FaultKind::kFail, .op = CollectiveOp::kReduceScatter,
                         .unit = "blocks.0"});
        }
      });
  EXPECT_THAT(errors[0], MatchesRegex("(.|\n)*injected failure of fail #[0-9]+ reduce-scatter "
                                      "of 72 Float \\(sum\\) \\(unit 'blocks.0', "
                                      "backward\\)(.|\n)*"));
  for (int r : {1, 2}) {
    SCOPED_TRACE(r);
    EXPECT_THAT(errors[r], AllOf(HasSubstr("what every rank of the group reported:"),
                                 HasSubstr("stopped: "), HasSubstr("injected failure")));
  }
}

// The same for a reduction that quantizes (reduce_quantization): its
// all-to-all's failure is named on its rank and quoted by the others.
TEST(FailureModes, AFailedQuantizedReductionIsReportedByItsRankAndQuotedByTheOthers) {
  FsdpOptions options;
  options.reduce_quantization = CommQuantization::kInt8;
  const std::vector<std::string> errors = TrainWithFault(
      [](int rank, int step, FaultInjectingCollectives& faulty) {
        if (rank == 0 && step == 1) {
          faulty.Inject(
              {.kind = FaultKind::kFail, .op = CollectiveOp::kAllToAll, .unit = "blocks.0"});
        }
      },
      options);
  // 3 messages of 24 code bytes and two blocks' parameters (16 bytes).
  EXPECT_THAT(errors[0], MatchesRegex("(.|\n)*injected failure of fail #[0-9]+ all-to-all "
                                      "of 120 Byte \\(unit 'blocks.0', backward\\)(.|\n)*"));
  for (int r : {1, 2}) {
    SCOPED_TRACE(r);
    EXPECT_THAT(errors[r], AllOf(HasSubstr("what every rank of the group reported:"),
                                 HasSubstr("stopped: "), HasSubstr("injected failure")));
  }
}

TEST(FailureModes, AMismatchedCollectiveFailsEveryRankShowingBothSizes) {
  const std::vector<std::string> errors =
      TrainWithFault([](int rank, int step, FaultInjectingCollectives& faulty) {
        if (rank == 1 && step == 1) {
          faulty.Inject({.kind = FaultKind::kMismatchSize, .op = CollectiveOp::kAllGather,
                         .unit = "blocks.3", .phase = "forward"});
        }
      });
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(r);
    EXPECT_THAT(errors[r], AllOf(HasSubstr("first divergence at collective #"),
                                 HasSubstr("all-gather of 72 Float (unit 'blocks.3', forward)"),
                                 HasSubstr("rank 1 issued"),
                                 HasSubstr("all-gather of 69 Float (unit 'blocks.3', forward)")));
  }
}

}  // namespace
}  // namespace fsdp::testing
