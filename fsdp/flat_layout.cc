#include "fsdp/flat_layout.h"

#include <algorithm>
#include <set>

namespace fsdp {

FlatLayout FlatLayout::Of(const std::vector<Param>& params, bool sharded, int world_size,
                          int rank) {
  FlatLayout layout;
  layout.sharded_ = sharded;
  const int world = sharded ? world_size : 1;
  layout.rank_ = sharded ? rank : 0;
  std::vector<int64_t> numels;
  int64_t group_numel[2] = {0, 0};  // Frozen, trainable.
  for (const Param& p : params) {
    int64_t numel = 1;
    for (const int64_t d : p.shape) numel *= d;
    numels.push_back(numel);
    group_numel[p.trainable] += numel;
  }
  layout.flat_numel_ = group_numel[0] + group_numel[1];
  layout.trainable_numel_ = group_numel[1];
  // A segment per group with elements (one, frozen, when no parameter has
  // any), so that only a real mix costs a second all-gather.
  for (const bool trainable : {true, false}) {
    const int64_t numel = group_numel[trainable];
    if (numel == 0 && !(layout.segments_.empty() && !trainable)) continue;
    Segment seg;
    seg.trainable = trainable;
    seg.full_begin = layout.padded_numel_;
    seg.shard_begin = layout.shard_numel_;
    seg.shard_numel = (numel + world - 1) / world;
    seg.padded_numel = seg.shard_numel * world;
    layout.padded_numel_ += seg.padded_numel;
    layout.shard_numel_ += seg.shard_numel;
    layout.segments_.push_back(seg);
  }
  // Each parameter in its group's segment, in order; an empty one whose
  // group has no segment in the other (it takes no room).
  layout.infos_.resize(params.size());
  layout.segment_of_.assign(params.size(), 0);
  std::vector<int64_t> filled(layout.segments_.size(), 0);
  for (size_t i = 0; i < params.size(); ++i) {
    FlatParamInfo& info = layout.infos_[i];
    info.fqn = params[i].fqn;
    info.shape = params[i].shape;
    info.trainable = params[i].trainable;
    info.numel = numels[i];
    size_t& s = layout.segment_of_[i];
    for (size_t k = 0; k < layout.segments_.size(); ++k) {
      if (layout.segments_[k].trainable == info.trainable) s = k;
    }
    const Segment& seg = layout.segments_[s];
    info.offset = seg.full_begin + filled[s];
    filled[s] += info.numel;
    const int64_t owned = layout.OwnedBegin(seg, layout.rank_);
    const int64_t begin = std::max(info.offset, owned);
    const int64_t end = std::min(info.offset + info.numel, owned + seg.shard_numel);
    info.shard_offset = end > begin ? begin - info.offset : 0;
    info.shard_numel = std::max<int64_t>(0, end - begin);
  }
  return layout;
}

at::Tensor FlatLayout::ShardViewOf(const at::Tensor& flat, size_t i) const {
  const FlatParamInfo& info = infos_[i];
  // Not sharded: W = 1, so the shard is the flat parameter, segments unpadded.
  if (!sharded_) return FullViewOf(flat, i);
  if (info.shard_numel == 0) return flat.narrow(0, 0, 0);
  const Segment& seg = SegmentOf(i);
  return flat.narrow(0, seg.shard_begin + info.offset + info.shard_offset - OwnedBegin(seg, rank_),
                     info.shard_numel);
}

at::Tensor FlatLayout::FullViewOf(const at::Tensor& full, size_t i) const {
  return full.narrow(0, infos_[i].offset, infos_[i].numel).view(infos_[i].shape);
}

std::vector<FlatLayout::Piece> FlatLayout::PiecesOf(size_t s, int rank) const {
  const Segment& seg = segments_[s];
  std::set<int64_t> cuts;  // In the flat parameter.
  for (size_t i = 0; i < infos_.size(); ++i) {
    if (segment_of_[i] != s) continue;
    cuts.insert(infos_[i].offset);
    cuts.insert(infos_[i].offset + infos_[i].numel);
  }
  const int64_t begin = OwnedBegin(seg, rank);
  const int64_t end = begin + seg.shard_numel;
  cuts.insert(end);
  std::vector<Piece> pieces;
  int64_t at = begin;
  for (const int64_t cut : cuts) {
    if (cut <= at) continue;
    const int64_t piece_end = std::min(cut, end);
    pieces.push_back({at, seg.shard_begin + (at - begin), piece_end - at});
    at = piece_end;
    if (at == end) break;
  }
  return pieces;
}

}  // namespace fsdp
