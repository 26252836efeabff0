#include "fsdp/quantized_gather.h"

#include <algorithm>
#include <array>
#include <set>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "ATen/core/grad_mode.h"
#include "c10/util/Exception.h"
#include "comm/block_quantization.h"
#include "fsdp/gradient_reduction.h"

namespace fsdp {
namespace {

int64_t RoundUp8(int64_t n) { return (n + 7) / 8 * 8; }

// Rank `rank`'s pieces, in shard order: {offset in the flat parameter,
// offset in the shard, length}, cut at every parameter boundary and at the
// segment's unpadded end, so that each holds one parameter's values (or
// padding).
std::vector<std::array<int64_t, 3>> PiecesOf(const FlatLayout& layout, int rank) {
  std::vector<std::array<int64_t, 3>> pieces;
  for (size_t s = 0; s < layout.segments().size(); ++s) {
    const FlatLayout::Segment& seg = layout.segments()[s];
    std::set<int64_t> cuts;  // In the flat parameter.
    for (size_t i = 0; i < layout.params().size(); ++i) {
      if (&layout.SegmentOf(i) != &seg) continue;
      const FlatParamInfo& p = layout.params()[i];
      cuts.insert(p.offset);
      cuts.insert(p.offset + p.numel);
    }
    const int64_t begin = layout.OwnedBegin(seg, rank);
    const int64_t end = begin + seg.shard_numel;
    cuts.insert(end);
    int64_t at = begin;
    for (int64_t cut : cuts) {
      if (cut <= at) continue;
      const int64_t piece_end = std::min(cut, end);
      pieces.push_back({at, seg.shard_begin + (at - begin), piece_end - at});
      at = piece_end;
      if (at == end) break;
    }
  }
  return pieces;
}

}  // namespace

QuantizedGather::QuantizedGather(const FlatLayout& layout, int world_size,
                                 CommQuantization quantization, c10::Device device)
    : layout_(layout), world_size_(world_size), quantization_(quantization) {
  TORCH_CHECK(layout.sharded() && quantization != CommQuantization::kNone,
              "QuantizedGather needs a sharded layout and a quantization");
  const int64_t shard = layout.shard_numel();
  if (quantization == CommQuantization::kBf16) {
    message_bytes_ = shard * 2;
    return;
  }
  std::vector<std::vector<std::array<int64_t, 3>>> per_rank;
  int64_t most = 0;  // Blocks of the rank with the most.
  for (int r = 0; r < world_size; ++r) {
    per_rank.push_back(PiecesOf(layout, r));
    int64_t blocks = 0;
    for (const auto& piece : per_rank.back()) {
      blocks += QuantizationRun{0, 0, 0, piece[2]}.blocks();
    }
    most = std::max(most, blocks);
  }
  const int64_t params_begin = RoundUp8(shard);
  message_bytes_ = params_begin + most * kBlockParamBytes;
  std::vector<QuantizationRun> own, all;
  for (int r = 0; r < world_size; ++r) {
    const int64_t base = r * message_bytes_;
    int64_t param = params_begin;
    for (const auto& [flat, in_shard, length] : per_rank[r]) {
      const QuantizationRun run{in_shard, in_shard, param, length};
      all.push_back({flat, base + in_shard, base + param, length});
      if (r == layout.rank()) own.push_back(run);
      param += run.blocks() * kBlockParamBytes;
    }
  }
  own_table_ = BlockTable(own).To(device);
  gather_table_ = BlockTable(all).To(device);
}

std::unique_ptr<CollectiveWork> QuantizedGather::Start(const at::Tensor& shard,
                                                       Collectives& group) {
  TORCH_CHECK(!pending(), "QuantizedGather::Start with an all-gather pending");
  at::NoGradGuard no_grad;
  try {
    if (quantization_ == CommQuantization::kBf16) {
      message_ = shard.to(at::kBFloat16);
    } else {
      // Zeroed: the bytes between the codes and the parameters, and the
      // parameter slots a rank with fewer blocks leaves, are sent too.
      message_ = at::zeros({message_bytes_}, shard.options().dtype(at::kByte));
      QuantizeBlocks(shard, message_, own_table_);
    }
    gathered_ = at::empty({world_size_ * message_.numel()}, message_.options());
    return group.AllGatherIntoTensor(gathered_, message_);
  } catch (...) {
    Discard();
    throw;
  }
}

void QuantizedGather::Finish(const at::Tensor& full) {
  TORCH_CHECK(pending(), "QuantizedGather::Finish without a pending all-gather");
  at::NoGradGuard no_grad;
  if (quantization_ == CommQuantization::kInt8) {
    DequantizeBlocks(gathered_, gather_table_, full);
  } else if (layout_.segments().size() == 1) {
    full.copy_(gathered_);  // W shards end to end: the flat parameter's layout.
  } else {
    const at::Tensor messages = gathered_.view({world_size_, layout_.shard_numel()});
    for (const FlatLayout::Segment& seg : layout_.segments()) {
      for (int r = 0; r < world_size_; ++r) {
        full.narrow(0, layout_.OwnedBegin(seg, r), seg.shard_numel)
            .copy_(messages[r].narrow(0, seg.shard_begin, seg.shard_numel));
      }
    }
  }
  Discard();
}

void QuantizedGather::Discard() {
  // Written by the all-gather's stream, read here on the current one.
  RecordUseOnCurrentStream(gathered_);
  RecordUseOnCurrentStream(message_);
  gathered_ = at::Tensor();
  message_ = at::Tensor();
}

at::Tensor QuantizedGather::RoundTrip(const at::Tensor& shard, at::ScalarType dtype) const {
  at::NoGradGuard no_grad;
  if (quantization_ == CommQuantization::kBf16) return shard.to(at::kBFloat16).to(dtype);
  at::Tensor message = at::zeros({message_bytes_}, shard.options().dtype(at::kByte));
  QuantizeBlocks(shard, message, own_table_);
  at::Tensor decoded = at::empty({shard.numel()}, shard.options().dtype(dtype));
  DequantizeBlocks(message, own_table_, decoded);
  return decoded;
}

}  // namespace fsdp
