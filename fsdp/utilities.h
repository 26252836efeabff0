// What a training loop uses between steps, each taking the model it acts
// on: NoSync (accumulate gradients without communication), SummonFullParams
// (full parameters, and gradients, for a scope), ClipGradNorm, Apply (a
// function on every module, for initialization after wrapping) and
// UniqueParameters (what to build an optimizer over). The functions return
// an absl::Status; the scopes throw c10::Error in the wrong state, since a
// constructor cannot return a status (fsdp/fully_shard.h, "Errors").
#ifndef FSDP_FSDP_UTILITIES_H_
#define FSDP_FSDP_UTILITIES_H_

#include <functional>
#include <vector>

#include "ATen/core/Tensor.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp/fully_shard.h"
#include "torch/nn/module.h"

namespace fsdp {

// While alive, backward passes of `model` accumulate full gradients locally
// without communicating; the first backward after it reduces their sum.
// Costs unsharded gradient memory for every unit. REQUIRES: the model IDLE.
class NoSync {
 public:
  explicit NoSync(FullyShardedModel& model);
  NoSync(const NoSync&) = delete;
  NoSync& operator=(const NoSync&) = delete;
  ~NoSync();

 private:
  FullyShardedModel& model_;
  bool previous_;
};

struct SummonOptions {
  // Copy in-place changes of the full parameters (and, with with_grads, of
  // the full gradients) back into the shards at the end.
  bool writeback = true;
  // Only rank 0 keeps the full parameters; the others see their shards.
  // Not with writeback (the other ranks' shards would not see rank 0's
  // changes).
  bool rank0_only = false;
  // Also all-gather the gradients into .grad (full shape).
  bool with_grads = false;
  // All units (true) or only the root's own parameters (false); with a
  // unit's module, that unit and the units inside it, or that unit alone.
  bool recurse = true;
};

// While alive, the model's parameters are full (unsharded), as in PyTorch's
// summon_full_params; the destructor writes back (if asked) and reshards.
// Every rank of the group must enter and leave it. REQUIRES: the model
// IDLE. Forward and backward inside it are errors (the units' state is
// SUMMON_FULL_PARAMS).
class SummonFullParams {
 public:
  explicit SummonFullParams(FullyShardedModel& model, const SummonOptions& options = {});
  // PyTorch's summon_full_params(module): the unit that wraps `unit_module`
  // and, with recurse, the units inside it (FULL state dicts gather one unit
  // at a time this way). Throws c10::Error if no unit wraps it.
  explicit SummonFullParams(FullyShardedModel& model, const torch::nn::Module& unit_module,
                            const SummonOptions& options = {});
  SummonFullParams(const SummonFullParams&) = delete;
  SummonFullParams& operator=(const SummonFullParams&) = delete;
  ~SummonFullParams();

 private:
  // Writes back (if asked) and returns every entered unit to IDLE,
  // resharded.
  void Leave();

  FullyShardedModel& model_;
  std::vector<FlatParamHandle*> handles_;
  SummonOptions options_;
  int rank_;
};

// Scales every gradient of `model` so that their joint norm (of the
// unsharded gradients, `norm_type` >= 1 or infinity) is at most `max_norm`,
// as torch::nn::utils::clip_grad_norm_ does on the unwrapped model, and
// returns that norm before clipping; every rank of the group must call it.
// kFailedPrecondition unless IDLE with gradients reduced (not inside NoSync
// or with requires_gradient_sync false, nor with a sum that
// requires_all_reduce false keeps aside); kInvalidArgument for a bad norm_type or max_norm.
absl::StatusOr<at::Tensor> ClipGradNorm(FullyShardedModel& model, double max_norm,
                                        double norm_type = 2.0);

// Calls `fn` on every module of `model` (children before parents, root
// last, as torch::nn::Module::apply) with the full parameters in place and
// writes in-place changes back to the shards: for initialization after
// wrapping (PyTorch FSDP's apply). Every rank must call it with the same
// `fn`. kFailedPrecondition unless IDLE; an exception `fn` throws comes
// back as the status.
absl::Status Apply(FullyShardedModel& model, const std::function<void(torch::nn::Module&)>& fn);

// The module's parameters, each tied tensor once (libtorch's
// Module::parameters() lists a tensor under every name it has; PyTorch's
// dedups). Build optimizers over these: an optimizer given a tensor twice
// steps it twice.
std::vector<at::Tensor> UniqueParameters(const torch::nn::Module& module);

}  // namespace fsdp

#endif  // FSDP_FSDP_UTILITIES_H_
