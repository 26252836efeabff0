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

absl::StatusOr<DcpModelAndOptimizer> DcpShardsOfModelAndOptimizer(
    FullyShardedModel& model, torch::optim::Optimizer& optimizer, const DcpCheckpointKeys& keys,
    const std::vector<DcpItem>& extra) {
  FSDP_ASSIGN_OR_RETURN(const auto places, OptimizerShardPlaces(model, optimizer));
  FSDP_ASSIGN_OR_RETURN(OptimStateDict optim, ShardedOptimStateDict(model, optimizer));
  DcpModelAndOptimizer out;
  out.shards = ModelDcpShards(model, keys.model, /*every_name=*/true);
  // Elementwise state goes as shards; step counts and options as values.
  for (auto& [fqn, param] : optim.state) {
    const ParamShardPlace& place = places.at(fqn);
    for (const auto& [name, t] : param.tensors) {
      DcpTensorShard shard;
      shard.path = {{false, keys.optim, 0}, {false, "state", 0}, {false, fqn, 0}, {false, name, 0}};
      shard.shape = place.full_shape;
      shard.dtype = t.scalar_type();
      shard.sharded = place.sharded;
      shard.lo = place.lo;
      shard.hi = place.hi;
      shard.local = t;
      out.shards.push_back(std::move(shard));
    }
    param.tensors.clear();
  }
  out.values = DcpItemsOfOptimState(optim, keys.optim);
  out.values.insert(out.values.end(), extra.begin(), extra.end());
  return out;
}

absl::Status SaveShardedDcpModelAndOptimizer(FullyShardedModel& model,
                                             torch::optim::Optimizer& optimizer,
                                             const std::string& dir, const DcpCheckpointKeys& keys,
                                             const std::vector<DcpItem>& extra,
                                             const absl::Status& caller_ready) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("saving a DCP checkpoint"));
  DcpModelAndOptimizer state;
  // A problem here is reported through the save, which every rank enters.
  absl::Status ready = caller_ready;
  try {
    if (ready.ok()) {
      absl::StatusOr<DcpModelAndOptimizer> found =
          DcpShardsOfModelAndOptimizer(model, optimizer, keys, extra);
      ready = found.status();
      if (found.ok()) state = *std::move(found);
    }
  } catch (...) {
    ready = StatusFromCurrentException();
  }
  return SaveModelShardedDcp(model, dir, state.shards, state.values, ready);
}

absl::Status StageShardedDcpOptimizer(FullyShardedModel& model,
                                      torch::optim::Optimizer& optimizer, const std::string& dir,
                                      const std::string& optim_key, StagedDcpOptimizer& staged) {
  absl::Status ready;
  try {
    // Errors are returned here, never thrown past a caller's collective.
    const auto read = [&]() -> absl::StatusOr<OptimStateDict> {
      FSDP_ASSIGN_OR_RETURN(const auto places, OptimizerShardPlaces(model, optimizer));
      // A state keyed by index names the optimizer's parameters by
      // position across its groups.
      FSDP_ASSIGN_OR_RETURN(const OptimStateDict current, ShardedOptimStateDict(model, optimizer));
      std::vector<std::string> fqn_of_index;
      for (const ParamGroupState& group : current.param_groups) {
        fqn_of_index.insert(fqn_of_index.end(), group.params.begin(), group.params.end());
      }
      return LoadDcpOptimStateDictPart(dir, optim_key, places, fqn_of_index, &staged.bytes_read);
    };
    absl::StatusOr<OptimStateDict> optim = read();
    ready = optim.ok() ? CheckShardedOptimStateDict(model, optimizer, *optim) : optim.status();
    if (optim.ok()) {
      for (const auto& [fqn, param] : optim->state) {
        for (const auto& [name, t] : param.tensors) {
          staged.bytes_needed += t.numel() * static_cast<int64_t>(t.element_size());
        }
      }
      staged.state = *std::move(optim);
    }
  } catch (...) {
    ready = StatusFromCurrentException();
  }
  if (ready.ok()) return ready;
  return absl::Status(ready.code(), absl::StrCat("the optimizer state under '", optim_key,
                                                 "': ", ready.message()));
}

absl::Status ApplyStagedDcpOptimizer(FullyShardedModel& model,
                                     torch::optim::Optimizer& optimizer, const std::string& dir,
                                     const StagedDcpOptimizer& staged) {
  if (absl::Status applied = LoadShardedOptimStateDict(model, optimizer, staged.state);
      !applied.ok()) {
    return absl::Status(
        applied.code(),
        absl::StrCat("the model was loaded from '", dir,
                     "' but the optimizer state could not be written: ", applied.message()));
  }
  return absl::OkStatus();
}

absl::Status LoadShardedDcpModelAndOptimizer(FullyShardedModel& model,
                                             torch::optim::Optimizer& optimizer,
                                             const std::string& dir, const DcpCheckpointKeys& keys,
                                             ShardedLoadStats* stats,
                                             const absl::Status& caller_ready) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("loading a DCP checkpoint"));
  // This rank's part of the optimizer state, read and checked first: a
  // problem there fails the model's load on every rank too.
  StagedDcpOptimizer optim;
  absl::Status ready = StageShardedDcpOptimizer(model, optimizer, dir, keys.optim, optim);
  if (!caller_ready.ok()) ready = caller_ready;
  ShardedLoadStats model_stats;
  FSDP_RETURN_IF_ERROR(LoadShardedDcp(model.group(), dir,
                                      ModelDcpShards(model, keys.model, /*every_name=*/false),
                                      &model_stats, ready, model.replicate_group()));
  FSDP_RETURN_IF_ERROR(ApplyStagedDcpOptimizer(model, optimizer, dir, optim));
  if (stats != nullptr) {
    stats->bytes_read = model_stats.bytes_read + optim.bytes_read;
    stats->bytes_needed = model_stats.bytes_needed + optim.bytes_needed;
  }
  return absl::OkStatus();
}

}  // namespace fsdp
