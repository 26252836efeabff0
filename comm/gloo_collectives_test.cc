#include "comm/gloo_collectives.h"

#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "c10/util/Exception.h"
#include "comm/collectives.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"

namespace fsdp {
namespace {

using ::fsdp::testing::MultiRankOptions;
using ::fsdp::testing::RunOnProcessRanks;
using ::fsdp::testing::RunOnThreadRanks;
using ::testing::HasSubstr;

// Small integers, different on every rank and position, so that sums are
// exact in every dtype and a misplaced chunk changes the result.
at::Tensor Pattern(int rank, int64_t numel, at::ScalarType dtype) {
  at::Tensor i = at::arange(numel, at::kLong);
  return ((i * 31 + rank * 17 + 3) % 13 - 6).to(dtype);
}

// What rank `rank` must hold after reducing Pattern(r, numel) over all r.
at::Tensor ExpectedReduction(int world_size, int64_t numel, at::ScalarType dtype,
                             ReduceOp op) {
  at::Tensor sum = at::zeros({numel}, at::kFloat);
  for (int r = 0; r < world_size; ++r) sum += Pattern(r, numel, at::kFloat);
  if (op == ReduceOp::kAvg) sum.div_(world_size);
  return sum.to(dtype);
}

void ExpectEqualTensors(const at::Tensor& actual, const at::Tensor& expected,
                        const std::string& what) {
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type()) << what;
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(at::equal(actual, expected))
      << what << "\nactual:   " << actual.slice(0, 0, 12)
      << "\nexpected: " << expected.slice(0, 0, 12);
}

// Checks every collective on one rank for several sizes. Sizes per rank
// include 1, a prime (uneven over 3 ranks) and one above Gloo's small-message
// range; 0 checks the empty case.
void CheckAllCollectives(Collectives& comm, at::ScalarType dtype) {
  const int rank = comm.rank();
  const int world = comm.world_size();
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{1} << 16}) {
    SCOPED_TRACE(::testing::Message() << "shard numel " << n << ", dtype " << dtype);
    // All-gather into one tensor.
    at::Tensor shard = Pattern(rank, n, dtype);
    at::Tensor shard_before = shard.clone();
    at::Tensor full = at::full({world * n}, 99, dtype);
    comm.AllGatherIntoTensor(full, shard)->Wait();
    std::vector<at::Tensor> pieces;
    for (int r = 0; r < world; ++r) pieces.push_back(Pattern(r, n, dtype));
    ExpectEqualTensors(full, at::cat(pieces), "all-gather output");
    ExpectEqualTensors(shard, shard_before, "all-gather input is unchanged");

    // Reduce-scatter, sum and average.
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      at::Tensor input = Pattern(rank, world * n, dtype);
      at::Tensor input_before = input.clone();
      at::Tensor output = at::full({n}, 99, dtype);
      comm.ReduceScatterTensor(output, input, op)->Wait();
      at::Tensor expected =
          ExpectedReduction(world, world * n, dtype, op).slice(0, rank * n, (rank + 1) * n);
      ExpectEqualTensors(output, expected,
                         std::string("reduce-scatter ") + ReduceOpName(op));
      ExpectEqualTensors(input, input_before, "reduce-scatter input is unchanged");
    }

    // All-reduce: any shape and any numel (n + 1 is not a multiple of 2 or 4).
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      at::Tensor tensor = Pattern(rank, n + 1, dtype).view({1, n + 1});
      comm.AllReduce(tensor, op)->Wait();
      ExpectEqualTensors(tensor.view({-1}), ExpectedReduction(world, n + 1, dtype, op),
                         std::string("all-reduce ") + ReduceOpName(op));
    }

    // All-to-all: chunk `rank` of every rank's input, in rank order.
    {
      at::Tensor input = Pattern(rank, world * n, dtype);
      at::Tensor input_before = input.clone();
      at::Tensor output = at::full({world * n}, 99, dtype);
      comm.AllToAll(output, input)->Wait();
      std::vector<at::Tensor> pieces;
      for (int r = 0; r < world; ++r) {
        pieces.push_back(Pattern(r, world * n, dtype).slice(0, rank * n, (rank + 1) * n));
      }
      ExpectEqualTensors(output, at::cat(pieces), "all-to-all output");
      ExpectEqualTensors(input, input_before, "all-to-all input is unchanged");
    }

    // Broadcast from every root.
    for (int root = 0; root < world; ++root) {
      at::Tensor tensor = Pattern(rank, n, dtype);
      comm.Broadcast(tensor, root)->Wait();
      ExpectEqualTensors(tensor, Pattern(root, n, dtype), "broadcast");
    }
  }
  comm.Barrier();
}

class CollectivesTest
    : public ::testing::TestWithParam<std::tuple<int, at::ScalarType>> {};

TEST_P(CollectivesTest, ThreadRanksMatchReference) {
  const auto [world, dtype] = GetParam();
  absl::Status status = RunOnThreadRanks(
      world, [dtype = dtype](Collectives& comm) { CheckAllCollectives(comm, dtype); });
  EXPECT_TRUE(status.ok()) << status;
}

INSTANTIATE_TEST_SUITE_P(
    WorldSizesAndDtypes, CollectivesTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 4),
                       ::testing::Values(at::kFloat, at::kHalf, at::kBFloat16)),
    [](const ::testing::TestParamInfo<CollectivesTest::ParamType>& info) {
      return "W" + std::to_string(std::get<0>(info.param)) + "_" +
             c10::toString(std::get<1>(info.param));
    });

TEST(Collectives, MatchReferenceWithoutReusedBuffers) {
  MultiRankOptions options;
  options.gloo.reuse_staging_buffers = false;
  absl::Status status = RunOnThreadRanks(
      3,
      [](Collectives& comm) {
        CheckAllCollectives(comm, at::kFloat);
        CheckAllCollectives(comm, at::kBFloat16);
      },
      options);
  EXPECT_TRUE(status.ok()) << status;
}

TEST(Collectives, ProcessRanksMatchReference) {
  for (int world : {2, 3}) {
    absl::Status status = RunOnProcessRanks(world, [](Collectives& comm) {
      CheckAllCollectives(comm, at::kFloat);
      CheckAllCollectives(comm, at::kBFloat16);
    });
    EXPECT_TRUE(status.ok()) << "world size " << world << ": " << status;
  }
}

// Several collectives in flight at once: each must get its own staging
// buffer, since the group reuses them only once no pending work holds them.
TEST(Collectives, OverlappingCollectivesKeepTheirOwnBuffers) {
  absl::Status status = RunOnThreadRanks(3, [](Collectives& comm) {
    const int world = comm.world_size();
    const int64_t n = 4099;
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      std::vector<at::Tensor> rs_out, ag_out, ar;
      std::vector<std::unique_ptr<CollectiveWork>> works;
      for (int k = 0; k < 3; ++k) {
        rs_out.push_back(at::empty({n}, dtype));
        works.push_back(comm.ReduceScatterTensor(
            rs_out.back(), Pattern(comm.rank() + k, world * n, dtype), ReduceOp::kSum));
        ag_out.push_back(at::empty({world * n}, dtype));
        works.push_back(
            comm.AllGatherIntoTensor(ag_out.back(), Pattern(comm.rank() + k, n, dtype)));
        ar.push_back(Pattern(comm.rank() + k, n, dtype));
        works.push_back(comm.AllReduce(ar.back(), ReduceOp::kSum));
      }
      // Wait in reverse order of issue.
      for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->Wait();
      for (int k = 0; k < 3; ++k) {
        at::Tensor expected_sum = at::zeros({world * n}, at::kFloat);
        std::vector<at::Tensor> pieces;
        for (int r = 0; r < world; ++r) {
          expected_sum += Pattern(r + k, world * n, at::kFloat);
          pieces.push_back(Pattern(r + k, n, dtype));
        }
        ExpectEqualTensors(rs_out[k],
                           expected_sum.slice(0, comm.rank() * n, (comm.rank() + 1) * n)
                               .to(dtype),
                           "overlapping reduce-scatter " + std::to_string(k));
        ExpectEqualTensors(ag_out[k], at::cat(pieces),
                           "overlapping all-gather " + std::to_string(k));
        ExpectEqualTensors(ar[k], expected_sum.slice(0, 0, n).to(dtype).clone(),
                           "overlapping all-reduce " + std::to_string(k));
      }
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(Collectives, CountsCallsAndFullBufferBytes) {
  absl::Status status = RunOnThreadRanks(3, [](Collectives& comm) {
    comm.ResetCounters();
    at::Tensor shard = at::zeros({10}, at::kBFloat16);
    at::Tensor full = at::zeros({30}, at::kBFloat16);
    comm.AllGatherIntoTensor(full, shard)->Wait();
    comm.AllGatherIntoTensor(full, shard)->Wait();
    comm.ReduceScatterTensor(shard, full, ReduceOp::kAvg)->Wait();
    comm.AllReduce(at::zeros({5}, at::kFloat), ReduceOp::kSum)->Wait();
    comm.Broadcast(at::zeros({4}, at::kDouble), 0)->Wait();
    comm.AllToAll(at::zeros({12}, at::kByte), at::zeros({12}, at::kByte))->Wait();
    comm.Barrier();
    const CollectiveCounters c = comm.counters();
    EXPECT_EQ(c.Calls(CollectiveOp::kAllGather), 2);
    EXPECT_EQ(c.Bytes(CollectiveOp::kAllGather), 2 * 30 * 2);
    EXPECT_EQ(c.Calls(CollectiveOp::kReduceScatter), 1);
    EXPECT_EQ(c.Bytes(CollectiveOp::kReduceScatter), 30 * 2);
    EXPECT_EQ(c.Calls(CollectiveOp::kAllReduce), 1);
    EXPECT_EQ(c.Bytes(CollectiveOp::kAllReduce), 5 * 4);
    EXPECT_EQ(c.Calls(CollectiveOp::kBroadcast), 1);
    EXPECT_EQ(c.Bytes(CollectiveOp::kBroadcast), 4 * 8);
    EXPECT_EQ(c.Calls(CollectiveOp::kAllToAll), 1);
    EXPECT_EQ(c.Bytes(CollectiveOp::kAllToAll), 12);
    EXPECT_EQ(c.Calls(CollectiveOp::kBarrier), 1);
    comm.ResetCounters();
    EXPECT_EQ(comm.counters().Calls(CollectiveOp::kAllGather), 0);
  });
  EXPECT_TRUE(status.ok()) << status;
}

// Every caller mistake is refused on the calling rank, before anything is
// sent, with a message naming the operation, the rank and the mismatch; the
// group stays usable afterwards.
TEST(Collectives, RejectsBadArgumentsWithClearErrors) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& comm) {
    auto expect_error = [&](const std::function<void()>& call, const std::string& text) {
      try {
        call();
        ADD_FAILURE() << "expected an error containing: " << text;
      } catch (const c10::Error& e) {
        EXPECT_THAT(e.msg(), HasSubstr(text));
        EXPECT_THAT(e.msg(), HasSubstr("rank " + std::to_string(comm.rank()) + " of 2"));
      }
    };
    const at::Tensor shard = at::zeros({4});
    expect_error([&] { comm.AllGatherIntoTensor(at::zeros({7}), shard); },
                 "all-gather: output has 7 elements but must have world_size * "
                 "input.numel() = 2 * 4 = 8");
    expect_error([&] { comm.ReduceScatterTensor(shard, at::zeros({9}), ReduceOp::kSum); },
                 "reduce-scatter: input has 9 elements but must have world_size * "
                 "output.numel() = 2 * 4 = 8");
    expect_error([&] { comm.AllGatherIntoTensor(at::zeros({8}, at::kHalf), shard); },
                 "all-gather: output dtype Half does not match input dtype Float");
    expect_error([&] { comm.AllGatherIntoTensor(at::zeros({8}), at::zeros({4}, at::kLong)); },
                 "input has dtype Long; supported are Float, Double, Half and BFloat16");
    expect_error([&] { comm.AllGatherIntoTensor(at::zeros({8}), at::zeros({2, 2})); },
                 "input must be 1-D (a flat buffer) but has shape [2, 2]");
    expect_error([&] { comm.AllGatherIntoTensor(at::zeros({16}).slice(0, 0, 16, 2), shard); },
                 "output must be contiguous");
    expect_error([&] { comm.ReduceScatterTensor(shard, at::Tensor(), ReduceOp::kSum); },
                 "input is an undefined tensor");
    expect_error([&] { comm.ReduceScatterTensor(shard, at::zeros({8}), static_cast<ReduceOp>(7)); },
                 "invalid ReduceOp 7");
    expect_error([&] { comm.AllReduce(at::zeros({3}, at::kInt), ReduceOp::kSum); },
                 "all-reduce: tensor has dtype Int");
    expect_error([&] { comm.Broadcast(at::zeros({3}), 2); },
                 "broadcast: root 2 is not a rank of this group (world_size 2)");
    expect_error([&] { comm.Broadcast(at::zeros({3}), -1); }, "root -1");
    expect_error([&] { comm.AllToAll(at::zeros({6}), at::zeros({5})); },
                 "all-to-all: input and output must have the same number of elements, a "
                 "multiple of world_size 2, but input has 5 and output 6");
    expect_error([&] { comm.AllToAll(at::zeros({3}), at::zeros({3})); }, "input has 3");
    expect_error([&] { comm.AllToAll(at::zeros({4}, at::kByte), at::zeros({4})); },
                 "all-to-all: output dtype Byte does not match input dtype Float");
    expect_error(
        [&] {
          const at::Tensor both = at::zeros({4});
          comm.AllToAll(both, both);
        },
        "all-to-all: output and input are the same tensor");
    expect_error([&] { comm.AllReduce(at::zeros({4}, at::kByte), ReduceOp::kSum); },
                 "all-reduce: tensor has dtype Byte");
    const at::Tensor meta = at::empty({4}, at::TensorOptions().device(at::kMeta));
    expect_error([&] { comm.AllReduce(meta, ReduceOp::kSum); },
                 "all-reduce: tensor is on meta, which this group does not handle (it "
                 "handles CPU tensors)");
    expect_error([&] { comm.AllGatherIntoTensor(at::zeros({8}), meta); },
                 "all-gather: input is on meta, which this group does not handle");
    EXPECT_EQ(comm.counters().Calls(CollectiveOp::kAllGather), 0)
        << "refused calls must not be counted";

    // The group still works.
    at::Tensor full = at::zeros({8});
    comm.AllGatherIntoTensor(full, at::full({4}, comm.rank() + 1.0))->Wait();
    EXPECT_EQ(full.sum().item<float>(), 4 * 1.0 + 4 * 2.0);
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(Collectives, RejectsBadGroupArguments) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  GlooOptions options;
  options.hostname = "127.0.0.1";
  EXPECT_THAT(CreateGlooCollectives(store, 2, 2, options).status().message(),
              HasSubstr("rank 2 is not in [0, world_size = 2)"));
  EXPECT_THAT(CreateGlooCollectives(store, 0, 0, options).status().message(),
              HasSubstr("rank 0 is not in [0, world_size = 0)"));
  EXPECT_THAT(CreateGlooCollectives(c10::intrusive_ptr<c10d::Store>(), 0, 1, options).status().message(),
              HasSubstr("store is null"));
  GlooOptions both = options;
  both.interface = "lo";
  EXPECT_THAT(CreateGlooCollectives(store, 0, 1, both).status().message(),
              HasSubstr("at most one of interface and hostname"));
}

// Restores SIGPIPE's disposition when a test ends, whatever it set.
class SigpipeDisposition {
 public:
  SigpipeDisposition() { sigaction(SIGPIPE, nullptr, &saved_); }
  ~SigpipeDisposition() { sigaction(SIGPIPE, &saved_, nullptr); }
  static void Set(void (*handler)(int)) {
    struct sigaction action = {};
    action.sa_handler = handler;
    sigemptyset(&action.sa_mask);
    ASSERT_EQ(sigaction(SIGPIPE, &action, nullptr), 0);
  }
  static void (*Current())(int) {
    struct sigaction action = {};
    sigaction(SIGPIPE, nullptr, &action);
    return action.sa_handler;
  }

 private:
  struct sigaction saved_ = {};
};

// Writes to a socket whose peer has closed its end; returns errno.
int WriteToClosedPeer() {
  int ends[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, ends) != 0) return -1;
  close(ends[1]);
  const char byte = 1;
  const ssize_t written = write(ends[0], &byte, 1);
  const int error = written < 0 ? errno : 0;
  close(ends[0]);
  return error;
}

// Gloo writes with writev(2), so a peer that went away raises SIGPIPE in
// the sender (NOTE [Broken connections]). Once a group exists, that write
// must fail with EPIPE and leave this process alive to report it; without
// the handler this test dies of SIGPIPE.
TEST(Collectives, AClosedPeerIsAnErrorNotAKilledProcess) {
  SigpipeDisposition restore;
  SigpipeDisposition::Set(SIG_DFL);
  GlooOptions options;
  options.hostname = "127.0.0.1";
  auto group = CreateGlooCollectives(c10::make_intrusive<c10d::HashStore>(), 0, 1, options);
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_NE(SigpipeDisposition::Current(), SIG_DFL);
  EXPECT_NE(SigpipeDisposition::Current(), SIG_IGN) << "SIG_IGN would pass to exec'd children";
  EXPECT_EQ(WriteToClosedPeer(), EPIPE);
}

void ProgramsOwnSigpipeHandler(int) {}

TEST(Collectives, ASigpipeDispositionTheProgramChoseIsKept) {
  SigpipeDisposition restore;
  GlooOptions options;
  options.hostname = "127.0.0.1";
  for (void (*chosen)(int) : {&ProgramsOwnSigpipeHandler, SIG_IGN}) {
    SigpipeDisposition::Set(chosen);
    auto group = CreateGlooCollectives(c10::make_intrusive<c10d::HashStore>(), 0, 1, options);
    ASSERT_TRUE(group.ok()) << group.status();
    EXPECT_EQ(SigpipeDisposition::Current(), chosen);
  }
}

// Ranks that disagree on the world size are told so, by rank, instead of
// waiting for a peer that will never come.
TEST(Collectives, MismatchedWorldSizesAreNamed) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  GlooOptions options;
  options.hostname = "127.0.0.1";
  options.timeout = std::chrono::seconds(5);
  absl::Status statuses[3];
  std::vector<std::thread> threads;
  // Ranks 0 and 1 believe in a world of 3, rank 2 in a world of 4.
  for (int rank = 0; rank < 3; ++rank) {
    threads.emplace_back([&, rank] {
      statuses[rank] =
          CreateGlooCollectives(store, rank, rank == 2 ? 4 : 3, options).status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_THAT(statuses[rank].message(),
                HasSubstr("world size mismatch: this rank was created with world size 3 "
                          "but rank 2 was created with world size 4"))
        << "rank " << rank;
  }
  EXPECT_THAT(statuses[2].message(),
              HasSubstr("world size mismatch: this rank was created with world size 4 "
                        "but rank 0 was created with world size 3"));
}

// A rank that never joins a collective makes the others fail within the
// collective timeout, naming the operation, instead of hanging.
TEST(Collectives, MissingPeerTimesOutWithTheOperationNamed) {
  MultiRankOptions options;
  options.collective_timeout = std::chrono::seconds(2);
  absl::Status status = RunOnThreadRanks(
      2,
      [](Collectives& comm) {
        if (comm.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::seconds(4));
          return;
        }
        at::Tensor full = at::zeros({8});
        std::unique_ptr<CollectiveWork> work = comm.AllGatherIntoTensor(full, at::zeros({4}));
        std::string first_error;
        try {
          work->Wait();
        } catch (const c10::Error& e) {
          first_error = e.msg();
        }
        // A failed work stays failed.
        try {
          work->Wait();
          ADD_FAILURE() << "a second Wait() on a failed work returned normally";
        } catch (const c10::Error& e) {
          EXPECT_EQ(e.msg(), first_error);
        }
        throw std::runtime_error(first_error);
      },
      options);
  ASSERT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr("1 of 2 ranks failed"));
  EXPECT_THAT(status.message(),
              HasSubstr("rank 0: rank 0 of 2 of group 'world': all-gather of 8 Float "
                        "elements failed"));
}

// Forwards to a shared store, but throws when this rank first publishes
// its Gloo address in the first mesh attempt: this rank's connection fails,
// and its peers, which never learn its address, fail theirs when the store
// times out. Every rank must then agree to build the mesh again.
class FailFirstMeshStore final : public c10d::Store {
 public:
  explicit FailFirstMeshStore(c10::intrusive_ptr<c10d::Store> inner)
      : inner_(std::move(inner)), failed_(std::make_shared<std::atomic<bool>>(false)) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    if (key.find("mesh/0/") != std::string::npos && key.find("/result/") == std::string::npos &&
        !failed_->exchange(true)) {
      throw std::runtime_error("injected: Connection closed by peer");
    }
    inner_->set(key, value);
  }
  // libtorch 2.x's Store is cloneable (a second client of the same store);
  // 1.13's has no clone(), hence no `override`. A clone shares the inner
  // store and the one injected failure.
  c10::intrusive_ptr<c10d::Store> clone() {
    auto copy = c10::make_intrusive<FailFirstMeshStore>(inner_);
    copy->failed_ = failed_;
    return copy;
  }
  std::vector<uint8_t> get(const std::string& key) override { return inner_->get(key); }
  int64_t add(const std::string& key, int64_t value) override { return inner_->add(key, value); }
  bool deleteKey(const std::string& key) override { return inner_->deleteKey(key); }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  int64_t getNumKeys() override { return inner_->getNumKeys(); }
  void wait(const std::vector<std::string>& keys) override { inner_->wait(keys); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    inner_->wait(keys, timeout);
  }

 private:
  c10::intrusive_ptr<c10d::Store> inner_;
  std::shared_ptr<std::atomic<bool>> failed_;
};

TEST(Collectives, AConnectionDroppedWhileTheMeshFormsIsRetriedOnEveryRank) {
  auto shared = c10::make_intrusive<c10d::HashStore>();
  constexpr int kWorld = 3;
  std::vector<std::string> errors(kWorld);
  std::vector<double> sums(kWorld, 0);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kWorld; ++rank) {
    threads.emplace_back([&, rank] {
      c10::intrusive_ptr<c10d::Store> store = shared;
      if (rank == 1) store = c10::make_intrusive<FailFirstMeshStore>(shared);
      GlooOptions options;
      options.hostname = "127.0.0.1";
      options.timeout = std::chrono::seconds(3);
      auto comm = CreateGlooCollectives(store, rank, kWorld, options);
      if (!comm.ok()) {
        errors[rank] = std::string(comm.status().message());
        return;
      }
      at::Tensor t = at::full({1}, rank + 1.0, at::kFloat);
      (*comm)->AllReduce(t, ReduceOp::kSum)->Wait();
      sums[rank] = t.item<float>();
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < kWorld; ++rank) {
    EXPECT_EQ(errors[rank], "") << "rank " << rank;
    EXPECT_EQ(sums[rank], 6.0) << "rank " << rank;
  }
}

// NOTE [Concurrent enqueues] in gloo_collectives.cc: many process groups of
// one process, each rank a thread, issue their groups' first collectives at
// the same moment, round after round with new groups. Under libtorch 2.11
// without the enqueue mutex this crashes inside c10d's flight recorder.
TEST(Collectives, ManyGroupsOfOneProcessStartTheirFirstCollectivesAtOnce) {
  constexpr int kGroups = 6;
  constexpr int kRanks = 2;
  constexpr int kRounds = 25;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<c10::intrusive_ptr<c10d::Store>> stores;
    for (int g = 0; g < kGroups; ++g) stores.push_back(c10::make_intrusive<c10d::HashStore>());
    std::atomic<int> connected{0};
    std::vector<std::string> errors(kGroups * kRanks);
    std::vector<double> sums(kGroups * kRanks, 0);
    std::vector<std::thread> threads;
    for (int g = 0; g < kGroups; ++g) {
      for (int rank = 0; rank < kRanks; ++rank) {
        threads.emplace_back([&, g, rank] {
          const int slot = g * kRanks + rank;
          GlooOptions options;
          options.hostname = "127.0.0.1";
          options.group_name = absl::StrCat("group ", g);
          auto comm = CreateGlooCollectives(stores[g], rank, kRanks, options);
          ++connected;
          if (!comm.ok()) {
            errors[slot] = std::string(comm.status().message());
            return;
          }
          while (connected.load() < kGroups * kRanks) std::this_thread::yield();
          at::Tensor t = at::full({8}, rank + 1.0, at::kFloat);
          (*comm)->AllReduce(t, ReduceOp::kSum)->Wait();
          sums[slot] = t[7].item<float>();
        });
      }
    }
    for (auto& t : threads) t.join();
    for (int slot = 0; slot < kGroups * kRanks; ++slot) {
      EXPECT_EQ(errors[slot], "") << "round " << round << ", thread " << slot;
      EXPECT_EQ(sums[slot], 3.0) << "round " << round << ", thread " << slot;
    }
  }
}

TEST(Collectives, BroadcastAndAllGatherBytesDeliverBytesExactly) {
  absl::Status status = RunOnThreadRanks(3, [](Collectives& comm) {
    std::string mine;
    for (int i = 0; i < 1001; ++i) mine.push_back(static_cast<char>((i * 37 + comm.rank()) & 0xff));
    std::string bytes = mine;
    BroadcastBytes(comm, bytes, 1);
    std::string want;
    for (int i = 0; i < 1001; ++i) want.push_back(static_cast<char>((i * 37 + 1) & 0xff));
    EXPECT_EQ(bytes, want);
    std::string empty = comm.rank() == 2 ? "" : "ignored";
    BroadcastBytes(comm, empty, 2);
    EXPECT_EQ(empty, "");
    const std::vector<std::string> all =
        AllGatherBytes(comm, std::string(static_cast<size_t>(comm.rank()) * 5, 'a' + comm.rank()));
    ASSERT_EQ(all.size(), 3u);
    EXPECT_EQ(all[0], "");
    EXPECT_EQ(all[1], "bbbbb");
    EXPECT_EQ(all[2], "cccccccccc");

    // And through an all-to-all (coded payloads): every value 0..255.
    const int64_t chunk = 256;
    at::Tensor send = (at::arange(3 * chunk, at::kLong) + comm.rank()).remainder(256).to(at::kByte);
    at::Tensor received = at::empty({3 * chunk}, at::kByte);
    comm.AllToAll(received, send)->Wait();
    for (int r = 0; r < 3; ++r) {
      const at::Tensor theirs = (at::arange(3 * chunk, at::kLong) + r).remainder(256).to(at::kByte);
      EXPECT_TRUE(at::equal(received.slice(0, r * chunk, (r + 1) * chunk),
                            theirs.slice(0, comm.rank() * chunk, (comm.rank() + 1) * chunk)))
          << "chunk from rank " << r;
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

}  // namespace
}  // namespace fsdp
