// Which part of which tensor of a wrapped model this rank holds: the core's
// one answer, which state dicts, checkpoints and optimizer state (statedict/,
// optim/) build on instead of reading the units' flat parameters.
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
#include <unordered_map>
#include <vector>

#include "ATen/core/Tensor.h"
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

}  // namespace fsdp

#endif  // FSDP_FSDP_SHARD_PLACEMENT_H_
