// Activation checkpointing for libtorch modules (PyTorch's torch.utils.
// checkpoint and checkpoint_wrapper / apply_activation_checkpointing): a
// checkpointed region runs its forward without keeping the intermediate
// activations autograd would save, keeps only its inputs, and in backward
// runs the forward again (with the random-number state of the first run) to
// get them back. It trades about one more forward per step for the memory
// of every activation inside the region.
//
// A module type that may be checkpointed derives from
// fsdp::CheckpointableModule and runs its math through CheckpointedForward;
// ApplyActivationCheckpointing selects, by a wrap policy, which modules of a
// model checkpoint ("every Block"). With FSDP, the region goes inside the
// unit's scope, so the unit's parameters are unsharded around both the
// forward and the recompute:
//
//   struct BlockImpl : torch::nn::Module, fsdp::ShardableModule,
//                      fsdp::CheckpointableModule {
//     at::Tensor forward(at::Tensor x) {
//       fsdp::UnitForward unit(this);
//       return unit.Return(fsdp::CheckpointedForward(*this, unit.Input(x),
//           [this](const at::Tensor& x) { ...the block's math... }));
//     }
//   };
//   absl::StatusOr<std::vector<std::string>> checkpointed =  // FQNs selected
//       fsdp::ApplyActivationCheckpointing(*model, *fsdp::ModuleTypePolicy::Of<BlockImpl>());
//
// Stock libtorch modules get a region through fsdp::UnitModule
// (fsdp/unit_module.h), which is a CheckpointableModule. Checkpoint() is the
// same region for code without a module.
//
// How backward works. The region is one autograd node whose inputs are the
// region's tensor inputs and the module's parameters. Its backward runs the
// body again with gradients enabled on detached copies of the inputs and
// takes the gradients of the inputs and of the parameters from that graph
// (torch::autograd::grad); autograd then delivers the parameters' gradients
// to their accumulators like any other node's. So gradients reach
// parameters through the outer backward (torch::autograd::grad over the
// whole model sees them, and FSDP's hooks on the accumulators fire as
// without checkpointing), inputs that do not require grad are fine (the
// parameters keep the node in the graph), outputs may be used any number of
// times, and a region entered with gradients disabled just runs its body.
// Under FSDP the unit's pre-backward hook, on the unit's outputs, runs
// before the node's backward: the recompute finds the parameters unsharded
// (with mixed precision, in param_dtype, as in forward), the gradients
// reach the accumulators after it, and the unit reshards after those; the
// collectives of a step are the same as without checkpointing.
//
// Results equal those without checkpointing bit for bit where the body is
// deterministic: the recompute runs the same kernels on the same values.
//
// Limits (each checked where it can be, named in the error):
//  - The body must use as parameters only the module's own (for
//    CheckpointedForward) or the listed ones (Checkpoint): a gradient to any
//    other leaf tensor would be lost, so backward refuses it by name. Tensors
//    captured from outside (a tied weight of another module) must be passed
//    as inputs or listed.
//  - The body is kept (copied) and called again in backward: whatever it
//    captures must live until then. Capture the module (`this`), not
//    locals of the forward by reference.
//  - The body runs twice. Side effects repeat: a BatchNorm's running
//    statistics are updated twice per step, a counter counts twice, a cache
//    written in forward is written again. Keep such modules out of the
//    region (or accept the double update, as PyTorch does).
//  - Inputs and outputs are defined tensors (refused otherwise).
//  - Random numbers: the default CPU generator's state, and that of the
//    default CUDA generator of every device an input is on, are restored for
//    the recompute and put back after it. Draws from other generators repeat
//    only if options.generators lists them. Thread ranks share the default
//    generators, and each rank's capture and restore move them under the
//    others: with thread ranks, a body must draw only from generators of
//    its own rank, listed in options.generators (process ranks may use the
//    defaults).
//  - The recompute runs without autograd in its forward and with it in
//    backward; a kernel that picks its algorithm (and so its random draws)
//    by whether inputs require grad would draw other numbers. None of the
//    kernels tested does: the CPU ones, and scaled_dot_product_attention
//    with dropout on an H200 (torch 2.11; other GPUs may pick other kernels).
//  - Autocast (at::autocast) is restored for the recompute, without its cast
//    cache; other thread-local modes (inference mode, dispatch keys) are not.
//  - On libtorch 2.x, hooks registered on a parameter tensor (not on its
//    gradient accumulator, where FSDP's are) run twice per backward: once
//    when the recompute's gradients are taken, once when they are delivered.
//  - A region must not contain the forward of an FSDP unit: the unit would
//    be gathered again in backward outside FSDP's hooks. Checkpoint the unit
//    itself (the region inside its scope) or modules inside one unit. A
//    region inside a region runs its body directly (the outer recompute
//    already covers it).
//  - Inputs are saved with autograd's version check: modifying one in place
//    after the forward is an error in backward, as for any saved tensor.
//  - No second-order gradients: a backward with create_graph through a
//    region is refused.
//
// Thread safety: a region's forward runs on the calling thread, its
// recompute on the thread autograd runs the backward on; whether a thread
// is inside a region is per thread. The selection set by
// ApplyActivationCheckpointing must not change while the model runs.
#ifndef FSDP_FSDP_ACTIVATION_CHECKPOINTING_H_
#define FSDP_FSDP_ACTIVATION_CHECKPOINTING_H_

#include <functional>
#include <string>
#include <vector>

#include "ATen/core/Generator.h"
#include "ATen/core/Tensor.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "policies/wrap_policy.h"
#include "torch/nn/module.h"

namespace fsdp {

struct CheckpointOptions {
  // Restore the random-number state for the recompute (PyTorch's
  // preserve_rng_state). Off only for bodies that draw no random numbers,
  // to save the state copies.
  bool preserve_rng_state = true;
  // Further generators whose state is saved and restored like the default
  // ones' (a per-rank generator a dropout module draws from).
  std::vector<at::Generator> generators;
};

using CheckpointBody = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// A module whose forward runs its math through CheckpointedForward.
// Checkpointing is off until ApplyActivationCheckpointing selects the
// module.
class CheckpointableModule {
 public:
  virtual ~CheckpointableModule() = default;
  bool activation_checkpointing() const { return checkpointing_; }
  const CheckpointOptions& checkpoint_options() const { return options_; }

 private:
  friend absl::StatusOr<std::vector<std::string>> ApplyActivationCheckpointing(
      torch::nn::Module&, const WrapPolicy&, const CheckpointOptions&);
  friend absl::Status RemoveActivationCheckpointing(torch::nn::Module&);
  friend std::vector<at::Tensor> CheckpointedForward(const CheckpointableModule&,
                                                     const std::vector<at::Tensor>&,
                                                     const CheckpointBody&);
  bool checkpointing_ = false;
  CheckpointOptions options_;
  std::string region_name_;  // The module's FQN, for errors.
};

// Runs body(inputs) as a checkpointed region whose parameters are
// `parameters` (those that require grad take part). Runs it directly when
// gradients are disabled, when nothing it depends on requires grad, or
// inside another region. `name` appears in errors.
std::vector<at::Tensor> Checkpoint(const std::string& name, const CheckpointBody& body,
                                   const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& parameters,
                                   const CheckpointOptions& options = {});

// A module's forward math: checkpointed, with the module's parameters
// (recursively), when ApplyActivationCheckpointing selected the module;
// run directly otherwise. `module` must be the torch::nn::Module that is
// the CheckpointableModule (the block's `*this`).
std::vector<at::Tensor> CheckpointedForward(const CheckpointableModule& module,
                                            const std::vector<at::Tensor>& inputs,
                                            const CheckpointBody& body);
at::Tensor CheckpointedForward(const CheckpointableModule& module, const at::Tensor& input,
                               const std::function<at::Tensor(const at::Tensor&)>& body);

// Selects for checkpointing the submodules of `root` that `policy` chooses
// (policies never choose the root itself; their per-unit options are not
// used) and returns their FQNs, which name the regions in errors. Errors,
// with nothing changed: kInvalidArgument if a chosen module is not a
// CheckpointableModule (its forward has no region to checkpoint), if a
// chosen module is inside another chosen or already checkpointed one, or
// already checkpointed itself (nested regions would recompute twice), or if
// the policy chose nothing (a misspelt type); the policy's own error.
absl::StatusOr<std::vector<std::string>> ApplyActivationCheckpointing(
    torch::nn::Module& root, const WrapPolicy& policy, const CheckpointOptions& options = {});

// Turns checkpointing off for every module of `root`.
absl::Status RemoveActivationCheckpointing(torch::nn::Module& root);

// How many checkpointed regions the autograd graph that computed `output`
// passes through (each region node once): a check that a model's
// selection took effect ("one per block"). 0 for a tensor without a graph.
int CheckpointedRegionsInGraph(const at::Tensor& output);

// Whether the calling thread runs a checkpointed region's body (its forward
// or its recompute), and that region's name ("" outside one). FSDP's unit
// scope refuses to open inside one.
bool InCheckpointedRegion();
const std::string& CheckpointedRegionName();

}  // namespace fsdp

#endif  // FSDP_FSDP_ACTIVATION_CHECKPOINTING_H_
