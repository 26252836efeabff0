// The scope a unit's forward runs in: how FSDP gets control of a C++
// module's forward, which has no hooks (fsdp/RUNTIME_DESIGN.md, "Forward").
// A module type that may become a unit derives from fsdp::ShardableModule
// (fsdp/wrap_plan.h) and opens a scope in its forward:
//
//   at::Tensor forward(at::Tensor x) {
//     fsdp::UnitForward unit(this);  // unshards this unit, if it is one
//     x = unit.Input(x);             // mixed precision's input cast
//     ...the block's math, unchanged...
//     return unit.Return(x);         // reshards, arms the backward hooks
//   }
//
// Stock libtorch modules get it through fsdp::UnitModule
// (fsdp/unit_module.h).
#ifndef FSDP_FSDP_UNIT_FORWARD_H_
#define FSDP_FSDP_UNIT_FORWARD_H_

#include <vector>

#include "ATen/core/Tensor.h"
#include "fsdp/wrap_plan.h"  // ShardableModule.
#include "torch/nn/module.h"

namespace fsdp {

class FsdpUnit;

// Opens a unit's forward (see the example at the top). A module that is not
// a wrapped unit gets a scope that does nothing, so a block type can be used
// with and without FSDP.
class UnitForward {
 public:
  explicit UnitForward(const torch::nn::Module* module);
  UnitForward(const UnitForward&) = delete;
  UnitForward& operator=(const UnitForward&) = delete;
  // Reshards if Return was never reached (an exception in forward).
  ~UnitForward();

  // A forward input, cast to the unit's param_dtype when its mixed
  // precision says so (cast_forward_inputs; cast_root_forward_inputs for the
  // root) and it is floating point; otherwise returned as is.
  at::Tensor Input(const at::Tensor& input) const;

  // Ends the forward: reshards by strategy and arms the pre-backward hook
  // on every output that requires grad. Returns its argument, each
  // floating-point tensor cast to the unit's output_dtype when its mixed
  // precision has one.
  at::Tensor Return(at::Tensor output);
  std::vector<at::Tensor> Return(std::vector<at::Tensor> outputs);

 private:
  // Marks when the gradient of a unit's input is computed (unit_forward.cc).
  struct InputGradientHook;

  void Abandon();  // Reshards and idles the unit after an exception.
  at::Tensor CastOutput(const at::Tensor& output) const;

  FsdpUnit* unit_;
  bool returned_ = false;
};

}  // namespace fsdp

#endif  // FSDP_FSDP_UNIT_FORWARD_H_
