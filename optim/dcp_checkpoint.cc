#include "optim/dcp_checkpoint.h"

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "optim/optim_state.h"
#include "optim/torch_optim_file.h"
#include "statedict/dcp_sharded.h"

namespace fsdp {

absl::Status SaveShardedDcpModelAndOptimizer(FullyShardedModel& model,
                                             torch::optim::Optimizer& optimizer,
                                             const std::string& dir, const DcpCheckpointKeys& keys,
                                             const std::vector<DcpItem>& extra) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("saving a DCP checkpoint"));
  std::vector<DcpTensorShard> shards;
  std::vector<DcpItem> values;
  // A problem here is reported through the save, which every rank enters.
  absl::Status ready;
  try {
    ready = [&]() -> absl::Status {
      FSDP_ASSIGN_OR_RETURN(const auto places, OptimizerShardPlaces(model, optimizer));
      FSDP_ASSIGN_OR_RETURN(OptimStateDict optim, ShardedOptimStateDict(model, optimizer));
      shards = ModelDcpShards(model, keys.model, /*every_name=*/true);
      // Elementwise state goes as shards; step counts and options as values.
      for (auto& [fqn, param] : optim.state) {
        const ParamShardPlace& place = places.at(fqn);
        for (const auto& [name, t] : param.tensors) {
          DcpTensorShard shard;
          shard.path = {
              {false, keys.optim, 0}, {false, "state", 0}, {false, fqn, 0}, {false, name, 0}};
          shard.shape = place.full_shape;
          shard.dtype = t.scalar_type();
          shard.sharded = place.sharded;
          shard.lo = place.lo;
          shard.hi = place.hi;
          shard.local = t;
          shards.push_back(std::move(shard));
        }
        param.tensors.clear();
      }
      values = DcpItemsOfOptimState(optim, keys.optim);
      values.insert(values.end(), extra.begin(), extra.end());
      return absl::OkStatus();
    }();
  } catch (...) {
    ready = StatusFromCurrentException();
  }
  return SaveModelShardedDcp(model, dir, shards, values, ready);
}

absl::Status LoadShardedDcpModelAndOptimizer(FullyShardedModel& model,
                                             torch::optim::Optimizer& optimizer,
                                             const std::string& dir, const DcpCheckpointKeys& keys,
                                             ShardedLoadStats* stats,
                                             const absl::Status& caller_ready) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("loading a DCP checkpoint"));
  // This rank's part of the optimizer state, read and checked first: a
  // problem there fails the model's load on every rank too.
  int64_t optim_bytes = 0, optim_needed = 0;
  absl::StatusOr<OptimStateDict> optim = absl::UnknownError("not read");
  absl::Status ready;
  try {
    // Errors are returned here, never thrown past the collective below.
    const auto read = [&]() -> absl::StatusOr<OptimStateDict> {
      FSDP_ASSIGN_OR_RETURN(const auto places, OptimizerShardPlaces(model, optimizer));
      // A state keyed by index names the optimizer's parameters by
      // position across its groups.
      FSDP_ASSIGN_OR_RETURN(const OptimStateDict current, ShardedOptimStateDict(model, optimizer));
      std::vector<std::string> fqn_of_index;
      for (const ParamGroupState& group : current.param_groups) {
        fqn_of_index.insert(fqn_of_index.end(), group.params.begin(), group.params.end());
      }
      return LoadDcpOptimStateDictPart(dir, keys.optim, places, fqn_of_index, &optim_bytes);
    };
    optim = read();
    ready = optim.ok() ? CheckShardedOptimStateDict(model, optimizer, *optim) : optim.status();
    if (optim.ok()) {
      for (const auto& [fqn, param] : optim->state) {
        for (const auto& [name, t] : param.tensors) {
          optim_needed += t.numel() * static_cast<int64_t>(t.element_size());
        }
      }
    }
  } catch (...) {
    ready = StatusFromCurrentException();
  }
  if (!ready.ok()) {
    ready = absl::Status(ready.code(), absl::StrCat("the optimizer state under '", keys.optim,
                                                    "': ", ready.message()));
  }
  if (!caller_ready.ok()) ready = caller_ready;
  ShardedLoadStats model_stats;
  FSDP_RETURN_IF_ERROR(LoadShardedDcp(model.group(), dir,
                                      ModelDcpShards(model, keys.model, /*every_name=*/false),
                                      &model_stats, ready, model.replicate_group()));
  if (absl::Status applied = LoadShardedOptimStateDict(model, optimizer, *optim); !applied.ok()) {
    return absl::Status(
        applied.code(),
        absl::StrCat("the model was loaded from '", dir,
                     "' but the optimizer state could not be written: ", applied.message()));
  }
  if (stats != nullptr) {
    stats->bytes_read = model_stats.bytes_read + optim_bytes;
    stats->bytes_needed = model_stats.bytes_needed + optim_needed;
  }
  return absl::OkStatus();
}

}  // namespace fsdp
