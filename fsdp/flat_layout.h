// FlatLayout: where each of a unit's parameters lies in its flat parameter
// and in one rank's shard of it (NOTE [Flat parameter] in
// flat_param_handle.h). Pure arithmetic over shapes: it owns no tensors and
// issues no collectives, so the handle, the shard placements the state dicts
// and optimizer read, and the tests all ask it the same question and get the
// same answer. The view functions only narrow a tensor the caller passes.
//
// Thread safety: immutable after Of(); safe to share.
#ifndef FSDP_FSDP_FLAT_LAYOUT_H_
#define FSDP_FSDP_FLAT_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ATen/core/Tensor.h"

namespace fsdp {

// Where one original parameter lies in the flat parameter and in this
// rank's shard.
struct FlatParamInfo {
  std::string fqn;
  std::vector<int64_t> shape;
  bool trainable = true;  // requires_grad at Create: its segment.
  int64_t offset = 0;     // First element in the flat parameter.
  int64_t numel = 0;
  int64_t shard_offset = 0;  // First element of the part this rank owns,
                             // relative to the start of p_i.
  int64_t shard_numel = 0;   // Elements of p_i this rank owns (may be 0).
};

class FlatLayout {
 public:
  // What the layout needs of one parameter.
  struct Param {
    std::string fqn;
    std::vector<int64_t> shape;
    bool trainable = true;
  };

  // One segment of the flat parameter (NOTE [Flat parameter]).
  struct Segment {
    bool trainable = false;
    int64_t full_begin = 0;    // First element in the flat parameter.
    int64_t padded_numel = 0;  // P_s = W * S_s.
    int64_t shard_begin = 0;   // First element in the shard.
    int64_t shard_numel = 0;   // S_s.
  };

  // Lays `params` out for rank `rank` of `world_size`. `sharded` false
  // (NO_SHARD) lays them out unpadded, as for one rank that holds them all,
  // whatever world_size and rank say.
  static FlatLayout Of(const std::vector<Param>& params, bool sharded, int world_size, int rank);

  bool sharded() const { return sharded_; }
  int rank() const { return rank_; }  // 0 when not sharded.
  const std::vector<FlatParamInfo>& params() const { return infos_; }
  // Trainable first; one or two.
  const std::vector<Segment>& segments() const { return segments_; }
  const Segment& SegmentOf(size_t i) const { return segments_[segment_of_[i]]; }
  bool has_trainable_params() const { return segments_.front().trainable; }

  int64_t flat_numel() const { return flat_numel_; }            // sum F_s, unpadded.
  int64_t trainable_numel() const { return trainable_numel_; }  // Unpadded.
  int64_t padded_numel() const { return padded_numel_; }        // P, the full buffer.
  int64_t shard_numel() const { return shard_numel_; }          // S, padding included.
  // Elements of the sharded gradient (the trainable segment's part of the
  // shard; 0 without trainable parameters).
  int64_t trainable_shard_numel() const {
    return has_trainable_params() ? segments_.front().shard_numel : 0;
  }
  // The first element of segment `s` that `rank` owns, in the flat parameter.
  int64_t OwnedBegin(const Segment& seg, int rank) const {
    return seg.full_begin + rank * seg.shard_numel;
  }

  // A stretch of one rank's part of a segment that holds one parameter's
  // values, or padding only.
  struct Piece {
    int64_t flat_offset = 0;   // In the flat parameter.
    int64_t shard_offset = 0;  // In that rank's shard.
    int64_t numel = 0;
  };
  // Rank `rank`'s part of segment `s`, cut at every parameter boundary and
  // at the segment's unpadded end, in shard order (what quantized
  // collectives code in separate blocks: fsdp/quantized_gather.h).
  std::vector<Piece> PiecesOf(size_t s, int rank) const;

  // Parameter i's part of `flat`, a tensor laid out like the shard (or, for
  // a trainable parameter, like the sharded gradient: the trainable
  // segment's part of the shard): 1-D and possibly empty, or when not
  // sharded the whole parameter in its shape.
  at::Tensor ShardViewOf(const at::Tensor& flat, size_t i) const;
  // Parameter i's view, in its shape, of `full`, a tensor laid out like the
  // flat parameter (or, for a trainable parameter, like its trainable
  // segment alone).
  at::Tensor FullViewOf(const at::Tensor& full, size_t i) const;

 private:
  bool sharded_ = true;
  int rank_ = 0;
  std::vector<FlatParamInfo> infos_;
  std::vector<Segment> segments_;
  std::vector<size_t> segment_of_;  // Parameter i's segment.
  int64_t flat_numel_ = 0;
  int64_t trainable_numel_ = 0;
  int64_t padded_numel_ = 0;
  int64_t shard_numel_ = 0;
};

}  // namespace fsdp

#endif  // FSDP_FSDP_FLAT_LAYOUT_H_
