#include "comm/block_quantization.h"

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

// Runs of the given lengths laid end to end over the values, codes at the
// same offsets, parameters after all codes.
BlockTable EndToEnd(const std::vector<int64_t>& lengths, int64_t* total) {
  std::vector<QuantizationRun> runs;
  int64_t at = 0;
  for (int64_t length : lengths) at += length;
  int64_t param = (at + 7) / 8 * 8;
  at = 0;
  for (int64_t length : lengths) {
    runs.push_back({at, at, param, length});
    param += runs.back().blocks() * kBlockParamBytes;
    at += length;
  }
  *total = at;
  return BlockTable(runs);
}

at::Tensor BytesFor(const BlockTable& table) { return at::zeros({table.byte_end()}, at::kByte); }

// Each value is off by at most half a step of its block, (hi - lo) / 510.
TEST(BlockQuantization, ErrorIsAtMostHalfAStepOfItsBlock) {
  at::manual_seed(3);
  const std::vector<int64_t> lengths = {256, 1, 7, 256, 100};
  int64_t n = 0;
  const BlockTable table = EndToEnd(lengths, &n);
  // Blocks of very different scales and offsets side by side.
  at::Tensor values = at::randn({n}, at::kDouble);
  values.narrow(0, 0, 256).mul_(0.02);
  values.narrow(0, 264, 256).mul_(0.01).add_(1.0);  // A LayerNorm gain.
  values.narrow(0, 520, 100).mul_(1000.0);
  for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const at::Tensor x = values.to(dtype);
    at::Tensor bytes = BytesFor(table);
    QuantizeBlocks(x, bytes, table);
    at::Tensor decoded = at::empty_like(x);
    DequantizeBlocks(bytes, table, decoded);
    int64_t at = 0;
    for (int64_t length : lengths) {
      const at::Tensor block = x.narrow(0, at, length).to(at::kDouble);
      const double step = (block.max() - block.min()).item<double>() / 255.0;
      const double error =
          (decoded.narrow(0, at, length).to(at::kDouble) - block).abs().max().item<double>();
      EXPECT_LE(error, step / 2 * (1 + 1e-5) + 1e-7 * block.abs().max().item<double>())
          << c10::toString(dtype) << " block at " << at << " of length " << length;
      at += length;
    }
    // The gain's resolution is its spread's, not its magnitude's.
    EXPECT_LT((decoded.narrow(0, 264, 256) - x.narrow(0, 264, 256)).abs().max().item<double>(),
              2e-4);
  }
}

TEST(BlockQuantization, HalfPrecisionValuesRoundTripWithinTheirOwnRounding) {
  at::manual_seed(4);
  int64_t n = 0;
  const BlockTable table = EndToEnd({256, 256, 3}, &n);
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    const at::Tensor x = at::randn({n}).to(dtype);
    at::Tensor bytes = BytesFor(table);
    QuantizeBlocks(x, bytes, table);
    at::Tensor decoded = at::empty({n}, at::kFloat);
    DequantizeBlocks(bytes, table, decoded);  // Decoded into another dtype.
    const at::Tensor xf = x.to(at::kFloat);
    const double step = (xf.max() - xf.min()).item<double>() / 255.0;
    EXPECT_LE((decoded - xf).abs().max().item<double>(), step / 2 * 1.001) << c10::toString(dtype);
  }
}

TEST(BlockQuantization, EqualValuesDecodeExactly) {
  int64_t n = 0;
  const BlockTable table = EndToEnd({256, 5, 256}, &n);
  at::Tensor x = at::zeros({n});
  x.narrow(0, 256, 5).fill_(1.0f);
  x.narrow(0, 261, 256).fill_(-0.3125f);
  at::Tensor bytes = BytesFor(table);
  QuantizeBlocks(x, bytes, table);
  at::Tensor decoded = at::full({n}, 7.0f);
  DequantizeBlocks(bytes, table, decoded);
  EXPECT_TRUE(at::equal(decoded, x));
}

// A diverged value is not hidden: its block decodes to NaN, the others are
// untouched.
TEST(BlockQuantization, ANonFiniteValueMakesItsBlockNaN) {
  int64_t n = 0;
  const BlockTable table = EndToEnd({4, 4, 4}, &n);
  at::Tensor x = at::arange(n, at::kFloat);
  x[1] = std::numeric_limits<float>::infinity();
  x[9] = std::nanf("");
  at::Tensor bytes = BytesFor(table);
  QuantizeBlocks(x, bytes, table);
  at::Tensor decoded = at::empty({n});
  DequantizeBlocks(bytes, table, decoded);
  EXPECT_TRUE(decoded.narrow(0, 0, 4).isnan().all().item<bool>());
  EXPECT_TRUE(at::allclose(decoded.narrow(0, 4, 4), x.narrow(0, 4, 4), 0, 4.0 / 510 * 1.001));
  EXPECT_TRUE(decoded.narrow(0, 8, 4).isnan().all().item<bool>());
  // Finite values whose range overflows float32: NaN too, not a silent inf.
  const at::Tensor wide = at::tensor({-3e38f, 3e38f, 1.0f, 2.0f});
  const BlockTable one = EndToEnd({4}, &n);
  at::Tensor wide_bytes = BytesFor(one);
  QuantizeBlocks(wide, wide_bytes, one);
  at::Tensor wide_decoded = at::empty({4});
  DequantizeBlocks(wide_bytes, one, wide_decoded);
  EXPECT_TRUE(wide_decoded.isnan().all().item<bool>()) << wide_decoded;
}

// A run longer than a block is cut into blocks of 256 from its start, each
// with its own parameters: the same bytes as those blocks given one by one.
TEST(BlockQuantization, ALongRunIsItsBlocksInOrder) {
  const at::Tensor x = at::sin(at::arange(700, at::kFloat) * 0.1) * at::arange(700, at::kFloat);
  int64_t n = 0;
  const BlockTable one_run = EndToEnd({700}, &n);
  const BlockTable three_runs = EndToEnd({256, 256, 188}, &n);
  EXPECT_EQ(one_run.blocks(), 3);
  EXPECT_EQ(one_run.byte_end(), three_runs.byte_end());
  at::Tensor a = BytesFor(one_run), b = BytesFor(three_runs);
  QuantizeBlocks(x, a, one_run);
  QuantizeBlocks(x, b, three_runs);
  EXPECT_TRUE(at::equal(a, b));
  at::Tensor decoded = at::empty({n});
  DequantizeBlocks(a, one_run, decoded);
  // Each block's error is its own spread's (block 2 spans about 188 * 1.0).
  EXPECT_LE((decoded.narrow(0, 0, 256) - x.narrow(0, 0, 256)).abs().max().item<float>(),
            (x.narrow(0, 0, 256).max() - x.narrow(0, 0, 256).min()).item<float>() / 510 * 1.001);
}

TEST(BlockQuantization, RefusesRunsAndTensorsThatDoNotFitNamingThem) {
  auto refused = [](const std::function<void()>& f, const std::string& expected) {
    try {
      f();
      ADD_FAILURE() << "accepted; expected: " << expected;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  refused([] { BlockTable({{0, 0, 384, 0}}); }, "run 0 {value 0, code 0, param 384, length 0}");
  refused(
      [] {
        BlockTable({{0, 0, 384, 8}, {8, 8, 390, 8}});
      },
      "run 1 {value 8, code 8, param 390");
  refused([] { BlockTable({{-1, 0, 384, 8}}); }, "run 0 {value -1");
  const BlockTable table({{0, 0, 392, 300}});  // Two blocks: parameters 392..408.
  EXPECT_EQ(table.byte_end(), 408);
  refused([&] { QuantizeBlocks(at::zeros({299}), at::zeros({408}, at::kByte), table); },
          "the table's runs reach value 300 and byte 408 but there are 299 values and 408 bytes");
  refused([&] { QuantizeBlocks(at::zeros({300}), at::zeros({407}, at::kByte), table); },
          "but there are 300 values and 407 bytes");
  refused([&] { QuantizeBlocks(at::zeros({300}, at::kInt), at::zeros({408}, at::kByte), table); },
          "values have dtype Int");
  refused([&] { DequantizeBlocks(at::zeros({408}), table, at::zeros({300})); },
          "bytes must be a 1-D contiguous uint8 tensor, got Float");
  refused(
      [&] {
        QuantizeBlocks(at::zeros({300}), at::zeros({412}, at::kByte).narrow(0, 1, 408), table);
      },
      "bytes must start at a 4-byte boundary");
  EXPECT_TRUE(CanQuantizeOn(at::kCPU));
}

}  // namespace
}  // namespace fsdp
