#include "fsdp/comm_hooks.h"

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "fsdp/fsdp_options.h"

namespace fsdp {

double GradientPredivideFactor(int world_size) {
  int factor = 1;
  while (world_size % factor == 0 && world_size / factor > factor) factor *= 2;
  return factor;
}

namespace {

class Completed : public PendingReduction {
 public:
  void Wait() override {}
};

class Then : public PendingReduction {
 public:
  Then(std::unique_ptr<PendingReduction> first, std::function<void()> then)
      : then_(std::move(then)), first_(std::move(first)) {}

  void Advance() override { first_->Advance(); }
  void Wait() override {
    first_->Wait();
    first_.reset();
    std::function<void()> then = std::move(then_);
    then_ = nullptr;
    then();
  }

 private:
  std::function<void()> then_;  // Its tensors outlive `first_`'s wait.
  std::unique_ptr<PendingReduction> first_;
};

// The built-in reduction in flight: the shard group's collective, then
// (hybrid) the replicate group's all-reduce of this rank's shard.
class DefaultReduction : public PendingReduction {
 public:
  // `partial`: hybrid's all-reduce left out (CommHookContext::all_reduce).
  DefaultReduction(std::unique_ptr<CollectiveWork> shard_group_work, at::Tensor grad,
                   at::Tensor out, Collectives* replicate, double postdivide, bool partial,
                   at::Tensor add_before_all_reduce)
      : grad_(std::move(grad)),
        out_(std::move(out)),
        add_before_all_reduce_(std::move(add_before_all_reduce)),
        replicate_(replicate),
        postdivide_(postdivide),
        partial_(partial),
        shard_group_work_(std::move(shard_group_work)) {}

  void Advance() override {
    if (shard_group_work_ == nullptr) return;
    shard_group_work_->Wait();
    shard_group_work_.reset();
    grad_ = at::Tensor();  // The flat gradient is no longer read.
    if (replicate_ != nullptr && replicate_->world_size() > 1 && !partial_) {
      if (add_before_all_reduce_.defined()) {
        out_.add_(add_before_all_reduce_);
        add_before_all_reduce_ = at::Tensor();
      }
      // Only this rank's shard crosses shard groups.
      replicate_work_ = replicate_->AllReduce(out_, ReduceOp::kSum);
    }
  }

  void Wait() override {
    Advance();
    if (replicate_work_ != nullptr) {
      replicate_work_->Wait();
      replicate_work_.reset();
    }
    if (postdivide_ != 1 && !partial_) out_.div_(postdivide_);
    out_ = at::Tensor();
  }

 private:
  // Declared before the works, so that a destroyed reduction waits for
  // them before it lets go of their tensors.
  at::Tensor grad_;
  at::Tensor out_;
  at::Tensor add_before_all_reduce_;
  Collectives* const replicate_;
  const double postdivide_;
  const bool partial_;
  std::unique_ptr<CollectiveWork> shard_group_work_;
  std::unique_ptr<CollectiveWork> replicate_work_;
};

}  // namespace

std::unique_ptr<PendingReduction> CompletedReduction() { return std::make_unique<Completed>(); }

std::unique_ptr<PendingReduction> ReductionThen(std::unique_ptr<PendingReduction> first,
                                                std::function<void()> then) {
  return std::make_unique<Then>(std::move(first), std::move(then));
}

std::unique_ptr<PendingReduction> DefaultCommHook::Reduce(const CommHookContext& context,
                                                          at::Tensor grad, at::Tensor out) {
  Collectives* replicate = context.replicate_group;
  const bool partial = !context.all_reduce && replicate != nullptr && replicate->world_size() > 1;
  TORCH_CHECK(!context.add_before_all_reduce.defined() ||
                  (replicate != nullptr && context.all_reduce &&
                   context.add_before_all_reduce.sizes() == out.sizes()),
              "DefaultCommHook: add_before_all_reduce for unit '", context.unit,
              "' needs a replicate group, all_reduce and out's shape");
  const int world =
      context.group.world_size() * (replicate != nullptr ? replicate->world_size() : 1);
  // FSDP2 divides by a user's factor wholly before the sum.
  const double predivide =
      context.divide_factor ? *context.divide_factor : GradientPredivideFactor(world);
  const double postdivide = context.divide_factor ? 1 : world / predivide;
  if (predivide != 1) grad.div_(predivide);
  std::unique_ptr<CollectiveWork> work =
      context.sharded ? context.group.ReduceScatterTensor(out, grad, ReduceOp::kSum)
                      : context.group.AllReduce(grad, ReduceOp::kSum);
  return std::make_unique<DefaultReduction>(std::move(work), std::move(grad), std::move(out),
                                            replicate, postdivide, partial,
                                            context.add_before_all_reduce);
}

std::string LowPrecisionCommHook::Name() const {
  return absl::StrCat(DTypeName(dtype_), "_compress");
}

std::unique_ptr<PendingReduction> LowPrecisionCommHook::Reduce(const CommHookContext& context,
                                                               at::Tensor grad, at::Tensor out) {
  at::Tensor low = grad.to(ToScalarType(dtype_));
  at::Tensor low_out = context.sharded ? at::empty({out.numel()}, low.options()) : low;
  return ReductionThen(DefaultCommHook().Reduce(context, low, low_out),
                       [out, low_out]() mutable { out.copy_(low_out); });
}

}  // namespace fsdp
