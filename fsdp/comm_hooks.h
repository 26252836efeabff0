// Communication hooks: replace how a unit's gradients are reduced
// (PyTorch's FullyShardedDataParallel.register_comm_hook).
//
//   auto hook = std::make_shared<fsdp::LowPrecisionCommHook>(at::kBFloat16);
//   FSDP_RETURN_IF_ERROR(fsdp_model->RegisterCommHook(hook));  // before the first forward
//
// A hook is an object, so its state lives in its members (PyTorch passes a
// separate state object; here the hook is the state). The runtime calls
// Reduce once per unit per reduction, on every rank in the same order: from
// the unit's post-backward hook, or at the end of backward for a unit some
// of whose parameters got no gradient. Reduce issues the reduction and returns it in flight (a
// PendingReduction); the runtime goes on with backward and waits for it
// later, so that communication overlaps the backward of the units before
// it:
//   * when it issues the next unit's reduction, it calls Advance() on the
//     one before (once per reduction): a reduction waits there for the
//     collectives that read the flat gradient and issues the rest (a
//     second stage, as hybrid sharding's replicate all-reduce), so that
//     reductions in flight hold
//     at most one unit's flat gradient besides the one being issued
//     (FSDP2 bounds its reduce-scatter inputs the same way; NO_SHARD,
//     whose all-reduce is in place, holds them until the end);
//   * at the end of backward it calls Wait() on each, in issue order.
// A synchronous hook reduces inside Reduce and returns CompletedReduction().
#ifndef FSDP_FSDP_COMM_HOOKS_H_
#define FSDP_FSDP_COMM_HOOKS_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "ATen/core/Tensor.h"
#include "comm/collectives.h"
#include "policies/unit_options.h"

namespace fsdp {

// What a hook is told about the unit whose gradient it reduces. Hybrid
// sharding's replicate group and its partial sums are not here: hooks never
// run under hybrid sharding (RegisterCommHook refuses them, as PyTorch
// does), whose reduction is the runtime's own (fsdp/gradient_reduction.h).
struct CommHookContext {
  Collectives& group;   // The unit's group: W ranks.
  bool sharded;         // False for NO_SHARD.
  const std::string& unit;  // The unit's name ("<root>" for the root).
  // FsdpOptions::gradient_divide_factor: divide the sum by this instead of
  // by the number of ranks (the built-in reduction divides before the sum).
  std::optional<double> divide_factor;
};

// A reduction in flight. Destroying one that was not waited for waits for
// its collectives (errors are then dropped), so the tensors they use are
// never freed while a transfer still uses them.
class PendingReduction {
 public:
  PendingReduction() = default;
  PendingReduction(const PendingReduction&) = delete;
  PendingReduction& operator=(const PendingReduction&) = delete;
  virtual ~PendingReduction() = default;

  // See the top of this file. The default does nothing. The runtime labels
  // what this issues with the reduction's own unit.
  virtual void Advance() {}
  // Returns once `out` of the Reduce call holds the result; throws
  // c10::Error if a collective failed. Called once, after which the
  // reduction holds no tensors.
  virtual void Wait() = 0;
};

// For a hook that finished inside Reduce.
std::unique_ptr<PendingReduction> CompletedReduction();

// `first`, then `then` on the waiting thread once `first` completed: how a
// hook that post-processes another's result (a cast back, an error
// feedback update) stays asynchronous. Advance() advances `first`.
std::unique_ptr<PendingReduction> ReductionThen(std::unique_ptr<PendingReduction> first,
                                                std::function<void()> then);

class CommHook {
 public:
  virtual ~CommHook() = default;
  virtual std::string Name() const = 0;
  // `grad` is this rank's full flat gradient of the unit's trainable
  // parameters (its trainable segment, NOTE [Flat parameter] in
  // flat_param_handle.h: padded to W chunks, in the unit's reduction
  // dtype); the hook may modify it. It must
  // leave in `out` the average over the group's ranks, or the sum divided
  // by context.divide_factor when that is set:
  // for a sharded unit `out` is this rank's chunk (grad.numel() / W
  // elements), for NO_SHARD it is `grad` itself (reduce in place). `out`
  // has grad's dtype. The reduction in flight keeps whatever tensors it
  // still needs (`grad` at least until Advance()).
  virtual std::unique_ptr<PendingReduction> Reduce(const CommHookContext& context, at::Tensor grad,
                                                   at::Tensor out) = 0;
};

// FSDP's built-in reduction, what every unit uses unless a hook is
// registered: reduce-scatter (all-reduce for NO_SHARD) with PyTorch's pre-
// and post-division (GradientDivisorsFor) to keep sums in range.
// Advance() waits for the collective; Wait() waits and post-divides.
class DefaultCommHook : public CommHook {
 public:
  std::string Name() const override { return "default"; }
  std::unique_ptr<PendingReduction> Reduce(const CommHookContext& context, at::Tensor grad,
                                           at::Tensor out) override;
};

// PyTorch's fp16_compress_hook / bf16_compress_hook: communicates the
// gradient in `dtype` (half the bytes of float32) and writes the result back
// in the gradient's own dtype. `dtype` must be a floating-point type
// (at::kBFloat16, at::kHalf); the constructor throws otherwise.
class LowPrecisionCommHook : public CommHook {
 public:
  explicit LowPrecisionCommHook(at::ScalarType dtype);
  std::string Name() const override;
  std::unique_ptr<PendingReduction> Reduce(const CommHookContext& context, at::Tensor grad,
                                           at::Tensor out) override;

 private:
  at::ScalarType dtype_;
};

// PyTorch's split of the 1/W gradient scaling: divide by this power of two
// (near sqrt(W)) before the sum and by W / it after, so that neither the
// summands nor the sum of a low-precision gradient leave the representable
// range.
double GradientPredivideFactor(int world_size);

// What the built-in reductions divide by before and after the sum of
// `world_size` ranks' gradients: GradientPredivideFactor and the rest, or
// with a divide factor all of it before (as FSDP2 does).
struct GradientDivisors {
  double pre = 1;
  double post = 1;
};
GradientDivisors GradientDivisorsFor(int world_size, std::optional<double> divide_factor);

}  // namespace fsdp

#endif  // FSDP_FSDP_COMM_HOOKS_H_
