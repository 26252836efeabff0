// QuantizedGather: one unit's all-gather in fewer bytes than its compute
// dtype (ResolvedUnitOptions::all_gather_quantization; ZeRO++'s qwZ). Each
// rank codes its shard into a message of equal size on every rank, one
// all-gather moves the W messages, and every rank decodes all of them,
// its own included, into the full parameter: so every rank computes with
// the same values, and the shard the optimizer steps stays exact.
//
// Messages (laid out so that the ranks agree on them from the layout
// alone, without exchanging anything):
//  * kBf16: the shard (S elements, padding included) in bfloat16.
//  * kInt8: S code bytes, zero bytes up to a multiple of 8, then the
//    parameters of up to B blocks, 8 bytes each (comm/block_quantization.h),
//    where B is the largest block count of any rank's shard. A rank's shard
//    is cut into blocks at every parameter boundary, at the segments'
//    padding and every 256 values after a cut, so that no block mixes two
//    parameters' scales (a LayerNorm gain near 1.0 beside weights near
//    0.02 would lose the weights' resolution) and the padding's zeros code
//    exactly.
//
// Cost: the all-gather's output is W * message bytes (what the group's
// counters count) instead of W * S * sizeof(compute dtype); a gathered
// buffer of that size lives from Start to Finish beside the full
// parameter; coding and decoding run on the compute device, on the current
// stream. The tables that say where each block lies hold a row per
// parameter piece of each rank (40 bytes), kept for the unit's life.
//
// World size 1 codes and decodes too, though nothing crosses a wire: a run
// on one rank computes with the values a run on many would.
//
// QuantizedReduceScatter: the reduction's counterpart (ResolvedUnitOptions::
// reduce_quantization; ZeRO++'s qgZ). The unit's flat gradient (its
// trainable segment, W chunks of S) is coded chunk by chunk, chunk r into
// the message for rank r (laid out as rank r's all-gather message above,
// over the trainable segment alone), one all-to-all delivers them, and each
// rank decodes the W messages for its chunk into float32 and sums them in
// rank order: the sum is taken in float32 whatever the reduction dtype, and
// every rank sums its chunk the same way, so that runs repeat bit for bit.
// Each rank's gradient is approximate before the sum (the error of one
// block is at most its range / 510); no error feedback is kept. The sum is
// cast to `out`'s dtype (the reduction dtype), where the runtime divides
// it. Cost: besides the flat gradient, a coded copy of it (what is sent)
// and as much received, from Start to the wait, and two float32 chunks
// (S elements) while decoding.
//
// QuantizedAllReduce: under hybrid sharding with reduce_quantization, the
// replicate group's all-reduce of the reduced chunk (S elements, the shard
// group's sum) in the same codes, so that the gradients cross the slow
// links between hosts quantized too (ZeRO++'s qgZ quantizes both hops).
// The chunk is cut into R parts of ceil(S / R) elements (the last shorter,
// possibly empty); each part's blocks are cut at the chunk's pieces as
// above. Stage one: every replica codes part j for replica j, one
// all-to-all delivers them, and each replica decodes the R codes of its
// part and sums them in float32 in replica order. Stage two: each replica
// codes its part's sum, one all-gather delivers the R sums, and every
// replica decodes all of them, its own included, into the chunk: so the
// replicas hold the same values bit for bit and step alike. Each value is
// coded twice: its error is at most the sum of the R coded contributions'
// half steps plus the sum's half step. Cost: each replica sends the other
// R - 1 a message of ceil(S / R) codes and their block parameters in each
// stage, 2 (R - 1) messages, about 0.26x (int8) or 0.5x (bf16) of what a
// float32 ring all-reduce sends (2 (R - 1) / R * 4S bytes). Memory: stage
// one holds a coded copy of the chunk and as much received, freed when
// stage two is issued; stage two holds R + 1 messages (about S (1 + 1/R)
// bytes in int8, twice that in bf16) until Wait() decodes them, which the
// runtime does for every unit at the end of backward.
//
// Thread safety: none; its handle drives it.
#ifndef FSDP_FSDP_QUANTIZED_GATHER_H_
#define FSDP_FSDP_QUANTIZED_GATHER_H_

#include <cstdint>
#include <memory>

#include "ATen/core/Tensor.h"
#include "comm/block_quantization.h"
#include "comm/collectives.h"
#include "fsdp/comm_hooks.h"
#include "fsdp/flat_layout.h"
#include "policies/unit_options.h"

namespace fsdp {

class QuantizedGather {
 public:
  // For a sharded `layout` of a group of `world_size` ranks, computing on
  // `device`. REQUIRES: layout.sharded(), quantization != kNone.
  QuantizedGather(const FlatLayout& layout, int world_size, CommQuantization quantization,
                  c10::Device device);
  QuantizedGather(const QuantizedGather&) = delete;
  QuantizedGather& operator=(const QuantizedGather&) = delete;

  // Codes `shard` (laid out like the shard, floating, on the compute
  // device) and issues the all-gather of the messages over `group` (the
  // layout's shard group, or one of its size). REQUIRES: nothing pending.
  std::unique_ptr<CollectiveWork> Start(const at::Tensor& shard, Collectives& group);
  // Once the work has completed: decodes every rank's message into `full`
  // (laid out like the flat parameter, any floating dtype, on the compute
  // device) and releases the gathered buffer.
  void Finish(const at::Tensor& full);
  // Releases the gathered buffer without decoding (a failed all-gather).
  void Discard();
  bool pending() const { return gathered_.defined(); }

  // The values every rank's full parameter holds at this rank's part after
  // Finish: `shard` coded and decoded, in `dtype`.
  at::Tensor RoundTrip(const at::Tensor& shard, at::ScalarType dtype) const;

  // Bytes of one rank's message: the all-gather moves world_size times this.
  int64_t message_bytes() const { return message_bytes_; }

 private:
  const FlatLayout& layout_;
  const int world_size_;
  const CommQuantization quantization_;
  int64_t message_bytes_ = 0;
  // kInt8: this rank's runs (value offsets into the shard) and every
  // rank's (value offsets into the flat parameter, code and parameter
  // offsets into the gathered buffer), on the compute device: a run per
  // parameter piece, so a few rows per parameter and rank.
  BlockTable own_table_;
  BlockTable gather_table_;
  at::Tensor gathered_;  // W messages, while an all-gather is pending.
  at::Tensor message_;   // This rank's message, until the all-gather is done.
};

class QuantizedReduceScatter {
 public:
  // For a sharded `layout` with trainable parameters, of a group of
  // `world_size` ranks, computing on `device`. REQUIRES: layout.sharded(),
  // layout.has_trainable_params(), quantization != kNone.
  QuantizedReduceScatter(const FlatLayout& layout, int world_size, CommQuantization quantization,
                         c10::Device device);
  QuantizedReduceScatter(const QuantizedReduceScatter&) = delete;
  QuantizedReduceScatter& operator=(const QuantizedReduceScatter&) = delete;

  // Codes `flat_grad` (the trainable segment's full gradient, W * S
  // elements, floating, on the compute device) and issues the all-to-all
  // over `group`; the work's Wait() leaves in `out` (S elements, floating)
  // the sum over the ranks of their chunks for this rank. The work holds
  // what it needs; this object must outlive it.
  std::unique_ptr<CollectiveWork> Start(const at::Tensor& flat_grad, const at::Tensor& out,
                                        Collectives& group) const;

  // Bytes each rank sends: W messages.
  int64_t sent_bytes() const { return world_size_ * message_bytes_; }

 private:
  const int world_size_;
  const CommQuantization quantization_;
  int64_t chunk_numel_ = 0;  // S of the trainable segment.
  int64_t message_bytes_ = 0;
  // kInt8: every chunk of the flat gradient coded into the message for its
  // rank; and any one message this rank receives decoded into its chunk.
  BlockTable send_table_;
  BlockTable receive_table_;
};

class QuantizedAllReduce {
 public:
  // For this rank's trainable chunk of a sharded `layout` with trainable
  // parameters, summed across `replicas` ranks of which this is `replica`,
  // computing on `device`. REQUIRES: layout.sharded(),
  // layout.has_trainable_params(), quantization != kNone, replicas >= 1.
  QuantizedAllReduce(const FlatLayout& layout, int replicas, int replica,
                     CommQuantization quantization, c10::Device device);
  QuantizedAllReduce(const QuantizedAllReduce&) = delete;
  QuantizedAllReduce& operator=(const QuantizedAllReduce&) = delete;

  // Codes `chunk` (S elements, floating, on the compute device) and issues
  // stage one's all-to-all over `replicate`. The first Advance() of the
  // reduction returned waits for it, sums and issues stage two's
  // all-gather; Wait() does what Advance() has not done and leaves the sum
  // over the replicas in `chunk`. The reduction holds what it needs; this
  // object must outlive it.
  std::unique_ptr<PendingReduction> Start(const at::Tensor& chunk, Collectives& replicate) const;

  // Bytes of one message: both stages move R of them per replica (what
  // the group's counters count for each).
  int64_t message_bytes() const { return message_bytes_; }

 private:
  class Work;

  const int replicas_;
  const CommQuantization quantization_;
  int64_t chunk_numel_ = 0;  // S.
  int64_t part_numel_ = 0;   // ceil(S / R).
  int64_t own_numel_ = 0;    // This replica's part's (the last may be shorter).
  int64_t message_bytes_ = 0;
  // kInt8: every part of the chunk coded into (or decoded from) message j
  // of R; and this replica's part (values from 0) in any one message.
  BlockTable parts_table_;
  BlockTable own_table_;
};

}  // namespace fsdp

#endif  // FSDP_FSDP_QUANTIZED_GATHER_H_
