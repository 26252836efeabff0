#include "fsdp/unit_module.h"

#include "c10/util/Exception.h"

namespace fsdp {
namespace {

// The held module's answers on default arguments. Module declares the three
// functions protected, for AnyModule (which a macro makes their friend); a
// class derived from Module may name them, and a pointer to member formed
// here calls the held module's overrides.
struct DefaultArguments : torch::nn::Module {
  static bool Has(torch::nn::Module& m) {
    return (m.*(&DefaultArguments::_forward_has_default_args))();
  }
  static unsigned int Required(torch::nn::Module& m) {
    return (m.*(&DefaultArguments::_forward_num_required_args))();
  }
  static std::vector<torch::nn::AnyValue> Populate(torch::nn::Module& m,
                                                   std::vector<torch::nn::AnyValue>&& arguments) {
    return (m.*(&DefaultArguments::_forward_populate_default_args))(std::move(arguments));
  }
};

}  // namespace

UnitModuleImpl::UnitModuleImpl(std::shared_ptr<torch::nn::Module> inner)
    : torch::nn::Module("fsdp::UnitModule"), inner_(std::move(inner)) {
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

void UnitModuleImpl::train(bool on) {
  torch::nn::Module::train(on);
  inner_->train(on);
}

void UnitModuleImpl::pretty_print(std::ostream& stream) const {
  stream << "fsdp::UnitModule(";
  inner_->pretty_print(stream);
  stream << ")";
}

bool UnitModuleImpl::_forward_has_default_args() { return DefaultArguments::Has(*inner_); }

unsigned int UnitModuleImpl::_forward_num_required_args() {
  return DefaultArguments::Required(*inner_);
}

std::vector<torch::nn::AnyValue> UnitModuleImpl::_forward_populate_default_args(
    std::vector<torch::nn::AnyValue>&& arguments) {
  return DefaultArguments::Populate(*inner_, std::move(arguments));
}

}  // namespace fsdp
