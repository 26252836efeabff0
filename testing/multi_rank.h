// Runs a test body on W ranks, with a deadline, and reports every rank's
// failure together.
//
//   TEST(AllGather, Float32) {
//     absl::Status status = RunOnThreadRanks(4, [](Collectives& comm) {
//       ... EXPECT_* / ASSERT_* as usual; comm.rank() says which rank this is ...
//     });
//     EXPECT_TRUE(status.ok()) << status;
//   }
//
// Two ways to run the ranks:
//   * RunOnThreadRanks: one thread per rank in this process; the groups meet
//     through an in-memory store and talk over loopback TCP.
//   * RunOnProcessRanks: one process per rank, each a re-run of this test
//     binary filtered to the current test, meeting through a real TCPStore
//     rendezvous from launcher environment variables (as torchrun would).
//     Code before the call runs in every rank process too; code after it runs
//     only in the parent. A test may call it more than once.
//
// Failures: an exception escaping the body on rank r becomes "rank r: <what>"
// in the returned status, with every failed rank listed, and is published
// to the group's fingerprint exchange (Collectives::ReportStopped), so that
// the other ranks' collective errors quote it. gtest failures
// inside the body are reported by gtest itself, marked "rank r" (thread mode)
// or found in the failing rank's log, which the status quotes (process mode).
// Collectives get `collective_timeout`, so a rank stuck in a collective fails
// with the name of the operation. If ranks are still running at `timeout`:
// process mode kills them and names them in the status; thread mode cannot
// kill threads, so it prints the names of the ranks that did not finish and
// ends the test process with exit code kHungRanksExitCode.
#ifndef FSDP_TESTING_MULTI_RANK_H_
#define FSDP_TESTING_MULTI_RANK_H_

#include <chrono>
#include <functional>

#include "absl/status/status.h"
#include "comm/collectives.h"
#include "comm/gloo_collectives.h"

namespace fsdp::testing {

struct MultiRankOptions {
  // Deadline of the whole body on all ranks, group creation included.
  std::chrono::milliseconds timeout = std::chrono::seconds(120);
  // Bound on each collective (and on connecting the group).
  std::chrono::milliseconds collective_timeout = std::chrono::seconds(60);
  // Options of every rank's group; the harness sets timeout (from
  // collective_timeout) and, in thread mode, hostname (loopback).
  GlooOptions gloo;
};

using RankBody = std::function<void(Collectives& comm)>;

inline constexpr int kHungRanksExitCode = 86;

absl::Status RunOnThreadRanks(int world_size, const RankBody& body,
                              const MultiRankOptions& options = {});

absl::Status RunOnProcessRanks(int world_size, const RankBody& body,
                               const MultiRankOptions& options = {});

}  // namespace fsdp::testing

#endif  // FSDP_TESTING_MULTI_RANK_H_
