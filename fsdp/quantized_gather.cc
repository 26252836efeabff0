#include "fsdp/quantized_gather.h"

#include <algorithm>
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

int64_t BlocksOf(const std::vector<FlatLayout::Piece>& pieces) {
  int64_t blocks = 0;
  for (const FlatLayout::Piece& piece : pieces) {
    blocks += QuantizationRun{0, 0, 0, piece.numel}.blocks();
  }
  return blocks;
}

// The all-to-all of a QuantizedReduceScatter in flight; Wait() decodes the
// W messages one at a time and sums them into `out`.
class ReduceScatterWork final : public CollectiveWork {
 public:
  ReduceScatterWork(std::unique_ptr<CollectiveWork> exchange, at::Tensor message,
                    at::Tensor received, at::Tensor out, const BlockTable* table, int world_size)
      : message_(std::move(message)),
        received_(std::move(received)),
        out_(std::move(out)),
        table_(table),
        world_size_(world_size),
        exchange_(std::move(exchange)) {}

  void Wait() override {
    if (done_) return;
    exchange_->Wait();  // Throws its error again on every call.
    at::NoGradGuard no_grad;
    // Written by the all-to-all's stream, read here on the current one.
    RecordUseOnCurrentStream(received_);
    RecordUseOnCurrentStream(message_);
    const int64_t chunk = out_.numel();
    const int64_t message = received_.numel() / world_size_;
    at::Tensor sum, decoded;
    for (int r = 0; r < world_size_; ++r) {
      const at::Tensor theirs = received_.narrow(0, r * message, message);
      if (table_ == nullptr) {
        decoded = theirs.to(at::kFloat);
      } else {
        if (!decoded.defined()) decoded = at::empty({chunk}, out_.options().dtype(at::kFloat));
        DequantizeBlocks(theirs, *table_, decoded);  // `message` is a multiple of 8 bytes.
      }
      sum = r == 0 ? decoded.clone() : sum.add_(decoded);
    }
    out_.copy_(sum);
    done_ = true;
    exchange_.reset();
    message_ = received_ = out_ = at::Tensor();
  }

 private:
  // Declared before the exchange, so that an unwaited work waits for it
  // before it lets go of its buffers.
  at::Tensor message_;
  at::Tensor received_;
  at::Tensor out_;
  const BlockTable* table_;  // One sender's message; null for kBf16.
  const int world_size_;
  bool done_ = false;
  std::unique_ptr<CollectiveWork> exchange_;
};

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
  std::vector<std::vector<FlatLayout::Piece>> per_rank(world_size);
  int64_t most = 0;  // Blocks of the rank with the most.
  for (int r = 0; r < world_size; ++r) {
    for (size_t s = 0; s < layout.segments().size(); ++s) {
      for (const FlatLayout::Piece& piece : layout.PiecesOf(s, r)) per_rank[r].push_back(piece);
    }
    most = std::max(most, BlocksOf(per_rank[r]));
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

QuantizedReduceScatter::QuantizedReduceScatter(const FlatLayout& layout, int world_size,
                                               CommQuantization quantization, c10::Device device)
    : world_size_(world_size), quantization_(quantization) {
  TORCH_CHECK(
      layout.sharded() && layout.has_trainable_params() && quantization != CommQuantization::kNone,
      "QuantizedReduceScatter needs a sharded layout with trainable parameters and a "
      "quantization");
  const FlatLayout::Segment& trainable = layout.segments().front();
  chunk_numel_ = trainable.shard_numel;
  if (quantization == CommQuantization::kBf16) {
    message_bytes_ = chunk_numel_ * 2;
    return;
  }
  std::vector<std::vector<FlatLayout::Piece>> per_rank;
  int64_t most = 0;
  for (int r = 0; r < world_size; ++r) {
    per_rank.push_back(layout.PiecesOf(0, r));
    most = std::max(most, BlocksOf(per_rank.back()));
  }
  const int64_t params_begin = RoundUp8(chunk_numel_);
  message_bytes_ = params_begin + most * kBlockParamBytes;
  // The flat gradient is laid out like the trainable segment, which starts
  // the flat parameter: its offsets are the flat parameter's.
  std::vector<QuantizationRun> send, receive;
  for (int r = 0; r < world_size; ++r) {
    const int64_t chunk_begin = layout.OwnedBegin(trainable, r);
    int64_t param = params_begin;
    for (const FlatLayout::Piece& piece : per_rank[r]) {
      const int64_t in_chunk = piece.flat_offset - chunk_begin;
      send.push_back({piece.flat_offset, r * message_bytes_ + in_chunk, r * message_bytes_ + param,
                      piece.numel});
      param += QuantizationRun{0, 0, 0, piece.numel}.blocks() * kBlockParamBytes;
    }
  }
  // Every sender coded this rank's chunk with this rank's pieces: one table
  // decodes any sender's message.
  const int64_t own_begin = layout.OwnedBegin(trainable, layout.rank());
  int64_t param = params_begin;
  for (const FlatLayout::Piece& piece : per_rank[layout.rank()]) {
    const int64_t in_chunk = piece.flat_offset - own_begin;
    receive.push_back({in_chunk, in_chunk, param, piece.numel});
    param += QuantizationRun{0, 0, 0, piece.numel}.blocks() * kBlockParamBytes;
  }
  send_table_ = BlockTable(send).To(device);
  receive_table_ = BlockTable(receive).To(device);
}

std::unique_ptr<CollectiveWork> QuantizedReduceScatter::Start(const at::Tensor& flat_grad,
                                                              const at::Tensor& out,
                                                              Collectives& group) const {
  TORCH_CHECK(flat_grad.numel() == world_size_ * chunk_numel_ && out.numel() == chunk_numel_,
              "QuantizedReduceScatter::Start: expected a flat gradient of ",
              world_size_ * chunk_numel_, " elements and an output of ", chunk_numel_, ", got ",
              flat_grad.numel(), " and ", out.numel());
  at::NoGradGuard no_grad;
  at::Tensor message;
  if (quantization_ == CommQuantization::kBf16) {
    message = flat_grad.to(at::kBFloat16);
  } else {
    // Zeroed: the gaps between codes and parameters are sent too.
    message = at::zeros({sent_bytes()}, flat_grad.options().dtype(at::kByte));
    QuantizeBlocks(flat_grad, message, send_table_);
  }
  at::Tensor received = at::empty_like(message);
  std::unique_ptr<CollectiveWork> exchange = group.AllToAll(received, message);
  return std::make_unique<ReduceScatterWork>(
      std::move(exchange), std::move(message), std::move(received), out,
      quantization_ == CommQuantization::kInt8 ? &receive_table_ : nullptr, world_size_);
}

// Stage one in flight, then stage two (QuantizedAllReduce at the top of
// the header).
class QuantizedAllReduce::Work final : public PendingReduction {
 public:
  Work(const QuantizedAllReduce& plan, std::unique_ptr<CollectiveWork> exchange, at::Tensor sent,
       at::Tensor received, at::Tensor chunk, Collectives& replicate)
      : plan_(plan),
        replicate_(replicate),
        sent_(std::move(sent)),
        received_(std::move(received)),
        chunk_(std::move(chunk)),
        exchange_(std::move(exchange)) {}

  void Advance() override {
    if (exchange_ == nullptr) return;
    exchange_->Wait();
    exchange_.reset();
    at::NoGradGuard no_grad;
    // Written by the all-to-all's stream, read here on the current one.
    RecordUseOnCurrentStream(received_);
    RecordUseOnCurrentStream(sent_);
    const int64_t message = received_.numel() / plan_.replicas_;
    const bool int8 = plan_.quantization_ == CommQuantization::kInt8;
    at::Tensor sum;
    if (plan_.own_numel_ > 0) {
      at::Tensor decoded;
      for (int r = 0; r < plan_.replicas_; ++r) {
        const at::Tensor theirs = received_.narrow(0, r * message, message);
        if (int8) {
          if (!decoded.defined()) {
            decoded = at::empty({plan_.own_numel_}, chunk_.options().dtype(at::kFloat));
          }
          DequantizeBlocks(theirs, plan_.own_table_, decoded);
        } else {
          decoded = theirs.narrow(0, 0, plan_.own_numel_).to(at::kFloat);
        }
        sum = r == 0 ? decoded.clone() : sum.add_(decoded);
      }
    }
    sent_ = received_ = at::Tensor();
    // Zeroed: the gaps, and the part a replica with an empty one sends.
    at::Tensor own = at::zeros({message}, chunk_.options().dtype(int8 ? at::kByte : at::kBFloat16));
    if (sum.defined()) {
      if (int8) {
        QuantizeBlocks(sum, own, plan_.own_table_);
      } else {
        own.narrow(0, 0, plan_.own_numel_).copy_(sum);
      }
    }
    gathered_ = at::empty({plan_.replicas_ * message}, own.options());
    own_ = std::move(own);
    gather_ = replicate_.AllGatherIntoTensor(gathered_, own_);
  }

  void Wait() override {
    Advance();
    TORCH_CHECK(gather_ != nullptr,
                "QuantizedAllReduce: the all-gather of the replicas' sums was never issued (stage "
                "two failed earlier, or this reduction was already waited for)");
    gather_->Wait();
    gather_.reset();
    at::NoGradGuard no_grad;
    RecordUseOnCurrentStream(gathered_);
    RecordUseOnCurrentStream(own_);
    if (plan_.quantization_ == CommQuantization::kInt8) {
      DequantizeBlocks(gathered_, plan_.parts_table_, chunk_);
    } else {
      chunk_.copy_(gathered_.narrow(0, 0, plan_.chunk_numel_));
    }
    gathered_ = own_ = chunk_ = at::Tensor();
  }

 private:
  const QuantizedAllReduce& plan_;
  Collectives& replicate_;
  // Declared before the works, so that an unwaited reduction waits for
  // them before it lets go of their buffers.
  at::Tensor sent_;
  at::Tensor received_;
  at::Tensor chunk_;
  at::Tensor own_;       // This replica's part's sum, coded.
  at::Tensor gathered_;  // Every replica's.
  std::unique_ptr<CollectiveWork> exchange_;
  std::unique_ptr<CollectiveWork> gather_;
};

QuantizedAllReduce::QuantizedAllReduce(const FlatLayout& layout, int replicas, int replica,
                                       CommQuantization quantization, c10::Device device)
    : replicas_(replicas), quantization_(quantization) {
  TORCH_CHECK(layout.sharded() && layout.has_trainable_params() &&
                  quantization != CommQuantization::kNone && replicas >= 1 && replica >= 0 &&
                  replica < replicas,
              "QuantizedAllReduce needs a sharded layout with trainable parameters, a "
              "quantization and a replica rank below the replica count");
  const FlatLayout::Segment& trainable = layout.segments().front();
  chunk_numel_ = trainable.shard_numel;
  part_numel_ = (chunk_numel_ + replicas - 1) / replicas;
  const int64_t own_begin = std::min<int64_t>(chunk_numel_, replica * part_numel_);
  own_numel_ = std::min(chunk_numel_, own_begin + part_numel_) - own_begin;
  if (quantization == CommQuantization::kBf16) {
    message_bytes_ = part_numel_ * 2;
    return;
  }
  // Each part's stretches of the chunk's pieces, in chunk offsets.
  struct Stretch {
    int64_t begin;
    int64_t length;
  };
  std::vector<std::vector<Stretch>> parts(replicas);
  const int64_t chunk_begin = layout.OwnedBegin(trainable, layout.rank());
  for (const FlatLayout::Piece& piece : layout.PiecesOf(0, layout.rank())) {
    const int64_t begin = piece.flat_offset - chunk_begin;
    for (int j = 0; j < replicas; ++j) {
      const int64_t from = std::max(begin, j * part_numel_);
      const int64_t to = std::min(begin + piece.numel, (j + 1) * part_numel_);
      if (from < to) parts[j].push_back({from, to - from});
    }
  }
  int64_t most = 0;
  for (const std::vector<Stretch>& part : parts) {
    int64_t blocks = 0;
    for (const Stretch& s : part) blocks += QuantizationRun{0, 0, 0, s.length}.blocks();
    most = std::max(most, blocks);
  }
  const int64_t params_begin = RoundUp8(part_numel_);
  message_bytes_ = params_begin + most * kBlockParamBytes;
  std::vector<QuantizationRun> all, own;
  for (int j = 0; j < replicas; ++j) {
    const int64_t base = j * message_bytes_;
    int64_t param = params_begin;
    for (const Stretch& s : parts[j]) {
      const int64_t in_part = s.begin - j * part_numel_;
      all.push_back({s.begin, base + in_part, base + param, s.length});
      if (j == replica) own.push_back({in_part, in_part, param, s.length});
      param += QuantizationRun{0, 0, 0, s.length}.blocks() * kBlockParamBytes;
    }
  }
  parts_table_ = BlockTable(all).To(device);
  if (!own.empty()) own_table_ = BlockTable(own).To(device);
}

std::unique_ptr<PendingReduction> QuantizedAllReduce::Start(const at::Tensor& chunk,
                                                            Collectives& replicate) const {
  TORCH_CHECK(chunk.numel() == chunk_numel_ && replicate.world_size() == replicas_,
              "QuantizedAllReduce::Start: expected a chunk of ", chunk_numel_, " elements across ",
              replicas_, " replicas, got ", chunk.numel(), " across ", replicate.world_size());
  at::NoGradGuard no_grad;
  at::Tensor sent;
  if (quantization_ == CommQuantization::kBf16) {
    sent = at::zeros({replicas_ * part_numel_}, chunk.options().dtype(at::kBFloat16));
    sent.narrow(0, 0, chunk_numel_).copy_(chunk);
  } else {
    // Zeroed: the gaps between codes and parameters are sent too.
    sent = at::zeros({replicas_ * message_bytes_}, chunk.options().dtype(at::kByte));
    QuantizeBlocks(chunk, sent, parts_table_);
  }
  at::Tensor received = at::empty_like(sent);
  std::unique_ptr<CollectiveWork> exchange = replicate.AllToAll(received, sent);
  return std::make_unique<Work>(*this, std::move(exchange), std::move(sent), std::move(received),
                                chunk, replicate);
}

}  // namespace fsdp
