#include "fsdp/quantized_gather.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "comm/block_quantization.h"
#include "fsdp/comm_hooks.h"
#include "fsdp/fsdp_options.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"

namespace fsdp {
namespace {

using ::fsdp::testing::RunOnThreadRanks;

// A weight near 0.02, a LayerNorm gain near 1.0, a bias, and a frozen
// weight of another scale: every block boundary case (parameters that
// straddle ranks, ones smaller than a block, padding, two segments).
struct Unit {
  std::vector<FlatLayout::Param> specs = {
      {"w", {30, 21}, true}, {"gain", {64}, true}, {"b", {5}, true}, {"frozen", {300}, false}};
  std::vector<at::Tensor> values;

  // The same on every rank without a shared generator (thread ranks would
  // draw different values from one).
  static at::Tensor Wavy(int64_t n, double phase) {
    return at::sin(at::arange(n, at::kFloat) * 0.731 + phase);
  }

  Unit() {
    values = {Wavy(630, 0.1).view({30, 21}) * 0.02, 1.0 + 0.01 * Wavy(64, 0.2), Wavy(5, 0.3),
              Wavy(300, 0.4) * 5.0};
  }

  // `layout`'s flat parameter, padding zero.
  at::Tensor Full(const FlatLayout& layout) const {
    at::Tensor full = at::zeros({layout.padded_numel()});
    for (size_t i = 0; i < values.size(); ++i) {
      layout.FullViewOf(full, i).copy_(values[i]);
    }
    return full;
  }

  // This rank's shard of it.
  at::Tensor Shard(const FlatLayout& layout) const {
    const at::Tensor full = Full(layout);
    std::vector<at::Tensor> parts;
    for (const FlatLayout::Segment& seg : layout.segments()) {
      parts.push_back(full.narrow(0, layout.OwnedBegin(seg, layout.rank()), seg.shard_numel));
    }
    return at::cat(parts);
  }
};

// Expects each trainable parameter's part of `out` (the flat parameter's
// values from `begin` on, a sum of `times` x the unit's values coded
// along the way) within `half_steps` of its coding's half steps of the
// exact sum, and the padding's zeros exact. int8: a block of a parameter
// spans at most its range (a half step: range / 510); bf16 (8 significant
// bits): each value is off by at most 2^-8 of the largest.
void ExpectNearTheExactSum(const Unit& unit, const FlatLayout& layout, const at::Tensor& out,
                           int64_t begin, double times, double half_steps, CommQuantization q,
                           const std::string& config) {
  const at::Tensor exact_sum = unit.Full(layout).narrow(0, begin, out.numel()) * times;
  for (size_t i = 0; i < 3; ++i) {
    const FlatParamInfo& p = layout.params()[i];
    const int64_t from = std::max(p.offset, begin);
    const int64_t to = std::min(p.offset + p.numel, begin + out.numel());
    if (from >= to) continue;
    const at::Tensor v = unit.values[i];
    const double bound = (q == CommQuantization::kInt8 ? (v.max() - v.min()).item<double>() / 510.0
                                                       : v.abs().max().item<double>() / 256.0) *
                         times * half_steps * 1.001;
    EXPECT_LE(
        (out.narrow(0, from - begin, to - from) - exact_sum.narrow(0, from - begin, to - from))
            .abs()
            .max()
            .item<double>(),
        bound)
        << unit.specs[i].fqn << ", " << config;
  }
  const int64_t values_end = layout.params()[2].offset + layout.params()[2].numel;
  if (begin + out.numel() > values_end) {
    const int64_t pad_from = std::max(values_end, begin) - begin;
    EXPECT_TRUE(at::equal(out.narrow(0, pad_from, out.numel() - pad_from),
                          at::zeros({out.numel() - pad_from})))
        << config;
  }
}

// Every rank decodes the same full parameter; each value is within half a
// step of a block that holds only its own parameter's values, so within
// half a step of that parameter's range; the padding is exactly zero; this
// rank's part is what RoundTrip says.
TEST(QuantizedGather, Int8DecodesEveryShardAlikeWithinEachParametersResolution) {
  for (int world : {1, 2, 3}) {
    absl::Status status = RunOnThreadRanks(world, [](Collectives& group) {
      Unit unit;
      const FlatLayout layout =
          FlatLayout::Of(unit.specs, /*sharded=*/true, group.world_size(), group.rank());
      QuantizedGather gather(layout, group.world_size(), CommQuantization::kInt8, at::kCPU);
      const at::Tensor shard = unit.Shard(layout);
      auto work = gather.Start(shard, group);
      EXPECT_TRUE(gather.pending());
      work->Wait();
      at::Tensor full = at::full({layout.padded_numel()}, 99.0f);
      gather.Finish(full);
      EXPECT_FALSE(gather.pending());

      const at::Tensor exact = unit.Full(layout);
      for (size_t i = 0; i < unit.values.size(); ++i) {
        const at::Tensor v = unit.values[i];
        const double half_step = (v.max() - v.min()).item<double>() / 510.0 * 1.0001;
        EXPECT_LE((layout.FullViewOf(full, i) - v).abs().max().item<double>(), half_step)
            << unit.specs[i].fqn << " at W = " << group.world_size();
      }
      at::Tensor padding_mask = at::ones({layout.padded_numel()}, at::kBool);
      for (size_t i = 0; i < unit.values.size(); ++i) {
        padding_mask.narrow(0, layout.params()[i].offset, layout.params()[i].numel).fill_(false);
      }
      EXPECT_TRUE(at::equal(full.masked_select(padding_mask),
                            at::zeros({padding_mask.sum().item<int64_t>()})));
      // Rank r's decoded part is its own RoundTrip.
      const at::Tensor own = gather.RoundTrip(shard, at::kFloat);
      for (const FlatLayout::Segment& seg : layout.segments()) {
        EXPECT_TRUE(at::equal(full.narrow(0, layout.OwnedBegin(seg, group.rank()), seg.shard_numel),
                              own.narrow(0, seg.shard_begin, seg.shard_numel)));
      }
      // And every rank holds the same bytes.
      at::Tensor everyone = at::empty({group.world_size() * full.numel()});
      group.AllGatherIntoTensor(everyone, full)->Wait();
      for (int r = 1; r < group.world_size(); ++r) {
        EXPECT_TRUE(at::equal(everyone.narrow(0, r * full.numel(), full.numel()), full));
      }
    });
    EXPECT_TRUE(status.ok()) << status;
  }
}

// The reduction's counterpart over the same unit (the trainable segment:
// a weight of 630 values, more than two blocks, a gain, a bias, padding;
// the frozen segment is not reduced), with every rank's gradient a
// different multiple of the values, at W = 1..4: this rank's chunk is the
// rank-order float32 sum of every rank's part coded as this rank's shard
// would be (RoundTrip), within the sum of their half steps of each
// parameter's exact sum, and exactly zero over the padding; the all-to-all
// moves the bytes sent_bytes() says.
TEST(QuantizedReduceScatter, SumsEveryRanksDecodedChunkInFloat32) {
  for (int world : {1, 2, 3, 4}) {
    for (CommQuantization q : {CommQuantization::kInt8, CommQuantization::kBf16}) {
      absl::Status status = RunOnThreadRanks(world, [q](Collectives& group) {
        const int w = group.world_size();
        Unit unit;
        const FlatLayout layout = FlatLayout::Of(unit.specs, /*sharded=*/true, w, group.rank());
        const FlatLayout::Segment& trainable = layout.segments().front();
        // Rank r's gradient: the trainable values times r + 1.
        auto full_of = [&](int r) {
          Unit scaled = unit;
          for (size_t i = 0; i < 3; ++i) scaled.values[i] = unit.values[i] * (r + 1);
          return scaled;
        };
        const at::Tensor flat_grad =
            full_of(group.rank()).Full(layout).narrow(0, 0, trainable.padded_numel);
        const QuantizedReduceScatter reduce(layout, w, q, at::kCPU);
        at::Tensor out = at::full({trainable.shard_numel}, 99.0f);
        group.ResetCounters();
        reduce.Start(flat_grad, out, group)->Wait();
        EXPECT_EQ(group.counters().Bytes(CollectiveOp::kAllToAll), reduce.sent_bytes());

        const QuantizedGather codec(layout, w, q, at::kCPU);
        at::Tensor expected;
        for (int r = 0; r < w; ++r) {
          const at::Tensor decoded =
              codec.RoundTrip(full_of(r).Shard(layout), at::kFloat).narrow(0, 0, out.numel());
          expected = r == 0 ? decoded.clone() : expected.add_(decoded);
        }
        EXPECT_TRUE(at::equal(out, expected)) << "W = " << w;
        ExpectNearTheExactSum(unit, layout, out, layout.OwnedBegin(trainable, group.rank()),
                              w * (w + 1) / 2, /*half_steps=*/1, q, absl::StrCat("W = ", w));
      });
      EXPECT_TRUE(status.ok()) << status;
    }
  }
}

// The replicate group's sum under hybrid sharding, at R = 1..4 replicas
// of shard-group rank 1 of 2 (the chunk that holds the gain, the bias and
// the padding), replica r's chunk the unit's times r + 1: every replica
// ends with the same chunk bit for bit, within two codings' half steps of
// each parameter's exact sum, and the padding's zeros exact; each stage
// moves R messages, with Advance() called before Wait() or not.
TEST(QuantizedAllReduce, EveryReplicaHoldsTheSameSumWithinTwoCodings) {
  for (int replicas : {1, 2, 3, 4}) {
    for (CommQuantization q : {CommQuantization::kInt8, CommQuantization::kBf16}) {
      for (bool advance : {false, true}) {
        std::vector<at::Tensor> results(replicas);
        absl::Status status = RunOnThreadRanks(replicas, [&](Collectives& replicate) {
          const int r = replicate.rank();
          Unit unit;
          const FlatLayout layout = FlatLayout::Of(unit.specs, /*sharded=*/true, 2, 1);
          const FlatLayout::Segment& trainable = layout.segments().front();
          const int64_t begin = layout.OwnedBegin(trainable, 1);
          at::Tensor chunk = unit.Full(layout).narrow(0, begin, trainable.shard_numel) * (r + 1);
          const QuantizedAllReduce sum(layout, replicas, r, q, at::kCPU);
          replicate.ResetCounters();
          std::unique_ptr<PendingReduction> work = sum.Start(chunk, replicate);
          if (advance) work->Advance();
          work->Wait();
          EXPECT_EQ(replicate.counters().Bytes(CollectiveOp::kAllToAll),
                    replicas * sum.message_bytes());
          EXPECT_EQ(replicate.counters().Bytes(CollectiveOp::kAllGather),
                    replicas * sum.message_bytes());
          results[r] = chunk;
        });
        ASSERT_TRUE(status.ok()) << status;
        const std::string config = absl::StrCat("R = ", replicas, ", ", CommQuantizationName(q),
                                                advance ? ", advanced" : "");
        for (int r = 1; r < replicas; ++r) {
          EXPECT_TRUE(at::equal(results[r], results[0])) << config << ", replica " << r;
        }
        Unit unit;
        const FlatLayout layout = FlatLayout::Of(unit.specs, /*sharded=*/true, 2, 1);
        const int64_t begin = layout.OwnedBegin(layout.segments().front(), 1);
        const int64_t values_end = layout.params()[2].offset + layout.params()[2].numel;
        ASSERT_GT(begin + results[0].numel(), values_end);  // The chunk ends in padding.
        // Each contribution's half step, then the sum's: as many again.
        ExpectNearTheExactSum(unit, layout, results[0], begin, replicas * (replicas + 1) / 2.0,
                              /*half_steps=*/2, q, config);
      }
    }
  }
}

// A chunk of 3 values across 4 replicas: parts of 1 value, the last empty.
// The replica with nothing to sum still exchanges and gathers (every
// replica takes part in both collectives), and the sums are exact: a block
// of one value codes exactly in int8, and these values and their sums are
// bfloat16 numbers.
TEST(QuantizedAllReduce, AReplicaWithAnEmptyPartStillTakesPart) {
  for (CommQuantization q : {CommQuantization::kInt8, CommQuantization::kBf16}) {
    absl::Status status = RunOnThreadRanks(4, [q](Collectives& replicate) {
      const FlatLayout layout =
          FlatLayout::Of({{"t", {3}, true}}, /*sharded=*/true, /*world_size=*/1, /*rank=*/0);
      ASSERT_EQ(layout.segments().front().shard_numel, 3);
      const at::Tensor values = at::tensor({0.5f, -1.25f, 2.0f});
      at::Tensor chunk = values * (replicate.rank() + 1);
      const QuantizedAllReduce sum(layout, 4, replicate.rank(), q, at::kCPU);
      sum.Start(chunk, replicate)->Wait();
      EXPECT_TRUE(at::equal(chunk, values * 10)) << CommQuantizationName(q) << ": " << chunk;
    });
    EXPECT_TRUE(status.ok()) << status;
  }
}

// bf16: each value is its bfloat16 rounding, decoded into the compute
// dtype, over both segments.
TEST(QuantizedGather, Bf16IsTheShardsRoundedToBfloat16) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& group) {
    Unit unit;
    const FlatLayout layout = FlatLayout::Of(unit.specs, true, 2, group.rank());
    ASSERT_EQ(layout.segments().size(), 2u);
    QuantizedGather gather(layout, 2, CommQuantization::kBf16, at::kCPU);
    EXPECT_EQ(gather.message_bytes(), layout.shard_numel() * 2);
    gather.Start(unit.Shard(layout), group)->Wait();
    at::Tensor full = at::empty({layout.padded_numel()}, at::kDouble);
    gather.Finish(full);
    EXPECT_TRUE(at::equal(full, unit.Full(layout).to(at::kBFloat16).to(at::kDouble)));
  });
  EXPECT_TRUE(status.ok()) << status;
}

// What the group's own counters count: int8 at most 0.27x the float32
// all-gather's bytes and 0.53x bf16's, for a unit of transformer-sized
// parameters with LayerNorm gains and biases in it.
TEST(QuantizedGather, CountersSeeAQuarterOfTheFloat32Bytes) {
  absl::Status status = RunOnThreadRanks(2, [](Collectives& group) {
    const std::vector<FlatLayout::Param> specs = {
        {"ln.weight", {256}, true},       {"ln.bias", {256}, true},
        {"qkv.weight", {768, 256}, true}, {"qkv.bias", {768}, true},
        {"fc.weight", {1024, 256}, true}, {"fc.bias", {1024}, true}};
    const FlatLayout layout = FlatLayout::Of(specs, true, 2, group.rank());
    const at::Tensor shard = at::randn({layout.shard_numel()});
    int64_t bytes[3] = {0, 0, 0};
    const CommQuantization modes[3] = {CommQuantization::kNone, CommQuantization::kBf16,
                                       CommQuantization::kInt8};
    for (int m = 0; m < 3; ++m) {
      group.ResetCounters();
      at::Tensor full = at::empty({layout.padded_numel()});
      if (modes[m] == CommQuantization::kNone) {
        group.AllGatherIntoTensor(full, shard)->Wait();
      } else {
        QuantizedGather gather(layout, 2, modes[m], at::kCPU);
        gather.Start(shard, group)->Wait();
        gather.Finish(full);
      }
      bytes[m] = group.counters().Bytes(CollectiveOp::kAllGather);
    }
    EXPECT_EQ(bytes[1] * 2, bytes[0]);
    EXPECT_LE(bytes[2], 0.27 * bytes[0]) << bytes[2] << " of " << bytes[0];
    EXPECT_LE(bytes[2], 0.53 * bytes[1]);
    // The reduction sends as much as the all-gather gathers.
    const int64_t sent =
        QuantizedReduceScatter(layout, 2, CommQuantization::kInt8, at::kCPU).sent_bytes();
    EXPECT_LE(sent, 0.27 * bytes[0]) << sent << " of " << bytes[0];
  });
  EXPECT_TRUE(status.ok()) << status;
}

TEST(QuantizedGather, RefusedWhereItCannotApplyNamingTheUnit) {
  const MixedPrecision none;
  MixedPrecision bf16;
  bf16.param_dtype = at::kBFloat16;
  EXPECT_TRUE(CheckAllGatherQuantization("h.0", ShardingStrategy::kFullShard, bf16,
                                         CommQuantization::kInt8, at::kFloat, "w")
                  .ok());
  const struct {
    ShardingStrategy strategy;
    const MixedPrecision* mp;
    CommQuantization quantization;
    at::ScalarType dtype;
    std::string expected;
  } cases[] = {
      {ShardingStrategy::kNoShard, &none, CommQuantization::kInt8, at::kFloat,
       "unit 'h.0' has all_gather_quantization=int8 but its strategy is NO_SHARD"},
      {ShardingStrategy::kFullShard, &none, CommQuantization::kInt8, at::kLong,
       "its parameters ('w', ...) are Long, not float32, float64, float16 or bfloat16"},
      {ShardingStrategy::kShardGradOp, &bf16, CommQuantization::kBf16, at::kFloat,
       "it already all-gathers in BFloat16"},
      {ShardingStrategy::kFullShard, &none, CommQuantization::kBf16, at::kHalf,
       "it already all-gathers in Half"},
  };
  for (const auto& c : cases) {
    const absl::Status status =
        CheckAllGatherQuantization("h.0", c.strategy, *c.mp, c.quantization, c.dtype, "w");
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.expected;
    EXPECT_NE(std::string(status.message()).find(c.expected), std::string::npos) << status;
  }
}

}  // namespace
}  // namespace fsdp
