// What Wrap does to a model's tensors around sharding them: deferred
// allocation and param_init_fn, the move to device_id, rank 0's values
// (sync_module_states) and buffer_dtype casts. Parameters are handled one
// unit at a time, just before the unit's handle shards them, so no rank
// holds more than one unit's full parameters beyond what the model held
// before Wrap; buffers once every unit is sharded.
//
// Used only by FullyShardedModel::Wrap; errors come back without the
// rank prefix, which Wrap adds.
#ifndef FSDP_FSDP_UNIT_INIT_H_
#define FSDP_FSDP_UNIT_INIT_H_

#include <map>
#include <string>

#include "absl/status/status.h"
#include "c10/core/ScalarType.h"
#include "c10/core/TensorImpl.h"
#include "comm/collectives.h"
#include "fsdp/fsdp_options.h"
#include "fsdp/wrap_plan.h"
#include "torch/nn/module.h"

namespace fsdp {

// Modules by FQN ("" for the root).
using ModulesByName = std::map<std::string, torch::nn::Module*>;

// device_id names one concrete device, and no parameter is on another
// accelerator (parameters are not moved between accelerators).
absl::Status CheckDeviceId(const FsdpOptions& options, const WrapPlan& plan);

// The unit's parameters, ready to shard: deferred ones allocated and
// filled by param_init_fn (once per owning module, with that module's
// deferred buffers), moved to device_id, and set to rank 0's values under
// sync_module_states (one flat broadcast per unit, over the shard group and
// then the replicate group).
absl::Status InitUnitParams(const PlannedUnit& unit, const ModulesByName& modules,
                            const FsdpOptions& options, const ProcessGroups& groups);

// Every buffer outside ignored modules: deferred ones allocated and filled
// by param_init_fn, moved to device_id, set to rank 0's values under
// sync_module_states, and cast to the buffer_dtype of the unit owning it;
// `original_dtypes` gets the dtype of each buffer cast.
absl::Status InitBuffers(torch::nn::Module& root, const ModulesByName& modules,
                         const WrapPlan& plan, const FsdpOptions& options,
                         const ProcessGroups& groups,
                         std::map<const c10::TensorImpl*, at::ScalarType>& original_dtypes);

}  // namespace fsdp

#endif  // FSDP_FSDP_UNIT_INIT_H_
