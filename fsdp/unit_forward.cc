#include "fsdp/unit_forward.h"

#include "fsdp/activation_checkpointing.h"
#include "fsdp/flat_param_handle.h"
#include "fsdp/fully_shard.h"
#include "fsdp/unit_scheduler.h"

namespace fsdp {

UnitForward::UnitForward(const torch::nn::Module* module) : unit_(GetModuleUnit(module)) {
  if (unit_ == nullptr) return;
  // Its recompute would gather the unit again inside another unit's
  // backward, outside the hooks that order gathers and reductions.
  TORCH_CHECK(!InCheckpointedRegion(), unit_->model_->Describe(*unit_),
              " opens its forward inside the activation-checkpointed region '",
              CheckpointedRegionName(),
              "': a checkpointed region must not contain another unit's forward. Checkpoint the "
              "unit itself (its region inside its scope) or modules within one unit");
  try {
    unit_->model_->PreForward(*unit_);
  } catch (...) {
    // A failed all-gather: no destructor will run for this scope.
    Abandon();
    throw;
  }
}

UnitForward::~UnitForward() {
  if (unit_ == nullptr || returned_) return;
  Abandon();
}

void UnitForward::Abandon() {
  // The forward threw: leave the unit resharded and idle (and the model,
  // if this is the root).
  if (unit_->is_root_) unit_->model_->SetModelState(ModelTrainingState::kIdle);
  FlatParamHandle* handle = unit_->handle_.get();
  if (handle == nullptr) return;
  try {
    if (handle->training_state() == HandleTrainingState::kForward) {
      unit_->model_->scheduler().Move(*handle, HandleTrainingState::kForward,
                                      HandleTrainingState::kIdle);
    }
    unit_->model_->scheduler().Reshard(*handle);
  } catch (...) {
    // Destructors cannot throw; the forward's exception is the one to see.
  }
}

at::Tensor UnitForward::Input(const at::Tensor& input) const {
  if (unit_ == nullptr || !input.defined() || !input.is_floating_point()) return input;
  const MixedPrecision& mp = unit_->options_.mixed_precision;
  const bool cast = unit_->is_root_ ? mp.cast_root_forward_inputs : mp.cast_forward_inputs;
  if (!cast || !mp.param_dtype) return input;
  return input.to(*mp.param_dtype);
}

at::Tensor UnitForward::CastOutput(const at::Tensor& output) const {
  const std::optional<at::ScalarType>& dtype = unit_->options_.mixed_precision.output_dtype;
  if (!dtype || !output.defined() || !output.is_floating_point()) return output;
  return output.to(*dtype);
}

at::Tensor UnitForward::Return(at::Tensor output) {
  if (unit_ != nullptr) {
    // Cast first: the pre-backward hooks go on what the caller receives.
    output = CastOutput(output);
    unit_->model_->PostForward(*unit_, {output});
  }
  returned_ = true;
  return output;
}

std::vector<at::Tensor> UnitForward::Return(std::vector<at::Tensor> outputs) {
  if (unit_ != nullptr) {
    for (at::Tensor& output : outputs) output = CastOutput(output);
    unit_->model_->PostForward(*unit_, outputs);
  }
  returned_ = true;
  return outputs;
}

}  // namespace fsdp
