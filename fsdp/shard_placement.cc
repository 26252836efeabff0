#include "fsdp/shard_placement.h"

#include "fsdp/flat_param_handle.h"

namespace fsdp {

ShardPlacements ShardPlacementsOf(const FullyShardedModel& model) {
  ShardPlacements placements;
  for (size_t u = 0; u < model.units().size(); ++u) {
    const FlatParamHandle* handle = model.units()[u]->handle();
    if (handle == nullptr) continue;
    const FlatLayout& layout = handle->layout();
    for (size_t i = 0; i < handle->entries().size(); ++i) {
      const FlatParamInfo& info = layout.params()[i];
      ShardPlacement p;
      p.full_shape = info.shape;
      p.sharded = layout.sharded();
      p.lo = p.sharded ? info.shard_offset : 0;
      p.hi = p.sharded ? info.shard_offset + info.shard_numel : info.numel;
      p.local = handle->LocalShardOf(i).reshape({-1});
      p.unit = static_cast<int>(u);
      placements.emplace(handle->entries()[i].param.unsafeGetTensorImpl(), std::move(p));
    }
  }
  return placements;
}

std::optional<UnitShard> UnitShard::Of(const FsdpUnit& unit) {
  if (unit.handle() == nullptr) return std::nullopt;
  return UnitShard(*unit.handle());
}

const FlatLayout& UnitShard::layout() const { return handle_->layout(); }
ShardingStrategy UnitShard::strategy() const { return handle_->strategy(); }
const at::Tensor& UnitShard::local() const { return handle_->local_shard(); }
const at::Tensor& UnitShard::param(size_t i) const { return handle_->entries().at(i).param; }
at::Tensor UnitShard::AllGather(const at::Tensor& shard_like) const {
  return handle_->AllGatherShardLike(shard_like);
}

ShardPlacement PlacementOf(const ShardPlacements& placements, const at::Tensor& tensor) {
  auto it = placements.find(tensor.unsafeGetTensorImpl());
  if (it != placements.end()) return it->second;
  ShardPlacement whole;
  whole.full_shape = tensor.sizes().vec();
  whole.hi = tensor.numel();
  whole.in_place = tensor.is_contiguous();
  whole.local = whole.in_place ? tensor.detach().view({-1}) : tensor.detach().reshape({-1});
  return whole;
}

}  // namespace fsdp
