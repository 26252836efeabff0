#include "comm/fingerprint.h"

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "c10/util/Exception.h"
#include "comm/collectives.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/fault_injection.h"
#include "testing/multi_rank.h"

namespace fsdp {
namespace {

using ::fsdp::testing::Fault;
using ::fsdp::testing::FaultInjectingCollectives;
using ::fsdp::testing::FaultKind;
using ::fsdp::testing::MultiRankOptions;
using ::fsdp::testing::RunOnThreadRanks;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

FingerprintReport ReportOf(int rank, const FingerprintLog& log, const std::string& status) {
  return MakeReport(rank, log, status);
}

TEST(FingerprintLog, HashesTheWholeHistoryAndKeepsTheLastRecords) {
  FingerprintLog a(/*capacity=*/4), b(/*capacity=*/4), c(/*capacity=*/4);
  for (int i = 0; i < 10; ++i) {
    a.Append(CollectiveOp::kAllGather, 8, "Float", 0, "blocks.1", "forward");
    b.Append(CollectiveOp::kAllGather, 8, "Float", 0, "blocks.1", "forward");
    c.Append(CollectiveOp::kAllGather, 8, "Float", 0, i == 2 ? "blocks.2" : "blocks.1",
             "forward");
  }
  EXPECT_EQ(a.count(), 10);
  EXPECT_EQ(a.hash(), b.hash());
  // A difference long out of the ring still changes the hash.
  EXPECT_NE(a.hash(), c.hash());
  const std::vector<CollectiveRecord> recent = a.Recent();
  ASSERT_EQ(recent.size(), 4u);
  EXPECT_EQ(recent.front().seq, 6);
  EXPECT_EQ(recent.back().seq, 9);
  EXPECT_EQ(DescribeRecord(recent.back()),
            "#9 all-gather of 8 Float (unit 'blocks.1', forward)");
}

TEST(FingerprintReport, RoundTripsAndRejectsDamagedText) {
  FingerprintLog log;
  log.Append(CollectiveOp::kReduceScatter, 64, "BFloat16", 1, "h.0\twith tab", "backward");
  log.Append(CollectiveOp::kBarrier, 0, "", 0, "", "");
  const FingerprintReport report = ReportOf(3, log, "timed out\nafter 5 s");
  absl::StatusOr<FingerprintReport> parsed = ParseReport(SerializeReport(report));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->rank, 3);
  EXPECT_EQ(parsed->count, 2);
  EXPECT_EQ(parsed->hash, log.hash());
  EXPECT_EQ(parsed->status, "timed out after 5 s");
  ASSERT_EQ(parsed->recent.size(), 2u);
  EXPECT_TRUE(parsed->recent[0].SameCollective(report.recent[0]));
  EXPECT_EQ(parsed->recent[0].unit, "h.0 with tab");

  const std::string text = SerializeReport(report);
  EXPECT_THAT(ParseReport("hello").status().message(), HasSubstr("bad header"));
  EXPECT_THAT(ParseReport(text.substr(0, text.find("count"))).status().message(),
              HasSubstr("missing"));
  std::string bad_record = text;
  bad_record.replace(bad_record.find("record\t0\t1"), 10, "record\tx\t1");
  EXPECT_THAT(ParseReport(bad_record).status().message(), HasSubstr("malformed line"));
  std::string bad_count = text;
  bad_count.replace(bad_count.find("count\t2"), 7, "count\t5");
  EXPECT_THAT(ParseReport(bad_count).status().message(), HasSubstr("do not end at its count"));
}

TEST(DescribeDivergence, NamesTheFirstDifferingCollectiveAndWhoIssuedWhat) {
  FingerprintLog r0, r1, r2;
  for (FingerprintLog* log : {&r0, &r1, &r2}) {
    log->Append(CollectiveOp::kAllGather, 8, "Float", 0, "blocks.0", "forward");
  }
  // Rank 1 skipped blocks.1.
  r0.Append(CollectiveOp::kAllGather, 8, "Float", 0, "blocks.1", "forward");
  r2.Append(CollectiveOp::kAllGather, 8, "Float", 0, "blocks.1", "forward");
  r0.Append(CollectiveOp::kAllGather, 8, "Float", 0, "blocks.2", "forward");
  r1.Append(CollectiveOp::kAllGather, 8, "Float", 0, "blocks.2", "forward");
  std::vector<std::optional<FingerprintReport>> reports = {
      ReportOf(0, r0, "timed out"), ReportOf(1, r1, "stopped: boom"), std::nullopt};
  EXPECT_FALSE(HistoriesAgree(reports));
  const std::string text = DescribeDivergence(reports, std::chrono::milliseconds(1500));
  EXPECT_THAT(text, HasSubstr("first divergence at collective #1:\n"
                              "    rank 0 issued #1 all-gather of 8 Float (unit 'blocks.1', "
                              "forward)\n"
                              "    rank 1 issued #1 all-gather of 8 Float (unit 'blocks.2', "
                              "forward)"));
  EXPECT_THAT(text, HasSubstr("rank 0: 3 collectives issued, last #2 all-gather of 8 Float "
                              "(unit 'blocks.2', forward); timed out"));
  EXPECT_THAT(text, HasSubstr("rank 1: 2 collectives issued"));
  EXPECT_THAT(text, HasSubstr("stopped: boom"));
  EXPECT_THAT(text, HasSubstr("rank 2 sent no report within 1500 ms"));

  reports[2] = ReportOf(2, r2, "timed out");
  EXPECT_THAT(DescribeDivergence(reports, std::chrono::milliseconds(1)),
              HasSubstr("ranks 0, 2 issued #1 all-gather of 8 Float (unit 'blocks.1'"));
}

TEST(DescribeDivergence, SaysWhenOnlyCountsDifferOrTheDifferenceIsOlderThanTheRing) {
  FingerprintLog a(2), b(2);
  for (int i = 0; i < 3; ++i) {
    a.Append(CollectiveOp::kAllReduce, 4, "Float", 0, "", "clip_grad_norm");
    b.Append(CollectiveOp::kAllReduce, 4, "Float", 0, "", "clip_grad_norm");
  }
  a.Append(CollectiveOp::kAllReduce, 4, "Float", 0, "", "clip_grad_norm");
  EXPECT_THAT(DescribeDivergence({ReportOf(0, a, "x"), ReportOf(1, b, "y")},
                                 std::chrono::milliseconds(1)),
              HasSubstr("no recorded collective differs, but the ranks issued different "
                        "numbers of collectives"));

  FingerprintLog c(2), d(2);
  c.Append(CollectiveOp::kBroadcast, 4, "Float", 0, "", "sync");
  d.Append(CollectiveOp::kBroadcast, 4, "Float", 1, "", "sync");  // Another root.
  for (int i = 0; i < 3; ++i) {
    c.Append(CollectiveOp::kBarrier, 0, "", 0, "", "");
    d.Append(CollectiveOp::kBarrier, 0, "", 0, "", "");
  }
  const std::string text = DescribeDivergence({ReportOf(0, c, "x"), ReportOf(1, d, "y")},
                                              std::chrono::milliseconds(1));
  EXPECT_THAT(text, HasSubstr("the histories differ before collective #2, older than the "
                              "records kept"));
}

MultiRankOptions ShortTimeouts() {
  MultiRankOptions options;
  options.timeout = std::chrono::seconds(60);
  options.collective_timeout = std::chrono::seconds(3);
  options.gloo.fingerprints.report_timeout = std::chrono::seconds(5);
  return options;
}

// Runs `body` on 3 thread ranks and returns each rank's error ("" if none).
std::vector<std::string> ErrorsOnThreeRanks(const std::function<void(Collectives&)>& body) {
  return ::fsdp::testing::RankErrors(3, body, ShortTimeouts());
}

// Equal sizes, different units: the data would move without an error.
void RelabeledSecondCollective(Collectives& comm) {
  at::Tensor out = at::empty({6}, at::kFloat);
  {
    CollectiveLabel label(comm, "a", "forward");
    comm.AllGatherIntoTensor(out, at::ones({2}))->Wait();
  }
  CollectiveLabel label(comm, comm.rank() == 1 ? "c" : "b", "forward");
  comm.AllGatherIntoTensor(out, at::ones({2}))->Wait();
  comm.VerifyConsistency();
}

constexpr char kRelabeledDivergence[] =
    "first divergence at collective #1:\n    ranks 0, 2 issued #1 all-gather of 6 Float (unit "
    "'b', forward)\n    rank 1 issued #1 all-gather of 6 Float (unit 'c', forward)";

TEST(GlooFingerprints, HeadersStopADifferentCollectiveBeforeItMovesData) {
  const std::vector<std::string> errors = ErrorsOnThreeRanks(RelabeledSecondCollective);
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(r);
    EXPECT_THAT(errors[r], AllOf(HasSubstr("the ranks issued different collectives here "
                                           "(nothing was sent)"),
                                 HasSubstr(kRelabeledDivergence)));
  }
}

TEST(GlooFingerprints, WithoutHeadersThePeriodicCheckFindsTheDivergence) {
  ASSERT_TRUE(RunOnThreadRanks(3, [](Collectives& comm) {
                at::Tensor out = at::empty({6}, at::kFloat);
                CollectiveLabel label(comm, "a", "forward");
                for (int i = 0; i < 3; ++i) {
                  comm.AllGatherIntoTensor(out, at::ones({2}))->Wait();
                  comm.VerifyConsistency();
                }
              }).ok());
  MultiRankOptions options = ShortTimeouts();
  options.gloo.check_collective_headers = false;
  const std::vector<std::string> errors =
      ::fsdp::testing::RankErrors(3, RelabeledSecondCollective, options);
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(r);
    EXPECT_THAT(errors[r], AllOf(HasSubstr("collective fingerprint check 0 failed"),
                                 HasSubstr(kRelabeledDivergence)));
  }
}

TEST(GlooFingerprints, MisuseOfTheExchangeIsRefused) {
  ASSERT_TRUE(RunOnThreadRanks(1, [](Collectives& comm) {
                FingerprintOptions bad;
                bad.capacity = 0;
                try {
                  comm.AttachFingerprintExchange(nullptr, bad);
                  ADD_FAILURE() << "capacity 0 accepted";
                } catch (const c10::Error& e) {
                  EXPECT_THAT(e.msg(), HasSubstr("capacity and report_timeout must be positive"));
                }
                comm.Barrier();
                try {
                  comm.AttachFingerprintExchange(nullptr, FingerprintOptions());
                  ADD_FAILURE() << "attached after a collective";
                } catch (const c10::Error& e) {
                  EXPECT_THAT(e.msg(), HasSubstr("attach the fingerprint exchange before the "
                                                 "first collective"));
                }
              }).ok());
}

TEST(GlooFingerprints, VerifyingEachCollectiveStopsTheFirstDifferentOne) {
  MultiRankOptions options = ShortTimeouts();
  options.gloo.check_collective_headers = false;
  options.gloo.fingerprints.verify_each_collective = true;
  const std::vector<std::string> errors =
      ::fsdp::testing::RankErrors(3, RelabeledSecondCollective, options);
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(r);
    // Check 0 ran before #0 and passed; check 1, before #1 moved any data,
    // failed.
    EXPECT_THAT(errors[r], AllOf(HasSubstr("collective fingerprint check 1 failed"),
                                 HasSubstr(kRelabeledDivergence)));
  }
}

TEST(GlooFingerprints, ASkippedCollectiveFailsEveryRankWithTheDivergence) {
  const int threads_before = ::fsdp::testing::ThreadCount();
  std::vector<std::string> fired;
  const std::vector<std::string> errors = ErrorsOnThreeRanks([&](Collectives& comm) {
    FaultInjectingCollectives faulty(comm);
    if (comm.rank() == 1) faulty.Inject({.kind = FaultKind::kSkip, .unit = "blocks.1"});
    at::Tensor out = at::empty({6}, at::kFloat);
    try {
      for (const char* unit : {"blocks.0", "blocks.1", "blocks.2", "blocks.3"}) {
        CollectiveLabel label(faulty, unit, "forward");
        faulty.AllGatherIntoTensor(out, at::ones({2}))->Wait();
      }
      faulty.Barrier();
    } catch (...) {
      if (comm.rank() == 1) fired = faulty.fired();
      throw;
    }
  });
  std::printf("rank 0's error:\n%s\n", errors[0].c_str());
  EXPECT_THAT(fired, ::testing::ElementsAre("skip #1 all-gather of 6 Float (unit 'blocks.1', "
                                            "forward)"));
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(errors[r]);
    EXPECT_THAT(errors[r], AllOf(HasSubstr("what every rank of the group reported:"),
                                 HasSubstr("first divergence at collective #1:"),
                                 HasSubstr("ranks 0, 2 issued #1 all-gather of 6 Float (unit "
                                           "'blocks.1', forward)"),
                                 HasSubstr("rank 1 issued #1 all-gather of 6 Float (unit "
                                           "'blocks.2', forward)")));
  }
  // Every Gloo thread of the three groups is gone.
  EXPECT_EQ(::fsdp::testing::ThreadCount(), threads_before);
}

TEST(GlooFingerprints, ARankThatStopsIsQuotedByTheOthers) {
  const std::vector<std::string> errors = ErrorsOnThreeRanks([](Collectives& comm) {
    CollectiveLabel label(comm, "blocks.0", "forward");
    at::Tensor out = at::empty({6}, at::kFloat);
    comm.AllGatherIntoTensor(out, at::ones({2}))->Wait();
    TORCH_CHECK(comm.rank() != 2, "rank 2 raised in its forward");
    comm.AllGatherIntoTensor(out, at::ones({2}))->Wait();
  });
  EXPECT_THAT(errors[2], HasSubstr("rank 2 raised in its forward"));
  for (int r : {0, 1}) {
    SCOPED_TRACE(errors[r]);
    EXPECT_THAT(errors[r], AllOf(HasSubstr("failed in #1 all-gather of 6 Float (unit "
                                           "'blocks.0', forward)"),
                                 HasSubstr("rank 2: 1 collectives issued"),
                                 HasSubstr("stopped: rank 2 raised in its forward")));
  }
}

}  // namespace
}  // namespace fsdp
