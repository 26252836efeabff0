#include "fsdp/unit_module.h"

#include "c10/util/Exception.h"
#include "fsdp/activation_checkpointing.h"
#include "fsdp/fully_shard.h"
#include "fsdp/unit_forward.h"

namespace fsdp {

UnitModuleImpl::UnitModuleImpl(std::shared_ptr<torch::nn::Module> inner,
                               std::function<at::Tensor(const at::Tensor&)> forward)
    : torch::nn::Module("fsdp::UnitModule"), inner_(std::move(inner)), forward_(std::move(forward)) {
  TORCH_CHECK(inner_ != nullptr, "fsdp::UnitModule: the module to hold is null");
  // The held module's own tensors and submodules, under their own names,
  // so that FQNs are those of the unwrapped model.
  for (const auto& item : inner_->named_parameters(/*recurse=*/false)) {
    register_parameter(item.key(), item.value(), item.value().requires_grad());
  }
  for (const auto& item : inner_->named_buffers(/*recurse=*/false)) {
    register_buffer(item.key(), item.value());
  }
  for (const auto& item : inner_->named_children()) register_module(item.key(), item.value());
  train(inner_->is_training());
}

at::Tensor UnitModuleImpl::forward(const at::Tensor& input) {
  UnitForward unit(this);
  return unit.Return(CheckpointedForward(*this, unit.Input(input), forward_));
}

void UnitModuleImpl::train(bool on) {
  torch::nn::Module::train(on);
  inner_->train(on);
}

void UnitModuleImpl::pretty_print(std::ostream& stream) const {
  stream << "fsdp::UnitModule(";
  inner_->pretty_print(stream);
  stream << ")";
}

}  // namespace fsdp
