#include "fsdp/unit_forward.h"

#include <cstdint>

#include "c10/core/GradMode.h"
#include "fsdp/activation_checkpointing.h"
#include "fsdp/flat_param_handle.h"
#include "fsdp/fully_shard.h"
#include "fsdp/unit_scheduler.h"
#include "torch/csrc/autograd/custom_function.h"

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

// Identity in forward; its backward runs once the gradient of the unit's
// input is complete (NOTE [Frozen parameters in backward] in
// fully_shard.cc).
struct UnitForward::InputGradientHook : torch::autograd::Function<InputGradientHook> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            FsdpUnit* unit) {
    ctx->saved_data["unit"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(unit));
    return input.view_as(input);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* unit = reinterpret_cast<FsdpUnit*>(
        static_cast<intptr_t>(ctx->saved_data["unit"].toInt()));
    unit->model_->InputGradientDone(*unit);
    return {grads[0], torch::autograd::Variable()};
  }
};

at::Tensor UnitForward::Input(const at::Tensor& input) const {
  if (unit_ == nullptr || !input.defined() || !input.is_floating_point()) return input;
  at::Tensor in = input;
  if (unit_->holds_frozen_params_ && in.requires_grad() && c10::GradMode::is_enabled()) {
    ++unit_->input_gradients_pending_;
    in = InputGradientHook::apply(in, unit_);
  }
  const MixedPrecision& mp = unit_->options_.mixed_precision;
  const bool cast = unit_->is_root_ ? mp.cast_root_forward_inputs : mp.cast_forward_inputs;
  if (!cast || !mp.param_dtype) return in;
  return in.to(*mp.param_dtype);
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
