// Two-level all-gather and reduce-scatter (comm/hierarchical_collectives.h)
// at W = 4 as 2 hosts x 2 and W = 6 as 2 x 3 and 3 x 2, over Gloo in one
// process: the same results as a flat group's, with only 1/L of the buffer
// on the cross-host group; queued collectives fail behind a failed one and
// a barrier queues behind them; groups in the wrong order are refused on every
// rank.
#include "comm/hierarchical_collectives.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "comm/gloo_collectives.h"
#include "comm/hybrid_groups.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"

namespace fsdp {
namespace {

using ::testing::HasSubstr;

struct Layout {
  int world, per_host;
};

// Runs `body(world, host, cross)` on `layout.world` thread ranks with Gloo
// groups; returns each rank's error ("" when none).
std::vector<std::string> RunRanks(
    Layout layout,
    const std::function<void(Collectives& world, Collectives& host, Collectives& cross)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  GlooOptions options;
  options.hostname = "127.0.0.1";
  options.timeout = std::chrono::seconds(30);
  const HybridShardLayout hybrid = HybridShardLayout::Create(layout.world, layout.per_host).value();
  std::vector<std::string> errors(layout.world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < layout.world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        const GroupConnector connect = GlooGroupConnector(store, options);
        auto world = connect("world", rank, layout.world);
        auto groups = CreateHybridShardCollectives(rank, hybrid, "two_level", connect);
        if (!world.ok() || !groups.ok()) {
          errors[rank] = absl::StrCat(world.status().ToString(), groups.status().ToString());
          return;
        }
        body(**world, *groups->shard, *groups->replicate);
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

// `error`, of a collective queued behind `first` (a collective whose ranks
// gave shards of different sizes), says it did not run and quotes `first`.
void ExpectNotRunAfterAMismatch(const std::string& first, const std::string& error) {
  EXPECT_THAT(first, HasSubstr("the ranks issued different collectives here"));
  EXPECT_THAT(error, HasSubstr("not run: an earlier collective of this group failed: "));
  EXPECT_THAT(error, HasSubstr("the ranks issued different collectives here"));
}

class TwoLevel : public ::testing::TestWithParam<Layout> {};

// Rank r's shard is 5 values r * 100 + i; every rank gathers them in rank
// order. The cross-host group gathers H of the W shards.
TEST_P(TwoLevel, AllGatherPutsEveryShardInRankOrder) {
  const Layout layout = GetParam();
  constexpr int64_t n = 5;
  const std::vector<std::string> errors =
      RunRanks(layout, [&](Collectives& world, Collectives& host, Collectives& cross) {
        auto group = CreateHierarchicalCollectives(world, host, cross);
        const at::Tensor shard = at::arange(n, at::kFloat) + 100.0 * world.rank();
        at::Tensor out = at::empty({layout.world * n});
        group->AllGatherIntoTensor(out, shard)->Wait();
        at::Tensor want = at::empty({layout.world * n});
        world.AllGatherIntoTensor(want, shard)->Wait();
        EXPECT_TRUE(at::equal(out, want)) << "rank " << world.rank() << ": " << out;
        const int hosts = layout.world / layout.per_host;
        EXPECT_EQ(cross.counters().Bytes(CollectiveOp::kAllGather), hosts * n * 4);
        EXPECT_EQ(group->counters().Calls(CollectiveOp::kAllGather), 1);
      });
  for (int r = 0; r < layout.world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Integer-valued inputs, so that every summation order gives the same
// float sums: each rank's output equals a flat reduce-scatter's exactly for
// sums and to rounding for averages; the cross-host group reduces H of the
// W segments.
TEST_P(TwoLevel, ReduceScatterSumsEveryRanksSegment) {
  const Layout layout = GetParam();
  constexpr int64_t n = 7;
  const std::vector<std::string> errors =
      RunRanks(layout, [&](Collectives& world, Collectives& host, Collectives& cross) {
        auto group = CreateHierarchicalCollectives(world, host, cross);
        at::manual_seed(world.rank());
        const at::Tensor input = at::randint(-50, 50, {layout.world * n}, at::kFloat);
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          SCOPED_TRACE(ReduceOpName(op));
          at::Tensor out = at::empty({n});
          group->ReduceScatterTensor(out, input, op)->Wait();
          at::Tensor want = at::empty({n});
          world.ReduceScatterTensor(want, input, op)->Wait();
          // Averages round at each level (a host's mean, then the hosts'):
          // up to a few float steps of the sums (|sum| <= 300 here), which
          // near-cancelling means leave as absolute error.
          EXPECT_TRUE(at::allclose(out, want, 1e-6, 1e-4)) << (out - want).abs().max();
          if (op == ReduceOp::kSum) EXPECT_TRUE(at::equal(out, want)) << out << want;
        }
        const int hosts = layout.world / layout.per_host;
        EXPECT_EQ(cross.counters().Bytes(CollectiveOp::kReduceScatter), 2 * hosts * n * 4);
      });
  for (int r = 0; r < layout.world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Layouts, TwoLevel,
                         ::testing::Values(Layout{4, 2}, Layout{6, 3}, Layout{6, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return absl::StrCat("W", info.param.world, "_", info.param.per_host,
                                               "_per_host");
                         });

// The host and cross-host groups swapped (W = 6 as 2 hosts x 3: the sizes
// still multiply to 6): every rank refuses, naming a misplaced rank,
// before anything is sent on the groups; and a group passed twice is
// refused.
TEST(TwoLevelGroups, GroupsInTheWrongOrderAreRefusedOnEveryRank) {
  const std::vector<std::string> errors =
      RunRanks({6, 3}, [&](Collectives& world, Collectives& host, Collectives& cross) {
        try {
          CreateHierarchicalCollectives(world, cross, host);
          ADD_FAILURE() << "swapped groups were accepted";
        } catch (const c10::Error& e) {
          EXPECT_THAT(e.what_without_backtrace(),
                      HasSubstr("hierarchical collectives: world rank 1 is rank 0 of its host "
                                "group and 1 of its cross-host group, which makes it 2"));
        }
        try {
          CreateHierarchicalCollectives(world, host, host);
          ADD_FAILURE() << "one group as host and cross-host groups was accepted";
        } catch (const c10::Error& e) {
          EXPECT_THAT(e.what_without_backtrace(), HasSubstr("must be three groups"));
        }
      });
  for (int r = 0; r < 6; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// A barrier queues behind the collectives issued before it, at both
// levels: issued right after an all-gather (whose stages are then still
// queued or in flight), it returns on every rank, and the all-gather
// completes with every rank's values. Issued out of order on some rank, a
// level's barrier would pair with another rank's all-gather stage and fail.
TEST(TwoLevelGroups, ABarrierQueuesBehindTheIssuedCollectives) {
  const std::vector<std::string> errors =
      RunRanks({4, 2}, [&](Collectives& world, Collectives& host, Collectives& cross) {
        auto group = CreateHierarchicalCollectives(world, host, cross);
        at::Tensor out = at::zeros({4 * 1000});
        std::unique_ptr<CollectiveWork> work =
            group->AllGatherIntoTensor(out, at::full({1000}, 1.0f + world.rank()));
        group->Barrier();
        work->Wait();
        EXPECT_EQ(out.sum().item<float>(), 1000.0f * (1 + 2 + 3 + 4));
      });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// A collective that fails on the worker fails its work, and the one queued
// behind it fails at once quoting it: the second host's ranks give shards
// of another size, which the cross-host groups' header check refuses on
// both of their ranks before any data moves.
TEST(TwoLevelGroups, ACollectiveQueuedBehindAFailedOneFailsQuotingIt) {
  const std::vector<std::string> errors =
      RunRanks({4, 2}, [&](Collectives& world, Collectives& host, Collectives& cross) {
        auto group = CreateHierarchicalCollectives(world, host, cross);
        const int64_t n = world.rank() < 2 ? 3 : 4;
        at::Tensor out = at::empty({4 * n});
        std::unique_ptr<CollectiveWork> mismatched = group->AllGatherIntoTensor(out, at::ones({n}));
        std::unique_ptr<CollectiveWork> behind = group->AllGatherIntoTensor(out, at::ones({n}));
        std::string first;
        try {
          mismatched->Wait();
          ADD_FAILURE() << "shards of different sizes were gathered";
        } catch (const c10::Error& e) {
          first = e.what_without_backtrace();
        }
        try {
          behind->Wait();
          ADD_FAILURE() << "the collective behind a failed one ran";
        } catch (const c10::Error& e) {
          ExpectNotRunAfterAMismatch(first, e.what_without_backtrace());
        }
      });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// A failure at one level stops the other level's later collectives too:
// the ranks with local index 1 give longer shards, so every host group's
// all-gather is refused (the cross-host groups pair equal shards and
// succeed). The first host's ranks then issue another all-gather; the
// second host's never do, but keep their groups open. Its cross-host stage
// must not run (it would wait the 30 s timeout for peers that never come):
// it fails at once, quoting the first failure.
TEST(TwoLevelGroups, AFailureAtOneLevelStopsTheOtherLevelsLaterCollectives) {
  std::atomic<int> first_host_done{0};
  const std::vector<std::string> errors =
      RunRanks({4, 2}, [&](Collectives& world, Collectives& host, Collectives& cross) {
        auto group = CreateHierarchicalCollectives(world, host, cross);
        const int64_t n = host.rank() == 0 ? 3 : 4;
        at::Tensor out = at::empty({4 * n});
        std::string first;
        try {
          group->AllGatherIntoTensor(out, at::ones({n}))->Wait();
          ADD_FAILURE() << "a host group gathered shards of different sizes";
        } catch (const c10::Error& e) {
          first = e.what_without_backtrace();
        }
        if (cross.rank() == 1) {
          for (int i = 0; i < 600 && first_host_done.load() < 2; ++i) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
          }
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        try {
          group->AllGatherIntoTensor(out, at::ones({n}))->Wait();
          ADD_FAILURE() << "an all-gather ran after a failed one";
        } catch (const c10::Error& e) {
          ExpectNotRunAfterAMismatch(first, e.what_without_backtrace());
        }
        const double waited_s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        EXPECT_LT(waited_s, 10) << "rank " << world.rank() << " waited for the cross-host stage";
        ++first_host_done;
      });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

}  // namespace
}  // namespace fsdp
