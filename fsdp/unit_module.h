// Stock libtorch modules as FSDP units, with no edits to them: UnitModule
// holds any module whose forward maps one tensor to one tensor (Linear,
// TransformerEncoderLayer, a Sequential of such) and opens the unit's
// UnitForward scope around that forward. It is also a
// CheckpointableModule (fsdp/activation_checkpointing.h): selected by
// ApplyActivationCheckpointing, the held module's forward is recomputed in
// backward, inside the unit's scope.
//
//   fsdp::UnitModule model(torch::nn::Sequential(
//       fsdp::UnitModule(torch::nn::TransformerEncoderLayer(options)),
//       fsdp::UnitModule(torch::nn::TransformerEncoderLayer(options)),
//       torch::nn::Linear(d_model, d_model)));
//   auto wrapped = fsdp::FullyShardedModel::Wrap(model.ptr(), group, {},
//                                                fsdp::SelectModulesOfType<fsdp::UnitModuleImpl>());
//
// The root is a UnitModule too: FSDP needs a hook on the root's forward.
// Which UnitModules become units is still the policy's choice; one the
// policy leaves out only forwards.
//
// Names are those of the held module: a UnitModule registers the held
// module's own parameters, buffers and submodules under their names, so
// state dict keys and FQNs equal the unwrapped model's ("0.linear1.weight",
// not "0.inner.linear1.weight"). Input casting follows the unit's mixed
// precision (UnitForward::Input); train()/eval() reach the held module.
//
// The held module itself is not in the module tree, where the UnitModule
// stands in for it: FsdpOptions::param_init_fn, Module::apply,
// FullyShardedModel::Apply and policies that select by type see the
// UnitModule (inner() reaches the held module), and ignored_modules must
// name the UnitModule. Tensors the held module registers after wrapping
// (reset()) are not the UnitModule's; clone() is not supported.
#ifndef FSDP_FSDP_UNIT_MODULE_H_
#define FSDP_FSDP_UNIT_MODULE_H_

#include <functional>
#include <memory>
#include <ostream>
#include <utility>

#include "ATen/core/Tensor.h"
#include "fsdp/activation_checkpointing.h"
#include "fsdp/wrap_plan.h"
#include "torch/nn/module.h"
#include "torch/nn/pimpl.h"

namespace fsdp {

class UnitModuleImpl : public torch::nn::Module,
                       public ShardableModule,
                       public CheckpointableModule {
 public:
  // `inner` is a module holder (torch::nn::Linear, ...) or a shared_ptr to
  // a module; its forward must be callable with one tensor.
  template <typename Holder>
  explicit UnitModuleImpl(Holder inner)
      : UnitModuleImpl(PtrOf(inner), [m = PtrOf(inner)](const at::Tensor& x) -> at::Tensor {
          return m->forward(x);
        }) {}

  // Opens the unit's scope (when it is a unit) around the held module's
  // forward, checkpointed when selected.
  at::Tensor forward(const at::Tensor& input);

  const std::shared_ptr<torch::nn::Module>& inner() const { return inner_; }

  // Also sets the held module's mode (its forward may read it).
  void train(bool on = true) override;
  void pretty_print(std::ostream& stream) const override;

 private:
  UnitModuleImpl(std::shared_ptr<torch::nn::Module> inner,
                 std::function<at::Tensor(const at::Tensor&)> forward);

  template <typename M>
  static std::shared_ptr<M> PtrOf(const torch::nn::ModuleHolder<M>& holder) {
    return holder.ptr();
  }
  template <typename M>
  static std::shared_ptr<M> PtrOf(const std::shared_ptr<M>& module) {
    return module;
  }

  std::shared_ptr<torch::nn::Module> inner_;
  std::function<at::Tensor(const at::Tensor&)> forward_;
};
TORCH_MODULE(UnitModule);

}  // namespace fsdp

#endif  // FSDP_FSDP_UNIT_MODULE_H_
