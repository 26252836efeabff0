#include "fsdp/gradient_reduction.h"

#include <functional>
#include <utility>

#include "ATen/ATen.h"
#include "ATen/core/grad_mode.h"
#include "c10/core/impl/VirtualGuardImpl.h"
#include "c10/util/Exception.h"

namespace fsdp {
namespace {

// The runtime's own reduction in flight: the shard group's collective, then
// under hybrid sharding the replicate group's all-reduce of this rank's
// shard (or the quantized sum that replaces it, in two stages). User hooks
// never run under hybrid sharding (RegisterCommHook refuses them, as
// PyTorch does), so this is the only reduction that crosses the replicate
// group; it also runs a sum_scatter (quantized reduce-scatter), which hooks
// cannot be combined with.
class ShardGroupReduction : public PendingReduction {
 public:
  // `replicate` null: no replicate group. `partial`: the all-reduce is left
  // out and `out` keeps the shard group's sum before the post-divide.
  // `carry`: an earlier partial sum, added to `out` before the all-reduce.
  // `replicate_sum` (GradientReductionOptions): replaces the all-reduce.
  ShardGroupReduction(
      std::unique_ptr<CollectiveWork> shard_group_work, at::Tensor grad, at::Tensor out,
      Collectives* replicate,
      const std::function<std::unique_ptr<PendingReduction>(const at::Tensor&)>& replicate_sum,
      double postdivide, bool partial, at::Tensor carry)
      : grad_(std::move(grad)),
        out_(std::move(out)),
        carry_(std::move(carry)),
        replicate_(replicate),
        replicate_sum_(replicate_sum),
        postdivide_(postdivide),
        partial_(partial),
        shard_group_work_(std::move(shard_group_work)) {}

  // The first call waits for the shard group's collective and issues the
  // replicate group's; a later one advances a replicate_sum's stages.
  void Advance() override {
    if (shard_group_work_ == nullptr) {
      if (replicate_sum_work_ != nullptr) replicate_sum_work_->Advance();
      return;
    }
    shard_group_work_->Wait();
    shard_group_work_.reset();
    grad_ = at::Tensor();  // The flat gradient is no longer read.
    if (partial_) return;
    if (carry_.defined()) {
      out_.add_(carry_);
      carry_ = at::Tensor();
    }
    // Only this rank's shard crosses shard groups.
    if (replicate_ == nullptr) return;
    if (replicate_sum_) {
      replicate_sum_work_ = replicate_sum_(out_);
    } else {
      replicate_work_ = replicate_->AllReduce(out_, ReduceOp::kSum);
    }
  }

  void Wait() override {
    Advance();
    if (replicate_work_ != nullptr) {
      replicate_work_->Wait();
      replicate_work_.reset();
    }
    if (replicate_sum_work_ != nullptr) {
      replicate_sum_work_->Wait();
      replicate_sum_work_.reset();
    }
    if (postdivide_ != 1 && !partial_) out_.div_(postdivide_);
    out_ = at::Tensor();
  }

 private:
  // Declared before the works, so that a destroyed reduction waits for
  // them before it lets go of their tensors.
  at::Tensor grad_;
  at::Tensor out_;
  at::Tensor carry_;
  Collectives* replicate_;
  std::function<std::unique_ptr<PendingReduction>(const at::Tensor&)> replicate_sum_;
  const double postdivide_;
  const bool partial_;
  std::unique_ptr<CollectiveWork> shard_group_work_;
  std::unique_ptr<CollectiveWork> replicate_work_;
  std::unique_ptr<PendingReduction> replicate_sum_work_;
};

}  // namespace

void RecordUseOnCurrentStream(const at::Tensor& t) {
  if (!t.defined() || t.device().is_cpu()) return;
  c10::impl::VirtualGuardImpl guard(t.device().type());
  guard.recordDataPtrOnStream(t.storage().data_ptr(), guard.getStream(t.device()));
}

at::Tensor UnitPlacement::OnComputeDevice(const at::Tensor& host, at::ScalarType dtype) const {
  if (!offload) return host.to(dtype);
  // A copy even when the compute device is the host: one code path.
  return host.to(compute_device, dtype, /*non_blocking=*/true, /*copy=*/true);
}

at::Tensor UnitPlacement::EmptyOnHost(int64_t numel, at::ScalarType dtype) const {
  return at::empty({numel}, at::TensorOptions().dtype(dtype).device(at::kCPU).pinned_memory(
                                compute_device.type() == c10::DeviceType::CUDA));
}

GradientReduction::GradientReduction(std::string unit_name, std::string who,
                                     const FlatLayout& layout, Collectives& group,
                                     UnitPlacement placement,
                                     const GradientReductionOptions& options)
    : unit_name_(std::move(unit_name)),
      who_(std::move(who)),
      layout_(layout),
      group_(group),
      placement_(placement),
      options_(options) {}

GradientReduction::~GradientReduction() = default;

bool GradientReduction::hybrid() const {
  return options_.replicate != nullptr && options_.replicate->world_size() > 1;
}

void GradientReduction::SetDivideFactor(std::optional<double> factor) {
  TORCH_CHECK(!factor || *factor > 0, who_, ": the gradient divide factor must be positive, got ",
              factor ? *factor : 0.0);
  options_.divide_factor = factor;
}

void GradientReduction::AllocateShardedGrad(at::Tensor initial) {
  const int64_t numel = layout_.trainable_shard_numel();
  sharded_grad_ =
      initial.defined() ? std::move(initial)
      : placement_.offload
          ? placement_.EmptyOnHost(numel, options_.grad_dtype).zero_()
          : at::zeros(
                {numel},
                at::TensorOptions().dtype(options_.grad_dtype).device(placement_.compute_device));
  grad_aliases_.clear();
  for (size_t i = 0; i < layout_.params().size(); ++i) {
    if (!layout_.params()[i].trainable) {
      grad_aliases_.emplace_back();
      continue;
    }
    const at::Tensor part = layout_.ShardViewOf(sharded_grad_, i);
    grad_aliases_.push_back(
        at::empty({0}, part.options())
            .set_(part.storage(), part.storage_offset(), part.sizes(), part.strides()));
  }
}

void GradientReduction::SetAsideAccumulated(const std::vector<FlatParamEntry>& params) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const FlatParamInfo& info = layout_.params()[i];
    if (!info.trainable) continue;
    const at::Tensor grad = params[i].param.grad();
    if (!grad.defined() && !sharded_grad_.defined()) continue;  // Nothing yet.
    if (!sharded_grad_.defined()) AllocateShardedGrad(at::Tensor());
    const at::Tensor& alias = grad_aliases_[i];
    if (!grad.defined()) {
      alias.zero_();  // Cleared by the user: accumulation restarts at zero.
    } else if (!grad.is_alias_of(alias) || grad.sizes() != alias.sizes()) {
      TORCH_CHECK(grad.numel() == alias.numel(), who_, ": the gradient of '", info.fqn, "' has ",
                  grad.numel(), " elements but this rank owns ", alias.numel(),
                  " of the parameter");
      alias.copy_(grad.reshape(alias.sizes()));  // Replaced by the user.
    }
    params[i].param.mutable_grad() = at::Tensor();
  }
}

void GradientReduction::Start(const std::vector<FlatParamEntry>& params, bool all_reduce) {
  TORCH_CHECK(layout_.has_trainable_params(), who_,
              ": ReduceGradients on a unit without trainable parameters");
  TORCH_CHECK(!pending(), who_, ": ReduceGradients while the previous reduction is pending");
  // Refused before the gradients are taken from the parameters, so that
  // they survive the error.
  TORCH_CHECK(hook_ == nullptr || !hybrid(), who_, ": the comm hook '", hook_->Name(),
              "' cannot reduce under hybrid sharding (as in PyTorch)");
  TORCH_CHECK(hook_ == nullptr || !options_.sum_scatter, who_, ": the comm hook '", hook_->Name(),
              "' cannot reduce a unit with reduce_quantization: the hook replaces the reduction "
              "that option quantizes");
  at::NoGradGuard no_grad;
  // Copying the gradients in casts them to the reduction's dtype. Only the
  // trainable segment is reduced: it starts the flat parameter.
  const FlatLayout::Segment& trainable = layout_.segments().front();
  at::Tensor flat_grad =
      at::zeros({trainable.padded_numel},
                at::TensorOptions().dtype(options_.reduce_dtype).device(placement_.compute_device));
  for (size_t i = 0; i < params.size(); ++i) {
    const FlatParamInfo& info = layout_.params()[i];
    if (!info.trainable) continue;
    const at::Tensor grad = params[i].param.grad();
    if (!grad.defined()) continue;  // Unused in this backward: contributes zero.
    TORCH_CHECK(grad.sizes().vec() == info.shape, who_, ": the gradient of '", info.fqn,
                "' has shape ", grad.sizes(), " but the parameter has shape ",
                at::IntArrayRef(info.shape),
                " (was PrepareGradientsForBackward called before backward?)");
    flat_grad.narrow(0, info.offset, info.numel).copy_(grad.reshape({-1}));
    RecordUseOnCurrentStream(grad);  // Made on compute, read here (the reduction's stream).
    params[i].param.mutable_grad() = at::Tensor();
  }
  at::Tensor reduced = layout_.sharded() ? at::empty({trainable.shard_numel}, flat_grad.options())
                                         : flat_grad;  // NO_SHARD reduces in place.
  // Without a replicate group to cross, every reduction all-reduces.
  const bool partial = hybrid() && !all_reduce;
  pending_ = Issue(std::move(flat_grad), reduced, !partial);
  pending_advances_ = 0;
  reduced_ = std::move(reduced);
  pending_is_partial_ = partial;
}

std::unique_ptr<PendingReduction> GradientReduction::Issue(at::Tensor flat_grad,
                                                           const at::Tensor& reduced,
                                                           bool all_reduce) {
  const bool scatter_sum = options_.sum_scatter && layout_.sharded();
  if (!hybrid() && !scatter_sum) {
    const CommHookContext context{group_, layout_.sharded(), unit_name_, options_.divide_factor};
    std::unique_ptr<PendingReduction> pending =
        hook_ != nullptr ? hook_->Reduce(context, std::move(flat_grad), reduced)
                         : DefaultCommHook().Reduce(context, std::move(flat_grad), reduced);
    TORCH_CHECK(pending != nullptr, who_, ": the comm hook '",
                hook_ != nullptr ? hook_->Name() : "default",
                "' returned no reduction (a synchronous hook returns CompletedReduction())");
    pending_is_hooks_ = true;
    return pending;
  }
  Collectives* replicate = hybrid() ? options_.replicate : nullptr;
  // The average over every rank holding a replica of this shard: divided as
  // DefaultCommHook divides, over both groups' ranks.
  const GradientDivisors divisors = GradientDivisorsFor(
      group_.world_size() * (replicate != nullptr ? replicate->world_size() : 1),
      options_.divide_factor);
  if (divisors.pre != 1) flat_grad.div_(divisors.pre);
  std::unique_ptr<CollectiveWork> work =
      scatter_sum         ? options_.sum_scatter(flat_grad, reduced)
      : layout_.sharded() ? group_.ReduceScatterTensor(reduced, flat_grad, ReduceOp::kSum)
                          : group_.AllReduce(flat_grad, ReduceOp::kSum);
  at::Tensor carry;
  if (all_reduce) carry = std::exchange(partial_, at::Tensor());
  TORCH_INTERNAL_ASSERT(!carry.defined() || carry.sizes() == reduced.sizes());
  pending_is_hooks_ = false;
  return std::make_unique<ShardGroupReduction>(std::move(work), std::move(flat_grad), reduced,
                                               replicate, options_.replicate_sum, divisors.post,
                                               !all_reduce, std::move(carry));
}

void GradientReduction::Advance() {
  if (!pending()) return;
  if (pending_is_hooks_ && pending_advances_ > 0) return;
  ++pending_advances_;
  try {
    pending_->Advance();
  } catch (...) {
    pending_.reset();
    reduced_ = at::Tensor();
    throw;
  }
}

bool GradientReduction::Finish() {
  if (!pending()) return false;
  std::unique_ptr<PendingReduction> pending = std::move(pending_);
  at::Tensor reduced = std::move(reduced_);
  pending->Wait();
  pending.reset();
  at::NoGradGuard no_grad;
  if (pending_is_partial_) {
    // Kept in the reduction's dtype on the compute device until the
    // all-reduce that takes it; the sharded gradient stays as it was, but
    // Start took it out of .grad.
    partial_ = partial_.defined() ? partial_.add_(reduced) : reduced;
    return sharded_grad_.defined();
  }
  if (reduced.scalar_type() != options_.grad_dtype) reduced = reduced.to(options_.grad_dtype);
  if (placement_.offload) {
    // Accumulated on the compute device, in stream order: nothing here
    // waits for the device (see "CPU offload" in flat_param_handle.h).
    if (sharded_grad_.defined()) {
      reduced.add_(placement_.OnComputeDevice(sharded_grad_, sharded_grad_.scalar_type()));
    } else {
      AllocateShardedGrad(placement_.EmptyOnHost(reduced.numel(), reduced.scalar_type()));
    }
    sharded_grad_.copy_(reduced, /*non_blocking=*/true);
  } else if (sharded_grad_.defined()) {
    sharded_grad_.add_(reduced);
  } else {
    AllocateShardedGrad(std::move(reduced));
  }
  return true;
}

}  // namespace fsdp
