// Which part of which tensor of a wrapped model this rank holds: the core's
// one answer, which state dicts, checkpoints and optimizer state (statedict/,
// optim/) build on instead of reading the units' flat parameters
// (fsdp/flat_param_handle.h is the core's own: nothing outside fsdp/
// includes it, tools/test.sh checks).
//
// Every parameter a unit holds is, on this rank, the elements [lo, hi) of
// its flattened full tensor (full_shape), stored in the unit's flat shard;
// `local` views them there (1-D, contiguous), so writing into it loads
// them. Under NO_SHARD, and for tensors no unit holds (buffers, ignored
// parameters), the rank holds the whole tensor: sharded false, [0, numel).
// A tensor no unit holds that is not contiguous (a transpose kept as a
// buffer) cannot be viewed flat: its `local` is a copy, and `in_place`
// false tells loaders to refuse it rather than load nothing.
#ifndef FSDP_FSDP_SHARD_PLACEMENT_H_
#define FSDP_FSDP_SHARD_PLACEMENT_H_

#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "ATen/core/Tensor.h"
#include "fsdp/flat_layout.h"
#include "fsdp/fully_shard.h"

namespace fsdp {

struct ShardPlacement {
  std::vector<int64_t> full_shape;
  bool sharded = false;  // Else this rank holds all of it.
  int64_t lo = 0;        // This rank's elements of the flattened tensor: [lo, hi).
  int64_t hi = 0;
  at::Tensor local;       // Those elements, 1-D, in the model's own storage...
  bool in_place = true;   // ...unless false: a copy.
  int unit = -1;          // model.units()[unit] holds it; -1: no unit does.
};

// Keyed by the TensorImpl of the module's parameter (what named_parameters
// and state_dict hand out; a tied parameter once). REQUIRES: the model IDLE
// (the parameters are views of the shards).
using ShardPlacements = std::unordered_map<const void*, ShardPlacement>;
ShardPlacements ShardPlacementsOf(const FullyShardedModel& model);

// `tensor`'s placement: from `placements`, or the whole tensor when no unit
// holds it.
ShardPlacement PlacementOf(const ShardPlacements& placements, const at::Tensor& tensor);

// One unit's flat shard as a whole: what a LOCAL state dict saves as one
// tensor (with its layout, so that a load into another layout is refused),
// and the layout in which optimizer state is gathered one collective per
// state key per unit rather than one per parameter. The same answer as the
// placements above, unit by unit; the unit's flat parameter stays inside
// the core. Valid while the model lives; REQUIRES the model IDLE.
class UnitShard {
 public:
  // Empty when the unit holds no parameters of its own.
  static std::optional<UnitShard> Of(const FsdpUnit& unit);

  // Where each parameter lies in the flat parameter and in this rank's
  // shard; sharded() is false under NO_SHARD.
  const FlatLayout& layout() const;
  ShardingStrategy strategy() const;
  // This rank's shard (layout().shard_numel() elements, padding included),
  // the unit's own storage: writing into it loads it.
  const at::Tensor& local() const;
  // The module's parameter at layout().params()[i].
  const at::Tensor& param(size_t i) const;
  // For state laid out like the shard: every rank's `shard_like` gathered
  // into the flat parameter's layout, where layout().FullViewOf finds each
  // parameter's part. `shard_like` has layout().shard_numel() elements, or
  // layout().trainable_shard_numel() for the trainable parameters' state
  // only (the result is then that segment). Blocking; every rank of the
  // unit's shard group calls it.
  at::Tensor AllGather(const at::Tensor& shard_like) const;

 private:
  explicit UnitShard(const FlatParamHandle& handle) : handle_(&handle) {}
  const FlatParamHandle* handle_;
};

}  // namespace fsdp

#endif  // FSDP_FSDP_SHARD_PLACEMENT_H_
