// Communication hooks: replace how a unit's gradients are reduced
// (PyTorch's FullyShardedDataParallel.register_comm_hook).
//
//   auto hook = std::make_shared<fsdp::LowPrecisionCommHook>(fsdp::DType::kBFloat16);
//   FSDP_RETURN_IF_ERROR(fsdp_model->RegisterCommHook(hook));  // before the first forward
//
// A hook is an object, so its state lives in its members (PyTorch passes a
// separate state object; here the hook is the state). The runtime calls
// Reduce once per unit per reduction, from the unit's post-backward hook, on
// every rank in the same order.
#ifndef FSDP_FSDP_COMM_HOOKS_H_
#define FSDP_FSDP_COMM_HOOKS_H_

#include <string>

#include "ATen/core/Tensor.h"
#include "comm/collectives.h"
#include "policies/unit_options.h"

namespace fsdp {

struct CommHookContext {
  Collectives& group;   // The unit's group: W ranks.
  bool sharded;         // False for NO_SHARD.
  const std::string& unit;  // The unit's name ("<root>" for the root).
  // Hybrid sharding's replicate group (R ranks), whose ranks hold the same
  // shard and average it among themselves; null otherwise. Only the
  // built-in reduction (DefaultCommHook) runs under hybrid sharding:
  // RegisterCommHook refuses user hooks there, as PyTorch does.
  Collectives* replicate_group = nullptr;
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  virtual std::string Name() const = 0;
  // `grad` is this rank's full flat gradient of the unit's trainable
  // parameters (its trainable segment, NOTE [Flat parameter] in
  // flat_param_handle.h: padded to W chunks, in the unit's reduction
  // dtype); the hook may modify it. It must
  // leave in `out` the average over the group's ranks (times the replicate
  // group's): for a sharded unit `out` is this rank's chunk (grad.numel() /
  // W elements), for NO_SHARD it is `grad` itself (reduce in place). `out`
  // has grad's dtype.
  virtual void Reduce(const CommHookContext& context, at::Tensor& grad, at::Tensor& out) = 0;
};

// FSDP's built-in reduction, what every unit uses unless a hook is
// registered: reduce-scatter (all-reduce for NO_SHARD), then under hybrid
// sharding an all-reduce of the result over the replicate group, with
// PyTorch's pre- and post-division (by the number of ranks averaged over)
// to keep sums in range.
class DefaultCommHook : public CommHook {
 public:
  std::string Name() const override { return "default"; }
  void Reduce(const CommHookContext& context, at::Tensor& grad, at::Tensor& out) override;
};

// PyTorch's fp16_compress_hook / bf16_compress_hook: communicates the
// gradient in `dtype` (half the bytes of float32) and writes the result back
// in the gradient's own dtype.
class LowPrecisionCommHook : public CommHook {
 public:
  explicit LowPrecisionCommHook(DType dtype) : dtype_(dtype) {}
  std::string Name() const override;
  void Reduce(const CommHookContext& context, at::Tensor& grad, at::Tensor& out) override;

 private:
  DType dtype_;
};

// PyTorch's split of the 1/W gradient scaling: divide by this power of two
// (near sqrt(W)) before the sum and by W / it after, so that neither the
// summands nor the sum of a low-precision gradient leave the representable
// range.
double GradientPredivideFactor(int world_size);

}  // namespace fsdp

#endif  // FSDP_FSDP_COMM_HOOKS_H_
