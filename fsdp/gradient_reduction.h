// GradientReduction: one unit's gradient reduction, from the parameters'
// full gradients to this rank's accumulated sharded gradient, in one place
// (FSDP2's foreach_reduce): copy-in into the trainable segment's flat
// layout, cast to the reduction dtype, the reduction itself (the comm hook,
// DefaultCommHook unless a user registered one; under hybrid sharding or
// with a sum_scatter (reduce_quantization) the built-in shard-group sum, the
// replicate group's all-reduce (or its replicate_sum) and the partial-sum
// carry of SetRequiresAllReduce(false)), the cast to the
// gradient dtype and the accumulation into the sharded gradient, on the
// compute device even when that gradient lives on the host.
//
// The handle (flat_param_handle.h) owns one and decides when each step runs
// and when .grad shows the result; this class never touches a parameter's
// data, only its .grad. Internal: not installed, not a public target.
//
// Thread safety: none; the runtime drives it from one thread.
#ifndef FSDP_FSDP_GRADIENT_REDUCTION_H_
#define FSDP_FSDP_GRADIENT_REDUCTION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ATen/core/Tensor.h"
#include "c10/core/Device.h"
#include "comm/collectives.h"
#include "fsdp/comm_hooks.h"
#include "fsdp/flat_layout.h"

namespace fsdp {

// One original parameter of a unit.
struct FlatParamEntry {
  std::string fqn;   // Name in the unwrapped model, e.g. "h.0.attn.c_attn.weight".
  at::Tensor param;  // The module's parameter (a leaf; frozen or trainable).
};

// Where a unit computes, and whether it keeps its shard and sharded gradient
// on the host instead (CPU offload, NOTE in flat_param_handle.h).
struct UnitPlacement {
  c10::Device compute_device = c10::Device(c10::DeviceType::CPU);
  bool offload = false;

  // `host` (the shard or sharded gradient) on the compute device in
  // `dtype`: itself when it is there already, else a copy issued on the
  // current stream.
  at::Tensor OnComputeDevice(const at::Tensor& host, at::ScalarType dtype) const;
  // A 1-D tensor in host memory (pinned for a CUDA compute device), for
  // what offloading keeps there.
  at::Tensor EmptyOnHost(int64_t numel, at::ScalarType dtype) const;
};

// On a device with streams the caching allocator hands memory back to the
// stream it was allocated on as soon as it is freed; memory that another
// stream used must not be reused before that stream's work so far is done.
// Records `t`'s use by the current stream (PyTorch's record_stream); a no-op
// on CPU, where work is synchronous.
void RecordUseOnCurrentStream(const at::Tensor& t);

struct GradientReductionOptions {
  // Hybrid sharding's replicate group (null otherwise): see the top.
  Collectives* replicate = nullptr;
  at::ScalarType reduce_dtype = at::kFloat;  // The reduction runs in it.
  at::ScalarType grad_dtype = at::kFloat;    // The sharded gradient's.
  std::optional<double> divide_factor;       // FsdpOptions::gradient_divide_factor.
  // Issues the shard group's sum of a sharded unit's flat gradient into
  // this rank's chunk `out` in place of the group's reduce-scatter: the
  // unit's reduce_quantization (QuantizedReduceScatter in
  // quantized_gather.h). Null: the reduce-scatter (or a comm hook). A comm
  // hook cannot be combined with it.
  std::function<std::unique_ptr<CollectiveWork>(const at::Tensor& flat_grad, const at::Tensor& out)>
      sum_scatter;
  // Issues the replicate group's sum of this rank's reduced chunk, in
  // place, instead of its all-reduce: the unit's reduce_quantization under
  // hybrid sharding (QuantizedAllReduce in quantized_gather.h), a reduction
  // in two stages. Null: the all-reduce.
  std::function<std::unique_ptr<PendingReduction>(const at::Tensor& chunk)> replicate_sum;
};

class GradientReduction {
 public:
  // `who` names the unit and rank in errors; `layout` and `group` must
  // outlive this.
  GradientReduction(std::string unit_name, std::string who, const FlatLayout& layout,
                    Collectives& group, UnitPlacement placement,
                    const GradientReductionOptions& options);
  GradientReduction(const GradientReduction&) = delete;
  GradientReduction& operator=(const GradientReduction&) = delete;
  ~GradientReduction();

  // Before a backward: moves what the user left in .grad (the accumulated
  // gradient, zeroed, cleared or replaced) into the sharded gradient and
  // clears .grad, so that autograd accumulates fresh full-shape gradients.
  void SetAsideAccumulated(const std::vector<FlatParamEntry>& params);

  // Copies the trainable parameters' full gradients (missing ones count as
  // zero) into a flat buffer in the reduction dtype, clears .grad and
  // issues the reduction. `all_reduce` false (hybrid only): the replicate
  // all-reduce is left out and Finish keeps the shard group's sum aside;
  // the next reduction that all-reduces adds it before its all-reduce, so
  // the sum crosses the replicate group once (FSDP2's partial reduce
  // output). REQUIRES: trainable parameters, nothing pending.
  void Start(const std::vector<FlatParamEntry>& params, bool all_reduce);
  // PendingReduction::Advance of the reduction in flight; no-op without one.
  // The runtime calls it when it issues the next unit's reduction and
  // again at the one after: a comm hook's reduction is advanced the first
  // time only (its contract), the runtime's own reduction at each call (a
  // replicate_sum's second stage issues at the second).
  void Advance();
  // Waits for the reduction and adds the result into the sharded gradient
  // (or, partial, into the carried sum). Returns whether .grad must be
  // pointed at the sharded gradient again (Start cleared it). Throws the
  // reduction's error, leaving none pending. No-op (false) without one.
  bool Finish();

  bool pending() const { return pending_ != nullptr; }
  // A shard group's sum waiting for the next all-reducing reduction.
  bool has_partial() const { return partial_.defined(); }

  // Like the trainable segment's part of the shard (host when offloading);
  // undefined until first needed.
  const at::Tensor& sharded_grad() const { return sharded_grad_; }
  // Parameter i's part of sharded_grad(), shaped like its shard (frozen:
  // undefined). Not autograd views (made with set_): libtorch's
  // Optimizer::zero_grad() detaches gradients in place, which views forbid.
  const std::vector<at::Tensor>& grad_aliases() const { return grad_aliases_; }

  void SetCommHook(CommHook* hook) { hook_ = hook; }
  void SetDivideFactor(std::optional<double> factor);
  std::optional<double> divide_factor() const { return options_.divide_factor; }

 private:
  // Allocates sharded_grad_ (zeroed, or adopting `initial`) and its aliases.
  void AllocateShardedGrad(at::Tensor initial);
  // Issues `flat_grad`'s reduction into `reduced`: the hook's, or hybrid's.
  std::unique_ptr<PendingReduction> Issue(at::Tensor flat_grad, const at::Tensor& reduced,
                                          bool all_reduce);
  bool hybrid() const;

  const std::string unit_name_;
  const std::string who_;
  const FlatLayout& layout_;
  Collectives& group_;
  const UnitPlacement placement_;
  GradientReductionOptions options_;
  CommHook* hook_ = nullptr;
  at::Tensor sharded_grad_;
  std::vector<at::Tensor> grad_aliases_;
  // The reduction in flight and where it leaves this rank's reduced part
  // of the flat gradient.
  std::unique_ptr<PendingReduction> pending_;
  at::Tensor reduced_;
  bool pending_is_partial_ = false;  // The pending reduction leaves out the all-reduce.
  bool pending_is_hooks_ = false;    // A comm hook's (DefaultCommHook's too).
  int pending_advances_ = 0;
  at::Tensor partial_;               // has_partial(); reduction dtype, compute device.
};

}  // namespace fsdp

#endif  // FSDP_FSDP_GRADIENT_REDUCTION_H_
